"""Disco: joint op fusion and tensor fusion for data-parallel training.

Disco (IEEE TPDS; arXiv 2209.12769) keeps plain data parallelism and
chooses, together, which adjacent layers are compiled as one region (op
fusion, `plan.op_fusion`) and which gradients are all-reduced as one buffer
and in which order (tensor fusion, `plan.buckets`), by a backtracking search
driven by a step-time estimator. The two interact: fusing layers removes
launches and memory traffic (less compute), but a region's gradients are
ready only when its whole backward ends, so fusing near the end of backward
can delay the all-reduces that compute was hiding.

This planner:

1. takes the replicas of the proportional baseline on the device subset
   whose start is predicted fastest (`_choose_devices`: all devices, or the
   `batch_size` fastest when the batch is smaller than the device count;
   without the slowest type, the worst-connected node(s); each node alone,
   one device of each type alone), and, of two sets of
   batch shares, the one predicted faster with DDP buckets: the proportional
   baseline's (peak FLOP/s) or shares that balance each device's predicted
   step (`_balanced_base`: compute at its share plus the optimizer update);
   so on mixed GPUs Disco is never predicted slower than proportional shares
   with DDP buckets, and its search starts from the faster set;
2. scores seed layouts (DDP 25 MiB, Horovod 64 MiB, no fusion, and the
   chain-optimal layout of `fusion.tensor_fusion.chain_optimal_bounds`);
3. searches, from the best seed: fuse every layer the fusion model can absorb
   (one move), then toggle single fusions (fuse or un-fuse two adjacent
   layers), merge or split adjacent buckets, and re-solve the bucket layout
   for the current compute timeline; a move is kept only when the predicted
   step time drops, otherwise it is undone (backtracking). Passes repeat
   until none improves or `time_budget_s` is spent;
4. picks each bucket's all-reduce algorithm (ring, tree, hierarchical) as
   the one the cost model prices cheapest for its size;
5. simulates the result with `estimator.simulate` (the one source of
   predicted times) and keeps the proportional DDP plan instead should the
   simulation ever disagree with the search.

During the search candidates are scored by `_Timeline`, a closed-form
replay of the simulator for data-parallel all-reduce plans (forward then
backward on each device stream, the bucket chain on the links, the
optimizer update last). Tests check it equals `simulate` to 1e-9; the final
numbers come from `simulate`.

Example:

```python
from autodist_keras.strategies import disco

plan = disco.plan(graph, Cluster.from_string("8xV100"), batch_size=256)
print(plan.summary())
print(plan.op_fusion[:3], len(plan.buckets))
```
"""

import bisect
import time

import numpy as np

from autodist_keras.errors import AutodistError
from autodist_keras.errors import StrategyError
from autodist_keras.estimator.cost_model import AnalyticCostModel
from autodist_keras.estimator.simulator import device_timing_key
from autodist_keras.fusion import op_fusion as op_fusion_lib
from autodist_keras.fusion import tensor_fusion
from autodist_keras.strategies import _common
from autodist_keras.strategies import baselines
from autodist_keras.strategies.plan import LayerGroup
from autodist_keras.strategies.plan import Plan
from autodist_keras.strategies.plan import Provenance
from autodist_keras.strategies.plan import Replica
from autodist_keras.strategies.plan import SyncSpec

DEFAULT_TIME_BUDGET_S = 2.0
ALGORITHMS = ("ring", "tree", "hierarchical")
# Nodes (most peak FLOP/s first) whose devices alone `_choose_devices` prices as a start.
MAX_NODE_STARTS = 8
_UNPRICED = object()
OPTION_NAMES = ("algorithms", "speeds", "op_fusion", "tensor_fusion", "compare_baselines",
                "backend")
_EPS = 1e-12


class _State:
    """One point of the search: op-fusion joins and the per-layer times they give."""

    __slots__ = ("joins", "fwd", "bwd", "heads", "_pieces")

    def __init__(self, joins, fwd, bwd, heads):
        self.joins, self.fwd, self.bwd, self.heads = joins, fwd, bwd, heads
        self._pieces = None


