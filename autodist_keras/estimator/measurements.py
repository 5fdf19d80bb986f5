"""Real step-time measurements of (model, plan, cluster) cases, stored as JSON.

The learned iteration estimator (`estimator/learned.py`) is trained on what
this module measures: a `Case` names a model builder, a plan kind and a batch
size; `measure_case` builds the model, extracts its `ModelGraph`, makes the
plan for the cluster, asks the simulator for its (analytic) prediction, then
trains the model for real and returns a `Record` with the median step time
over `steps` steps after `warmup` steps.

How a case runs (`isolate=True`, the default): in a fresh Python process with
`KERAS_BACKEND` set to the requested backend, through the runtime adapters,
exactly as a user's `model.fit` runs a plan:

- PyTorch: `AutoStrategy(cluster=..., plan=...)`, `model.fit` with a
  `timing.StepTimer`. Every replica is one process pinned to its device's
  cores and thread count; rank 0's step includes waiting for the gradient
  all-reduce, so its time is the distributed step time.
- TensorFlow: `tensorflow_adapter.run_steps` with the plan: one worker
  process per plan device, each pinned to its device's cores and thread
  count, gradients summed by `MultiWorkerMirroredStrategy` collectives;
  rank 0's steps are timed. In one TensorFlow process the testbed's logical
  devices share one thread pool and do not get their own cores (see
  docs/runtime_tensorflow.md), so this is how the testbed is realised.
  `tf_processes=False` measures in one process on logical devices instead.

`measure_case` starts a fresh measuring process; `measure_cases` measures a
pass over many cases in one (PyTorch worker pools are reused between cases;
TensorFlow workers are new for each case) and starts another after a case
that fails or times out. `isolate=False` measures in the calling process with plain Keras `fit` (one
device only, pinned with `profiler.pinned_to`): cheaper, used by the tests.

Measurements are persisted as JSON (`save_measurements`,
`load_measurements`), with their provenance (date, machine, load average,
steps, backend and versions). Graphs and clusters are stored once per file
and shared by the records. Nothing is pickled.

Example:

```python
case = Case("mlp", "autodist_keras.graph.zoo:mlp", {"hidden": [256, 256]}, "proportional")
record = measure_case(case, "cpu_testbed", backend="torch", steps=20, warmup=5)
print(record.measured_s, record.predicted_analytic_s)
save_measurements([record], "measurements_torch.json")
```
"""

import contextlib
import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from autodist_keras.errors import EstimatorError
from autodist_keras.errors import received_repr

RECORD_SCHEMA = "autodist_keras.measurement/1"
FILE_SCHEMA = "autodist_keras.measurements/1"
CASE_ENV = "AUTODIST_KERAS_MEASURE_CASE"
BACKENDS = ("tensorflow", "torch")
DEFAULT_STEPS = 20
DEFAULT_WARMUP = 5
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_MISSING = object()


# -------------------------------------------------------------------- plans
def _single_device(graph, cluster, batch_size, **options):
    from autodist_keras.strategies import baselines

    return baselines.single_device(graph, cluster, batch_size, **options)


def _data_parallel(graph, cluster, batch_size, **options):
    from autodist_keras.strategies import baselines

    return baselines.data_parallel_even(graph, cluster, batch_size, **options)


def _proportional(graph, cluster, batch_size, **options):
    from autodist_keras.strategies import baselines

    return baselines.proportional(graph, cluster, batch_size, **options)


def _data_parallel_2(graph, cluster, batch_size, **options):
    """Even data parallelism on the two fastest devices (by peak FLOP/s)."""
    from autodist_keras.strategies import baselines

    speeds = baselines.device_speeds(cluster)
    fastest = sorted(cluster.names, key=lambda d: (-speeds[d], cluster.names.index(d)))[:2]
    fastest = [d for d in cluster.names if d in fastest]
    return baselines.data_parallel_even(graph, cluster, batch_size, devices=fastest, **options)


PLAN_KINDS = {
    "single_device": _single_device,
    "data_parallel": _data_parallel,
    "proportional": _proportional,
    "data_parallel_2": _data_parallel_2,
}


def make_plan(kind, graph, cluster, batch_size, options=None):
    """Builds the plan of a plan kind (see `PLAN_KINDS`).

    Args:
        kind: `"single_device"`, `"data_parallel"` (even shares over every
            device), `"proportional"` (shares by device speed) or
            `"data_parallel_2"` (even shares over the two fastest devices).
        graph: The `ModelGraph`.
        cluster: The `Cluster`.
        batch_size: Global batch size.
        options: Extra keyword arguments of the baseline builder (e.g.
            `{"sync": "ps"}`).

    Returns:
        A validated `Plan`.

    Raises:
        EstimatorError: For an unknown plan kind.
    """
    if kind not in PLAN_KINDS:
        raise EstimatorError(
            f"Unknown plan kind {kind!r}; measurable kinds are {sorted(PLAN_KINDS)}. "
            f"Received: {kind!r}"
        )
    return PLAN_KINDS[kind](graph, cluster, batch_size, **dict(options or {}))


