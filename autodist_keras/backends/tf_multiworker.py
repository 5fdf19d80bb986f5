"""Several TensorFlow worker processes: TF_CONFIG, pinning, collectives, local launch.

One job: everything the TensorFlow adapter needs when one plan replica runs
per process. Workers follow the `TF_CONFIG` convention of
`tf.distribute.MultiWorkerMirroredStrategy`; the strategy is used only for
its collectives (all-reduce and all-gather across workers), called from the
adapter's own train step. `launch_local_workers` starts such workers on this
machine over loopback, which is how the CPU testbed's per-device cores and
thread counts become real: one process per device, or one process per core
set, whose devices (logical CPU devices) share that process's collectives
the way a multi-GPU worker's GPUs do (`WORKER_DEVICES_ENV`).

Example:

```python
results = launch_local_workers(
    model_fn="mymodels:mlp", strategy="proportional", plan=None,
    cluster=Cluster.cpu_testbed(), x=x, y=y, batch_size=48, steps=20,
)
print(results[0]["step_times_s"])
```
"""

import dataclasses
import importlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from autodist_keras.backends.processes import process_alive
from autodist_keras.backends.tf_worker import PARENT_PID_ENV
from autodist_keras.errors import BackendError
from autodist_keras.errors import WorkerError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# JSON list of the plan device names one worker process runs (a replica each),
# set for every process by `launch_local_workers`. Unset: one device per
# worker, the worker's rank indexing the strategy's devices.
WORKER_DEVICES_ENV = "AUTODIST_KERAS_WORKER_DEVICES"

PROCESS_LAYOUTS = ("per_device", "per_core")


@dataclasses.dataclass
class WorkerInfo:
    """This process's place among the workers `TF_CONFIG` describes.

    Args:
        num_workers: Number of tasks (chief and workers).
        rank: This task's rank: the chief first, then workers by index.
        task_type: `"worker"` or `"chief"`.
        task_index: Index within its task type.
        addresses: `host:port` of every task, by rank.
    """

    num_workers: int
    rank: int
    task_type: str
    task_index: int
    addresses: list


def parse_tf_config(environ=None):
    """Reads `TF_CONFIG`; returns a `WorkerInfo` when it names two or more tasks.

    Args:
        environ: Mapping to read from (default `os.environ`).

    Returns:
        `WorkerInfo`, or None when `TF_CONFIG` is unset or names one task.

    Raises:
        BackendError: If `TF_CONFIG` is not valid JSON or lacks `cluster`/`task`.
    """
    environ = os.environ if environ is None else environ
    text = environ.get("TF_CONFIG")
    if not text:
        return None
    try:
        config = json.loads(text)
        cluster = config["cluster"]
        task = config["task"]
        task_type = task["type"]
        task_index = int(task["index"])
    except (ValueError, KeyError, TypeError) as e:
        raise BackendError(
            "TF_CONFIG must be JSON like {\"cluster\": {\"worker\": [\"host:port\", ...]}, "
            "\"task\": {\"type\": \"worker\", \"index\": 0}}. "
            f"Received: {text[:200]!r} ({type(e).__name__}: {e})"
        ) from None
    addresses = list(cluster.get("chief", [])) + list(cluster.get("worker", []))
    if len(addresses) < 2:
        return None
    if task_type == "chief":
        rank = task_index
    elif task_type == "worker":
        rank = len(cluster.get("chief", [])) + task_index
    else:
        raise BackendError(
            "The TensorFlow adapter runs 'chief' and 'worker' tasks only (no parameter-server "
            f"or evaluator tasks). Received: task type {task_type!r}"
        )
    if not 0 <= rank < len(addresses):
        raise BackendError(
            f"TF_CONFIG task index {task_index} is outside the {task_type} list. "
            f"Received: {task!r}"
        )
    return WorkerInfo(len(addresses), rank, task_type, task_index, addresses)


