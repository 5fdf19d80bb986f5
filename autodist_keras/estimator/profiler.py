"""Profiler: real timing of layers and collectives on the local devices.

Two measurements feed the estimator:

- `profile_layers(model, cluster, batch_sizes)` times each layer's forward and
  backward pass, in isolation, on each local device of `cluster`, on the active
  Keras backend (TensorFlow: a `tf.while_loop` in a `tf.function` with
  `tf.GradientTape`; PyTorch: eager calls and autograd). Each layer is
  rebuilt from its config
  (`layer.__class__.from_config(layer.get_config())`) under `keras.device(...)`
  and called with random inputs of the shapes and dtypes of its call in the
  model (falling back to the model's own layer object when the rebuild fails).
  Every figure is the median of `repeats` runs after `warmup` calls.
- `profile_collectives(cluster)` spawns one `torch.distributed` process per
  device (gloo on CPU, NCCL on GPU; loopback, a free port, timeouts), times
  all-reduce, broadcast and point-to-point ping-pong over a range of sizes,
  and fits `time = latency + bytes / bandwidth` per link and operation.

CPU testbed devices (`Cluster.cpu_testbed()`) are profiled by pinning every
thread of the profiling process to the device's cores
(`os.sched_setaffinity`) and setting `torch.set_num_threads(device.threads)`
on PyTorch; both are restored afterwards. TensorFlow fixes its thread pools
when it starts, so on TensorFlow only the cores are restricted (the
recorded `threads_used` says what the pools had). A device profiled alone
runs at full speed on its cores even when other devices share them; the
profile records each device's sharing factor (`len(cores) / sum(1 / n_c)`,
`n_c` the number of devices using core `c`) and the contended time
`measured x sharing`, the time when all devices run at once and the OS
shares the core fairly. See docs/profiler.md.

Results are cached as JSON files (one per measurement, written atomically)
under `~/.cache/autodist_keras` (or `$AUTODIST_KERAS_CACHE`, or the
`cache_dir` argument), keyed by the layer signature (class, config hash,
call shapes and dtypes), the device signature (model, affinity, threads, host
CPU) and the backend with its version; a repeat run reuses them.

Example:

```python
profile = profile_layers(model, Cluster.cpu_testbed(), batch_sizes=(8, 32))
print(profile.summary())
t = profile.time("dense", "node0/cpu1", 32, phase="forward")
links = profile_collectives(Cluster.cpu_testbed(), sizes=(1 << 10, 1 << 16, 1 << 20))
print(links.fit("p2p", "node0/cpu0", "node0/cpu1"))
```
"""

import contextlib
import dataclasses
import datetime
import functools
import hashlib
import inspect
import json
import math
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import traceback

from autodist_keras import strict_json
from autodist_keras.devices.detect import host_cpu_name
from autodist_keras.errors import AutodistError
from autodist_keras.errors import EstimatorError
from autodist_keras.errors import OutputError
from autodist_keras.lazy_tensorflow import tensorflow_left_unimported

CACHE_ENV = "AUTODIST_KERAS_CACHE"
CACHE_VERSION = 1
# Bumped when the way a layer is timed changes, so old figures are not reused.
MEASUREMENT_VERSION = 2
DEFAULT_BATCH_SIZES = (8, 32)
DEFAULT_WARMUP = 2
DEFAULT_REPEATS = 5
DEFAULT_MIN_RUN_S = 5e-3
MAX_INNER_CALLS = 64
MAX_LOOP_ITERATIONS = 1000
DEFAULT_UNKNOWN_DIM = 64
DEFAULT_COLLECTIVE_SIZES = tuple(1 << k for k in (10, 13, 16, 18, 20, 22))
COLLECTIVE_OPS = ("allreduce", "broadcast", "p2p")
# Fit fields in bytes/s that are `inf` when a time does not grow with size; JSON
# has no Infinity, so `CollectiveProfile.to_dict` stores them as null.
BANDWIDTH_FIELDS = ("bandwidth", "ring_link_bandwidth")
PHASES = ("forward", "backward")


# --------------------------------------------------------------------- cache
def default_cache_dir():
    """Returns the profile cache directory: `$AUTODIST_KERAS_CACHE` or `~/.cache/autodist_keras`.

    A `~` in the variable is expanded and a relative value is made absolute
    (against the current directory). The plan cache lives below the same root
    (`strategies.selection.default_cache_dir`).

    Returns:
        An absolute path.
    """
    env = os.environ.get(CACHE_ENV)
    if env:
        return os.path.abspath(os.path.expanduser(env))
    return os.path.join(os.path.expanduser("~"), ".cache", "autodist_keras")


def _canonical_json(data):
    return json.dumps(data, sort_keys=True, separators=(",", ":"), default=repr)


def _sha256(data):
    text = data if isinstance(data, str) else _canonical_json(data)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def write_json_atomic(path, data):
    """Writes `data` as JSON to `path` through a temporary file and a rename.

    A reader never sees a partial file, and concurrent writers of the same
    path leave one complete version. A symbolic link is written through
    (`strategies.plan.write_atomic`).

    The text is standard JSON (`json_text`): NaN and Infinity are refused.

    Raises:
        OutputError: If the file cannot be written (nothing is left behind).
        EstimatorError: If `data` holds NaN or Infinity (nothing is written).
    """
    from autodist_keras.strategies.plan import write_atomic

    text = json_text(data, os.fspath(path), indent=1)
    write_atomic(path, lambda f: f.write(text.encode("utf-8")), suffix=".json")


def json_text(data, where, indent=None):
    """`data` as standard JSON text (RFC 8259, keys sorted), refusing NaN and Infinity.

    Python's `json` would write them as the bare words `NaN` and `Infinity`,
    which JavaScript's `JSON.parse` and other strict readers reject. Store an
    unbounded or unknown number as None (`null`) instead.

    Args:
        data: A JSON-able value.
        where: The file (or object) being written, for the message.
        indent: As for `json.dumps`.

    Raises:
        EstimatorError: If `data` holds a NaN or infinite float (naming its
            field), or a value or structure JSON cannot hold.
    """
    return strict_json.dumps(data, where, EstimatorError, indent=indent)


def read_json(path, what, hint=""):
    """Reads a JSON file, turning a missing or malformed file into `EstimatorError`.

    Args:
        path: The file.
        what: What the file should hold, for the message (e.g. `"profile"`).
        hint: Optional sentence telling how to make the file.

    Returns:
        The decoded JSON value.
    """
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise EstimatorError(
            f"Cannot read {what} {path}: {e.strerror}.{' ' + hint if hint else ''} "
            f"Received: {path!r}"
        ) from None
    except ValueError as e:
        raise EstimatorError(
            f"The {what} {path} is not valid JSON ({e}). Received: {path!r}"
        ) from None


def _unwritable_cache(directory, reason, fix):
    """The `EstimatorError` for a profile cache that cannot be written.

    Args:
        directory: The cache directory.
        reason: Why writing failed.
        fix: What to do, in the caller's terms (an argument, or a command-line option).

    Returns:
        An `EstimatorError` that keeps `directory` and `reason` as
        `cache_directory` and `cache_reason` (`profile_main` rewords the fix).
    """
    error = EstimatorError(
        f"Cannot write the profile cache in {directory} ({reason}). {fix} "
        f"Received: {directory!r}"
    )
    error.cache_directory, error.cache_reason = directory, reason
    return error


class ProfileCache:
    """Measurements on disk: one JSON file per key, written atomically.

    Args:
        directory: Cache directory; default `default_cache_dir()`.

    Example:

    ```python
    cache = ProfileCache(tmp_path)
    cache.put(key_fields, {"forward_s": 1e-4})
    cache.get(key_fields)["forward_s"]
    ```
    """

    def __init__(self, directory=None):
        self.directory = os.path.abspath(os.fspath(directory or default_cache_dir()))

    def key(self, fields):
        """Returns the hex digest naming the entry of `fields` (a JSON-able dict)."""
        return _sha256(dict(fields, cache_version=CACHE_VERSION))

    def path(self, fields):
        digest = self.key(fields)
        kind = str(fields.get("kind", "entry"))
        return os.path.join(self.directory, f"v{CACHE_VERSION}", kind, digest[:2], digest + ".json")

    def get(self, fields):
        """Returns the cached record for `fields`, or None.

        An unreadable or foreign file (a hash collision, a partial copy) is
        treated as missing and will be overwritten.
        """
        path = self.path(fields)
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("key") != _canonical_json(fields):
            return None
        return data.get("record")

    def put(self, fields, record):
        """Stores `record` (a JSON-able dict) under `fields`."""
        try:
            write_json_atomic(
                self.path(fields), {"key": _canonical_json(fields), "record": record}
            )
        except OutputError as e:
            reason = str(e).split(" Received:")[0]
            raise _unwritable_cache(
                self.directory, reason,
                f"Set {CACHE_ENV} or pass cache_dir= to a writable directory.",
            ) from None

    def __len__(self):
        count = 0
        for _, _, files in os.walk(os.path.join(self.directory, f"v{CACHE_VERSION}")):
            count += sum(1 for f in files if f.endswith(".json") and not f.startswith(".tmp-"))
        return count


# ------------------------------------------------------------------- devices
def device_signature(device):
    """What makes two devices measure the same: model, affinity, threads, host CPU.

    Two CPU testbed devices with the same cores and threads share a
    signature (and hence cache entries), as do two GPUs of the same model.
    """
    signature = {
        "kind": device.kind,
        "model": device.model,
        "cpu_affinity": sorted(device.cpu_affinity) if device.cpu_affinity is not None else None,
        "threads": device.threads,
    }
    if device.kind == "cpu":
        signature["host_cpu"] = host_cpu_name()
        if device.cpu_affinity is None:
            signature["process_cores"] = _process_cores()
    return signature


