"""Choosing a plan: candidates from every family and the baselines, scored by the estimator.

`choose_plan` builds the baselines (single device, even and proportional
data parallelism, each with all-reduce and PS where it differs) and asks each
planner family (FastT, HeteroG, Disco) for its best plan. Every candidate is
scored by the simulator, the one source of predicted times. The fastest
feasible candidate wins; the others are recorded on the winner's
`prediction.baselines` so `explain()` can show what they would cost.

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
import os
import time

from autodist_keras.errors import AutodistError
from autodist_keras.errors import StrategyError
from autodist_keras.strategies import baselines
from autodist_keras.strategies.plan import Plan
from autodist_keras.strategies.plan import write_text_atomic

FAMILIES = ("fastt", "heterog", "disco")
FAMILY_BUDGET_S = {"fastt": 3.0, "heterog": 4.0, "disco": 2.0}
CACHE_VERSION = 1


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
    """

    name: str
    family: str
    plan: object = None
    step_time_s: float = None
    feasible: bool = False
    planning_time_s: float = 0.0
    executable: bool = None
    reason: str = None

    def to_dict(self):
        return {
            "name": self.name,
            "family": self.family,
            "predicted_step_time_s": self.step_time_s,
            "feasible": self.feasible,
            "planning_time_s": self.planning_time_s,
            "executable": self.executable,
            "reason": self.reason,
        }


def default_cache_dir():
    """Where plans are cached: `$AUTODIST_KERAS_CACHE/plans` or `~/.cache/autodist_keras/plans`."""
    root = os.environ.get("AUTODIST_KERAS_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "autodist_keras"
    )
    return os.path.join(root, "plans")