def pin_process(cores, threads=None):
    """Restricts this process (every thread) to `cores` and TF to `threads` threads.

    Must run before TensorFlow starts its thread pools (its first op).

    Args:
        cores: CPU core ids.
        threads: Intra-op threads for TensorFlow (inter-op gets the same, at
            least 2, so collectives can progress); None leaves TF's default.

    Raises:
        BackendError: If TensorFlow already started.
    """
    import tensorflow as tf

    cores = set(int(c) for c in cores)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:
            pass
    os.sched_setaffinity(0, cores)
    if threads:
        try:
            tf.config.threading.set_intra_op_parallelism_threads(int(threads))
            tf.config.threading.set_inter_op_parallelism_threads(max(2, int(threads)))
        except RuntimeError:
            raise BackendError(
                "TensorFlow already started, so this worker's thread count cannot be set. "
                "Create the AutoStrategy before running any TensorFlow op. "
                f"Received: threads={threads}"
            ) from None


def worker_device_names(environ=None):
    """The plan devices this worker process runs, from `WORKER_DEVICES_ENV`.

    Args:
        environ: Mapping to read from (default `os.environ`).

    Returns:
        A list of device names, or None when the variable is unset.

    Raises:
        BackendError: If the value is not a JSON list of device names.
    """
    environ = os.environ if environ is None else environ
    text = environ.get(WORKER_DEVICES_ENV)
    if not text:
        return None
    try:
        names = json.loads(text)
    except ValueError:
        names = None
    if (not isinstance(names, list) or not names
            or not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names)):
        raise BackendError(
            f"{WORKER_DEVICES_ENV} must be a JSON list of distinct device names, e.g. "
            f'\'["node0/cpu1", "node0/cpu2"]\'. Received: {text[:200]!r}'
        )
    return names


def local_device_names(worker, devices, environ=None):
    """The plan devices this process runs: `WORKER_DEVICES_ENV`, else its rank's device.

    Args:
        worker: This process's `WorkerInfo` (None outside multi-worker mode).
        devices: The strategy's device names, in order.
        environ: Mapping to read from (default `os.environ`).

    Returns:
        A list of names from `devices`.

    Raises:
        BackendError: If the variable names devices outside `devices`, or,
            without it, the workers are not one per device.
    """
    devices = list(devices)
    mine = worker_device_names(environ)
    if mine is None:
        if worker is None:
            return devices[:1]
        if worker.num_workers != len(devices):
            raise BackendError(
                f"TF_CONFIG describes {worker.num_workers} worker tasks but the strategy "
                f"uses {len(devices)} devices ({devices}); run one worker process per device, "
                "in the order of the strategy's devices, or name each worker's devices in "
                f"{WORKER_DEVICES_ENV}. "
                f"Received: {worker.num_workers} tasks for {len(devices)} devices"
            )
        return [devices[worker.rank]]
    unknown = [n for n in mine if n not in devices]
    if unknown:
        raise BackendError(
            f"{WORKER_DEVICES_ENV} names devices the strategy does not use "
            f"({unknown}); name some of {devices}. Received: {mine}"
        )
    return mine


def group_devices(cluster, devices, processes="per_device"):
    """Splits `devices` into the sets that one worker process each runs.

    Args:
        cluster: The `Cluster`.
        devices: Device names, in the strategy's order.
        processes: `"per_device"` (one process per device) or `"per_core"`:
            devices of one node with the same CPU affinity (testbed devices
            sharing cores) share a process; devices without an affinity
            (GPUs) keep one process each.

    Returns:
        A list of lists of names, ordered by each set's first device.

    Raises:
        BackendError: If `processes` is not one of `PROCESS_LAYOUTS`.
    """
    if processes not in PROCESS_LAYOUTS:
        raise BackendError(
            f"processes must be one of {list(PROCESS_LAYOUTS)}. Received: {processes!r}"
        )
    groups, by_key = [], {}
    for name in devices:
        device = cluster.device(name)
        if processes == "per_device" or device.cpu_affinity is None:
            groups.append([name])
            continue
        key = (device.node, tuple(sorted(device.cpu_affinity)))
        if key in by_key:
            by_key[key].append(name)
        else:
            by_key[key] = [name]
            groups.append(by_key[key])
    return groups


