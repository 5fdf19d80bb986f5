"""The per-fit protocol between rank 0 (`Driver`) and the other ranks (`serve`).

A session is one `model.fit` call:

1. SETUP: rank 0 broadcasts JSON (plan, model and compile configs for
   spawned workers, Keras settings, each rank's device, the list of state
   variables) and then the state itself (all model weights and optimizer
   variables) as one flat buffer. Each rank builds or checks its replica and
   the ranks agree on success with one all-reduce; a rank that failed reports
   why (class not registered, shapes differ) and rank 0 raises it.
2. TRAIN, once per batch: rank 0 broadcasts `[TRAIN, n, header, lr]`, a JSON
   header when the batch structure changed, and sends each rank its shard
   (`plan.shares_for(n)` samples, contiguous, in rank order) as one packed
   buffer. Every rank runs `ReplicaTrainer.step`; the workers send their
   predictions and loss (and what the step changed in the model's own metric
   trackers, `loss_trackers`) back to rank 0 right after their forward pass,
   and rank 0 updates Keras's metrics over the whole batch.
3. END: rank 0 broadcasts the History; every worker answers with a digest of
   each variable's bytes so rank 0 can confirm the replicas ended identical.

Example:

```python
driver = Driver(model, plan, comm, cluster, reporter, spawned=True)
driver.setup()
logs = driver.train_step(data)
driver.end(history)
```
"""

import itertools
import json
import math
import os
import traceback
import warnings

from autodist_keras.backends import loss_trackers
from autodist_keras.backends import replica_random
from autodist_keras.backends import torch_fusion
from autodist_keras.backends import torch_transport as tt
from autodist_keras.backends.torch_device import check_model_device
from autodist_keras.backends.torch_device import device_info
from autodist_keras.backends.torch_device import pin
from autodist_keras.backends.torch_device import unpin
from autodist_keras.backends.torch_shm import SharedSlots
from autodist_keras.backends.torch_shm_reduce import ReduceArea
from autodist_keras.backends.torch_state_watch import SCALAR_TYPES
from autodist_keras.backends.torch_state_watch import OptimizerSettingsWatch
from autodist_keras.backends.torch_state_watch import SentLearningRate
from autodist_keras.backends.torch_state_watch import StateWatch
from autodist_keras.backends.torch_state_watch import apply_settings
from autodist_keras.backends.torch_state_watch import build_as
from autodist_keras.backends.torch_state_watch import built_settings_changed
from autodist_keras.backends.torch_state_watch import callable_learning_rate_as_value
from autodist_keras.backends.torch_state_watch import decay_excluded
from autodist_keras.backends.torch_state_watch import exclude_from_decay
from autodist_keras.backends.torch_state_watch import has_callable_learning_rate
from autodist_keras.backends.torch_state_watch import learning_rate_holder
from autodist_keras.backends.torch_state_watch import note_built_settings
from autodist_keras.backends.torch_state_watch import use_sent_learning_rate
from autodist_keras.backends.torch_step import ReplicaTrainer
from autodist_keras.errors import BackendError
from autodist_keras.errors import WorkerError
from autodist_keras.lazy_tensorflow import tensorflow_left_unimported
from autodist_keras.stacklevel import user_stacklevel
from autodist_keras.strategies.auto import warn_if_batch_outgrows_plan

_session_ids = itertools.count(1)
SHM_ENV = "AUTODIST_KERAS_TORCH_SHM"
# "0" makes spawned CPU workers sum gradients through gloo instead of shared memory.
SHM_REDUCE_ENV = "AUTODIST_KERAS_TORCH_SHM_REDUCE"


# ------------------------------------------------------------------ helpers
def state_variables(model):
    """Variables a replica must share with rank 0: model weights, optimizer variables."""
    optimizer = getattr(model, "optimizer", None)
    opt_vars = list(optimizer.variables) if optimizer is not None else []
    return list(model.weights), opt_vars


def variable_metas(variables):
    return [[v.path, list(v.shape), str(v.dtype)] for v in variables]


def _value(v):
    return v.value.detach()


def checksums(model):
    """A digest of the exact bytes of each weight and optimizer variable.

    Returns:
        A uint8 tensor, 16 bytes (BLAKE2b) per variable: equal on two ranks
        exactly when their values are bit-identical.
    """
    import hashlib

    import torch

    weights, opt_vars = state_variables(model)
    # The raw bytes (as uint8): NumPy has no bfloat16.
    digests = b"".join(
        hashlib.blake2b(_value(v).to("cpu").contiguous().reshape(-1).view(torch.uint8)
                        .numpy().tobytes(), digest_size=16).digest()
        for v in weights + opt_vars
    )
    return torch.frombuffer(bytearray(digests), dtype=torch.uint8)


def custom_modules(model):
    """Modules outside Keras whose classes or functions the model uses."""
    objects = [model, getattr(model, "optimizer", None)]
    objects.extend(model._flatten_layers(include_self=False, recursive=True))
    objects.extend(loss for _, loss in _losses(model))
    modules = []
    for obj in objects:
        if obj is None or isinstance(obj, str):
            continue
        is_function = callable(obj) and not hasattr(obj, "get_config")
        module = getattr(obj, "__module__", None) if is_function else type(obj).__module__
        if module and not module.split(".")[0] in ("keras", "builtins") and module not in modules:
            modules.append(module)
    return modules


def _losses(model):
    """`[(where, loss), ...]`: the model's compiled loss objects, named for messages."""
    losses = model.loss
    if isinstance(losses, dict):
        return [(f"loss {k!r}", v) for k, v in losses.items()]
    if isinstance(losses, (list, tuple)):
        return [(f"loss {i}", v) for i, v in enumerate(losses)]
    return [("loss", losses)]


_MISSING = object()


def _plain(value):
    """Whether `value` is a plain setting (number, string, None, or a tuple of them)."""
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return isinstance(value, SCALAR_TYPES)