class _Timeline:
    """Predicted step time of a data-parallel all-reduce plan, in closed form.

    Mirrors `estimator.simulate` for one data-parallel group with all-reduce
    sync and default execution order: each device runs every forward in graph
    order, then every backward in reverse graph order, back to back; a bucket
    all-reduce starts when its last gradient is ready on every device (the end
    of the backward of its layer, or of the first layer of its op-fusion
    region) and the previous bucket is done; each device's optimizer update
    starts after its compute and the last all-reduce.
    """

    def __init__(self, graph, cluster, replicas, cost, algorithms):
        self.np = np
        self.graph = graph
        self.names = list(graph.nodes)
        self.index = {name: i for i, name in enumerate(self.names)}
        self.cost = cost
        self.fusion_cost = op_fusion_lib.FusionAwareCostModel(cost, graph, [])
        self.members = [r.device for r in replicas]
        self.algorithms = list(algorithms)
        nodes = [graph.nodes[n] for n in self.names]
        order = tensor_fusion.launch_order(graph)
        total = sum(int(v.bytes) for v in order)
        # Device classes: identical devices with identical shares run identical timelines.
        classes = {}
        for r in replicas:
            d = cluster.device(r.device)
            key = (d.kind, d.model, d.peak_flops_fp32, d.peak_flops_fp16,
                   d.memory_bandwidth, r.batch_share)
            classes.setdefault(key, []).append(r)
        self.classes = []
        for members in classes.values():
            device = cluster.device(members[0].device)
            share = members[0].batch_share
            update = max(
                cost.replica_update_time(total, cluster.device(m.device), len(order))
                if order else 0.0
                for m in members
            )
            self.classes.append({
                "device": device, "share": share, "devices": [m.device for m in members],
                "fwd": np.array([cost.layer_time(n, device, share, "forward") for n in nodes]),
                "bwd": np.array([cost.layer_time(n, device, share, "backward") for n in nodes]),
                "update": update,
            })
        self.var_names = [v.name for v in order]
        self.var_bytes = [int(v.bytes) for v in order]
        owner = graph.variable_owner
        self.var_layer = np.array([self.index[owner[v.name]] for v in order], dtype=int)
        self.prefix = [0]
        for b in self.var_bytes:
            self.prefix.append(self.prefix[-1] + b)
        self._allreduce = {}
        self._allreduce_time = {}
        self.affine, self.affine_exact = self._fit_allreduce() if len(self.members) > 1 else (
            [(0.0, 0.0)] * len(self.algorithms), True
        )
        self._runs = {}
        self._fused_times = {}
        self.producers, self.consumers = op_fusion_lib.adjacency(graph)
        self.outputs = set(graph.outputs)
        self.evaluations = 0

    def with_algorithms(self, algorithms):
        """The same timeline, pricing all-reduces with other algorithms only."""
        other = _Timeline.__new__(_Timeline)
        other.__dict__.update(self.__dict__)
        other.algorithms = list(algorithms)
        other._allreduce, other._allreduce_time = {}, {}
        if len(self.members) > 1:
            other.affine, other.affine_exact = other._fit_allreduce()
        else:
            other.affine, other.affine_exact = [(0.0, 0.0)] * len(other.algorithms), True
        return other

    # ------------------------------------------------------------ pricing
    def _fit_allreduce(self):
        """Affine fits `a + b * bytes` of each algorithm, and whether they are exact."""
        s1, s2 = float(2**20), float(2**30)
        fits = []
        for a in self.algorithms:
            t1 = self.cost.allreduce_time(s1, self.members, a)
            t2 = self.cost.allreduce_time(s2, self.members, a)
            slope = (t2 - t1) / (s2 - s1)
            fits.append((t1 - slope * s1, slope))
        exact = all(a >= 0 and b >= 0 for a, b in fits)
        for size in (1, 4099, 3 * 2**22 + 7, 5 * 2**28):
            for (a, b), name in zip(fits, self.algorithms):
                t = self.cost.allreduce_time(size, self.members, name)
                if abs(a + b * size - t) > 1e-9 * max(t, 1e-12):
                    exact = False
        return [(max(a, 0.0), max(b, 0.0)) for a, b in fits], exact

    def allreduce(self, nbytes):
        """`(seconds, algorithm)` of the cheapest all-reduce of `nbytes`."""
        found = self._allreduce.get(nbytes)
        if found is None:
            best = None
            for (a, b), name in zip(self.affine, self.algorithms):
                if self.affine_exact:
                    t = a + b * nbytes if nbytes > 0 else 0.0
                else:
                    t = self.cost.allreduce_time(nbytes, self.members, name)
                if best is None or t < best[0]:
                    best = (t, name)
            found = self._allreduce[nbytes] = best
            self._allreduce_time[nbytes] = best[0]
        return found

    def affine_costs(self):
        """`(a, b)` per algorithm, fitted at two sizes (exact for alpha-beta models)."""
        return list(self.affine)

    # ------------------------------------------------------------ compute
    def _run_contexts(self, lo, hi):
        """Absorbed layers of the region made of layers `lo..hi` (inclusive)."""
        key = (lo, hi)
        found = self._runs.get(key)
        if found is None:
            contexts = op_fusion_lib.contexts_of_region(
                self.graph, self.names[lo:hi + 1], self.producers, self.consumers, self.outputs
            )
            found = [(self.index[k], c) for k, c in contexts.items() if c.absorbed]
            self._runs[key] = found
        return found

    def _fused_time(self, ci, i, context):
        key = (ci, i, context)
        found = self._fused_times.get(key)
        if found is None:
            c = self.classes[ci]
            node = self.graph.nodes[self.names[i]]
            found = self._fused_times[key] = tuple(
                self.fusion_cost.layer_time_in(node, c["device"], c["share"], phase, context)
                for phase in ("forward", "backward")
            )
        return found

    def _apply_runs(self, state, lo, hi):
        """Re-prices layers `lo..hi` for the runs `state.joins` makes there."""
        joins = state.joins
        for ci, c in enumerate(self.classes):
            state.fwd[ci][lo:hi + 1] = c["fwd"][lo:hi + 1]
            state.bwd[ci][lo:hi + 1] = c["bwd"][lo:hi + 1]
        state.heads[lo:hi + 1] = self.np.arange(lo, hi + 1)
        start = lo
        for k in range(lo, hi + 1):
            if k in joins and k < hi:
                continue
            if k > start:
                state.heads[start:k + 1] = start
                for i, context in self._run_contexts(start, k):
                    for ci in range(len(self.classes)):
                        state.fwd[ci][i], state.bwd[ci][i] = self._fused_time(ci, i, context)
            start = k + 1

    def state(self, joins):
        """The `_State` of a set of joins, priced from scratch."""
        np = self.np
        state = _State(
            frozenset(joins),
            [c["fwd"].copy() for c in self.classes],
            [c["bwd"].copy() for c in self.classes],
            np.arange(len(self.names)),
        )
        if state.joins and self.names:
            self._apply_runs(state, 0, len(self.names) - 1)
        return state

    def toggled(self, state, j):
        """`state` with join `j` (layers `j` and `j + 1` in one region) flipped."""
        old = state.joins
        lo = j
        while lo - 1 in old:
            lo -= 1
        hi = j + 1
        while hi in old:
            hi += 1
        new = _State(
            old ^ {j}, [a.copy() for a in state.fwd], [a.copy() for a in state.bwd],
            state.heads.copy(),
        )
        self._apply_runs(new, lo, hi)
        return new

    def pieces(self, state):
        """`(compute end per class, gradient ready times in launch order)` of a state."""
        if state._pieces is None:
            np = self.np
            compute, ready_layer = [], None
            for fwd, bwd in zip(state.fwd, state.bwd):
                f_total = float(fwd.sum())
                if len(bwd):
                    ends = f_total + np.cumsum(bwd[::-1])[::-1]
                    compute.append(float(ends[0]))
                    at_head = ends[state.heads]
                    ready_layer = at_head if ready_layer is None else np.maximum(
                        ready_layer, at_head
                    )
                else:
                    compute.append(f_total)
            if len(self.var_layer):
                # Launch order is reverse graph order, so ready times never decrease.
                ready = np.maximum.accumulate(ready_layer[self.var_layer]).tolist()
            else:
                ready = []
            state._pieces = (compute, ready)
        return state._pieces

    def step(self, state, bounds):
        """Predicted step time of `state` (op fusion) with buckets ending at `bounds`."""
        self.evaluations += 1
        compute, ready = self.pieces(state)
        prefix, cache = self.prefix, self._allreduce_time
        comm_end = 0.0
        start = 0
        for end in bounds:
            r = ready[end - 1]
            nbytes = prefix[end] - prefix[start]
            t = cache.get(nbytes)
            if t is None:
                t = self.allreduce(nbytes)[0]
            comm_end = (comm_end if comm_end > r else r) + t
            start = end
        step = 0.0
        for ci, c in enumerate(self.classes):
            t = (compute[ci] if compute[ci] > comm_end else comm_end) + c["update"]
            if t > step:
                step = t
        return step

    def optimal_bounds(self, state):
        """The chain-optimal bucket layout for a state's compute timeline."""
        _, ready = self.pieces(state)
        bounds, _ = tensor_fusion.chain_optimal_bounds(
            self.var_bytes, ready, self.affine_costs()
        )
        return tuple(bounds)

    def bound(self, state):
        """The fully-overlapped bound (`tensor_fusion.overlapped_bound`) of a state."""
        compute, ready = self.pieces(state)
        per_device, update = {}, {}
        for ci, c in enumerate(self.classes):
            for name in c["devices"]:
                per_device[name] = compute[ci]
                update[name] = c["update"]
        return tensor_fusion.overlapped_bound(
            per_device, update, list(zip(ready, self.var_bytes)),
            lambda nbytes: self.allreduce(nbytes)[0],
        )

    def compute_saving(self, state):
        """Forward+backward time fusion saves on the first class's device (seconds)."""
        c = self.classes[0]
        return float(c["fwd"].sum() + c["bwd"].sum() - state.fwd[0].sum() - state.bwd[0].sum())