def _process_cores():
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count()


def sharing_factors(cluster, devices=None):
    """Contention factor of each device when all of `devices` run at once.

    A device on cores `C` where core `c` is used by `n_c` of the devices gets
    `sum(1 / n_c)` cores' worth of time when all run, against `len(C)` when it
    runs alone, so its compute-bound time grows by `len(C) / sum(1 / n_c)`.
    Devices without a CPU affinity (GPUs, a detected CPU) have factor 1.

    Args:
        cluster: The `Cluster`.
        devices: Device names (default: all).

    Returns:
        Dict from device name to a float >= 1.
    """
    names = list(devices) if devices is not None else list(cluster.names)
    users = {}
    for name in names:
        affinity = cluster.device(name).cpu_affinity
        for core in affinity or ():
            users[core] = users.get(core, 0) + 1
    factors = {}
    for name in names:
        affinity = cluster.device(name).cpu_affinity
        if not affinity:
            factors[name] = 1.0
            continue
        share = sum(1.0 / users[c] for c in set(affinity))
        factors[name] = len(set(affinity)) / share
    return factors


def _thread_ids():
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def _set_all_affinity(cores):
    """Pins every thread of this process to `cores`; returns the threads pinned."""
    pinned = 0
    for tid in _thread_ids():
        try:
            os.sched_setaffinity(tid, cores)
            pinned += 1
        except (ProcessLookupError, PermissionError):
            continue
    return pinned


@contextlib.contextmanager
def pinned_to(device, backend=None):
    """Runs the block on a CPU testbed device's cores and thread count.

    Every thread of the process is pinned to `device.cpu_affinity` (threads
    started inside the block inherit it) and, on PyTorch,
    `torch.set_num_threads(device.threads)`. On exit the process's previous
    affinity is restored on every thread, and the previous thread count.
    Devices without an affinity run unchanged.

    Args:
        device: A `Device`.
        backend: `"tensorflow"` or `"torch"` (default: the Keras backend).

    Yields:
        A dict of what was applied: `affinity_used` (sorted cores, or None)
        and `threads_used`.

    Raises:
        EstimatorError: If the device's cores do not exist on this machine or
            this platform cannot set CPU affinity.
    """
    backend = backend or _keras_backend()
    info = {"affinity_used": None, "threads_used": _threads_in_use(backend)}
    affinity = device.cpu_affinity
    if not affinity:
        yield info
        return
    if not hasattr(os, "sched_setaffinity"):
        raise EstimatorError(
            f"Device {device.name!r} is a CPU testbed device (cpu_affinity="
            f"{list(affinity)}), but this platform cannot pin threads to cores "
            "(os.sched_setaffinity is Linux-only). Profile Cluster.detect() instead. "
            f"Received: platform={sys.platform!r}"
        )
    previous = set(os.sched_getaffinity(0))
    cores = set(int(c) for c in affinity)
    available = set(range(os.cpu_count() or 1))
    if not cores <= available:
        raise EstimatorError(
            f"Device {device.name!r} asks for cores {sorted(cores)}, but this machine "
            f"has cores {sorted(available)}. Fix the testbed's cpu_affinity. "
            f"Received: cpu_affinity={list(affinity)}"
        )
    previous_threads = None
    torch = None
    if backend == "torch":
        import torch

        previous_threads = torch.get_num_threads()
    try:
        _set_all_affinity(cores)
        if torch is not None and device.threads:
            torch.set_num_threads(int(device.threads))
        info["affinity_used"] = sorted(os.sched_getaffinity(0))
        info["threads_used"] = _threads_in_use(backend)
        yield info
    finally:
        _set_all_affinity(previous)
        if torch is not None and previous_threads is not None:
            torch.set_num_threads(previous_threads)


def _threads_in_use(backend):
    if backend == "torch":
        import torch

        return int(torch.get_num_threads())
    if backend == "tensorflow":
        import tensorflow as tf

        # 0 means TensorFlow's default: one thread per schedulable core at start-up.
        return int(tf.config.threading.get_intra_op_parallelism_threads())
    return None


def _keras_backend():
    import keras

    return keras.backend.backend()


def _framework_versions(backend):
    import keras

    versions = {"keras": keras.__version__}
    if backend == "tensorflow":
        import tensorflow as tf

        versions["tensorflow"] = tf.__version__
    elif backend == "torch":
        import torch

        versions["torch"] = torch.__version__
    return versions


def _keras_device_name(device):
    if device.kind == "gpu":
        return f"gpu:{device.index}"
    return "cpu:0"


def _check_local(device, backend):
    """Raises unless `device` exists on this machine for `backend`."""
    if device.kind == "cpu":
        return
    if device.kind != "gpu":
        raise EstimatorError(
            f"Cannot profile device {device.name!r} of kind {device.kind!r}; the profiler "
            f"times CPUs and GPUs. Received: kind={device.kind!r}"
        )
    count = 0
    if backend == "torch":
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    elif backend == "tensorflow":
        import tensorflow as tf

        count = len(tf.config.list_physical_devices("GPU"))
    if device.index >= count:
        raise EstimatorError(
            f"Device {device.name!r} ({device.model}) is not a local device: this machine "
            f"has {count} GPU(s) visible to {backend}. The profiler measures local devices "
            "only (Cluster.detect() or Cluster.cpu_testbed()); plan for other clusters "
            f"with the analytic or learned cost model. Received: {device.name!r}"
        )


def _sync_fn(device, backend):
    if device.kind != "gpu":
        return lambda: None
    if backend == "torch":
        import torch

        return torch.cuda.synchronize
    import tensorflow as tf

    return tf.test.experimental.sync_devices


# ------------------------------------------------------------ layer records
@dataclasses.dataclass
class LayerTiming:
    """Measured forward and backward time of one graph node on one device.

    Args:
        node: The `LayerNode` name.
        layer_type: The layer's class name.
        device: Device name.
        batch_size: Samples in the profiled batch.
        forward_s: Median forward time, alone on the device, seconds.
        backward_s: Median backward time (gradients of inputs and weights),
            alone on the device, seconds.
        sharing: The device's sharing factor (see `sharing_factors`).
        forward_runs_s: Every timed run of the forward pass.
        forward_backward_runs_s: Every timed run of forward plus backward.
        cached: True when the figures came from the cache, not measured now.
        source: `"from_config"` (rebuilt layer) or `"model_layer"`.
        key: Cache key digest.
        details: Affinity and threads used, inner calls per run, shapes.
    """

    node: str
    layer_type: str
    device: str
    batch_size: int
    forward_s: float
    backward_s: float
    sharing: float = 1.0
    forward_runs_s: list = dataclasses.field(default_factory=list)
    forward_backward_runs_s: list = dataclasses.field(default_factory=list)
    cached: bool = False
    source: str = "from_config"
    key: str = ""
    details: dict = dataclasses.field(default_factory=dict)

    @property
    def forward_contended_s(self):
        """Forward time when every device sharing the cores runs at once."""
        return self.forward_s * self.sharing

    @property
    def backward_contended_s(self):
        """Backward time when every device sharing the cores runs at once."""
        return self.backward_s * self.sharing

    def time(self, phase, contended=True):
        """Seconds of `phase` (`"forward"` or `"backward"`)."""
        if phase not in PHASES:
            raise EstimatorError(f"phase must be one of {PHASES}. Received: {phase!r}")
        value = self.forward_s if phase == "forward" else self.backward_s
        return value * (self.sharing if contended else 1.0)


