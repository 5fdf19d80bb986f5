"""Tensor fusion: which gradients are all-reduced together, and the best any layout can do.

A bucket layout is an ordered list of buckets, each a list of trainable
variable names whose gradients are flattened into one buffer and reduced by
one collective; buckets launch in list order, each as soon as its gradients
are ready and the previous bucket is done (the simulator's model, and what the
backends' reducers do). Every variable is in exactly one bucket.

Layouts compared by Disco (all in *launch order*: the order backward produces
gradients, last layer first):

- `no_fusion`: one bucket per variable (PyTorch DDP with a zero bucket cap).
- `ddp_buckets`: PyTorch DDP style, variables packed in launch order until a
  bucket would exceed 25 MiB (the same layout as the proportional and even
  baselines).
- `horovod_buckets`: Horovod style, a 64 MiB fusion threshold (Horovod fuses
  what is ready in one cycle up to `HOROVOD_FUSION_THRESHOLD`; statically,
  packing in readiness order up to the threshold).
- `chain_optimal_bounds`: the layout minimising the end of the all-reduce
  chain for given gradient-ready times (dynamic programming, exact for costs
  of the form `a + b * bytes`, see its docstring).

`overlapped_bound` is the fully-overlapped bound: the predicted step time if
communication were hidden behind compute as well as the ready times allow.
For device `d` with forward+backward compute `C_d` and optimizer update
`U_d`, gradients of total size `S` whose ready times (the latest over the
devices) are `r_v`, and `A(S)` the cheapest all-reduce of `S` bytes over the
members:

```
E     = max over ready times t of ( t + A(bytes of the gradients ready at or after t) )
bound = max over devices d of ( max(C_d, E) + U_d )
```

`E` says: no gradient can be reduced before it exists, the buckets run one
after another, and no layout reduces a set of gradients faster than one
all-reduce of their total size (true when `A` is subadditive, as every
`a + b * S` cost with `a >= 0` is). With `t` the earliest ready time this is
"all communication after the first gradient, at the one-bucket price"; with
`t` the latest it is the last bucket's tail. The bound is below the simulated
time of every bucket layout of the same plan (same replicas, op fusion and
all-reduce algorithms); on one device it equals the simulated time.

Example:

```python
layouts = {name: fn(graph) for name, fn in BASELINE_LAYOUTS.items()}
bound = overlapped_bound_of(graph, cluster, plan)
print(bound.step_time_s, bound.binding)
```
"""

import dataclasses

from autodist_keras.errors import PlanError
from autodist_keras.strategies.baselines import DDP_BUCKET_BYTES
from autodist_keras.strategies.baselines import HOROVOD_FUSION_BYTES
from autodist_keras.strategies.baselines import gradient_buckets

# Exposed communication up to this share of the bound still counts as compute-bound
# when it is only the last gradients' all-reduce (`OverlappedBound.binding`).
MINOR_EXPOSURE = 0.1


def launch_order(graph):
    """Trainable tensors in the order backward produces their gradients.

    The last layer's gradients come first; inside a layer, its variables in
    reverse creation order (as PyTorch DDP registers them).

    Args:
        graph: The `ModelGraph`.

    Returns:
        A list of `graph.TensorInfo`.
    """
    order = []
    for node in reversed(list(graph.nodes.values())):
        for tensor in reversed(node.variables):
            order.append(tensor)
    return order


def no_fusion(graph):
    """One bucket per variable, in launch order (no tensor fusion)."""
    return gradient_buckets(graph, 0)


def ddp_buckets(graph, bucket_bytes=DDP_BUCKET_BYTES):
    """PyTorch DDP style buckets: pack in launch order up to `bucket_bytes` (25 MiB).

    The first bucket is capped at 1 MiB, as DDP's is.

    Args:
        graph: The `ModelGraph`.
        bucket_bytes: Bucket cap in bytes. A variable larger than the cap
            gets a bucket of its own.

    Returns:
        A list of lists of variable names.
    """
    return gradient_buckets(graph, bucket_bytes)


