"""Choosing a plan: candidates from every family and the baselines, scored by the estimator.

`choose_plan` builds the baselines (single device, even and proportional
data parallelism, each with all-reduce and PS where it differs, and, where
some devices share CPU cores, even data parallelism over the devices that do
not: `data_parallel_unshared`) and asks each
planner family (FastT, HeteroG, Disco) for its best plan. Every candidate is
scored by the simulator, the one source of predicted times. The fastest
feasible candidate wins; the others are recorded on the winner's
`prediction.baselines` so `explain()` can show what they would cost.

Scoring (`estimator=`): every candidate is simulated (memory feasibility and
the step breakdown always come from the simulator). Its predicted step time
comes from the scorer:

- `"learned"` (default): the packaged learned estimator of the backend
  (`estimator/learned.py`, trained on measured CPU-testbed steps). When the
  search's devices and backend lie in its domain
  (`LearnedEstimator.cluster_in_domain`), each candidate whose plan lies in
  it (`LearnedEstimator.in_domain`) gets the learned prediction; each other
  one gets the simulator's time times `learned / simulated` of the in-domain
  candidate of the same search closest to it (same devices, nearest
  simulated time), so every number of one search is on the learned scale
  and an out-of-domain plan keeps only the simulator's *relative* gain. Outside the domain (e.g. GPU
  clusters) every candidate gets the plain simulator's time.
- `"simulator"`: the plain simulator for every candidate.
- a path to a JSON file written by `LearnedEstimator.save()`: that
  estimator, with the same domain rule.

Each candidate's `scorer` and its plan's `prediction.source` say which
produced its number.

Chosen plans are cached on disk as JSON, keyed by the model's and the
cluster's fingerprints, the batch size and the options, so a repeat run
reuses the plan without planning again.

Example:

```python
plan, candidates = choose_plan(graph, cluster, batch_size=256)
for c in candidates:
    print(c.name, c.step_time_s, c.feasible)
```
"""

import dataclasses
import hashlib
import importlib
import json
import math
import os
import time
import warnings

from autodist_keras.devices.detect import active_keras_backend
from autodist_keras.errors import AutodistError
from autodist_keras.estimator.simulator import optimizer_slots_of
from autodist_keras.errors import OutputError
from autodist_keras.errors import StrategyError
from autodist_keras.strategies import _common
from autodist_keras.strategies import baselines
from autodist_keras.strategies.plan import CACHE_NOTE_PREFIX
from autodist_keras.strategies.plan import Plan
from autodist_keras.strategies.plan import write_text_atomic

FAMILIES = ("fastt", "heterog", "disco")
FAMILY_BUDGET_S = {"fastt": 3.0, "heterog": 4.0, "disco": 2.0}
# Bumped when planners or the simulator change what they would plan (3: session 14's
# parameter-server host time and HeteroG share balancing; 4: session 15's attention
# memory, FastT's data-parallel seed and the planners' step host time; 5: session 20's
# fan-out transfers, HeteroG's sets, starts and LP memory, Disco's straggler types, the
# backend in the key and in plans; 6: session 21's Disco device subsets, FastT's ties
# and op-fusion regions without random layers; 7: regions without keras.ops nodes;
# 8: under PyTorch, only regions its runtime compiles as chains; 9: half-precision
# matmuls priced at the FP16 peak; 10: recurrent layers' saved activations; 11: the
# search's notes without the speedup over even data parallelism, which explain() gives);
# the package version is in the key too, so an upgrade never reuses an older
# release's plans.
CACHE_VERSION = 11
ESTIMATOR_CHOICES = ("learned", "simulator")
TIE_RTOL = 1e-6
SCORER_SIMULATOR = "simulator (predicted)"


@dataclasses.dataclass
class Candidate:
    """One plan considered by the search.

    Args:
        name: Candidate name, e.g. `"heterog"` or `"data_parallel_even"`.
        family: `"baseline"` or the planner family.
        plan: The `Plan` (None if the planner failed).
        step_time_s: Predicted step time (None if not available).
        feasible: Whether the plan fits in every device's memory (predicted).
        planning_time_s: Measured time spent making this candidate.
        executable: Whether the active backend adapter can run it (None when
            planning without a backend, e.g. from the CLI).
        reason: Why it was not usable, if so.
        scorer: Which predictor produced `step_time_s`, e.g.
            `"learned estimator (gnn, torch; predicted)"`.
        simulated_step_time_s: The plain simulator's step time (predicted).
    """

    name: str
    family: str
    plan: object = None
    step_time_s: float = None
    feasible: bool = False
    planning_time_s: float = 0.0
    executable: bool = None
    reason: str = None
    scorer: str = None
    simulated_step_time_s: float = None
    scorer_why: str = None  # why the learned estimator did not score it (outside its domain)

    def to_dict(self):
        return {
            "name": self.name,
            "family": self.family,
            "predicted_step_time_s": self.step_time_s,
            "scorer": self.scorer,
            "simulated_step_time_s": self.simulated_step_time_s,
            "feasible": self.feasible,
            "planning_time_s": self.planning_time_s,
            "executable": self.executable,
            "reason": self.reason,
            "scorer_why": self.scorer_why,
        }


