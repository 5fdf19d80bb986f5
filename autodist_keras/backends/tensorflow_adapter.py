"""Runs data-parallel plans inside `model.fit` on the TensorFlow backend.

One process drives every local device: GPUs, or logical CPU devices that the
adapter creates with `tf.config.set_logical_device_configuration` on a
CPU-only machine. The adapter replaces the model's train, test and predict
functions; each step takes the global batch Keras' data pipeline produced,
slices it by the plan's batch shares, runs every replica's forward and
backward pass under `tf.device` inside one `tf.function`, weights each
replica's loss by `share / global batch`, fuses each planned gradient bucket
into one flat buffer per replica, sums the buffers the way the plan's sync
method says (ring, tree, hierarchical or parameter server), splits the sum
back, and applies it once with the model's optimizer. Metrics and the logged
loss are computed over the whole global batch.

When `TF_CONFIG` names two or more tasks, each process is one worker that
runs one replica (its share of each global batch) and sums gradient buckets
across workers with `tf.distribute.MultiWorkerMirroredStrategy` collectives
(one all-reduce per bucket).

See `docs/runtime_tensorflow.md` for what is and is not supported.

Example:

```python
strategy = AutoStrategy(strategy="proportional", cluster=Cluster.cpu_testbed())
with strategy.scope():
    model = keras.Sequential([...])
    model.compile(optimizer="adam", loss="mse")
model.fit(x, y, batch_size=48, shuffle=False)
```
"""

import contextlib
import os

from autodist_keras.backends import batchnorm_stats
from autodist_keras.backends import loss_trackers
from autodist_keras.backends import model_checks
from autodist_keras.backends import replica_random
from autodist_keras.backends import tf_add_guard
from autodist_keras.backends import tf_assign_watch
from autodist_keras.backends import tf_fusion
from autodist_keras.backends import tf_multiworker
from autodist_keras.backends import tf_reduce
from autodist_keras.backends import worker_callbacks
from autodist_keras.backends.base import BackendAdapter
from autodist_keras.errors import BackendError
from autodist_keras.strategies.auto import warn_if_batch_outgrows_plan

# With several workers, the predictions a metric needs ride in the train step's
# fused all-reduce (each worker's rows in place, zeros elsewhere) instead of an
# all-gather of their own, while the global batch's predictions are at most this
# many elements (4 MiB of float32); larger outputs keep the all-gather, which
# moves half the bytes.
FOLDED_PREDICTIONS_MAX_ELEMENTS = 1 << 20


def _recording_scope(state_mapping=None):
    """A Keras `StatelessScope` that also remembers which variables were assigned.

    Assignments made inside (BatchNormalization statistics, seed counters)
    are recorded instead of applied; losses added with `add_loss` (activity
    regularisers) are collected, and `_restore_losses` hands them back to
    their layers afterwards. `state_mapping` (`[(variable, value), ...]`)
    gives variables other values inside (a replica's own seeds). A trainable
    variable assigned inside (SpectralNormalization's kernel) is read
    afterwards as the assigned value with the gradient of a read of the
    variable (`_assigned_read`), as in plain Keras, where the assignment
    really happens.
    """
    from keras.src.backend.common.stateless_scope import StatelessScope

    class RecordingScope(StatelessScope):
        def __init__(self):
            super().__init__(state_mapping=state_mapping, collect_losses=True,
                             initialize_variables=False)
            self.assigned = []
            self.outer = _outer_graph()
            self.lifted = {}  # id(variable) -> its value read in `outer`

        def add_update(self, update):
            variable, value = update
            if all(v is not variable for v in self.assigned):
                self.assigned.append(variable)
            if getattr(variable, "trainable", False):
                value = _assigned_read(value, _leaf_read(self, variable))
            super().add_update((variable, value))

        def get_current_value(self, variable):
            value = super().get_current_value(variable)
            if value is None and _in_nested_function(self.outer):
                value = _lifted_read(self, variable)
            return value

    return RecordingScope()


def _outer_graph():
    """The graph a forward pass is traced in (None when it runs eagerly)."""
    import tensorflow as tf

    return None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()


def _in_nested_function(outer):
    """Whether ops made now go into an XLA function traced inside the pass (graph `outer`).

    Keras's TF backend compiles some layers' ops as their own
    `tf.function(jit_compile=True)`, traced anew at each call (grouped
    convolutions, channels_first Conv3D: keras/src/backend/tensorflow/nn.py
    `conv`). A variable read in there captures the variable's resource: XLA
    refuses a resource on another device than the replica's ("Trying to
    access resource ... located in device CPU:0 from device CPU:2"), and a
    per-device copy made in there is no tensor of the pass's graph, so it
    gets no gradient. Such reads are made in the pass's graph instead
    (`_read_outside`). Functions compiled without XLA are left alone: they
    may be traced once and reused, and reading a resource works in them.
    """
    import tensorflow as tf
    from tensorflow.python.ops import control_flow_util

    if tf.executing_eagerly():
        return False
    graph = tf.compat.v1.get_default_graph()
    return graph is not outer and control_flow_util.GraphOrParentsInXlaContext(graph)


def _read_outside(variable, outer, device=None):
    """`variable`'s value read in the pass's graph `outer` (eagerly when None).

    With `device`, a per-device copy made there (`tf_placement`'s leaves),
    else a read where the pass runs. The XLA function being traced captures
    the value as an input, so it is copied to the function's device, and
    the step's tape (or `tf.gradients`) sees the read.
    """
    import tensorflow as tf
    from tensorflow.python.eager import context

    with (outer.as_default() if outer is not None else context.eager_mode()), \
            tf.control_dependencies(None):
        if device is None:
            return tf.convert_to_tensor(variable._value)
        with tf.device(device):
            return tf.identity(tf.stop_gradient(variable._value))


def _lifted_read(scope, variable):
    """`variable` read in `scope.outer` (`_read_outside`), once per scope (`scope.lifted`)."""
    if id(variable) not in scope.lifted:
        scope.lifted[id(variable)] = _read_outside(variable, scope.outer)
    return scope.lifted[id(variable)]


def _leaf_read(scope, variable):
    """`variable` as `scope` serves it before an assignment (a read of the variable,
    a per-device copy, or an earlier assigned value): what its gradient goes to."""
    import tensorflow as tf

    value = scope.get_current_value(variable)
    return tf.convert_to_tensor(variable._value) if value is None else value


def _assigned_read(value, leaf):
    """What a read of a trainable variable gives after `variable.assign(value)` in `call`.

    Plain Keras applies the assignment, so a later read is the variable
    itself: its value is `value`, and its gradient goes to the variable, not
    back through what computed `value` (SpectralNormalization assigns
    `kernel / sigma(kernel)`, then reads the kernel). In a stateless scope a
    later read is `value` itself; this is `value` with the gradient of the
    variable's read `leaf` instead.

    Args:
        value: The assigned tensor (in the variable's dtype).
        leaf: The variable's value as the scope served it before (`_leaf_read`).

    Returns:
        A tensor equal to `value` whose gradient flows to `leaf` only.
    """
    import tensorflow as tf

    @tf.custom_gradient
    def read(value, leaf):
        return tf.identity(value), lambda dy: (None, dy)

    return read(value, tf.cast(leaf, value.dtype))


def _restore_losses(model, scope):
    """Puts the losses collected in `scope` back on the layers that added them.

    Outside a stateless scope Keras keeps `add_loss` losses on each layer
    (`layer._losses`), where `model.losses` (and so `compute_loss`) finds
    them; this restores that state for the replica just run.
    """
    if not scope.losses:
        return
    for layer in model._flatten_layers():
        ids = getattr(layer, "_loss_ids", None)
        if ids:
            layer._losses[:] = [loss for loss in scope.losses if id(loss) in ids]


class _Replica:
    def __init__(self, name, device, share, node):
        self.name = name  # plan device name
        self.device = device  # TF device string
        self.share = share
        self.node = node


def _cpu_devices(cluster):
    """The cluster's CPU and CPU-testbed devices: one logical CPU device each."""
    return [d for d in cluster.devices if d.kind != "gpu"]


# How many logical CPU devices an AutoStrategy of this process gave TensorFlow
# (None: none did), for the message when a later strategy needs more.
_logical_cpus_set_by_a_strategy = None


def configure_logical_cpus(cluster):
    """Gives TensorFlow one logical CPU device per CPU device of `cluster`, if it can.

    Logical devices can only be created before TensorFlow runs its first
    operation. `AutoStrategy` calls this when it is created, so a script that
    creates the strategy first gets its devices even if it builds the model
    outside `strategy.scope()`; the adapter calls it again and raises if the
    devices are missing. With `TF_CONFIG` set, a worker gets one logical CPU
    device per CPU device it runs (`tf_multiworker.WORKER_DEVICES_ENV`),
    none when it runs one device.

    Args:
        cluster: The `Cluster`.

    Returns:
        The number of logical CPU devices this process needs (0 for a
        worker running one device).
    """
    import tensorflow as tf

    if tf_multiworker.parse_tf_config() is not None:
        names = tf_multiworker.worker_device_names() or []
        local = [n for n in names if n in cluster.names and cluster.device(n).kind != "gpu"]
        if len(local) <= 1:
            return 0
        needed = len(local)
    else:
        needed = len(_cpu_devices(cluster))
    if needed <= 1:
        return needed
    global _logical_cpus_set_by_a_strategy
    physical = tf.config.list_physical_devices("CPU")[0]
    try:
        existing = tf.config.get_logical_device_configuration(physical) or []
        if len(existing) < needed:
            tf.config.set_logical_device_configuration(
                physical, [tf.config.LogicalDeviceConfiguration() for _ in range(needed)]
            )
            _logical_cpus_set_by_a_strategy = needed
    except RuntimeError:
        pass  # TensorFlow is already initialised: the adapter checks what it has.
    return needed