class _Search:
    """Disco's backtracking search over (op-fusion joins, bucket bounds).

    Every move is scored by `_Timeline.step`; a move is kept when the
    predicted step time drops (merging buckets also when it stays equal),
    otherwise it is undone.
    """

    def __init__(self, timeline, joins_allowed, deadline, progress, use_op, use_tensor):
        self.tl = timeline
        self.candidates = list(joins_allowed) if use_op else []
        self.deadline = deadline
        self.progress = progress
        self.use_tensor = use_tensor
        self.budget_exhausted = False
        self.passes = 0
        self.accepted = {"op_fusion": 0, "tensor_fusion": 0}
        self.state = self.bounds = self.best = None

    def _time_left(self):
        if time.perf_counter() >= self.deadline:
            self.budget_exhausted = True
            return False
        return True

    def consider(self, state, bounds, allow_equal=False):
        """Moves to `(state, bounds)` if it is predicted faster; returns whether it did."""
        t = self.tl.step(state, bounds)
        if t < self.best * (1.0 - 1e-12) or (allow_equal and t <= self.best):
            self.state, self.bounds, self.best = state, tuple(bounds), t
            return True
        return False

    def _tensor_moves(self):
        """Re-solve the buckets for the current timeline, then split and merge them."""
        tl = self.tl
        before = self.best
        if self._time_left() and self.consider(self.state, tl.optimal_bounds(self.state)):
            self.accepted["tensor_fusion"] += 1
        k = 0
        while k < len(self.bounds) and self._time_left():
            bounds = self.bounds
            lo = bounds[k - 1] if k else 0
            hi = bounds[k]
            if hi - lo > 1:
                cut = bisect.bisect_left(tl.prefix, (tl.prefix[lo] + tl.prefix[hi]) / 2.0)
                cut = min(max(cut, lo + 1), hi - 1)
                if self.consider(self.state, bounds[:k] + (cut,) + bounds[k:]):
                    self.accepted["tensor_fusion"] += 1
            k += 1
        # Merging is kept when it costs nothing: fewer, larger buckets.
        k = 0
        while k < len(self.bounds) - 1 and self._time_left():
            bounds = self.bounds
            if self.consider(self.state, bounds[:k] + bounds[k + 1:], allow_equal=True):
                self.accepted["tensor_fusion"] += 1
                continue
            k += 1
        return self.best < before * (1.0 - 1e-12)

    def run(self, state, bounds):
        tl = self.tl
        self.state, self.bounds = state, tuple(bounds)
        self.best = tl.step(state, self.bounds)
        # The first moves are made whatever the budget (a few evaluations): re-solve
        # the buckets, then fuse everything the model can absorb and re-solve again.
        if self.use_tensor:
            self.consider(state, tl.optimal_bounds(state))
        if self.candidates:
            fused = tl.state(self.candidates)
            if self.consider(fused, tl.optimal_bounds(fused) if self.use_tensor else self.bounds):
                self.accepted["op_fusion"] += 1
        improved = True
        while improved and self._time_left():
            improved = False
            self.passes += 1
            if self.use_tensor:
                improved = self._tensor_moves()
            # Op fusion: flip each adjacent pair (fuse, or un-fuse).
            for j in self.candidates:
                if not self._time_left():
                    break
                if self.consider(tl.toggled(self.state, j), self.bounds):
                    self.accepted["op_fusion"] += 1
                    improved = True
            if self.progress is not None:
                self.progress.set_postfix(best_ms=f"{self.best * 1e3:.2f}", refresh=False)
        return self.state, self.bounds, self.best


def _check_options(options):
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise StrategyError(
            f"Unknown Disco option(s) {unknown}. Valid options: {', '.join(OPTION_NAMES)}. "
            f"Received: {unknown}"
        )
    algorithms = options.get("algorithms", ALGORITHMS)
    if isinstance(algorithms, str):
        algorithms = (algorithms,)
    algorithms = tuple(algorithms)
    bad = [a for a in algorithms if a not in ALGORITHMS]
    if not algorithms or bad:
        raise StrategyError(
            f"Disco option `algorithms` must list all-reduce algorithms from {ALGORITHMS}. "
            f"Received: algorithms={options.get('algorithms')!r}"
        )
    return algorithms