def pinning_for(devices):
    """The cores and TensorFlow thread count of a process running `devices`.

    Args:
        devices: `Device`s of the CPU testbed (with `cpu_affinity`).

    Returns:
        `(cores, threads)`: the union of the devices' cores, and the sum of
        their thread counts capped at that many cores (devices sharing one
        core share one thread); `(None, None)` when a device has no affinity.
    """
    if not devices or any(d.cpu_affinity is None for d in devices):
        return None, None
    cores = sorted({int(c) for d in devices for c in d.cpu_affinity})
    if any(d.threads is None for d in devices):
        return cores, None
    return cores, min(sum(int(d.threads) for d in devices), len(cores))


def make_collective_strategy(timeout_s=300, worker=None):
    """Creates the `MultiWorkerMirroredStrategy` whose collectives the adapter uses.

    TensorFlow waits for every task `TF_CONFIG` names, without a time limit,
    holding the interpreter (no Python thread runs meanwhile) and catching
    SIGTERM. So a worker that was not started by `launch_local_workers` says
    first, on stderr, which tasks it waits for: a `TF_CONFIG` left over from
    an earlier job otherwise looks like a silent hang that SIGTERM cannot end.

    Args:
        timeout_s: The collectives' timeout.
        worker: This process's `WorkerInfo`, for that line.

    Raises:
        BackendError: If TensorFlow already started (collectives must be
            configured at program start).
    """
    import tensorflow as tf

    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING,
        timeout_seconds=float(timeout_s),
    )
    if worker is not None and not os.environ.get(PARENT_PID_ENV):
        others = [a for r, a in enumerate(worker.addresses) if r != worker.rank]
        print(
            f"autodist_keras: {worker.task_type} {worker.task_index} of TF_CONFIG "
            f"({worker.addresses[worker.rank]}) joins the other tasks it names ({others}). "
            "(TensorFlow waits for all of them without a time limit, and SIGTERM does not "
            "stop it meanwhile: if this waits because TF_CONFIG is left over from an earlier "
            f"job, stop it with kill -9 {os.getpid()} and unset TF_CONFIG.)",
            file=sys.stderr, flush=True,
        )
    try:
        return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    except (RuntimeError, ValueError) as e:
        raise BackendError(
            "Could not start the multi-worker collectives. Create the AutoStrategy before "
            "running any TensorFlow op, and check that TF_CONFIG lists reachable host:port "
            f"addresses. Received: {type(e).__name__}: {e}"
        ) from None


_REMOTE_TASK = re.compile(r"remote target /job:(chief|worker)/replica:\d+/task:(\d+)")
_ABORTED_BY = re.compile(r"Collective ops is aborted by: [^\n]*")