def _refuse_torchrun_ranks():
    """Raises when this process is one of several torchrun-style ranks.

    `torchrun` and `autodist-keras launch` start one process per rank with
    `RANK` / `WORLD_SIZE` set; the TensorFlow backend does not read them, so
    each rank would train the whole plan on its own.
    """
    world = os.environ.get("WORLD_SIZE", "").strip()
    if not world.isdigit() or int(world) <= 1:
        return
    raise BackendError(
        f"This process is one of {world} ranks started torchrun-style (RANK="
        f"{os.environ.get('RANK', '?')}, WORLD_SIZE={world}: torchrun or autodist-keras "
        "launch), but the TensorFlow backend does not use them: every rank would train the "
        "whole plan on its own. On TensorFlow run one process, which drives every local "
        "device, or start one worker per process with TF_CONFIG "
        "(docs/runtime_tensorflow.md); for ranks, use KERAS_BACKEND=torch. "
        f"Received: WORLD_SIZE={world!r} with KERAS_BACKEND=tensorflow"
    )


class TensorFlowAdapter(BackendAdapter):
    """Backend adapter for `KERAS_BACKEND=tensorflow`.

    Created by `AutoStrategy` (at `scope()`); creating it configures the
    local devices, so it must happen before TensorFlow runs its first op.

    Args:
        strategy: The `AutoStrategy` this adapter serves.

    Raises:
        BackendError: If TensorFlow already started with fewer logical CPU
            devices than the cluster has CPU devices, or `TF_CONFIG` is
            malformed.
    """

    name = "tensorflow"

    def __init__(self, strategy):
        super().__init__(strategy)
        import tensorflow as tf  # noqa: F401  (loaded here, lazily)

        tf_add_guard.install()  # replicas know their row counts: see tf_add_guard
        self.cluster = strategy.cluster
        self.worker = tf_multiworker.parse_tf_config()
        self.worker_devices = None  # the plan devices this worker process runs
        self.collective = None
        if self.worker is not None:
            self._setup_worker()
        else:
            _refuse_torchrun_ranks()
            self._setup_local_devices()
        self._home = None
        self._scratch = None  # a worker's directory for its callbacks' files
        self.runtime_info = {}

    def callbacks_for_fit(self, callbacks):
        """Workers other than worker 0 write their callbacks' files privately
        (`worker_callbacks`): every worker runs the script's callbacks, and two
        writing one checkpoint crashed the job or corrupted the file."""
        if self.worker is None or self.worker.rank == 0:
            return callbacks
        if self._scratch is None:
            import shutil
            import tempfile
            import weakref

            self._scratch = tempfile.mkdtemp(prefix=f"autodist_keras_worker{self.worker.rank}_")
            weakref.finalize(self, shutil.rmtree, self._scratch, True)
        return worker_callbacks.for_worker(callbacks, self.worker.rank, self._scratch)

    # -------------------------------------------------------------- devices
    def _local_cpu_devices(self):
        return _cpu_devices(self.cluster)

    def _setup_local_devices(self):
        """Creates one logical CPU device per CPU device of the cluster."""
        import tensorflow as tf

        needed = configure_logical_cpus(self.cluster)
        if needed <= 1:
            return
        have = len(tf.config.list_logical_devices("CPU"))
        if have >= needed:
            return
        if _logical_cpus_set_by_a_strategy == have:
            why = (f"an earlier AutoStrategy in this process gave TensorFlow {have} logical CPU "
                   "devices, and TensorFlow fixes them at its first operation. In this process "
                   f"use a cluster of at most {have} CPU devices (Cluster.cpu_testbed() with "
                   f"{have} devices, say), or run this strategy in a new process. ")
        else:
            why = (f"TensorFlow already started with {have} logical CPU device(s), and logical "
                   "devices can only be created before TensorFlow runs its first operation. "
                   "Create the AutoStrategy (or call strategy.scope()) before building models "
                   "or running any TensorFlow op, or configure the devices yourself first with "
                   "tf.config.set_logical_device_configuration(tf.config.list_physical_devices("
                   f"'CPU')[0], [tf.config.LogicalDeviceConfiguration()] * {needed}). ")
        raise BackendError(
            f"The cluster has {needed} CPU devices "
            f"({[d.name for d in self._local_cpu_devices()]}), but {why}"
            f"Received: {have} logical CPU device(s)"
        )

    def _setup_worker(self):
        """Pins this worker to its devices' cores, creates their logical CPU
        devices and starts the collectives."""
        import tensorflow as tf

        worker = self.worker
        mine = tf_multiworker.local_device_names(worker, self.strategy.devices)
        devices = [self.cluster.device(n) for n in mine]
        if len(devices) > 1 and any(d.kind == "gpu" for d in devices):
            raise BackendError(
                "A worker process runs several devices only on the CPU testbed (logical CPU "
                "devices); with GPUs, run one worker per GPU (CUDA_VISIBLE_DEVICES=<its index>). "
                f"Received: {mine}"
            )
        self.worker_devices = mine
        cores, threads = tf_multiworker.pinning_for(devices)
        if cores is not None:
            tf_multiworker.pin_process(cores, threads)
        if len(devices) > 1:
            configure_logical_cpus(self.cluster)  # before the collectives start TensorFlow
        timeout = self.strategy.options.get("timeout_s", 300)
        self.collective = tf_multiworker.make_collective_strategy(timeout, worker)
        have = len(tf.config.list_logical_devices("CPU"))
        if have < len(devices):
            raise BackendError(
                f"This worker runs {len(devices)} devices ({mine}) but TensorFlow started with "
                f"{have} logical CPU device(s). Create the AutoStrategy before any TensorFlow "
                f"op runs. Received: {have} logical CPU device(s)"
            )
        local = list(self.collective.extended.worker_devices)
        if len(local) != 1:
            raise BackendError(
                f"Each worker runs one replica, but this worker sees {len(local)} devices "
                f"({local}). Give each worker process one visible GPU, e.g. "
                "CUDA_VISIBLE_DEVICES=<its GPU index>. "
                f"Received: {len(local)} local devices"
            )
        replica_id = tf_multiworker.replica_id(self.collective)
        if replica_id != worker.rank:
            raise BackendError(
                f"This worker ({worker.task_type} {worker.task_index}) has collective replica "
                f"id {replica_id}, not the rank {worker.rank} autodist_keras derived from "
                "TF_CONFIG (chief first, then workers by index). Use a TF_CONFIG with only "
                f"'worker' tasks. Received: {worker}"
            )

    def tf_device(self, name):
        """Maps a plan device name to a local TensorFlow device string.

        GPUs map to `/GPU:<index within the node>`; CPU and testbed devices
        map to logical CPU devices in the order the cluster lists them.

        Raises:
            BackendError: If the device does not exist on this machine.
        """
        import tensorflow as tf

        device = self.cluster.device(name)
        if self.worker is not None:
            base = self.collective.extended.worker_devices[0]
            if name not in self.worker_devices or len(self.worker_devices) == 1:
                return base
            index = self.worker_devices.index(name)
            return tf.DeviceSpec.from_string(base).replace(device_index=index).to_string()
        if device.kind == "gpu":
            gpus = tf.config.list_logical_devices("GPU")
            if device.index >= len(gpus):
                raise BackendError(
                    f"The plan places a replica on {name!r} (GPU {device.index} of its node), "
                    f"but this machine has {len(gpus)} GPU(s) visible to TensorFlow. Plan for "
                    "the local devices (Cluster.detect()) or run on the machine the plan was "
                    f"made for. Received: {name!r}"
                )
            return f"/GPU:{device.index}"
        cpus = [d.name for d in self._local_cpu_devices()]
        k = cpus.index(name)
        have = len(tf.config.list_logical_devices("CPU"))
        if k >= have:
            raise BackendError(
                f"The plan places a replica on {name!r} (CPU device {k}), but TensorFlow has "
                f"{have} logical CPU device(s). Create the AutoStrategy before any TensorFlow op "
                f"runs so the adapter can create them. Received: {name!r}"
            )
        return f"/CPU:{k}"

    @property
    def home(self):
        """Where the variables live (found when first needed, so that a strategy for a
        cluster that is not here can still plan)."""
        if self._home is None:
            self._home = self._home_device()
        return self._home

    def cluster_is_here(self):
        """False when the strategy's devices name GPUs that TensorFlow does not see here."""
        import tensorflow as tf

        if self.worker is not None:
            return True
        gpus = [self.cluster.device(n) for n in self.strategy.devices
                if self.cluster.device(n).kind == "gpu"]
        return not gpus or max(d.index for d in gpus) < len(tf.config.list_logical_devices("GPU"))

    def _home_device(self):
        """Where the variables live: the PS server if there is one, else the first device."""
        if self.worker is not None:
            return self.collective.extended.worker_devices[0]
        plan = self.strategy._fixed_plan
        if plan is not None:
            servers = {s.server for s in plan.sync.values() if s.method == "ps"}
            if len(servers) == 1 and all(s.method == "ps" for s in plan.sync.values()):
                return self.tf_device(servers.pop())
            return self.tf_device(plan.devices[0])
        options = self.strategy.options
        if options.get("sync") == "ps" and self.strategy.name != "single_device":
            return self.tf_device(options.get("ps_server") or self.strategy.devices[0])
        return self.tf_device(self.strategy.devices[0])

    def measurement_note(self):
        """Says so when CPU testbed devices ran unpinned, in this one process."""
        info = self.runtime_info or {}
        names = list(info.get("replica_devices") or {})
        if info.get("mode") != "single-process" or len(names) < 2:
            return None
        if not any(self.cluster.device(n).cpu_affinity for n in names):
            return None
        return (
            "TensorFlow drove the testbed devices from this one process, where their cores "
            "are not enforced (every device's ops share TensorFlow's thread pool), so this "
            "step is not the pinned testbed step that the prediction models; "
            "tensorflow_adapter.run_steps(..., processes='per_core') times that "
            "(docs/runtime_tensorflow.md)"
        )

    def can_execute(self, plan):
        """Whether this adapter can run `plan` here.

        Placement and hybrid plans (several layer groups) run in one process
        on this machine's devices (`tf_placement`); they cannot run in
        multi-worker mode, and a group with several replicas must hold only
        layers that can be split along the batch axis.

        Returns:
            `(True, "")`, or `(False, reason)` for plans spanning nodes in one
            process, devices missing on this machine, (multi-worker)
            replicas that are not one per worker or placement plans, and
            placement plans this model cannot run (see
            `tf_placement.unsupported`).
        """
        if not plan.is_data_parallel and self.worker is not None:
            return False, (
                "multi-worker mode (TF_CONFIG) runs one data-parallel replica per worker "
                f"process; this plan has {len(plan.groups)} layer groups, and placement plans "
                "need every device in one process (run without TF_CONFIG on one node)"
            )
        if self.worker is not None:
            if sorted(plan.devices) != sorted(self.strategy.devices):
                return False, (
                    f"multi-worker mode runs one replica per worker on {self.strategy.devices}; "
                    f"the plan uses {plan.devices}"
                )
            return True, ""
        nodes = plan.nodes(self.cluster)
        if len(nodes) > 1:
            return False, f"the plan spans nodes {nodes}; one process drives one node"
        names = list(plan.devices) + sorted(
            {s.server for s in plan.sync.values() if s.method == "ps" and s.server}
        )
        for name in names:
            try:
                self.tf_device(name)
            except (BackendError, KeyError, ValueError) as e:
                return False, str(e)
        if not plan.is_data_parallel:
            from autodist_keras.backends import tf_placement

            reason = tf_placement.unsupported(plan, self.strategy.graph)
            if reason:
                return False, reason
        return True, ""

    # ------------------------------------------------------------ interface
    def variable_scope(self):
        """Places the model's variables on the home device (PS server or first device).

        For a cluster that is not on this machine (planning only), the
        variables stay on TensorFlow's default device: `plan_for` and
        `explain()` work, and `fit` says it cannot run the plan here.
        """
        import contextlib

        import tensorflow as tf

        if not self.cluster_is_here():
            return contextlib.nullcontext()
        return tf.device(self.home)

    def attach(self, model):
        """Installs plan-running train, test and predict functions on `model`."""
        # The model's train/test/predict functions hold the runtime; the adapter
        # does not, so a model the user drops is freed.
        runtime = _Runtime(self, model)
        model.train_function = None
        model.test_function = None
        model.predict_function = None

        def make_train_function(force=False):
            keras_own = model.train_function is not None and (
                model.train_function is runtime.keras_train_function)
            replan = runtime.plan is not None and runtime.trainable_changed()
            if replan:
                # (Keras calls this at the start of every fit.) A layer frozen or
                # unfrozen since the last fit without compiling again: the plan
                # and the traced steps are for the old variables, so this fit
                # plans again for those that train now, as the PyTorch runtime
                # does (Keras's own TensorFlow step sees the change only when it
                # happens to trace again: docs/runtime_tensorflow.md).
                runtime.reset()
            if model.train_function is None or force or keras_own or replan:
                model.train_function = runtime.make_function("train")
            return model.train_function

        def make_test_function(force=False):
            if model.test_function is None or force:
                model.test_function = runtime.make_function("test")
            return model.test_function

        def make_predict_function(force=False):
            if model.predict_function is None or force:
                model.predict_function = runtime.make_function("predict")
            return model.predict_function

        model.make_train_function = make_train_function
        model.make_test_function = make_test_function
        model.make_predict_function = make_predict_function
        model._autodist_runtime = runtime

    @property
    def workers_share_devices(self):
        """Whether some worker process runs several devices (fewer workers than
        devices): every worker then makes the same choice of collectives."""
        return self.worker is not None and self.worker.num_workers < len(self.strategy.devices)

    @property
    def rank(self):
        """This process's worker rank (0 when not running multi-worker)."""
        return 0 if self.worker is None else self.worker.rank