# --------------------------------------------------------------------- cases
@dataclasses.dataclass(frozen=True)
class Case:
    """One measurable case: a model, a plan kind and a batch size.

    Args:
        model: Label of the model (held-out evaluation groups by it), e.g.
            `"mlp_wide"`.
        builder: `"module:function"` returning an uncompiled `keras.Model`
            (e.g. `"autodist_keras.graph.zoo:mlp"`); it must be importable
            by a fresh process.
        kwargs: Keyword arguments of the builder (JSON-ready).
        plan: Plan kind, a key of `PLAN_KINDS`.
        batch_size: Global batch size.
        plan_options: Extra keyword arguments of the plan builder.
    """

    model: str
    builder: str
    kwargs: dict = dataclasses.field(default_factory=dict)
    plan: str = "single_device"
    batch_size: int = 96
    plan_options: dict = dataclasses.field(default_factory=dict)

    @property
    def name(self):
        """`"<model>/<plan>/b<batch_size>"`, unique per case."""
        return f"{self.model}/{self.plan}/b{self.batch_size}"

    def to_dict(self):
        return {
            "model": self.model,
            "builder": self.builder,
            "kwargs": dict(self.kwargs),
            "plan": self.plan,
            "batch_size": int(self.batch_size),
            "plan_options": dict(self.plan_options),
        }

    @classmethod
    def from_dict(cls, data):
        try:
            return cls(
                model=str(data["model"]),
                builder=str(data["builder"]),
                kwargs=dict(data.get("kwargs") or {}),
                plan=str(data.get("plan", "single_device")),
                batch_size=int(data.get("batch_size", 96)),
                plan_options=dict(data.get("plan_options") or {}),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise EstimatorError(
                f"Malformed case ({type(e).__name__}: {e}); a case needs `model` and "
                f"`builder`. Received: {data!r}"
            ) from None

    def check(self):
        """Validates the fields a user writes; returns `self`.

        Raises:
            EstimatorError: On an unknown plan kind, a builder that is not
                `"module:function"`, or a batch size below 1.
        """
        if self.plan not in PLAN_KINDS:
            raise EstimatorError(
                f"Case {self.model!r}: unknown plan kind {self.plan!r}; use one of "
                f"{sorted(PLAN_KINDS)}. Received: plan={self.plan!r}"
            )
        if ":" not in self.builder:
            raise EstimatorError(
                f"Case {self.model!r}: builder must be 'module:function' (importable by a "
                f"fresh process). Received: builder={self.builder!r}"
            )
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise EstimatorError(
                f"Case {self.model!r}: batch_size must be a positive integer. "
                f"Received: batch_size={self.batch_size!r}"
            )
        return self


def build_model(case):
    """Builds (uncompiled) the Keras model of a case."""
    import importlib

    module_name, _, attr = case.builder.partition(":")
    try:
        obj = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise EstimatorError(
            f"Case {case.model!r}: cannot import builder {case.builder!r} "
            f"({type(e).__name__}: {e}). Received: builder={case.builder!r}"
        ) from None
    return obj(**case.kwargs)


def compile_model(model):
    """Compiles a case model the way every measurement does (Adam, logits loss)."""
    import keras

    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def case_model_from_env():
    """Builds and compiles the case in `$AUTODIST_KERAS_MEASURE_CASE`.

    The model function that TensorFlow worker processes import (they inherit
    the environment of the measuring process).
    """
    text = os.environ.get(CASE_ENV)
    if not text:
        raise EstimatorError(
            f"{CASE_ENV} is not set; this function builds the case of a running "
            f"measurement. Received: {CASE_ENV} unset"
        )
    import keras

    data = json.loads(text)
    case = Case.from_dict(data)
    keras.utils.set_random_seed(int(data.get("seed", 0)))
    return compile_model(build_model(case))


def synthetic_data(model, samples, seed=0):
    """Random inputs and class labels matching a model's inputs and output.

    Float inputs are standard normal; integer inputs (token ids) are uniform
    below the smallest `Embedding.input_dim` of the model (2 when it has
    none); labels are uniform below the output's last dimension.

    Args:
        model: A built Keras model with one output.
        samples: Number of samples.
        seed: NumPy seed.

    Returns:
        `(x, y)`: an array (or a list of arrays for several inputs) and an
        int32 label array.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    vocab = [
        int(layer.input_dim) for layer in model._flatten_layers()
        if type(layer).__name__ == "Embedding"
    ]
    high = min(vocab) if vocab else 2
    xs = []
    for tensor in model.inputs:
        shape = (samples,) + tuple(int(d) if d is not None else 1 for d in tensor.shape[1:])
        dtype = str(tensor.dtype)
        if "int" in dtype:
            xs.append(rng.integers(0, high, size=shape).astype(dtype))
        else:
            xs.append(rng.standard_normal(shape).astype(dtype))
    classes = int(model.outputs[0].shape[-1])
    y = rng.integers(0, classes, size=(samples,)).astype("int32")
    return (xs[0] if len(xs) == 1 else xs), y


# ------------------------------------------------------------------- records
@dataclasses.dataclass
class Record:
    """One measured case: what ran, what the simulator predicted, what it took.

    Args:
        case: The `Case`.
        backend: `"tensorflow"` or `"torch"`.
        graph: The model's `ModelGraph`.
        cluster: The `Cluster` the plan ran on.
        plan: The `Plan` that ran.
        predicted_analytic_s: The simulator's step time with the analytic
            cost model at measurement time (predicted).
        measured_s: Median measured step time in seconds (over every pass).
        passes: One dict per measurement pass: `step_times_s` (after
            warm-up), `median_s`, `load_average` (1-minute, before and
            after), `started` (ISO time), `wall_s`, `runtime` (how it ran),
            and `machine_probe_s` (`machine_speed.probe` on every core of
            the cluster right before the pass, for CPU devices of this
            machine).
        steps: Timed steps per pass.
        warmup: Untimed steps before them.
        mode: `"adapter"` (fresh process, runtime adapters) or
            `"inprocess"` (plain Keras fit in the calling process).
    """

    case: Case
    backend: str
    graph: object
    cluster: object
    plan: object
    predicted_analytic_s: float
    measured_s: float
    passes: list
    steps: int
    warmup: int
    mode: str = "adapter"

    @property
    def model(self):
        return self.case.model

    @property
    def name(self):
        return self.case.name

    @property
    def machine_probe_s(self):
        """Median machine-speed probe over the passes (`machine_speed.probe`), or
        None when a pass did not record one (measurements before 3 December 2026)."""
        probes = [p.get("machine_probe_s") for p in self.passes]
        if not probes or any(v is None for v in probes):
            return None
        return float(statistics.median(probes))

    @property
    def spread(self):
        """`(max - min) / median` of the per-pass medians (0 for one pass)."""
        medians = [p["median_s"] for p in self.passes]
        if len(medians) < 2:
            return 0.0
        return (max(medians) - min(medians)) / statistics.median(medians)

    def merged(self, other):
        """This record with `other`'s passes added (same case and backend)."""
        if other.case != self.case or other.backend != self.backend:
            raise EstimatorError(
                f"Only passes of the same case and backend merge. Received: {self.name} "
                f"({self.backend}) and {other.name} ({other.backend})"
            )
        passes = list(self.passes) + list(other.passes)
        return dataclasses.replace(
            self, passes=passes, measured_s=_median_of_passes(passes)
        )

    def to_dict(self, graph_key=None, cluster_key=None):
        """JSON-ready dict; `graph_key` / `cluster_key` reference shared tables."""
        return {
            "schema": RECORD_SCHEMA,
            "case": self.case.to_dict(),
            "backend": self.backend,
            "graph": graph_key if graph_key is not None else self.graph.to_dict(),
            "cluster": cluster_key if cluster_key is not None else self.cluster.to_dict(),
            "plan": self.plan.to_dict(),
            "predicted_analytic_s": float(self.predicted_analytic_s),
            "measured_s": float(self.measured_s),
            "passes": list(self.passes),
            "steps": int(self.steps),
            "warmup": int(self.warmup),
            "mode": self.mode,
        }

    @classmethod
    def from_dict(cls, data, graphs=None, clusters=None, source="<dict>"):
        """Rebuilds a record; string `graph` / `cluster` fields index `graphs` / `clusters`."""
        from autodist_keras.devices import Cluster
        from autodist_keras.graph import ModelGraph
        from autodist_keras.strategies.plan import Plan

        if not isinstance(data, dict) or data.get("schema") != RECORD_SCHEMA:
            raise EstimatorError(
                f"{source}: not a measurement record (expected schema {RECORD_SCHEMA!r}). "
                "Write records with save_measurements(). Received: "
                f"{data.get('schema') if isinstance(data, dict) else type(data).__name__!r}"
            )

        def field(name, convert, default=_MISSING):
            """`convert(data[name])` (or of `default`); a missing or bad value names the field."""
            value = data.get(name, default)
            if value is _MISSING:
                raise EstimatorError(
                    f"{source}: malformed measurement record: field `{name}` is missing. "
                    f"Write records with save_measurements(). Received: fields {sorted(data)}"
                )
            try:
                return convert(value)
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                raise EstimatorError(
                    f"{source}: malformed measurement record, field `{name}` "
                    f"({type(e).__name__}: {e}). Write records with save_measurements(). "
                    f"Received: {name}={received_repr(value)}"
                ) from None

        def shared(table, build):
            def convert(value):
                if isinstance(value, str):
                    value = (table or {})[value]
                return build(value, source=source) if isinstance(value, dict) else value
            return convert

        return cls(
            case=field("case", Case.from_dict),
            backend=field("backend", str),
            graph=field("graph", shared(graphs, ModelGraph.from_dict)),
            cluster=field("cluster", shared(clusters, Cluster.from_dict)),
            plan=field("plan", lambda v: Plan.from_dict(v, source=source)),
            predicted_analytic_s=field("predicted_analytic_s", float),
            measured_s=field("measured_s", float),
            passes=field("passes", lambda v: list(v or []), None),
            steps=field("steps", int, 0),
            warmup=field("warmup", int, 0),
            mode=field("mode", str, "adapter"),
        )


def _median_of_passes(passes):
    times = [t for p in passes for t in p["step_times_s"]]
    if not times:
        raise EstimatorError("A measurement pass recorded no step times. Received: []")
    return float(statistics.median(times))


# ----------------------------------------------------------------- machine
def load_average():
    """The 1-minute load average (None where the OS does not report it)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def machine_info():
    """Facts about this machine for a measurement file's provenance."""
    from autodist_keras.devices.detect import host_cpu_name

    cpu = host_cpu_name()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu,
        "cores": cores,
    }