def _lost_settings(obj):
    """Constructor settings of `obj` that a rebuild from its Keras config changes.

    Compares the attributes named like the constructor's arguments (and the
    keyword arguments a Keras loss wrapper passes its function) of `obj` and of
    `deserialize(serialize(obj))`, where they are plain values.

    Returns:
        `["name=value (rebuilt: other)", ...]`, empty when nothing is lost or the
        object cannot be rebuilt here (`check_serializable` and the workers say why).
    """
    import inspect

    from keras.src.saving import serialization_lib

    try:
        with tensorflow_left_unimported():
            config = serialization_lib.serialize_keras_object(obj)
        rebuilt = serialization_lib.deserialize_keras_object(config, safe_mode=False)
        parameters = inspect.signature(type(obj).__init__).parameters.values()
    except Exception:  # noqa: BLE001  (reported elsewhere, with the right advice)
        return []
    def read(target, name):
        try:
            return getattr(target, name, _MISSING)
        except Exception:  # noqa: BLE001  (a property that cannot answer yet: not compared)
            return _MISSING

    pairs = [(p.name, read(obj, p.name), read(rebuilt, p.name))
             for p in parameters if p.name != "self"
             and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    mine, theirs = getattr(obj, "_fn_kwargs", None), getattr(rebuilt, "_fn_kwargs", None)
    if isinstance(mine, dict) and isinstance(theirs, dict):
        pairs += [(k, v, theirs.get(k, _MISSING)) for k, v in mine.items()]
    return [f"{name}={a!r} (rebuilt: {'not set' if b is _MISSING else repr(b)})"
            for name, a, b in pairs
            if a is not _MISSING and _plain(a) and b is not _MISSING and _plain(b) and a != b]


def check_config_round_trip(model):
    """Raises `BackendError` when the optimizer or a loss would lose settings in the workers.

    Spawned workers rebuild them from their Keras configs; a `get_config()`
    that leaves out a constructor argument (Keras's own `Huber` drops
    `delta`) would make every worker train with the default, silently.
    """
    objects = [("optimizer", getattr(model, "optimizer", None))] + _losses(model)
    for where, obj in objects:
        if obj is None or isinstance(obj, str) or not hasattr(obj, "get_config"):
            continue
        lost = _lost_settings(obj)
        if not lost:
            continue
        cls = type(obj).__name__
        if type(obj).__module__.split(".")[0] == "keras":
            advice = (f"Keras's own {cls}.get_config() leaves them out. Use a registered "
                      "function with the setting built in, e.g. "
                      "`@keras.saving.register_keras_serializable()` over "
                      "`def my_loss(y_true, y_pred): return keras.losses.huber(y_true, "
                      "y_pred, delta=0.25)`.")
        else:
            advice = (f"Return every constructor argument from {cls}.get_config(), as "
                      "Keras's own saving needs too.")
        raise BackendError(
            f"The PyTorch runtime rebuilds the {where} in each spawned worker from its "
            f"Keras config, and that config does not keep {', '.join(lost)}: the workers "
            f"would train with other settings than yours. {advice} Received: {cls} with "
            f"config keys {sorted(obj.get_config())}"
        )


def check_serializable(model):
    """Raises `BackendError` when spawned workers could not rebuild `model`.

    Workers rebuild the model from its Keras config, so every class and function
    outside Keras must be registered with
    `@keras.saving.register_keras_serializable()` in a module they can import.
    """
    import sys

    import keras

    objects = [("model", model)]
    objects += [(f"layer {l.name!r}", l) for l in model._flatten_layers(include_self=False, recursive=True)]
    objects.append(("optimizer", getattr(model, "optimizer", None)))
    objects += _losses(model)
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if isinstance(layer, keras.layers.Lambda):
            function = getattr(layer, "function", None)
            if getattr(function, "__name__", "") == "<lambda>":
                _check_lambda(layer.name, function)
            else:
                objects.append((f"function of Lambda layer {layer.name!r}", function))
    main = sys.modules.get("__main__")
    for where, obj in objects:
        if obj is None or isinstance(obj, str):
            continue
        target = obj if isinstance(obj, type) or (callable(obj) and not hasattr(obj, "get_config")) else type(obj)
        module = getattr(target, "__module__", "") or ""
        if module.split(".")[0] in ("keras", "builtins", "torch"):
            continue
        name = getattr(target, "__qualname__", repr(target))
        if getattr(target, "__name__", "") == "<lambda>":
            raise BackendError(
                f"The {where} is a lambda, which spawned workers cannot rebuild. "
                "Define it as a named function decorated with "
                "@keras.saving.register_keras_serializable(). "
                f"Received: {target!r}"
            )
        if module == "__main__" and not getattr(main, "__file__", None):
            # Checked first: registering it in the session would not help.
            raise BackendError(
                f"The {where} uses {name}, defined in an interactive session (a notebook, "
                "`python -c`); spawned worker processes cannot import it. Move it into a "
                "module (a .py file), decorate it with "
                "@keras.saving.register_keras_serializable() there, and import it from "
                f"there. Received: __main__.{name}"
            )
        if "<locals>" in name and _registered_only_in_this_run(target, module, name, main):
            # Registered when the function ran, in this process only: a worker
            # imports the module without running that function.
            function = name.split(".<locals>")[0]
            raise BackendError(
                f"The {where} uses {name.split('.')[-1]}, defined inside the function "
                f"{function}() of module {module!r}, so it is registered with Keras only "
                "where that function runs: the PyTorch runtime's worker processes import "
                "the module without running it and cannot rebuild the model. Define the "
                "class (or function) at the top level of the module, decorated with "
                "@keras.saving.register_keras_serializable(), and keep training under "
                f"`if __name__ == '__main__':`. Received: {module}.{name}"
            )
        registered = keras.saving.get_registered_name(target)
        if keras.saving.get_registered_object(registered) is not target:
            raise BackendError(
                f"The {where} uses {name} (module {module!r}), which is not registered "
                "with Keras, so the PyTorch runtime's worker processes cannot rebuild the "
                "model. Decorate it with @keras.saving.register_keras_serializable() in a "
                "module the workers import (or at the top level of your script, with "
                "training under `if __name__ == '__main__':`). "
                f"Received: {module}.{name}"
            )


def _registered_only_in_this_run(target, module, qualname, main):
    """Whether a class (or function) defined inside a function was made by a call
    that worker processes will not repeat when they import its module.

    Certain when that function is still running (the fit was called from inside
    it, `main()` say); likely when it lives in the main script and the script
    keeps no top-level name for it (the training code under the main guard made
    it). A class a factory made while its module was imported (kept in a dict,
    say) is made again in each worker, so it passes.
    """
    import inspect
    import sys

    function = qualname.split(".<locals>")[0].split(".")[-1]
    home = sys.modules.get(module)
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if (frame.f_code.co_name == function and home is not None
                    and frame.f_globals is vars(home)):
                return True
            frame = frame.f_back
    finally:
        del frame
    if home is None or home is not main:
        return False
    return not any(value is target for value in vars(home).values())


def prediction_leaves(y_pred):
    """The leaves of `y_pred`, then the Keras masks of those that carry one.

    Returns:
        `(spec, tensors, masked)`: the tree's spec, the tensors to send, and
        the indices of the leaves whose masks follow them (in that order).
    """
    from keras.src.backend import get_keras_mask

    spec, leaves = tt.flatten_tree(y_pred)
    masks = [get_keras_mask(t) for t in leaves]
    masked = [j for j, m in enumerate(masks) if m is not None]
    return spec, leaves + [masks[j] for j in masked], masked


def _prediction_layout(y_pred):
    """`(spec, metas, masked)` of the predictions as workers send them."""
    spec, tensors, masked = prediction_leaves(y_pred)
    return spec, [tt.leaf_meta(t) for t in tensors], masked


def _check_lambda(layer_name, function):
    """A `Lambda` layer's lambda reaches the workers as bytecode, without the
    script's globals or its closure: one that uses them (`ops.square`) would
    fail there, with an error about output shapes."""
    import inspect

    try:
        names = inspect.getclosurevars(function)
    except (TypeError, ValueError):
        return
    outside = sorted(set(names.globals) | set(names.nonlocals))
    if outside:
        raise BackendError(
            f"The Lambda layer {layer_name!r} runs a lambda that uses names from its "
            f"surroundings ({', '.join(outside)}); Keras saves a lambda's code without them, "
            "so the PyTorch runtime's worker processes cannot run it. Write the lambda's "
            "body as a named function (or a custom layer) decorated with "
            "@keras.saving.register_keras_serializable() at the top level of your script "
            "or module. "
            f"Received: {function!r} using {outside}"
        )


def _json_default(o):
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:
        pass
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"Object of type {type(o).__name__} is not JSON serializable")


def history_payload(history):
    """The END payload: rank 0's History, or `completed: False` when its fit failed."""
    if history is None:
        return {"history": {}, "epoch": [], "params": {}, "completed": False}
    return json.loads(json.dumps(
        {"history": history.history, "epoch": list(history.epoch), "params": dict(history.params or {})},
        default=_json_default,
    ))