class _Runtime:
    """Per-model state: the plan, its replicas, buckets and traced step functions."""

    def __init__(self, adapter, model):
        self.adapter = adapter
        self.model = model
        self.plan = None
        self.replicas = None
        self.layout = None
        self.fns = {}
        self.local_indices = None  # multi-worker: the plan replicas this process runs
        self.placement = None  # a tf_placement.PlacementRuntime for multi-group plans
        self.fusion = None  # a tf_fusion.FusionRegions when op-fusion regions are realised
        self.keras_train_function = None  # Keras's own, for one replica on the default device
        self.compiled = None  # which compile() the traced steps were made for
        self.trained_paths = None  # the trainable variables the plan was made for
        self.eager_rows_deduplicated = {}  # {variable path: bool}, for eager steps
        self.settings = None  # an OptimizerSettingsWatch: the settings the train steps traced
        self.settings_retraces = 0  # how often a changed setting dropped the traced steps

    # ------------------------------------------------------------ preparing
    def prepare(self, data, batch_size):
        import tensorflow as tf

        model = self.model
        with tf.device(self.adapter.home):
            model._symbolic_build(data_batch=data)
        strategy = self.adapter.strategy
        # Several TF_CONFIG workers each plan on their own and must agree: from the
        # model's shapes alone (each worker's first batch may be padded differently).
        shapes = strategy.sample_shapes(data[0], model) if self.adapter.worker is None else None
        plan = strategy._plan_for_training(model, batch_size, input_shapes=shapes)
        self.trained_paths = [v.path for v in model.trainable_variables]
        with tf.device(self.adapter.home):
            model_checks.check_model_for_plan(model, data[0], data[1], plan)
        if not plan.is_data_parallel:
            self._prepare_placement(plan)
            return
        replicas = []
        for r in plan.replicas:
            device = self.adapter.cluster.device(r.device)
            replicas.append(_Replica(r.device, self.adapter.tf_device(r.device), r.batch_share, device.node))
        if self.adapter.worker is None:
            nodes = {r.node for r in replicas}
            if len(nodes) > 1:
                raise BackendError(
                    f"The plan spans several nodes ({sorted(nodes)}); one process drives one "
                    "node's devices. Start one worker process per device with TF_CONFIG set "
                    "(see docs/runtime_tensorflow.md). "
                    f"Received: devices {[r.name for r in replicas]}"
                )
        else:
            mine = self.adapter.worker_devices
            names = [r.name for r in replicas]
            if sorted(names) != sorted(self.adapter.strategy.devices) or any(
                    m not in names for m in mine):
                raise BackendError(
                    "In multi-worker mode every worker runs one replica per device it owns: the "
                    "plan's replicas must be exactly the strategy's devices "
                    f"{self.adapter.strategy.devices}, one per device. "
                    f"Received: plan replicas {names}"
                )
            self.local_indices = [names.index(m) for m in mine]
        variables = model.trainable_variables
        self.layout = tf_reduce.bucket_layout(
            plan,
            [v.path for v in variables],
            [_dtype_name(v) for v in variables],
        )
        if model.optimizer is not None and not model.optimizer.built:
            with tf.device(self.adapter.home):
                model.optimizer.build(variables)
        self.plan = plan
        self.replicas = replicas
        self.fusion = tf_fusion.for_plan(
            model, plan,
            [self.adapter.cluster.device(r.name).kind for r in replicas],
            self.adapter.strategy.options.get("op_fusion", "auto"),
        )
        if self.adapter.worker is not None:
            tf_multiworker.check_device_ownership(
                self.adapter.collective, self.adapter.strategy.devices, self.adapter.worker_devices)
            tf_multiworker.broadcast_variables(self.adapter.collective, model.weights)
        self.adapter.runtime_info = (
            {
                "mode": "multi-worker" if self.adapter.worker is not None else "single-process",
                "worker_devices": self.adapter.worker_devices,
                "replica_devices": {r.name: r.device for r in replicas},
                "home_device": self.adapter.home,
                "buckets": len(self.layout),
                **tf_fusion.run_info(self.fusion),  # regions compiled, and why others are not
            }
        )

    def _prepare_placement(self, plan):
        """Sets up a placement or hybrid plan (several layer groups), run by `tf_placement`."""
        import tensorflow as tf

        from autodist_keras.backends import tf_placement

        adapter = self.adapter
        ok, why = adapter.can_execute(plan)
        if not ok:
            raise BackendError(
                f"The TensorFlow adapter cannot run this {plan.provenance.planner} plan with "
                f"{len(plan.groups)} layer groups here: {why}. Use a data-parallel strategy "
                "('data_parallel' or 'proportional'), or strategy='auto', which picks a plan "
                f"that runs. Received: groups {[g.name for g in plan.groups]}"
            )
        model = self.model
        self.placement = tf_placement.PlacementRuntime(adapter, model, plan, adapter.strategy.graph)
        self.layout = self.placement.layout
        if model.optimizer is not None and not model.optimizer.built:
            with tf.device(adapter.home):
                model.optimizer.build(model.trainable_variables)
        self.plan = plan
        adapter.runtime_info = self.placement.info()

    def shares(self, batch_size):
        if batch_size == self.plan.global_batch_size:
            shares = tuple(r.share for r in self.replicas)
        else:
            shares = tuple(self.plan.shares_for(batch_size))
        if self.adapter.worker is not None and min(shares) == 0:
            raise BackendError(
                f"A batch of {batch_size} samples leaves a worker with no samples (shares "
                f"{list(shares)}); in multi-worker mode every worker needs at least one. Use a "
                "dataset size that is a multiple of the batch size, or drop the last batch. "
                f"Received: batch of {batch_size}"
            )
        return shares

    # ------------------------------------------------------------ functions
    def make_function(self, kind):
        """Returns the function Keras calls with an iterator (train/test) or data list (predict)."""
        import tensorflow as tf

        from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

        model = self.model
        compiled = (getattr(model, "_compile_config", None), model.optimizer)
        if self.compiled is None or any(a is not b for a, b in zip(compiled, self.compiled)):
            # Compiled again (outside the scope: the model keeps this runtime): the
            # steps traced before hold the old optimizer, losses and metrics.
            self.fns.clear()
            self.keras_train_function = None
            self.compiled = compiled
        step_name = f"{kind}_step"
        custom = getattr(type(model), step_name) is not getattr(TensorFlowTrainer, step_name)
        multi_worker = self.adapter.worker is not None
        if custom or (multi_worker and kind != "train"):
            if kind == "train":
                raise BackendError(
                    f"{type(model).__name__} overrides train_step; the TensorFlow adapter "
                    "distributes Keras' standard train step (forward, compute_loss, gradients, "
                    "optimizer) and cannot split a custom one across replicas. Override "
                    "compute_loss / compute_metrics instead, or train this model outside "
                    f"strategy.scope(). Received: {type(model).__name__}.train_step"
                )
            # Custom test/predict steps, and evaluation on every worker, run on one
            # device with Keras' own function.
            original = getattr(TensorFlowTrainer, f"make_{kind}_function")
            setattr(model, f"{kind}_function", None)
            original(model)
            return getattr(model, f"{kind}_function")

        if kind == "predict":
            def predict_function(data):
                outputs = None
                for batch in data:
                    out = self.run_step("predict", batch)
                    outputs = out if outputs is None else _concat_structures(outputs, out)
                return outputs

            return predict_function

        def function(iterator):
            logs = None
            for _ in range(max(1, int(model.steps_per_execution))):
                try:
                    data = next(iterator)
                except (StopIteration, tf.errors.OutOfRangeError):
                    if logs is None:
                        raise StopIteration
                    break
                logs = self.run_step(kind, data)
            if kind == "train" and self.keras_step_suffices():
                # One replica on the default device: from the next step on, Keras's
                # own train function runs (no overhead over plain Keras). The next
                # fit's first step comes back here, to check its batch size.
                if self.keras_train_function is None:
                    TensorFlowTrainer.make_train_function(model, force=True)
                    self.keras_train_function = model.train_function
                model.train_function = self.keras_train_function
            return logs

        return function

    def keras_step_suffices(self):
        """Whether the plan is one replica on this process's default device
        (outside multi-worker mode), so Keras's own train step realises it.

        Not for a model with per-output loss metrics (several compiled
        losses): Keras's traced step, fed batches of unknown size, counts
        every batch as 1 in those averages, while the first step (ours, which
        makes the plan) counts its rows, so the logged `<output>_loss` would
        match neither plain nor eager Keras. Our step weighs every batch by
        its rows, as eager Keras does.

        Returns:
            `True` when the loop may run Keras's own train function.
        """
        import tensorflow as tf

        if (self.plan is None or not self.plan.is_data_parallel or self.adapter.worker is not None
                or not self.replicas or len(self.replicas) != 1
                or (self.fusion is not None and self.fusion.active)):
            return False  # (Keras's own step would not compile the op-fusion regions)
        compile_loss = getattr(self.model, "_compile_loss", None)
        if compile_loss is not None and list(getattr(compile_loss, "metrics", None) or []):
            return False
        default = ("GPU", 0) if tf.config.list_logical_devices("GPU") else ("CPU", 0)
        for name in (self.replicas[0].device, self.adapter.home):
            spec = tf.DeviceSpec.from_string(name)
            if ((spec.device_type or "").upper(), spec.device_index or 0) != default:
                return False
        return True

    def run_step(self, kind, data):
        """Runs one `kind` step; a collective that another worker left is a `WorkerError`."""
        if self.adapter.worker is None:
            return self._run_step(kind, data)
        import tensorflow as tf

        try:
            return self._run_step(kind, data)
        except tf.errors.OpError as e:
            failure = tf_multiworker.collective_failure(
                e, self.adapter.worker, self.adapter.strategy.options.get("timeout_s", 300))
            if failure is None:
                raise
            raise failure from None

    def _run_step(self, kind, data):
        import tensorflow as tf

        from keras.src import tree
        from keras.src.trainers.data_adapters import data_adapter_utils

        data = _standardise(data)
        if kind == "predict" and not isinstance(data, tuple):
            data = (data,)
        x, y, sw = data_adapter_utils.unpack_x_y_sample_weight(data)
        leaves = [t for t in tree.flatten(x) if t is not None]
        if not leaves:
            raise BackendError(f"A {kind} batch has no input tensors. Received: {type(data).__name__}")
        batch_size = int(leaves[0].shape[0])
        if batch_size == 0 and self.adapter.worker is None:
            # No replica gets a row (train_on_batch(x[:0])): Keras's own step, which
            # plain Keras runs on such a batch too (no replica's output to gather).
            return self._single_device_step(kind, x, y, sw, batch_size)
        if self.plan is None:
            if kind != "train":
                # The plan is made at the first training step; until then, one device.
                return self._single_device_step(kind, x, y, sw, batch_size)
            self.prepare((x, y, sw), batch_size)
        if kind == "train":
            warn_if_batch_outgrows_plan(self.plan, batch_size)
            if self.adapter.first_train_batch is None:
                self.adapter.first_train_batch = batch_size
                self.adapter.first_train_shapes = self.adapter.strategy.sample_shapes(
                    x, self.model)
        placement = self.placement
        if placement is not None:
            key = ("placement", kind, batch_size)
        else:
            shares = self.shares(batch_size)
            key = (kind, shares)
        if kind == "train" and self.trainable_changed():
            # A callback froze or unfroze a layer since the fit began: the traced
            # step would go on training it, a new trace would pair the new
            # variables with the old buckets. (0.2 ms for ResNet50's 214.)
            raise model_checks.trainable_changed_during_fit(
                len(self.trained_paths), len(self.model.trainable_variables))
        if kind == "train" and not self.model.run_eagerly:
            self._retrace_if_optimizer_settings_changed()
        fn = self.fns.get(key)
        if fn is None:
            if placement is not None:
                body = getattr(placement, f"{kind}_step")(batch_size)
            else:
                builder = {"train": self._train_step, "test": self._test_step,
                           "predict": self._predict_step}[kind]
                body = builder(shares)
            fn = body if self.model.run_eagerly else tf.function(
                body, reduce_retracing=True, autograph=False
            )
            self.fns[key] = fn
        if kind == "predict":
            return fn(x)
        return fn(x, y, sw)

    def _retrace_if_optimizer_settings_changed(self):
        """Drops the traced train steps when an optimizer setting changed since they were traced.

        A traced step holds the optimizer's Python settings (`momentum`,
        `beta_1`, `weight_decay`, `clipnorm`, ...) as the constants they were
        when it was traced; a callback that sets one during `fit` would change
        only the steps traced later (a new share tuple: the last, partial
        batch), so batches of different sizes would train with different
        values, and neither as eager Keras does. The next step traces again
        with the new values, as eager Keras and the PyTorch runtime apply them
        at once (plain Keras's traced step sees them only when it happens to
        trace again: docs/runtime_tensorflow.md, "Optimizer features"). Reads
        each setting once per step (microseconds). A setting changed at many
        steps (a per-batch momentum schedule) traces the step as often; the
        fifth time warns once, naming the settings.
        """
        from autodist_keras.backends.torch_state_watch import OptimizerSettingsWatch

        optimizer = self.model.optimizer
        watch = self.settings
        if watch is None or watch.optimizer is not optimizer:
            self.settings = None if optimizer is None else OptimizerSettingsWatch(optimizer)
            self.settings_retraces = 0
            return
        names = watch.moved_keys()
        if not names:
            return
        for key in [k for k in self.fns if "train" in k[:2]]:
            del self.fns[key]
        self.settings_retraces += 1
        if self.settings_retraces == _SETTINGS_RETRACES_WARNED:
            import warnings

            from autodist_keras.stacklevel import user_stacklevel

            warnings.warn(
                "The optimizer's settings changed between training steps "
                f"{self.settings_retraces} times so far; the TensorFlow runtime traces its "
                "train step again after each change, so that the new values apply (plain "
                "Keras's traced step would keep the old ones). Change them less often (once "
                "per epoch) to avoid the traces. "
                f"Received: {type(optimizer).__name__} settings {names} changed at the last "
                "step",
                stacklevel=user_stacklevel(),
            )
        watch.mark()

    def trainable_changed(self):
        """Whether the model's trainable variables differ from those planned for."""
        return self.trained_paths != [v.path for v in self.model.trainable_variables]

    def reset(self):
        """Forgets the plan and the traced steps (the next training step prepares anew)."""
        self.plan = self.layout = self.replicas = self.local_indices = None
        self.placement = self.fusion = self.keras_train_function = None
        self.fns.clear()

    def _single_device_step(self, kind, x, y, sw, batch_size):
        """Keras' own step on the home device: evaluate/predict before any plan
        exists, and any step on a batch of no rows.

        One function per batch size, as the planned steps have: with one
        function whose trace relaxes the batch dimension, Keras would weigh
        the per-output loss metrics of the relaxed batches as 1 and of the
        others by their size.
        """
        import tensorflow as tf

        key = ("single", kind, batch_size)
        if key not in self.fns:
            model = self.model

            def step(x, y, sw):
                with tf.device(self.adapter.home):
                    if kind == "predict":
                        return model.predict_step((x,))
                    if kind == "train":
                        return model.train_step((x, y, sw))
                    return model.test_step((x, y, sw))

            self.fns[key] = step if model.run_eagerly else tf.function(step, autograph=False)
        return self.fns[key](x, y, sw)

    # ---------------------------------------------------------- step bodies
    def _forward(self, x, training, replica_index=0):
        """One replica's forward pass; assignments (BN statistics, seeds) are recorded, not applied.

        Replica `replica_index` draws its random numbers (Dropout masks) from
        its own seeds (`replica_random`); the seed counters it records carry
        replica 0's seeds, so whichever replica's record is kept, the state
        goes on as on one device.
        """
        model = self.model
        seeds = replica_random.seed_state_variables(model) if training and replica_index else []
        mapping = replica_random.offset_states(seeds, replica_index)
        with _recording_scope(mapping) as scope:
            if model._call_has_training_arg:
                y_pred = model(x, training=training)
            else:
                y_pred = model(x)
        _restore_losses(model, scope)
        offset = {id(v) for v in seeds}
        updates = [
            (v, replica_random.restore_seed(scope.get_current_value(v), replica_index, v.dtype)
             if id(v) in offset else scope.get_current_value(v))
            for v in scope.assigned
        ]
        return y_pred, updates

    def _index_of(self, replica):
        """`replica`'s position in the plan (its random streams follow it)."""
        return next(i for i, r in enumerate(self.replicas) if r is replica)

    def _local_replicas(self, shares):
        """(replica, share, start) of the replicas this process runs, skipping empty ones."""
        out, start = [], 0
        for i, (replica, share) in enumerate(zip(self.replicas, shares)):
            if share > 0 and (self.local_indices is None or i in self.local_indices):
                out.append((replica, share, start))
            start += share
        return out

    def _train_step(self, shares):
        import tensorflow as tf

        from keras.src import tree

        model = self.model
        adapter = self.adapter
        total = sum(shares)
        local = self._local_replicas(shares)
        layout = self.layout
        collective = adapter.collective

        fusion = self.fusion

        def step(x, y, sw):
            variables = model.trainable_variables
            shapes = [tuple(v.shape) for v in variables]
            per_replica_grads, weighted_losses, y_preds, all_updates = [], [], [], []
            trackers = None  # custom metric trackers compute_loss may update
            for index, (replica, share, start) in enumerate(local):
                xi, yi, swi = _slice((x, y, sw), start, share)
                regions = fusion.recording(index) if fusion else contextlib.nullcontext()
                with tf.device(replica.device), regions:
                    with tf.GradientTape() as tape:
                        y_pred, updates = self._forward(
                            xi, training=True, replica_index=self._index_of(replica))
                        if trackers is None:
                            trackers = self._trackers(updates)
                        with trackers.watching():
                            loss = model._compute_loss(
                                x=xi, y=yi, y_pred=y_pred, sample_weight=swi, training=True
                            )
                        weighted = loss * tf.constant(share / total, loss.dtype)
                        scaled = (
                            model.optimizer.scale_loss(weighted)
                            if model.optimizer is not None else weighted
                        )
                    grads = tape.gradient(scaled, variables)
                trackers.record(share, restore=index < len(local) - 1)
                per_replica_grads.append(grads)
                weighted_losses.append(weighted)
                y_preds.append(y_pred)
                all_updates.append((replica, share, updates))
            if trackers is None:  # (no local replica has rows)
                trackers = self._trackers([])
            if fusion:
                fusion.mark()  # op-fusion regions and their gradients become XLA clusters

            with tf.device(adapter.home):
                loss, floats, ints = self._local_loss_and_state(weighted_losses, all_updates, total)
                floats += trackers.floats(total)
                ints += trackers.ints()
                # Predictions the metrics need, as zero-padded global-batch tensors
                # summed by the last bucket's all-reduce (None: no such folding).
                folded = self._fold_predictions(y_preds, local, total)
                reduced = [None] * len(variables)
                split = []  # (bucket, sparse indices, dense indices)
                for bucket in layout:
                    present = [
                        i for i in bucket.indices
                        if any(g[i] is not None for g in per_replica_grads)
                    ]  # variables no replica produced a gradient for stay None
                    sparse = [
                        i for i in present
                        if isinstance(per_replica_grads[0][i], tf.IndexedSlices)
                    ]
                    split.append((bucket, sparse, [i for i in present if i not in sparse]))
                # With several workers the loss and the float state (batch-norm
                # statistics) travel in the last float32 gradient bucket's
                # all-reduce instead of one collective of their own.
                carrier = None
                if collective is not None:
                    carrier = next((k for k in reversed(range(len(split))) if split[k][2]
                                    and variables[split[k][2][0]].dtype == "float32"), None)
                for k, (bucket, sparse, dense) in enumerate(split):
                    for i in sparse:
                        reduced[i] = self._gather_sparse(
                            [g[i] for g in per_replica_grads], shares, variables[i], x)
                    if not dense:
                        continue
                    dtype = variables[dense[0]].dtype
                    b_shapes = [shapes[i] for i in dense]
                    buffers, devices, nodes = [], [], []
                    for (replica, _, _), grads in zip(local, per_replica_grads):
                        with tf.device(replica.device):
                            buffers.append(tf_reduce.fuse([grads[i] for i in dense], b_shapes, dtype))
                        devices.append(replica.device)
                        nodes.append(replica.node)
                    if collective is not None:
                        # This worker's replicas are summed here, then once across workers.
                        mine = tf.add_n(buffers) if len(buffers) > 1 else buffers[0]
                    if k == carrier:
                        extras = [loss] + [value for _, value in floats] + (folded or [])
                        summed, extras = tf_multiworker.all_reduce_sum_with(
                            collective, mine, extras)
                        loss, floats, folded = _split_extras(extras, floats, folded)
                    elif collective is not None:
                        summed = tf_multiworker.all_reduce_sum(collective, mine)
                    else:
                        summed = tf_reduce.reduce_local(
                            buffers, devices, adapter.home, bucket.method, bucket.algorithm,
                            adapter.tf_device(bucket.server) if bucket.method == "ps" else None,
                            nodes,
                        )
                    server = adapter.tf_device(bucket.server) if (
                        bucket.method == "ps" and collective is None) else adapter.home
                    with tf.device(server):
                        for i, g in zip(dense, tf_reduce.unfuse(summed, b_shapes)):
                            reduced[i] = g
                if carrier is None and collective is not None:
                    loss, floats, folded = self._all_reduce_loss_and_state(loss, floats, folded)
                for variable, value in _with_variance_corrections(floats) + ints:
                    variable.assign(value)
                global_loss = loss
                if model.optimizer is not None and variables:  # Keras skips it too
                    model.optimizer.apply_gradients(zip(reduced, variables))
                if folded is not None:
                    y_pred_global = self._unfold_predictions(folded, y_preds[0])
                else:
                    y_pred_global = self._gather_predictions(y_preds, shares)
                model._loss_tracker.update_state(global_loss, sample_weight=total)
                return model.compute_metrics(x, y, y_pred_global, sample_weight=sw)

        return step

    def _test_step(self, shares):
        import tensorflow as tf

        model = self.model
        total = sum(shares)
        local = self._local_replicas(shares)

        def step(x, y, sw):
            weighted_losses, y_preds, all_updates = [], [], []
            trackers = None
            for index, (replica, share, start) in enumerate(local):
                xi, yi, swi = _slice((x, y, sw), start, share)
                with tf.device(replica.device):
                    y_pred, updates = self._forward(xi, training=False)
                    # What the pass assigned (a stateful RNN's states, a layer's
                    # counter or metric) is applied once, combined as in
                    # training: Keras's test step applies it too.
                    all_updates.append((replica, share, updates))
                    if trackers is None:
                        trackers = self._trackers(updates)
                    with trackers.watching():
                        loss = model._compute_loss(
                            x=xi, y=yi, y_pred=y_pred, sample_weight=swi, training=False
                        )
                    if loss is not None:
                        weighted_losses.append(loss * tf.constant(share / total, loss.dtype))
                trackers.record(share, restore=index < len(local) - 1)
                y_preds.append(y_pred)
            if trackers is None:
                trackers = self._trackers([])
            with tf.device(self.adapter.home):
                floats, ints = self._combined_state(all_updates, total)
                for variable, value in (_with_variance_corrections(floats + trackers.floats(total))
                                        + ints + trackers.ints()):
                    variable.assign(value)
                y_pred_global = self._gather_predictions(y_preds, shares)
                if weighted_losses:
                    model._loss_tracker.update_state(
                        self._sum_scalar(weighted_losses), sample_weight=total
                    )
                return model.compute_metrics(x, y, y_pred_global, sample_weight=sw)

        return step

    def _predict_step(self, shares):
        import tensorflow as tf

        local = self._local_replicas(shares)
        total = sum(shares)

        def step(x):
            y_preds, all_updates = [], []
            for replica, share, start in local:
                (xi,) = _slice((x,), start, share)
                with tf.device(replica.device):
                    y_pred, updates = self._forward(xi, training=False)
                y_preds.append(y_pred)
                all_updates.append((replica, share, updates))
            with tf.device(self.adapter.home):
                # The pass's assignments, as in the test step (Keras's predict
                # step applies them too).
                floats, ints = self._combined_state(all_updates, total)
                for variable, value in _with_variance_corrections(floats) + ints:
                    variable.assign(value)
                return self._gather_predictions(y_preds, shares)

        return step

    # -------------------------------------------------------------- helpers
    def _sum_scalar(self, values):
        import tensorflow as tf

        return tf.add_n(values) if len(values) > 1 else values[0]

    def _gather_sparse(self, slices, shares, variable, x):
        """Combines the replicas' sparse (`IndexedSlices`) gradients of `variable`.

        The result is the `IndexedSlices` one device would compute for the
        global batch, which depends on how the gradient was produced:

        - one row per lookup (`Embedding`, `tf.gather`: the gradient of the
          global batch has a row for every id of every sample, repeated ids
          included): the replicas' slices are concatenated in replica order;
        - rows deduplicated by a `Unique` op (`tf.nn.embedding_lookup_sparse`,
          which Keras's `Dense` uses on a `tf.SparseTensor` input: one row per
          distinct id, holding the sum over the batch): the concatenation is
          deduplicated again (`tf_reduce.merge_rows`), one row per id distinct over the
          global batch, in order of first appearance, holding the replicas'
          sum. Concatenating would repeat an id once per replica holding it,
          and optimizers that transform the slices before adding them (Adam
          squares them) would then differ from one device.

        `_rows_deduplicated` tells the two apart. Densifying and summing would
        give the second case's values but change what Keras's optimizers do
        with the first case's repeated indices.
        """
        import tensorflow as tf

        deduplicated = self._rows_deduplicated(variable, slices, x)
        dense_shape = slices[0].dense_shape
        if self.adapter.collective is None:
            with tf.device(self.adapter.home):
                return tf.IndexedSlices(*tf_reduce.concat_slices(slices, deduplicated),
                                        dense_shape)
        local_share = shares[self.local_indices[0]]
        rows = slices[0].values.shape[0]
        if (deduplicated or self.adapter.workers_share_devices or rows is None
                or rows % local_share):
            # Row counts other workers cannot derive from the shares: one
            # row per distinct id, several local replicas (no worker knows the
            # others' replicas' rows), or unknown rows per sample. The local
            # slices are concatenated (deduplicated rows merged first, fewer
            # to send) and all-gathered with their sizes; densifying and
            # summing would lose the repeated rows of a lookup's gradient.
            with tf.device(self.adapter.home):
                values, indices = tf_reduce.concat_slices(slices, deduplicated)
            values = tf_multiworker.all_gather_rows(self.adapter.collective, values)
            indices = tf_multiworker.all_gather_rows(self.adapter.collective, indices)
            if deduplicated:
                with tf.device(self.adapter.home):
                    values, indices = tf_reduce.merge_rows(values, indices)
            return tf.IndexedSlices(values, indices, dense_shape)
        # One replica per worker, rows a fixed number per sample: every worker
        # knows every worker's row count from the shares (one collective each).
        per_sample = rows // local_share
        sizes = [s * per_sample for s in shares]
        values = tf_multiworker.all_gather_uneven(self.adapter.collective, slices[0].values, sizes)
        indices = tf_multiworker.all_gather_uneven(self.adapter.collective, slices[0].indices, sizes)
        return tf.IndexedSlices(values, indices, dense_shape)

    def _rows_deduplicated(self, variable, slices, x):
        """Whether `variable`'s sparse gradient has one row per distinct id (see `_gather_sparse`).

        In a traced step, read from the graph: the rows of every replica's
        slices come straight (through reshapes, casts, identities) from the
        ids a `Unique` op returns. Every replica runs the same code, and a
        `Unique` over a replica's ids is, for the global batch, a `Unique`
        over all of them (or over the same ids, when they do not come from the
        batch), so one device's gradient has one row per distinct id of the
        global batch. In an eager step (`run_eagerly=True`) tensors carry no
        graph: the model's forward and backward pass is traced once (never
        run) on the batch and the same test is read from that trace; a
        variable whose gradient there is not `IndexedSlices` is taken as one
        row per lookup (concatenated).
        """
        return tf_reduce.rows_deduplicated(slices, variable, self.model, x,
                                           self.eager_rows_deduplicated)

    def _gather_predictions(self, y_preds, shares):
        from keras.src import tree

        if self.adapter.collective is None:
            if len(y_preds) == 1:
                return y_preds[0]
            return tree.map_structure(lambda *parts: _concat(parts), *y_preds)
        if not self._metrics_need_predictions():
            return y_preds[0]  # no metric reads them: skip the all-gather
        if self.adapter.workers_share_devices:
            raise BackendError(
                "This worker runs several replicas, and the model's metrics need predictions "
                "that cannot travel in the gradient all-reduce (they must be floating point "
                "with a batch axis). Run one worker per device (processes='per_device') or "
                "compile without metrics. Received: prediction dtypes "
                f"{sorted({str(t.dtype.name) for t in tree.flatten(y_preds[0])})}"
            )
        return tree.map_structure(
            lambda part: _with_mask(
                tf_multiworker.all_gather_uneven(self.adapter.collective, part, list(shares)),
                part, lambda m: tf_multiworker.all_gather_uneven(
                    self.adapter.collective, m, list(shares)),
            ),
            y_preds[0],
        )

    def _fold_predictions(self, y_preds, local, total):
        """This worker's predictions in place in zero global-batch tensors, or None.

        Summed over the workers, each such tensor is the global batch's
        predictions, exactly (every element is one worker's value plus zeros),
        so the train step adds them to the gradient all-reduce it makes anyway
        and skips the all-gather. A worker running several replicas places
        each replica's rows. None when there are no collectives, no metric
        reads the predictions, a prediction is not floating point or has no
        batch axis, or (one replica per worker, so they can be all-gathered
        instead) the predictions exceed `FOLDED_PREDICTIONS_MAX_ELEMENTS`.
        """
        import tensorflow as tf
        from keras.src import tree
        from keras.src.backend import get_keras_mask

        if self.adapter.collective is None or not self._metrics_need_predictions():
            return None
        per_replica = [tree.flatten(p) for p in y_preds]
        elements = 0
        for leaf in per_replica[0]:
            if (leaf.shape.rank in (None, 0) or not leaf.shape[1:].is_fully_defined()
                    or not leaf.dtype.is_floating):
                return None
            elements += total * leaf.shape[1:].num_elements()
        if not self.adapter.workers_share_devices and elements > FOLDED_PREDICTIONS_MAX_ELEMENTS:
            return None
        # Keras masks of masked outputs travel too, as 0/1 floats after the leaves.
        masks = [[get_keras_mask(leaf) for leaf in leaves] for leaves in per_replica]
        masked = [j for j in range(len(per_replica[0])) if masks[0][j] is not None]
        columns = [[leaves[j] for leaves in per_replica] for j in range(len(per_replica[0]))]
        columns += [[tf.cast(m[j], per_replica[0][j].dtype) for m in masks] for j in masked]
        folded = []
        for parts in columns:
            parts = [
                tf.pad(part, [[start, total - start - share]] + [[0, 0]] * (part.shape.rank - 1))
                for part, (_, share, start) in zip(parts, local)
            ]
            folded.append(tf.add_n(parts) if len(parts) > 1 else parts[0])
        return folded

    def _unfold_predictions(self, folded, structure):
        """The global predictions from summed `folded` tensors, masks set again.

        `structure` is a replica's predictions, as `_fold_predictions` got
        them: its masked leaves say which masks follow the leaves.
        """
        from keras.src import tree
        from keras.src.backend import get_keras_mask
        from keras.src.backend import set_keras_mask

        masked = [j for j, leaf in enumerate(tree.flatten(structure))
                  if get_keras_mask(leaf) is not None]
        leaves = folded[:len(folded) - len(masked)]
        for j, mask in zip(masked, folded[len(leaves):]):
            set_keras_mask(leaves[j], mask > 0.5)
        return tree.pack_sequence_as(structure, leaves)

    def _metrics_need_predictions(self):
        """False when compute_metrics is Keras' own and there are no compiled metrics."""
        from keras.src.trainers.trainer import Trainer

        model = self.model
        if getattr(type(model), "compute_metrics") is not Trainer.compute_metrics:
            return True
        metrics = getattr(model, "_compile_metrics", None)
        return metrics is not None and bool(getattr(metrics, "metrics", True))

    def _trackers(self, updates):
        """A `_TrackerRecord` of the custom metric trackers (`loss_trackers`),
        made after the first replica's forward pass and before its
        `compute_loss`; variables that pass assigned (a layer's metric
        updated in `call`, recorded with the other state) are left out.
        Other variables `compute_loss` assigns join it as they are assigned
        (`_TrackerRecord.watching`), except those of the compiled loss and
        metrics, which the steps make global themselves."""
        import tensorflow as tf

        assigned = {id(v) for v, _ in updates}
        variables = [v for v in loss_trackers.tracker_variables(self.model)
                     if id(v) not in assigned]
        excluded = assigned | loss_trackers.compiled_metric_variable_ids(self.model)
        with tf.device(self.adapter.home):
            return _TrackerRecord(variables, self.adapter.home, excluded,
                                  loss_trackers.metric_variable_ids(self.model))

    def _local_loss_and_state(self, weighted_losses, all_updates, total):
        """This process's summed weighted loss and its new non-trainable state.

        Non-trainable state assigned during the forward pass (batch
        normalisation moving statistics) becomes the share-weighted mean of
        the replicas' new values, so the moving mean follows the global
        batch mean exactly; `_SecondMoment` entries let
        `_with_variance_corrections` make the moving variance exact too;
        integer state (seed counters) takes the first replica's value, but
        for integer state declared `aggregation="sum"`, which gets the sum of
        the replicas' changes (`loss_trackers.sums_replica_changes`). With
        several workers the loss and the float values are partial sums still
        to be all-reduced (the train step carries them in a gradient bucket's
        all-reduce, else `_all_reduce_loss_and_state`) before the caller
        assigns them.

        Returns:
            `(loss, floats, ints)`: the loss, and `(variable, value)` pairs
            of float and of integer state.
        """
        floats, ints = self._combined_state(all_updates, total)
        return self._sum_scalar(weighted_losses), floats, ints

    def _combined_state(self, all_updates, total):
        """`(floats, ints)` of `_local_loss_and_state`: the replicas' assigned
        state (`[(replica, share, [(variable, value), ...]), ...]`) combined."""
        import tensorflow as tf

        order, values = [], {}
        for _, share, updates in all_updates:
            for variable, value in updates:
                if id(variable) not in values:
                    order.append(variable)
                    values[id(variable)] = []
                values[id(variable)].append((share, value))
        floats, ints = [], []
        metric_ids = None
        for variable in order:
            entries = values[id(variable)]
            if loss_trackers.is_float(variable):
                parts = [
                    tf.cast(v, variable.dtype) * tf.constant(s / total, variable.dtype)
                    for s, v in entries
                ]
                floats.append((variable, tf.add_n(parts) if len(parts) > 1 else parts[0]))
                continue
            if metric_ids is None:
                metric_ids = loss_trackers.metric_variable_ids(self.model)
            if loss_trackers.sums_replica_changes(variable, metric_ids):
                old = tf.identity(variable.value)
                floats.append(_summed_changes(variable, old, [v for _, v in entries]))
            else:
                ints.append((variable, entries[0][1]))
        floats += self._second_moments(values, total)
        return floats, ints

    def _second_moments(self, values, total):
        """`(_SecondMoment, sum_r w_r d_r^2)` entries for the float state, one per
        BatchNormalization layer whose moving mean this process updated
        (`batchnorm_stats`): summed over the workers with the other float
        state, they make the moving variance that of the global batch."""
        import tensorflow as tf

        if len(self.replicas or ()) < 2:
            return []
        out = []
        for mean, variance, momentum in batchnorm_stats.moving_pairs(self.model):
            entries = values.get(id(mean), [])
            if not entries or id(variance) not in values:
                continue
            old = tf.cast(mean.value, tf.float32)
            out.append((_SecondMoment(mean, variance, momentum), tf.add_n(
                [tf.cast(s / total, tf.float32) * tf.square(tf.cast(v, tf.float32) - old)
                 for s, v in entries])))
        return out

    def _all_reduce_loss_and_state(self, loss, floats, folded=None):
        """Sums the loss, float state and folded predictions over the workers in one
        fused all-reduce; returns them as `(loss, floats, folded)`."""
        summed = tf_multiworker.all_reduce_sum_many(
            self.adapter.collective, [loss] + [v for _, v in floats] + (folded or [])
        )
        return _split_extras(summed, floats, folded)