def _framework_versions(backend):
    versions = {}
    try:
        import keras

        versions["keras"] = keras.__version__
    except ImportError:
        pass
    name = "tensorflow" if backend == "tensorflow" else "torch"
    try:
        module = __import__(name)
        versions[name] = module.__version__
    except ImportError:
        pass
    return versions


# ----------------------------------------------------------------- measuring
def _resolve_backend(backend):
    if backend is None:
        from autodist_keras.devices.detect import active_keras_backend

        backend = active_keras_backend()
    if backend not in BACKENDS:
        raise EstimatorError(
            f"backend must be one of {BACKENDS}. Received: backend={backend!r}"
        )
    return backend


def _check_counts(steps, warmup):
    for value, field, low in ((steps, "steps", 1), (warmup, "warmup", 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise EstimatorError(
                f"{field} must be an integer >= {low}. Received: {field}={value!r}"
            )


def measure_case(case, cluster="cpu_testbed", backend=None, steps=DEFAULT_STEPS,
                 warmup=DEFAULT_WARMUP, isolate=True, timeout_s=900, seed=0,
                 tf_processes=None):
    """Runs one case for real and returns its `Record` (measured step time).

    Args:
        case: A `Case` (or its dict).
        cluster: The `Cluster`, or anything `Cluster.resolve` takes
            (default: the CPU testbed). Its devices must be on this machine.
        backend: `"tensorflow"` or `"torch"` (default: the active Keras
            backend, or `$KERAS_BACKEND`).
        steps: Timed steps.
        warmup: Untimed steps first (tracing, worker start-up).
        isolate: Measure in a fresh process through the runtime adapters
            (default). False measures in this process with plain Keras
            `fit`, which only one-device plans allow, on the active backend.
        timeout_s: Give up (killing the measuring process and its workers)
            after this long.
        seed: Seed of the weights and the synthetic data.
        tf_processes: TensorFlow only. True runs the plan with one worker
            process per plan device, each pinned to its device's cores and
            thread count (`tensorflow_adapter.run_steps`; rank 0's steps are
            timed): how the TensorFlow runtime realises CPU testbed devices.
            False runs it in the measuring process on logical devices, which
            share one thread pool. None (default): True when the cluster's
            devices have CPU affinities.

    Returns:
        A `Record` with one pass.

    Raises:
        EstimatorError: For a malformed case, a bad `steps` / `warmup`, a
            several-device plan with `isolate=False`, or a measuring process
            that fails or times out (its output tail is in the message).
    """
    from autodist_keras.devices import Cluster

    if isinstance(case, dict):
        case = Case.from_dict(case)
    case.check()
    _check_counts(steps, warmup)
    backend = _resolve_backend(backend)
    cluster = Cluster.resolve(cluster)
    if not isolate:
        active = _resolve_backend(None)
        if active != backend:
            raise EstimatorError(
                f"isolate=False measures on the active Keras backend ({active!r}); ask for "
                f"that backend or use isolate=True. Received: backend={backend!r}"
            )
        job = _job(case, cluster, backend, steps, warmup, seed, timeout_s, tf_processes)
        return Record.from_dict(_run_job(job, in_process=True))
    [(_, result)] = _run_isolated([case], cluster, backend, steps, warmup, seed, timeout_s,
                                  tf_processes)
    if isinstance(result, str):
        raise EstimatorError(result)
    return result


def _job(case, cluster, backend, steps, warmup, seed, timeout_s, tf_processes):
    return {
        "case": case.to_dict(),
        "cluster": cluster.to_dict(),
        "backend": backend,
        "steps": steps,
        "warmup": warmup,
        "seed": seed,
        "timeout_s": timeout_s,
        "tf_processes": tf_processes,
    }


def _run_isolated(cases, cluster, backend, steps, warmup, seed, timeout_s, tf_processes,
                  on_result=None):
    """Measures `cases` in order in fresh processes (one for as many cases as it survives).

    The measuring process appends one JSON line per case to a results file;
    a case that takes longer than `timeout_s`, or a process that dies, ends
    that process (and its workers): the case is reported failed and a new
    process carries on with the next one.

    Returns:
        A list of `(case, Record or error message)` in case order; each is
        also passed to `on_result(case, result)` as soon as it is known.
    """
    def report(case, result):
        results.append((case, result))
        if on_result is not None:
            on_result(case, result)

    results = []
    remaining = list(cases)
    workdir = tempfile.mkdtemp(prefix="autodist_measure_")
    try:
        attempt = 0
        while remaining:
            attempt += 1
            job_path = os.path.join(workdir, f"job{attempt}.json")
            out_path = os.path.join(workdir, f"results{attempt}.jsonl")
            log_path = os.path.join(workdir, f"log{attempt}.txt")
            jobs = [_job(c, cluster, backend, steps, warmup, seed, timeout_s, tf_processes)
                    for c in remaining]
            with open(job_path, "w", encoding="utf-8") as f:
                json.dump({"jobs": jobs}, f)
            open(out_path, "w").close()
            env = dict(os.environ)
            env["KERAS_BACKEND"] = backend
            env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
            env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
            done = []
            with open(log_path, "w", encoding="utf-8") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "autodist_keras.estimator.measurements", job_path,
                     out_path],
                    env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                )
                try:
                    deadline = time.monotonic() + timeout_s
                    while True:
                        lines = _read_lines(out_path)
                        if len(lines) > len(done):
                            for case, line in zip(remaining[len(done):], lines[len(done):]):
                                report(case, _result(case, line, backend, out_path))
                            done = lines
                            deadline = time.monotonic() + timeout_s
                        code = proc.poll()
                        if code is not None or len(done) == len(remaining):
                            break
                        if time.monotonic() > deadline:
                            code = "timeout"
                            break
                        time.sleep(0.2)
                finally:
                    if proc.poll() is None and len(done) < len(remaining):
                        _kill_group(proc)
                    elif proc.poll() is None:
                        try:
                            proc.wait(timeout=60)
                        except subprocess.TimeoutExpired:
                            _kill_group(proc)
            lines = _read_lines(out_path)
            for case, line in zip(remaining[len(done):], lines[len(done):]):
                report(case, _result(case, line, backend, out_path))
            done = lines
            if len(done) < len(remaining):
                case = remaining[len(done)]
                if code == "timeout":
                    why = (f"did not finish in {timeout_s} s; raise timeout_s or use fewer steps. "
                           f"Received: timeout_s={timeout_s}")
                else:
                    why = f"ended the measuring process (exit code {code})"
                report(case, f"Measuring {case.name} on {backend} {why}. Log tail:\n"
                             f"{_tail(log_path)}")
                remaining = remaining[len(done) + 1:]
            else:
                remaining = []
    finally:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    return results