@dataclasses.dataclass
class LayerProfile:
    """The result of `profile_layers`: measured layer times and what was skipped.

    Args:
        backend: Keras backend that ran the layers.
        timings: List of `LayerTiming`.
        skipped: List of dicts `{node, device, batch_size, reason}` not measured.
        measured: Number of measurements taken in this run.
        reused: Number of figures taken from the cache.
        elapsed_s: Wall time of the run, seconds.
        budget_s: The time budget, or None.
        devices: Dict from device name to `{signature, sharing, peak_flops_fp32,
            memory_bandwidth}`.
        settings: Warm-up, repeats, batch sizes, versions.
        graph_fingerprint: Fingerprint of the profiled `ModelGraph`.
        model_name: The Keras model's name.
    """

    backend: str
    timings: list
    skipped: list = dataclasses.field(default_factory=list)
    measured: int = 0
    reused: int = 0
    elapsed_s: float = 0.0
    budget_s: float = None
    devices: dict = dataclasses.field(default_factory=dict)
    settings: dict = dataclasses.field(default_factory=dict)
    graph_fingerprint: str = None
    model_name: str = None

    def __post_init__(self):
        self._index = None

    def _lookup(self):
        if self._index is None:
            self._index = {}
            for t in self.timings:
                self._index.setdefault((t.node, t.device), {})[t.batch_size] = t
        return self._index

    def get(self, node, device, batch_size):
        """The `LayerTiming` measured for exactly this node, device and batch, or None."""
        return self._lookup().get((node, device), {}).get(int(batch_size))

    def time(self, node, device, batch_size, phase="forward", contended=True):
        """Measured seconds of `phase` of `node` on `device` at `batch_size`.

        Between profiled batch sizes the time is interpolated linearly; outside
        them it is extrapolated linearly from the two nearest (never below the
        nearest measured time scaled by the batch ratio's lower bound of 0).

        Raises:
            EstimatorError: If the node was not profiled on that device.
        """
        by_batch = self._lookup().get((node, device))
        if not by_batch:
            raise EstimatorError(
                f"No profile of node {node!r} on device {device!r}; profile it first "
                f"(profiled devices: {sorted(self.devices)}). Received: {(node, device)!r}"
            )
        batch_size = int(batch_size)
        if batch_size in by_batch:
            return by_batch[batch_size].time(phase, contended)
        sizes = sorted(by_batch)
        if len(sizes) == 1:
            only = sizes[0]
            return by_batch[only].time(phase, contended) * batch_size / only
        if batch_size < sizes[0]:
            lo, hi = sizes[0], sizes[1]
        elif batch_size > sizes[-1]:
            lo, hi = sizes[-2], sizes[-1]
        else:
            hi = next(s for s in sizes if s > batch_size)
            lo = max(s for s in sizes if s < batch_size)
        t_lo = by_batch[lo].time(phase, contended)
        t_hi = by_batch[hi].time(phase, contended)
        value = t_lo + (t_hi - t_lo) * (batch_size - lo) / (hi - lo)
        return max(value, 0.0)

    def to_dict(self):
        """Returns a JSON-ready dict (timings as dicts)."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["timings"] = [dataclasses.asdict(t) for t in self.timings]
        data["schema"] = "autodist_keras.layer_profile/1"
        return data

    @classmethod
    def from_dict(cls, data):
        """Builds a profile from `to_dict()` output."""
        if not isinstance(data, dict) or data.get("schema") != "autodist_keras.layer_profile/1":
            raise EstimatorError(
                "Not a layer profile (expected schema 'autodist_keras.layer_profile/1'); "
                "write profiles with LayerProfile.to_json(). "
                f"Received: {data.get('schema') if isinstance(data, dict) else type(data).__name__!r}"
            )
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in fields}
        kwargs["timings"] = [LayerTiming(**t) for t in data.get("timings", [])]
        return cls(**kwargs)

    def to_json(self, path=None):
        """Returns the JSON text; writes it atomically to `path` if given."""
        data = self.to_dict()
        if path is not None:
            write_json_atomic(path, data)
        return json_text(data, "the layer profile", indent=1)

    @classmethod
    def from_json(cls, path):
        """Reads a profile written by `to_json(path)`."""
        return cls.from_dict(read_json(path, "profile"))

    def summary(self, limit=40):
        """Returns a readable table of the measured times (rich)."""
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text

        table = Table(title=f"Layer profile ({self.backend}), measured, median of runs")
        for column in ("node", "type", "device", "batch", "fwd ms", "bwd ms", "sharing", "from"):
            table.add_column(column)
        for t in self.timings[:limit]:
            # Text, not markup: a layer named "dense[0]" kept its brackets.
            table.add_row(*(Text(cell) for cell in (
                t.node, t.layer_type, t.device, str(t.batch_size),
                f"{t.forward_s * 1e3:.3f}", f"{t.backward_s * 1e3:.3f}", f"{t.sharing:g}",
                "cache" if t.cached else "measured",
            )))
        console = Console(record=True, width=120, file=open(os.devnull, "w"))
        console.print(table)
        text = console.export_text()
        lines = [text.rstrip()]
        if len(self.timings) > limit:
            lines.append(f"... {len(self.timings) - limit} more rows")
        lines.append(
            f"{self.measured} measured, {self.reused} from cache, {len(self.skipped)} skipped, "
            f"{self.elapsed_s:.1f} s"
            + (f" (budget {self.budget_s:g} s)" if self.budget_s is not None else "")
        )
        for s in self.skipped[:5]:
            lines.append(
                f"skipped {s['node']} on {s['device']} at batch {s['batch_size']}: {s['reason']}"
            )
        if len(self.skipped) > 5:
            lines.append(f"... {len(self.skipped) - 5} more skipped")
        return "\n".join(lines)


# ---------------------------------------------------------- model plumbing
def _graph_calls(model, graph):
    """Dict from `ModelGraph` node name to `(operation, keras Node or None)`.

    `ModelGraph.from_keras` records the Keras call behind every node
    (`graph.calls`: nested models flattened, shared layers as `"name#k"`); a
    graph read from JSON has none, so the model's graph is rebuilt for them.
    """
    calls = getattr(graph, "calls", None)
    if calls:
        return calls
    from autodist_keras.graph import ModelGraph

    return ModelGraph.from_keras(model).calls


def _find_layer(model, name):
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if layer.name == name:
            return layer
    return None


def _is_input_node(node):
    return getattr(node, "kind", None) == "input" or node.layer_type == "InputLayer"


class _Spec:
    """Shape and dtype of one tensor argument (batch axis filled in)."""

    def __init__(self, shape, dtype):
        self.shape = tuple(shape)
        self.dtype = str(dtype)

    def to_json(self):
        return {"shape": list(self.shape), "dtype": self.dtype}


def _call_template(model, node, calls):
    """Returns `(operation, args, kwargs)` with `_Spec` placeholders (batch = None)."""
    import keras
    from keras import tree

    found = calls.get(node.name)
    op, keras_node = found if found is not None else (None, None)
    if keras_node is not None:

        def to_spec(x):
            if isinstance(x, keras.KerasTensor):
                return _Spec(x.shape, x.dtype)
            return x

        args = tree.map_structure(to_spec, keras_node.arguments.args)
        kwargs = dict(tree.map_structure(to_spec, keras_node.arguments.kwargs))
    else:
        if op is None and (getattr(node, "kind", None) == "model"
                           or node.layer_name == model.name):
            op = model
        elif op is None:
            op = _find_layer(model, node.layer_name)
        if op is None:
            raise EstimatorError(
                f"Graph node {node.name!r} names layer {node.layer_name!r}, which model "
                f"{model.name!r} does not have; build the ModelGraph from the same model. "
                f"Received: {node.layer_name!r}"
            )
        dtype = getattr(op, "input_dtype", None) or "float32"
        specs = [_Spec((None,) + tuple(s), dtype) for s in node.input_shapes]
        if not specs:
            raise EstimatorError(
                f"Node {node.name!r} has no known input shape, so it cannot be called "
                "alone. Build the model (call it on a batch) before profiling. "
                f"Received: input_shapes={node.input_shapes!r}"
            )
        args = (specs[0],) if len(specs) == 1 else (specs,)
        kwargs = {}
    if getattr(op, "_call_has_training_arg", False):
        kwargs["training"] = True
    return op, args, kwargs


def _fill_batch(template, batch_size, unknown_dim):
    from keras import tree

    def fill(x):
        if isinstance(x, _Spec):
            shape = list(x.shape)
            if shape and shape[0] is None:
                shape[0] = batch_size
            shape = [unknown_dim if d is None else int(d) for d in shape]
            return _Spec(shape, x.dtype)
        return x

    return tree.map_structure(fill, template)


def _spec_signature(structure):
    from keras import tree

    def sig(x):
        if isinstance(x, _Spec):
            return {"tensor": x.to_json()}
        if isinstance(x, (bool, int, float, str)) or x is None:
            return x
        return repr(type(x).__name__)

    return tree.map_structure(sig, structure)


def _structure_key(template):
    """The call's structure, shapes without the batch axis, and dtypes."""
    from keras import tree

    def strip(x):
        if isinstance(x, _Spec):
            return _Spec(x.shape[1:], x.dtype)
        return x

    return _canonical_json(_spec_signature(tree.map_structure(strip, template)))


def _layer_config(layer):
    try:
        with tensorflow_left_unimported():
            config = dict(layer.get_config())
    except Exception:  # noqa: BLE001 - any layer may refuse; fall back to identity
        return None
    config.pop("name", None)
    return config


# Packages whose layers' code the versions in every cache key already cover.
_VERSIONED_PACKAGES = ("builtins", "keras", "tensorflow", "torch", "tf_keras", "autodist_keras")


def _code_text(code):
    """A code object's instructions, constants and names, nested functions included."""
    parts = [code.co_code.hex(), repr(code.co_names)]
    for const in code.co_consts:
        parts.append(_code_text(const) if inspect.iscode(const) else repr(const))
    return "|".join(parts)


@functools.lru_cache(maxsize=None)
def custom_code_sha256(cls):
    """SHA-256 of the code of `cls` and of its base classes outside Keras.

    The profile cache keys a layer's timing on its class path and config, so a
    custom layer whose `call` was edited (same name, same config) would get its
    old timings back. Its class's source is part of the key. Keras's own layers
    return None: the Keras version in the key covers their code.

    Args:
        cls: A layer class.

    Returns:
        A hex digest, or None when every class in `cls`'s hierarchy comes
        from Keras, a framework or this package.
    """
    parts = []
    for klass in cls.__mro__:
        if (klass.__module__ or "").split(".")[0] in _VERSIONED_PACKAGES:
            continue
        try:
            parts.append(inspect.getsource(klass))
        except (OSError, TypeError):  # no source file (python -c, a frozen app)
            functions = [(name, getattr(value, "__func__", value))
                         for name, value in sorted(vars(klass).items())]
            parts.append(repr([(name, _code_text(f.__code__)) for name, f in functions
                               if hasattr(f, "__code__")]))
    return _sha256("\n".join(parts)) if parts else None


def layer_signature(layer, args, kwargs):
    """The cache identity of a layer call: class, config hash, call shapes and dtypes.

    The layer's name is left out, so identical layers (the repeated blocks of
    a ResNet, say) share one measurement. A layer class defined outside Keras
    also contributes the digest of its code (`custom_code_sha256`).
    """
    config = _layer_config(layer)
    cls = type(layer)
    signature = {
        "layer_class": f"{cls.__module__}.{cls.__qualname__}",
        "config_sha256": _sha256(config) if config is not None else f"id:{id(layer)}",
        "call": _spec_signature((list(args), kwargs)),
        "dtype": str(getattr(layer, "compute_dtype", "float32")),
    }
    code = custom_code_sha256(cls)
    if code is not None:
        signature["code_sha256"] = code
    return signature


