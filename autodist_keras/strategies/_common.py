"""Plumbing shared by the FastT and HeteroG planners.

Argument checks, the planning-time budget, building a `Plan` from a layer
placement, attaching the simulator's prediction and provenance, and the
baseline figures a planner compares itself with in `plan.notes`.

Example:

```python
devices = check_request("fastt", graph, cluster, 256, None, options, OPTION_NAMES)
plan = placement_plan(graph, tables, replicas, 256, "fastt")
result = finish(plan, graph, cluster, cost, started, options)
```
"""

import time

from autodist_keras.errors import PlanError
from autodist_keras.errors import StrategyError
from autodist_keras.strategies import baselines
from autodist_keras.strategies.plan import LayerGroup
from autodist_keras.strategies.plan import Plan
from autodist_keras.strategies.plan import Provenance
from autodist_keras.strategies.plan import Replica
from autodist_keras.strategies.plan import SyncSpec


BATCH_STATISTICS_LAYERS = ("BatchNormalization", "SyncBatchNormalization")


def unsplittable_layers(graph):
    """Layer calls whose result depends on the whole batch: not to split by rows.

    The layers the TensorFlow placement runtime refuses to split
    (`tf_placement.whole_batch_problem`: a trainable BatchNormalization or a
    subclass of it, which normalises with the batch's statistics, and a
    stateful layer, which keeps state per batch row), and trainable layers of
    a batch-statistics type by name (`BATCH_STATISTICS_LAYERS`).
    Only graphs made with `ModelGraph.from_keras` (with Keras calls) are
    checked: the runtimes run no placement plan for any other graph.

    Args:
        graph: A `ModelGraph`.

    Returns:
        A set of graph node names (empty for a graph without Keras calls).

    Example:

    ```python
    blocked = unsplittable_layers(ModelGraph.from_keras(model))
    ```
    """
    calls = getattr(graph, "calls", None) or {}
    if not calls:
        return set()
    from autodist_keras.backends.tf_placement import whole_batch_problem

    blocked = set()
    for name, node in graph.nodes.items():
        op = calls.get(name, (None, None))[0]
        if op is None or node.kind == "input":
            continue
        named = node.layer_type in BATCH_STATISTICS_LAYERS and getattr(op, "trainable", False)
        if named or whole_batch_problem(op):
            blocked.add(name)
    return blocked


def unsplittable_units(graph, coarse, units):
    """Indices of the `units` that hold a layer not to split by rows.

    The planners work on a coarse graph whose units group layers; a unit
    holding any of `unsplittable_layers(graph)` must not be split either
    (FastT leaves it out of its splits, HeteroG keeps it on one device in a
    hybrid plan).

    Args:
        graph: The `ModelGraph`.
        coarse: The coarse graph, whose `members` maps a unit to its layers
            (a unit missing there is the layer of that name).
        units: The unit names, in the planner's index order.

    Returns:
        A set of indices into `units`.

    Example:

    ```python
    blocked = unsplittable_units(graph, coarse, tables.layers)
    ```
    """
    layers = unsplittable_layers(graph)
    if not layers:
        return set()
    return {i for i, unit in enumerate(units)
            if layers & set(coarse.members.get(unit, [unit]))}


def ranked_devices(devices, cluster, speeds=None):
    """`devices` fastest first, then the best connected, then in the order given.

    Speed is `speeds[name]` where given, else the device's peak FP32 FLOP/s;
    among equally fast devices the one whose node has the faster NIC, then
    the lower NIC latency, comes first.

    Args:
        devices: Device names.
        cluster: The `Cluster`.
        speeds: Optional dict from device name to a speed figure.

    Returns:
        A list of the names, ranked.

    Example:

    ```python
    top = ranked_devices(cluster.names, cluster)[:batch_size]
    ```
    """
    def key(item):
        i, name = item
        node = cluster.nodes[cluster.device(name).node]
        speed = float(speeds[name]) if speeds is not None and name in speeds else float(
            cluster.device(name).peak_flops_fp32)
        return (-speed, -node.nic_bandwidth, node.nic_latency, i)

    return [name for _, name in sorted(enumerate(devices), key=key)]