def format_exception(exc):
    """`Type: message` plus the last lines of the traceback."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    lines = tb.strip().splitlines()
    return f"{type(exc).__name__}: {exc}\n" + "\n".join(lines[-12:])


class Reporter:
    """How a worker tells rank 0 that it failed, and how rank 0 finds out.

    Spawned workers report through a pipe to rank 0's monitor
    (`torch_pool.WorkerPool`); torchrun ranks write to the shared store.
    """

    def report(self, rank, message, secondary):  # pragma: no cover - interface
        raise NotImplementedError

    def diagnose(self, failure=None, wait_s=5.0):  # pragma: no cover - interface
        raise NotImplementedError


class StoreReporter(Reporter):
    """Failure reports through the process group's store (torchrun ranks)."""

    def __init__(self, store, world_size, prefix="autodist_keras/errors"):
        self.store = store
        self.world_size = world_size
        self.prefix = prefix

    def report(self, rank, message, secondary):
        try:
            self.store.set(f"{self.prefix}/{rank}", json.dumps({"message": message, "secondary": secondary}))
        except Exception:  # noqa: BLE001 - the store may be gone with rank 0
            pass

    def diagnose(self, failure=None, wait_s=5.0):
        import time

        deadline = time.monotonic() + wait_s
        found = {}
        while True:
            for r in range(1, self.world_size):
                key = f"{self.prefix}/{r}"
                try:
                    if r not in found and self.store.check([key]):
                        found[r] = json.loads(self.store.get(key).decode("utf-8"))
                except Exception:  # noqa: BLE001
                    pass
            primary = [r for r, v in found.items() if not v.get("secondary")]
            if primary:
                r = min(primary)
                return WorkerError(r, found[r]["message"])
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        if found:
            r = min(found)
            return WorkerError(r, found[r]["message"])
        peer = getattr(failure, "peer", None)
        if peer is None and self.world_size == 2:
            peer = 1  # rank 0's only peer
        return WorkerError(
            peer if peer is not None else "unknown",
            f"a peer stopped answering ({failure}); no rank reported an error (a process "
            "killed or hung). Check the logs of the other ranks.",
        )


