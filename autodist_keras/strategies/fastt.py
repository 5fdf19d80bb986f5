"""FastT: layer placement, execution order and op splitting by list scheduling.

After FastT (Yi et al., Middleware 2020). The model's training graph (a
forward and a backward task per layer) is list-scheduled over the devices
twice, with HEFT (upward rank, earliest finish time) and with CPOP (the
critical path on the one device that runs it fastest); each layer's backward
runs where its forward ran. Then, for the costliest layers on the schedule's
critical path, FastT tries splitting them along the batch axis over 2..n
devices (shares proportional to device speed), reschedules, and keeps a split
only if the schedule gets shorter. A split can cover one layer or the run of
consecutive layers the layer shares its devices with (mixed data and model
parallelism). Placement is memory-aware: a device takes a layer only if the
layer's parameters, gradients, optimizer slots and activations still fit, so
a model too large for one device is spread over several.

The schedules' makespans steer the search; the final candidates (HEFT and
CPOP, with and without splits) are scored by `estimator.simulate`, and the
best one is returned with its prediction. The plan's groups are runs of
consecutive layers on one device with the whole batch, or split layers with
several replicas; `plan.order` lists each device's forward and backward
entries by scheduled start time.

Example:

```python
from autodist_keras.strategies import fastt

plan = fastt.plan(graph, Cluster.from_string("2xV100,2xP100"), batch_size=128)
print(plan.summary())
```
"""

import time

from autodist_keras.errors import PlanError
from autodist_keras.errors import StrategyError
from autodist_keras.estimator.simulator import optimizer_slots_of
from autodist_keras.estimator.simulator import usable_memory_bytes
from autodist_keras.strategies import _common
from autodist_keras.strategies import baselines
from autodist_keras.strategies._coarse import CoarseCostModel
from autodist_keras.strategies._coarse import CoarseGraph
from autodist_keras.strategies._coarse import chain_partition
from autodist_keras.strategies._listsched import CostTables
from autodist_keras.strategies._listsched import static_bytes
from autodist_keras.strategies._listsched import list_schedule
from autodist_keras.strategies._listsched import resolve_cost_model

PLANNER = "fastt"
DEFAULT_BUDGET_S = 3.0
DEFAULT_MAX_WORK = 1.5e6  # estimated microseconds of list scheduling in the split search
PROXY_SCORE_RANGE = 1.5  # simulate final candidates within this factor of the best schedule
METHODS = ("heft", "cpop")
OPTION_NAMES = (
    "methods",  # list schedulers to run, subset of ("heft", "cpop")
    "split",  # try op splitting (default True)
    "max_split_rounds",  # accepted splits at most (default 12)
    "split_candidates",  # critical-path layers tried per round (default 3)
    "max_work",  # deterministic cap on split-search work, estimated microseconds (1.5e6)
    "memory_aware",  # respect device memory while placing (default True)
    "bucket_bytes",  # gradient bucket threshold of split layers (default 25 MiB)
    "baselines",  # dict name -> known baseline step time (s), to skip re-simulating
    "compare_baselines",  # simulate the even and proportional baselines for notes (default True)
)
DP_SEED = "dp"  # the data-parallel schedule among the candidates
UNITS_PER_MODEL = 48  # a fused chain holds at most 1/48 of the model's FLOPs
MIN_GAIN = 0.005  # a split must shorten the schedule by at least 0.5%