def default_cache_dir():
    """Where plans are cached: `$AUTODIST_KERAS_CACHE/plans` or `~/.cache/autodist_keras/plans`.

    The root is the profile cache's (`estimator.profiler.default_cache_dir`):
    a `~` in the variable is expanded and a relative value made absolute, so
    plans and profiles land in the same place.

    Returns:
        An absolute path.
    """
    from autodist_keras.estimator.profiler import default_cache_dir as cache_root

    return os.path.join(cache_root(), "plans")


def _package_version():
    from autodist_keras import __version__

    return __version__


def cache_key(graph, cluster, batch_size, devices, families, options, scorer="simulator"):
    """A stable key of everything a plan search depends on (the scorer's identity included)."""
    payload = json.dumps(
        {
            "version": CACHE_VERSION,
            "package": _package_version(),
            "scorer": scorer,
            "graph": graph.fingerprint(),
            # Not in the fingerprint (the same model), but it changes the memory model.
            "optimizer_slots": optimizer_slots_of(graph),
            "cluster": cluster.fingerprint(),
            "batch_size": batch_size,
            "devices": list(devices),
            "families": list(families),
            "options": {k: repr(v) for k, v in sorted(options.items())},
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()


class Scorer:
    """Gives each candidate its predicted step time (see the module docstring).

    Use `resolve_scorer` to make one.

    Args:
        estimator: A trained `LearnedEstimator`, or None for the plain simulator.
        backend: The Keras backend the plan is for.
        identity: A stable string for the plan cache key.
        label: What the user asked for (`"learned"`, `"simulator"` or a path).
        why: Why the learned estimator is not used at all, if so.
    """

    def __init__(self, estimator=None, backend=None, identity="simulator", label="simulator",
                 why=""):
        self.estimator = estimator
        self.backend = backend
        self.identity = identity
        self.label = label
        self.why = why
        self.active = False
        self.active_why = why
        self.machine_probe_s = None
        self.speed_factor = 1.0

    def prepare(self, cluster, devices):
        """Decides, for one search, whether the learned estimator can score it.

        When it can and the cluster's devices are CPU cores of this machine,
        the machine-speed probe runs once on those cores (all of them, as
        when the training measurements were made), and every learned
        prediction of the search is scaled by how much slower (or faster)
        the machine runs now than during the estimator's training
        measurements (`LearnedEstimator.speed_factor`).
        """
        self.active, self.active_why = False, self.why
        self.machine_probe_s, self.speed_factor = None, 1.0
        if self.estimator is not None:
            self.active, why = self.estimator.cluster_in_domain(cluster, devices, self.backend)
            if not self.active:
                self.active_why = why
            elif self.estimator.machine_probe_s.get(self.backend):
                from autodist_keras.estimator import machine_speed

                cores = machine_speed.cluster_cores(cluster)
                if cores:
                    self.machine_probe_s = machine_speed.probe(cores).seconds
                    self.speed_factor = self.estimator.speed_factor(self.backend,
                                                                    self.machine_probe_s)
        return self

    def score(self, graph, cluster, plan, sim):
        """Returns `(seconds, source, reason)` for a simulated plan (all predicted)."""
        if not self.active:
            return sim.step_time_s, SCORER_SIMULATOR, self.active_why
        from autodist_keras.errors import EstimatorError

        inside, why = self.estimator.in_domain(graph, cluster, plan, self.backend)
        if inside:
            try:
                seconds = self.estimator.predict(graph, cluster, plan, backend=self.backend,
                                                 sim=sim, machine_probe_s=self.machine_probe_s)
                return seconds, f"{self.estimator.describe(self.backend)}; predicted", ""
            except EstimatorError as e:
                why = f"the learned estimator failed: {e}"
        # Provisional: `finish` rescales it by an in-domain candidate of the same search.
        factor = self.estimator.calibration(self.backend) * self.speed_factor
        return (sim.step_time_s * factor,
                f"simulator x {factor:.2f} calibration of the learned estimator; predicted", why)

    def finish(self, candidates, targets=None):
        """Puts out-of-domain candidates on the learned scale of this search.

        Each candidate scored outside the estimator's domain gets its
        simulated time times `learned / simulated` of a reference: the
        in-domain candidate on the same devices (else any in-domain one)
        whose simulated time is closest to its own. Where no candidate is in
        the domain, the estimator's overall calibration (already applied)
        stays.

        Args:
            candidates: The scored `Candidate`s of the search (the references
                are taken among them).
            targets: The candidates to rescale (default: every one of
                `candidates`); `score_plan` rescales only the plan it adds.

        Returns:
            `candidates`.
        """
        if not self.active:
            return candidates
        inside = [c for c in candidates if c.plan is not None and c.scorer
                  and c.scorer.startswith("learned") and c.simulated_step_time_s]
        if not inside:
            return candidates
        for c in (candidates if targets is None else targets):
            if c.plan is None or not c.scorer or not c.scorer.startswith("simulator x"):
                continue
            same = [r for r in inside if set(r.plan.devices) == set(c.plan.devices)] or inside
            ref = min(same, key=lambda r: abs(math.log(r.simulated_step_time_s
                                                       / c.simulated_step_time_s)))
            factor = ref.step_time_s / ref.simulated_step_time_s
            source = (f"simulator x {factor:.2f} (learned / simulated of {ref.name} in this "
                      "search); predicted")
            c.step_time_s = c.simulated_step_time_s * factor
            c.scorer = source
            c.plan.prediction.step_time_s = c.step_time_s
            c.plan.prediction.source = source
        return candidates

    @property
    def held_out_mape(self):
        """The learned estimator's held-out MAPE in percent (its training
        report), when it scores this search; else None."""
        if not self.active or self.estimator is None:
            return None
        mape = (self.estimator.report or {}).get("held_out", {}).get("mape")
        return float(mape) if mape is not None else None

    def summary(self, candidates):
        """One line saying which scorer produced the candidates' numbers."""
        if not self.active:
            reason = f" ({self.active_why})" if self.active_why else ""
            return f"scored by the simulator{reason}"
        learned = [c.name for c in candidates if c.scorer and c.scorer.startswith("learned")]
        other = [c.name for c in candidates
                 if c.scorer and not c.scorer.startswith("learned")]
        line = (f"scored by the {self.estimator.describe(self.backend)} for "
                f"{len(learned)} candidate(s) in its training domain")
        if self.machine_probe_s is not None:
            ratio = self.machine_probe_s / self.estimator.machine_probe_s[self.backend]
            if self.speed_factor != 1.0:
                line += (f", scaled x{self.speed_factor:.2f} because this machine runs "
                         f"{ratio:.2f}x as slow now as during its training measurements "
                         "(machine-speed probe)")
            else:
                line += (f", not rescaled: the machine-speed probe reads {ratio:.2f}x its "
                         "training measurements' time, within the probe's noise")
        if other and learned:
            line += (f"; by the simulator, rescaled by the learned / simulated ratio of an "
                     f"in-domain candidate, for {', '.join(other)} (outside its domain)")
        elif other:
            line += ("; so every candidate got the simulator's time scaled by the estimator's "
                     "overall calibration (none lies in its training domain)")
        return line


def resolve_scorer(estimator="learned", backend=None):
    """Makes the `Scorer` for an `estimator=` option.

    Args:
        estimator: `"learned"` (the packaged estimator of the backend, the
            simulator where there is none), `"simulator"`, a path to a JSON
            file written by `LearnedEstimator.save()`, or a
            `LearnedEstimator`.
        backend: `"tensorflow"` or `"torch"` (default: the active Keras
            backend, or `$KERAS_BACKEND`).

    Returns:
        A `Scorer`.

    Raises:
        StrategyError: For any other value, or a file that is not a learned
            estimator.
    """
    from autodist_keras.errors import EstimatorError
    from autodist_keras.estimator import learned
    from autodist_keras.estimator.measurements import _resolve_backend

    check_estimator(estimator)
    try:
        backend = _resolve_backend(backend)
    except EstimatorError as e:
        raise StrategyError(str(e)) from None
    if estimator == "simulator":
        return Scorer(backend=backend, why="estimator='simulator' was requested")
    if estimator == "learned":
        path = learned.default_path(backend)
        found = learned.load_default(backend)
        if found is None:
            return Scorer(backend=backend, label="learned",
                          why=f"no packaged learned estimator for {backend!r}")
        return Scorer(found, backend, identity=f"learned:{_file_digest(path)}", label="learned")
    if isinstance(estimator, learned.LearnedEstimator):
        digest = hashlib.sha256(json.dumps(estimator.to_dict(), sort_keys=True).encode())
        return Scorer(estimator, backend, identity=f"learned:{digest.hexdigest()[:16]}",
                      label="LearnedEstimator")
    try:
        found = learned.LearnedEstimator.load(estimator)
    except EstimatorError as e:
        raise StrategyError(
            f"estimator={estimator!r} could not be used: {e} Pass 'learned', 'simulator' or "
            f"the path of a JSON file written by LearnedEstimator.save(). "
            f"Received: estimator={estimator!r}"
        ) from None
    return Scorer(found, backend, identity=f"learned:{_file_digest(estimator)}",
                  label=os.fspath(estimator))


def check_estimator(estimator):
    """Raises `StrategyError` unless `estimator` is a valid `estimator=` option.

    Valid: `"learned"`, `"simulator"`, a `LearnedEstimator`, or the path of an
    existing `.json` file.
    """
    from autodist_keras.estimator.learned import LearnedEstimator

    if isinstance(estimator, LearnedEstimator):
        if not estimator.trained:
            raise StrategyError(
                "estimator= was given an untrained LearnedEstimator; fit or load it first. "
                "Received: an untrained LearnedEstimator"
            )
        return
    valid = (isinstance(estimator, (str, os.PathLike))
             and (estimator in ESTIMATOR_CHOICES
                  or (os.fspath(estimator).endswith(".json") and os.path.isfile(estimator))))
    if not valid:
        raise StrategyError(
            f"estimator must be one of {', '.join(repr(c) for c in ESTIMATOR_CHOICES)}, or the "
            "path of an existing JSON file written by LearnedEstimator.save(). "
            f"Received: estimator={estimator!r}"
        )


def _file_digest(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def baseline_candidates(graph, cluster, batch_size, devices, options):
    """Returns the baseline plans as `(name, builder)` pairs (not yet built).

    With a `step_costs` option (measured per-replica step costs), the
    proportional candidates balance those costs (`share_balance`).
    """
    opts = {k: v for k, v in options.items() if k in ("algorithm", "bucket_bytes")}
    costs = {"step_costs": options["step_costs"]} if options.get("step_costs") else {}
    pairs = [
        ("single_device", lambda: baselines.single_device(
            graph, cluster, batch_size, devices=devices,
            bucket_bytes=opts.get("bucket_bytes", baselines.DDP_BUCKET_BYTES))),
    ]
    if len(devices) > 1:
        pairs += [
            ("data_parallel_even", lambda: baselines.data_parallel_even(
                graph, cluster, batch_size, devices=devices, **opts)),
            ("proportional", lambda: baselines.proportional(
                graph, cluster, batch_size, devices=devices, **opts, **costs)),
            ("data_parallel_even_ps", lambda: baselines.data_parallel_even(
                graph, cluster, batch_size, devices=devices, sync="ps", **opts)),
            ("proportional_ps", lambda: baselines.proportional(
                graph, cluster, batch_size, devices=devices, sync="ps", **opts, **costs)),
        ]
        unshared = unshared_devices(cluster, devices)
        if 2 <= len(unshared) < len(devices):
            pairs.append(("data_parallel_unshared", lambda: baselines.data_parallel_even(
                graph, cluster, batch_size, devices=unshared, **opts)))
    return pairs


def unshared_devices(cluster, devices):
    """The devices that share no CPU core with a faster one, fastest first taken.

    On the CPU testbed (node0/cpu1 and node0/cpu2 share core 1) this is
    `["node0/cpu0", "node0/cpu1"]`; devices without a CPU affinity (GPUs)
    share nothing, so there it is every device.

    Args:
        cluster: The `Cluster`.
        devices: Device names.

    Returns:
        A list of device names, in `devices` order.
    """
    speeds = baselines.device_speeds(cluster)
    taken, keep = set(), set()
    for name in sorted(devices, key=lambda d: (-speeds[d], devices.index(d))):
        cores = set(cluster.device(name).cpu_affinity or ())
        if cores & taken:
            continue
        taken |= cores
        keep.add(name)
    return [d for d in devices if d in keep]


def available_families():
    """The planner families whose modules are present, in search order."""
    found = []
    for family in FAMILIES:
        try:
            module = importlib.import_module(f"autodist_keras.strategies.{family}")
        except ImportError:
            continue
        if hasattr(module, "plan"):
            found.append(family)
    return found


def _backend_cost_model(cluster, backend):
    """The analytic cost model for plans that `backend` will run, or None (the
    simulator's default) when that is the active Keras backend.

    The cost model's host times depend on the backend (PyTorch pays eager
    dispatch per layer on GPUs): a search for another backend than this
    process's must price its plans for that one. Until session 31
    `choose_plan(..., backend="torch")` in a TensorFlow process labelled (and
    cached) plans for PyTorch but priced them for TensorFlow: the zoo MLP on
    2xV100 at batch 64, 0.080 ms against 4.752 ms (predicted).

    Args:
        cluster: The `Cluster`.
        backend: `"tensorflow"`, `"torch"` or None.

    Returns:
        An `AnalyticCostModel`, or None.
    """
    if not backend or backend == active_keras_backend():
        return None
    from autodist_keras.estimator.cost_model import AnalyticCostModel

    return AnalyticCostModel(cluster, framework=backend)


def _score(graph, cluster, candidate, cost_model, scorer=None):
    from autodist_keras.estimator import simulate

    # Baseline builders validate their plans already; planner plans are checked here.
    # The simulator always runs: memory feasibility and the breakdown come from it.
    result = simulate(graph, cluster, candidate.plan, cost_model=cost_model,
                      validate=candidate.family != "baseline")
    prediction = result.to_prediction()
    if candidate.plan.prediction is not None:
        # Keep what the planner recorded (e.g. Disco's fusion baselines and bound).
        prediction.baselines = dict(candidate.plan.prediction.baselines)
    candidate.simulated_step_time_s = prediction.step_time_s
    candidate.scorer = prediction.source
    if scorer is not None:
        seconds, source, why = scorer.score(graph, cluster, candidate.plan, result)
        candidate.scorer_why = why or None
        prediction.simulated_step_time_s = prediction.step_time_s
        prediction.step_time_s = float(seconds)
        prediction.source = source
        candidate.scorer = source
    candidate.plan.prediction = prediction
    candidate.step_time_s = prediction.step_time_s
    candidate.feasible = prediction.feasible
    if not prediction.feasible:
        candidate.reason = prediction.infeasible_reason
    return candidate


def build_candidates(
    graph,
    cluster,
    batch_size,
    devices=None,
    families=None,
    cost_model=None,
    options=None,
    progress=None,
    executable=None,
    scorer=None,
):
    """Builds and scores every candidate plan.

    Args:
        graph: The `ModelGraph`.
        cluster: The `Cluster`.
        batch_size: Global batch size.
        devices: Device names to plan for (default: all).
        families: Planner families to try (default: every available one).
        cost_model: Cost model for the simulator (default: analytic, for
            `options["backend"]` when given, else for the active backend).
            A cost model given here scores every candidate (`scorer` unused).
        options: Options passed to the baselines (`algorithm`, `bucket_bytes`)
            and `backend`, the Keras backend the plans are for.
        progress: Optional tqdm bar, advanced once per candidate.
        executable: Optional predicate `plan -> (bool, reason)` telling whether
            the active backend can run a plan.
        scorer: A `Scorer` (from `resolve_scorer`) giving predicted step
            times; None scores with the plain simulator.

    Returns:
        A list of `Candidate`, baselines first.
    """
    devices = list(devices or cluster.names)
    options = dict(options or {})
    if cost_model is not None:
        scorer = None  # the given cost model scores every candidate
    else:
        cost_model = _backend_cost_model(cluster, options.get("backend"))
    if scorer is not None:
        scorer.prepare(cluster, devices)
    families = available_families() if families is None else list(families)
    candidates = []
    for name, build in baseline_candidates(graph, cluster, batch_size, devices, options):
        started = time.perf_counter()
        candidate = Candidate(name=name, family="baseline")
        try:
            candidate.plan = build()
            _score(graph, cluster, candidate, cost_model, scorer)
        except AutodistError as e:
            candidate.reason = str(e)
        candidate.planning_time_s = time.perf_counter() - started
        candidates.append(candidate)
        if progress is not None:
            progress.update(1)
    # Disco plans op-fusion regions where the backend's runtime compiles them by
    # default (every device a GPU, TensorFlow's XLA; not torch.compile, which
    # measured slower than eager Keras).
    # op_fusion="on" / "off" (AutoStrategy's runtime option) forces the search either way.
    disco_options = {"backend": options["backend"]} if options.get("backend") else {}
    if options.get("op_fusion") in ("on", "off"):
        disco_options["op_fusion"] = options["op_fusion"] == "on"
    family_options = {"disco": disco_options}
    for family in families:
        started = time.perf_counter()
        candidate = Candidate(name=family, family=family)
        try:
            module = importlib.import_module(f"autodist_keras.strategies.{family}")
            candidate.plan = module.plan(
                graph, cluster, batch_size, cost_model=cost_model, devices=devices,
                time_budget_s=FAMILY_BUDGET_S.get(family), progress=None,
                **family_options.get(family, {}),
            )
            _score(graph, cluster, candidate, cost_model, scorer)
            runnable, why = runnable_anywhere(candidate.plan, cluster, options.get("backend"))
            if not runnable:  # auto never chooses it, wherever the cluster is
                candidate.executable, candidate.reason = False, why
                candidate.plan.notes.append(f"execution: {why}; auto does not choose it.")
            elif not candidate.plan.is_data_parallel:
                candidate.plan.notes.append(
                    "execution: this placement/hybrid plan has "
                    f"{len(candidate.plan.groups)} layer groups; the TensorFlow adapter runs "
                    "such plans in one process on local devices, the PyTorch adapter runs "
                    "data-parallel plans only (AutoStrategy skips plans the active backend "
                    "cannot run)."
                )
        except AutodistError as e:
            candidate.plan = None
            candidate.reason = f"{family} planner failed: {e}"
        candidate.planning_time_s = time.perf_counter() - started
        candidates.append(candidate)
        if progress is not None:
            progress.update(1)
    if scorer is not None:
        scorer.finish(candidates)
    if executable is not None:
        for candidate in candidates:  # (baselines are data parallel: runnable anywhere)
            if candidate.plan is not None and candidate.executable is not False:
                candidate.executable, why = executable(candidate.plan)
                if not candidate.executable:
                    candidate.reason = why
    return candidates


def runnable_anywhere(plan, cluster, backend=None):
    """Whether some runtime can run `plan` on `cluster` (wherever it is).

    Data-parallel plans run on one node or several (TensorFlow multi-worker,
    `torchrun`). Placement and hybrid plans (several layer groups) run only
    on the TensorFlow runtime, in one process that drives one node's devices,
    so such a plan spanning nodes cannot run anywhere yet, and under the
    PyTorch backend not at all.

    Args:
        plan: A `Plan`.
        cluster: The `Cluster` it was made for.
        backend: `"tensorflow"`, `"torch"`, or None for either.

    Returns:
        `(True, "")`, or `(False, reason)`.
    """
    nodes = plan.nodes(cluster)
    if plan.is_data_parallel or len(nodes) <= 1:
        if backend == "torch":
            from autodist_keras.backends.torch_adapter import plan_kind_runs_on_torch

            return plan_kind_runs_on_torch(plan)
        return True, ""
    return False, (
        f"this placement/hybrid plan ({len(plan.groups)} layer groups) spans nodes {nodes}; "
        "no runtime can run it yet: the TensorFlow runtime runs such plans in one process "
        "on one node, the PyTorch runtime data-parallel plans only"
    )


def _usable(candidate):
    """Whether auto may choose the candidate: a plan that fits and that the
    backend can run (where known)."""
    return (candidate.plan is not None and candidate.feasible
            and candidate.executable is not False)


def pick(candidates, fits_hint=""):
    """Returns the fastest feasible (and executable, where known) candidate.

    Args:
        candidates: The scored `Candidate`s.
        fits_hint: A sentence on what would fit, for the error (`_fits_hint`).

    Raises:
        StrategyError: If no candidate is feasible.
    """
    usable = [c for c in candidates if _usable(c)]
    if not usable:
        reasons = "; ".join(f"{c.name}: {_common.shorten(c.reason)}" for c in candidates
                            if c.reason)
        blocked = [c for c in candidates if c.feasible and c.executable is False]
        if blocked:
            raise StrategyError(
                f"No plan that fits can run: {', '.join(c.name for c in blocked)} fit "
                f"(predicted), but {_common.shorten(str(blocked[0].reason)).rstrip('.')}; "
                "the plans that can run do not fit. Use more or larger devices (on one node, "
                f"for a placement plan), or a smaller batch.{fits_hint} Received: {reasons}"
            )
        raise StrategyError(
            "No candidate plan fits this model on this cluster (predicted). Use more or "
            f"larger devices, or a smaller batch.{fits_hint} Received: {reasons}"
        )
    # Ties go to the simpler plan: baselines come first in the list. Times within
    # TIE_RTOL of the fastest count as ties (float noise, or a family returning a
    # baseline's plan with other buckets).
    fastest = min(c.step_time_s for c in usable)
    return next(c for c in usable if c.step_time_s <= fastest * (1.0 + TIE_RTOL))


def _fits_hint(graph, cluster, devices, batch_size):
    """' Data parallelism fits about N samples ...' or '' (predicted capacity)."""
    from autodist_keras.strategies import baselines

    names = list(devices or cluster.names)
    try:
        capacity = sum(baselines.memory_capacity_samples(graph, cluster, d) for d in names)
    except Exception:  # noqa: BLE001 - a hint only; the error stands without it
        return ""
    if capacity >= batch_size:
        return ""
    if capacity <= 0:
        from autodist_keras.estimator import simulator

        static, per_sample = simulator.replica_memory_terms(graph)
        room = max(simulator.usable_memory_bytes(cluster.device(d)) for d in names)
        if static > room:
            return (" Data parallelism fits no sample on these devices (predicted): the "
                    f"weights, gradients and optimizer slots alone ({static / 2**20:.1f} MiB) "
                    f"exceed the most any device can use ({room / 2**20:.1f} MiB).")
        # The state fits, but one sample's activations do not fit beside it: a smaller
        # batch cannot help (it said "the weights ... alone exceed", which was untrue).
        return (" Data parallelism fits no sample on these devices (predicted): beside the "
                f"weights, gradients and optimizer slots ({static / 2**20:.1f} MiB) one "
                f"sample's activations ({per_sample / 2**20:.1f} MiB) exceed the most any "
                f"device can use ({room / 2**20:.1f} MiB).")
    return (f" Data parallelism fits about {capacity} samples per step on these "
            f"{len(names)} devices (predicted): try batch_size={capacity} or less.")


def record_candidates(plan, candidates):
    """Stores every candidate's predicted figures on `plan.prediction.baselines`.

    The candidates come first, in search order. Figures the planner recorded
    inside its own search (HeteroG's seeds and search result, Disco's fusion
    baselines) are kept after them, unless a candidate has the same name;
    they carry no `"family"` key, which is how `explain()` tells them from
    the candidates (it lists them apart, not as candidates).

    Args:
        plan: The chosen `Plan` (with its `prediction`).
        candidates: The `Candidate`s of the search.
    """
    figures = {c.name: c.to_dict() for c in candidates}
    for name, value in plan.prediction.baselines.items():
        figures.setdefault(name, value)
    plan.prediction.baselines = figures


def note_scoring(plan, scorer, candidates, scorer_why=None):
    """Notes on a forced strategy's plan which predictor scored the candidates.

    `explain()` adds it to the plan's "why", as `auto` says it in its own
    lines: the learned estimator or the simulator, and any machine-speed
    scaling of the learned times.

    Args:
        plan: The chosen `Plan` (its notes are replaced, not appended to twice).
        scorer: The `Scorer` that scored `candidates`.
        candidates: The `Candidate` list of the search.
        scorer_why: For a plan that is none of the candidates (`score_plan`),
            why the learned estimator did not score it, if so.
    """
    plan.notes = [n for n in plan.notes if not n.startswith("scored: ")] + [
        "scored: " + scorer.summary(candidates)]
    if scorer_why:
        plan.notes.append(f"scored: the learned estimator did not score it: {scorer_why}")


def score_plan(graph, cluster, plan, scorer, candidates, name):
    """Scores a plan made beside a search exactly as the search's candidates were.

    A forced strategy whose options shape its plan (`sync="ps"`, `speeds`,
    ...) builds that plan apart from the candidates; scored by the plain
    simulator it would sit on another scale than they do (the learned
    estimator's), and `explain()` would compare figures of two scales. Here
    it gets the scorer's time, and outside the estimator's domain the same
    `learned / simulated` rescaling by an in-domain candidate of the search
    (`Scorer.finish`), so a plan equal to a candidate gets the candidate's
    figure.

    Args:
        graph: The `ModelGraph`.
        cluster: The `Cluster`.
        plan: The `Plan` (built and validated); its `prediction` is set.
        scorer: The `Scorer` that scored `candidates` (prepared for their
            devices), or None for the plain simulator.
        candidates: The scored `Candidate`s of the search.
        name: The name of the new `Candidate` (e.g. `"data_parallel_even"`).

    Returns:
        The scored `Candidate` of `plan` (not added to `candidates`).

    Example:

    ```python
    scorer = resolve_scorer("learned", "torch")
    candidates = build_candidates(graph, cluster, 96, scorer=scorer)
    plan = baselines.data_parallel_even(graph, cluster, 96, sync="ps")
    forced = score_plan(graph, cluster, plan, scorer, candidates, "data_parallel_even")
    ```
    """
    candidate = Candidate(name=name, family="baseline", plan=plan)
    backend = scorer.backend if scorer is not None else None
    _score(graph, cluster, candidate, _backend_cost_model(cluster, backend), scorer)
    if scorer is not None:
        scorer.finish(list(candidates) + [candidate], targets=[candidate])
    return candidate


def _explain_choice(best, candidates, scorer=None):
    by_name = {c.name: c for c in candidates}
    even = by_name.get("data_parallel_even") or by_name.get("single_device")
    lines = [f"chosen: {best.name} (fastest predicted feasible plan of {len(candidates)}; "
             f"its time from the {best.scorer or SCORER_SIMULATOR})"]
    if scorer is not None:
        lines.append(scorer.summary(candidates))
    # (The speedup itself is no note: `explain()` gives it from the candidates, as
    # `speedup_vs_even_predicted`; a note said it again, rounded otherwise.)
    if even is not None and not even.feasible:
        why = ("it does not fit in memory (predicted)" if even.plan is not None
               else str(even.reason or "it could not be built").rstrip("."))
        lines.append(f"no speedup over {even.name} is given: {why}")
    for c in candidates:
        if c is best:
            continue
        if c.step_time_s is not None and c.step_time_s < best.step_time_s:
            lines.append(f"faster on paper but not used: {c.name} ({c.reason})")
    close = _close_call(best, candidates, scorer)
    if close:
        lines.append(close)
    return lines


def _close_call(best, candidates, scorer):
    """A warning line when the runner-up is predicted slower by less than the
    learned estimator's held-out error, so real runs may rank the two the
    other way; None otherwise (or when the error is unknown)."""
    mape = scorer.held_out_mape if scorer is not None else None
    if mape is None or not best.step_time_s or not (best.scorer or "").startswith("learned"):
        return None
    # Candidates tied with the chosen one (the same plan reached by another
    # family) are not a different choice.
    others = [c for c in candidates
              if c is not best and _usable(c) and c.step_time_s
              and c.step_time_s > best.step_time_s * (1.0 + TIE_RTOL)]
    if not others:
        return None
    runner_up = min(others, key=lambda c: c.step_time_s)
    gap = runner_up.step_time_s / best.step_time_s - 1.0
    if gap * 100.0 >= mape:
        return None
    return (f"close call: {runner_up.name} is predicted only {gap * 100:.1f}% slower, inside "
            f"the learned estimator's held-out error ({mape:.1f}% MAPE); on real hardware "
            f"either may be faster. To be sure, time both: AutoStrategy(plan=...) runs a "
            f"given plan")


def choose_plan(
    graph,
    cluster,
    batch_size,
    devices=None,
    families=None,
    cost_model=None,
    options=None,
    cache_dir=None,
    use_cache=True,
    show_progress=False,
    executable=None,
    estimator="learned",
    backend=None,
):
    """Plans with every family and baseline and returns the best plan.

    Args:
        graph: The `ModelGraph`.
        cluster: The `Cluster`.
        batch_size: Global batch size.
        devices: Device names (default: all).
        families: Planner families to try (default: all available).
        cost_model: Cost model for the simulator (default: analytic).
        options: Options for the baselines (`algorithm`, `bucket_bytes`).
        cache_dir: Plan cache folder (default: `default_cache_dir()`).
        use_cache: Read and write the plan cache.
        show_progress: Show a tqdm progress bar while planning.
        executable: Optional predicate `plan -> (bool, reason)`.
        estimator: Which predictor scores the candidates: `"learned"`
            (default), `"simulator"`, a path to a saved `LearnedEstimator`
            JSON, or a `LearnedEstimator` (see the module docstring). The
            simulator always decides memory feasibility. Ignored (plain
            simulator) when `cost_model` is given.
        backend: Keras backend the plan is for (default: `options["backend"]`,
            else the active one or `$KERAS_BACKEND`); the candidates are priced
            for it (its host times), whichever backend this process runs.

    Returns:
        `(plan, candidates)`: the chosen `Plan` (its `prediction.baselines`
        holds every candidate's predicted figures) and the list of
        `Candidate` (empty when the plan came from the cache).
    """
    devices = list(devices or cluster.names)
    options = dict(options or {})
    families = available_families() if families is None else list(families)
    # The backend sets the cost model's host times and Disco's op-fusion rule,
    # so it is part of what a cached plan was made for.
    backend = backend or options.get("backend") or active_keras_backend()
    options["backend"] = backend
    scorer = None
    if cost_model is None:
        # `build_candidates` prepares it (and runs the machine-speed probe once);
        # a plan from the cache needs neither.
        scorer = resolve_scorer(estimator, backend)
    key = cache_key(graph, cluster, batch_size, devices, families, options,
                    scorer=scorer.identity if scorer is not None else "simulator")
    path = os.path.join(cache_dir or default_cache_dir(), f"{key}.json")
    if use_cache and cost_model is None and os.path.exists(path):
        try:
            plan = Plan.from_json(path)
            plan.validate(graph, cluster)
            if ((executable is not None and not executable(plan)[0])
                    or not runnable_anywhere(plan, cluster, backend)[0]):
                # e.g. a placement plan cached by a one-process run, read by a worker
                raise StrategyError("the cached plan cannot run here; planning again")
            plan.notes = [n for n in plan.notes if not n.startswith(CACHE_NOTE_PREFIX)]
            plan.notes.append(f"cache: reused plan {key[:12]} from {path}")
            plan.provenance.backend = plan.provenance.backend or backend
            return plan, []
        except AutodistError:
            pass  # a stale or damaged cache entry: plan again and overwrite it
    started = time.perf_counter()
    total = len(baseline_candidates(graph, cluster, batch_size, devices, options)) + len(families)
    bar = None
    if show_progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc="autodist_keras: planning", unit="plan", leave=False)
    try:
        candidates = build_candidates(
            graph, cluster, batch_size, devices=devices, families=families,
            cost_model=cost_model, options=options, progress=bar, executable=executable,
            scorer=scorer,
        )
    finally:
        if bar is not None:
            bar.close()
    # What batch would fit is worked out only for the error that needs it.
    hint = "" if any(_usable(c) for c in candidates) else _fits_hint(
        graph, cluster, devices, batch_size)
    best = pick(candidates, hint)
    plan = best.plan
    plan.provenance.backend = backend
    record_candidates(plan, candidates)
    plan.notes = [n for n in plan.notes if not n.startswith("auto:")]
    plan.notes += ["auto: " + line for line in _explain_choice(best, candidates, scorer)]
    plan.provenance.options = dict(
        plan.provenance.options, auto_search_time_s=time.perf_counter() - started,
        candidates=[c.name for c in candidates], auto_chosen=best.name,
        scorer=scorer.identity if scorer is not None else "cost_model",
    )
    if use_cache and cost_model is None:
        try:
            write_text_atomic(path, plan.to_json())
        except OutputError as e:
            # The cache only saves planning time: go on with the plan just made.
            reason = str(e).split(" Received:")[0]
            warnings.warn(
                f"autodist_keras could not cache the plan it made: {reason} The plan is used "
                "as is, and the next run plans again; to keep plans, point "
                "AUTODIST_KERAS_CACHE (or cache_dir=) at a writable directory. "
                f"Received: cache directory {os.path.dirname(path)!r}",
                stacklevel=2,
            )
    return plan, candidates