def _with_layout(base, graph, buckets, bucket_algorithm, regions, shares=None):
    """A copy of the data-parallel plan `base` with other buckets, algorithms and
    regions (and, with `shares`, other batch shares in replica order)."""
    group = base.groups[0]
    if shares is None:
        shares = [r.batch_share for r in group.replicas]
    sync = {}
    for bucket, algorithm in zip(buckets, bucket_algorithm):
        for name in bucket:
            sync[name] = SyncSpec(method="allreduce", algorithm=algorithm, server=None)
    for v in graph.variables:
        sync.setdefault(v.name, SyncSpec(method="allreduce", algorithm="ring", server=None))
    return Plan(
        global_batch_size=base.global_batch_size,
        groups=[
            LayerGroup(
                name=group.name,
                layers=list(group.layers),
                replicas=[Replica(r.device, n) for r, n in zip(group.replicas, shares)],
            )
        ],
        sync=sync,
        buckets=[list(b) for b in buckets],
        op_fusion=[list(r) for r in regions],
        provenance=Provenance(
            planner="disco",
            graph_fingerprint=base.provenance.graph_fingerprint,
            cluster_fingerprint=base.provenance.cluster_fingerprint,
            layer_order=base.provenance.layer_order,
        ),
    )


def plan(
    graph,
    cluster,
    batch_size,
    cost_model=None,
    devices=None,
    time_budget_s=None,
    progress=None,
    **options,
):
    """Plans data-parallel training with Disco's joint op and tensor fusion.

    Args:
        graph: The `ModelGraph`.
        cluster: The `Cluster`.
        batch_size: Global batch size.
        cost_model: Cost model for the estimator (default
            `AnalyticCostModel(cluster)`).
        devices: Device names it may use (default: all). Disco plans on the
            subset of them whose start is predicted fastest
            (`_choose_devices`: a slow device type, nodes behind slow
            links, or all but one node or one device may be left out), and
            on at most `batch_size` of them; a note names the devices left
            out and why, and `provenance.options["left_out"]` maps each to
            its reason.
        time_budget_s: Wall-time budget for the whole call (default 2 s).
            The search stops when it is spent (then the result may depend on
            the machine's speed; the plan's notes say so).
        progress: Optional tqdm bar; advanced once per search phase.
        **options: `algorithms` (all-reduce algorithms a bucket may use,
            default `("ring", "tree", "hierarchical")`), `speeds` (measured
            device speeds for the proportional shares), `op_fusion` and
            `tensor_fusion` (False to search only the other),
            `compare_baselines` (True to also simulate the no-fusion,
            DDP 25 MiB and Horovod 64 MiB layouts and the fully-overlapped
            bound into `plan.prediction.baselines`), and `backend` (the Keras
            backend the plan is for, default the active one: whether op
            fusion is searched when `op_fusion` is not given, and which
            regions the backend's runtime compiles, `op_fusion.candidate_joins`).

    Returns:
        A validated `Plan` with `planner="disco"`, `buckets`, `op_fusion`,
        per-bucket all-reduce algorithms and the simulator's prediction.

    Raises:
        StrategyError: For unknown options.
        PlanError: If the batch or devices cannot form a data-parallel plan
            (as `baselines.proportional` on all devices, or on the
            `batch_size` fastest when the batch is smaller than the device
            count: unknown devices, a batch that is not a positive integer,
            a model that does not fit in memory).

    Example:

    ```python
    plan = disco.plan(graph, cluster, 512, time_budget_s=1.0)
    print(plan.prediction.step_time_s, len(plan.op_fusion), len(plan.buckets))
    ```
    """
    from autodist_keras.estimator import simulate

    started = time.perf_counter()
    algorithms = _check_options(options)
    budget = DEFAULT_TIME_BUDGET_S if time_budget_s is None else time_budget_s
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0:
        raise StrategyError(
            f"time_budget_s must be a positive number of seconds. Received: {time_budget_s!r}"
        )
    budget = float(budget)
    use_op = options.get("op_fusion")  # default: GPUs under TensorFlow only (see below)
    backend = options.get("backend")
    if backend is None:
        from autodist_keras.devices.detect import active_keras_backend

        backend = active_keras_backend()
    use_tensor = bool(options.get("tensor_fusion", True))
    compare = bool(options.get("compare_baselines", False))

    cost = cost_model if cost_model is not None else AnalyticCostModel(cluster)
    if isinstance(cost, op_fusion_lib.FusionAwareCostModel):
        cost = cost.base
    if hasattr(cost, "with_cluster"):
        cost = cost.with_cluster(cluster)

    # Replicas and shares: the proportional baseline (memory-capped, speed-weighted)
    # on the device subset whose start is predicted fastest (`_choose_devices`).
    # The layer joins into op-fusion regions that the backend's runtime compiles.
    joins = op_fusion_lib.candidate_joins(graph, framework=backend)
    chosen = _choose_devices(graph, cluster, batch_size, devices, options.get("speeds"), cost,
                             algorithms, use_tensor, use_op, backend, joins)
    start = chosen.start
    base, timeline, ring = start.base, start.timeline, start.ring
    unfused, ddp_bounds, start_time = start.unfused, start.ddp_bounds, start.ring_time
    algorithms = list(timeline.algorithms)
    pricing = start.pricing_s
    names = timeline.var_names
    shares_from = "proportional"
    fusion_not_searched = False
    if use_op is None:
        # Plan regions only where the runtimes compile them by default (GPUs,
        # TensorFlow's XLA; torch.compile regions measured slower).
        use_op = op_fusion_lib.compiled_by_default(
            [cluster.device(d).kind for d in base.devices], framework=backend)
        fusion_not_searched = not use_op
    use_op = bool(use_op)
    if options.get("speeds") is None and len(base.replicas) > 1 and start_time is not None:
        # Shares that balance the predicted per-device step (compute and update):
        # kept when they predict a faster start than the speed-proportional ones.
        priced = time.perf_counter()
        balanced = chosen.balanced(start)
        if balanced is not None and balanced.ring_time < start_time * (1.0 - 1e-9):
            base, timeline, ring, start_time = (balanced.base, balanced.timeline, balanced.ring,
                                                balanced.ring_time)
            unfused = balanced.unfused
            shares_from = "balanced"
        pricing += time.perf_counter() - priced
    seeds = chosen.seeds
    seed_times = {name: timeline.step(unfused, b) for name, b in seeds.items()}
    seed = "ddp_25mb"
    if use_tensor and seed_times:
        seed = min(sorted(seed_times), key=lambda n: (seed_times[n], n))
    start_bounds = seeds.get(seed) or ddp_bounds or ((len(names),) if names else ())
    if progress is not None:
        progress.update(1)

    # Leave time for the final simulation: it prices every layer again and runs the
    # event loop, a few times what pricing the layers for the replay took.
    reserve = min(max(4.0 * pricing, 0.02), 0.4 * budget)
    deadline = started + budget - reserve
    search = _Search(timeline, joins, deadline, progress, use_op, use_tensor)
    state, bounds, _ = search.run(unfused, start_bounds)
    if progress is not None:
        progress.update(1)

    result, bucket_algorithm = _plan_from(base, graph, timeline, state, bounds)
    result.validate(graph, cluster)
    sim = simulate(graph, cluster, result, cost_model=cost, validate=False)
    notes = []
    base_result = None
    if start_time is not None and sim.step_time_s > start_time * (1.0 + 1e-9):
        # The search's closed form and the simulator disagree: trust the simulator.
        base_result = simulate(graph, cluster, base, cost_model=cost, validate=False)
        if sim.step_time_s > base_result.step_time_s:
            notes.append(
                "Disco's search result was predicted slower by the simulator "
                f"({sim.step_time_s * 1e3:.3f} ms) than {shares_from} shares with DDP "
                f"buckets ({base_result.step_time_s * 1e3:.3f} ms); kept the latter."
            )
            state, bounds = unfused, ddp_bounds
            result, bucket_algorithm = _plan_from(base, graph, ring, state, bounds)
            sim = base_result

    prediction = sim.to_prediction()
    bound = timeline.bound(state)
    if compare:
        if base_result is None:
            base_result = simulate(graph, cluster, base, cost_model=cost, validate=False)
        prediction.baselines["ddp_25mb"] = _figures(base_result.to_prediction())
        for name, layout in tensor_fusion.BASELINE_LAYOUTS.items():
            if name == "ddp_25mb":
                continue
            buckets = layout(graph)
            other = _with_layout(base, graph, buckets, ["ring"] * len(buckets), [])
            prediction.baselines[name] = _figures(
                simulate(graph, cluster, other, cost_model=cost, validate=False).to_prediction()
            )
        prediction.baselines["overlapped_bound"] = bound.to_dict()
        prediction.baselines["overlapped_bound_no_op_fusion"] = timeline.bound(unfused).to_dict()
    result.prediction = prediction

    if chosen.note:
        notes.append(chosen.note)
    notes += _notes(timeline, state, bounds, bucket_algorithm, result, sim, bound, start_time,
                    use_op, shares_from)
    if fusion_not_searched:
        notes.append(
            "Op fusion: not searched; the runtimes compile op-fusion regions by default "
            "only on GPUs under TensorFlow (XLA). torch.compile regions were measured "
            "slower than eager Keras on the CPU and on an NVIDIA H200 (AutoStrategy's "
            "op_fusion='on', or disco.plan(..., op_fusion=True), forces the search)."
        )
    if not sim.feasible:
        notes.append(
            f"Predicted not to fit in memory ({sim.infeasible_reason}). Disco changes neither "
            "the batch shares nor memory use; use a smaller batch, more devices, or a "
            "placement planner (FastT, HeteroG)."
        )
    if search.budget_exhausted:
        notes.append(
            f"The search stopped at its time budget ({budget:.2f} s) after "
            f"{timeline.evaluations} evaluations, so the result can depend on the machine's "
            "speed; a larger time_budget_s may find a faster plan."
        )
    result.notes = notes
    result.provenance.planner = "disco"
    result.provenance.options = {
        "algorithms": list(algorithms),
        "time_budget_s": budget,
        "op_fusion": use_op,
        "tensor_fusion": use_tensor,
        "speeds": options.get("speeds"),
        "shares": shares_from,
        "devices": list(devices) if devices is not None else None,
        "left_out": {name: reason for name, (reason, _) in chosen.left_out.items()},
        "search": {
            "seed": seed,
            "evaluations": timeline.evaluations,
            "passes": search.passes,
            "accepted_moves": dict(search.accepted),
            "budget_exhausted": search.budget_exhausted,
        },
    }
    result.provenance.graph_fingerprint = base.provenance.graph_fingerprint
    result.provenance.layer_order = base.provenance.layer_order
    result.provenance.cluster_fingerprint = base.provenance.cluster_fingerprint
    result.provenance.planning_time_s = time.perf_counter() - started
    return result