def _result(case, line, backend, source):
    if line.get("ok"):
        return Record.from_dict(line["record"], source=source)
    return f"Measuring {case.name} on {backend} failed: {line.get('error')}"


def _read_lines(path):
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.endswith("\n"):
                    rows.append(json.loads(line))
    except (OSError, ValueError):
        pass
    return rows


def _kill_group(proc):
    """Ends the measuring process and every worker it started (its session)."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _tail(path, chars=3000):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return "(no log)"


def _run_job(job, in_process):
    """Builds, plans, simulates and measures one case; returns the record dict."""
    import keras

    from autodist_keras.devices import Cluster
    from autodist_keras.estimator.simulator import simulate
    from autodist_keras.graph import ModelGraph

    backend = keras.backend.backend()
    case = Case.from_dict(job["case"])
    cluster = Cluster.from_dict(job["cluster"])
    steps, warmup, seed = int(job["steps"]), int(job["warmup"]), int(job.get("seed", 0))
    if backend == "tensorflow" and not in_process and not _tf_processes(
            cluster, job.get("tf_processes")):
        _configure_tensorflow_devices(cluster)

    # Keras numbers unnamed layers per session (`input_layer`, `input_layer_1`,
    # ...): the model measured below must get the names the plan was made for,
    # so each build starts from a fresh session.
    keras.backend.clear_session()
    keras.utils.set_random_seed(seed)
    probe = build_model(case)
    graph = ModelGraph.from_keras(probe)
    plan = make_plan(case.plan, graph, cluster, case.batch_size, case.plan_options)
    predicted = simulate(graph, cluster, plan).step_time_s
    samples = case.batch_size * (steps + warmup)
    x, y = synthetic_data(probe, samples, seed=seed)
    del probe
    keras.backend.clear_session()

    load_before = load_average()
    speed = _probe_for(cluster)
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    if in_process:
        times, runtime = _measure_in_process(case, cluster, plan, x, y, steps, warmup, seed)
    else:
        times, runtime = _measure_with_adapter(case, cluster, plan, x, y, steps, warmup,
                                               seed, backend, job.get("timeout_s", 900),
                                               job.get("tf_processes"))
    wall = time.perf_counter() - t0
    if len(times) < steps:
        raise EstimatorError(
            f"Measuring {case.name}: expected {steps} timed steps, got {len(times)}. "
            f"Received: {len(times)} step times"
        )
    times = [float(t) for t in times[:steps]]
    passes = [{
        "step_times_s": times,
        "median_s": float(statistics.median(times)),
        "load_average": [load_before, load_average()],
        "started": started,
        "wall_s": round(wall, 3),
        "runtime": runtime,
    }]
    if speed is not None:
        # How fast this machine was right before the pass (machine_speed.probe).
        passes[0]["machine_probe_s"] = speed.seconds
    record = Record(
        case=case, backend=backend, graph=graph, cluster=cluster, plan=plan,
        predicted_analytic_s=float(predicted), measured_s=_median_of_passes(passes),
        passes=passes, steps=steps, warmup=warmup,
        mode="inprocess" if in_process else "adapter",
    )
    return record.to_dict()


def _probe_for(cluster):
    """The machine-speed probe on every core of the cluster (the same cores for
    every plan, so records compare), or None off this machine's CPUs."""
    from autodist_keras.estimator import machine_speed

    cores = machine_speed.cluster_cores(cluster)
    return machine_speed.probe(cores) if cores else None


