"""Runs a data-parallel Plan inside `model.fit` on the PyTorch Keras backend.

One process per planned device. The user's process is rank 0: it keeps Keras's
own `fit` loop (progress bar, callbacks, History, validation) and its model is
replica 0. At the first training step the adapter asks the strategy for the
plan and, for a plan with several replicas, starts the other ranks:

- locally (`python train.py`): ranks 1..n-1 are spawned worker processes
  (`torch_pool`), kept for later fits of the same process;
- under `torchrun` (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set), every
  rank runs the user's script; on ranks > 0, `fit` serves rank 0's commands
  (their own data is ignored) and returns rank 0's History. After fit every
  rank holds the trained weights.

Each step rank 0 splits the batch by `plan.shares_for(n)`, sends the shards,
and every rank trains on its shard with planned bucketed gradient reduction
(`torch_session`, `torch_step`, `torch_reducer`). `evaluate`, `predict` and
the validation inside `fit` run on rank 0 alone (single device), on the
trained weights.

Example:

```python
strategy = AutoStrategy(strategy="proportional", cluster=Cluster.cpu_testbed())
with strategy.scope():
    model = zoo.mlp()
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
model.fit(x, y, batch_size=48, epochs=2)   # 3 processes, uneven shares
```
"""

import atexit
import os
import types
import weakref

from autodist_keras.backends import model_checks
from autodist_keras.backends import torch_fusion
from autodist_keras.backends.base import BackendAdapter
from autodist_keras.backends.torch_fusion import DEFAULT_COMPILER
from autodist_keras.errors import BackendError
from autodist_keras.strategies.auto import may_outgrow
from autodist_keras.strategies.auto import warn_if_batch_outgrows_plan

DEFAULT_TIMEOUT_S = 300.0
_ATTACHED = "_autodist_keras_torch_adapter"
_RUN = "_autodist_keras_torch_run"  # a model's last `_FitRun` (see `TorchAdapter._run`)

_torchrun_comm = None


def _batch(data):
    """`(x, y, rows)` of the batch Keras's torch trainer passes a train function
    (`rows` None when the batch has no input tensors)."""
    from keras.src.trainers.data_adapters import data_adapter_utils

    from autodist_keras.backends import torch_transport as tt

    x, y, _ = data_adapter_utils.unpack_x_y_sample_weight(data[0])
    _, leaves = tt.flatten_tree(x)
    if not leaves:
        return x, y, None
    first = leaves[0]
    return x, y, int(first.shape[0]) if hasattr(first, "shape") else len(first)


def _checking_batch_size(train_function, plan):
    """Keras's own one-replica train function, warning once when a batch outgrows `plan`."""

    def function(data):
        if may_outgrow(plan):
            rows = _batch(data)[2]
            if rows is not None:
                warn_if_batch_outgrows_plan(plan, rows)
        return train_function(data)

    return function


def torchrun_env():
    """`(rank, world_size)` when this process was started by torchrun (or the
    same variables), else None. Spawned workers never count."""
    if os.environ.get("AUTODIST_KERAS_WORKER_RANK"):
        return None
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except ValueError:
        raise BackendError(
            "RANK and WORLD_SIZE must be integers (as torchrun sets them). "
            f"Received: RANK={os.environ['RANK']!r}, WORLD_SIZE={os.environ['WORLD_SIZE']!r}"
        ) from None
    if world <= 1:
        return None
    if not 0 <= rank < world:
        raise BackendError(
            f"RANK must be in [0, WORLD_SIZE). Received: RANK={rank}, WORLD_SIZE={world}"
        )
    return rank, world


def _get_torchrun_comm(rank, world, timeout_s):
    """The process-wide `Comm` of a torchrun job (made once)."""
    global _torchrun_comm
    if _torchrun_comm is not None and not _torchrun_comm.broken:
        return _torchrun_comm
    import torch.distributed as dist

    from autodist_keras.backends.torch_transport import Comm

    notice = _waiting_notice(rank, world, timeout_s)
    try:
        return _join_torchrun(rank, world, timeout_s, dist, Comm)
    finally:
        notice.cancel()


# Seconds a rank waits for the others before it says what it is waiting for.
WAITING_NOTICE_S = 10.0