def plan(graph, cluster, batch_size, cost_model=None, devices=None, time_budget_s=None,
         progress=None, **options):
    """Plans placement, execution order and op splits with FastT.

    Args:
        graph: The `ModelGraph`.
        cluster: The `Cluster`.
        batch_size: Global batch size.
        cost_model: A `CostModel` (default `AnalyticCostModel(cluster)`).
        devices: Device names to use (default: all).
        time_budget_s: Safety stop for the search in seconds (default 3);
            the search is otherwise bounded by `max_work`, so results are
            deterministic unless the budget is hit (then a note says so).
        progress: Optional tqdm instance, advanced once per search stage.
        **options: See `OPTION_NAMES`: `methods`, `split`,
            `max_split_rounds`, `split_candidates`, `max_work`,
            `memory_aware`, `bucket_bytes`, `baselines`,
            `compare_baselines`.

    Returns:
        A validated `Plan` with `provenance.planner == "fastt"` and the
        simulator's prediction.

    Raises:
        StrategyError: For unknown or invalid options.
        PlanError: For an invalid batch size or unknown devices.

    Example:

    ```python
    plan = fastt.plan(graph, cluster, 256, methods=("heft",), split=False)
    ```
    """
    from autodist_keras.estimator import simulate

    started = time.perf_counter()
    names = _common.check_request(
        PLANNER, graph, cluster, batch_size, devices, options, OPTION_NAMES
    )
    methods = tuple(options.get("methods", METHODS))
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise StrategyError(
            f"fastt: methods must be a non-empty subset of {METHODS}. Received: {methods!r}"
        )
    split = bool(options.get("split", True))
    rounds = _int_option(options, "max_split_rounds", 12, 0)
    per_round = _int_option(options, "split_candidates", 3, 1)
    max_work = float(options.get("max_work", DEFAULT_MAX_WORK))
    memory_aware = bool(options.get("memory_aware", True))
    bucket_bytes = options.get("bucket_bytes", baselines.DDP_BUCKET_BYTES)
    budget = _common.Budget(time_budget_s, DEFAULT_BUDGET_S, started)
    cost = resolve_cost_model(cluster, cost_model)
    coarse = _units(graph, cluster, cost, names, batch_size)
    tables = CostTables(coarse.graph, cluster, CoarseCostModel(cost, coarse), names,
                        buffer_bytes=_common.unit_buffer_bytes(graph, coarse))
    tables.bucket_bytes = bucket_bytes or 0
    notes = []
    # Units holding a layer that cannot run as batch-split replicas (a trainable
    # BatchNormalization) are never split: no runtime could run that plan.
    blocked = _common.unsplittable_units(graph, coarse, tables.layers)
    if graph.data_parallel_only:
        notes.append(
            "The model has no functional graph (subclassed); FastT sees it as one "
            "opaque layer, so only whole-model placement or splitting applies."
        )

    works = []
    searched = []
    for method in methods:
        work = _Work(max_work / len(methods))
        works.append(work)
        base = list_schedule(tables, batch_size, method, memory=memory_aware)
        work.add(base)
        best, kept = base, []
        if split and tables.n_dev > 1:
            best, kept = _split_search(
                tables, batch_size, base, rounds, per_round, work, budget, memory_aware,
                blocked,
            )
        searched.append((method, base, best, kept))
        _common.tick(progress, PLANNER, f"{method}: {len(kept)} split(s)")
    if split and 1 < tables.n_dev <= batch_size:
        # Data parallelism is a split of every layer over every device. On large
        # clusters the greedy split search can stop at its work limit far from it
        # (ResNet50 on 96 GPUs: 8.6 s against 0.17 s), so it is a candidate too,
        # twice: with shares balancing the cost model's per-sample times, and with
        # the proportional baseline's (so FastT is never predicted slower than it).
        # Only where the baseline fits: a full replica per device is what a model
        # too large for the devices cannot have.
        try:
            dp = baselines.proportional(graph, cluster, batch_size, devices=names)
        except PlanError:
            dp = None  # the batch does not fit in the devices' memory
        if dp is not None:
            devices = list(range(tables.n_dev))
            seeds = []
            share = {r.device: r.batch_share for r in dp.replicas}
            for reps in (list(zip(devices, tables.speed_shares(devices, batch_size))),
                         [(d, share[tables.devices[d]]) for d in devices
                          if share.get(tables.devices[d], 0) > 0]):
                seeds.append(list_schedule(tables, batch_size, methods[0],
                                           {i: reps for i in range(len(tables.layers))},
                                           memory_aware))
            searched.append((DP_SEED, seeds[0], seeds[1],
                             [f"every layer over all {tables.n_dev} devices"]))

    # Score the candidates with the simulator: every schedule whose makespan
    # is within PROXY_SCORE_RANGE of the best one, best schedules first, and
    # the data-parallel seed with the proportional baseline's shares whatever
    # its schedule says. The schedules count memory against MEMORY_MARGIN of
    # each device and approximate the gradient buffers, so they can call that
    # seed over memory where the simulator, which made its shares fit, does
    # not; skipping it then returned placements up to 18x slower than the
    # baseline (ResNet152, 16 mixed GPUs: 9.8 s against 0.53 s, predicted).
    record = {
        "methods": list(methods), "split": split, "max_split_rounds": rounds,
        "split_candidates": per_round, "max_work": max_work, "memory_aware": memory_aware,
        "bucket_bytes": bucket_bytes,
    }
    pool, seen = [], set()
    for method, base, best, kept in searched:
        for sched, splits in ((best, kept), (base, [])):
            key = tuple(tuple(r) for r in sched.replicas)
            if key not in seen:
                seen.add(key)
                pool.append((sched.score(), len(pool), method, splits, sched))
    pool.sort(key=lambda x: x[:2])
    top = pool[0][4]
    baseline_seed = next(
        (tuple(tuple(r) for r in best.replicas)
         for method, _, best, _ in searched if method == DP_SEED), None)
    scored = []
    for _, _, method, splits, sched in pool:
        if scored and tuple(tuple(r) for r in sched.replicas) != baseline_seed and (
            sched.score()[:2] != top.score()[:2]
            or sched.makespan > PROXY_SCORE_RANGE * top.makespan
            or budget.exhausted()
        ):
            continue
        candidate = _plan_from_schedule(graph, coarse, sched, batch_size, bucket_bytes, record)
        result = simulate(graph, cluster, candidate, cost_model=cost, validate=False)
        scored.append(
            ((not result.feasible, result.step_time_s, len(scored)), candidate, result,
             method, splits, sched)
        )
    scored.sort(key=lambda x: x[0])
    _, chosen, result, label, splits, sched = scored[0]
    _common.tick(progress, PLANNER, "scored")

    by_method = {}
    for _, _, res, lab, _, _ in scored:
        if lab not in by_method or res.step_time_s < by_method[lab]:
            by_method[lab] = res.step_time_s
    simulated_keys = {tuple(tuple(r) for r in x[5].replicas): x[3] for x in scored}
    parts = []
    for method, base, best, _ in searched:
        if method in by_method:
            parts.append(f"{method.upper()} {_common.ms(by_method[method])} simulated")
            continue
        twin = simulated_keys.get(tuple(tuple(r) for r in best.replicas))
        if twin is not None:
            parts.append(f"{method.upper()} found the same placement as {twin.upper()}")
        else:
            parts.append(
                f"{method.upper()} {_common.ms(min(base.makespan, best.makespan))} scheduled, "
                "not simulated (slower schedule)"
            )
    notes.append("List schedules: " + "; ".join(parts) + f"; kept {label.upper()}.")
    if label == DP_SEED:
        notes.append(
            "Kept the data-parallel seed (every layer split over all devices by speed): "
            "no placement or split the search found was predicted faster."
        )
    used = chosen.devices
    if splits and label != DP_SEED:
        notes.append(
            f"Split {len(splits)} time(s) along the batch axis: "
            + "; ".join(splits[:6]) + ("; ..." if len(splits) > 6 else "") + "."
        )
    elif split and tables.n_dev > 1 and label != DP_SEED:
        notes.append("No op split shortened the schedule; the plan is a pure placement.")
    single = [g for g in chosen.groups if len(g.replicas) == 1]
    if len({g.replicas[0].device for g in single}) > 1:
        notes.append(
            f"Layers placed on {len({g.replicas[0].device for g in single})} devices "
            "(model parallelism)."
        )
    fits_one = any(
        sum(tables.static) + sum(tables.act) * batch_size <= cap for cap in tables.capacity
    )
    if not fits_one:
        notes.append(
            f"The model does not fit on one device at batch {batch_size} (predicted); "
            f"placed across {len(used)} device(s)."
        )
    notes.extend(_common.result_notes(result, budget))
    if not budget.hit and any(w.hit for w in works):
        notes.append("The split search stopped at its work limit (max_work).")
    figures = {}
    if options.get("baselines") is None and budget.exhausted():
        notes.append("Not compared with the baselines: the planning budget is spent.")
    elif options.get("compare_baselines", True) and tables.n_dev > 1:
        figures = _common.baseline_results(
            graph, cluster, batch_size, names, cost,
            ("data_parallel_even", "proportional"), options.get("baselines"),
        )
        notes.append(_common.comparison_note(result.step_time_s, figures))
    _common.finish(chosen, graph, cluster, cost, started, result)
    chosen.prediction.baselines = figures
    chosen.notes = notes
    chosen.provenance.options = dict(record, chosen=label, splits=list(splits))
    chosen.provenance.planning_time_s = time.perf_counter() - started
    _common.tick(progress, PLANNER, "done")
    return chosen