def collective_failure(error, worker, timeout_s):
    """The error to raise when a step's collective failed because of another worker.

    Every worker runs every step's collectives. When one worker stops (an
    exception in its script or callbacks, a kill) the others get
    TensorFlow's "Collective ops is aborted by: Socket closed" after a
    70-line graph trace, which names neither the worker nor the cause.

    Args:
        error: The `tf.errors.OpError` a step raised.
        worker: This process's `WorkerInfo`.
        timeout_s: The collectives' timeout (AutoStrategy's `timeout_s`).

    Returns:
        A `WorkerError` naming the other worker, or a `BackendError` for a
        timeout or for a lost coordination service among three or more
        workers (rank 0's: it often stopped only because another worker
        failed first, so it is not blamed; with two, rank 0 is named), or
        None when `error` is no collective failure.
    """
    import tensorflow as tf

    text = str(error)
    aborted = _ABORTED_BY.search(text)
    if isinstance(error, tf.errors.DeadlineExceededError):
        if aborted is None and "Collective" not in text:
            return None  # a deadline of something else (reading a remote file, say)
        said = aborted.group(0).strip() if aborted else "collective timed out"
        return BackendError(
            f"Worker rank {worker.rank} waited timeout_s={timeout_s:g} s for the other workers "
            "in a collective: one of them is stuck or much slower (a callback that runs long "
            "on one worker, a worker that evaluates or saves alone). Check the other workers' "
            "output, or raise AutoStrategy(timeout_s=...). "
            f"Received: {type(error).__name__}: {said}"
        )
    if not isinstance(error, (tf.errors.UnavailableError, tf.errors.CancelledError,
                              tf.errors.AbortedError)) or aborted is None:
        return None
    if "coordination service" in aborted.group(0) and worker.num_workers > 2:
        # The service runs on rank 0 (the chief, else worker 0). With three or more
        # workers, rank 0 often stopped only because another worker failed first and
        # aborted its collective: blaming it would send the user to a healthy log.
        # (With two, rank 0 is the other worker: named below.)
        chiefs = (worker.rank - worker.task_index if worker.task_type == "worker" else 1)
        leader = "chief 0" if chiefs else "worker 0"
        return BackendError(
            f"A collective failed: {leader} of TF_CONFIG, which runs TensorFlow's "
            "coordination service, stopped or became unreachable during this step. It may "
            "have failed itself (an exception in its script or callbacks, a kill, a network "
            "failure) or stopped because another worker failed first: the earliest error in "
            f"the {worker.num_workers} workers' output is the cause. Every worker runs every "
            f"step, so worker rank {worker.rank} stops too. "
            f"Received: {type(error).__name__}: {aborted.group(0).strip()}"
        )
    remote = _REMOTE_TASK.search(text)
    if "coordination service" in aborted.group(0):  # two workers: the other one is rank 0
        chiefs = (worker.rank - worker.task_index if worker.task_type == "worker" else 1)
        peer, who = 0, ("chief 0" if chiefs else "worker 0") + " of TF_CONFIG"
    elif remote is None:
        peer, who = None, "another worker"
    else:
        job, index = remote.group(1), int(remote.group(2))
        chiefs = worker.rank - worker.task_index if worker.task_type == "worker" else 1
        peer = index if job == "chief" else chiefs + index
        who = f"{job} {index} of TF_CONFIG"
    message = (
        f"{who} stopped or became unreachable during a collective of this step (an "
        "exception in its script or callbacks, a kill, a network failure); its own output "
        f"says why. Every worker runs every step, so worker rank {worker.rank} stops too. "
        f"Received: {type(error).__name__}: {aborted.group(0).strip()}"
    )
    return BackendError("A collective failed: " + message) if peer is None else WorkerError(
        peer, message)


def replica_id(strategy):
    """This worker's replica id in the collective group."""
    import tensorflow as tf

    def fn():
        ctx = tf.distribute.get_replica_context()
        return tf.identity(ctx.replica_id_in_sync_group)

    out = strategy.run(fn)
    return int(strategy.experimental_local_results(out)[0])


def all_reduce_sum(strategy, tensor):
    """Sums `tensor` over all workers (one collective all-reduce)."""
    import tensorflow as tf

    def fn(t):
        ctx = tf.distribute.get_replica_context()
        return ctx.all_reduce(tf.distribute.ReduceOp.SUM, tf.identity(t))

    out = strategy.run(fn, args=(tensor,))
    return strategy.experimental_local_results(out)[0]


def all_reduce_sum_many(strategy, tensors):
    """Sums several tensors over all workers with one fused all-reduce.

    The tensors are flattened into one float32 buffer, summed, split and
    cast back to their dtypes.
    """
    import tensorflow as tf

    if len(tensors) == 1:
        return [all_reduce_sum(strategy, tensors[0])]
    flat = tf.concat([tf.reshape(tf.cast(t, "float32"), [-1]) for t in tensors], axis=0)
    total = all_reduce_sum(strategy, flat)
    sizes = [int(_num_elements(t.shape)) for t in tensors]
    return [
        tf.cast(tf.reshape(part, t.shape), t.dtype)
        for t, part in zip(tensors, tf.split(total, sizes))
    ]


def all_reduce_sum_with(strategy, buffer, extras):
    """Sums a flat float32 `buffer` and some small tensors in one all-reduce.

    Args:
        strategy: The collective strategy.
        buffer: A 1-D float32 tensor (a fused gradient bucket).
        extras: Tensors of any float dtype and shape (the loss, state values).

    Returns:
        `(summed_buffer, summed_extras)`, the extras in their own dtypes and shapes.
    """
    import tensorflow as tf

    parts = [tf.reshape(tf.cast(t, "float32"), [-1]) for t in extras]
    total = all_reduce_sum(strategy, tf.concat([buffer] + parts, axis=0))
    sizes = [int(_num_elements(t.shape)) for t in extras]
    pieces = tf.split(total, [int(buffer.shape[0])] + sizes)
    return pieces[0], [tf.cast(tf.reshape(p, t.shape), t.dtype)
                       for t, p in zip(extras, pieces[1:])]