def _waiting_notice(rank, world, timeout_s):
    """A started timer that prints, if joining takes long, which job the rank joins
    and why (the environment's torchrun variables, perhaps left over)."""
    import sys
    import threading

    variables = ", ".join(f"{v}={os.environ.get(v)}" for v in
                          ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))

    def say():
        print(
            f"autodist_keras: rank {rank} has waited {WAITING_NOTICE_S:g} s for the other "
            f"ranks of a {world}-rank torchrun job ({variables}, from the environment); it "
            f"gives up after timeout_s={timeout_s:g} s. If these variables are left over "
            "from an earlier torchrun, unset them to train with spawned workers.",
            file=sys.stderr, flush=True,
        )

    timer = threading.Timer(WAITING_NOTICE_S, say)
    timer.daemon = True
    timer.start()
    return timer


def _join_torchrun(rank, world, timeout_s, dist, Comm):
    """Joins the torchrun job's store (env:// rendezvous) and makes its `Comm`."""
    global _torchrun_comm
    import datetime

    if dist.is_available() and dist.is_initialized():
        store = dist.distributed_c10d._get_default_store()
    else:
        for var in ("MASTER_ADDR", "MASTER_PORT"):
            if var not in os.environ:
                raise BackendError(
                    f"RANK and WORLD_SIZE are set but {var} is not; start the job with "
                    "torchrun, or set MASTER_ADDR and MASTER_PORT to rank 0's address "
                    f"and a free port. Received: {var} unset"
                )
        try:
            store, _, _ = next(dist.rendezvous(
                "env://", rank=rank, world_size=world,
                timeout=datetime.timedelta(seconds=timeout_s),
            ))
        except (RuntimeError, TimeoutError) as e:
            if _address_in_use(e):
                raise _port_in_use(rank, e) from None
            raise _not_joined(rank, world, timeout_s, e) from None
    try:
        _torchrun_comm = Comm(store, rank, world, timeout_s, prefix="autodist_keras/torchrun")
    except (RuntimeError, TimeoutError) as e:
        raise _not_joined(rank, world, timeout_s, e) from None
    atexit.register(_shutdown_torchrun_comm)
    return _torchrun_comm


def _shutdown_torchrun_comm():
    """At exit: ends the torchrun job's process groups while the peers are still up."""
    global _torchrun_comm
    comm, _torchrun_comm = _torchrun_comm, None
    if comm is not None:
        comm.shutdown()


def _address_in_use(error):
    """Whether the rendezvous failed because rank 0 could not listen on MASTER_PORT."""
    text = str(error)
    return "EADDRINUSE" in text or "address already in use" in text.lower()


def _port_in_use(rank, error):
    """The error for a MASTER_ADDR:MASTER_PORT that another process already listens on."""
    address = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    return BackendError(
        f"Rank {rank} could not start the job's store at MASTER_ADDR:MASTER_PORT = {address}: "
        "the port is already in use, by another job or a process left over from an earlier "
        "run. Pick a free port (torchrun --master-port, or MASTER_PORT), stop the process "
        "that holds it, or leave the port to `autodist-keras launch` (and "
        "`autodist_keras.launch(...)` without master_port), which choose a free one. "
        "Received: " + str(error).splitlines()[0][:300]
    )


def _not_joined(rank, world, timeout_s, error):
    return BackendError(
        f"Rank {rank} waited {timeout_s:g} s (the strategy's timeout_s) for the other ranks of "
        f"this {world}-rank job and not all of them arrived. Every rank must run the script "
        "to its fit with the same model and data; a rank that exits or fails before fit "
        "leaves the others waiting. The job is named by RANK, WORLD_SIZE, MASTER_ADDR and "
        "MASTER_PORT in the environment: if they are left over from an earlier torchrun, "
        "unset them. Received: " + str(error).splitlines()[0][:300]
    )