class _Start:
    """A data-parallel start on one device subset, priced for the search.

    `ring_time`: the proportional shares with DDP buckets and ring all-reduce
    (the reference the search never ends slower than); `score`: the best
    start the search begins from (the seed layouts and the re-solved buckets,
    no op fusion, each bucket's cheapest all-reduce), which subsets are
    compared by.
    """

    __slots__ = ("base", "timeline", "ring", "unfused", "ddp_bounds", "ring_time", "score",
                 "pricing_s", "balanced")


class _Choice:
    """The start `_choose_devices` keeps, the seed layouts, and what it left out and why.

    `balanced(start)`: the `_Start` of `start`'s shares balanced by predicted
    step (`_balanced_base`), or None; priced once per start.
    """

    __slots__ = ("start", "seeds", "left_out", "note", "balanced")

    def __init__(self, start, seeds, left_out, note, balanced):
        self.start, self.seeds, self.left_out, self.note = start, seeds, left_out, note
        self.balanced = balanced


def _price_start(graph, cluster, base, cost, algorithms, seeds, use_tensor, joins):
    """The `_Start` of the data-parallel plan `base`; `joins`: the search's first
    op-fusion move (every candidate join), or () when op fusion is not searched."""
    priced = time.perf_counter()
    if len(base.replicas) == 1:
        algorithms = algorithms[:1]
    start = _Start()
    start.base = base
    start.timeline = timeline = _Timeline(graph, cluster, base.replicas, cost, algorithms)
    start.unfused = timeline.state(())
    start.ring = timeline.with_algorithms(["ring"])
    start.ddp_bounds = tensor_fusion.bounds_of(timeline.var_names, base.buckets)
    start.ring_time = (start.ring.step(start.unfused, start.ddp_bounds)
                       if start.ddp_bounds is not None else None)
    start.pricing_s = time.perf_counter() - priced
    start.balanced = _UNPRICED
    if use_tensor:
        layouts = list(seeds.values())
        if timeline.var_names:
            layouts.append(timeline.optimal_bounds(start.unfused))
    else:
        layouts = [seeds.get("ddp_25mb") or start.ddp_bounds]
    times = [timeline.step(start.unfused, b) for b in layouts if b is not None]
    if joins and layouts and layouts[0] is not None:
        fused = timeline.state(joins)
        times.append(timeline.step(fused, timeline.optimal_bounds(fused) if use_tensor
                                   else layouts[0]))
    if start.ring_time is not None:
        times.append(start.ring_time)
    start.score = min(times) if times else 0.0
    return start