def _random_value(spec, layer, rng):
    import numpy as np

    dtype = np.dtype(spec.dtype) if spec.dtype != "bfloat16" else np.float32
    shape = tuple(spec.shape)
    if np.issubdtype(dtype, np.floating):
        return rng.standard_normal(shape).astype(dtype)
    if np.issubdtype(dtype, np.integer):
        high = 2
        if type(layer).__name__ == "Embedding":
            high = int(getattr(layer, "input_dim", 2))
        return rng.integers(0, max(high, 1), size=shape).astype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    return np.zeros(shape, dtype=dtype)


def _materialise(structure, layer, rng):
    import keras
    from keras import tree

    def make(x):
        if isinstance(x, _Spec):
            value = _random_value(x, layer, rng)
            return keras.ops.convert_to_tensor(value, dtype=x.dtype)
        return x

    return tree.map_structure(make, structure)


def _is_tensor(x):
    import keras

    return keras.ops.is_tensor(x)


def _input_bytes(args, kwargs):
    from keras import tree

    total = 0
    for x in tree.flatten((list(args), kwargs)):
        if isinstance(x, _Spec):
            size = 1
            for d in x.shape:
                size *= int(d)
            total += size * _itemsize(x.dtype)
    return total


def _itemsize(dtype):
    import numpy as np

    if dtype == "bfloat16":
        return 2
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        return 4


def _rebuild(layer):
    """A fresh copy of `layer` from its config, or None when that fails."""
    try:
        with tensorflow_left_unimported():
            config = layer.get_config()
        # (outside the block: building a TF-backed preprocessing layer needs TensorFlow)
        return layer.__class__.from_config(config)
    except Exception:  # noqa: BLE001 - fall back to the model's own layer object
        return None


# -------------------------------------------------------------- measurement
def _time_runs(fn, sync, warmup, repeats, min_run_s):
    """Per-call seconds of `fn()`: each run repeats it until `min_run_s` has passed."""
    for _ in range(max(warmup, 1)):
        fn()
        sync()
    start = time.perf_counter()
    fn()
    sync()
    single = time.perf_counter() - start
    inner = int(min(MAX_INNER_CALLS, max(1, math.ceil(min_run_s / max(single, 1e-9)))))
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        runs.append((time.perf_counter() - start) / inner)
    return runs, inner


def _time_loop(loop, sync, warmup, repeats, min_run_s):
    """Per-iteration seconds of `loop(k)`, a compiled loop of `k` iterations.

    `loop(0)` (the function call and loop set-up, no iteration) is timed as
    well and subtracted, so what remains is the cost of the iterations only.
    """
    def timed(k):
        start = time.perf_counter()
        loop(k)
        sync()
        return time.perf_counter() - start

    for _ in range(max(warmup, 1)):
        timed(1)
        timed(0)
    base = statistics.median(timed(0) for _ in range(max(repeats, 3)))
    probe = max(timed(32) - base, 1e-7) / 32
    # The loop should outlast the call overhead many times over, so that the
    # overhead's jitter is small against what is measured (within 10 x
    # min_run_s, so a slow or busy machine does not make profiling endless).
    target = min(max(min_run_s, 20.0 * base), 10.0 * min_run_s)
    k = int(min(MAX_LOOP_ITERATIONS, max(16, math.ceil(target / probe))))
    runs = [max(timed(k) - base, 0.0) / k for _ in range(repeats)]
    return runs, k


class _TensorFlowLoops:
    """Compiled loops running a layer's forward, forward+backward, or nothing.

    Inside a training step (one `tf.function` for the whole model) a layer
    costs its kernels plus the executor's per-op overhead, not a
    `tf.function` call. So each figure is the per-iteration time of a
    `tf.while_loop` (one iteration at a time) around the layer call, minus
    the per-iteration time of the same loop with an empty body.

    The loops take the layer's input tensors as arguments with the batch
    axis left open, so one trace serves every batch size (and every CPU
    testbed device, which all place ops on `cpu:0`).
    """

    def __init__(self, layer, template):
        from keras import tree

        self.layer = layer
        self.template = template
        self.flat_template = tree.flatten(template)
        self.positions = [i for i, x in enumerate(self.flat_template) if isinstance(x, _Spec)]
        self._loops = {}

    def rebuild(self, tensors):
        from keras import tree

        flat = list(self.flat_template)
        for position, tensor in zip(self.positions, tensors):
            flat[position] = tensor
        return tree.pack_sequence_as(self.template, flat)

    @staticmethod
    def _spec(tensor):
        import tensorflow as tf

        shape = tuple(tensor.shape)
        if shape:
            shape = (None,) + shape[1:]
        return tf.TensorSpec(shape, tensor.dtype)

    @staticmethod
    def _first(tensors):
        """One element of each result keeps the body's work alive (no pruning)."""
        import tensorflow as tf

        total = tf.constant(0.0)
        for t in tensors:
            if isinstance(t, tf.IndexedSlices):
                t = t.values
            if t is not None and tf.is_tensor(t):
                total += tf.cast(tf.reshape(t, [-1])[0], tf.float32)
        return total

    def _loop(self, name, body_fn, specs):
        import tensorflow as tf

        if name in self._loops:
            return self._loops[name]

        def loop(k, *arguments):
            def body(i, acc):
                return i + 1, acc + body_fn(*arguments)

            return tf.while_loop(
                lambda i, acc: i < k, body, (tf.constant(0), tf.constant(0.0)),
                parallel_iterations=1,
            )

        signature = [tf.TensorSpec((), tf.int32)] + list(specs)
        # Keras layers need no AutoGraph, and tracing without it is several
        # times faster; a custom layer with Python control flow on tensors
        # gets it on a retry.
        plain = tf.function(loop, input_signature=signature, autograph=False)
        state = {"fn": plain}

        def call(*arguments):
            try:
                return state["fn"](*arguments)
            except Exception:  # noqa: BLE001 - retried once with AutoGraph
                if state["fn"] is not plain:
                    raise
                state["fn"] = tf.function(loop, input_signature=signature, autograph=True)
                return state["fn"](*arguments)

        self._loops[name] = call
        return call

    def runners(self, tensors, upstream_seed):
        """Returns `(forward, forward_backward, empty)`, each `f(k)` running k iterations."""
        import numpy as np
        import tensorflow as tf
        from keras import tree

        layer = self.layer
        args, kwargs = self.rebuild(tensors)
        outputs = layer(*args, **kwargs)  # eager: builds the layer, gives output shapes
        flat_out = [o for o in tree.flatten(outputs) if tf.is_tensor(o) and o.dtype.is_floating]
        rng = np.random.default_rng(upstream_seed)
        upstream = [
            tf.constant(rng.standard_normal(tuple(o.shape)).astype(o.dtype.as_numpy_dtype))
            for o in flat_out
        ]
        float_index = [i for i, t in enumerate(tensors) if t.dtype.is_floating]
        variables = [getattr(v, "value", v) for v in getattr(layer, "trainable_variables", [])]
        in_specs = tuple(self._spec(t) for t in tensors)
        up_specs = tuple(self._spec(u) for u in upstream)
        n_in = len(tensors)

        def forward_body(*xs):
            a, kw = self.rebuild(xs)
            return self._first(tree.flatten(layer(*a, **kw)))

        forward_fn = self._loop("forward", forward_body, in_specs)
        empty_fn = self._loop("empty", lambda anchor: self._first([anchor]),
                              (tf.TensorSpec((None,), tf.float32),))
        anchor = tf.zeros((1,), tf.float32)

        def forward(k):
            return forward_fn(tf.constant(k, tf.int32), *tensors)

        def empty(k):
            return empty_fn(tf.constant(k, tf.int32), anchor)

        if not flat_out or not (float_index or variables):
            return forward, forward, empty

        def step_body(*xs):
            inputs, grads_out = xs[:n_in], xs[n_in:]
            watched = [inputs[i] for i in float_index]
            with tf.GradientTape() as tape:
                tape.watch(watched)
                a, kw = self.rebuild(inputs)
                out = layer(*a, **kw)
            out = [o for o in tree.flatten(out) if tf.is_tensor(o) and o.dtype.is_floating]
            grads = tape.gradient(out, watched + variables, output_gradients=list(grads_out))
            return self._first(list(grads))

        step_fn = self._loop("forward_backward", step_body, in_specs + up_specs)

        def forward_backward(k):
            return step_fn(tf.constant(k, tf.int32), *tensors, *upstream)

        return forward, forward_backward, empty


def _runner_torch(layer, args, kwargs, upstream_seed):
    import numpy as np
    import torch
    from keras import tree

    flat = [x for x in tree.flatten((list(args), kwargs)) if isinstance(x, torch.Tensor)]
    float_inputs = [x for x in flat if x.is_floating_point()]
    for x in float_inputs:
        x.requires_grad_(True)

    def forward():
        with torch.enable_grad():
            return layer(*args, **kwargs)

    outputs = forward()
    flat_out = [
        o for o in tree.flatten(outputs)
        if isinstance(o, torch.Tensor) and o.is_floating_point() and o.requires_grad
    ]
    rng = np.random.default_rng(upstream_seed)
    upstream = [
        torch.as_tensor(
            rng.standard_normal(tuple(o.shape)).astype(np.float32), device=o.device
        ).to(o.dtype)
        for o in flat_out
    ]
    params = [getattr(v, "value", v) for v in getattr(layer, "trainable_weights", [])]
    sources = float_inputs + [p for p in params if isinstance(p, torch.Tensor) and p.requires_grad]
    if not flat_out or not sources:
        return forward, forward, None

    def forward_backward():
        out = forward()
        out = [
            o for o in tree.flatten(out)
            if isinstance(o, torch.Tensor) and o.is_floating_point() and o.requires_grad
        ]
        return torch.autograd.grad(out, sources, grad_outputs=upstream, allow_unused=True)

    # Eager PyTorch pays the layer's Python and dispatch cost in training too:
    # nothing is subtracted.
    return forward, forward_backward, None