# ------------------------------------------------------------------ rank 0
class Driver:
    """Rank 0's side of a session: drives the workers from inside `model.fit`.

    Args:
        model: The user's model (replica 0).
        plan: The data-parallel `Plan`; replica `r` runs on rank `r`.
        comm: Rank 0's `Comm`.
        cluster: The `Cluster` (for each replica's device).
        reporter: How to learn why a worker failed.
        spawned: True when the workers are processes this library spawned (they
            rebuild the model from its config); False under torchrun (every
            rank built the model from the same script).
        timeout_s: Seconds an operation may wait for a worker.
        wake: Optional callable run just before SETUP is sent (spawned
            workers wait for it between fits).
        op_fusion: `(policy, compiler)`: AutoStrategy's `op_fusion` and
            `op_fusion_compiler` options; rank 0 decides from them whether the
            plan's op-fusion regions are compiled, and the workers follow.
    """

    def __init__(self, model, plan, comm, cluster, reporter, spawned, timeout_s, wake=None,
                 op_fusion=("auto", torch_fusion.DEFAULT_COMPILER)):
        if len(plan.replicas) != comm.world_size:
            raise BackendError(
                f"The plan has {len(plan.replicas)} replicas but {comm.world_size} "
                "processes run (WORLD_SIZE under torchrun). Start one process per "
                "planned device, or plan for the devices you launch on. "
                f"Received: plan devices {plan.devices}"
            )
        self.op_fusion = op_fusion  # (policy, torch.compile backend)
        self.model = model
        self.plan = plan
        self.comm = comm
        self.cluster = cluster
        self.reporter = reporter
        self.spawned = spawned
        self.timeout_s = timeout_s
        self.wake = wake
        self.session_id = next(_session_ids)
        self.devices = [device_info(cluster.device(r.device)) for r in plan.replicas]
        self.trainer = None
        self._watch = None  # a StateWatch over the weights and optimizer variables, after SETUP
        self._settings = None  # an OptimizerSettingsWatch over rank 0's optimizer, after SETUP
        self.in_step = False
        self.in_sync = None
        self.replica_checksums = None
        self._header = None
        self._ypred = None  # (spec, metas, masked leaves) of the model's predictions
        self._ypred_inputs = None  # the input metas `_ypred` was computed for
        self._layouts = {}
        # Spawned workers share rank 0's machine: shards go through shared memory
        # (torch_shm) unless AUTODIST_KERAS_TORCH_SHM=0.
        self._use_shm = spawned and os.environ.get(SHM_ENV, "1") != "0"
        # ... and, on CPUs, sum gradients there too (torch_shm_reduce) unless
        # AUTODIST_KERAS_TORCH_SHM_REDUCE=0.
        self._use_shm_reduce = (spawned and comm.grad_backend == "gloo"
                                and os.environ.get(SHM_REDUCE_ENV, "1") != "0")
        # How gradients were summed: "shared_memory", "gloo" or "nccl".
        self.gradient_transport = comm.grad_backend
        self._slots = None
        self._slots_unlinked = True
        self.steps = 0

    # ----------------------------------------------------------- failures
    def _fail(self, failure):
        raise self.reporter.diagnose(failure) from None

    # -------------------------------------------------------------- setup
    def setup(self):
        """Sends the plan and state; every rank builds its replica. Raises on failure."""
        import keras

        model = self.model
        optimizer = model.optimizer
        note_built_settings(optimizer, model.trainable_variables)
        # Local checks first: nothing is sent if rank 0 cannot run the plan.
        self.trainer = ReplicaTrainer(model, self.comm, self.plan, self._nodes(), self._device_ranks())
        policy, compiler = self.op_fusion
        self.trainer.fusion = torch_fusion.for_plan(
            model, self.plan, [d["kind"] for d in self.devices], policy, compiler)
        # Slot reuse is safe because each step's gradient all-reduce orders the
        # ranks (torch_shm); a model with nothing to reduce sends messages.
        self._use_shm = self._use_shm and self.trainer.reducer.num_buckets > 0
        area = None
        if self._use_shm_reduce and self.trainer.reducer.num_buckets > 0:
            area = ReduceArea.create(self.trainer.reducer.shared_layout(), self.comm.world_size)
        only = loss_trackers.rank0_only_trackers(model)
        if only:
            warnings.warn(
                f"Metric(s) {only} of model {model.name!r} are updated inside the training "
                "step and are not sums or means (keras.metrics.Mean, Sum): the PyTorch "
                "runtime logs them from rank 0's rows only, not the whole batch's. For "
                "whole-batch values track a Mean (or Sum) of the per-sample value.",
                stacklevel=user_stacklevel(),
            )
        weights, opt_vars = state_variables(model)
        payload = {
            "session": self.session_id,
            "plan": self.plan.to_dict(),
            "devices": self.devices,
            "weights": variable_metas(weights),
            "optimizer_variables": variable_metas(opt_vars),
            # The plan names variables by rank 0's paths; a replica rebuilt from the
            # config may path them differently (a Sequential's layers lose its prefix).
            "trainable_paths": [v.path for v in model.trainable_weights],
            # Optimizer state outside its config (`exclude_from_weight_decay`),
            # as indices into "weights".
            "decay_excluded": decay_excluded(optimizer, weights),
            # The variables rank 0's optimizer was built for (indices into "weights"):
            # a layer frozen since, without compiling again, still has its slots.
            "optimizer_built_for": _built_for(optimizer, weights),
            # Settings that may decide its variables, changed since it was built.
            "optimizer_built_with": built_settings_changed(optimizer),
            "timeout_s": self.timeout_s,
            "profile_dir": self.trainer.profile.directory,
            # Rank 0 decided whether the plan's op-fusion regions are compiled.
            "op_fusion_compiler": self.trainer.fusion.compiler if self.trainer.fusion else None,
            # Where the workers sum gradients with rank 0 (None: the process group).
            "reduce_area": area.describe() if area is not None else None,
            # Each worker's own random streams (Dropout masks differ between replicas).
            "random": replica_random.rank0_streams(model),
            # Float elements of the custom metric trackers whose change every
            # worker sends after its loss (`loss_trackers`).
            "tracker_elements": self.trainer.trackers.size,
            "keras": {
                "floatx": keras.config.floatx(),
                "epsilon": keras.config.epsilon(),
                "image_data_format": keras.config.image_data_format(),
                "dtype_policy": keras.config.dtype_policy().name,
            },
        }
        if self.spawned:
            # A callable learning rate goes as its value (sent again before every step).
            with callable_learning_rate_as_value(optimizer):
                check_serializable(model)
                check_config_round_trip(model)
                from keras.src.saving import serialization_lib

                try:
                    with tensorflow_left_unimported():
                        model_config = serialization_lib.serialize_keras_object(model)
                except (NotImplementedError, TypeError, ValueError, RecursionError) as e:
                    said = " ".join(str(e).split()).split(". ")[0].rstrip(".")  # Keras's first sentence
                    raise BackendError(
                        "The PyTorch runtime rebuilds the model in each spawned worker process "
                        f"from its Keras config, and model {model.name!r} "
                        f"({type(model).__name__}) could not give one: {said}. Implement "
                        "get_config() on the class (returning its constructor's arguments, as "
                        "Keras's own saving needs too), or train it without AutoStrategy. "
                        f"Received: {type(e).__name__} from get_config()"
                    ) from e
                model_config.pop("compile_config", None)
                with tensorflow_left_unimported():
                    compile_config = dict(model.get_compile_config() or {})
                    compile_config["optimizer"] = serialization_lib.serialize_keras_object(
                        optimizer)
                for key in ("metrics", "weighted_metrics"):
                    compile_config.pop(key, None)
                payload["model"] = json.loads(json.dumps(model_config, default=_json_default))
                payload["compile"] = json.loads(json.dumps(compile_config, default=_json_default))
            payload["learning_rate_sent"] = (self._learning_rate()
                                             if has_callable_learning_rate(optimizer) else None)
            payload["modules"] = custom_modules(model)
            # State that is neither config nor variables (adapted lookup tables).
            payload["assets"] = layer_assets(model)
        # Trainable flags a config may not carry (a subclassed model's sublayers),
        # which spawned workers take; torchrun ranks, which froze their own
        # models, are checked against them (`check_trainable_flags`).
        payload["trainable_flags"] = trainable_flags(model)
        try:
            if self.wake is not None:
                self.wake()
            self.comm.broadcast_command(tt.CMD_SETUP, tt.json_length(payload))
            self.comm.broadcast_json(payload)
            state = tt.pack([_value(v) for v in weights + opt_vars])
            if state.numel():
                self.comm.broadcast(state, 0)
            status = self.comm.allreduce_max(0)
        except tt.CommFailure as failure:
            self._fail(failure)
        finally:
            if area is not None:
                area.unlink()  # every worker mapped it before agreeing on the status
        if status:
            raise self.reporter.diagnose(None)
        if area is not None:
            self.trainer.reducer.use_shared_memory(area)
            self.gradient_transport = "shared_memory"
        self.trainer.attach()
        self._watch = StateWatch(weights + opt_vars)
        self._settings = OptimizerSettingsWatch(optimizer)

    def _nodes(self):
        return [d["node"] for d in self.devices]

    def _device_ranks(self):
        return {d["name"]: r for r, d in enumerate(self.devices)}

    # -------------------------------------------------------------- train
    def _learning_rate(self):
        """The learning rate the workers set before this step (nan: theirs applies).

        A variable's value (a callback may have set it), or a callable learning
        rate's value now: the workers' optimizers hold a variable instead of the
        function (`callable_learning_rate_as_value`). A schedule is evaluated
        by every replica at its own, equal, `iterations`.
        """
        holder = learning_rate_holder(self.model.optimizer)
        lr = getattr(holder, "_learning_rate", None)
        if hasattr(lr, "assign"):
            return float(lr.numpy()) if hasattr(lr, "numpy") else float(lr)
        if has_callable_learning_rate(holder):
            return float(holder.learning_rate)
        return math.nan

    def _layout(self, n):
        """`(shares, offsets)` of a global batch of `n` samples (cached per `n`)."""
        layout = self._layouts.get(n)
        if layout is None:
            warn_if_batch_outgrows_plan(self.plan, n)
            shares = self.plan.shares_for(n)
            offsets = [0]
            for s in shares:
                offsets.append(offsets[-1] + s)
            layout = self._layouts[n] = (shares, offsets)
        return layout

    def _shared_slots(self, metas, n):
        """The shared-memory slots big enough for a batch of `n` rows, or None
        when shards travel as messages (see `torch_shm`)."""
        if not self._use_shm:
            return None
        need = tt.packed_size(metas, rows=n)
        if self._slots is None or self._slots.slot_bytes < need:
            from autodist_keras.backends.torch_shm import SharedSlots

            if self._slots is not None:
                self._slots.unlink()
            self._slots = SharedSlots.create(tt.padded_size(need))
            if self._slots is None:  # no usable /dev/shm: send messages from now on
                self._use_shm = False
                return None
            self._slots_unlinked = False
        return self._slots

    def train_step(self, data):
        """One distributed training step; returns Keras's logs (global metrics)."""
        import torch
        from keras.src.trainers.data_adapters import data_adapter_utils

        profile = self.trainer.profile
        profile.begin()
        batch = data[0]
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(batch)
        spec, leaves = tt.flatten_tree((x, y, sample_weight))
        leaves = [tt.to_torch(leaf) for leaf in leaves]
        if not leaves or leaves[0].dim() == 0:
            raise BackendError(
                "The PyTorch runtime splits each batch along its first dimension and "
                "found no batched tensor. Pass arrays, datasets or loaders of batched "
                f"tensors. Received: {type(x).__name__}"
            )
        n = int(leaves[0].shape[0])
        for leaf in leaves:
            if leaf.dim() == 0 or int(leaf.shape[0]) != n:
                raise BackendError(
                    "Every input, target and sample-weight tensor of a batch must have "
                    f"the same first (batch) dimension to be split across replicas. "
                    f"Received: shapes {[tuple(t.shape) for t in leaves]}"
                )
        shares, offsets = self._layout(n)
        header = {"spec": spec, "metas": [tt.leaf_meta(t) for t in leaves]}
        world = self.comm.world_size
        slots = self._shared_slots(header["metas"], n) if n > shares[0] else None
        slot = -1
        if slots is not None:
            header["shm"] = slots.describe()
            slot = self.steps % 2
            # The workers' rows of every leaf, in `pack`'s layout for n rows.
            tt.pack_into(slots.slot(slot), leaves, start=shares[0])
        elif self._header is not None and "shm" in self._header:
            header["shm"] = self._header["shm"]  # unchanged mapping, shards by message
        header_len = 0 if header == self._header else tt.json_length(header)
        self.in_step = True
        sends, recvs, done = [], {}, {}
        try:
            self._send_changed_state()
            self.comm.broadcast_command(tt.CMD_TRAIN, n, header_len, self._learning_rate(), slot)
            if header_len:
                self.comm.broadcast_json(header)
                self._header = header
            if slot < 0:
                for r in range(1, world):
                    if shares[r] > 0:
                        shard = tt.pack([t[offsets[r]:offsets[r + 1]] for t in leaves])
                        sends.append((self.comm.isend(shard, r, tag=1), r))
            own = tt.unflatten_tree(spec, [t[:shares[0]] for t in leaves])
            profile.mark("sent")

            def post_receives(y_pred, loss):
                # The predictions' shapes beyond the batch dimension may change
                # from batch to batch (sequences padded per batch): they are
                # taken from this step's own predictions, or from a one-row
                # forward pass when rank 0 has no rows, whenever the inputs' change.
                if y_pred is not None:
                    self._ypred = _prediction_layout(y_pred)
                elif self._ypred is None or self._ypred_inputs != header["metas"]:
                    self._ypred = self._predict_spec(leaves, spec)
                self._ypred_inputs = header["metas"]
                metas = self._ypred[1]
                for r in range(1, world):
                    if shares[r] > 0:
                        size = tt.packed_size(metas, rows=shares[r]) + extras_bytes
                        buf = torch.empty(size, dtype=torch.uint8)
                        recvs[r] = (self.comm.irecv(buf, r, tag=2), buf)

            def global_metrics():
                # Runs while the gradient collectives are in flight: the metrics
                # need only the predictions, which every rank sent after its
                # forward pass, so rank 0 computes them instead of waiting.
                self._restore_loss_metrics(saved)
                if shares[0] == 0:
                    post_receives(None, None)
                for work, r in sends:
                    self.comm.wait(work, peer=r)
                profile.mark("sends_done")
                preds, losses, deltas = [], [], []
                ypred_spec, metas, masked = self._ypred
                if shares[0] > 0:
                    preds.append([t.detach() for t in prediction_leaves(y_pred0[0])[1]])
                    losses.append((shares[0], float(y_pred0[1].detach())))
                    if trackers.size:
                        deltas.append(trackers.delta * (shares[0] / n))
                for r in range(1, world):
                    if shares[r] > 0:
                        work, buf = recvs[r]
                        self.comm.wait(work, peer=r)
                        parts = tt.unpack(buf, metas, rows=shares[r])
                        extras = buf[tt.packed_size(metas, rows=shares[r]):][:extras_bytes]
                        extras = extras.view(torch.float64)
                        preds.append(parts)
                        losses.append((shares[r], float(extras[0])))
                        if trackers.size:
                            deltas.append(extras[1:] * (shares[r] / n))
                profile.mark("predictions")
                try:
                    # Custom trackers: one update of the whole batch (`loss_trackers`).
                    trackers.combine(deltas)
                    done["logs"] = self._metrics(x, y, sample_weight, ypred_spec, masked, preds,
                                                 losses, n)
                except Exception as e:  # noqa: BLE001 - raised once the step is complete
                    done["error"] = e
                profile.mark("metrics")

            y_pred0 = [None, None]
            trackers = self.trainer.trackers
            # The loss (and custom trackers' change) after each worker's predictions.
            extras_bytes = tt.padded_size(8 * (1 + trackers.size))

            def after_forward(y_pred, loss):
                y_pred0[:] = [y_pred, loss]
                post_receives(y_pred, loss)

            saved = self._save_loss_metrics()
            self.trainer.step(
                own[0], own[1], own[2], shares[0], n,
                after_forward=after_forward if shares[0] > 0 else None,
                before_wait=global_metrics,
            )
        except tt.CommFailure as failure:
            self._fail(failure)
        self._watch.mark()  # the step's own writes are the workers' too
        self.in_step = False
        self.steps += 1
        if slots is not None and not self._slots_unlinked:
            # Every worker mapped the file while reading this step's header.
            slots.unlink()
            self._slots_unlinked = True
        profile.end()
        if "error" in done:
            raise done["error"]
        return done["logs"]

    def _send_changed_state(self):
        """Sends the workers the variables and optimizer settings rank 0 changed
        since its last step.

        Callbacks run between steps on rank 0 only: `set_weights` in
        `on_epoch_end`, `EarlyStopping(restore_best_weights=True)`, a new
        learning rate, a new `optimizer.momentum`. Without this the workers
        would go on from their old values (`torch_state_watch`).
        """
        changed = self._watch.changed()
        settings = self._settings.changed()
        if not changed and not settings:
            return
        payload = {"indices": changed, "optimizer": settings}
        self.comm.broadcast_command(tt.CMD_STATE, tt.json_length(payload))
        self.comm.broadcast_json(payload)
        if changed:
            self.comm.broadcast(tt.pack([_value(self._watch.variables[i]) for i in changed]), 0)
        self._watch.mark()
        self._settings.mark()

    def _predict_spec(self, leaves, spec):
        import torch

        sample = tt.unflatten_tree(spec, [t[:1] for t in leaves])
        with torch.no_grad():
            y_pred = self.model(sample[0], training=False)
        return _prediction_layout(y_pred)

    def _loss_metrics(self):
        compile_loss = getattr(self.model, "_compile_loss", None)
        return list(compile_loss.metrics) if compile_loss is not None else []

    def _save_loss_metrics(self):
        return [[_value(v).clone() for v in m.variables] for m in self._loss_metrics()]

    def _restore_loss_metrics(self, saved):
        for metric, values in zip(self._loss_metrics(), saved):
            for v, value in zip(metric.variables, values):
                v.assign(value)

    def _metrics(self, x, y, sample_weight, ypred_spec, masked, preds, losses, n):
        import torch
        from keras.src.backend import set_keras_mask

        model = self.model
        device = None
        params = [v.value for v in model.trainable_weights]
        if params:
            device = params[0].device
        columns = list(zip(*preds))
        full = [torch.cat(list(col), dim=0) for col in columns]
        if device is not None and device.type != "cpu":
            full = [t.to(device) for t in full]
        # The leaves come first, then the Keras masks of the masked ones: the
        # metrics and per-output losses of a masked output read its mask.
        leaves = full[:len(full) - len(masked)]
        for j, mask in zip(masked, full[len(leaves):]):
            set_keras_mask(leaves[j], mask)
        y_pred = tt.unflatten_tree(ypred_spec, leaves)
        global_loss = sum(share * value for share, value in losses) / float(n)
        with torch.no_grad():
            model._loss_tracker.update_state(global_loss, sample_weight=n)
            if self._loss_metrics():
                model._compile_loss(y, y_pred, sample_weight)
            return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    # ---------------------------------------------------------------- end
    def release_shared_memory(self):
        """Drops rank 0's mappings of the session's shared files (shard slots,
        gradient area) once no worker uses them any more.

        `end` does it as the session ends; when a failed fit discards the
        workers instead, the adapter calls this: the files are unlinked as soon
        as every rank has mapped them, but a mapping keeps holding its
        `/dev/shm` space (20 MiB for a 1.3M-parameter model) until it is
        dropped. Calling it again does nothing.
        """
        if self._slots is not None:
            self._slots.close()
        if self.trainer is not None:
            self.trainer.reducer.release_shared_memory()

    def end(self, history):
        """Ends the session: sends the History, checks the replicas agree."""
        import torch

        if self._slots is not None:
            self._slots.close()  # every worker has read its last rows
        if self.trainer is not None:
            self.trainer.detach()
            self.trainer.profile.save({"plan_shares": [r.batch_share for r in self.plan.replicas]})
        payload = history_payload(history)
        try:
            if self._watch is not None:
                self._send_changed_state()  # e.g. EarlyStopping's restored best weights
            self.comm.broadcast_command(tt.CMD_END, tt.json_length(payload))
            self.comm.broadcast_json(payload)
            own = checksums(self.model)
            received = {}
            for r in range(1, self.comm.world_size):
                buf = torch.empty(own.numel(), dtype=torch.uint8)
                received[r] = (self.comm.irecv(buf, r, tag=3), buf)
            for r, (work, buf) in received.items():
                self.comm.wait(work, peer=r)
        except tt.CommFailure as failure:
            self._fail(failure)
        if self.trainer is not None:  # every worker has sent its last gradients
            self.trainer.reducer.release_shared_memory()
        self.replica_checksums = {0: own.tolist()}
        self.replica_checksums.update({r: buf.tolist() for r, (_, buf) in received.items()})
        self.in_sync = all(bool(torch.equal(own, buf)) for _, buf in received.values())
        if history is not None and not self.in_sync:
            warnings.warn(_differ_message(self.model, own, [buf for _, buf in
                                                            received.values()]),
                          stacklevel=user_stacklevel())