def _configure_tensorflow_devices(cluster):
    """One logical CPU device per CPU device of the cluster, before TensorFlow starts."""
    import tensorflow as tf

    needed = len([d for d in cluster.devices if d.kind != "gpu"])
    if needed > 1:
        physical = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            physical, [tf.config.LogicalDeviceConfiguration() for _ in range(needed)]
        )


def _measure_in_process(case, cluster, plan, x, y, steps, warmup, seed):
    """Plain Keras fit in this process, pinned to the plan's one device."""
    import keras

    from autodist_keras.estimator.profiler import pinned_to
    from autodist_keras.timing import StepTimer

    if len(plan.devices) != 1:
        raise EstimatorError(
            f"Measuring {case.name} in this process runs plain Keras on one device; this "
            f"plan uses {len(plan.devices)} devices. Use isolate=True to run it through the "
            f"runtime adapters. Received: devices={plan.devices}"
        )
    device = cluster.device(plan.devices[0])
    keras.utils.set_random_seed(seed)
    model = compile_model(build_model(case))
    timer = StepTimer(warmup=warmup)
    with pinned_to(device) as info:
        model.fit(x, y, batch_size=case.batch_size, epochs=1, shuffle=False, verbose=0,
                  callbacks=[timer])
    runtime = {"runner": "keras fit in the calling process", "device": device.name,
               "affinity": info.get("affinity_used"), "threads": info.get("threads_used")}
    return timer.times_s, runtime