def check_request(planner, graph, cluster, batch_size, devices, options, allowed):
    """Validates a planner call and returns the device names to plan over.

    Raises:
        StrategyError: For an unknown option.
        PlanError: For an unknown device or a batch smaller than one sample
            per device.
    """
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise StrategyError(
            f"{planner}.plan() got unknown option(s) {unknown}. Valid options: "
            f"{', '.join(sorted(allowed))}. Received: {unknown}"
        )
    names = baselines._resolve_devices(cluster, devices)
    if len(set(names)) != len(names):
        raise PlanError(f"devices lists a device twice. Received: devices={names}")
    baselines._check_batch(batch_size, 1)
    if not graph.nodes:
        raise PlanError(
            f"{planner}: the model graph has no layers to place. Received: a graph "
            "with 0 nodes"
        )
    return names


class Budget:
    """Wall-clock planning budget.

    Searches are bounded by deterministic evaluation counts; the budget is a
    safety stop on slow machines, and hitting it is reported in the notes
    (results may then differ from run to run).

    Args:
        seconds: Budget in seconds, or None for the planner's default.
        default: The planner's default budget in seconds.
        started: `time.perf_counter()` when planning began.
    """

    def __init__(self, seconds, default, started):
        if seconds is not None and (not isinstance(seconds, (int, float)) or seconds <= 0):
            raise StrategyError(
                f"time_budget_s must be a positive number of seconds. Received: {seconds!r}"
            )
        self.seconds = float(seconds if seconds is not None else default)
        self.started = started
        self.hit = False

    def elapsed(self):
        return time.perf_counter() - self.started

    def exhausted(self, reserve=0.0):
        """True once `seconds - reserve` have passed (and remembers it)."""
        if self.elapsed() >= self.seconds - reserve:
            self.hit = True
        return self.hit


def group_layers(layer_names, replicas):
    """Merges consecutive layers with identical replicas into layer groups.

    Args:
        layer_names: Layer names in topological order.
        replicas: Per layer, a list of `(device name, share)`.

    Returns:
        A list of `LayerGroup` named `g0`, `g1`, ...
    """
    groups = []
    last = None
    for name, reps in zip(layer_names, replicas):
        key = tuple((d, int(s)) for d, s in reps)
        if groups and key == last:
            groups[-1].layers.append(name)
            continue
        groups.append(
            LayerGroup(f"g{len(groups)}", [name], [Replica(d, int(s)) for d, s in key])
        )
        last = key
    return groups


def placement_plan(graph, layer_replicas, batch_size, planner, order=None, sync=None,
                   bucket_bytes=baselines.DDP_BUCKET_BYTES, options=None):
    """A plan from a per-layer placement.

    Args:
        graph: The `ModelGraph`.
        layer_replicas: Dict from layer name to a list of `(device, share)`.
        batch_size: Global batch size.
        planner: Provenance name.
        order: Per device, `(layer, phase)` entries (execution priority).
        sync: Dict from variable name to `SyncSpec` (default: ring all-reduce).
        bucket_bytes: Gradient bucket threshold (DDP-style packing).
        options: Options to record in the provenance.

    Returns:
        A `Plan` (not yet simulated).
    """
    names = list(graph.nodes)
    groups = group_layers(names, [layer_replicas[n] for n in names])
    if sync is None:
        sync = {v.name: SyncSpec(method="allreduce", algorithm="ring") for v in graph.variables}
    return Plan(
        global_batch_size=batch_size,
        groups=groups,
        sync=sync,
        buckets=baselines.gradient_buckets(graph, bucket_bytes),
        order={d: [tuple(e) for e in entries] for d, entries in (order or {}).items()},
        provenance=Provenance(planner=planner, options=dict(options or {})),
    )


def finish(plan, graph, cluster, cost_model, started, result=None):
    """Attaches the simulator's prediction, fingerprints and planning time.

    Args:
        plan: The chosen `Plan`.
        graph, cluster, cost_model: What it was planned for.
        started: `time.perf_counter()` when planning began.
        result: The plan's `SimResult` if already simulated.

    Returns:
        The `SimResult`.
    """
    from autodist_keras.estimator import simulate

    plan.validate(graph, cluster)
    if result is None:
        result = simulate(graph, cluster, plan, cost_model=cost_model, validate=False)
    baselines_seen = plan.prediction.baselines if plan.prediction is not None else {}
    plan.prediction = result.to_prediction()
    plan.prediction.baselines = dict(baselines_seen)
    plan.provenance.graph_fingerprint = graph.fingerprint()
    plan.provenance.layer_order = list(graph.nodes)
    plan.provenance.cluster_fingerprint = cluster.fingerprint()
    plan.provenance.planning_time_s = time.perf_counter() - started
    return result


