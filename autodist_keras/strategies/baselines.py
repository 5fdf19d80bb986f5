"""Baseline plan builders: single device, even and proportional data parallelism.

These are the plans every smarter planner must beat, and the plans the runtime
runs before the planners exist. Each builder takes a `ModelGraph`, a `Cluster`
and a global batch size and returns a `Plan` with one data-parallel group, a
sync method for every trainable variable, and gradient buckets.

Example:

```python
graph = ModelGraph.from_keras(model)
cluster = Cluster.cpu_testbed()
plan = proportional(graph, cluster, batch_size=256, sync="allreduce")
print(plan.summary())
```
"""

import time

from autodist_keras.errors import PlanError
from autodist_keras.estimator import simulator
from autodist_keras.strategies.plan import LayerGroup
from autodist_keras.strategies.plan import Plan
from autodist_keras.strategies.plan import Provenance
from autodist_keras.strategies.plan import Replica
from autodist_keras.strategies.plan import SyncSpec
from autodist_keras.strategies.plan import split_batch

DDP_BUCKET_BYTES = 25 * 1024 * 1024
DDP_FIRST_BUCKET_BYTES = 1024 * 1024  # torch DDP's first bucket (its last layers' gradients)
HOROVOD_FUSION_BYTES = 64 * 1024 * 1024


def gradient_buckets(graph, bucket_bytes=DDP_BUCKET_BYTES, variables=None,
                     first_bucket_bytes=DDP_FIRST_BUCKET_BYTES):
    """Packs gradients into buckets in the order backward produces them.

    Backward runs from the last layer to the first, so the last layer's
    gradients are ready first. Variables are packed in reverse graph order
    until a bucket would exceed `bucket_bytes` (DDP-style). A variable larger
    than the threshold gets a bucket of its own. As in PyTorch DDP, the first
    bucket is capped lower (`first_bucket_bytes`, 1 MiB): the last layers'
    gradients start their all-reduce while backward is still running instead
    of waiting for 25 MiB of gradients.

    Args:
        graph: The `ModelGraph`.
        bucket_bytes: Size threshold in bytes. `None` or `0` puts each
            variable in its own bucket (no tensor fusion); `float("inf")`
            puts everything in one bucket.
        variables: Restrict to these variable names (default: all).
        first_bucket_bytes: Threshold of the first bucket (at most
            `bucket_bytes`); `None`, or an infinite `bucket_bytes`, applies
            `bucket_bytes` to every bucket (Horovod-style fusion has no
            smaller first bucket).

    Returns:
        A list of lists of variable names, in launch order.
    """
    order = []
    for node in reversed(list(graph.nodes.values())):
        for tensor in reversed(node.variables):
            if variables is None or tensor.name in variables:
                order.append(tensor)
    if not bucket_bytes:
        return [[t.name] for t in order]
    if bucket_bytes < 0:
        raise PlanError(f"bucket_bytes must be positive. Received: {bucket_bytes}")
    if first_bucket_bytes is not None and first_bucket_bytes <= 0:
        raise PlanError(
            f"first_bucket_bytes must be positive or None. Received: {first_bucket_bytes}"
        )
    whole = first_bucket_bytes is None or bucket_bytes == float("inf")
    first = bucket_bytes if whole else min(first_bucket_bytes, bucket_bytes)
    buckets, current, size = [], [], 0
    for tensor in order:
        cap = first if not buckets else bucket_bytes
        if current and size + tensor.bytes > cap:
            buckets.append(current)
            current, size = [], 0
        current.append(tensor.name)
        size += tensor.bytes
    if current:
        buckets.append(current)
    return buckets


def device_speeds(cluster, devices=None):
    """Relative compute speed of each device, from catalog peak FLOP/s.

    For CPU testbed devices the peak already reflects the cores they own or
    share, so a device owning a core is twice as fast as two sharing one.
    """
    devices = devices or cluster.names
    return {name: float(cluster.device(name).peak_flops_fp32) for name in devices}