def _differ_message(model, own, others):
    """The warning for replicas whose weights differ after fit, naming the variables."""
    weights, opt_vars = state_variables(model)
    variables = weights + opt_vars
    differ = [v for i, v in enumerate(variables)
              if any(not bool((own[16 * i:16 * i + 16] == other[16 * i:16 * i + 16]).all())
                     for other in others)]
    names = [getattr(v, "path", v.name) for v in differ]
    shown = f"{names[:5]}" + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    message = f"autodist_keras: after fit, the replicas' values of {shown} differ. "
    kept_by_fit = {id(v) for v in model.trainable_weights} | {id(v) for v in opt_vars}
    if differ and not any(id(v) in kept_by_fit for v in differ):
        return message + (
            "These are non-trainable variables that the model's layers assign during the "
            "training step: float ones are combined after each step as a batch-share-weighted "
            "mean (exact for moving averages of batch means, and for BatchNormalization's "
            "statistics; not for sums, maxima or a layer's own batch variance), integer ones are "
            "not synchronised and must advance the same on every rank (a step counter does; "
            "a count of rows does not: declare it with add_weight(..., aggregation=\"sum\") "
            "and the ranks' changes are added up). Rank 0's values, which you hold, are "
            "those of its own shards.")
    return message + (
        "Something changed rank 0's replica during fit in a way the runtime does not "
        "send to the workers: rank 0 sends the variables and the optimizer's config "
        "settings that callbacks change between steps, not other attributes of the "
        "optimizer or the layers; and the workers rebuilt the model, its layers and "
        "optimizer from their Keras configs, so a setting a custom get_config() leaves "
        "out (and the constructor does not restore) differs there. The weights you "
        "hold are rank 0's; the gradients "
        "the replicas summed came from different weights, so they may differ from "
        "one-device training.")


