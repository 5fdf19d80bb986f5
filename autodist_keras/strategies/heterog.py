"""HeteroG: per-group replication, batch shares and gradient sync, by search.

After HeteroG (Yi et al., CoNEXT 2020). The model's layers are cut into `k`
groups of consecutive layers with about equal compute (HeteroG groups ops
around the costliest ones). Each group gets a strategy: the devices that
replicate it (all of them, one node's, the fastest ones, the ones with the
most memory, or a single device) and how its gradients are synchronised
(ring or hierarchical all-reduce, or a parameter server on a chosen device).
Several replicas of a group on one device in HeteroG's encoding are a larger
batch share here, so uneven shares on mixed GPUs fall out of the search.

- Batch shares: a linear program (`scipy.optimize.linprog`, HiGHS) over all
  groups at once minimises the slowest device's compute time. Each device's
  time for a group is the group's summed layer times, a convex piecewise-linear
  function of its share (sampled on a grid of batch sizes); constraints: the
  shares of a replica set add up to the batch, every replica gets a sample,
  and parameters, gradients, optimizer slots and activations fit in each
  device's memory. Groups with the same replica set share their shares (no
  activation traffic between them). The LP's shares are rounded to whole
  samples.
- Strategies: local search over groups (costliest gradients first), scored
  by the simulator on a coarse graph whose nodes are the groups (same
  semantics, a fraction of the tasks), seeded with the even and proportional
  data-parallel baselines and their hierarchical and parameter-server variants,
  the whole batch on one device, and with the LP-balanced data-parallel plan.
- Execution order: HEFT upward rank.
- The final plan and every seed are scored by `estimator.simulate` on the
  real graph; the result is never predicted slower than its seeds (when a
  seed wins, it is returned under the heterog name and a note says so).

Example:

```python
from autodist_keras.strategies import heterog

plan = heterog.plan(graph, Cluster.resolve("hetero_testbed"), 256)
print(plan.summary())
```
"""

import math
import time

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_matrix

from autodist_keras.errors import PlanError
from autodist_keras.errors import StrategyError
from autodist_keras.strategies import _common
from autodist_keras.strategies import baselines
from autodist_keras.strategies._coarse import CoarseCostModel
from autodist_keras.strategies._coarse import CoarseGraph
from autodist_keras.strategies._coarse import contiguous_partition
from autodist_keras.strategies._listsched import CostTables
from autodist_keras.strategies._listsched import rank_order
from autodist_keras.strategies._listsched import resolve_cost_model
from autodist_keras.strategies._listsched import static_bytes
from autodist_keras.strategies.plan import Plan
from autodist_keras.strategies.plan import Provenance
from autodist_keras.strategies.plan import SyncSpec
from autodist_keras.strategies.plan import split_batch

PLANNER = "heterog"
DEFAULT_BUDGET_S = 4.0
DEFAULT_MAX_WORK = 1.5e6  # estimated microseconds of search (LPs and coarse simulations)
LP_COST_US = 8500.0  # one share LP, measured (process time) on the development machine
SIM_TASK_COST_US = 45.0  # one simulated task of a coarse plan, same
MAX_HEAVY_GROUPS = 6  # groups whose replica sets are searched (largest gradients)
MIN_GAIN = 0.002  # a move must shorten the coarse step by at least 0.2%
SPREAD = -1  # PS "server" meaning: gradients spread over one server per node of the set
COMM_HEAVY_SHARE = 0.02  # a layer with >= 2% of the gradient bytes ...
MAX_ISOLATED = 4  # ... whose all-reduce outlasts its compute gets its own group (at most 4)
OPTION_NAMES = (
    "groups",  # number of layer groups k (default: 8-16 by model size)
    "max_work",  # deterministic search cap, estimated microseconds (1.5e6)
    "passes",  # local-search passes over the groups (default 2)
    "seeds",  # include the baseline seeds (default True)
    "bucket_bytes",  # gradient bucket threshold (default 25 MiB)
    "baselines",  # dict name -> known baseline step time (s); only for notes
    "isolate",  # give comm-heavy layers groups of their own (default True)
)