# ------------------------------------------------------------------ helpers
# The train steps traced again for changed optimizer settings before a warning.
_SETTINGS_RETRACES_WARNED = 5


def _standardise(data):
    import tensorflow as tf

    from keras.src import tree

    def convert(v):
        if v is None or isinstance(v, tf.experimental.Optional):
            return None
        if isinstance(v, (tf.Tensor, tf.SparseTensor, tf.RaggedTensor)):
            return v
        return tf.convert_to_tensor(v)

    if isinstance(data, list):
        data = tuple(data)
    return tree.map_structure(convert, data)


class _TrackerRecord:
    """The custom metric trackers' values each replica's `compute_loss` left,
    and those of any other variable `compute_loss` assigned (`watching`).

    Made before the first replica's `compute_loss` (it reads the old
    values); `record` after each replica's reads the new values and, except
    after the last replica, restores the old ones, so every replica updates
    from the same state. `floats` gives `(_TrackerDelta, sum_r w_r (new_r -
    old))` entries, summed over the workers with the other float state, and
    `_with_variance_corrections` turns them into `old + sum`: one update of
    the whole batch (`loss_trackers`). Integer variables take the first
    replica's value, like integer layer state, except those declared
    `aggregation="sum"` (`loss_trackers.sums_replica_changes`): `floats`
    gives them as `(_TrackerDelta, sum_r (new_r - old))`, so a count of
    rows advances by the whole batch (over the workers too).
    """

    def __init__(self, variables, device, excluded=(), metric_ids=()):
        import tensorflow as tf

        self.variables = list(variables)
        self.device = device
        self.old = [tf.identity(v.value) for v in self.variables]
        self.new = []  # (share, [value per variable]) per replica
        # Variables `watching` leaves alone: the compiled metrics, the compiled
        # (per-output) loss trackers, state the forward pass recorded.
        self._excluded = set(excluded) | {id(v) for v in self.variables}
        self._graph = None  # the graph `watching` began in (None: eager)
        self._metric_ids = metric_ids

    def _summed(self, variable):
        return loss_trackers.sums_replica_changes(variable, self._metric_ids)

    def watching(self):
        """A context in which every variable that gets assigned (by a
        `compute_loss` override: a moving average of the loss, a step
        counter) joins the record at its first assignment, its old value
        read just before it (`tf_assign_watch`), in the step's own graph even
        when the assignment is in a `tf.cond` branch or a loop body. A
        variable a later replica assigns first counts as unchanged by the
        replicas before it. A `SeedGenerator`'s state is left out: each
        replica goes on drawing after the one before (restored, every replica
        would draw the same numbers for its rows).

        Returns:
            A context manager.
        """
        self._graph = _outer_graph()
        return tf_assign_watch.watching(self._learn)

    def _learn(self, variable):
        import tensorflow as tf

        if id(variable) in self._excluded:
            return
        self._excluded.add(id(variable))
        if replica_random.is_seed_state(variable):
            return
        graph = self._graph
        # An assignment in a control-flow branch or a nested function is traced in
        # a graph of its own, whose tensors the step cannot use: read the old
        # value in the step's graph (ordered before the branch that assigns).
        outer = (graph.as_default() if graph is not None
                 and tf.compat.v1.get_default_graph() is not graph
                 else contextlib.nullcontext())
        with outer, tf.device(self.device):
            old = tf.identity(variable.value)
        self.variables.append(variable)
        self.old.append(old)
        for _, values in self.new:  # replicas already recorded left it as it was
            values.append(old)

    def record(self, share, restore):
        import tensorflow as tf

        if not self.variables:
            return
        with tf.device(self.device):
            self.new.append((share, [tf.identity(v.value) for v in self.variables]))
            if restore:
                for v, old in zip(self.variables, self.old):
                    v.assign(old)

    def floats(self, total):
        import tensorflow as tf

        out = []
        for j, (v, old) in enumerate(zip(self.variables, self.old)):
            if not self.new:
                continue
            if self._summed(v):
                out.append(_summed_changes(v, old, [values[j] for _, values in self.new]))
            if not loss_trackers.is_float(v):
                continue
            parts = [tf.constant(s / total, old.dtype) * (values[j] - old) for s, values in self.new]
            out.append((_TrackerDelta(v, old), tf.add_n(parts) if len(parts) > 1 else parts[0]))
        return out

    def ints(self):
        return [(v, self.new[0][1][j]) for j, v in enumerate(self.variables)
                if not loss_trackers.is_float(v) and not self._summed(v) and self.new]