def baseline_results(graph, cluster, batch_size, devices, cost_model, which, provided=None):
    """Simulated step times of baseline plans, for comparison notes.

    Args:
        which: Baseline names among `data_parallel_even` and `proportional`.
        provided: Dict from baseline name to a known step time in seconds
            (or a `Prediction`), to skip simulating it again.

    Returns:
        Dict from name to `{"step_time_s": float, "feasible": bool}`; a
        baseline that cannot be built (e.g. it does not fit) maps to
        `{"step_time_s": None, "feasible": False, "error": message}`.
    """
    from autodist_keras.estimator import simulate

    builders = {
        "data_parallel_even": baselines.data_parallel_even,
        "proportional": baselines.proportional,
    }
    out = {}
    for name in which:
        known = (provided or {}).get(name)
        if known is not None:
            step = getattr(known, "step_time_s", known)
            feasible = getattr(known, "feasible", True)
            out[name] = {"step_time_s": float(step), "feasible": bool(feasible)}
            continue
        try:
            plan = builders[name](graph, cluster, batch_size, devices=devices)
        except PlanError as e:
            out[name] = {"step_time_s": None, "feasible": False, "error": str(e)}
            continue
        result = simulate(graph, cluster, plan, cost_model=cost_model, validate=False)
        out[name] = {"step_time_s": result.step_time_s, "feasible": result.feasible}
    return out


def shorten(text, limit=300):
    """`text` cut at a word boundary (with " ...") when longer than `limit` characters."""
    text = str(text)
    if len(text) <= limit:
        return text
    return text[:limit].rsplit(" ", 1)[0] + " ..."


def comparison_note(step_time_s, figures):
    """One sentence comparing a predicted step time with baseline figures."""
    parts = []
    for name, fig in figures.items():
        other = fig.get("step_time_s")
        if other is None:
            parts.append(f"{name} cannot be built ({shorten(fig.get('error', 'does not fit'), 80)})")
            continue
        speedup = other / step_time_s if step_time_s > 0 else float("inf")
        fits = "" if fig.get("feasible", True) else ", does not fit in memory"
        parts.append(f"{name} {ms(other)}{fits} (this plan is {speedup:.2f}x)")
    return (f"Simulated (the planner's own scoring, predicted) {ms(step_time_s)} per step vs "
            + "; ".join(parts) + ".")


def int_option(planner, name, value, minimum):
    """Checks an integer planner option and returns it.

    Args:
        planner: Planner name, for the message.
        name: Option name.
        value: The value given (or the default).
        minimum: Smallest allowed value.

    Returns:
        `value`.

    Raises:
        StrategyError: When `value` is not an integer (bools are not) or is
            below `minimum`.
    """
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise StrategyError(
            f"{planner}: option {name} must be an integer >= {minimum}. Received: {value!r}"
        )
    return value


def tick(progress, planner, text):
    """Advances an optional tqdm `progress` by one stage, labelled `planner text`."""
    if progress is not None:
        progress.update(1)
        progress.set_postfix_str(f"{planner} {text}", refresh=False)


def result_notes(result, budget):
    """The closing notes every planner adds: predicted memory overflow, budget hit.

    Args:
        result: The chosen plan's `SimResult`.
        budget: The planning `Budget`.

    Returns:
        A list of zero to two sentences.
    """
    notes = []
    if not result.feasible:
        notes.append(f"The plan does not fit in memory (predicted): {result.infeasible_reason}.")
    if budget.hit:
        notes.append(
            f"The planning budget of {budget.seconds:.1f} s was reached; the search stopped "
            "early, so the result may differ between runs."
        )
    return notes


def unit_buffer_bytes(graph, coarse):
    """Backward gradient buffer per sample of each unit of a `CoarseGraph`.

    The largest output of the unit's layers (`simulator.gradient_buffer_bytes`),
    not the sum the unit's `output_bytes` holds: the simulator counts the
    buffer on the fine graph.
    """
    from autodist_keras.estimator.simulator import gradient_buffer_bytes

    return {
        unit: gradient_buffer_bytes(graph.nodes[layer] for layer in layers)
        for unit, layers in coarse.members.items()
    }


def batch_grid(batch):
    """Batch sizes at which to sample a cost curve: 1, 2, 3, 4, 6, 8, 12, ... and `batch`.

    Layer times are convex and piecewise linear in the batch under the
    roofline, so interpolating between these points is close to exact.
    """
    pts = {1, batch}
    g = 2
    while g < batch:
        pts.add(g)
        pts.add(g + g // 2)
        g *= 2
    return sorted(p for p in pts if p <= batch)


def ms(seconds):
    """Seconds as a short millisecond string."""
    return f"{seconds * 1e3:.2f} ms"