def _tf_processes(cluster, tf_processes):
    """Whether a TensorFlow case runs as one pinned worker process per plan device."""
    if tf_processes is None:
        return any(d.cpu_affinity is not None for d in cluster.devices)
    return bool(tf_processes)


def _measure_with_adapter(case, cluster, plan, x, y, steps, warmup, seed, backend, timeout_s,
                          tf_processes=None):
    """The runtime adapters, as `model.fit` under `AutoStrategy` runs the plan."""
    import keras

    from autodist_keras.strategies.auto import AutoStrategy
    from autodist_keras.timing import StepTimer

    if backend == "tensorflow" and _tf_processes(cluster, tf_processes):
        from autodist_keras.backends import tensorflow_adapter

        os.environ[CASE_ENV] = json.dumps(dict(case.to_dict(), seed=int(seed)))
        times = tensorflow_adapter.run_steps(
            "autodist_keras.estimator.measurements:case_model_from_env", plan, cluster,
            x, y, batch_size=case.batch_size, steps=steps, warmup=warmup, processes=True,
            timeout_s=timeout_s,
        )
        return list(times), {
            "runner": "tensorflow_adapter.run_steps: one pinned worker process per plan "
                      "device (rank 0 timed)",
            "devices": plan.devices,
        }
    strategy = AutoStrategy(cluster=cluster, plan=plan, timeout_s=float(timeout_s))
    keras.utils.set_random_seed(seed)
    with strategy.scope():
        model = compile_model(build_model(case))
    timer = StepTimer(warmup=warmup)
    pin = contextlib.nullcontext()
    if backend == "tensorflow" and len(plan.devices) == 1:
        # One device: pin every thread of this process to the device's cores (the
        # PyTorch adapter pins its processes itself; several TensorFlow logical
        # devices share this process's thread pool, as in a user's fit).
        from autodist_keras.estimator.profiler import pinned_to

        pin = pinned_to(cluster.device(plan.devices[0]), backend)
    # PyTorch worker pools stay up for the next case of this process (main() ends them).
    with pin:
        model.fit(x, y, batch_size=case.batch_size, epochs=1, shuffle=False, verbose=0,
                  callbacks=[timer])
    runtime = {"runner": f"AutoStrategy(plan=...) model.fit on {backend}",
               "devices": plan.devices}
    last = getattr(strategy.adapter, "last_run", None)
    if isinstance(last, dict) and last.get("mode"):
        runtime["mode"] = last["mode"]
    if isinstance(last, dict) and last.get("gradient_transport"):
        # How the ranks summed gradients (shared memory or gloo): the step
        # times depend on it, so the data says which one they measured.
        runtime["gradient_transport"] = last["gradient_transport"]
    return timer.times_s, runtime