class _TrackerDelta:
    """A float-state entry that is no variable's value: the share-weighted
    change of a custom metric tracker's variable (`_TrackerRecord`)."""

    def __init__(self, variable, old):
        self.variable, self.old = variable, old


def _summed_changes(variable, old, new_values):
    """The float-state entry of an integer variable declared `aggregation="sum"`:
    `(_TrackerDelta(variable, old), sum_r (new_r - old))`, its replicas'
    changes added up (summed over the workers with the float state, in
    float32: exact while a step's change stays below 2**24)."""
    import tensorflow as tf

    changes = [tf.cast(v, variable.dtype) - old for v in new_values]
    return _TrackerDelta(variable, old), tf.add_n(changes) if len(changes) > 1 else changes[0]


class _SecondMoment:
    """A float-state entry that is no variable: `sum_r w_r d_r^2` of a
    BatchNormalization layer's moving-mean changes (`batchnorm_stats`)."""

    def __init__(self, mean, variance, momentum):
        self.mean, self.variance, self.momentum = mean, variance, momentum


def _with_variance_corrections(floats):
    """The summed float state to assign: `_SecondMoment` entries removed, their
    corrections added to the moving variances (`batchnorm_stats`), and the
    summed changes of `_TrackerDelta` entries added to their old values."""
    import tensorflow as tf

    floats = [(entry.variable, entry.old + value) if isinstance(entry, _TrackerDelta)
              else (entry, value) for entry, value in floats]

    summed = {id(v): value for v, value in floats if not isinstance(v, _SecondMoment)}
    corrections = {}
    for entry, second in floats:
        if isinstance(entry, _SecondMoment):
            first = tf.cast(summed[id(entry.mean)], tf.float32) - tf.cast(entry.mean.value,
                                                                          tf.float32)
            corrections[id(entry.variance)] = batchnorm_stats.variance_correction(
                first, second, entry.momentum)
    return [(v, value + tf.cast(corrections[id(v)], value.dtype) if id(v) in corrections
             else value)
            for v, value in floats if not isinstance(v, _SecondMoment)]