def plan_kind_runs_on_torch(plan):
    """Whether the PyTorch runtime runs plans of this kind, on any machine.

    It runs one process per device, each with a whole replica of the model,
    so it runs data-parallel plans whose PS servers (if any) hold a replica.

    Args:
        plan: A `Plan`.

    Returns:
        `(True, "")`, or `(False, reason)`.
    """
    if not plan.is_data_parallel:
        return False, (
            "the PyTorch runtime runs one process per device, each with a whole replica of "
            "the model (data parallelism), so it cannot place layer groups on different "
            f"devices; this {plan.provenance.planner} plan has {len(plan.groups)} layer "
            "groups. Run it with KERAS_BACKEND=tensorflow (one process drives every local "
            "device), or use a data-parallel strategy ('data_parallel', 'proportional', "
            "'disco' or 'auto')"
        )
    devices = set(plan.devices)
    servers = sorted({s.server for s in plan.sync.values() if s.method == "ps"} - devices)
    if servers:
        return False, f"PS server(s) {servers} run no replica; the PyTorch runtime hosts PS in a replica"
    return True, ""

class TorchAdapter(BackendAdapter):
    """Realises data-parallel plans on the PyTorch backend (gloo on CPU, NCCL on GPU).

    Args:
        strategy: The `AutoStrategy`; its option `timeout_s` (default 300)
            bounds how long a step waits for a silent worker. A worker that
            dies or raises is reported at once, whatever the timeout.

    Attributes:
        last_run: Facts about the last distributed fit: `mode` (`"spawned"`,
            `"torchrun"` or `"local"`), `world_size`, `steps`, `in_sync`
            (the replicas ended with bit-identical weights and optimizer
            state), `worker_pids`, `gradient_transport` (`"shared_memory"`,
            `"gloo"` or `"nccl"`: how the ranks summed gradients).

    The adapter holds its fitted models weakly, as the strategy does: the
    last fit's state (`_run`: its driver, reducer and op-fusion regions) hangs
    on that fit's model, so `del model` frees the model, its optimizer state
    and that state together.
    """

    name = "torch"

    def __init__(self, strategy):
        super().__init__(strategy)
        self.timeout_s = float(strategy.options.get("timeout_s", DEFAULT_TIMEOUT_S))
        if self.timeout_s <= 0:
            raise BackendError(f"timeout_s must be positive. Received: {self.timeout_s}")
        self.last_run = {}
        self._last_model = None  # a weak reference to the last fitted model
        env = torchrun_env()
        if env is not None and env[1] > len(strategy.devices):
            raise BackendError(
                f"Under torchrun each process runs one replica on one of the strategy's "
                f"devices, but WORLD_SIZE={env[1]} processes run and the strategy has "
                f"{len(strategy.devices)} device(s) ({', '.join(strategy.devices)}). Start "
                f"{len(strategy.devices)} processes (torchrun --nproc-per-node, or "
                "autodist-keras launch --nprocs), or give the strategy a cluster of every "
                "node's devices (a YAML spec). "
                f"Received: WORLD_SIZE={env[1]}, devices={strategy.devices}"
            )

    def variable_scope(self):
        """Creates the model's variables on the device rank 0 will run on.

        Keras's PyTorch backend puts new tensors on the GPU whenever CUDA is
        available, so without this a model for the CPU testbed on a machine
        with a GPU would live on the GPU. The device is the first replica's
        of a given data-parallel plan, else `cuda:$LOCAL_RANK` for a torchrun
        rank on a GPU cluster, else the first of the strategy's devices
        (`_start` checks that the plan's rank 0 agrees and says what to change
        if not; placement plans are refused there).
        """
        import contextlib

        import keras

        from autodist_keras.backends.torch_device import device_info
        from autodist_keras.backends.torch_device import keras_device_name

        strategy = self.strategy
        cluster = strategy.cluster
        plan = getattr(strategy, "plan", None)
        if plan is not None and plan.is_data_parallel and plan.replicas:
            info = device_info(cluster.device(plan.replicas[0].device))
        else:
            env = torchrun_env()
            gpus = [d for d in cluster.devices if d.kind == "gpu"]
            if env is not None and gpus:
                local = int(os.environ.get("LOCAL_RANK", env[0]))
                info = {"name": f"local rank {local}", "kind": "gpu", "index": local}
            else:
                info = device_info(cluster.device(strategy.devices[0]))
        name = keras_device_name(info)
        return keras.device(name) if name else contextlib.nullcontext()

    @property
    def _run(self):
        """The last fit's `_FitRun` while its model is alive, else None.

        The run (and through its driver the model, its optimizer and their
        buffers) is kept by the model it trained, not by the adapter: a
        strategy serves many models and must not keep the last of them alive
        (`del model; gc.collect()` left a 6.3M-parameter model and its Adam
        state in memory until the strategy was gone).
        """
        model = self._last_model() if self._last_model is not None else None
        return None if model is None else vars(model).get(_RUN)

    def _remember(self, model, run):
        """Makes `run` the last fit's, kept by `model` (the previous model forgets its run)."""
        previous = self._last_model() if self._last_model is not None else None
        if previous is not None and previous is not model:
            vars(previous).pop(_RUN, None)
        object.__setattr__(model, _RUN, run)
        self._last_model = weakref.ref(model)

    def before_fit(self, model):
        """Notes the optimizer's settings before Keras builds it (`torch_state_watch`)."""
        from autodist_keras.backends.torch_state_watch import note_settings_before_build

        note_settings_before_build(getattr(model, "optimizer", None))

    def attach(self, model):
        """Wraps `model.fit` so that it runs the strategy's plan."""
        if getattr(model, _ATTACHED, None) is self:
            return
        adapter = self

        def fit(self_model, *args, **kwargs):
            return adapter._fit(self_model, *args, **kwargs)

        model.fit = types.MethodType(fit, model)
        object.__setattr__(model, _ATTACHED, self)

    # ------------------------------------------------------------------ fit
    def _fit(self, model, *args, **kwargs):
        steps = getattr(model, "steps_per_execution", 1)
        if steps != 1:
            # Keras's torch trainer refuses it in `make_train_function`, which the
            # runtime's own train function bypasses: without this check every
            # other batch would be dropped silently.
            raise BackendError(
                "`steps_per_execution` must be 1 with the PyTorch backend, as in Keras; "
                "compile the model without it. "
                f"Received: steps_per_execution={steps}"
            )
        env = torchrun_env()
        if env is not None and env[0] > 0:
            return self._serve_torchrun(model, *env)
        run = _FitRun(self, model, env)
        self._remember(model, run)
        model.train_function = run.train_function
        try:
            try:
                history = type(model).fit(model, *args, **kwargs)
            except BaseException:
                run.abort()
                raise
            finally:
                model.train_function = None
                run.restore()
            try:
                run.finish(history)
            except BaseException:
                run.abort()
                raise
        finally:
            run.release()  # the workers may serve the next fit
        return history

    def _serve_torchrun(self, model, rank, world):
        import keras

        from autodist_keras.backends.torch_session import StoreReporter
        from autodist_keras.backends.torch_session import serve
        from autodist_keras.errors import WorkerError
        from autodist_keras.strategies.plan import Plan

        comm = _get_torchrun_comm(rank, world, self.timeout_s)
        reporter = StoreReporter(comm.store, world)

        def on_model(setup, replica):
            self.strategy.plan = Plan.from_dict(setup["plan"])

        try:
            replica, payload = serve(comm, reporter, model=model, on_model=on_model)
        except BaseException as e:
            from autodist_keras.backends.torch_session import format_exception
            from autodist_keras.backends.torch_transport import CommFailure

            reporter.report(rank, format_exception(e), isinstance(e, CommFailure))
            comm.broken = True
            if isinstance(e, CommFailure):
                raise WorkerError(0, f"rank {rank} lost its connection to rank 0: {e}") from None
            raise
        if replica is None:
            raise BackendError(
                f"Rank {rank}: the session's setup failed on some rank; rank 0 raised the "
                "error. Received: setup status 1"
            )
        if payload.get("completed") is False:
            raise WorkerError(
                0, "its fit stopped with an error before the end (rank 0's output shows it), "
                f"so rank {rank}'s fit stops too and its model is not fully trained"
            )
        history = keras.callbacks.History()
        history.set_model(model)
        history.history = payload.get("history", {})
        history.epoch = payload.get("epoch", [])
        history.params = payload.get("params", {})
        model.history = history
        self.last_run = {"mode": "torchrun", "world_size": world, "rank": rank}
        return history

    def can_execute(self, plan):
        """Whether this runtime can run `plan`.

        Returns:
            `(True, "")`, or `(False, reason)` for plans with several layer
            groups (placement), a PS server that runs no replica, or a
            replica count other than torchrun's WORLD_SIZE.
        """
        runnable, why = plan_kind_runs_on_torch(plan)
        if not runnable:
            return runnable, why
        env = torchrun_env()
        if env is not None and len(plan.replicas) != env[1]:
            return False, (
                f"under torchrun one process runs per replica, and WORLD_SIZE={env[1]} "
                f"processes run, but this plan has {len(plan.replicas)} replica(s): start "
                f"{len(plan.replicas)} processes, or give the strategy {env[1]} devices "
                "(devices=)"
            )
        return True, ""

    def cluster_is_here(self):
        """False when the strategy's devices name GPUs this machine lacks (spawned runs)."""
        return torchrun_env() is not None or not self._missing_gpus(self.strategy.devices)

    def _missing_gpus(self, names):
        """Why the GPUs among device `names` are not on this machine (spawned runs), or ''."""
        gpus = [n for n in names if self.strategy.cluster.device(n).kind == "gpu"]
        if not gpus:
            return ""
        import torch

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        absent = [d for d in gpus if self.strategy.cluster.device(d).index >= have]
        if not absent:
            return ""
        return (
            f"the plan trains on GPU(s) {absent}, but this machine has {have} CUDA GPU(s): "
            "the cluster describes GPUs that are not here, and the replicas would silently "
            "run on the CPU. To train here, use cluster=None (this machine's devices) or "
            "Cluster.cpu_testbed(); to plan for a cluster you do not own, use "
            "strategy.plan_for(model, batch_size) or `autodist-keras plan`"
        )

    def worker_pids(self):
        """Process ids of the spawned workers of the current or last fit, by rank."""
        return dict(self.last_run.get("worker_pids", {}))

    def close(self):
        """Ends the spawned worker processes (they are also ended at exit).

        Workers that a running fit is using (another strategy's fit, from whose
        callback this is called, say) end when that fit is done.
        """
        from autodist_keras.backends.torch_pool import shutdown_pools

        shutdown_pools(idle_only=True)