def measure_cases(cases, cluster="cpu_testbed", backend=None, steps=DEFAULT_STEPS,
                  warmup=DEFAULT_WARMUP, passes=1, timeout_s=900, progress=True,
                  tf_processes=None):
    """Measures many cases, `passes` times each (pass 1 of every case first).

    Each pass measures the cases in order in one fresh process (a new one
    after a case that fails or times out), which saves start-up costs and
    keeps the PyTorch worker pools between cases. Interleaving the passes
    spreads slow phases of a shared machine over all cases; a record's
    `measured_s` is the median over every pass's steps and its `spread`
    says how far the passes differ.

    Args:
        cases: `Case` objects (or dicts).
        cluster, backend, steps, warmup, timeout_s, tf_processes: As in
            `measure_case` (`timeout_s` bounds each case).
        passes: Measurements of each case.
        progress: Print one line per measured case.

    Returns:
        `(records, failures)`: one `Record` per case that succeeded, and a
        list of `(case name, error message)` for those that did not (a case
        that fails once is not measured again).
    """
    from autodist_keras.devices import Cluster

    cases = [Case.from_dict(c).check() if isinstance(c, dict) else c.check() for c in cases]
    names = [c.name for c in cases]
    if len(set(names)) != len(names):
        raise EstimatorError(
            f"Cases must differ in model, plan or batch size. Received: {sorted(names)}"
        )
    _check_counts(steps, warmup)
    backend = _resolve_backend(backend)
    cluster = Cluster.resolve(cluster)
    merged, failures = {}, []
    for number in range(passes):

        def collect(case, result, number=number):
            if isinstance(result, str):
                failures.append((case.name, result))
                merged.pop(case.name, None)
                if progress:
                    print(f"[pass {number + 1}/{passes}] {case.name}: FAILED", flush=True)
                return
            previous = merged.get(case.name)
            merged[case.name] = previous.merged(result) if previous else result
            if progress:
                print(f"[pass {number + 1}/{passes}] {case.name}: measured "
                      f"{result.measured_s * 1e3:.2f} ms (simulated "
                      f"{result.predicted_analytic_s * 1e3:.2f} ms), load "
                      f"{result.passes[0]['load_average']}", flush=True)

        failed = {name for name, _ in failures}
        todo = [c for c in cases if c.name not in failed]
        _run_isolated(todo, cluster, backend, steps, warmup, 0, timeout_s, tf_processes,
                      on_result=collect)
    return [merged[c.name] for c in cases if c.name in merged], failures