# ---------------------------------------------------------------- ranks > 0
def _finalize_like_rank0(model, payload):
    """What Keras's `fit` does to rank 0's weights after its last epoch, here too.

    Keras ends `fit` with `optimizer.finalize_variable_values` (with
    `use_ema=True` it swaps in the moving averages), so a worker does the same
    before the replicas' weights are compared.
    """
    import keras

    optimizer = getattr(model, "optimizer", None)
    epochs = (payload or {}).get("params", {}).get("epochs") or 0
    if isinstance(optimizer, keras.optimizers.Optimizer) and epochs > 0:
        optimizer.finalize_variable_values(model.trainable_weights)


def _apply_keras_settings(settings):
    import keras

    keras.config.set_floatx(settings["floatx"])
    keras.config.set_epsilon(settings["epsilon"])
    keras.config.set_image_data_format(settings["image_data_format"])
    keras.config.set_dtype_policy(settings["dtype_policy"])


def _rebuild_model(setup, rank):
    """Builds and compiles the replica a spawned worker trains."""
    import importlib

    import keras
    from keras.src.saving import serialization_lib

    for module in setup.get("modules", []):
        if module in ("__main__", "__mp_main__"):
            continue
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise BackendError(
                f"Worker rank {rank} cannot import module {module!r}, which defines "
                "classes or functions of the model. Make it importable from the worker "
                f"(installed, or on sys.path). Received: {e}"
            ) from None
    _apply_keras_settings(setup["keras"])
    try:
        model = serialization_lib.deserialize_keras_object(setup["model"], safe_mode=False)
        compile_config = serialization_lib.deserialize_keras_object(setup["compile"],
                                                                    safe_mode=False)
    except (TypeError, ValueError) as e:
        registered = setup["model"].get("registered_name")
        class_name = setup["model"].get("class_name") or ""
        if (registered and keras.saving.get_registered_object(registered) is not None
                and f"passed to {class_name}" in str(e)):
            advice = (
                f"Its class {registered!r} is registered, so its constructor did not accept "
                "the config Keras saved: give the class a get_config() that returns its "
                "constructor's arguments (and a from_config() if they need converting), "
                "as Keras's own saving needs too.")
        else:
            advice = ("Register custom layers, losses and optimizers with "
                      "@keras.saving.register_keras_serializable() in a module the workers "
                      "import.")
        said = str(e) if len(str(e)) <= 300 else str(e)[:300] + " ..."
        raise BackendError(
            f"Worker rank {rank} cannot rebuild the model from its config: {said} {advice} "
            f"Received: model class {setup['model'].get('class_name')!r}"
        ) from None
    load_layer_assets(model, setup.get("assets") or {}, rank)
    use_trainable_flags(model, setup.get("trainable_flags"))
    model.compile(**compile_config)
    if setup.get("learning_rate_sent") is not None:  # rank 0's is a function
        use_sent_learning_rate(model.optimizer, setup["learning_rate_sent"])
    if not model.built:
        raise BackendError(
            f"Worker rank {rank} rebuilt the model but could not build it (no build "
            "config). Build the model (call it on data or give it an Input) before fit. "
            f"Received: {type(model).__name__}"
        )
    built_for = setup.get("optimizer_built_for")
    weights = model.weights
    if built_for is None or any(i >= len(weights) for i in built_for):
        variables = model.trainable_variables
    else:
        variables = [weights[i] for i in built_for]
    build_as(model.optimizer, variables, setup.get("optimizer_built_with") or {})
    return model


def trainable_flags(model):
    """The `trainable` flags of `model`'s layers and weights, for `use_trainable_flags`.

    A functional or Sequential model's config holds each layer's `trainable`,
    but a subclassed model's config holds only its constructor's arguments:
    a sublayer frozen after construction (`model.backbone.trainable = False`,
    the transfer-learning recipe) came back trainable in a spawned worker,
    whose rebuilt replica then had more trainable variables than rank 0's and
    failed at SETUP ("This replica has 4 trainable variables but rank 0's
    model has 2"), until session 29.

    Args:
        model: Rank 0's model.

    Returns:
        A dict: `"layers"`, `[class name, trainable]` of every layer in
        `model._flatten_layers()` order (the model first, each layer before
        its sublayers); `"weights"`, the `trainable` flag of each of
        `model.weights`, in order.

    Example:

    >>> trainable_flags(model)  # doctest: +SKIP
    {'layers': [['WithBackbone', True], ['Functional', False], ...], 'weights': [...]}
    """
    return {
        "layers": [[type(layer).__name__, bool(layer.trainable)]
                   for layer in model._flatten_layers()],
        "weights": [bool(v.trainable) for v in model.weights],
    }