def cache_key(graph, cluster, batch_size, devices, families, options):
    """A stable key of everything a plan search depends on."""
    payload = json.dumps(
        {
            "version": CACHE_VERSION,
            "graph": graph.fingerprint(),
            "cluster": cluster.fingerprint(),
            "batch_size": batch_size,
            "devices": list(devices),
            "families": list(families),
            "options": {k: repr(v) for k, v in sorted(options.items())},
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()


def baseline_candidates(graph, cluster, batch_size, devices, options):
    """Returns the baseline plans as `(name, builder)` pairs (not yet built)."""
    opts = {k: v for k, v in options.items() if k in ("algorithm", "bucket_bytes")}
    pairs = [
        ("single_device", lambda: baselines.single_device(
            graph, cluster, batch_size,
            bucket_bytes=opts.get("bucket_bytes", baselines.DDP_BUCKET_BYTES))),
    ]
    if len(devices) > 1:
        pairs += [
            ("data_parallel_even", lambda: baselines.data_parallel_even(
                graph, cluster, batch_size, devices=devices, **opts)),
            ("proportional", lambda: baselines.proportional(
                graph, cluster, batch_size, devices=devices, **opts)),
            ("data_parallel_even_ps", lambda: baselines.data_parallel_even(
                graph, cluster, batch_size, devices=devices, sync="ps", **opts)),
            ("proportional_ps", lambda: baselines.proportional(
                graph, cluster, batch_size, devices=devices, sync="ps", **opts)),
        ]
    return pairs


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


def _score(graph, cluster, candidate, cost_model):
    from autodist_keras.estimator import simulate

    # Baseline builders validate their plans already; planner plans are checked here.
    result = simulate(graph, cluster, candidate.plan, cost_model=cost_model,
                      validate=candidate.family != "baseline")
    prediction = result.to_prediction()
    if candidate.plan.prediction is not None:
        # Keep what the planner recorded (e.g. Disco's fusion baselines and bound).
        prediction.baselines = dict(candidate.plan.prediction.baselines)
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
):
    """Builds and scores every candidate plan.

    Args:
        graph: The `ModelGraph`.
        cluster: The `Cluster`.
        batch_size: Global batch size.
        devices: Device names to plan for (default: all).
        families: Planner families to try (default: every available one).
        cost_model: Cost model for the simulator (default: analytic).
        options: Options passed to the baselines (`algorithm`, `bucket_bytes`).
        progress: Optional tqdm bar, advanced once per candidate.
        executable: Optional predicate `plan -> (bool, reason)` telling whether
            the active backend can run a plan.

    Returns:
        A list of `Candidate`, baselines first.
    """
    devices = list(devices or cluster.names)
    options = dict(options or {})
    families = available_families() if families is None else list(families)
    candidates = []
    for name, build in baseline_candidates(graph, cluster, batch_size, devices, options):
        started = time.perf_counter()
        candidate = Candidate(name=name, family="baseline")
        try:
            candidate.plan = build()
            _score(graph, cluster, candidate, cost_model)
        except AutodistError as e:
            candidate.reason = str(e)
        candidate.planning_time_s = time.perf_counter() - started
        candidates.append(candidate)
        if progress is not None:
            progress.update(1)
    for family in families:
        started = time.perf_counter()
        candidate = Candidate(name=family, family=family)
        try:
            module = importlib.import_module(f"autodist_keras.strategies.{family}")
            candidate.plan = module.plan(
                graph, cluster, batch_size, cost_model=cost_model, devices=devices,
                time_budget_s=FAMILY_BUDGET_S.get(family), progress=None,
            )
            _score(graph, cluster, candidate, cost_model)
            if not candidate.plan.is_data_parallel:
                candidate.plan.notes.append(
                    "execution: this placement/hybrid plan has "
                    f"{len(candidate.plan.groups)} layer groups; the TensorFlow and PyTorch "
                    "adapters of this version run data-parallel plans only, so AutoStrategy "
                    "picks the fastest plan that can run and reports this one as an alternative."
                )
        except AutodistError as e:
            candidate.plan = None
            candidate.reason = f"{family} planner failed: {e}"
        candidate.planning_time_s = time.perf_counter() - started
        candidates.append(candidate)
        if progress is not None:
            progress.update(1)
    if executable is not None:
        for candidate in candidates:
            if candidate.plan is not None:
                candidate.executable, why = executable(candidate.plan)
                if not candidate.executable:
                    candidate.reason = why
    return candidates


def pick(candidates):
    """Returns the fastest feasible (and executable, where known) candidate.

    Raises:
        StrategyError: If no candidate is feasible.
    """
    usable = [
        c for c in candidates
        if c.plan is not None and c.feasible and c.executable is not False
    ]
    if not usable:
        reasons = "; ".join(f"{c.name}: {c.reason}" for c in candidates if c.reason)
        raise StrategyError(
            "No candidate plan fits this model on this cluster (predicted). Use more or "
            f"larger devices, or a smaller batch. Received: {reasons}"
        )
    # Ties go to the simpler plan: baselines come first in the list.
    return min(usable, key=lambda c: c.step_time_s)


def record_candidates(plan, candidates):
    """Stores every candidate's predicted figures on `plan.prediction.baselines`.

    Figures the planner recorded itself (e.g. Disco's fusion baselines) are kept.
    """
    plan.prediction.baselines = dict(
        plan.prediction.baselines, **{c.name: c.to_dict() for c in candidates}
    )


def _explain_choice(best, candidates):
    by_name = {c.name: c for c in candidates}
    even = by_name.get("data_parallel_even") or by_name.get("single_device")
    lines = [f"chosen: {best.name} (fastest predicted feasible plan of {len(candidates)})"]
    if even is not None and even.step_time_s and best.step_time_s:
        lines.append(
            f"predicted speedup over {even.name}: {even.step_time_s / best.step_time_s:.2f}x"
        )
    for c in candidates:
        if c is best:
            continue
        if c.step_time_s is not None and c.step_time_s < best.step_time_s:
            lines.append(f"faster on paper but not used: {c.name} ({c.reason})")
    return lines


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

    Returns:
        `(plan, candidates)`: the chosen `Plan` (its `prediction.baselines`
        holds every candidate's predicted figures) and the list of
        `Candidate` (empty when the plan came from the cache).
    """
    devices = list(devices or cluster.names)
    options = dict(options or {})
    families = available_families() if families is None else list(families)
    key = cache_key(graph, cluster, batch_size, devices, families, options)
    path = os.path.join(cache_dir or default_cache_dir(), f"{key}.json")
    if use_cache and cost_model is None and os.path.exists(path):
        try:
            plan = Plan.from_json(path)
            plan.validate(graph, cluster)
            plan.notes = [n for n in plan.notes if not n.startswith("cache:")]
            plan.notes.append(f"cache: reused plan {key[:12]} from {path}")
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
        )
    finally:
        if bar is not None:
            bar.close()
    best = pick(candidates)
    plan = best.plan
    record_candidates(plan, candidates)
    plan.notes = [n for n in plan.notes if not n.startswith("auto:")]
    plan.notes += ["auto: " + line for line in _explain_choice(best, candidates)]
    plan.provenance.options = dict(
        plan.provenance.options, auto_search_time_s=time.perf_counter() - started,
        candidates=[c.name for c in candidates],
    )
    if use_cache and cost_model is None:
        write_text_atomic(path, plan.to_json())
    return plan, candidates