def plan(graph, cluster, batch_size, cost_model=None, devices=None, time_budget_s=None,
         progress=None, **options):
    """Plans per-group replication, batch shares and gradient sync with HeteroG.

    Args:
        graph: The `ModelGraph`.
        cluster: The `Cluster`.
        batch_size: Global batch size.
        cost_model: A `CostModel` (default `AnalyticCostModel(cluster)`).
        devices: Device names to use (default: all).
        time_budget_s: Safety stop in seconds (default 4); the search is
            otherwise bounded by `max_work`, so results are deterministic
            unless the budget is hit (a note then says so).
        progress: Optional tqdm instance, advanced once per search stage.
        **options: `groups`, `max_work`, `passes`, `seeds`, `bucket_bytes`,
            `baselines` (see `OPTION_NAMES`).

    Returns:
        A validated `Plan` with `provenance.planner == "heterog"` and the
        simulator's prediction.

    Raises:
        StrategyError: For unknown or invalid options.
        PlanError: For an invalid batch size or unknown devices.

    Example:

    ```python
    plan = heterog.plan(graph, cluster, 256, groups=12)
    print(plan.notes)
    ```
    """
    from autodist_keras.estimator import simulate

    started = time.perf_counter()
    names = _common.check_request(
        PLANNER, graph, cluster, batch_size, devices, options, OPTION_NAMES
    )
    # (Checked first: a budget of "4" or -1 split over two device sets below was a
    # TypeError, or named half the value given.)
    budget = _common.Budget(time_budget_s, DEFAULT_BUDGET_S, started)
    cost = resolve_cost_model(cluster, cost_model)
    restricted = None
    if batch_size < len(names):
        restricted = len(names)
        times = _one_sample_times(graph, cluster, cost, names)
        fastest = _fastest(cluster, names, batch_size, times)
        holding = _fastest(cluster, names, batch_size, times, graph=graph)
        if holding != fastest:
            return _best_device_set(graph, cluster, batch_size, cost, (fastest, holding),
                                    budget.seconds, progress, options, restricted, started)
        names = fastest
    k = options.get("groups")
    if k is None:
        k = int(min(16, max(8, round(math.sqrt(len(graph.nodes))))))
    _common.int_option(PLANNER, "groups", k, 1)
    max_work = options.get("max_work", DEFAULT_MAX_WORK)
    if not isinstance(max_work, (int, float)) or isinstance(max_work, bool) or max_work < 0:
        raise StrategyError(
            f"heterog: option max_work must be a non-negative number. Received: {max_work!r}"
        )
    passes = options.get("passes", 2)
    _common.int_option(PLANNER, "passes", passes, 0)
    use_seeds = bool(options.get("seeds", True))
    isolate = bool(options.get("isolate", True))
    bucket_bytes = options.get("bucket_bytes", baselines.DDP_BUCKET_BYTES)
    record = {"groups": k, "max_work": max_work, "passes": passes, "seeds": use_seeds,
              "bucket_bytes": bucket_bytes, "isolate": isolate}

    space = _Space(graph, cluster, cost, names, batch_size, k, bucket_bytes, isolate)
    _common.tick(progress, PLANNER, f"{len(space.chunks)} groups")
    notes = []
    if restricted is not None:
        notes.append(
            f"The batch ({batch_size}) is smaller than the number of devices ({restricted}); "
            f"planned over the {len(names)} fastest at one sample (the predicted step of a "
            "replica with one sample), one sample each at least."
        )
    if graph.data_parallel_only:
        notes.append(
            "The model has no functional graph (subclassed); it is one group, so the "
            "search chooses devices, shares and sync for the whole model."
        )

    # Seeds: the baselines, simulated on the real graph.
    seeds, skipped, per_sim = [], [], 0.0
    if use_seeds:
        seeds, skipped, per_sim = _seeds(
            graph, cluster, cost, names, batch_size, bucket_bytes, budget,
            single=_single_device(space, graph, cluster, batch_size),
        )
    if skipped:
        notes.append(
            f"Seeds {skipped} were not simulated: the planning budget ran short, so the "
            "plan is only guaranteed no slower than the simulated seeds."
        )
    _common.tick(progress, PLANNER, f"{len(seeds)} seeds")

    # Local search over group strategies, scored on the coarse graph. Leave
    # time to simulate the result on the real graph.
    reserve = 1.5 * per_sim if seeds else budget.seconds / 4
    state, score, log = space.search(max_work, passes, budget, reserve)
    _common.tick(progress, PLANNER, f"{space.evals} evaluations")
    found = found_shares = None
    if state is not None:
        found_shares = space.solve_shares(state)
        found = space.fine_plan(state, record, found_shares)
        found_result = simulate(graph, cluster, found, cost_model=cost, validate=False)
        balanced_shares = space.balance_shares(state)
        if balanced_shares is not None:
            # Same predicted step (within 0.1%), other devices balanced: keep it.
            balanced = space.fine_plan(state, record, balanced_shares)
            balanced_result = simulate(graph, cluster, balanced, cost_model=cost, validate=False)
            if balanced_result.step_time_s <= found_result.step_time_s * 1.001:
                found, found_result, found_shares = balanced, balanced_result, balanced_shares
        found = (found, found_result)

    candidates = []
    if found is not None:
        candidates.append(("search", found[0], found[1]))
    candidates += [(name, p, r) for name, p, r in seeds]
    if not candidates:
        raise PlanError(
            "heterog found no plan: no group strategy fits the devices' memory and no "
            f"baseline could be built. Use more devices or a smaller batch. "
            f"Received: batch_size={batch_size}, devices={names}"
        )
    ranked = sorted(
        enumerate(candidates), key=lambda x: (not x[1][2].feasible, x[1][2].step_time_s, x[0])
    )
    _, (label, chosen, result) = ranked[0]

    if label == "search":
        notes.extend(space.describe(state, found_shares))
    else:
        chosen = _as_heterog(chosen, record)
        if result.feasible:
            notes.append(
                f"The best candidate was the seed {label!r}: no group strategy found by the "
                "search was predicted faster."
            )
        else:
            notes.append(
                f"No plan found fits in memory (predicted); the seed {label!r} is shown, and "
                f"it does not fit either ({result.infeasible_reason}). HeteroG places "
                f"{len(space.units)} layer groups of about equal compute, whole or replicated, "
                "and none of its memory-aware arrangements fit these devices; "
                "strategy='fastt' places single layers, a smaller batch needs less memory."
            )
    figures = {name: {"step_time_s": r.step_time_s, "feasible": r.feasible}
               for name, _, r in seeds}
    for name, value in (options.get("baselines") or {}).items():
        step = getattr(value, "step_time_s", value)
        figures.setdefault(name, {"step_time_s": float(step),
                                  "feasible": bool(getattr(value, "feasible", True))})
    if found is not None:
        figures["heterog_search"] = {"step_time_s": found[1].step_time_s,
                                     "feasible": found[1].feasible}
    best_seed = min((r.step_time_s for _, _, r in seeds if r.feasible), default=None)
    if best_seed is not None and label == "search":
        notes.append(
            f"Search result {_common.ms(result.step_time_s)} (simulated) vs best seed "
            f"{_common.ms(best_seed)} ({best_seed / result.step_time_s:.2f}x)."
        )
    compare = {n: f for n, f in figures.items() if n in ("data_parallel_even", "proportional")}
    if compare:
        notes.append(_common.comparison_note(result.step_time_s, compare))
    notes.extend(_common.result_notes(result, budget))
    _common.finish(chosen, graph, cluster, cost, started, result)
    chosen.prediction.baselines = figures
    chosen.notes = notes
    chosen.provenance.options = dict(record, chosen=label, evaluations=space.evals,
                                     pruned_by_lp_bound=space.pruned,
                                     isolated_layers=list(space.isolated),
                                     search_work_us=round(space.work),
                                     search_log=log[:40])
    chosen.provenance.planning_time_s = time.perf_counter() - started
    _common.tick(progress, PLANNER, "done")
    return chosen


def _lp_key(state):
    """The LP depends on each group's replica set and, for a parameter server, on
    where the aggregation runs, not on the all-reduce algorithm."""
    return tuple((c, sync if sync[0] == "ps" else None) for c, sync in state)


def _one_sample_times(graph, cluster, cost, names):
    """Seconds of one training step of a whole replica with one sample, per device.

    The cost model's forward and backward of every layer at a batch of one,
    the optimizer update of all the parameters and the step's fixed host
    time: what a device costs in a plan that gives it one sample, as when
    the batch is smaller than the device count. Until session 31 HeteroG
    ranked the devices there by peak FP32 FLOP/s, which a memory-bound
    model does not follow (at batch 1 a 4096-wide MLP on an L4, an A100 and
    a P100 got the L4, 30.3 peak TFLOP/s and 300 GB/s: 6.10 ms against
    1.27 ms on the A100, 19.5 TFLOP/s and 1.5 TB/s; predicted).

    Args:
        graph: The `ModelGraph`.
        cluster: The `Cluster`.
        cost: A cost model bound to `cluster`.
        names: Device names.

    Returns:
        A dict from device name to seconds (predicted).

    Example:

    ```python
    times = _one_sample_times(graph, cluster, AnalyticCostModel(cluster), cluster.names)
    ```
    """
    tables = CostTables(graph, cluster, cost, names)
    nbytes, ntensors = sum(tables.param_bytes), sum(tables.n_tensors)
    return {d: tables.per_sample_time(i, 1) + tables.update(i, nbytes, ntensors)
            + tables.step_overhead(i) for i, d in enumerate(names)}