# --------------------------------------------------------------- persistence
def save_measurements(records, path, provenance=None):
    """Writes records to a JSON file (atomically), graphs and clusters stored once.

    Args:
        records: `Record` objects.
        path: The `.json` file to write.
        provenance: Extra facts to store (command line, notes); the date,
            machine, backends and versions are added.

    Returns:
        The path.
    """
    from autodist_keras.estimator.profiler import write_json_atomic

    graphs, clusters, rows = {}, {}, []
    for record in records:
        gkey = f"{record.model}@{record.graph.fingerprint()[:12]}"
        ckey = record.cluster.fingerprint()[:16]
        graphs.setdefault(gkey, record.graph.to_dict())
        clusters.setdefault(ckey, record.cluster.to_dict())
        rows.append(record.to_dict(graph_key=gkey, cluster_key=ckey))
    backends = sorted({r.backend for r in records})
    info = {
        "written": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "backends": backends,
        "versions": {b: _framework_versions(b) for b in backends},
        "records": len(rows),
        "note": "measured_s are measured wall times (median over every pass's steps after "
                "warm-up); predicted_analytic_s are simulator predictions.",
    }
    info.update(provenance or {})
    data = {"schema": FILE_SCHEMA, "provenance": info, "graphs": graphs,
            "clusters": clusters, "records": rows}
    write_json_atomic(path, data)
    return path


def add_measurements(records, path, provenance=None):
    """Adds records to a measurements file (same case name: replaced), or writes it.

    The stored file's provenance is kept under `"earlier"` and `"added"`
    lists the added cases' names, so records of different sittings stay
    distinguishable (their machine-speed probes compare the machine's speed
    between them).

    Args:
        records: `Record` objects.
        path: The `.json` file (written atomically).
        provenance: Facts about this sitting (as for `save_measurements`).

    Returns:
        The list of records now in the file.

    Raises:
        EstimatorError: If `path` exists but is not a measurements file.

    Example:

    ```python
    add_measurements(measure_cases(new_cases, "cpu_testbed")[0], "measurements.json")
    ```
    """
    if not os.path.exists(os.fspath(path)):
        save_measurements(records, path, provenance=provenance)
        return list(records)
    stored, earlier = load_measurements(path)
    new = {r.name: r for r in records}
    merged = [new.pop(r.name, r) for r in stored] + list(new.values())
    save_measurements(merged, path, provenance=dict(
        provenance or {}, added=sorted(r.name for r in records), earlier=earlier))
    return merged


def load_measurements(path):
    """Reads a file written by `save_measurements`.

    Args:
        path: The JSON file.

    Returns:
        `(records, provenance)`.

    Raises:
        EstimatorError: If the file is missing, not JSON, or not a
            measurements file.
    """
    from autodist_keras.estimator.profiler import read_json

    path = os.fspath(path)
    data = read_json(path, "measurements file",
                     "Measure first (e.g. benchmarks/estimator_accuracy.py --measure).")
    if not isinstance(data, dict) or data.get("schema") != FILE_SCHEMA:
        raise EstimatorError(
            f"{path}: not a measurements file (expected schema {FILE_SCHEMA!r}). Write it "
            "with save_measurements(). Received: "
            f"{data.get('schema') if isinstance(data, dict) else type(data).__name__!r}"
        )
    graphs = dict(data.get("graphs") or {})
    clusters = dict(data.get("clusters") or {})
    from autodist_keras.devices import Cluster
    from autodist_keras.graph import ModelGraph

    graphs = {k: ModelGraph.from_dict(v, source=path) for k, v in graphs.items()}
    clusters = {k: Cluster.from_dict(v, source=path) for k, v in clusters.items()}
    records = [
        Record.from_dict(row, graphs, clusters, source=f"{path} record {i}")
        for i, row in enumerate(data.get("records") or [])
    ]
    return records, dict(data.get("provenance") or {})


def main(argv=None):
    """Entry point of the measuring process: `python -m ... jobs.json results.jsonl`.

    Measures each job in order and appends one JSON line per job to the
    results file: `{"ok": true, "record": ...}` or `{"ok": false, "error": ...}`.
    """
    import traceback

    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0], encoding="utf-8") as f:
        jobs = json.load(f)["jobs"]
    try:
        for job in jobs:
            try:
                line = {"ok": True, "record": _run_job(job, in_process=False)}
            except Exception as e:  # reported to the parent, which carries on
                line = {"ok": False, "error": f"{type(e).__name__}: {e}\n"
                                              f"{traceback.format_exc()[-2000:]}"}
            with open(argv[1], "a", encoding="utf-8") as f:
                f.write(json.dumps(line) + "\n")
                f.flush()
                os.fsync(f.fileno())
    finally:
        if "autodist_keras.backends.torch_pool" in sys.modules:
            sys.modules["autodist_keras.backends.torch_pool"].shutdown_pools()


if __name__ == "__main__":
    main()