def _measure_layer(layer, template, device, backend, warmup, repeats, min_run_s, seed,
                   calibration=None, loops=None):
    """Times one layer call on `device`; returns a cache record dict.

    `calibration` (a dict) keeps the empty-loop time per device between
    calls, so it is measured once per device and profiling run; `loops`
    keeps the compiled TensorFlow loops per layer and placement, so they are
    traced once for all batch sizes.
    """
    import keras
    import numpy as np
    from keras import tree

    rng = np.random.default_rng(seed)
    sync = _sync_fn(device, backend)
    with keras.device(_keras_device_name(device)):
        args, kwargs = _materialise(template, layer, rng)
        if backend == "tensorflow":
            loops = {} if loops is None else loops
            key = (_keras_device_name(device), id(layer), _structure_key(template))
            runner = loops.get(key)
            if runner is None:
                runner = loops[key] = _TensorFlowLoops(layer, template)
            tensors = [x for x in tree.flatten((args, kwargs)) if _is_tensor(x)]
            forward, forward_backward, empty = runner.runners(tensors, seed + 1)
            timer = _time_loop
        else:
            forward, forward_backward, empty = _runner_torch(layer, args, kwargs, seed + 1)
            timer = _time_runs
        fwd_runs, fwd_inner = timer(forward, sync, warmup, repeats, min_run_s)
        has_backward = forward_backward is not forward
        if has_backward:
            both_runs, both_inner = timer(forward_backward, sync, warmup, repeats, min_run_s)
        else:
            both_runs, both_inner = list(fwd_runs), fwd_inner
        overhead_s = 0.0
        if empty is not None:
            calibration = {} if calibration is None else calibration
            if device.name not in calibration:
                empty_runs, _ = timer(empty, sync, warmup, repeats, min_run_s)
                calibration[device.name] = statistics.median(empty_runs)
            overhead_s = calibration[device.name]
    forward_s = max(statistics.median(fwd_runs) - overhead_s, 0.0)
    both_s = max(statistics.median(both_runs) - overhead_s, 0.0)
    return {
        "forward_s": forward_s,
        "backward_s": max(both_s - forward_s, 0.0) if has_backward else 0.0,
        "forward_runs_s": fwd_runs,
        "forward_backward_runs_s": both_runs,
        "loop_overhead_s": overhead_s,
        "has_backward": has_backward,
        "inner_calls": [fwd_inner, both_inner],
        "method": "tf.while_loop in tf.function" if backend == "tensorflow" else "eager autograd",
        "warmup": warmup,
        "repeats": repeats,
        "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
    }


def _check_batch_sizes(batch_sizes):
    if isinstance(batch_sizes, (int, str)):
        batch_sizes = [batch_sizes]
    try:
        sizes = sorted({int(b) for b in batch_sizes})
    except (TypeError, ValueError):
        raise EstimatorError(
            "batch_sizes must be positive integers, e.g. (8, 32). "
            f"Received: {batch_sizes!r}"
        ) from None
    if not sizes or sizes[0] <= 0 or any(
        isinstance(b, bool) or (isinstance(b, float) and b != int(b)) for b in batch_sizes
    ):
        raise EstimatorError(
            f"batch_sizes must be positive integers, e.g. (8, 32). Received: {batch_sizes!r}"
        )
    return sizes


def _check_counts(warmup, repeats, budget_s):
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
        raise EstimatorError(f"warmup must be an integer >= 0. Received: {warmup!r}")
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise EstimatorError(f"repeats must be an integer >= 1. Received: {repeats!r}")
    if budget_s is not None and (
        not isinstance(budget_s, (int, float)) or isinstance(budget_s, bool) or budget_s < 0
        or math.isnan(budget_s)
    ):
        raise EstimatorError(
            "budget_s must be a non-negative number of seconds or None (no limit). "
            f"Received: {budget_s!r}"
        )


def _resolve_cluster(cluster):
    from autodist_keras.devices import Cluster

    if cluster is None:
        return Cluster.detect()
    if isinstance(cluster, str) and cluster == "cpu_testbed":
        return Cluster.cpu_testbed()
    return Cluster.resolve(cluster)


def profile_layers(
    model,
    cluster=None,
    batch_sizes=DEFAULT_BATCH_SIZES,
    devices=None,
    graph=None,
    warmup=DEFAULT_WARMUP,
    repeats=DEFAULT_REPEATS,
    min_run_s=DEFAULT_MIN_RUN_S,
    cache_dir=None,
    use_cache=True,
    budget_s=None,
    progress=True,
    unknown_dim=DEFAULT_UNKNOWN_DIM,
    seed=0,
):
    """Measures every layer's forward and backward time on local devices.

    Each layer of the model's graph is timed in isolation on each device for
    each batch size, on the active Keras backend, as it runs in training:
    on TensorFlow inside a compiled `tf.while_loop` (per-iteration time, minus
    the loop's own per-iteration cost, so neither the `tf.function` call nor
    the loop is counted), on PyTorch as eager Keras calls with autograd.
    `warmup` untimed calls, then the median of `repeats` runs; a run repeats
    the call until it lasts at least `min_run_s`, so microsecond layers are
    timed over many calls. Backward is `median(forward + backward) -
    median(forward)` (gradients of the inputs and the trainable weights).

    Args:
        model: A built Keras model.
        cluster: `None` (`Cluster.detect()`), `"cpu_testbed"`, a `Cluster`, or
            anything `Cluster.resolve` takes. Its devices must be local.
        batch_sizes: Batch sizes to profile.
        devices: Device names to profile (default: all of the cluster's).
        graph: The model's `ModelGraph` (built when omitted).
        warmup: Untimed calls before timing (the first traces the function).
        repeats: Timed runs per figure; the median is kept.
        min_run_s: Minimum duration of one timed run.
        cache_dir: Cache directory (default `$AUTODIST_KERAS_CACHE` or
            `~/.cache/autodist_keras`).
        use_cache: Read and write the cache.
        budget_s: Stop measuring after this many seconds (checked between
            measurements), keep what was measured and list the rest in
            `skipped`; None for no limit.
        progress: Show a tqdm progress bar.
        unknown_dim: Size given to unknown non-batch dimensions (e.g. a
            variable sequence length).
        seed: Seed of the random inputs.

    Returns:
        A `LayerProfile`.

    Raises:
        EstimatorError: For invalid arguments, or a device that is not on
            this machine.

    Example:

    ```python
    profile = profile_layers(model, "cpu_testbed", batch_sizes=(8, 32), budget_s=60)
    print(profile.summary())
    ```
    """
    from tqdm.auto import tqdm

    started = time.perf_counter()
    sizes = _check_batch_sizes(batch_sizes)
    _check_counts(warmup, repeats, budget_s)
    backend = _keras_backend()
    if backend not in ("tensorflow", "torch"):
        raise EstimatorError(
            "The profiler runs on the 'tensorflow' and 'torch' Keras backends; set "
            f"KERAS_BACKEND before importing keras. Received: {backend!r}"
        )
    if not getattr(model, "built", False):
        raise EstimatorError(
            f"Model {getattr(model, 'name', model)!r} is not built; call it on data or "
            "give it an Input before profiling. Received: an unbuilt model"
        )
    cluster = _resolve_cluster(cluster)
    names = list(devices) if devices is not None else list(cluster.names)
    for name in names:
        if name not in cluster.names:
            raise EstimatorError(
                f"Unknown device {name!r}; the cluster has {cluster.names}. Received: {name!r}"
            )
    for name in names:
        _check_local(cluster.device(name), backend)
    if graph is None:
        from autodist_keras.graph import ModelGraph

        graph = ModelGraph.from_keras(model)
    cache = ProfileCache(cache_dir) if use_cache else None
    versions = _framework_versions(backend)
    # Contention is among all of the cluster's devices (the testbed's peak
    # FLOP/s are split the same way), also when only some are profiled.
    sharing = sharing_factors(cluster)
    calls = _graph_calls(model, graph)
    nodes = [n for n in graph.nodes.values() if not _is_input_node(n)]

    templates = {}
    skipped = []
    for node in nodes:
        try:
            templates[node.name] = _call_template(model, node, calls)
        except AutodistError:
            raise
        except Exception as e:  # noqa: BLE001 - report and go on with the other layers
            for name in names:
                for b in sizes:
                    skipped.append({"node": node.name, "device": name, "batch_size": b,
                                    "reason": f"cannot build a call: {type(e).__name__}: {e}"})

    device_info = {}
    for name in names:
        d = cluster.device(name)
        device_info[name] = {
            "signature": device_signature(d),
            "sharing": sharing[name],
            "peak_flops_fp32": d.peak_flops_fp32,
            "memory_bandwidth": d.memory_bandwidth,
        }

    # Every (device, batch, node) task with its cache fields.
    tasks = []
    for name in names:
        for b in sizes:
            for node in nodes:
                if node.name not in templates:
                    continue
                layer, args_t, kwargs_t = templates[node.name]
                args_b, kwargs_b = _fill_batch((args_t, kwargs_t), b, unknown_dim)
                fields = {
                    "kind": "layer",
                    "method": MEASUREMENT_VERSION,
                    "backend": backend,
                    "versions": versions,
                    "layer": layer_signature(layer, args_b, kwargs_b),
                    "device": device_info[name]["signature"],
                }
                tasks.append((name, b, node, layer, (args_b, kwargs_b), fields))

    timings = []
    measured = 0
    reused = 0
    fresh = {}
    built = {}
    calibration = {}
    loops = {}
    bar = tqdm(total=len(tasks), desc="profiling layers", unit="layer", disable=not progress,
               leave=False)
    budget_hit = False
    current_device = None
    pin_stack = contextlib.ExitStack()
    try:
        for name, b, node, layer, template, fields in tasks:
            device = cluster.device(name)
            digest = _sha256(fields)
            record = fresh.get(digest)
            from_cache = False
            if record is None and cache is not None:
                record = cache.get(fields)
                from_cache = record is not None
            if record is None:
                if budget_s is not None and time.perf_counter() - started >= budget_s:
                    budget_hit = True
                    skipped.append({"node": node.name, "device": name, "batch_size": b,
                                    "reason": f"time budget of {budget_s:g} s spent"})
                    bar.update(1)
                    continue
                if current_device != name:
                    pin_stack.close()
                    pin_stack = contextlib.ExitStack()
                    pin_info = pin_stack.enter_context(pinned_to(device, backend))
                    current_device = name
                key = (_keras_device_name(device), id(layer))
                source = "from_config"
                try:
                    if key not in built:
                        with _keras_device(device):
                            copy = _rebuild(layer)
                        built[key] = (copy, "from_config") if copy is not None else (
                            layer, "model_layer")
                    target, source = built[key]
                    try:
                        record = _measure_layer(
                            target, template, device, backend, warmup, repeats, min_run_s, seed,
                            calibration, loops,
                        )
                    except Exception:  # noqa: BLE001 - a rebuilt copy may not run alone
                        if source != "from_config":
                            raise
                        built[key] = (layer, "model_layer")
                        target, source = built[key]
                        record = _measure_layer(
                            target, template, device, backend, warmup, repeats, min_run_s, seed,
                            calibration, loops,
                        )
                except Exception as e:  # noqa: BLE001 - report and go on
                    skipped.append({
                        "node": node.name, "device": name, "batch_size": b,
                        "reason": f"{type(e).__name__}: {_first_line(e)}",
                    })
                    bar.update(1)
                    continue
                record.update({
                    "source": source,
                    "layer_type": node.layer_type,
                    "input_bytes": _input_bytes(*template),
                    "affinity_used": pin_info["affinity_used"],
                    "threads_used": pin_info["threads_used"],
                })
                measured += 1
                fresh[digest] = record
                if cache is not None:
                    cache.put(fields, record)
            elif from_cache:
                reused += 1
            # else: same signature as a node measured earlier in this run.
            timings.append(LayerTiming(
                node=node.name,
                layer_type=node.layer_type,
                device=name,
                batch_size=b,
                forward_s=float(record["forward_s"]),
                backward_s=float(record["backward_s"]),
                sharing=float(sharing[name]),
                forward_runs_s=list(record.get("forward_runs_s", [])),
                forward_backward_runs_s=list(record.get("forward_backward_runs_s", [])),
                cached=from_cache,
                source=record.get("source", "from_config"),
                key=digest,
                details={k: record.get(k) for k in (
                    "inner_calls", "affinity_used", "threads_used", "input_bytes",
                    "loop_overhead_s", "has_backward", "method", "measured_at", "warmup", "repeats")},
            ))
            bar.update(1)
    finally:
        pin_stack.close()
        bar.close()
    if budget_hit and progress:
        print(
            f"profile_layers: time budget of {budget_s:g} s spent; kept {len(timings)} "
            f"figures, skipped {sum(1 for s in skipped if 'budget' in s['reason'])}.",
            file=sys.stderr,
        )
    return LayerProfile(
        backend=backend,
        timings=timings,
        skipped=skipped,
        measured=measured,
        reused=reused,
        elapsed_s=time.perf_counter() - started,
        budget_s=budget_s,
        devices=device_info,
        settings={
            "batch_sizes": sizes, "warmup": warmup, "repeats": repeats,
            "min_run_s": min_run_s, "unknown_dim": unknown_dim, "versions": versions,
            "seed": seed,
        },
        graph_fingerprint=graph.fingerprint() if hasattr(graph, "fingerprint") else None,
        model_name=getattr(model, "name", None),
    )