def _nodes_of(devices, cluster):
    """Dict node -> its devices among `devices` (both in the order given)."""
    nodes = {}
    for name in devices:
        nodes.setdefault(cluster.device(name).node, []).append(name)
    return nodes


def _gbit(cluster, node):
    return f"{cluster.nodes[node].nic_bandwidth * 8 / 1e9:g} Gbit/s"


def _smaller_sets(base, cluster):
    """Device subsets one step smaller than `base`'s: `(reason, node or None, devices)`.

    Without the slowest device type (the one whose devices get the fewest
    samples each, then the lowest peak FLOP/s); without the node behind the
    slowest network link (NIC bandwidth, then latency; among equals the one
    with the least peak FLOP/s, then the last; reason "link" when its link
    is slower than every other node's, else "weak node"); and without every
    node at the slowest link speed ("links"), when several share it and
    others are faster.
    """
    shares = {r.device: r.batch_share for r in base.replicas}
    devices = list(shares)
    by_type = {}
    for name in devices:
        by_type.setdefault(cluster.device(name).model, []).append(name)
    if len(by_type) > 1:
        slowest = min(by_type.values(), key=lambda names: (
            sum(shares[n] for n in names) / len(names),
            cluster.device(names[0]).peak_flops_fp32, names))
        yield "type", None, [n for n in devices if n not in slowest]
    nodes = _nodes_of(devices, cluster)
    if len(nodes) > 1:
        order = list(nodes)

        def key(node):
            spec = cluster.nodes[node]
            flops = sum(cluster.device(n).peak_flops_fp32 for n in nodes[node])
            return (spec.nic_bandwidth, -spec.nic_latency, flops, -order.index(node))

        worst = min(order, key=key)
        alone = all(cluster.nodes[worst].nic_bandwidth < cluster.nodes[n].nic_bandwidth
                    for n in order if n != worst)
        yield ("link" if alone else "weak node"), worst, [n for n in devices
                                                          if n not in nodes[worst]]
        slowest = min(cluster.nodes[n].nic_bandwidth for n in order)
        level = [n for n in order if cluster.nodes[n].nic_bandwidth <= slowest * (1 + 1e-9)]
        if 1 < len(level) < len(order):
            yield "links", tuple(level), [n for n in devices
                                          if cluster.device(n).node not in level]