def memory_capacity_samples(graph, cluster, device_name):
    """How many samples of this model fit on a device in one step (predicted).

    The same memory model as `simulate` (`simulator.replica_memory_terms`):
    static memory is parameters, gradients and the optimizer's slots per
    parameter (`graph.optimizer_slots`: Adam 2, plain SGD 0) plus
    non-trainable state; per-sample memory is every layer's activations
    kept for backward plus the backward gradient buffer (the largest layer
    output). They are divided into the device's usable memory
    (`simulator.usable_memory_bytes`: a GPU keeps a reserve for the CUDA
    context and allocator). A data-parallel all-reduce replica is predicted
    feasible by `simulate` exactly when its share is at most this number.

    Args:
        graph: The `ModelGraph`.
        cluster: The `Cluster`.
        device_name: A device of `cluster`.

    Returns:
        The number of samples (0 when the static memory alone does not fit).
    """
    device = cluster.device(device_name)
    static, per_sample = simulator.replica_memory_terms(graph)
    free = simulator.usable_memory_bytes(device) - static
    if free < 0:
        return 0
    if per_sample <= 0:
        return 1 << 62
    return int(free // per_sample)


def _memory_caps(graph, cluster, devices):
    """Predicted samples per device that fit; raises if a device holds none."""
    caps = {d: memory_capacity_samples(graph, cluster, d) for d in devices}
    empty = [d for d in devices if caps[d] < 1]
    if empty:
        usable = ", ".join(
            f"{d}: {simulator.usable_memory_bytes(cluster.device(d))}" for d in empty
        )
        raise PlanError(
            f"Devices {empty} cannot hold this model's parameters, gradients and optimizer "
            f"state with one sample ({graph.param_bytes} parameter bytes, counting "
            f"{simulator.optimizer_label(graph)}; usable memory in bytes {usable}, "
            "predicted). Leave them out with `devices=[...]`, or use a placement plan. "
            f"Received: devices={devices}"
        )
    return caps


def _shares_with_memory(graph, cluster, devices, weights, batch_size):
    """Proportional shares, capped by memory, the excess moved to devices with room."""
    caps = _memory_caps(graph, cluster, devices)
    if sum(caps.values()) < batch_size:
        short = ", ".join(f"{d}: {caps[d]}" for d in devices)
        raise PlanError(
            f"A global batch of {batch_size} samples does not fit in the devices' memory "
            f"(predicted capacity in samples per device: {short}; counting "
            f"{simulator.optimizer_label(graph)} and each GPU's reserve for the CUDA "
            "context and allocator). Use a smaller batch size or more devices. "
            f"Received: batch_size={batch_size}"
        )
    shares = dict(zip(devices, split_batch([weights[d] for d in devices], batch_size)))
    for _ in range(len(devices)):
        over = {d: shares[d] - caps[d] for d in devices if shares[d] > caps[d]}
        if not over:
            break
        excess = 0
        for d, extra in over.items():
            shares[d] = caps[d]
            excess += extra
        room = [d for d in devices if shares[d] < caps[d]]
        extra_parts = split_batch([weights[d] for d in room], excess)
        for d, part in zip(room, extra_parts):
            shares[d] += part
    return [shares[d] for d in devices]


def _data_parallel_plan(
    graph,
    cluster,
    batch_size,
    devices,
    shares,
    planner,
    sync,
    ps_server,
    algorithm,
    bucket_bytes,
    buckets,
    options,
    started,
):
    if sync not in ("allreduce", "ps"):
        raise PlanError(f"sync must be 'allreduce' or 'ps'. Received: {sync!r}")
    if sync == "ps":
        ps_server = ps_server or devices[0]
        if ps_server not in cluster.names:
            raise PlanError(
                f"ps_server must be a device of the cluster ({cluster.names}). "
                f"Received: {ps_server!r}"
            )
        spec = lambda: SyncSpec(method="ps", algorithm=None, server=ps_server)  # noqa: E731
    else:
        spec = lambda: SyncSpec(method="allreduce", algorithm=algorithm, server=None)  # noqa: E731
    variables = [v.name for v in graph.variables]
    if buckets is None:
        buckets = gradient_buckets(graph, bucket_bytes)
    plan = Plan(
        global_batch_size=batch_size,
        groups=[
            LayerGroup(
                name="all",
                layers=list(graph.nodes),
                replicas=[Replica(d, int(s)) for d, s in zip(devices, shares)],
            )
        ],
        sync={name: spec() for name in variables},
        buckets=[list(b) for b in buckets],
        provenance=Provenance(
            planner=planner,
            options=dict(options, sync=sync, ps_server=ps_server, algorithm=algorithm),
            graph_fingerprint=graph.fingerprint(),
            cluster_fingerprint=cluster.fingerprint(),
            layer_order=list(graph.nodes),
        ),
    )
    plan.validate(graph, cluster)
    plan.provenance.planning_time_s = time.perf_counter() - started
    return plan


def _resolve_devices(cluster, devices):
    names = list(devices) if devices is not None else list(cluster.names)
    if not names:
        raise PlanError("A plan needs at least one device. Received: []")
    for name in names:
        if name not in cluster.names:
            raise PlanError(
                f"Unknown device {name!r}; the cluster has {cluster.names}. Received: {name!r}"
            )
    return names


def _check_batch(batch_size, n):
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size <= 0:
        raise PlanError(f"batch_size must be a positive integer. Received: {batch_size!r}")
    if batch_size < n:
        raise PlanError(
            f"batch_size {batch_size} is smaller than the number of devices ({n}); every "
            f"replica needs at least one sample. Received: batch_size={batch_size}"
        )


def single_device(graph, cluster, batch_size, device=None, bucket_bytes=DDP_BUCKET_BYTES,
                  devices=None):
    """The whole batch on one device (the fastest by peak FLOP/s by default).

    Args:
        graph: The `ModelGraph`.
        cluster: The `Cluster`.
        batch_size: Global batch size.
        device: Device name; default the fastest of `devices`.
        bucket_bytes: Bucket threshold (irrelevant on one device, kept for
            a uniform plan layout).
        devices: The devices the user allowed (default: all of the
            cluster's); the default `device` is the fastest of them.

    Returns:
        A `Plan`.
    """
    started = time.perf_counter()
    _check_batch(batch_size, 1)
    if device is None:
        allowed = _resolve_devices(cluster, devices)
        speeds = device_speeds(cluster)
        device = max(allowed, key=lambda d: (speeds[d], -allowed.index(d)))
    devices = _resolve_devices(cluster, [device])
    return _data_parallel_plan(
        graph, cluster, batch_size, devices, [batch_size], "single_device", "allreduce",
        None, "ring", bucket_bytes, None, {"device": device}, started,
    )


def data_parallel_even(
    graph,
    cluster,
    batch_size,
    devices=None,
    sync="allreduce",
    ps_server=None,
    algorithm="ring",
    bucket_bytes=DDP_BUCKET_BYTES,
    buckets=None,
):
    """Even data parallelism: every device gets the same share (±1 sample).

    Args:
        graph: The `ModelGraph`.
        cluster: The `Cluster`.
        batch_size: Global batch size.
        devices: Device names to use (default: all).
        sync: `"allreduce"` or `"ps"`.
        ps_server: PS server device (default: the first device).
        algorithm: All-reduce algorithm: `"ring"`, `"tree"` or `"hierarchical"`.
        bucket_bytes: Gradient bucket threshold in bytes (default 25 MiB, as
            PyTorch DDP); 0 or None for one bucket per variable.
        buckets: Explicit bucket layout, overriding `bucket_bytes`.

    Returns:
        A `Plan`.
    """
    started = time.perf_counter()
    devices = _resolve_devices(cluster, devices)
    _check_batch(batch_size, len(devices))
    shares = split_batch([1] * len(devices), batch_size)
    return _data_parallel_plan(
        graph, cluster, batch_size, devices, shares, "data_parallel_even", sync, ps_server,
        algorithm, bucket_bytes, buckets, {"bucket_bytes": bucket_bytes}, started,
    )


def proportional(
    graph,
    cluster,
    batch_size,
    devices=None,
    speeds=None,
    sync="allreduce",
    ps_server=None,
    algorithm="ring",
    bucket_bytes=DDP_BUCKET_BYTES,
    buckets=None,
    step_costs=None,
):
    """Data parallelism with batch shares proportional to device speed.

    Shares are whole samples (largest-remainder rounding) and respect each
    device's predicted memory capacity: a device that cannot hold its share
    keeps what fits and the rest moves to devices with room.

    With `step_costs` (measured per-replica costs `fixed_s + per_sample_s *
    samples`), the shares instead balance those costs over the resources
    that run them (`share_balance.balanced_shares`): devices sharing CPU
    cores count as one resource, so a fixed per-replica cost paid twice on a
    shared core moves samples to the device that owns its core. The plan's
    notes and `provenance.options["step_costs"]` record the costs.

    Args:
        graph: The `ModelGraph`.
        cluster: The `Cluster`.
        batch_size: Global batch size.
        devices: Device names to use (default: all).
        speeds: Dict of measured relative speeds per device (e.g. samples/s);
            default: catalog peak FP32 FLOP/s.
        sync, ps_server, algorithm, bucket_bytes, buckets: As in
            `data_parallel_even`.
        step_costs: Optional dict `{device: StepCost | (fixed_s,
            per_sample_s) | {"fixed_s": ..., "per_sample_s": ...}}` of
            measured per-replica step costs in seconds (e.g. from
            `share_balance.fit_step_costs`), or the path of a JSON file
            holding one; replaces `speeds` for the shares.

    Returns:
        A `Plan`.

    Example:

    ```python
    costs = {d: (0.03, 0.002) for d in cluster.names}  # 30 ms + 2 ms per sample
    plan = proportional(graph, Cluster.cpu_testbed(), 96, step_costs=costs)
    ```
    """
    started = time.perf_counter()
    devices = _resolve_devices(cluster, devices)
    _check_batch(batch_size, len(devices))
    if step_costs is not None:
        return _balanced_plan(graph, cluster, batch_size, devices, step_costs, sync, ps_server,
                              algorithm, bucket_bytes, buckets, started)
    weights = dict(device_speeds(cluster, devices))
    if speeds is not None:
        unknown = [d for d in devices if d not in speeds]
        if unknown:
            raise PlanError(f"speeds has no entry for devices {unknown}. Received: {speeds}")
        weights = {d: float(speeds[d]) for d in devices}
    shares = _shares_with_memory(graph, cluster, devices, weights, batch_size)
    if min(shares) < 1:
        # Every replica keeps at least one sample, so all devices step together.
        shares = split_batch([max(w, 1e-9) for w in shares], batch_size)
        for i, s in enumerate(shares):
            if s == 0:
                donor = max(range(len(shares)), key=lambda j: shares[j])
                shares[donor] -= 1
                shares[i] = 1
    return _data_parallel_plan(
        graph, cluster, batch_size, devices, shares, "proportional", sync, ps_server,
        algorithm, bucket_bytes, buckets,
        {"bucket_bytes": bucket_bytes, "speeds": weights}, started,
    )


def _balanced_plan(graph, cluster, batch_size, devices, step_costs, sync, ps_server, algorithm,
                   bucket_bytes, buckets, started):
    """The proportional plan with shares that balance measured step costs."""
    from autodist_keras.strategies import share_balance

    costs = share_balance.load_step_costs(step_costs)
    caps = _memory_caps(graph, cluster, devices)
    shares = share_balance.balanced_shares(cluster, devices, costs, batch_size, caps=caps)
    costs = {d: costs[d] for d in devices}
    recorded = share_balance.step_costs_to_dict(costs)
    plan = _data_parallel_plan(
        graph, cluster, batch_size, devices, shares, "proportional", sync, ps_server,
        algorithm, bucket_bytes, buckets,
        {"bucket_bytes": bucket_bytes, "step_costs": recorded}, started,
    )
    busiest = share_balance.busiest_load_s(cluster, devices, costs, shares)
    described = ", ".join(
        f"{d} {c.fixed_s * 1e3:.2f} ms + {c.per_sample_s * 1e3:.4f} ms/sample"
        for d, c in costs.items()
    )
    plan.notes.append(
        "shares balance measured step costs (" + described + "); predicted busiest "
        f"resource {busiest * 1e3:.1f} ms per step from those costs"
    )
    return plan


BASELINES = {
    "single_device": single_device,
    "data_parallel_even": data_parallel_even,
    "proportional": proportional,
}