def _split_extras(values, floats, folded):
    """Splits summed `[loss] + state values + folded predictions` back apart."""
    loss = values[0]
    state = [(variable, value) for (variable, _), value in zip(floats, values[1:])]
    rest = list(values[1 + len(floats):])
    return loss, state, (rest if folded is not None else None)


def _slice(structures, start, size):
    import tensorflow as tf
    from keras.src import tree

    def cut(t):
        if t is None:
            return None
        if isinstance(t, tf.SparseTensor):  # rows of a sparse batch (sparse Keras inputs)
            rest = t.dense_shape[1:]
            return tf.sparse.slice(
                t, tf.concat([[start], tf.zeros_like(rest)], 0), tf.concat([[size], rest], 0))
        return t[start:start + size]

    return tuple(tree.map_structure(cut, s) if s is not None else None for s in structures)


def _concat(parts):
    """Concatenates the replicas' parts along the batch axis, with their Keras masks.

    A masked output's metrics (and per-output losses) read the mask of the
    prediction they get; `tf.concat` alone drops it.
    """
    import tensorflow as tf
    from keras.src.backend import get_keras_mask
    from keras.src.backend import set_keras_mask

    if parts[0].shape.rank == 0:
        return tf.stack(parts)
    whole = tf.concat(parts, axis=0)
    masks = [get_keras_mask(p) for p in parts]
    if all(m is not None for m in masks):
        set_keras_mask(whole, tf.concat(masks, axis=0))
    return whole