def _num_elements(shape):
    n = 1
    for d in shape:
        n *= int(d)
    return n


def all_gather_uneven(strategy, tensor, shares):
    """Concatenates each worker's `tensor` (first dims `shares[rank]`) in rank order.

    Collective all-gather needs equal shapes, so every part is padded to
    the largest share and the padding is cut after the gather.
    """
    import tensorflow as tf

    if tensor.shape.rank == 0:
        tensor = tf.reshape(tensor, [1])
        shares = [1] * len(shares)
    largest = max(shares)
    pad = [[0, largest - int(tensor.shape[0])]] + [[0, 0]] * (tensor.shape.rank - 1)
    padded = tf.pad(tensor, pad)

    def fn(t):
        ctx = tf.distribute.get_replica_context()
        return ctx.all_gather(tf.identity(t), axis=0)

    out = strategy.run(fn, args=(padded,))
    gathered = strategy.experimental_local_results(out)[0]
    parts = [gathered[k * largest:k * largest + s] for k, s in enumerate(shares)]
    return tf.concat(parts, axis=0)


def all_gather_rows(strategy, tensor):
    """Concatenates each worker's `tensor` in rank order; first dimensions may differ and be unknown.

    TensorFlow's collective all-gather exchanges the workers' first
    dimensions, pads to the largest and cuts the padding (two collectives):
    for row counts no worker can know in advance, such as a sparse
    gradient's (`all_gather_uneven` needs them, and pads with one).
    """
    import tensorflow as tf

    def fn(t):
        ctx = tf.distribute.get_replica_context()
        return ctx.all_gather(tf.identity(t), axis=0)

    out = strategy.run(fn, args=(tensor,))
    return strategy.experimental_local_results(out)[0]


def check_device_ownership(strategy, devices, mine):
    """Checks that every device is run by exactly one worker (one collective).

    Each worker contributes a 0/1 vector over `devices` marking `mine`; the
    sum must be all ones, else gradients would be summed twice or missed.

    Args:
        strategy: The collective strategy.
        devices: The strategy's device names (the same list on every worker).
        mine: The names this worker runs.

    Raises:
        BackendError: Naming the devices no worker, or several workers, run.
    """
    import tensorflow as tf

    marks = tf.constant([1.0 if name in mine else 0.0 for name in devices])
    counts = tf.function(lambda t: all_reduce_sum(strategy, t), autograph=False)(marks)
    counts = [int(round(float(c))) for c in counts.numpy()]
    wrong = {name: c for name, c in zip(devices, counts) if c != 1}
    if wrong:
        raise BackendError(
            "Every device must be run by exactly one worker process, but some are run by "
            f"none or by several (device: number of workers) {wrong}. Give the workers "
            f"disjoint {WORKER_DEVICES_ENV} lists that together cover {list(devices)}. "
            f"Received: this worker runs {list(mine)}"
        )


def broadcast_variables(strategy, variables):
    """Gives every worker rank 0's values of the floating-point `variables`."""
    import keras
    import tensorflow as tf

    floats = [
        v for v in variables
        if keras.backend.standardize_dtype(v.dtype).startswith(("float", "bfloat"))
    ]
    if not floats:
        return
    rank = replica_id(strategy)

    @tf.function(autograph=False)
    def broadcast():
        mine = tf.concat([tf.reshape(tf.cast(v.value, "float32"), [-1]) for v in floats], 0)
        keep = tf.constant(1.0 if rank == 0 else 0.0)
        total = all_reduce_sum(strategy, mine * keep)
        sizes = [_num_elements(v.shape) for v in floats]
        for v, part in zip(floats, tf.split(total, sizes)):
            v.assign(tf.cast(tf.reshape(part, v.shape), v.dtype))

    broadcast()


# ------------------------------------------------------------------ launching
def free_ports(n):
    """Returns `n` distinct free TCP ports on localhost (bound to port 0, then released)."""
    sockets, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in sockets:
            s.close()
    return ports


def callable_spec(fn):
    """`"module:qualname"` for a top-level function (or the string itself)."""
    if isinstance(fn, str):
        return fn
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", "")
    if not module or "<" in name or module == "__main__":
        raise BackendError(
            "model_fn must be a top-level function of an importable module (or a "
            "'module:function' string) so worker processes can import it. "
            f"Received: {fn!r}"
        )
    return f"{module}:{name}"