def _choose_devices(graph, cluster, batch_size, devices, speeds, cost, algorithms, use_tensor,
                    use_op, backend, candidate_joins):
    """The device subset whose data-parallel start is predicted fastest.

    Candidates (each the proportional baseline on the subset, priced by
    `_price_start`; a few dozen at most, never every subset):

    - all devices, or, when the batch is smaller than the device count, the
      `batch_size` fastest (then best-connected) devices;
    - greedily from there, the best of `_smaller_sets` (the slowest type out,
      the worst-connected node out, every node at the slowest link speed out)
      while it predicts a faster start;
    - each node alone (the `MAX_NODE_STARTS` with the most peak FLOP/s; its
      fastest `batch_size` devices when the batch is smaller than its device
      count) and one device of each type alone: the best of these, descended
      from as above, when it ends faster.

    A subset other than the first candidate must also be faster once both
    take the balanced shares `plan` would give them.

    With `speeds` (measured speeds) the devices are kept as given, but for
    the cut to `batch_size` devices. `candidate_joins` (from
    `op_fusion.candidate_joins` for `backend`) price each start's first
    op-fusion move where op fusion is searched.

    Returns:
        A `_Choice`.

    Raises:
        PlanError: As `baselines.proportional` on all devices (or on the
            `batch_size` fastest ones).
    """
    names = [v.name for v in tensor_fusion.launch_order(graph)]
    seeds = {}
    for name, layout in tensor_fusion.BASELINE_LAYOUTS.items():
        bounds = tensor_fusion.bounds_of(names, layout(graph))
        if bounds is not None:
            seeds[name] = tuple(bounds)
    allowed = list(devices) if devices is not None else list(cluster.names)
    few = (isinstance(batch_size, int) and not isinstance(batch_size, bool)
           and 0 < batch_size < len(allowed) and len(set(allowed)) == len(allowed)
           and all(name in cluster for name in allowed))
    starts = {}

    def price(base):
        fuses = use_op
        if fuses is None:
            fuses = op_fusion_lib.compiled_by_default(
                [cluster.device(d).kind for d in base.devices], framework=backend)
        return _price_start(graph, cluster, base, cost, algorithms, seeds, use_tensor,
                            candidate_joins if fuses else ())

    def start_on(subset, strict=False):
        key = tuple(subset)
        if key not in starts:
            try:
                base = baselines.proportional(graph, cluster, batch_size, devices=list(key),
                                              speeds=speeds)
            except AutodistError:
                if strict:
                    raise
                starts[key] = None
            else:
                starts[key] = price(base)
        return starts[key]

    left_out = {}
    if few:
        top = set(_common.ranked_devices(allowed, cluster, speeds)[:batch_size])
        first = [n for n in allowed if n in top]
        for n in allowed:
            if n not in top:
                left_out[n] = ("batch", None)
    else:
        # All devices, validated (and errors raised) exactly as the proportional baseline.
        base = baselines.proportional(graph, cluster, batch_size, devices=devices, speeds=speeds)
        first = list(base.devices)
        starts[tuple(first)] = price(base)
    start = start_on(first, strict=True)
    full = None if few else start

    def balanced(start):
        if start.balanced is _UNPRICED:
            other = _balanced_base(start.base, graph, cluster, cost, batch_size)
            start.balanced = price(other) if other is not None else None
        return start.balanced

    if speeds is not None or start.ring_time is None:
        return _Choice(start, seeds, left_out, _left_out_note(left_out, start, full, cluster,
                                                              batch_size, len(allowed)), balanced)

    def descend(current, reasons):
        while True:
            best = None
            for reason, node, subset in _smaller_sets(current.base, cluster):
                if not subset:
                    continue
                other = start_on(subset)
                if other is None or not other.score < current.score * (1.0 - 1e-9):
                    continue
                if best is None or other.score < best[2].score * (1.0 - 1e-12):
                    best = (reason, node, other)
            if best is None:
                return current, reasons
            reason, node, other = best
            reasons = dict(reasons)
            for name in current.base.devices:
                if name not in other.base.devices:
                    reasons[name] = (reason, node)
            current = other

    best, reasons = descend(start, left_out)
    # Starts on fewer devices that the descent need not pass through: each node
    # alone (the MAX_NODE_STARTS with the most peak FLOP/s), and one device of each type.
    nodes = _nodes_of(allowed, cluster)
    order = list(nodes)
    alone = []
    if len(nodes) > 1:
        strongest = sorted(order, key=lambda n: (
            -sum(cluster.device(d).peak_flops_fp32 for d in nodes[n]),
            -cluster.nodes[n].nic_bandwidth, cluster.nodes[n].nic_latency, order.index(n)))
        for node in strongest[:MAX_NODE_STARTS]:
            members = nodes[node]
            if few and len(members) > batch_size:
                keep = set(_common.ranked_devices(members, cluster, speeds)[:batch_size])
                members = [n for n in members if n in keep]
            why = {n: ("node", node) for n in allowed if n not in nodes[node]}
            why.update({n: ("batch", None) for n in nodes[node] if n not in members})
            alone.append((members, why))
    # One device of each type (the best-connected): peak FLOP/s need not say which
    # runs the step fastest (memory-bound layers follow memory bandwidth).
    types = {}
    for name in _common.ranked_devices(allowed, cluster, speeds):
        types.setdefault(cluster.device(name).model, name)
    for name in types.values():
        alone.append(([name], {n: ("device", name) for n in allowed if n != name}))
    candidates = []
    for members, why in alone:
        other = start_on(members)
        if other is not None:
            candidates.append((other.score, len(candidates), other, why))
    if candidates:
        _, _, other, why = min(candidates, key=lambda c: c[:2])
        other, why = descend(other, why)
        if other.score < best.score * (1.0 - 1e-9):
            best, reasons = other, why
    if best is not start:
        # The plan starts from balanced shares when they predict a faster start than
        # proportional ones (see `plan`); the subset must beat the first devices so too.
        def effective(s):
            other = balanced(s) if len(s.base.replicas) > 1 else None
            if other is not None and other.ring_time < s.ring_time * (1.0 - 1e-9):
                return other.score
            return s.score

        if not effective(best) < effective(start) * (1.0 - 1e-9):
            best, reasons = start, left_out
    return _Choice(best, seeds, reasons,
                   _left_out_note(reasons, best, full, cluster, batch_size, len(allowed)),
                   balanced)


def _left_out_note(reasons, start, full, cluster, batch_size, count):
    """The plan's note naming the devices `_choose_devices` left out, and why."""
    if not reasons:
        return None
    groups = {}
    for name, reason in reasons.items():
        groups.setdefault(reason, []).append(name)
    parts = []
    for (reason, node), names in groups.items():
        if reason == "type":
            why = "too slow to pay for a share (at least one sample) and its all-reduce"
        elif reason == "link":
            why = (f"behind the slowest network link ({node}, {_gbit(cluster, node)}): the "
                   "all-reduce across it costs more than their share of the batch saves")
        elif reason == "weak node":
            why = (f"{node} has the least peak FLOP/s of the nodes behind the slowest links "
                   f"({_gbit(cluster, node)}): the all-reduce across the network costs more "
                   "than their share of the batch saves")
        elif reason == "links":
            why = (f"behind the slowest network links ({', '.join(node)}, "
                   f"{_gbit(cluster, node[0])}): the all-reduce across them costs more than "
                   "their share of the batch saves")
        elif reason == "node":
            why = (f"one node ({node}) alone is predicted faster than spreading the batch "
                   "across the network")
        elif reason == "device":
            why = f"one device ({node}) alone is predicted faster"
        else:
            why = (f"the batch ({batch_size}) is smaller than the device count ({count}), so "
                   "at most that many devices are used, the fastest and best-connected first")
        parts.append(f"{', '.join(names)}: {why}")
    kept = len(start.base.devices)
    text = (f"Left out {'; '.join(parts)}. The best start on the {kept} device(s) kept "
            f"(seed or re-solved buckets, unfused or every candidate pair fused) is predicted "
            f"{start.score * 1e3:.3f} ms")
    if full is not None:
        text += f", on all {len(full.base.devices)} devices {full.score * 1e3:.3f} ms"
    return text + "."