class _Work:
    """Deterministic work counter, in estimated microseconds of scheduling.

    A schedule costs about 18 us per task plus 2.5 us per (free layer,
    device) pair examined for its earliest finish time (measured with
    `time.process_time` on one core of the development machine). Counting
    this instead of wall time keeps the search, and so the plan, the same on
    every run and machine.
    """

    def __init__(self, limit):
        self.limit = limit
        self.done = 0.0
        self.hit = False

    def add(self, schedule):
        free = sum(1 for r in schedule.replicas if len(r) == 1)
        self.done += 18.0 * len(schedule.task_meta) + 2.5 * free * schedule.tables.n_dev

    def exhausted(self):
        if self.done >= self.limit:
            self.hit = True
        return self.hit


def _int_option(options, name, default, minimum):
    return _common.int_option(PLANNER, name, options.get(name, default), minimum)


def _split_sizes(n_dev, batch):
    sizes, m = [], 2
    while m < n_dev:
        sizes.append(m)
        m *= 2
    sizes.append(n_dev)
    return [m for m in sizes if m <= batch]


def _segment(schedule, layer):
    """The run of consecutive layers sharing `layer`'s replicas."""
    reps = schedule.replicas
    key = reps[layer]
    lo = layer
    while lo > 0 and reps[lo - 1] == key:
        lo -= 1
    hi = layer
    while hi + 1 < len(reps) and reps[hi + 1] == key:
        hi += 1
    return list(range(lo, hi + 1))