def horovod_buckets(graph, threshold_bytes=HOROVOD_FUSION_BYTES):
    """Horovod style tensor fusion: pack in launch order up to a 64 MiB threshold.

    Args:
        graph: The `ModelGraph`.
        threshold_bytes: Horovod's fusion threshold in bytes.

    Returns:
        A list of lists of variable names.
    """
    return gradient_buckets(graph, threshold_bytes, first_bucket_bytes=None)


BASELINE_LAYOUTS = {
    "no_fusion": no_fusion,
    "ddp_25mb": ddp_buckets,
    "horovod_64mb": horovod_buckets,
}


def check_layout(graph, buckets):
    """Checks that a bucket layout covers every trainable variable exactly once.

    Args:
        graph: The `ModelGraph`.
        buckets: A list of lists of variable names.

    Returns:
        The layout as a list of lists.

    Raises:
        PlanError: If a bucket is empty, a name is unknown, or a variable is
            missing or repeated.
    """
    known = [v.name for v in graph.variables]
    known_set = set(known)
    seen = {}
    out = []
    for bi, bucket in enumerate(buckets):
        if isinstance(bucket, str) or not hasattr(bucket, "__iter__"):
            raise PlanError(f"buckets[{bi}] must be a list of variable names. Received: {bucket!r}")
        bucket = list(bucket)
        if not bucket:
            raise PlanError(f"buckets[{bi}] is empty; drop it. Received: []")
        for name in bucket:
            if name not in known_set:
                raise PlanError(
                    f"buckets[{bi}]: unknown variable {name!r}; bucket entries are the "
                    f"model's trainable variable paths. Received: {name!r}"
                )
            if name in seen:
                raise PlanError(
                    f"buckets[{bi}]: variable {name!r} is already in bucket {seen[name]}; "
                    f"each gradient is reduced once. Received: {name!r}"
                )
            seen[name] = bi
        out.append(bucket)
    missing = [name for name in known if name not in seen]
    if missing:
        raise PlanError(
            f"The bucket layout leaves out {len(missing)} variable(s), e.g. {missing[:3]}; "
            f"every trainable variable must be in one bucket. Received: {len(out)} buckets"
        )
    return out


def buckets_from_bounds(names, bounds):
    """Cuts a launch-ordered list of names at `bounds` (end indices, last = len(names))."""
    out, start = [], 0
    for end in bounds:
        out.append(list(names[start:end]))
        start = end
    return out


def bounds_of(names, buckets):
    """End indices of a contiguous layout over `names`, or None if it is not contiguous."""
    position = {name: i for i, name in enumerate(names)}
    bounds, expected = [], 0
    for bucket in buckets:
        idx = [position.get(name) for name in bucket]
        if None in idx or sorted(idx) != list(range(expected, expected + len(idx))):
            return None
        expected += len(idx)
        bounds.append(expected)
    return bounds if expected == len(names) else None