class _FitRun:
    """State of one `fit` call on rank 0."""

    def __init__(self, adapter, model, env):
        self.adapter = adapter
        self.model = model
        self.env = env
        self.driver = None
        self.pool = None
        self.local = False
        self.token = None
        self.failed = False
        self.fusion = None  # the one-replica path's op-fusion regions, if compiled
        self.plan = None  # the one-replica path's plan

    # ------------------------------------------------------------ first step
    def _start(self, data):
        from autodist_keras.backends.torch_device import check_model_device
        from autodist_keras.backends.torch_device import device_info
        from autodist_keras.backends.torch_device import grad_backend
        from autodist_keras.backends.torch_device import pin
        from autodist_keras.backends.torch_session import Driver
        from autodist_keras.backends.torch_session import StoreReporter

        strategy = self.adapter.strategy
        x, y, batch_size = _batch(data)
        if batch_size is None:
            raise BackendError("fit received a batch without inputs. Received: x=None")
        self.adapter.first_train_batch = batch_size
        self.adapter.first_train_shapes = strategy.sample_shapes(x, self.model)
        # torchrun ranks each plan on their own and must agree: from the model's
        # shapes alone there (each rank's first batch may be padded differently).
        shapes = self.adapter.first_train_shapes if torchrun_env() is None else None
        plan = strategy._plan_for_training(self.model, batch_size, input_shapes=shapes)
        model_checks.check_model_for_plan(self.model, x, y, plan)
        if not plan.is_data_parallel:
            raise BackendError(
                "The PyTorch runtime runs data-parallel plans (one layer group replicated "
                "over devices); this plan places layer groups on different devices. Run "
                "placement plans with KERAS_BACKEND=tensorflow, or use "
                "strategy='data_parallel', 'proportional' or 'auto'. "
                f"Received: {len(plan.groups)} groups"
            )
        missing = self.env is None and self.adapter._missing_gpus(plan.devices)
        if missing:
            raise BackendError(f"Cannot train here: {missing}. Received: plan devices "
                               f"{plan.devices}")
        devices = [device_info(strategy.cluster.device(r.device)) for r in plan.replicas]
        world = len(devices)
        timeout_s = self.adapter.timeout_s
        info = {"world_size": world, "plan_devices": plan.devices}
        op_fusion = (strategy.options.get("op_fusion", "auto"),
                     strategy.options.get("op_fusion_compiler", DEFAULT_COMPILER))
        if world == 1 and self.env is None:
            self.local = True
            self.plan = plan
            self.token = pin(devices[0])
            check_model_device(self.model, devices[0], 0)
            info["mode"] = "local"
            self.fusion = torch_fusion.for_plan(self.model, plan, [d["kind"] for d in devices],
                                                *op_fusion)
            if self.fusion is not None:
                self.fusion.install()
            info.update(torch_fusion.run_info(self.fusion))
            self.adapter.last_run = info
            return
        if self.env is not None:
            rank, env_world = self.env
            comm = _get_torchrun_comm(rank, env_world, timeout_s)
            reporter = StoreReporter(comm.store, env_world)
            spawned, wake = False, None
            info["mode"] = "torchrun"
        else:
            from autodist_keras.backends.torch_pool import get_pool

            self.pool = get_pool(world, timeout_s, grad_backend(devices))
            comm, reporter = self.pool.comm, self.pool
            spawned, wake = True, self.pool.wake
            info["mode"] = "spawned"
            info["worker_pids"] = self.pool.pids
            info["start_method"] = self.pool.start_method
        self.adapter.last_run = info
        # Pin rank 0 after the workers exist, so they do not inherit its affinity.
        self.token = pin(devices[0])
        check_model_device(self.model, devices[0], 0)
        driver = Driver(self.model, plan, comm, strategy.cluster, reporter, spawned, timeout_s,
                        wake=wake, op_fusion=op_fusion)
        driver.setup()
        self.driver = driver
        info["gradient_transport"] = driver.gradient_transport
        info.update(torch_fusion.run_info(driver.trainer.fusion))

    def train_function(self, data):
        if self.driver is None and not self.local:
            self._start(data)
        if self.local:
            # One replica: from the next step on, Keras's loop calls Keras's own
            # train function (torch.compile'd under jit_compile, as in plain
            # Keras); `_fit` clears it afterwards, so the next fit plans again.
            self.model.make_train_function(force=True)
            if may_outgrow(self.plan):
                self.model.train_function = _checking_batch_size(self.model.train_function,
                                                                 self.plan)
            return self.model.train_function(data)
        logs = self.driver.train_step(data)
        self.adapter.last_run["steps"] = self.driver.steps
        return logs

    # ------------------------------------------------------------------ end
    def finish(self, history):
        if self.driver is not None:
            self.driver.end(history)
            self.adapter.last_run["in_sync"] = self.driver.in_sync
            self.adapter.last_run["steps"] = self.driver.steps
        fusion = self.driver.trainer.fusion if self.driver is not None else self.fusion
        if fusion is not None:  # rank 0's region call counts, now that fit is done
            self.adapter.last_run.update(torch_fusion.run_info(fusion))

    def abort(self):
        """fit raised: end the session cleanly if possible, else stop the workers."""
        from autodist_keras.errors import WorkerError

        driver = self.driver
        if driver is None:
            if self.pool is not None and not self.pool.healthy():
                self._discard()
            return
        if driver.in_step or driver.comm.broken or (self.pool is not None and self.pool.failed()):
            self._discard()
            return
        try:
            driver.end(None)
        except (WorkerError, BackendError):
            self._discard()

    def _discard(self):
        # The failed session's gradient hooks must not fire in the next step
        # (`train_on_batch`, or the next fit before it builds its own driver).
        trainer = getattr(self.driver, "trainer", None)
        if trainer is not None:
            trainer.detach()
        if self.pool is not None:
            from autodist_keras.backends.torch_pool import discard_pool

            discard_pool(self.pool)
        elif self.driver is not None:
            self.driver.comm.broken = True
        if self.driver is not None:
            # The workers are gone: rank 0's mappings of the session's shared
            # files (already unlinked, but holding /dev/shm space while mapped)
            # go now, not when the model or the strategy is collected.
            self.driver.release_shared_memory()

    def release(self):
        """Gives the pool back for the next fit (a discarded one is gone already)."""
        if self.pool is not None:
            from autodist_keras.backends.torch_pool import release_pool

            release_pool(self.pool)

    def restore(self):
        from autodist_keras.backends.torch_device import unpin

        unpin(self.token)
        self.token = None
        # The user's model gets Keras's own `call` back, also when fit raised.
        trainer = getattr(self.driver, "trainer", None)
        for fusion in (self.fusion, getattr(trainer, "fusion", None)):
            if fusion is not None:
                fusion.uninstall()