def _colocated(schedule, layer):
    """Every layer with exactly `layer`'s replicas (same devices, same shares)."""
    key = schedule.replicas[layer]
    return [i for i, reps in enumerate(schedule.replicas) if reps == key]


def _layer_cost(tables, schedule, layer):
    return max(tables.layer_total(layer, d, s) for d, s in schedule.replicas[layer])


def _split_search(tables, batch, schedule, rounds, per_round, work, budget, memory_aware,
                  blocked=frozenset()):
    """Greedy op splitting on the critical path; returns (schedule, descriptions).

    Each round walks the critical path's layers, costliest first. For a layer
    it tries every layer sharing its devices, its run of consecutive
    co-located layers, the layer alone, and every layer not split yet, each
    split over n, ..., 4, 2 of the fastest devices with room (a region's
    sweep stops at the first size worse than its best). The best candidate
    of the first layer that has an improving one is kept, then a new round
    starts. Units in `blocked` (indices holding a layer that cannot be split,
    `_common.unsplittable_layers`) are left out of every region.
    """
    fixed = {}
    current = schedule
    kept = []
    sizes = _split_sizes(tables.n_dev, batch)
    tried = set()
    for _ in range(rounds):
        critical = [i for i in current.critical_layers if _layer_cost(tables, current, i) > 0]
        critical.sort(key=lambda i: (-_layer_cost(tables, current, i), i))
        best = None
        for layer in critical[:per_round]:
            regions = []
            rest = [i for i, reps in enumerate(current.replicas) if len(reps) == 1]
            for region in (_colocated(current, layer), _segment(current, layer), [layer],
                           rest if layer in rest else []):
                region = [i for i in region if i not in blocked]
                if region and region not in regions:
                    regions.append(region)
            now = len(current.replicas[layer])
            for region in regions:
                inside = set(region)
                static = sum(tables.static[i] for i in region)
                per_sample = sum(
                    tables.act[i] + sum(b for p, b in tables.preds[i] if p not in inside)
                    for i in region
                )
                reserved = [0] * tables.n_dev
                for j, reps in fixed.items():
                    if j not in inside:
                        for d, share in reps:
                            reserved[d] += tables.static[j] + tables.act[j] * share
                free = [tables.capacity[d] - reserved[d] - static for d in range(tables.n_dev)]
                room = [d for d in range(tables.n_dev) if free[d] >= per_sample]
                region_best = None
                for m in reversed(sizes):
                    if m <= now or len(room) < m:
                        continue
                    devs = sorted(tables.speed_order(batch // m, None, room)[:m])
                    caps = [free[d] // max(per_sample, 1) for d in devs]
                    shares = tables.speed_shares(devs, batch, caps=caps)
                    if shares is None:
                        continue
                    reps = list(zip(devs, shares))
                    key = (tuple(region), tuple(reps))
                    if key in tried:
                        continue
                    tried.add(key)
                    trial = dict(fixed)
                    for i in region:
                        trial[i] = reps
                    sched = list_schedule(tables, batch, current.method, trial, memory_aware)
                    work.add(sched)
                    if _better(sched, region_best or current):
                        region_best = sched
                        if _better(sched, best[0] if best is not None else current):
                            best = (sched, trial, region, m)
                    elif region_best is not None:
                        break  # sizes past the best one only get worse
                    if work.exhausted() or budget.exhausted(reserve=_reserve(budget)):
                        break
                if work.hit or budget.hit:
                    break
            if best is not None or work.hit or budget.hit:
                break
        if best is None:
            break
        sched, fixed, region, m = best
        first, last = tables.layers[region[0]], tables.layers[region[-1]]
        what = first if len(region) == 1 else f"{len(region)} units {first} .. {last}"
        kept.append(
            f"{what} over {m} devices ({_common.ms(current.makespan)} -> "
            f"{_common.ms(sched.makespan)} scheduled)"
        )
        current = sched
        if work.hit or budget.hit:
            break
    return current, kept


def _reserve(budget):
    # Leave a third of the budget for simulating the final candidates.
    return budget.seconds / 3.0


def _better(new, old):
    if new.overflow != old.overflow:
        return new.overflow < old.overflow
    return new.makespan < old.makespan * (1.0 - MIN_GAIN)


def _plan_from_schedule(graph, coarse, schedule, batch, bucket_bytes, record):
    placement = coarse.expand(schedule.placement())
    order = coarse.expand_order(schedule.device_order())
    return _common.placement_plan(
        graph, placement, batch, PLANNER, order=order, bucket_bytes=bucket_bytes,
        options=record,
    )


def _units(graph, cluster, cost, names, batch):
    """Fuses linear chains of layers into scheduling units (see `_coarse`)."""
    total = sum(n.forward_flops + n.backward_flops for n in graph.nodes.values())
    smallest = min(usable_memory_bytes(cluster.device(d)) for d in names)
    slots = optimizer_slots_of(graph)
    units = chain_partition(
        graph,
        cost_of=lambda n: n.forward_flops + n.backward_flops,
        max_cost=max(total / UNITS_PER_MODEL, 1.0),
        max_bytes=smallest / 8.0,
        bytes_of=lambda n: static_bytes(n, slots) + n.activation_bytes * batch,
    )
    return CoarseGraph(graph, units)