def chain_optimal_bounds(sizes, ready, affine_costs, start=0.0, split_ties=False):
    """The contiguous bucket layout that finishes the all-reduce chain first.

    Buckets are contiguous runs of the launch-ordered gradients; bucket `k`
    starts at `max(ready time of its last gradient, end of bucket k-1)` and
    takes `A(bytes) = min over (a, b) in affine_costs of a + b * bytes`.
    Because a bucket's end only grows with the previous bucket's end, the
    earliest end of the first `j` gradients obeys

    ```
    best[j] = min over i < j of max(ready[j-1], best[i]) + A(P[j] - P[i])
    ```

    (`P` the prefix sums of `sizes`), solved in `O(n^2)` vectorised steps.
    With `ready` non-decreasing (launch order) this is the exact optimum of
    the chain model for such costs.

    By default a bucket boundary only falls where the ready time changes:
    gradients ready at the same moment (one layer's, or one fused region's)
    stay together. With one algorithm this loses nothing (moving the rest of
    a tie group into the earlier bucket never ends the chain later) and it
    makes `n` the number of distinct ready times.

    Args:
        sizes: Bytes of each gradient, in launch order.
        ready: Ready time of each gradient (seconds), same order.
        affine_costs: List of `(a, b)` pairs, one per all-reduce algorithm.
        start: Time before which no all-reduce may start.
        split_ties: Allow boundaries between gradients with equal ready times.

    Returns:
        `(bounds, end)`: the end indices of the buckets and the chain's end.
    """
    import numpy as np

    n = len(sizes)
    if n == 0:
        return [], float(start)
    if len(ready) != n:
        raise PlanError(
            f"sizes and ready must have one entry per gradient. Received: {n} sizes, "
            f"{len(ready)} ready times"
        )
    if not split_ties:
        ends = [i + 1 for i in range(n) if i == n - 1 or ready[i + 1] != ready[i]]
        if len(ends) < n:
            starts = [0] + ends[:-1]
            unit_sizes = [sum(sizes[a:b]) for a, b in zip(starts, ends)]
            unit_ready = [ready[b - 1] for b in ends]
            unit_bounds, end = chain_optimal_bounds(
                unit_sizes, unit_ready, affine_costs, start=start, split_ties=True
            )
            return [ends[k - 1] for k in unit_bounds], end
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(sizes, dtype=float))])
    ready = np.asarray(ready, dtype=float)
    a = np.asarray([c[0] for c in affine_costs], dtype=float)[:, None]
    b = np.asarray([c[1] for c in affine_costs], dtype=float)[:, None]
    best = np.empty(n + 1)
    best[0] = float(start)
    choice = np.zeros(n + 1, dtype=int)
    for j in range(1, n + 1):
        span = prefix[j] - prefix[:j]
        cost = np.min(a + b * span[None, :], axis=0)
        cost[span <= 0] = 0.0
        cand = np.maximum(ready[j - 1], best[:j]) + cost
        i = int(np.argmin(cand))
        best[j] = cand[i]
        choice[j] = i
    bounds, j = [], n
    while j > 0:
        bounds.append(j)
        j = choice[j]
    return bounds[::-1], float(best[n])


@dataclasses.dataclass
class OverlappedBound:
    """The fully-overlapped bound of a data-parallel plan (predicted).

    Args:
        step_time_s: The bound: `max_d(max(C_d, E) + U_d)`.
        compute_s: The largest forward+backward compute time `max_d C_d`.
        comm_end_s: `E`, the earliest the gradient all-reduces can end.
        comm_s: `A(S)`, one all-reduce of every gradient.
        tail_s: The all-reduce of the gradients ready last.
        binding: `"compute"` when `max C_d >= E`; `"last all-reduce"` when
            only the all-reduce of the gradients ready last sticks out, and
            by at most `MINOR_EXPOSURE` of the bound (`E` = their ready time
            + `tail_s`: every earlier all-reduce is hidden, and no bucket
            layout can hide that one); else `"communication"`.
    """

    step_time_s: float
    compute_s: float
    comm_end_s: float
    comm_s: float
    tail_s: float
    binding: str

    def to_dict(self):
        return dataclasses.asdict(self)


def overlapped_bound(compute, update, ready, allreduce):
    """The fully-overlapped bound from the pieces of a simulated step.

    Args:
        compute: Dict from device name to its forward+backward compute time
            (the end of its last layer task).
        update: Dict from device name to its optimizer-update time.
        ready: List of `(ready_time, bytes)`, one per gradient, the ready
            time being the latest over the devices.
        allreduce: Callable `bytes -> seconds`, the cheapest all-reduce of
            that many bytes over the plan's devices.

    Returns:
        An `OverlappedBound`.
    """
    total = float(sum(b for _, b in ready))
    comm_all = allreduce(total) if total > 0 else 0.0
    comm_end, tail, last = 0.0, 0.0, 0.0
    if ready:
        by_time = sorted(ready, key=lambda rb: rb[0])
        remaining = total
        i = 0
        while i < len(by_time):
            t = by_time[i][0]
            cost = allreduce(remaining) if remaining > 0 else 0.0
            comm_end = max(comm_end, t + cost)
            tail, last = cost, t
            while i < len(by_time) and by_time[i][0] == t:
                remaining -= by_time[i][1]
                i += 1
    max_compute = max(compute.values(), default=0.0)
    step = 0.0
    for device, c in compute.items():
        step = max(step, max(c, comm_end) + update.get(device, 0.0))
    return OverlappedBound(
        step_time_s=step,
        compute_s=max_compute,
        comm_end_s=comm_end,
        comm_s=comm_all,
        tail_s=tail,
        binding=("compute" if max_compute >= comm_end
                 else "last all-reduce" if (comm_end <= (last + tail) * (1 + 1e-9)
                                            and comm_end - max_compute <= MINOR_EXPOSURE * step)
                 else "communication"),
    )