def _with_mask(whole, part, gather):
    """`whole` with the mask of `part` gathered by `gather` (0/1 floats), if it has one."""
    import tensorflow as tf
    from keras.src.backend import get_keras_mask
    from keras.src.backend import set_keras_mask

    mask = get_keras_mask(part)
    if mask is not None:
        set_keras_mask(whole, gather(tf.cast(mask, "float32")) > 0.5)
    return whole


def _concat_structures(a, b):
    from keras.src import tree

    return tree.map_structure(lambda u, v: _concat([u, v]), a, b)


def _dtype_name(variable):
    import keras

    return keras.backend.standardize_dtype(variable.dtype)


# ---------------------------------------------------------------- benchmarks
def run_steps(
    model_fn,
    plan_or_strategy_name,
    cluster,
    x,
    y,
    batch_size,
    steps,
    warmup=3,
    processes=None,
    timeout_s=600,
    options=None,
    devices=None,
    details=False,
):
    """Times training steps of a model under a plan (measured wall time).

    With `processes=False` the steps run in this process on logical
    devices (the whole step, every replica, is timed). With
    `processes=True` (the default for a cluster whose devices have CPU
    affinities, i.e. the CPU testbed) one worker process per device is
    started on this machine, each pinned to its device's cores with its
    thread count, and the times are rank 0's steps, each of which includes
    waiting for the slowest worker at the gradient all-reduce.

    Args:
        model_fn: A top-level function (or `"module:function"`) returning a
            compiled Keras model; it is called inside `strategy.scope()`.
        plan_or_strategy_name: A `Plan` or a strategy name
            (`"single_device"`, `"data_parallel"`, `"proportional"`, `"auto"`).
        cluster: The `Cluster` (or anything `Cluster.resolve` accepts).
        x: Input NumPy array.
        y: Target NumPy array.
        batch_size: Global batch size.
        steps: Number of timed steps.
        warmup: Steps run first and not timed (tracing, start-up).
        processes: Run one process per device (see above); default: True
            when the cluster's devices have CPU affinities and the plan is
            data-parallel (a placement plan always runs in this process).
            `"per_core"`: one process per core set instead, devices sharing
            cores sharing a process (`launch_local_workers`); `"per_device"`
            is the same as True.
        timeout_s: Give up (and kill workers) after this many seconds.
        options: Extra `AutoStrategy` options (e.g. `{"sync": "ps"}`).
        devices: Device names to use (default: the plan's devices for a
            `Plan`, else all of the cluster's). With `processes=True` one
            pinned worker runs per device, so a single-device strategy is
            timed with `devices=[that device]`.
        details: Return per-rank figures as well (see Returns).

    Returns:
        A list of `steps` step times in seconds. With `details=True`, a dict:
        `"step_times_s"` (that list) and `"ranks"`, one dict per rank (one
        for the whole process when `processes=False`) with `"device"`,
        `"share"` (its samples per step), `"step_times_s"` and
        `"cpu_times_s"` (the process's CPU time per step, all threads;
        measured steps only).

    Example:

    ```python
    times = run_steps("mymodels:mlp", "proportional", Cluster.cpu_testbed(),
                      x, y, batch_size=48, steps=20)
    ```
    """
    import numpy as np

    from autodist_keras.devices import Cluster
    from autodist_keras.strategies.plan import Plan

    cluster = Cluster.resolve(cluster)
    options = dict(options or {})
    if devices is None and isinstance(plan_or_strategy_name, Plan):
        devices = list(plan_or_strategy_name.devices)
    placement = isinstance(plan_or_strategy_name, Plan) and not plan_or_strategy_name.is_data_parallel
    if processes is None:
        processes = not placement and any(d.cpu_affinity is not None for d in cluster.devices)
    if processes and placement:
        raise BackendError(
            "A placement or hybrid plan (several layer groups) runs in one process that drives "
            "every device; it cannot be timed with one worker process per device. Pass "
            f"processes=False. Received: {len(plan_or_strategy_name.groups)} groups, processes=True"
        )
    x = np.asarray(x)
    y = np.asarray(y)
    if processes:
        layout = processes if isinstance(processes, str) else "per_device"
        results = tf_multiworker.launch_local_workers(
            model_fn=model_fn,
            plan=plan_or_strategy_name if isinstance(plan_or_strategy_name, Plan) else None,
            strategy=None if isinstance(plan_or_strategy_name, Plan) else plan_or_strategy_name,
            cluster=cluster,
            x=x,
            y=y,
            batch_size=batch_size,
            steps=steps + warmup,
            options=options,
            timeout_s=timeout_s,
            drop_remainder=True,
            devices=devices,
            processes=layout,
        )
        times = list(results[0]["step_times_s"][warmup:])
        if not details:
            return times
        ranks = [{"device": r.get("device"), "devices": r.get("devices"), "share": r.get("share"),
                  "step_times_s": list(r["step_times_s"][warmup:]),
                  "cpu_times_s": list(r.get("cpu_times_s", [])[warmup:])}
                 for r in results]
        return {"step_times_s": times, "ranks": ranks}
    from autodist_keras.strategies.auto import AutoStrategy

    if isinstance(plan_or_strategy_name, Plan):
        strategy = AutoStrategy(cluster=cluster, plan=plan_or_strategy_name, devices=devices,
                                **options)
    else:
        strategy = AutoStrategy(strategy=plan_or_strategy_name, cluster=cluster, devices=devices,
                                **options)
    fn = tf_multiworker.resolve_callable(model_fn)
    with strategy.scope():
        model = fn()
    timer = StepTimes()
    fit_repeating(model, x, y, batch_size, steps + warmup, [timer], drop_remainder=True)
    if not details:
        return timer.times_s[warmup:]
    plan = strategy.plan
    return {"step_times_s": timer.times_s[warmup:],
            "ranks": [{"device": ",".join(plan.devices), "share": batch_size,
                       "step_times_s": timer.times_s[warmup:],
                       "cpu_times_s": timer.cpu_times_s[warmup:]}]}