@contextlib.contextmanager
def _keras_device(device):
    import keras

    with keras.device(_keras_device_name(device)):
        yield


def _first_line(error):
    text = str(error).strip().splitlines()
    return text[0][:300] if text else ""


# --------------------------------------------------------------- collectives


def fit_alpha_beta(sizes, times):
    """Fits `time = latency + size / bandwidth` by non-negative least squares.

    Rows are weighted by `1 / time`, so the fit minimises relative error and
    small messages (which fix the latency) count as much as large ones.

    Args:
        sizes: Message sizes in bytes.
        times: Measured times in seconds (same length).

    Returns:
        A dict with `latency_s`, `bandwidth` (bytes/s; `inf` when the time
        does not grow with size, stored as null in JSON), `max_rel_error` and
        `mean_rel_error` of the fit over the points.

    Raises:
        EstimatorError: With fewer than two sizes or non-positive times.
    """
    import numpy as np
    from scipy.optimize import nnls

    sizes = np.asarray(sizes, dtype=float)
    times = np.asarray(times, dtype=float)
    if sizes.shape != times.shape or len(sizes) < 2 or len(set(sizes.tolist())) < 2:
        raise EstimatorError(
            "An alpha-beta fit needs at least two distinct message sizes with one time "
            f"each. Received: sizes={sizes.tolist()}, times={times.tolist()}"
        )
    if not np.all(np.isfinite(times)) or np.any(times <= 0):
        raise EstimatorError(
            f"Measured times must be positive and finite. Received: {times.tolist()}"
        )
    weights = 1.0 / times
    design = np.stack([np.ones_like(sizes), sizes], axis=1) * weights[:, None]
    (alpha, beta), _ = nnls(design, times * weights)
    predicted = alpha + beta * sizes
    rel = np.abs(predicted - times) / times
    return {
        "latency_s": float(alpha),
        "bandwidth": float(1.0 / beta) if beta > 0 else float("inf"),
        "max_rel_error": float(rel.max()),
        "mean_rel_error": float(rel.mean()),
    }


def _collective_worker(rank, world, port, dist_backend, ops, sizes, warmup, repeats,
                       affinities, threads, timeout_s, out_dir, parent_pid):
    """One rank of `profile_collectives` (runs in a spawned process).

    A parent killed outright (SIGKILL, or SIGTERM without a handler) cleans
    nothing up, so the rank watches it as the PyTorch runtime's workers do
    (`torch_worker.watch_parent`) and exits within a second of its death.
    """
    import threading

    from autodist_keras.backends.torch_worker import watch_parent

    threading.Thread(target=watch_parent, args=(parent_pid,), daemon=True).start()
    result = {"rank": rank, "ok": False}
    try:
        affinity = affinities[rank]
        if affinity and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, set(affinity))
        import datetime as _dt

        import torch
        import torch.distributed as dist

        if threads[rank]:
            torch.set_num_threads(int(threads[rank]))
        # The parent hosts the store on loopback (`loopback_store`); every rank is a client.
        store = dist.TCPStore("127.0.0.1", port, world + 1, False,
                              timeout=_dt.timedelta(seconds=timeout_s))
        dist.init_process_group(
            dist_backend, store=store, rank=rank,
            world_size=world, timeout=_dt.timedelta(seconds=timeout_s),
        )
        use_cuda = dist_backend == "nccl"
        device = torch.device(f"cuda:{rank}") if use_cuda else torch.device("cpu")
        sync = torch.cuda.synchronize if use_cuda else (lambda: None)
        runs = {}

        def timed(fn):
            for _ in range(warmup):
                fn()
            sync()
            out = []
            for _ in range(repeats):
                dist.barrier()
                start = time.perf_counter()
                fn()
                sync()
                out.append(time.perf_counter() - start)
            return out

        for op in ops:
            for size in sizes:
                buf = torch.ones(max(int(size) // 4, 1), dtype=torch.float32, device=device)
                if op == "allreduce":
                    runs.setdefault("allreduce", {})[str(size)] = timed(lambda: dist.all_reduce(buf))
                elif op == "broadcast":
                    runs.setdefault("broadcast", {})[str(size)] = timed(
                        lambda: dist.broadcast(buf, src=0)
                    )
                elif op == "p2p":
                    for a in range(world):
                        for b in range(a + 1, world):
                            key = f"{a}-{b}"

                            def ping():
                                if rank == a:
                                    dist.send(buf, dst=b)
                                    dist.recv(buf, src=b)
                                elif rank == b:
                                    dist.recv(buf, src=a)
                                    dist.send(buf, dst=a)

                            # Ping-pong: one run moves the message twice.
                            times = [t / 2.0 for t in timed(ping)]
                            if rank in (a, b):
                                runs.setdefault("p2p", {}).setdefault(key, {})[str(size)] = times
        dist.barrier()
        dist.destroy_process_group()
        result.update(ok=True, runs=runs, affinity_used=sorted(os.sched_getaffinity(0))
                      if hasattr(os, "sched_getaffinity") else None)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        result.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-2000:])
    write_json_atomic(os.path.join(out_dir, f"rank{rank}.json"), result)