def resolve_callable(spec):
    """Imports `"module:function"` (or returns a callable unchanged)."""
    if callable(spec):
        return spec
    if not isinstance(spec, str) or ":" not in spec:
        raise BackendError(f"Expected 'module:function'. Received: {spec!r}")
    module_name, _, attr = spec.partition(":")
    try:
        obj = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise BackendError(
            f"Cannot import {spec!r} ({type(e).__name__}: {e}). Make the module importable "
            f"from the worker's working directory. Received: {spec!r}"
        ) from None
    return obj


WORKDIR_PREFIX = "autodist_tf_workers_"


def remove_stale_workdirs(directory=None):
    """Removes work directories left by launchers that were killed outright.

    `launch_local_workers` removes its directory (the job, a copy of the
    data, the logs) when it returns or fails, but a launcher killed with
    SIGKILL runs no cleanup (its workers end with it: see
    `tf_worker.die_with_parent`). Each directory's name carries its
    launcher's pid; a directory whose launcher is no longer running is removed
    by the next launch.

    Args:
        directory: Where to look (default: the temporary directory).

    Returns:
        The paths removed.
    """
    directory = directory or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(WORKDIR_PREFIX):
            continue
        pid = name[len(WORKDIR_PREFIX):].split("_", 1)[0]
        if not pid.isdigit() or process_alive(int(pid)):
            continue
        path = os.path.join(directory, name)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def launch_local_workers(
    model_fn,
    cluster,
    x,
    y,
    batch_size,
    steps,
    strategy=None,
    plan=None,
    options=None,
    initial_weights=None,
    epochs=1,
    timeout_s=600,
    return_weights=False,
    drop_remainder=False,
    devices=None,
    alternate_plans=None,
    rounds=1,
    processes="per_device",
    groups=None,
):
    """Starts worker processes on this machine (one per device or per core set) and trains.

    Each worker gets `TF_CONFIG` for a loopback cluster on free ports and
    `WORKER_DEVICES_ENV` naming its devices, pins itself to their cores
    (testbed devices), builds the model with `model_fn` inside
    `strategy.scope()`, and runs `steps` training steps over `(x, y)` in
    order (no shuffling; the data repeats when short).

    Args:
        model_fn: Top-level function or `"module:function"` returning a
            compiled model.
        cluster: The `Cluster`; one worker per device.
        x, y: NumPy arrays (saved as `.npy` for the workers).
        batch_size: Global batch size.
        steps: Training steps per epoch.
        strategy: Strategy name, or None when `plan` is given.
        plan: A `Plan` to run instead of planning.
        options: `AutoStrategy` options.
        initial_weights: Optional list of arrays (`model.get_weights()` order)
            every worker loads before training.
        epochs: Number of epochs.
        timeout_s: Kill every worker and fail after this many seconds.
        return_weights: Also return each worker's final weights.
        drop_remainder: Drop the last partial batch of each pass over the data.
        devices: Device names to use (one worker each); default all of the
            cluster's. With one device, one pinned process runs the plan.
        alternate_plans: Optional list of data-parallel `Plan`s over the same
            devices (replacing `plan` and `strategy`): each worker trains one
            model per plan, `steps` steps each, alternating for `rounds`
            rounds (every second one in reverse order), so the plans are
            timed by the same processes seconds apart.
        rounds: Rounds of `alternate_plans`.
        processes: `"per_device"`: one worker process per device.
            `"per_core"`: devices sharing their cores (testbed devices on
            one core) share one process, which runs a replica on each and
            sums them locally before the one cross-process all-reduce, as a
            worker with several GPUs does (`group_devices`).
        groups: Explicit device sets, one list of names per worker process
            (overrides `processes`); each worker checks at its first step
            that every device is run by exactly one worker.

    Returns:
        A list, by rank, of dicts: `step_times_s`, `loss` (per epoch),
        `device` (its first device), `devices` (all of its devices),
        `share` (samples per step over its devices), `affinity`, and
        `weights` (list of arrays) when asked.
        With `alternate_plans`, each also has `phases`: one dict per fit in
        the order run (`plan`: index into `alternate_plans`, `share`,
        `step_times_s`, `cpu_times_s`), and the top-level `step_times_s` and
        `loss` are empty.

    Raises:
        WorkerError: If a worker exits with an error or the run times out.
    """
    import numpy as np

    remove_stale_workdirs()
    workdir = tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}_")
    procs, logs = [], []
    try:
        np.save(os.path.join(workdir, "x.npy"), np.asarray(x), allow_pickle=False)
        np.save(os.path.join(workdir, "y.npy"), np.asarray(y), allow_pickle=False)
        if initial_weights is not None:
            np.savez(os.path.join(workdir, "initial.npz"),
                     **{f"w{i}": np.asarray(w) for i, w in enumerate(initial_weights)})
        plan_path = None
        alternate = None
        if alternate_plans:
            paths = []
            for i, p in enumerate(alternate_plans):
                paths.append(os.path.join(workdir, f"plan{i}.json"))
                p.to_json(paths[-1])
            plan, strategy = alternate_plans[0], None
            alternate = {"plans": paths, "rounds": int(rounds)}
        if plan is not None:
            plan_path = os.path.join(workdir, "plan.json")
            plan.to_json(plan_path)
        devices = list(devices or cluster.names)
        for name in devices:
            cluster.device(name)  # unknown names fail here, not in a worker
        if groups is None:
            groups = group_devices(cluster, devices, processes)
        else:
            groups = [list(g) for g in groups]
            for name in (n for g in groups for n in g):
                cluster.device(name)
        num = len(groups)
        job = {
            "model_fn": callable_spec(model_fn),
            "strategy": strategy,
            "plan": plan_path,
            "cluster": cluster.to_dict(),
            "options": dict(options or {}),
            "x": os.path.join(workdir, "x.npy"),
            "y": os.path.join(workdir, "y.npy"),
            "initial_weights": os.path.join(workdir, "initial.npz") if initial_weights is not None else None,
            "batch_size": int(batch_size),
            "steps": int(steps),
            "epochs": int(epochs),
            "out_dir": workdir,
            "return_weights": bool(return_weights),
            "drop_remainder": bool(drop_remainder),
            "devices": devices,
            "alternate": alternate,
            "sys_path": [p for p in sys.path if p and os.path.isdir(p)],
        }
        job_path = os.path.join(workdir, "job.json")
        with open(job_path, "w", encoding="utf-8") as f:
            json.dump(job, f)
        ports = free_ports(num)
        addresses = [f"127.0.0.1:{p}" for p in ports]
        for rank in range(num):
            env = dict(os.environ)
            env["TF_CONFIG"] = json.dumps(
                {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": rank}}
            )
            env[WORKER_DEVICES_ENV] = json.dumps(groups[rank])
            env["KERAS_BACKEND"] = "tensorflow"
            env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
            env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
            env[PARENT_PID_ENV] = str(os.getpid())  # tf_worker.die_with_parent
            log_path = os.path.join(workdir, f"worker{rank}.log")
            log = open(log_path, "w", encoding="utf-8")
            logs.append((log, log_path))
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "autodist_keras.backends.tf_worker", job_path],
                env=env, stdout=log, stderr=subprocess.STDOUT, cwd=os.getcwd(),
            ))
        deadline = time.monotonic() + timeout_s
        while True:
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank = failed[0]
                raise WorkerError(rank, f"exit code {codes[rank]}; log tail:\n{_tail(logs[rank][1])}")
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                rank = next(r for r, c in enumerate(codes) if c is None)
                raise WorkerError(
                    rank, f"timed out after {timeout_s} s; log tail:\n{_tail(logs[rank][1])}"
                )
            time.sleep(0.1)
        results = []
        for rank in range(num):
            with open(os.path.join(workdir, f"result{rank}.json"), encoding="utf-8") as f:
                result = json.load(f)
            if return_weights:
                with np.load(os.path.join(workdir, f"weights{rank}.npz"), allow_pickle=False) as data:
                    result["weights"] = [data[f"w{i}"] for i in range(len(data.files))]
            results.append(result)
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for log, _ in logs:
            log.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _tail(path, chars=3000):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return "(no log)"
    return text[-chars:]