def _fastest(cluster, names, batch_size, times, graph=None):
    """The devices HeteroG plans over when the batch is smaller than the device count.

    The fastest with one sample each (`times`, from `_one_sample_times`:
    the cost model's step of a replica with one sample); among equally fast
    devices the best connected (their node's NIC bandwidth, then latency:
    `_common.ranked_devices`, as Disco ranks them), then the earlier in
    `names`. With `graph`, the devices that hold a whole replica of it with
    one sample (predicted, `baselines.memory_capacity_samples`) come first.

    Args:
        cluster: The `Cluster`.
        names: The device names asked for.
        batch_size: The global batch size (fewer than `len(names)`).
        times: Dict from device name to the seconds of a replica's step
            with one sample (`_one_sample_times`).
        graph: The `ModelGraph`, to rank the devices that hold it first
            (default None: by speed alone).

    Returns:
        `batch_size` device names, in `names` order.

    Example:

    ```python
    times = _one_sample_times(graph, cluster, cost, cluster.names)
    names = _fastest(cluster, cluster.names, 1, times, graph=graph)  # one that fits, if any
    ```
    """
    ranked = _common.ranked_devices(names, cluster, {d: 1.0 / times[d] for d in names})
    if graph is not None:  # (a stable sort: the ranking holds within each part)
        ranked.sort(key=lambda d: baselines.memory_capacity_samples(graph, cluster, d) < 1)
    keep = ranked[:batch_size]
    return [d for d in names if d in keep]


def _best_device_set(graph, cluster, batch_size, cost_model, sets, time_budget_s, progress,
                     options, restricted, started):
    """Plans over each device set and returns the fastest feasible plan (predicted).

    Used when the batch is smaller than the device count and the fastest
    devices are not the fastest that hold a replica: either set can give the
    faster plan (a placement over small devices, or a replica on one that
    holds it), so both are planned, each with half the time budget, and the
    simulator decides. Until session 30 only the fastest were planned, so
    where one of two equally fast devices could not hold the model the order
    of the devices in the cluster decided whether the plan fit.

    Args:
        graph: The `ModelGraph`.
        cluster: The `Cluster`.
        batch_size: The global batch size.
        cost_model: The cost model, bound to `cluster`.
        sets: Device name lists, `batch_size` devices each.
        time_budget_s: The caller's budget in seconds (checked, the default
            filled in), shared by the sets.
        progress: Optional tqdm bar.
        options: The planner options.
        restricted: How many devices were asked for.
        started: `time.perf_counter()` when planning began.

    Returns:
        The chosen `Plan`, with a note naming both sets and their predictions.
    """
    seconds = time_budget_s / len(sets)
    plans, failures = [], []
    for names in sets:
        try:
            plans.append(plan(graph, cluster, batch_size, cost_model=cost_model,
                              devices=list(names), time_budget_s=seconds, progress=progress,
                              **options))
        except PlanError as e:  # no plan on this set: the other may have one
            plans.append(None)
            failures.append(e)
    if len(failures) == len(sets):
        raise failures[0]
    ranked = sorted((i for i, p in enumerate(plans) if p is not None), key=lambda i: (
        not plans[i].prediction.feasible, plans[i].prediction.step_time_s, i))
    chosen = plans[ranked[0]]

    def figure(p):
        if p is None:
            return "no plan"
        fits = "" if p.prediction.feasible else ", predicted not to fit"
        return f"{_common.ms(p.prediction.step_time_s)}{fits}"

    fastest, holding = plans
    chosen.notes.insert(0, (
        f"The batch ({batch_size}) is smaller than the number of devices ({restricted}); "
        f"planned over the {batch_size} fastest {list(sets[0])} ({figure(fastest)}) and over "
        f"the {batch_size} fastest that hold the model with one sample {list(sets[1])} "
        f"({figure(holding)}); kept the {'first' if chosen is fastest else 'second'}."))
    chosen.provenance.options = dict(chosen.provenance.options,
                                     device_sets=[list(s) for s in sets])
    chosen.provenance.planning_time_s = time.perf_counter() - started
    return chosen


def _as_heterog(plan, record):
    plan.provenance = Provenance(planner=PLANNER, options=dict(record))
    return plan


def _single_device(space, graph, cluster, batch_size):
    """The device that runs the whole batch alone fastest, for the single-device seed.

    Among the devices that hold the model at the whole batch (predicted,
    `baselines.memory_capacity_samples`; all of them when none does), the
    one whose forward and backward per sample at the batch are fastest
    (cost model), then the one with the most room, then the first.

    Args:
        space: The `_Space` (its per-layer cost tables).
        graph: The `ModelGraph`.
        cluster: The `Cluster`.
        batch_size: The global batch size.

    Returns:
        A device name.
    """
    tables = space.fine_tables
    room = {d: baselines.memory_capacity_samples(graph, cluster, d) for d in space.names}
    fits = [d for d in space.names if room[d] >= batch_size] or list(space.names)
    return min(fits, key=lambda d: (tables.per_sample_time(space.names.index(d), batch_size),
                                    -room[d], space.names.index(d)))