def _balanced_base(base, graph, cluster, cost, batch_size):
    """A copy of `base` whose shares balance each device's predicted step.

    A device's predicted step at `n` samples is its forward and backward
    time (the cost model, sampled on a grid of batch sizes and interpolated;
    convex and increasing in `n`) plus its optimizer update, which does not
    shrink with the share. Samples go one at a time to the device that would
    finish its step earliest with one more (water filling, optimal for
    increasing costs), each device keeping at least one sample and at most
    its predicted memory capacity. Speed-proportional shares ignore the
    fixed part and the memory-bound layers (whose speed follows memory
    bandwidth, not peak FLOP/s), so on mixed devices these shares finish
    the compute together where proportional ones do not.

    Returns:
        The `Plan`, or None when the shares equal `base`'s or the devices'
        memory cannot hold the batch.
    """
    import heapq

    replicas = base.groups[0].replicas
    devices = [r.device for r in replicas]
    grid = _common.batch_grid(batch_size)
    nodes = list(graph.nodes.values())
    ntensors = len(graph.variables)
    curves = {}
    per_device = []
    for name in devices:
        device = cluster.device(name)
        key = device_timing_key(device)
        if key not in curves:
            times = [
                sum(cost.layer_time(n, device, g, "forward") + cost.layer_time(n, device, g, "backward")
                    for n in nodes)
                for g in grid
            ]
            update = float(cost.replica_update_time(graph.param_bytes, device, ntensors))
            curves[key] = (np.array(times, dtype=float) + update)
        per_device.append(curves[key])
    caps = [baselines.memory_capacity_samples(graph, cluster, d) for d in devices]
    if min(caps) < 1 or sum(min(c, batch_size) for c in caps) < batch_size:
        return None
    xs = np.array(grid, dtype=float)

    def finish(i, n):
        return float(np.interp(n, xs, per_device[i]))

    shares = [1] * len(devices)
    heap = [(finish(i, 2), i) for i in range(len(devices)) if caps[i] > 1]
    heapq.heapify(heap)
    for _ in range(batch_size - len(devices)):
        if not heap:
            return None
        _, i = heapq.heappop(heap)
        shares[i] += 1
        if shares[i] < caps[i]:
            heapq.heappush(heap, (finish(i, shares[i] + 1), i))
    if shares == [r.batch_share for r in replicas]:
        return None
    return _with_layout(base, graph, base.buckets, ["ring"] * len(base.buckets), [],
                        shares=shares)


def _plan_from(base, graph, timeline, state, bounds):
    """The plan of a search state: buckets, per-bucket algorithms and op-fusion regions."""
    names = timeline.var_names
    buckets = tensor_fusion.buckets_from_bounds(names, bounds)
    prefix = timeline.prefix
    bucket_algorithm = [
        timeline.allreduce(prefix[hi] - prefix[lo])[1]
        for lo, hi in zip((0,) + tuple(bounds[:-1]), bounds)
    ]
    regions = op_fusion_lib.regions_from_joins(timeline.names, state.joins)
    return _with_layout(base, graph, buckets, bucket_algorithm, regions), bucket_algorithm


def _notes(timeline, state, bounds, bucket_algorithm, plan, sim, bound, start_time, use_op,
           shares_from="proportional"):
    notes = []
    prefix = timeline.prefix
    sizes = [(prefix[hi] - prefix[lo]) / 2**20 for lo, hi in zip((0,) + tuple(bounds[:-1]), bounds)]
    counts = {}
    for a in bucket_algorithm:
        counts[a] = counts.get(a, 0) + 1
    notes.append(
        f"Tensor fusion: {len(bounds)} gradient bucket(s)"
        + (f" of {min(sizes):.2f} to {max(sizes):.2f} MiB" if sizes else "")
        + (f", all-reduce by {', '.join(f'{a} x{n}' for a, n in sorted(counts.items()))}"
           if counts and len(plan.devices) > 1 else "")
        + ("; one device, so no all-reduce" if len(plan.devices) == 1 else "")
        + "."
    )
    if plan.op_fusion:
        absorbed = sum(
            len(timeline._run_contexts(timeline.index[r[0]], timeline.index[r[-1]]))
            for r in plan.op_fusion
        )
        notes.append(
            f"Op fusion: {len(plan.op_fusion)} region(s) absorbing {absorbed} memory-bound "
            "layer(s) into their producers' kernels; predicted compute saving "
            f"{timeline.compute_saving(state) * 1e3:.3f} ms per step on "
            f"{timeline.classes[0]['devices'][0]}."
        )
    elif use_op:
        notes.append("Op fusion: none kept (no fusion lowered the predicted step time).")
    step = sim.step_time_s
    text = f"Predicted step {step * 1e3:.3f} ms"
    if start_time:
        text += (
            f" vs {start_time * 1e3:.3f} ms for {shares_from} shares with DDP 25 MiB buckets "
            f"({(start_time / step - 1) * 100:.1f}% faster)"
        )
    if bound.step_time_s > 0:
        text += (
            f"; fully-overlapped bound {bound.step_time_s * 1e3:.3f} ms ({_binding(bound)})"
            f", Disco {max(step / bound.step_time_s - 1, 0.0) * 100:.1f}% above it"
        )
    notes.append(text + ".")
    return notes


def _binding(bound):
    """What sets the fully-overlapped bound, in words."""
    if bound.binding == "last all-reduce":
        return (f"compute-bound but for the last gradients' all-reduce, "
                f"{bound.tail_s * 1e3:.3f} ms after backward, which no layout hides")
    return f"{bound.binding}-bound"


def _figures(prediction):
    return {
        "step_time_s": prediction.step_time_s,
        "compute_s": prediction.compute_s,
        "exposed_comm_s": prediction.exposed_comm_s,
        "idle_s": prediction.idle_s,
        "feasible": prediction.feasible,
    }