def use_trainable_flags(model, flags):
    """Gives a rebuilt replica rank 0's `trainable` flags (`trainable_flags`).

    Layers are set in `_flatten_layers()` order, each before its sublayers
    (setting a layer's flag sets its sublayers' too), then each weight's own
    flag. Nothing is changed when the replica's layers or weights do not line
    up with rank 0's (other classes or counts), nor for a layer whose
    `trainable` is a property without a setter: the SETUP checks that follow
    then name the difference.

    Args:
        model: The replica a spawned worker rebuilt from rank 0's config.
        flags: `trainable_flags(rank 0's model)`, or None (nothing to do).
    """
    if not flags:
        return
    layers = model._flatten_layers()
    if [type(layer).__name__ for layer in layers] != [name for name, _ in flags["layers"]]:
        return
    for layer, (_, trainable) in zip(layers, flags["layers"]):
        if bool(layer.trainable) != trainable:
            try:
                layer.trainable = trainable
            except AttributeError:
                # `trainable` overridden as a property without a setter: left as
                # the replica has it (the SETUP checks name a difference).
                continue
    weights = model.weights
    if len(weights) != len(flags["weights"]):
        return
    for variable, trainable in zip(weights, flags["weights"]):
        if bool(variable.trainable) != trainable:
            variable.trainable = trainable


def check_trainable_flags(model, flags, rank):
    """Checks that a torchrun rank's own model freezes the weights rank 0's does.

    Under torchrun every rank builds (and freezes) its model itself; rank 0's
    flags are not applied to it. A rank that froze other layers than rank 0
    with as many trainable variables (two layers of one shape, each rank
    freezing another one) summed its gradients into rank 0's other layer,
    silently: the weights went apart, and only a warning after fit said so.

    Args:
        model: This rank's own model (built by the user's script).
        flags: `trainable_flags(rank 0's model)`, or None (nothing to check).
        rank: This rank, for the message.

    Raises:
        BackendError: When a weight's `trainable` flag differs from rank 0's.

    Example:

    >>> check_trainable_flags(model, setup["trainable_flags"], rank=1)  # doctest: +SKIP
    """
    if not flags:
        return
    weights = model.weights
    theirs = flags.get("weights") or []
    if len(theirs) != len(weights):
        return  # `_check_metas` names a different number of weights
    differ = [(v.path, bool(v.trainable)) for v, trainable in zip(weights, theirs)
              if bool(v.trainable) != trainable]
    if not differ:
        return
    raise BackendError(
        f"Rank {rank}'s model freezes other weights than rank 0's: under torchrun each "
        "rank builds its own model, and every rank must set the same `trainable` flags "
        "(freeze the same layers, before compile) as rank 0, or the ranks would add up "
        "the gradients of different variables. Make the freezing code run on every "
        f"rank alike. Received: on rank {rank}, "
        + ", ".join(f"{path!r} trainable={mine}" for path, mine in differ[:6])
        + f"; rank 0 has the opposite ({len(differ)} weight(s) differ)"
    )


def _built_for(optimizer, weights):
    """Indices into `weights` of the variables `optimizer` was built for (None if unknown)."""
    built = getattr(optimizer, "_trainable_variables", None)
    if built is None:
        return None
    index = {id(v): i for i, v in enumerate(weights)}
    found = [index.get(id(v)) for v in built]
    return None if any(i is None for i in found) else found


def layer_assets(model):
    """The files each layer writes with Keras's `save_assets` (adapted vocabularies).

    Layers such as `IntegerLookup`, `StringLookup` and `TextVectorization` keep
    what `adapt()` learned in a table that is neither in their config nor a
    variable; Keras's saving writes it as asset files, and so does this.

    Returns:
        A JSON-ready dict: layer index (in `model._flatten_layers()` order) ->
        {file name: base64 content}.
    """
    import base64
    import tempfile

    out = {}
    for index, layer in enumerate(model._flatten_layers(include_self=False)):
        if not hasattr(layer, "save_assets"):
            continue
        with tempfile.TemporaryDirectory(prefix="autodist_keras_assets_") as folder:
            layer.save_assets(folder)
            files = {}
            for name in sorted(os.listdir(folder)):
                with open(os.path.join(folder, name), "rb") as f:
                    files[name] = base64.b64encode(f.read()).decode("ascii")
        if files:
            out[str(index)] = {"layer": layer.name, "files": files}
    return out


def load_layer_assets(model, assets, rank):
    """Gives a rebuilt replica's layers the asset files of rank 0's (`layer_assets`)."""
    import base64
    import tempfile

    if not assets:
        return
    layers = list(model._flatten_layers(include_self=False))
    for index, entry in assets.items():
        layer = layers[int(index)] if int(index) < len(layers) else None
        if layer is None or layer.name != entry["layer"] or not hasattr(layer, "load_assets"):
            raise BackendError(
                f"Worker rank {rank} rebuilt the model, but its layer #{index} is not rank "
                f"0's {entry['layer']!r}, whose adapted state (assets) it must load. Every "
                "rank must build the same model. "
                f"Received: {getattr(layer, 'name', None)!r}"
            )
        with tempfile.TemporaryDirectory(prefix="autodist_keras_assets_") as folder:
            for name, content in entry["files"].items():
                with open(os.path.join(folder, os.path.basename(name)), "wb") as f:
                    f.write(base64.b64decode(content))
            layer.load_assets(folder)


def _check_metas(model, setup, rank):
    weights, opt_vars = state_variables(model)
    for kind, mine, theirs in (
        ("weights", variable_metas(weights), setup["weights"]),
        ("optimizer variables", variable_metas(opt_vars), setup["optimizer_variables"]),
    ):
        if len(mine) != len(theirs):
            hint = "" if kind == "weights" else (
                " A setting that decides which variables an optimizer makes (SGD's "
                "momentum, Adam's amsgrad, use_ema) changed after it was built and before "
                "this runtime first saw it (an optimizer built, or loaded, before its first "
                "fit here): compile again with a new optimizer.")
            raise BackendError(
                f"Rank {rank}'s replica has {len(mine)} {kind} but rank 0's has "
                f"{len(theirs)}; every rank must build the same model and optimizer.{hint} "
                f"Received: {[m[0] for m in mine][:6]} vs {[t[0] for t in theirs][:6]}"
            )
        for m, t in zip(mine, theirs):
            if list(m[1]) != list(t[1]) or m[2] != t[2]:
                raise BackendError(
                    f"Rank {rank}'s {kind} {m[0]!r} has shape {m[1]} ({m[2]}) but rank 0's "
                    f"{t[0]!r} has {t[1]} ({t[2]}); every rank must build the same model. "
                    f"Received: {m} vs {t}"
                )
    return weights + opt_vars