def _seeds(graph, cluster, cost, names, batch_size, bucket_bytes, budget, single=None):
    """The baseline plans HeteroG starts from, simulated on the real graph.

    The first seed that can be built is always simulated; the others only
    while the seeds have used less than half of the budget (counting one
    more simulation for the final plan). `single` (a device name) adds the
    whole batch on that device, last.

    Returns:
        `(seeds, skipped, seconds per simulation)`, seeds as
        `(name, plan, SimResult)`.
    """
    from autodist_keras.estimator import simulate

    nodes = {cluster.device(d).node for d in names}
    speeds = baselines.device_speeds(cluster, names)
    fastest = max(names, key=lambda d: (speeds[d], -names.index(d)))
    specs = [("proportional", baselines.proportional, {})]
    if len(nodes) > 1:
        specs.append(("proportional_hierarchical", baselines.proportional,
                      {"algorithm": "hierarchical"}))
    specs += [
        ("data_parallel_even", baselines.data_parallel_even, {}),
        ("proportional_ps", baselines.proportional, {"sync": "ps", "ps_server": fastest}),
    ]
    if single is not None:
        # Every group on one device: in the search space, but not reachable by moves
        # of one group at a time from a start on two or more devices.
        specs.append(("single_device", baselines.single_device, {"device": single}))
    out, skipped, times = [], [], []
    for name, builder, kwargs in specs:
        if times:
            per = sum(times) / len(times)
            if budget.elapsed() + 2 * per > budget.seconds / 2:
                budget.hit = True
                skipped.append(name)
                continue
        try:
            p = builder(graph, cluster, batch_size, devices=names, bucket_bytes=bucket_bytes,
                        **kwargs)
        except PlanError:
            continue
        started = time.perf_counter()
        out.append((name, p, simulate(graph, cluster, p, cost_model=cost, validate=False)))
        times.append(time.perf_counter() - started)
    return out, skipped, (sum(times) / len(times) if times else 0.0)