def fit_repeating(model, x, y, batch_size, steps, callbacks, drop_remainder=False):
    """Runs `steps` training steps over `(x, y)` batches in order, repeating the data.

    Args:
        model: A compiled model.
        x, y: NumPy arrays.
        batch_size: Global batch size.
        steps: Number of training steps.
        callbacks: Keras callbacks.
        drop_remainder: Drop the last partial batch of each pass over the data
            (for timing: every step then has the full batch).

    Returns:
        The `History`.
    """
    import tensorflow as tf

    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        batch_size, drop_remainder=drop_remainder
    )
    dataset = dataset.repeat()
    return model.fit(dataset, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=callbacks,
                     shuffle=False)


def _step_timer_class():
    from autodist_keras.timing import StepTimer

    class StepTimes(StepTimer):
        """`StepTimer` without warm-up whose clock stops when the logs are ready.

        TensorFlow may hand the callback logs whose values are still being
        computed; reading them waits for the step, so the wall time (and the
        process's CPU time, `cpu_times_s`) covers the whole step.
        """

        def __init__(self):
            super().__init__(warmup=0)

        def on_train_batch_end(self, batch, logs=None):
            for value in (logs or {}).values():
                if hasattr(value, "numpy"):
                    value.numpy()  # wait for the step's results
            super().on_train_batch_end(batch, logs)

    return StepTimes


def StepTimes():  # noqa: N802  (a class made lazily so keras loads only when used)
    """Returns a Keras callback recording each training step's wall time in `.times_s`.

    It also records the process's CPU time per step in `.cpu_times_s`.
    """
    return _step_timer_class()()