def serve(comm, reporter, model=None, on_model=None):
    """Runs one session on a rank > 0: SETUP, TRAIN steps, END.

    Args:
        comm: This rank's `Comm`.
        reporter: Where to report a setup failure.
        model: The replica (torchrun: the user's own model); None for spawned
            workers, which rebuild it from rank 0's config.
        on_model: Optional callable receiving the setup dict and model.

    Returns:
        `(model, history_payload)`; `model` is None when setup failed (the
        failure was reported and rank 0 raises it).
    """
    import torch

    rank = comm.rank
    command = comm.broadcast_command(timeout_s=tt.IDLE_TIMEOUT_S)
    if int(command[0]) != tt.CMD_SETUP:
        raise BackendError(
            f"Rank {rank} expected the SETUP command and got "
            f"{tt.COMMAND_NAMES.get(int(command[0]), command[0])}. Received: {command}"
        )
    setup = comm.broadcast_json(length=int(command[1]))
    from autodist_keras.strategies.plan import Plan

    plan = Plan.from_dict(setup["plan"])
    metas = [[m[2], m[1]] for m in setup["weights"] + setup["optimizer_variables"]]
    state = torch.empty(tt.packed_size(metas), dtype=torch.uint8)
    if state.numel():
        comm.broadcast(state, 0)
    token = None
    trainer = None
    status = 0
    try:
        token = pin(setup["devices"][rank])
        rebuilt = model is None
        if rebuilt:
            model = _rebuild_model(setup, rank)
        elif getattr(model, "optimizer", None) is None:
            raise BackendError(
                f"Rank {rank}'s model is not compiled; compile it inside strategy.scope() "
                "on every rank, as rank 0 does. Received: optimizer=None"
            )
        elif not model.weights and setup["weights"]:
            # Rank 0 builds a model at its first training batch; this rank has no
            # batch, as it runs rank 0's steps (`serve`), so it cannot.
            raise BackendError(
                f"Rank {rank}'s model has no weights yet: under torchrun (or `autodist-keras "
                "launch`) only rank 0 sees the training data, so a model that creates its "
                "weights at its first call (a subclassed model) must be built on every rank "
                "before fit: call it once on a batch of inputs, e.g. `model(x[:1])`, "
                "after compile. Received: 0 weights on this rank, "
                f"{len(setup['weights'])} on rank 0"
            )
        elif not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        variables = _check_metas(model, setup, rank)
        if not rebuilt:
            check_trainable_flags(model, setup.get("trainable_flags"), rank)
        exclude_from_decay(model.optimizer, [variables[i] for i in setup.get("decay_excluded", [])])
        check_model_device(model, setup["devices"][rank], rank)
        with torch.no_grad():
            for v, value in zip(variables, tt.unpack(state, metas)):
                v.assign(value)
            replica_random.use_rank_streams(model, setup["random"], rank)
        nodes = [d["node"] for d in setup["devices"]]
        device_ranks = {d["name"]: r for r, d in enumerate(setup["devices"])}
        trainer = ReplicaTrainer(model, comm, plan, nodes, device_ranks,
                                 paths=setup.get("trainable_paths"))
        expected = setup.get("tracker_elements", 0)
        if trainer.trackers.size != expected:
            raise BackendError(
                f"Rank {rank}'s model has {trainer.trackers.size} float elements in its own "
                f"metric trackers (model.metrics other than the compiled ones) but rank 0's "
                f"has {expected}; every replica must create the same metrics. Received: "
                f"{[v.path for v in trainer.trackers.variables]}"
            )
        trainer.profile.directory = setup.get("profile_dir")
        if setup.get("reduce_area"):
            trainer.reducer.use_shared_memory(
                ReduceArea.open(setup["reduce_area"], trainer.reducer.shared_layout()))
        if setup.get("op_fusion_compiler"):
            from autodist_keras.fusion.op_fusion import regions_for

            trainer.fusion = torch_fusion.TorchFusionRegions(
                model, regions_for(plan), compiler=setup["op_fusion_compiler"])
        if on_model is not None:
            on_model(setup, model)
    except Exception as e:  # noqa: BLE001 - reported to rank 0, which raises it
        status = 1
        reporter.report(rank, format_exception(e), secondary=False)
    status = comm.allreduce_max(status)
    if status:  # rank 0 raises the reported error; no END follows
        unpin(token)
        return None, None
    trainer.attach()
    header = None
    slots = None  # shared-memory batch slots (spawned workers), from a header
    rows = {}  # global batch size -> (first row, number of rows) of this rank
    learning_rate = None  # the last value rank 0 sent (only rank 0's commands change it here)
    profile = trainer.profile
    try:
        while True:
            profile.begin()
            command = comm.broadcast_command(timeout_s=tt.IDLE_TIMEOUT_S)
            profile.mark("command")
            kind = int(command[0])
            if kind == tt.CMD_END:
                payload = comm.broadcast_json(length=int(command[1]))
                trainer.detach()
                _finalize_like_rank0(model, payload)
                profile.save()
                comm.wait(comm.isend(checksums(model), 0, tag=3), peer=0)
                return model, payload
            if kind == tt.CMD_STATE:
                _receive_state(comm, model, variables, metas, int(command[1]))
                profile.end()
                continue
            if kind != tt.CMD_TRAIN:
                raise BackendError(f"Rank {rank} got an unknown command. Received: {command}")
            n, header_len, lr, slot = int(command[1]), int(command[2]), command[3], int(command[4])
            if header_len:
                header = comm.broadcast_json(length=header_len)
                described = header.get("shm")
                if described and (slots is None or slots.path != described["path"]):
                    slots = SharedSlots.open(described)
            if lr != learning_rate:  # assigning (or reading) the variable costs ~0.1 ms
                _set_learning_rate(model, lr)
                learning_rate = lr
            if n not in rows:
                shares = plan.shares_for(n)
                rows[n] = (sum(shares[:rank]), shares[rank])
            start, share = rows[n]
            shard = (None, None, None)
            if share > 0:
                if slot >= 0:
                    if slots is None:
                        raise BackendError(
                            f"Rank {rank} was told to read its shard from shared memory "
                            "but no shared slots were described in the batch header. "
                            f"Received: slot {slot}"
                        )
                    # Views of the workers' rows that rank 0 wrote into the slot.
                    full = tt.unpack(slots.slot(slot), header["metas"], rows=n)
                    leaves = [t[start:start + share] for t in full]
                else:
                    buf = torch.empty(tt.packed_size(header["metas"], rows=share), dtype=torch.uint8)
                    comm.wait(comm.irecv(buf, 0, tag=1), peer=0)
                    leaves = tt.unpack(buf, header["metas"], rows=share)
                shard = tt.unflatten_tree(header["spec"], leaves)
            profile.mark("shard")
            sent = []

            def send_predictions(y_pred, loss):
                _, leaves, _ = prediction_leaves(y_pred)
                if trainer.trackers.size:
                    # The loss, then what this shard changed in the custom trackers.
                    loss_t = torch.cat([loss.detach().reshape(1).double(),
                                        trainer.trackers.delta])
                else:
                    loss_t = torch.tensor([float(loss.detach())], dtype=torch.float64)
                payload = tt.pack([t.detach() for t in leaves] + [loss_t])
                sent.append(comm.isend(payload, 0, tag=2))

            trainer.step(shard[0], shard[1], shard[2], share, n, after_forward=send_predictions)
            for work in sent:
                comm.wait(work, peer=0)
            profile.mark("sent")
            profile.end()
    finally:
        trainer.detach()
        unpin(token)


def _receive_state(comm, model, variables, metas, length):
    """A worker takes the variables and optimizer settings rank 0 changed between steps."""
    import torch

    payload = comm.broadcast_json(length=length)
    apply_settings(model.optimizer, payload.get("optimizer") or {})
    indices = payload["indices"]
    if not indices:
        return
    chosen = [metas[i] for i in indices]
    buf = torch.empty(tt.packed_size(chosen), dtype=torch.uint8)
    comm.broadcast(buf, 0)
    with torch.no_grad():
        for i, value in zip(indices, tt.unpack(buf, chosen)):
            variables[i].assign(value)


def _set_learning_rate(model, lr):
    """Sets the optimizer's learning rate to rank 0's (`serve` calls it only on a change)."""
    if lr is None or math.isnan(lr):
        return
    variable = getattr(learning_rate_holder(model.optimizer), "_learning_rate", None)
    if hasattr(variable, "assign"):
        variable.assign(lr)
    elif isinstance(variable, SentLearningRate):
        variable.value = lr