@dataclasses.dataclass
class CollectiveProfile:
    """Measured collective and point-to-point times with alpha-beta fits.

    Args:
        devices: Device names, in rank order.
        backend: `torch.distributed` backend (`"gloo"` or `"nccl"`).
        sizes: Message sizes in bytes.
        samples: `{op: {label: {size: median seconds}}}`; label `"all"` for
            all-reduce and broadcast, `"a|b"` (device names) for point-to-point.
        fits: List of dicts `{op, devices, latency_s, bandwidth, max_rel_error,
            mean_rel_error}`; for all-reduce also the per-link latency and
            bandwidth implied by the ring formula.
        settings: Warm-up, repeats, timeout, versions.
        elapsed_s: Wall time, seconds.
        cached: True when taken from the cache.
    """

    devices: list
    backend: str
    sizes: list
    samples: dict
    fits: list
    settings: dict = dataclasses.field(default_factory=dict)
    elapsed_s: float = 0.0
    cached: bool = False

    def fit(self, op, a=None, b=None):
        """The fit of `op`; for `"p2p"` the one between devices `a` and `b`.

        Raises:
            EstimatorError: If nothing was measured for it.
        """
        for f in self.fits:
            if f["op"] != op:
                continue
            if op != "p2p" or set(f["devices"]) == {a, b}:
                return f
        raise EstimatorError(
            f"No {op!r} fit" + (f" between {a!r} and {b!r}" if op == "p2p" else "")
            + f" in this collective profile (devices {self.devices}). "
            f"Received: op={op!r}"
        )

    def topology(self, base=None):
        """A topology whose links are the measured point-to-point fits.

        Args:
            base: A `Topology` to answer for pairs not measured (default:
                none; those raise `KeyError`, as an unknown pair does).

        Returns:
            A `MeasuredTopology`, usable wherever `CommModel` takes a topology.
        """
        return MeasuredTopology(self, base)

    def to_dict(self):
        """JSON-ready dict; an unbounded bandwidth (`inf`) is stored as None (`null`)."""
        data = dataclasses.asdict(self)
        data["fits"] = [{k: (None if k in BANDWIDTH_FIELDS and v == math.inf else v)
                         for k, v in fit.items()} for fit in data["fits"]]
        data["schema"] = "autodist_keras.collective_profile/1"
        return data

    @classmethod
    def from_dict(cls, data):
        """Builds a profile from `to_dict()` output (a null bandwidth reads as `inf`).

        Files written before bandwidths were stored as null hold `Infinity`
        there; they read the same.
        """
        if not isinstance(data, dict) or data.get("schema") != "autodist_keras.collective_profile/1":
            raise EstimatorError(
                "Not a collective profile (expected schema "
                "'autodist_keras.collective_profile/1'). "
                f"Received: {data.get('schema') if isinstance(data, dict) else type(data).__name__!r}"
            )
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in fields}
        if isinstance(kwargs.get("fits"), list):
            kwargs["fits"] = [
                {k: (math.inf if k in BANDWIDTH_FIELDS and v is None else v)
                 for k, v in fit.items()} if isinstance(fit, dict) else fit
                for fit in kwargs["fits"]]
        return cls(**kwargs)

    def summary(self):
        lines = [f"Collectives over {self.devices} ({self.backend}), measured, median of runs:"]
        for f in self.fits:
            bw = f["bandwidth"]
            bw_text = f"{bw / 1e9:.3f} GB/s" if math.isfinite(bw) else "unbounded"
            lines.append(
                f"  {f['op']:<9} {'|'.join(f['devices']) if f['op'] == 'p2p' else 'all':<28} "
                f"latency {f['latency_s'] * 1e6:8.1f} us  bandwidth {bw_text:>14}  "
                f"fit error max {f['max_rel_error'] * 100:.0f}%"
            )
        return "\n".join(lines)


class MeasuredTopology:
    """Link latency and bandwidth from measured point-to-point fits.

    Has the `bandwidth(a, b)` and `latency(a, b)` methods of
    `devices.Topology`, so `CommModel(MeasuredTopology(...))` prices
    transfers and collectives with measured links.

    Args:
        profile: A `CollectiveProfile`.
        base: A `Topology` for pairs that were not measured, or None.
    """

    def __init__(self, profile, base=None):
        self.base = base
        self._links = {}
        for f in profile.fits:
            if f["op"] == "p2p":
                a, b = f["devices"]
                self._links[(a, b)] = self._links[(b, a)] = (f["latency_s"], f["bandwidth"])

    def _get(self, a, b):
        if (a, b) in self._links:
            return self._links[(a, b)]
        if self.base is not None:
            return (self.base.latency(a, b), self.base.bandwidth(a, b))
        raise KeyError(f"{a}|{b}")

    def latency(self, a, b):
        return self._get(a, b)[0]

    def bandwidth(self, a, b):
        return self._get(a, b)[1]

    def __getattr__(self, name):
        if name != "base" and self.base is not None:
            return getattr(self.base, name)
        raise AttributeError(name)


def profile_collectives(
    cluster=None,
    devices=None,
    sizes=DEFAULT_COLLECTIVE_SIZES,
    ops=COLLECTIVE_OPS,
    warmup=2,
    repeats=5,
    timeout_s=120.0,
    cache_dir=None,
    use_cache=True,
):
    """Measures all-reduce, broadcast and point-to-point times between local devices.

    Spawns one process per device (pinned to the device's cores for CPU
    testbed devices), joins them in a `torch.distributed` group over loopback
    on a free port (gloo; NCCL when every device is a GPU), times each
    operation over `sizes` (median of `repeats` runs after `warmup`, every run
    started after a barrier; the time of a run is the slowest rank's), and
    fits `latency + size / bandwidth` per operation and, for point-to-point
    (ping-pong, half the round trip), per device pair. Child processes are
    killed when they overrun `timeout_s`.

    Args:
        cluster: `None` (`Cluster.detect()`), `"cpu_testbed"` or a `Cluster`.
        devices: Device names (default: all); at least two. A single detected
            CPU is profiled as two processes on it (`"<name>#0"`, `"<name>#1"`).
        sizes: Message sizes in bytes (at least two distinct).
        ops: Subset of `("allreduce", "broadcast", "p2p")`.
        warmup: Untimed runs per size.
        repeats: Timed runs per size.
        timeout_s: Limit for the whole measurement, seconds.
        cache_dir: Cache directory (as in `profile_layers`).
        use_cache: Read and write the cache.

    Returns:
        A `CollectiveProfile`.

    Raises:
        EstimatorError: If PyTorch is missing, the main script has no
            `if __name__ == "__main__":` guard (each spawned process imports
            it), arguments are invalid, a worker fails, or the measurement
            overruns `timeout_s`.

    Example:

    ```python
    if __name__ == "__main__":  # the spawned processes import this script
        links = profile_collectives("cpu_testbed", sizes=(1 << 10, 1 << 20), repeats=3)
        print(links.summary())
    ```
    """
    started = time.perf_counter()
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        raise EstimatorError(
            "Profiling collectives needs PyTorch (torch.distributed). Install it with "
            "`pip install torch` (CPU build is enough here). Received: no torch module"
        ) from None
    from autodist_keras.backends.torch_pool import check_main_guard

    # Spawned children import the main script: refuse a script without a main guard
    # now, not after each child died in multiprocessing's bootstrapping.
    check_main_guard("profile_collectives()", error=EstimatorError)
    cluster = _resolve_cluster(cluster)
    names = list(devices) if devices is not None else list(cluster.names)
    for name in names:
        if name not in cluster.names:
            raise EstimatorError(
                f"Unknown device {name!r}; the cluster has {cluster.names}. Received: {name!r}"
            )
    unknown = [op for op in ops if op not in COLLECTIVE_OPS]
    if unknown or not ops:
        raise EstimatorError(f"ops must be a non-empty subset of {COLLECTIVE_OPS}. Received: {ops!r}")
    try:
        sizes = sorted({int(s) for s in sizes})
    except (TypeError, ValueError):
        raise EstimatorError(f"sizes must be byte counts. Received: {sizes!r}") from None
    if len(sizes) < 2 or sizes[0] < 4:
        raise EstimatorError(
            "sizes needs at least two distinct message sizes of 4 bytes or more, to fit "
            f"latency and bandwidth. Received: {sizes!r}"
        )
    _check_counts(warmup, repeats, timeout_s)
    labels = list(names)
    if len(names) == 1:
        labels = [f"{names[0]}#0", f"{names[0]}#1"]
        names = [names[0], names[0]]
    device_objs = [cluster.device(n) for n in names]
    for d in device_objs:
        if d.kind == "gpu":
            _check_local(d, "torch")
    all_gpu = all(d.kind == "gpu" for d in device_objs)
    dist_backend = "nccl" if all_gpu and dist.is_nccl_available() else "gloo"
    world = len(names)
    fields = {
        "kind": "collective",
        "backend": dist_backend,
        "torch": torch.__version__,
        "devices": [device_signature(d) for d in device_objs],
        "labels": labels,
        "sizes": sizes,
        "ops": sorted(ops),
        "warmup": warmup,
        "repeats": repeats,
    }
    cache = ProfileCache(cache_dir) if use_cache else None
    if cache is not None:
        record = cache.get(fields)
        if record is not None:
            profile = CollectiveProfile.from_dict(record)
            profile.cached = True
            return profile

    affinities = [sorted(d.cpu_affinity) if d.cpu_affinity else None for d in device_objs]
    threads = [d.threads for d in device_objs]
    ctx = multiprocessing.get_context("spawn")
    from autodist_keras.backends.torch_transport import loopback_store

    with tempfile.TemporaryDirectory(prefix="autodist-collectives-") as out_dir:
        store = loopback_store(world + 1, timeout_s)
        port = store.port
        procs = [
            ctx.Process(
                target=_collective_worker,
                args=(rank, world, port, dist_backend, list(ops), sizes, warmup, repeats,
                      affinities, threads, float(timeout_s), out_dir, os.getpid()),
                daemon=True,
            )
            for rank in range(world)
        ]
        deadline = time.monotonic() + timeout_s
        try:
            for p in procs:
                p.start()
            for p in procs:
                p.join(max(deadline - time.monotonic(), 0.1))
            overrun = [i for i, p in enumerate(procs) if p.is_alive()]
        finally:
            launched = [p for p in procs if p.pid is not None]  # start() may have raised
            for p in launched:
                if p.is_alive():
                    p.terminate()
            for p in launched:
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join(5)
            store = None  # closes the listening socket now, not at the next collection
        results = []
        for rank in range(world):
            try:
                with open(os.path.join(out_dir, f"rank{rank}.json"), encoding="utf-8") as f:
                    results.append(json.load(f))
            except (OSError, ValueError):
                results.append({"rank": rank, "ok": False, "error": "no result written"})
    failed = [r for r in results if not r.get("ok")]
    if overrun or failed:
        detail = "; ".join(f"rank {r['rank']}: {r.get('error')}" for r in failed[:3])
        if overrun:
            raise EstimatorError(
                f"Collective profiling over {labels} did not finish within {timeout_s:g} s "
                f"(ranks {overrun} still running, killed). Raise timeout_s or use fewer "
                f"sizes. Received: timeout_s={timeout_s!r}. {detail}"
            )
        raise EstimatorError(
            f"Collective profiling over {labels} failed ({dist_backend}): {detail}. "
            f"Received: {len(failed)} failed rank(s)"
        )

    samples = {}
    for op in ops:
        if op in ("allreduce", "broadcast"):
            per_size = {}
            for size in sizes:
                per_rank = [r["runs"][op][str(size)] for r in results]
                slowest = [max(vals) for vals in zip(*per_rank)]
                per_size[str(size)] = statistics.median(slowest)
            samples[op] = {"all": per_size}
        else:
            pairs = {}
            for a in range(world):
                for b in range(a + 1, world):
                    key = f"{a}-{b}"
                    per_size = {}
                    for size in sizes:
                        per_rank = [r["runs"]["p2p"][key][str(size)] for r in results
                                    if key in r["runs"].get("p2p", {})]
                        slowest = [max(vals) for vals in zip(*per_rank)]
                        per_size[str(size)] = statistics.median(slowest)
                    pairs[f"{labels[a]}|{labels[b]}"] = per_size
            samples["p2p"] = pairs
    fits = []
    for op, by_label in samples.items():
        for label, per_size in by_label.items():
            fit = fit_alpha_beta(sizes, [per_size[str(s)] for s in sizes])
            fit["op"] = op
            fit["devices"] = label.split("|") if op == "p2p" else list(labels)
            if op == "allreduce" and world > 1:
                # Ring all-reduce: 2(n-1) alpha + 2(n-1)/n S / B.
                steps = 2 * (world - 1)
                fit["ring_link_latency_s"] = fit["latency_s"] / steps
                fit["ring_link_bandwidth"] = fit["bandwidth"] * steps / world
            fits.append(fit)
    profile = CollectiveProfile(
        devices=labels,
        backend=dist_backend,
        sizes=sizes,
        samples=samples,
        fits=fits,
        settings={
            "warmup": warmup, "repeats": repeats, "timeout_s": timeout_s,
            "torch": torch.__version__, "affinities": affinities, "threads": threads,
        },
        elapsed_s=time.perf_counter() - started,
    )
    if cache is not None:
        cache.put(fields, profile.to_dict())
    return profile