class _Space:
    """The search space: groups, replica sets, sync options, LP and evaluation."""

    def __init__(self, graph, cluster, cost, names, batch, k, bucket_bytes, isolate=True):
        self.graph, self.cluster, self.cost = graph, cluster, cost
        self.names = list(names)
        self.batch = batch
        self.evals = 0
        self.n = len(names)
        fine_tables = CostTables(graph, cluster, cost, names)
        fastest = fine_tables.speed_order(max(batch // self.n, 1))[0]
        per = max(batch // self.n, 1)
        layer_cost = {
            name: fine_tables.layer_total(i, fastest, per)
            for i, name in enumerate(fine_tables.layers)
        }
        self.isolated = self._comm_heavy(fine_tables, layer_cost) if isolate else []
        # Isolated layers count towards k (the search cost grows with the groups).
        self.chunks = contiguous_partition(
            graph, max(k - len(self.isolated), 1), lambda node: layer_cost[node.name],
            isolate=self.isolated,
        )
        self.coarse = CoarseGraph(graph, self.chunks)
        self.grid = _common.batch_grid(batch)
        self.ccost = CoarseCostModel(cost, self.coarse, grid=self.grid)
        self.tables = CostTables(self.coarse.graph, cluster, self.ccost, names,
                                 buffer_bytes=_common.unit_buffer_bytes(graph, self.coarse))
        self.fine_tables = fine_tables
        self.units = list(self.coarse.graph.nodes)
        self.buckets = baselines.gradient_buckets(graph, bucket_bytes)
        t = self.tables
        self.static = [static_bytes(self.coarse.graph.nodes[u], t.optimizer_slots)
                       for u in self.units]
        incoming = [0] * len(self.units)
        for i, preds in enumerate(t.preds):
            incoming[i] = sum(b for _, b in preds)
        self.act = [t.act[i] + incoming[i] for i in range(len(self.units))]
        self.buffer = list(t.buffer)  # backward gradient buffer per sample
        self.grad_bytes = [t.param_bytes[i] for i in range(len(self.units))]
        self.capacity = list(t.capacity)  # MEMORY_MARGIN of each device's usable memory
        # Time of each unit on each device class, sampled on the grid.
        self.f = {}
        for i, unit in enumerate(self.units):
            for c in range(t.n_class):
                d = t.class_rep[c]
                self.f[(i, c)] = np.array([
                    self.ccost.unit_time(unit, t.dev[d], s, "forward")
                    + self.ccost.unit_time(unit, t.dev[d], s, "backward")
                    for s in self.grid
                ])
        # Groups holding a layer that must not be split by rows (trainable
        # BatchNormalization, stateful layers): `runnable` keeps them whole.
        self.blocked = _common.unsplittable_units(graph, self.coarse, self.units)
        self._sets()
        self._cache = {}
        self._pruned = {}
        self._lp_cache = {}
        self.pruned = 0
        self.lp_bound = 0.0
        self._spread_cache = {}
        self._piece_cache = {}
        self._grid_array = np.array(self.grid, dtype=float)
        self.work = 0.0

    # ----------------------------------------------------------- the space
    def _comm_heavy(self, tables, layer_cost):
        """Layers whose gradient all-reduce over all devices outlasts their compute.

        HeteroG groups ops around the costliest ones; a layer with a large
        gradient and little compute (VGG's FC layers, embeddings) is costly
        in communication, and the best strategy for it (one device, one
        node, a PS) differs from its neighbours'. Such layers (at least
        `COMM_HEAVY_SHARE` of the gradient bytes, ring all-reduce over all
        devices longer than forward + backward on the fastest device at an
        even share; at most `MAX_ISOLATED`, largest first) get a group of
        their own.
        """
        total = sum(tables.param_bytes) or 1
        everyone = list(range(self.n))
        found = []
        for i, name in enumerate(tables.layers):
            nbytes = tables.param_bytes[i]
            if self.n < 2 or nbytes < COMM_HEAVY_SHARE * total:
                continue
            if tables.allreduce(nbytes, everyone, "ring") > layer_cost[name]:
                found.append((-nbytes, i, name))
        return [name for _, _, name in sorted(found)[:MAX_ISOLATED]]

    def _sets(self):
        t = self.tables
        n = self.n
        order = t.speed_order(max(self.batch // n, 1))
        sets = [tuple(range(n))]
        nodes = {}
        for d in range(n):
            nodes.setdefault(t.dev_node[d], []).append(d)
        if len(nodes) > 1:
            sets += [tuple(v) for v in nodes.values()]
        for m in sorted({1, max(n // 2, 1)}):
            sets.append(tuple(sorted(order[:m])))
        # All but the slowest device types (a straggler type leaves the set).
        types = []
        for d in order:  # fastest first
            model = t.dev[d].model
            if model not in types:
                types.append(model)
        for j in range(1, len(types)):
            kept = tuple(sorted(d for d in range(n) if t.dev[d].model in types[:-j]))
            if len(kept) >= 2:
                sets.append(kept)
        if len(nodes) > 2:
            # Devices of the best-connected nodes: partial replication that
            # drops the badly connected ones. A node's reach is its best link
            # to another node (its worst is the slowest NIC of the cluster for
            # every node alike, since a link runs at the slower end's speed).
            probe = float(2**26)
            heads = {k: v[0] for k, v in nodes.items()}
            reach = {
                k: min(t.transfer(h, o, probe) for j, o in heads.items() if j != k)
                for k, h in heads.items()
            }
            best = min(reach.values())
            well = [d for d in range(n) if reach[t.dev_node[d]] <= best * 1.01]
            if len(well) < n:
                sets.append(tuple(well))
        by_memory = sorted(range(n), key=lambda d: (-t.capacity[d], order.index(d)))
        big = [d for d in by_memory if t.capacity[d] >= t.capacity[by_memory[0]] * 0.999]
        if len(big) < n:
            sets.append(tuple(sorted(big)))
        self.sets = []
        for s in sets:
            if s not in self.sets and len(s) <= self.batch:
                self.sets.append(s)
        self.fastest = order[0]
        self.speed_rank = {d: order.index(d) for d in range(n)}

    def sync_options(self, set_id):
        members = self.sets[set_id]
        if len(members) == 1:
            return [("ring", None)]
        t = self.tables
        opts = [("ring", None)]
        if len({t.dev_node[d] for d in members}) > 1:
            opts.append(("hierarchical", None))
        fastest = min(members, key=lambda d: self.speed_rank[d])
        roomy = max(members, key=lambda d: (t.capacity[d], -self.speed_rank[d]))
        for server in dict.fromkeys([fastest, roomy]):
            opts.append(("ps", server))
        if len({t.dev_node[d] for d in members}) > 1:
            opts.append(("ps", SPREAD))
        return opts

    def spread(self, i, set_id):
        """Per-variable PS servers of group `i` on a set: one server per node.

        Each node of the set contributes its fastest member as a server;
        variables (largest first) go to the server whose NIC would finish
        its share soonest (assigned bytes / the node's outgoing bandwidth),
        so the pushes and pulls are spread over the nodes' NICs.

        Returns:
            `(dict variable name -> device index, dict server -> bytes)`.
        """
        key = (i, set_id)
        found = self._spread_cache.get(key)
        if found is not None:
            return found
        t = self.tables
        members = self.sets[set_id]
        servers = {}
        for d in sorted(members, key=lambda d: self.speed_rank[d]):
            servers.setdefault(t.dev_node[d], d)
        servers = list(servers.values())
        probe = float(2**26)
        slowness = {}
        for srv in servers:
            others = [d for d in members if t.dev_node[d] != t.dev_node[srv]]
            slowness[srv] = max((t.transfer(srv, o, probe) for o in others), default=1.0)
        load = {srv: 0.0 for srv in servers}
        assign = {}
        variables = self.coarse.graph.nodes[self.units[i]].variables
        for v in sorted(variables, key=lambda v: (-int(v.bytes), v.name)):
            srv = min(servers, key=lambda x: ((load[x] + int(v.bytes)) * slowness[x],
                                              self.speed_rank[x]))
            load[srv] += int(v.bytes)
            assign[v.name] = srv
        found = self._spread_cache[key] = (assign, load)
        return found

    # ------------------------------------------------------------- the LP
    def _pieces(self, chunk_ids, dev_class):
        """Slopes and offsets (y - slope * x) of a replica set's time function."""
        key = (chunk_ids, dev_class)
        found = self._piece_cache.get(key)
        if found is None:
            grid = self._grid_array
            ys = sum(self.f[(i, dev_class)] for i in chunk_ids)
            slopes = np.diff(ys) / np.diff(grid)
            offsets = ys[:-1] - slopes * grid[:-1]
            found = self._piece_cache[key] = (slopes.tolist(), offsets.tolist())
        return found

    def solve_shares(self, state):
        """Batch shares per replica set by the LP; None when nothing fits.

        The LP depends on each group's replica set and, for a parameter
        server, on where the aggregation runs, not on the all-reduce
        algorithm: states differing only in that share one solution (cached).
        """
        key = _lp_key(state)
        found = self._lp_cache.get(key)
        if found is None:
            found = self._lp_cache[key] = (self._solve_shares(state), self.lp_bound)
        shares, self.lp_bound = found
        return shares

    def balance_shares(self, state):
        """Re-solves `state`'s shares, balancing the devices that do not set the step time.

        The LP minimises the busiest device's time; when fixed costs make one
        device critical whatever the shares (e.g. a parameter server on a
        tiny model), every split of the others is optimal and the solver
        returns an arbitrary vertex (once 1 / 46 / 1 samples, the full-speed
        device getting 1). This second LP keeps the step time and then
        minimises the busiest of the other devices' times, so they share the
        rest evenly by speed. Returns the new shares, or None when they equal
        the first ones (`solve_shares` keeps returning the first ones).
        """
        balanced = self._solve_shares(state, balance=True)
        return None if balanced is None or balanced == self.solve_shares(state) else balanced

    def _solve_shares(self, state, balance=False):
        t = self.tables
        n = self.n
        B = self.batch
        load = np.zeros(n)
        static = np.zeros(n)
        for i, (set_id, sync) in enumerate(state):
            members = self.sets[set_id]
            nbytes, ntensors = self.grad_bytes[i], t.n_tensors[i]
            for d in members:
                static[d] += self.static[i]
            if sync[0] == "ps" and len(members) > 1 and sync[1] == SPREAD:
                _, per_server = self.spread(i, set_id)
                for server, part in per_server.items():
                    share = part / nbytes if nbytes else 0.0
                    load[server] += t.cost.aggregate_time(part, len(members), t.dev[server])
                    load[server] += t.update(server, part, max(1, round(ntensors * share)))
            elif sync[0] == "ps" and len(members) > 1:
                server = sync[1]
                if server not in members:
                    static[server] += self.static[i]
                load[server] += t.cost.aggregate_time(nbytes, len(members), t.dev[server])
                load[server] += t.update(server, nbytes, ntensors)
            else:
                for d in members:
                    load[d] += t.update(d, nbytes, ntensors)
        classes = sorted({s for s, _ in state})
        for d in sorted({d for c in classes for d in self.sets[c]}):
            load[d] += t.step_overhead(d)  # every device that runs a replica steps
        fixed_time = np.zeros(n)
        fixed_act = np.zeros(n)
        var_classes = []
        for c in classes:
            members = self.sets[c]
            chunk_ids = [i for i, (s, _) in enumerate(state) if s == c]
            if len(members) == 1:
                d = members[0]
                fixed_time[d] += sum(self.f[(i, t.dev_class[d])][-1] for i in chunk_ids)
                fixed_act[d] += self._class_act(c, chunk_ids, state) * B
            else:
                var_classes.append((c, members, chunk_ids))
        room = np.array(self.capacity, dtype=float) - static - fixed_act
        if (room < 0).any():
            return None
        if not var_classes:
            self.lp_bound = float(np.max(load + fixed_time))
            return {c: [(self.sets[c][0], B)] for c in classes}
        # Variables: T, then per (class, member): share s and time tau.
        index = {}
        nvar = 1
        for c, members, _ in var_classes:
            for d in members:
                index[(c, d)] = (nvar, nvar + 1)
                nvar += 2
        rows, cols, vals, b_ub = [], [], [], []
        eq_rows, eq_cols = [], []
        per_device = [[] for _ in range(n)]
        time_rows = {}
        for ci, (c, members, chunk_ids) in enumerate(var_classes):
            act = float(self._class_act(c, chunk_ids, state))
            for d in members:
                si, ti = index[(c, d)]
                eq_rows.append(ci)
                eq_cols.append(si)
                slopes, offsets = self._pieces(tuple(chunk_ids), t.dev_class[d])
                # tau >= y_j + slope_j * (s - x_j): slope_j * s - tau <= -offset_j
                for slope, offset in zip(slopes, offsets):
                    r = len(b_ub)
                    rows += [r, r]
                    cols += [si, ti]
                    vals += [slope, -1.0]
                    b_ub.append(-offset)
                per_device[d].append((ti, si, act))
        for d in range(n):
            if not per_device[d]:
                continue
            r = len(b_ub)
            time_rows[d] = r
            rows.append(r)
            cols.append(0)
            vals.append(-1.0)
            for ti, _, _ in per_device[d]:
                rows.append(r)
                cols.append(ti)
                vals.append(1.0)
            b_ub.append(-(load[d] + fixed_time[d]))
            mem = [(si, act) for _, si, act in per_device[d] if act > 0]
            if mem:
                r = len(b_ub)
                for si, act in mem:
                    rows.append(r)
                    cols.append(si)
                    vals.append(act)
                b_ub.append(room[d])
        a_ub = coo_matrix((vals, (rows, cols)), shape=(len(b_ub), nvar)).tocsr()
        a_eq = coo_matrix(
            ([1.0] * len(eq_rows), (eq_rows, eq_cols)), shape=(len(var_classes), nvar)
        ).tocsr()
        bounds = [(0, None)] + [
            b for _ in range(len(index)) for b in ((1.0, float(B)), (0, None))
        ]
        objective = np.zeros(nvar)
        objective[0] = 1.0
        self.work += LP_COST_US
        res = linprog(
            objective, A_ub=a_ub, b_ub=np.array(b_ub), A_eq=a_eq,
            b_eq=np.full(len(var_classes), float(B)), bounds=bounds, method="highs",
        )
        if res.status != 0:
            return None
        self.lp_bound = float(res.x[0])
        if balance:
            res = self._balanced(res, rows, cols, vals, b_ub, a_eq, bounds, nvar, time_rows,
                                 per_device, len(var_classes)) or res
        shares = {}
        for c in classes:
            members = self.sets[c]
            if len(members) == 1:
                shares[c] = [(members[0], B)]
                continue
            x = [max(res.x[index[(c, d)][0]], 1.0) for d in members]
            whole = split_batch(x, B)
            for j, s in enumerate(whole):
                if s == 0:
                    donor = max(range(len(whole)), key=lambda q: (whole[q], -q))
                    whole[donor] -= 1
                    whole[j] = 1
            shares[c] = list(zip(members, whole))
        return shares

    def _balanced(self, first, rows, cols, vals, b_ub, a_eq, bounds, nvar, time_rows,
                  per_device, n_classes):
        """The second LP of `balance_shares`; None if it fails or nothing is left to balance.

        Devices whose time constraint binds in the first solution (a nonzero
        dual value) set the step time; the step time stays at most the first
        optimum, and a new variable bounds every other device's time.
        """
        marginals = getattr(getattr(first, "ineqlin", None), "marginals", None)
        if marginals is None:
            return None
        critical = {d for d, r in time_rows.items() if abs(marginals[r]) > 1e-12}
        others = [d for d in time_rows if d not in critical]
        if not critical or not others:
            return None
        rows, cols, vals, b_ub = list(rows), list(cols), list(vals), list(b_ub)
        t2 = nvar
        for d in others:
            r = len(b_ub)
            rows.append(r)
            cols.append(t2)
            vals.append(-1.0)
            for ti, _, _ in per_device[d]:
                rows.append(r)
                cols.append(ti)
                vals.append(1.0)
            b_ub.append(b_ub[time_rows[d]])
        a_ub = coo_matrix((vals, (rows, cols)), shape=(len(b_ub), nvar + 1)).tocsr()
        a_eq = a_eq.tocoo()
        a_eq = coo_matrix((a_eq.data, (a_eq.row, a_eq.col)), shape=(n_classes, nvar + 1)).tocsr()
        step = float(first.x[0])
        bounds = [(0, step * (1 + 1e-9) + 1e-15)] + list(bounds[1:]) + [(0, None)]
        objective = np.zeros(nvar + 1)
        objective[t2] = 1.0
        self.work += LP_COST_US
        res = linprog(objective, A_ub=a_ub, b_ub=np.array(b_ub), A_eq=a_eq,
                      b_eq=np.full(n_classes, float(self.batch)), bounds=bounds, method="highs")
        return res if res.status == 0 else None

    # ------------------------------------------------------- evaluation
    def coarse_plan(self, state, shares):
        """Per-unit replicas `[(device name, share)]` and per-variable `SyncSpec`."""
        per_unit = {}
        sync = {}
        for i, (set_id, (method, server)) in enumerate(state):
            unit = self.units[i]
            per_unit[unit] = [(self.names[d], s) for d, s in shares[set_id]]
            ps = method == "ps" and len(self.sets[set_id]) > 1
            assign = self.spread(i, set_id)[0] if ps and server == SPREAD else None
            for v in self.coarse.graph.nodes[unit].variables:
                if assign is not None:
                    sync[v.name] = SyncSpec(method="ps", algorithm=None,
                                            server=self.names[assign[v.name]])
                elif ps:
                    sync[v.name] = SyncSpec(method="ps", algorithm=None, server=self.names[server])
                else:
                    sync[v.name] = SyncSpec(method="allreduce", algorithm=method, server=None)
        return per_unit, sync

    def evaluate(self, state, bound=None):
        """Coarse simulated step time of a state: (infeasible, seconds).

        With `bound` (seconds), a state whose LP optimum (the busiest
        device's compute and update time, a lower bound of its simulated
        step) is already at least `bound` is not simulated: the result is
        then `(False, lower bound)`, enough to reject the move.
        """
        from autodist_keras.estimator import simulate

        found = self._cache.get(state)
        if found is not None:
            return found
        if not self.runnable(state):
            self._cache[state] = (True, math.inf)
            return self._cache[state]
        lower = self._pruned.get(state)
        if lower is not None and bound is not None and lower >= bound:
            return (False, lower)
        if lower is None:
            shares = self.solve_shares(state)
            if shares is None:
                self._cache[state] = (True, math.inf)
                return self._cache[state]
            lower = self.lp_bound
            if bound is not None and lower >= bound:
                self.pruned += 1
                self._pruned[state] = lower
                return (False, lower)
        else:
            shares = self.solve_shares(state)
        self.evals += 1
        per_unit, sync = self.coarse_plan(state, shares)
        units = self.units
        p = Plan(
            global_batch_size=self.batch,
            groups=_common.group_layers(units, [per_unit[u] for u in units]),
            sync=sync,
            buckets=self.buckets,
        )
        result = simulate(self.coarse.graph, self.cluster, p, cost_model=self.ccost,
                          validate=False)
        self.work += SIM_TASK_COST_US * result.num_tasks
        score = (not result.feasible, result.step_time_s)
        self._cache[state] = score
        return score

    def runnable(self, state):
        """Whether `state` keeps every layer that must not be split by rows whole.

        A layer that computes on the whole batch (a trainable
        BatchNormalization or a subclass, a stateful layer:
        `_common.unsplittable_layers`) may be replicated with batch shares
        only in a data-parallel plan, where every group has the same replica
        set (one layer group; each replica normalises its own share, as data
        parallelism does). In a hybrid or placement plan a group holding one
        must run on one device: the TensorFlow placement runtime refuses to
        split it (`tf_placement.unsupported`), as FastT never splits it.
        Until session 31 HeteroG's search could return such a plan (a
        4x2048 MLP with BatchNormalization after each Dense, batch 64, two
        2 GiB and two 0.2 GiB GPUs, `seeds=False`: 8 groups, the
        BatchNormalization groups split over the two large GPUs).

        Args:
            state: One `(replica set, sync)` per group.

        Returns:
            True when the plan of `state` splits no such layer.
        """
        if not self.blocked or len({set_id for set_id, _ in state}) == 1:
            return True
        return all(len(self.sets[state[i][0]]) == 1 for i in self.blocked)

    # ----------------------------------------------------------- search
    def initial_states(self):
        """Uniform starting points: every group replicated on all devices (each
        sync option), and on each smaller replica set of two or more devices
        (ring all-reduce; the search then tries the other options). Moves
        change one group's set at a time, so "every group on the well-connected
        nodes" is reachable only from such a start."""
        states = []
        for sync in self.sync_options(0):
            states.append(tuple((0, sync) for _ in self.units))
        for set_id in range(1, len(self.sets)):
            if len(self.sets[set_id]) >= 2:
                sync = self.sync_options(set_id)[0]
                states.append(tuple((set_id, sync) for _ in self.units))
        return states

    def search(self, max_work, passes, budget, reserve):
        """Local search; returns (best state, its score, log lines).

        Starts from the best uniform state with every group on all devices
        (each sync option) or, when none fits, from a memory-aware state;
        and, when it scores differently, also from the best uniform state on
        a smaller replica set (the well-connected nodes, say), which single
        moves from the first cannot reach. From each start, group by group
        (largest gradients first), it tries the other sync options and, for
        the groups holding most of the gradient bytes or too much state for
        the smallest device, the other replica sets; keeps the best
        improving move. Stops after `passes` passes, at `max_work` estimated
        microseconds (a second start gets half as much again), or when the
        budget (less `reserve` seconds) is spent. The better result wins.
        """
        log = []
        everywhere, subset = [], []
        for state in self.initial_states():
            (everywhere if state[0][0] == 0 else subset).append((self.evaluate(state), state))
        best_score, best = min(everywhere, key=lambda x: x[0])
        if best_score[0]:
            state = self.memory_state()
            if state is not None:
                score = self.evaluate(state)
                if score < best_score:
                    best, best_score = state, score
                    log.append("memory-aware start: groups replicated where they fit")
        starts = [(best, best_score)]
        if subset:
            other_score, other = min(subset, key=lambda x: x[0])
            if other_score[1] < math.inf and other_score != best_score:
                starts.append((other, other_score))
        starts = [(s, sc) for s, sc in starts if s is not None and sc[1] < math.inf]
        if not starts:
            return None, best_score, log
        order = sorted(
            range(len(self.units)),
            key=lambda i: (-self.grad_bytes[i], -self.f[(i, 0)][-1], i),
        )
        heavy = set()
        total = sum(self.grad_bytes) or 1
        acc = 0
        for i in order:
            if acc >= 0.9 * total or len(heavy) >= MAX_HEAVY_GROUPS:
                break
            heavy.add(i)
            acc += self.grad_bytes[i]
        smallest = min(self.capacity)
        heavy |= {i for i in range(len(self.units)) if self.static[i] > smallest / 4}
        results = []
        for n, (state, score) in enumerate(starts):
            # The first start searches as it always did; a second gets half as much more.
            cap = max_work if n == 0 else self.work + max_work / 2
            lines = [] if n == 0 else [
                f"second start: every group on {self._label(state[0])}"]
            found, found_score = self._descend(state, score, order, heavy, cap, passes,
                                               budget, reserve, lines)
            lines.insert(0, f"coarse step {_common.ms(score[1])} -> "
                            f"{_common.ms(found_score[1])}")
            results.append((found_score, n, found, lines))
        best_score, _, best, lines = min(results, key=lambda x: (x[0], x[1]))
        return best, best_score, log + lines

    def _descend(self, best, best_score, order, heavy, max_work, passes, budget, reserve, log):
        """Best-improvement passes from `(best, best_score)`; see `search`."""
        # Each pass: first the sync of every group (cheap: the shares and the
        # LP stay, the plan usually stays one data-parallel group), then the
        # replica sets of the heavy groups (a new LP and a full simulation each).
        for _ in range(passes):
            improved = False
            for phase in ("sync", "sets"):
                for i in order:
                    if phase == "sets" and i not in heavy:
                        continue
                    if self.work >= max_work or budget.exhausted(reserve=reserve):
                        break
                    state, score, line = self._improve_group(
                        best, best_score, i, max_work, phase
                    )
                    if line:
                        best, best_score = state, score
                        log.append(line)
                        improved = True
            if not improved or self.work >= max_work or budget.hit:
                break
        return best, best_score

    def _improve_group(self, state, score, i, max_work, phase):
        set_id, sync = state[i]
        candidates = []
        for option in self.sync_options(set_id):
            if option != sync and phase == "sync":
                candidates.append((set_id, option))
        if phase == "sets":
            for other in range(len(self.sets)):
                if other == set_id:
                    continue
                opts = self.sync_options(other)
                keep = [
                    o for o in opts
                    if o[0] == sync[0] and (
                        o[0] != "ps" or o[1] == sync[1] == SPREAD
                        or (sync[1] != SPREAD and o[1] in self.sets[other])
                    )
                ]
                candidates.append((other, keep[0] if keep else opts[0]))
        best_state, best_score, line = state, score, None
        for cand in candidates:
            if self.work >= max_work:
                break
            trial = state[:i] + (cand,) + state[i + 1:]
            # Prune by the LP bound only against a feasible best.
            bound = None if best_score[0] else best_score[1] * (1 - MIN_GAIN)
            s = self.evaluate(trial, bound=bound)
            if s[0] < best_score[0] or (
                s[0] == best_score[0] and s[1] < best_score[1] * (1 - MIN_GAIN)
            ):
                best_state, best_score = trial, s
                line = (
                    f"group {i} ({self.units[i]}): {self._label(state[i])} -> "
                    f"{self._label(cand)}: {_common.ms(score[1])} -> {_common.ms(s[1])}"
                )
        return best_state, best_score, line

    def _class_act(self, c, chunk_ids, state):
        """Activation bytes per sample that the groups on replica set `c` keep.

        Their own outputs, and each input they receive from a group on
        another set, once per producer (a producer on the same set hands its
        output over in place).
        """
        t = self.tables
        received = {}
        for i in chunk_ids:
            for j, nbytes in t.preds[i]:
                if state[j][0] != c:
                    received[j] = max(received.get(j, 0), nbytes)
        # ... and the device's backward gradient buffer, the largest of the groups'
        # (counted once per set: at least what the simulator counts).
        buffer = max((self.buffer[i] for i in chunk_ids), default=0)
        return sum(t.act[i] for i in chunk_ids) + sum(received.values()) + buffer

    def memory_state(self):
        """Groups on the largest candidate set whose devices still have room.

        When that leaves some group without room, every device becomes a set
        of its own as well and the groups are placed in order, each on the
        current device while it has room, then on the next (a pipeline-like
        placement, as FastT makes when no replica fits); the local search
        then keeps those sets too. So does a greedy state that would split a
        layer that must stay whole (`runnable`).
        """
        state = self._greedy_memory_state()
        if state is None or not self.runnable(state):
            self.sets.extend((d,) for d in range(self.n) if (d,) not in self.sets)
            state = self._placement_memory_state()
        return state

    def _placement_memory_state(self):
        room = list(self.capacity)
        held = [0] * self.n  # each device's backward gradient buffer, counted in room
        order = sorted(range(self.n), key=lambda d: self.speed_rank[d])
        position, state = 0, []
        for i in range(len(self.units)):

            def need(d):
                return (self.static[i] + self.act[i] * self.batch
                        + max(self.buffer[i] * self.batch - held[d], 0))

            while position < len(order) and room[order[position]] < need(order[position]):
                position += 1
            if position == len(order):
                return None
            d = order[position]
            room[d] -= need(d)
            held[d] = max(held[d], self.buffer[i] * self.batch)
            state.append((self.sets.index((d,)), ("ring", None)))
        return tuple(state)

    def _greedy_memory_state(self):
        room = list(self.capacity)
        held = [0] * self.n  # each device's backward gradient buffer, counted in room
        state = []
        for i in range(len(self.units)):

            def need(d, per):
                return (self.static[i] + self.act[i] * per
                        + max(self.buffer[i] * per - held[d], 0))

            choice = None
            for set_id in sorted(range(len(self.sets)), key=lambda s: -len(self.sets[s])):
                members = self.sets[set_id]
                per = max(self.batch // len(members), 1)
                if all(room[d] >= need(d, per) for d in members):
                    choice = set_id
                    break
            if choice is None:
                return None
            members = self.sets[choice]
            per = max(self.batch // len(members), 1)
            for d in members:
                room[d] -= need(d, per)
                held[d] = max(held[d], self.buffer[i] * per)
            state.append((choice, ("ring", None)))
        return tuple(state)

    def _label(self, option):
        set_id, (method, server) = option
        members = self.sets[set_id]
        where = "all devices" if len(members) == self.n else (
            self.names[members[0]] if len(members) == 1
            else "[" + ", ".join(self.names[d] for d in members) + "]"
        )
        if len(members) == 1:
            return where
        if method == "ps" and server == SPREAD:
            how = "ps spread over one server per node"
        else:
            how = f"ps@{self.names[server]}" if method == "ps" else f"allreduce/{method}"
        return f"{where} {how}"

    # ------------------------------------------------------- final plan
    def fine_plan(self, state, record, shares=None):
        shares = shares or self.solve_shares(state)
        per_unit, sync = self.coarse_plan(state, shares)
        layer_replicas = self.coarse.expand(per_unit)
        entries = rank_order(self.fine_tables, self.batch)
        names = list(self.graph.nodes)
        by_device = {}
        for layer in names:
            for d, _ in layer_replicas[layer]:
                by_device.setdefault(d, set()).add(layer)
        order = {
            d: [e for e in entries if e[0] in layers] for d, layers in by_device.items()
        }
        plan = _common.placement_plan(
            self.graph, layer_replicas, self.batch, PLANNER, order=order, sync=sync,
            options=record,
        )
        plan.buckets = [list(b) for b in self.buckets]
        return plan

    def describe(self, state, shares=None):
        """Human-readable notes on the chosen strategies (and `shares`, default the LP's)."""
        shares = shares or self.solve_shares(state)
        notes = []
        distinct = []
        for i, option in enumerate(state):
            label = self._label(option)
            if distinct and distinct[-1][0] == label:
                distinct[-1][2] = i
            else:
                distinct.append([label, i, i])
        parts = []
        for label, a, b in distinct:
            span = f"group {a}" if a == b else f"groups {a}-{b}"
            parts.append(f"{span}: {label}")
        notes.append(
            f"{len(self.units)} layer groups of about equal compute; strategies: "
            + "; ".join(parts) + "."
        )
        full = [s for s in shares if len(self.sets[s]) == self.n]
        if full:
            text = ", ".join(f"{self.names[d]}={s}" for d, s in shares[full[0]])
            notes.append(f"Batch shares from the LP (all devices): {text}.")
        partial = [i for i, (s, _) in enumerate(state) if len(self.sets[s]) < self.n]
        if partial:
            notes.append(
                f"{len(partial)} group(s) run on a subset of the devices (partial "
                "replication or placement)."
            )
        return notes