def plan_algorithms(plan):
    """The all-reduce algorithms a data-parallel plan's sync entries use."""
    algorithms = sorted({
        spec.algorithm or "ring" for spec in plan.sync.values() if spec.method == "allreduce"
    })
    return algorithms or ["ring"]


def overlapped_bound_of(graph, cluster, plan, cost_model=None, result=None, algorithms=None):
    """The fully-overlapped bound of a data-parallel all-reduce plan, from its simulation.

    The pieces come from `simulate(graph, cluster, plan)`: each device's
    compute end and update time, and each gradient's ready time (the end of
    its layer's backward, or of its op-fusion region's first layer).

    Args:
        graph: The `ModelGraph`.
        cluster: The `Cluster`.
        plan: A data-parallel `Plan` with all-reduce sync.
        cost_model: The cost model `simulate` uses (default analytic).
        result: A `SimResult` of this plan, to skip simulating again.
        algorithms: All-reduce algorithms `A` may use (default: those of
            the plan's sync entries).

    Returns:
        An `OverlappedBound`.

    Raises:
        PlanError: If the plan is not data-parallel with all-reduce sync.
    """
    from autodist_keras.estimator import simulate
    from autodist_keras.estimator.cost_model import AnalyticCostModel
    from autodist_keras.fusion.op_fusion import region_heads

    if not plan.is_data_parallel or any(s.method != "allreduce" for s in plan.sync.values()):
        raise PlanError(
            "The fully-overlapped bound is defined for data-parallel plans with all-reduce "
            "sync (one layer group, every variable all-reduced). Received: "
            f"{len(plan.groups)} group(s), sync methods {sorted({s.method for s in plan.sync.values()})}"
        )
    if result is None:
        result = simulate(graph, cluster, plan, cost_model=cost_model)
    cost = cost_model if cost_model is not None else AnalyticCostModel(cluster)
    if hasattr(cost, "with_cluster"):
        cost = cost.with_cluster(cluster)
    members = [r.device for r in plan.replicas]
    algorithms = list(algorithms or plan_algorithms(plan))

    compute = {d: 0.0 for d in members}
    forward_end = {d: 0.0 for d in members}
    update = {d: 0.0 for d in members}
    backward_end = {d: {} for d in members}
    for event in result.timeline:
        if event.device not in compute:
            continue
        if event.kind in ("forward", "backward"):
            compute[event.device] = max(compute[event.device], event.end)
            if event.kind == "backward":
                backward_end[event.device][event.name.rsplit(":", 1)[0]] = event.end
            else:
                forward_end[event.device] = max(forward_end[event.device], event.end)
        elif event.kind == "update":
            update[event.device] += event.end - event.start
    heads = region_heads(graph, plan.op_fusion)
    layer_ready = {}
    for device in members:
        last = forward_end[device]
        ends = backward_end[device]
        for layer in reversed(list(graph.nodes)):
            # A zero-length backward leaves no event: it ends when the previous one did.
            last = ends.get(layer, last)
            layer_ready[layer] = max(layer_ready.get(layer, last), last)
    ready = []
    for node in graph.nodes.values():
        head = heads.get(node.name, node.name)
        for v in node.variables:
            ready.append((layer_ready[head], int(v.bytes)))

    def allreduce(nbytes):
        return min(cost.allreduce_time(nbytes, members, a) for a in algorithms)

    return overlapped_bound(compute, update, ready, allreduce)