# ----------------------------------------------------------------------- CLI
def add_profile_arguments(parser):
    """Adds the `autodist-keras profile` options to an argparse parser.

    Example:

    ```python
    p = sub.add_parser("profile", help="measure layer and link times on this machine")
    add_profile_arguments(p)
    p.set_defaults(func=lambda args: profile_main(args))
    ```
    """
    parser.add_argument("--model", required=True,
                        help="ResNet50, mlp, a .keras file or module:function")
    parser.add_argument("--cluster", default=None,
                        help="local devices to profile: omitted (detect) or 'cpu_testbed'")
    parser.add_argument("--batch-sizes", default=",".join(str(b) for b in DEFAULT_BATCH_SIZES),
                        help="comma-separated batch sizes (default %(default)s)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="stop measuring after this many seconds, keep the rest")
    parser.add_argument("--out", default=None, help="write the profile JSON here")
    parser.add_argument("--cache-dir", default=None,
                        help=f"cache directory (default ${CACHE_ENV} or ~/.cache/autodist_keras)")
    parser.add_argument("--no-cache", action="store_true", help="neither read nor write the cache")
    parser.add_argument("--warmup", type=int, default=DEFAULT_WARMUP)
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS)
    parser.add_argument("--collectives", action="store_true",
                        help="also time all-reduce, broadcast and point-to-point transfers")
    parser.add_argument("--collective-sizes", default=None,
                        help="comma-separated message sizes in bytes for --collectives")
    parser.add_argument("--train-cost-model", default=None, metavar="PATH",
                        help="fit a LearnedCostModel on this profile and write its JSON here")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def _int_list(text, what):
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise EstimatorError(
            f"{what} must be comma-separated integers, e.g. 8,32. Received: {text!r}"
        ) from None
    if not values:
        raise EstimatorError(f"{what} must list at least one integer. Received: {text!r}")
    return values


def profile_main(args):
    """Runs `autodist-keras profile`: profiles a model's layers (and links) here.

    Args:
        args: An `argparse.Namespace` made by a parser with
            `add_profile_arguments`, or a list of command-line strings.

    Returns:
        The exit status (0).

    Raises:
        AutodistError: For a bad model, cluster or option (the CLI prints it).
    """
    import argparse

    if not isinstance(args, argparse.Namespace):
        parser = add_profile_arguments(argparse.ArgumentParser(prog="autodist-keras profile"))
        args = parser.parse_args(list(args))
    try:
        return _profile_main(args)
    except EstimatorError as e:
        if getattr(e, "cache_directory", None) is None:
            raise
        # On the command line the fix is an option, not `cache_dir=`.
        raise _unwritable_cache(
            e.cache_directory, e.cache_reason,
            f"Pass --cache-dir DIR with a writable directory (or set {CACHE_ENV}), or "
            "--no-cache to measure without one.",
        ) from None


def _profile_main(args):
    """`profile_main` once its arguments are parsed."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from autodist_keras.graph import ModelGraph
    from autodist_keras.graph import load_model
    from autodist_keras.strategies.plan import output_target

    # Bad output paths fail now, not after the measurements.
    if args.out:
        output_target(args.out, "profile.json")
    if getattr(args, "train_cost_model", None):
        output_target(args.train_cost_model, "cost_model.json")
    batch_sizes = _int_list(args.batch_sizes, "--batch-sizes")
    cluster = _resolve_cluster(args.cluster)
    model = load_model(args.model)
    graph = ModelGraph.from_keras(model)
    profile = profile_layers(
        model, cluster, batch_sizes=batch_sizes, graph=graph, warmup=args.warmup,
        repeats=args.repeats, cache_dir=args.cache_dir, use_cache=not args.no_cache,
        budget_s=args.budget_s, progress=not args.quiet,
    )
    print(profile.summary())
    samples = None
    if args.train_cost_model:
        from autodist_keras.estimator.learned_cost import samples_from_profile

        # Checked before the collectives are measured, which take a while.
        samples = samples_from_profile(profile, graph, cluster)
        if not samples:
            why = (f"; the first because: {profile.skipped[0]['reason']}"
                   if profile.skipped else "")
            fix = ("Raise --budget-s (or leave it out) so that the layers are measured."
                   if args.budget_s is not None else "Fix the errors of the skipped layers.")
            raise EstimatorError(
                "--train-cost-model needs measured layer times, but the profile has none "
                f"({len(profile.skipped)} measurement(s) skipped{why}). {fix} "
                f"Received: --budget-s={args.budget_s!r}"
            )
    result = {"layers": profile.to_dict(), "collectives": None, "cluster": cluster.to_dict()}
    links = None
    if args.collectives:
        sizes = (_int_list(args.collective_sizes, "--collective-sizes")
                 if args.collective_sizes else DEFAULT_COLLECTIVE_SIZES)
        links = profile_collectives(
            cluster, sizes=sizes, cache_dir=args.cache_dir, use_cache=not args.no_cache,
        )
        print(links.summary())
        result["collectives"] = links.to_dict()
    if args.train_cost_model:
        from autodist_keras.estimator.learned_cost import LearnedCostModel

        cost = LearnedCostModel.train(samples, cluster, regressor="auto", links=links)
        cost.to_json(args.train_cost_model)
        report = cost.report
        print(
            f"Learned cost model ({cost.regressor}, {len(samples)} samples) written to "
            f"{args.train_cost_model}; held-out MAPE by {report.get('held_out_by')}: "
            f"learned {report.get('learned_mape', float('nan')):.1f}%, analytic "
            f"{report.get('analytic_mape', float('nan')):.1f}% (measured on this machine)."
        )
    if args.out:
        write_json_atomic(args.out, result)
        print(f"Profile written to {args.out}")
    return 0
