"""Discrete-event simulation of one training step of a Plan on a Cluster.

`simulate(graph, cluster, plan)` turns the plan into a task graph and runs it
on simulated devices and links:

- Compute: one stream per device. A layer group's replica runs every layer of
  the group forward on its batch share, then backward. The stream is a list
  scheduler: whenever it is free it starts the ready task of highest priority
  (`plan.order[device]` if given, else topological order forward and reverse
  topological order backward; the optimizer update comes last). It never
  idles while a task is ready (work-conserving).
- Activations: when a layer and its input's producer are in groups on
  different devices, the samples the two replicas have in common (replicas
  hold consecutive sample ranges of the global batch, in replica order) move
  over the link: `edge bytes per sample x samples` forward, the same back as
  gradients in backward. This covers placement plans (FastT), split ops (a
  group of one layer on several devices) and hybrid plans (HeteroG).
- Links: every device has a send and a receive port, every node a NIC send
  and receive port. A transfer occupies the sender's send port and the
  receiver's receive port (and both NICs across nodes) for
  `cost_model.transfer_time`; a collective occupies the ports of all its
  members (and the NICs of their nodes when it spans nodes). Transfers that
  need a busy port wait: requests are served first come, first served
  (those ready at the same instant in task order: bucket order, then replica
  order), so transfers through one port are serialised.
- Gradient synchronisation: `plan.buckets` in launch order. A bucket's
  variables are split by owning group and sync method. An all-reduce bucket
  starts when every member replica has produced the bucket's gradients, one
  at a time per communicator (its member set) and in bucket order, as
  PyTorch DDP does, on a communication stream separate from compute (so it
  overlaps with the rest of backward). A parameter-server bucket is pushed by
  each client to the server as soon as that client's gradients are ready
  (serialised on the server's receive port), summed and applied on the
  server's compute stream, and pulled back by every client.
- Optimizer update: per device, after its compute and its all-reduces,
  memory-bound (`cost_model.update_time`) for the variables it updates; a
  PS client's end of step follows its pulls, the server's its applies.
- Memory: parameters, gradients and optimizer slots (`graph.optimizer_slots`
  per parameter, read from the compiled optimizer: Adam 2, plain SGD 0; PS
  clients keep none, the server keeps them) plus live activations: each
  layer's output and what it saves for backward (`activation_bytes x share`;
  attention keeps its probabilities) from the start of its forward to the end
  of its backward, received activations from arrival until the consumer's
  backward ends, and the backward gradient buffer (the largest output of a
  replica's layers x its share, the largest of the device's replicas) from the
  device's first backward to its last. A device whose peak exceeds its usable memory
  (`usable_memory_bytes`: a GPU keeps `memory_reserve_bytes` for the CUDA
  context and the allocator) makes the plan infeasible (the device and the
  shortfall are named).

Every figure is a prediction from the cost model, not a measurement.

For data-parallel plans the compute timeline of replicas on identical devices
with identical shares and orders is identical, so it is simulated once per
such class and copied (`dedupe=True`); communication is always simulated per
device.

Example:

```python
result = simulate(graph, cluster, plan)
print(result.step_time_s, result.feasible)
result.export_trace("step.json")          # open in https://ui.perfetto.dev
plan.prediction = result.to_prediction()
```
"""

import collections
import copy
import dataclasses
import heapq
import json
import math
import os
import threading
from typing import Optional

from autodist_keras.errors import EstimatorError
from autodist_keras.errors import PlanError
from autodist_keras.estimator.cost_model import AnalyticCostModel
from autodist_keras.graph.model_graph import DEFAULT_OPTIMIZER_SLOTS
from autodist_keras.strategies.plan import Prediction
from autodist_keras.strategies.plan import output_target
from autodist_keras.strategies.plan import write_text_atomic

# What a GPU keeps from its nominal memory for the CUDA context, the framework's
# allocator (fragmentation, cached blocks) and kernels' workspace: plans may not use it.
GPU_MEMORY_RESERVE_BYTES = 512 * 2**20
GPU_MEMORY_RESERVE_FRACTION = 0.05


def memory_reserve_bytes(device):
    """Bytes of a device's memory that plans may not use (predicted overheads).

    A GPU loses memory to the CUDA context (a few hundred MiB), to the
    framework allocator's caching and fragmentation, and to kernels'
    workspace (cuDNN), none of which the memory model counts. A GPU
    therefore keeps `GPU_MEMORY_RESERVE_BYTES` (512 MiB) plus
    `GPU_MEMORY_RESERVE_FRACTION` (5%) of its memory in reserve. Other
    devices (CPU testbed devices, host RAM) keep none.

    Args:
        device: A `Device` of a `Cluster`.

    Returns:
        The reserve in bytes (at most the device's memory).
    """
    memory = int(device.memory_bytes)
    if getattr(device, "kind", None) != "gpu":
        return 0
    reserve = GPU_MEMORY_RESERVE_BYTES + int(GPU_MEMORY_RESERVE_FRACTION * memory)
    return min(reserve, max(memory, 0))


def usable_memory_bytes(device):
    """The memory a plan may fill on a device: its memory less its reserve.

    The simulator's feasibility check, `baselines.memory_capacity_samples`
    and the planners all use this figure (see `memory_reserve_bytes`).

    Args:
        device: A `Device` of a `Cluster`.

    Returns:
        Usable bytes (0 or more).

    Example:

    ```python
    cluster = Cluster.from_string("1xV100")
    usable_memory_bytes(cluster.device(cluster.names[0]))  # 16 GiB - 512 MiB - 5% of 16 GiB
    ```
    """
    return max(int(device.memory_bytes) - memory_reserve_bytes(device), 0)


def optimizer_slots_of(graph):
    """Optimizer slots per parameter the memory model counts for `graph`.

    `graph.optimizer_slots` (read from the compiled optimizer by
    `ModelGraph.from_keras`), or `DEFAULT_OPTIMIZER_SLOTS` (2, as Adam) for graphs without it.
    """
    return int(getattr(graph, "optimizer_slots", DEFAULT_OPTIMIZER_SLOTS))


def optimizer_label(graph):
    """`"2 optimizer slots per parameter (Adam)"`: what the memory model counted."""
    slots = optimizer_slots_of(graph)
    name = getattr(graph, "optimizer", None) or "optimizer unknown, as Adam"
    return f"{slots} optimizer slot{'' if slots == 1 else 's'} per parameter ({name})"


def gradient_buffer_bytes(nodes):
    """Per-sample bytes of the backward gradient buffer of a replica of `nodes`.

    While backward runs, the gradient flowing back through a layer is as
    large as that layer's output; the memory model keeps, on each device that
    runs backward, one buffer the size of the largest output of its
    replicas' layers (x their shares) from its first backward to its last.

    Args:
        nodes: The replica's `LayerNode`s.

    Returns:
        Bytes per sample.
    """
    return max((int(n.output_bytes) for n in nodes), default=0)


def replica_memory_terms(graph):
    """`(static, per_sample)` bytes of a replica of the whole model (predicted).

    A data-parallel (all-reduce) replica holding `n` samples needs
    `static + n x per_sample` bytes: static = parameters, gradients and
    `optimizer_slots_of(graph)` slots per parameter plus non-trainable
    state; per sample = every layer's `activation_bytes` plus the backward
    gradient buffer (`gradient_buffer_bytes`). `simulate` predicts exactly
    this peak for such a replica, and `baselines.memory_capacity_samples`
    divides the usable memory by it, so the two agree.

    Args:
        graph: The `ModelGraph`.

    Returns:
        A tuple of two ints.
    """
    nodes = list(graph.nodes.values())
    static = int(graph.param_bytes) * (2 + optimizer_slots_of(graph)) + sum(
        int(n.non_trainable_bytes or 0) for n in nodes
    )
    per_sample = sum(int(n.activation_bytes) for n in nodes) + gradient_buffer_bytes(nodes)
    return static, per_sample


def _format_bytes(n):
    """`"12.3 MiB"`, or KiB / bytes when under 0.1 MiB."""
    if abs(n) >= 0.1 * 2**20:
        return f"{n / 2**20:.1f} MiB"
    if abs(n) >= 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{int(n)} bytes"

_COMPUTE, _XFER, _COLLECTIVE, _UPDATE, _BARRIER = 0, 1, 2, 3, 4


def device_timing_key(device):
    """What makes two devices identical to the simulator: they run a layer in the
    same time (kind, model, FP32 and FP16 peaks, memory bandwidth).

    Args:
        device: A `Device`.

    Returns:
        A hashable tuple; equal for devices a cost model prices alike.

    Example:

    ```python
    curves = {}
    curves.setdefault(device_timing_key(cluster.device("node0/gpu0")), [])
    ```
    """
    return (device.kind, device.model, device.peak_flops_fp32, device.peak_flops_fp16,
            device.memory_bandwidth)


@dataclasses.dataclass
class SimEvent:
    """One interval on one stream of one device (predicted).

    Args:
        device: Device name.
        stream: `"compute"` or `"comm"`.
        name: What ran, e.g. `"conv1:forward"` or `"allreduce b3 (ring)"`.
        start: Start time in seconds from the beginning of the step.
        end: End time in seconds.
        kind: `"forward"`, `"backward"`, `"update"`, `"transfer"`,
            `"allreduce"`, `"ps_push"`, `"ps_pull"` or `"ps_update"`.
    """

    device: str
    stream: str
    name: str
    start: float
    end: float
    kind: str


@dataclasses.dataclass
class DeviceStats:
    """Per-device breakdown of the simulated step (predicted).

    Args:
        busy_s: Time the compute stream is running something.
        exposed_comm_s: Time the device communicates while its compute
            stream is idle.
        idle_s: The rest of the step: neither computing nor communicating.
        comm_s: Time the device communicates at all (overlapped or not).
        peak_memory_bytes: Predicted peak memory.
        memory_bytes: The device's memory capacity (nominal).
        memory_breakdown: Bytes of parameters, gradients, optimizer slots,
            peak live activations (`activations_peak`) and the backward
            gradient buffer live at that peak (`gradient_buffer`); they sum
            to `peak_memory_bytes`.
        usable_memory_bytes: What a plan may use: `memory_bytes` less the
            reserve (`memory_reserve_bytes`; 0 on CPUs). The device is short
            when `peak_memory_bytes` exceeds it.
    """

    busy_s: float
    exposed_comm_s: float
    idle_s: float
    comm_s: float
    peak_memory_bytes: int
    memory_bytes: int
    memory_breakdown: dict
    usable_memory_bytes: Optional[int] = None


@dataclasses.dataclass
class SimResult:
    """What `simulate` predicts for one training step.

    Args:
        step_time_s: Predicted time of one step, in seconds.
        per_device: Dict from device name to `DeviceStats`.
        peak_memory_bytes: Dict from device name to predicted peak bytes.
        feasible: False when some device's memory is exceeded.
        infeasible_reason: Which devices are short and by how many bytes.
        critical_device: The device that finishes last (then the busiest;
            ties within `CRITICAL_RTOL` of the step go to the first in
            device order).
        num_tasks: Number of simulated tasks.
        cost_model: The cost model's description.

    The `timeline` property lists every `SimEvent`, sorted by start time; it
    is built on first access (a large simulation has tens of thousands).
    """

    step_time_s: float
    per_device: dict
    peak_memory_bytes: dict
    feasible: bool
    infeasible_reason: Optional[str]
    critical_device: Optional[str]
    num_tasks: int = 0
    cost_model: dict = dataclasses.field(default_factory=dict)

    @property
    def timeline(self):
        """Every simulated interval as a `SimEvent`, sorted by start time."""
        cached = self.__dict__.get("_timeline")
        if cached is None:
            source = self.__dict__.get("_timeline_source")
            cached = _build_timeline(*source) if source is not None else []
            self.__dict__["_timeline"] = cached
            self.__dict__.pop("_timeline_source", None)
        return cached

    def to_prediction(self):
        """Returns the result as a `strategies.plan.Prediction` (labelled predicted)."""
        crit = self.per_device.get(self.critical_device)
        return Prediction(
            step_time_s=self.step_time_s,
            compute_s=crit.busy_s if crit else 0.0,
            exposed_comm_s=crit.exposed_comm_s if crit else 0.0,
            idle_s=crit.idle_s if crit else 0.0,
            peak_memory_bytes=dict(self.peak_memory_bytes),
            feasible=self.feasible,
            infeasible_reason=self.infeasible_reason,
            per_device={
                name: {
                    "busy_s": s.busy_s,
                    "exposed_comm_s": s.exposed_comm_s,
                    "idle_s": s.idle_s,
                    "comm_s": s.comm_s,
                    "peak_memory_bytes": s.peak_memory_bytes,
                }
                for name, s in self.per_device.items()
            },
            source="simulator (predicted)",
        )

    def trace(self, other_data=None):
        """Returns the timeline as a Chrome trace dict (`traceEvents`).

        Args:
            other_data: Optional dict of more entries for `otherData`.
        """
        devices = list(self.per_device)
        for event in self.timeline:
            if event.device not in self.per_device and event.device not in devices:
                devices.append(event.device)
        pid = {name: i + 1 for i, name in enumerate(devices)}
        tids = {"compute": 1, "comm": 2}
        events = []
        for name in devices:
            events.append(
                {"ph": "M", "name": "process_name", "pid": pid[name], "tid": 0,
                 "args": {"name": name}}
            )
            for stream, tid in tids.items():
                events.append(
                    {"ph": "M", "name": "thread_name", "pid": pid[name], "tid": tid,
                     "args": {"name": stream}}
                )
        for e in self.timeline:
            events.append(
                {
                    "ph": "X",
                    "name": e.name,
                    "cat": e.kind,
                    "pid": pid[e.device],
                    "tid": tids.get(e.stream, 3),
                    "ts": e.start * 1e6,
                    "dur": (e.end - e.start) * 1e6,
                }
            )
        return {
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "otherData": {
                "source": "autodist_keras simulator (predicted, not measured)",
                "step_time_s": self.step_time_s,
                "feasible": self.feasible,
                **(other_data or {}),
            },
        }

    def export_trace(self, path, other_data=None):
        """Writes the timeline as Chrome trace JSON (opens in Perfetto / chrome://tracing).

        Args:
            path: File to write.
            other_data: Optional dict of more entries for the trace's `otherData`.

        Returns:
            The path.

        Raises:
            EstimatorError: If a figure is NaN or infinite, which the strict JSON
                that trace viewers read cannot hold (nothing is written).
            OutputError: If `path` names no file to write (not a path, empty, a
                directory) or cannot be written (checked before the trace is made).
        """
        from autodist_keras.estimator.profiler import json_text

        # A path that names no file or cannot be written: an OutputError before the trace.
        output_target(path, "trace.json")
        write_text_atomic(path, json_text(self.trace(other_data), os.fspath(path)))
        return path

    def summary(self):
        """A short plain-text table of the per-device breakdown."""
        lines = [
            f"Predicted step time: {self.step_time_s * 1e3:.3f} ms "
            f"({'feasible' if self.feasible else 'INFEASIBLE: ' + str(self.infeasible_reason)})",
            f"{'device':<18}{'busy ms':>10}{'exp.comm ms':>13}{'idle ms':>10}{'peak MiB':>11}",
        ]
        for name, s in self.per_device.items():
            lines.append(
                f"{name:<18}{s.busy_s * 1e3:>10.3f}{s.exposed_comm_s * 1e3:>13.3f}"
                f"{s.idle_s * 1e3:>10.3f}{s.peak_memory_bytes / 2**20:>11.1f}"
            )
        return "\n".join(lines)


def batch_ranges(shares):
    """Consecutive `(start, end)` sample ranges of shares: `[2, 3] -> [(0, 2), (2, 5)]`."""
    out, offset = [], 0
    for s in shares:
        out.append((offset, offset + s))
        offset += s
    return out


def range_overlaps(ranges_a, ranges_b):
    """Yields (i, j, samples) for every overlapping pair of two sorted range lists.

    Used wherever one replica set's batch shares feed another's: replica `j`
    of the consumer receives `samples` samples from replica `i` of the
    producer.
    """
    i = j = 0
    while i < len(ranges_a) and j < len(ranges_b):
        a0, a1 = ranges_a[i]
        b0, b1 = ranges_b[j]
        n = min(a1, b1) - max(a0, b0)
        if n > 0:
            yield i, j, n
        if a1 <= b1:
            i += 1
        else:
            j += 1


def _union_length(intervals):
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        elif e > cur_e:
            cur_e = e
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def _merge(intervals):
    merged = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            if e > merged[-1][1]:
                merged[-1][1] = e
        else:
            merged.append([s, e])
    return merged


def _subtract_length(intervals, minus):
    """Length of union(intervals) not covered by union(minus)."""
    a = _merge(intervals)
    b = _merge(minus)
    total, j = 0.0, 0
    for s, e in a:
        covered = 0.0
        while j < len(b) and b[j][1] <= s:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            covered += min(e, b[k][1]) - max(s, b[k][0])
            k += 1
        total += (e - s) - covered
    return total


class _Tasks:
    """Column store of simulation tasks (lists are faster than objects here)."""

    def __init__(self):
        self.kind, self.name, self.dur, self.stream, self.ports = [], [], [], [], []
        self.prio, self.ndeps, self.succ, self.where = [], [], [], []
        self.alloc, self.free, self.span = [], [], []
        # Spans: [device, bytes, tasks not yet finished, started]; memory held
        # from the first of their tasks to start until the last one ends.
        self.spans = []

    def add(self, kind, name, dur, stream, ports, prio, where, evkind):
        self.kind.append(kind)
        self.name.append(name)
        self.dur.append(float(dur))
        self.stream.append(stream)
        self.ports.append(ports)
        self.prio.append(prio)
        self.ndeps.append(0)
        self.succ.append([])
        self.where.append((where, evkind))
        self.alloc.append(None)
        self.free.append(None)
        self.span.append(None)
        return len(self.kind) - 1

    def dep(self, before, after):
        self.succ[before].append(after)
        self.ndeps[after] += 1


CACHE_SIZE = 32  # simulated results kept (analytic cost model only), least recently used out
# Devices whose last end (then busy time) lie within this fraction of the step
# of the largest tie for critical device; the first in device order wins, so
# float noise (figures equal up to rounding) never decides which one it is.
CRITICAL_RTOL = 1e-9
_cache = collections.OrderedDict()
_cache_lock = threading.Lock()
cache_stats = {"hits": 0, "misses": 0}


def clear_cache():
    """Forgets every cached simulation result (see `simulate`'s `cache`)."""
    with _cache_lock:
        _cache.clear()
        cache_stats.update(hits=0, misses=0)


def _cache_key(graph, cluster, plan, cost_model, dedupe):
    """A key for a plan's simulation, or None when it must not be cached.

    Only the default analytic cost model (or an `AnalyticCostModel` whose
    config is the key) is cached: a profiled or learned model may change
    its answers. The graph and cluster are keyed by identity (the entry
    keeps them alive, so an id is not reused while cached); the plan by the
    JSON of what the simulation reads (batch, groups, sync, buckets, order,
    op fusion), not its prediction, provenance or notes.
    """
    if cost_model is None:
        cost_model = AnalyticCostModel()
    if type(cost_model) is AnalyticCostModel and getattr(cost_model, "cluster", None) in (
        None, cluster
    ):
        cost_key = json.dumps(cost_model.config(), sort_keys=True, default=str)
    else:
        return None
    body = json.dumps(
        [
            plan.global_batch_size,
            [[g.name, list(g.layers), [[r.device, r.batch_share] for r in g.replicas]]
             for g in plan.groups],
            sorted([k, v.method, v.algorithm, v.server] for k, v in plan.sync.items()),
            plan.buckets,
            {k: [list(e) for e in v] for k, v in (plan.order or {}).items()},
            [list(r) if isinstance(r, (list, tuple)) else r for r in (plan.op_fusion or [])],
        ],
        sort_keys=True, default=str,
    )
    return (id(graph), optimizer_slots_of(graph), id(cluster), cost_key, bool(dedupe), body)


def simulate(graph, cluster, plan, cost_model=None, validate=True, dedupe=True, cache=True):
    """Simulates one training step of `plan` for `graph` on `cluster`.

    Args:
        graph: The `ModelGraph`.
        cluster: The `Cluster`.
        plan: The `Plan` (any mix of data-parallel, placement, split-op and
            hybrid groups).
        cost_model: A `CostModel`; default `AnalyticCostModel(cluster)`.
        validate: Check the plan against the graph and cluster first.
        dedupe: Simulate the compute of identical data-parallel replicas once
            (same result, faster). Set False to simulate every device.
        cache: Reuse the result of an identical earlier simulation (same
            graph and cluster objects, same plan content, the default
            analytic cost model); the last `CACHE_SIZE` results are kept.
            Planners and the auto search simulate the same baselines and
            final plans several times; this makes the repeats free.

    Returns:
        A `SimResult`. Every number in it is a prediction.

    Raises:
        PlanError: If the plan does not match the graph or cluster.
        EstimatorError: If the cost model cannot price a part of the plan.

    Example:

    ```python
    plan = baselines.proportional(graph, cluster, 256)
    result = simulate(graph, cluster, plan)
    print(result.summary())
    ```
    """
    if validate:
        plan.validate(graph, cluster)
    key = _cache_key(graph, cluster, plan, cost_model, dedupe) if cache else None
    if key is not None:
        with _cache_lock:
            entry = _cache.get(key)
            if entry is not None:
                _cache.move_to_end(key)
                cache_stats["hits"] += 1
                return copy.copy(entry[0])
            cache_stats["misses"] += 1
    result = _simulate(graph, cluster, plan, cost_model, dedupe)
    if key is not None:
        with _cache_lock:
            _cache[key] = (result, graph, cluster)
            while len(_cache) > CACHE_SIZE:
                _cache.popitem(last=False)
        return copy.copy(result)
    return result


def _simulate(graph, cluster, plan, cost_model, dedupe):
    if cost_model is None:
        cost_model = AnalyticCostModel(cluster)
    elif hasattr(cost_model, "with_cluster"):
        cost_model = cost_model.with_cluster(cluster)
    if plan.op_fusion:
        # Fused regions: absorbed layers lose launches and memory traffic (fusion/op_fusion.py).
        from autodist_keras.fusion.op_fusion import fused_cost_model

        cost_model = fused_cost_model(cost_model, graph, plan.op_fusion)
    return _Simulation(graph, cluster, plan, cost_model, dedupe).run()


class _Simulation:
    def __init__(self, graph, cluster, plan, cost, dedupe):
        self.graph, self.cluster, self.plan, self.cost = graph, cluster, plan, cost
        self.dedupe = dedupe

    # ------------------------------------------------------------ building
    def _setup_devices(self):
        plan = self.plan
        names = list(plan.devices)
        for spec in plan.sync.values():
            if spec.method == "ps" and spec.server and spec.server not in names:
                names.append(spec.server)
        self.dev_names = names
        self.dev_index = {n: i for i, n in enumerate(names)}
        try:
            self.devs = [self.cluster.device(n) for n in names]
        except (KeyError, ValueError) as e:
            raise PlanError(
                f"The plan uses a device the cluster does not have; validate the plan "
                f"against this cluster. Received: {e}"
            ) from None
        nodes = []
        self.dev_node = []
        for d in self.devs:
            if d.node not in nodes:
                nodes.append(d.node)
            self.dev_node.append(nodes.index(d.node))
        n = len(names)
        self.num_ports = 2 * n + 2 * len(nodes)

    def _p2p_ports(self, a, b):
        ports = (2 * a, 2 * b + 1)
        na, nb = self.dev_node[a], self.dev_node[b]
        if na != nb:
            base = 2 * len(self.devs)
            ports += (base + 2 * na, base + 2 * nb + 1)
        return ports

    def _group_ports(self, members):
        ports = []
        nodes = set()
        for m in members:
            ports += [2 * m, 2 * m + 1]
            nodes.add(self.dev_node[m])
        if len(nodes) > 1:
            base = 2 * len(self.devs)
            for nd in sorted(nodes):
                ports += [base + 2 * nd, base + 2 * nd + 1]
        return tuple(ports)

    def _priorities(self):
        names = list(self.graph.nodes)
        n = len(names)
        default = {}
        for i, name in enumerate(names):
            default[(name, "forward")] = i
            default[(name, "backward")] = 2 * n - 1 - i
        self.n_prio = 2 * n
        self.default_prio = default
        self.dev_prio = {}
        for device, entries in (self.plan.order or {}).items():
            table = {}
            for k, entry in enumerate(entries):
                layer, phase = entry[0], entry[1]
                table.setdefault((layer, phase), k)
            base = len(entries)
            self.dev_prio[device] = (table, base)

    def _prio(self, device, layer, phase):
        found = self.dev_prio.get(device)
        if found is None:
            return self.default_prio[(layer, phase)]
        table, base = found
        p = table.get((layer, phase))
        return p if p is not None else base + self.default_prio[(layer, phase)]

    def build(self):
        graph, plan, cost = self.graph, self.plan, self.cost
        self._setup_devices()
        self._priorities()
        T = self.tasks = _Tasks()
        n_dev = len(self.devs)
        update_prio = 10 * (self.n_prio + 1)
        for name in self.dev_names:
            found = self.dev_prio.get(name)
            if found is not None:
                update_prio = max(update_prio, 10 * (found[1] + self.n_prio + 1))
        self.update_prio = update_prio

        layer_group = {}
        for gi, group in enumerate(plan.groups):
            for layer in group.layers:
                layer_group[layer] = gi
        self.layer_group = layer_group
        group_ranges = [batch_ranges(g.shares) for g in plan.groups]
        group_devs = [[self.dev_index[r.device] for r in g.replicas] for g in plan.groups]

        # Replica classes: identical devices with identical shares and orders
        # share one compute timeline in a data-parallel plan.
        alias = [list(range(len(g.replicas))) for g in plan.groups]
        ps_servers = {s.server for s in plan.sync.values() if s.method == "ps"}
        if self.dedupe and len(plan.groups) == 1:
            seen = {}
            group = plan.groups[0]
            for ri, r in enumerate(group.replicas):
                d = self.cluster.device(r.device)
                if r.device in ps_servers:
                    continue
                key = (
                    device_timing_key(d), r.batch_share,
                    tuple(map(tuple, plan.order.get(r.device, ()))) if plan.order else (),
                )
                if key in seen:
                    alias[0][ri] = seen[key]
                else:
                    seen[key] = ri
        self.alias = alias

        # Compute tasks.
        F, B = {}, {}
        dev_compute = [[] for _ in range(n_dev)]
        time_cache = {}
        for layer, node in graph.nodes.items():
            gi = layer_group[layer]
            group = plan.groups[gi]
            for ri, r in enumerate(group.replicas):
                if alias[gi][ri] != ri:
                    continue
                di = group_devs[gi][ri]
                dev = self.devs[di]
                for phase, table in (("forward", F), ("backward", B)):
                    # Everything of the device a cost model prices by: devices that
                    # differ only in their FP16 peak or kind must not share times.
                    key = (layer, device_timing_key(dev), r.batch_share, phase)
                    dur = time_cache.get(key)
                    if dur is None:
                        dur = cost.layer_time(node, dev, r.batch_share, phase)
                        time_cache[key] = dur
                    t = T.add(
                        _COMPUTE, f"{layer}:{phase}", dur, di,
                        None, self._prio(r.device, layer, phase) * 10, (di,), phase,
                    )
                    table[(layer, ri)] = t
                    dev_compute[di].append(t)
                act = node.activation_bytes * r.batch_share
                if act:
                    T.alloc[F[(layer, ri)]] = [(di, act)]
                    T.free[B[(layer, ri)]] = [(di, act)]
                T.dep(F[(layer, ri)], B[(layer, ri)])
        self.dev_compute = dev_compute
        # The backward gradient buffer of each device: the largest of its replicas'
        # (`gradient_buffer_bytes` x share), held from its first backward to its last.
        buffer_size = [0] * n_dev
        buffer_tasks = [[] for _ in range(n_dev)]
        for gi, group in enumerate(plan.groups):
            per_sample = gradient_buffer_bytes(graph.nodes[layer] for layer in group.layers)
            for ri, r in enumerate(group.replicas):
                if alias[gi][ri] != ri:
                    continue
                di = group_devs[gi][ri]
                buffer_size[di] = max(buffer_size[di], per_sample * r.batch_share)
                buffer_tasks[di] += [B[(layer, ri)] for layer in group.layers]
        for di in range(n_dev):
            if buffer_size[di] and buffer_tasks[di]:
                span = len(T.spans)
                T.spans.append([di, buffer_size[di], len(buffer_tasks[di]), False])
                for t in buffer_tasks[di]:
                    T.span[t] = span

        def rep(gi, ri):
            return alias[gi][ri]

        same_group_pairs = []
        for gi, group in enumerate(plan.groups):
            reps = [ri for ri in range(len(group.replicas)) if alias[gi][ri] == ri]
            pairs = [(ri, ri, group.replicas[ri].batch_share) for ri in reps]
            same_group_pairs.append([p for p in pairs if p[2] > 0] or pairs)

        # Data dependencies and activation transfers. A producer's output is
        # sent once to each device that consumes it (TensorFlow sends one copy
        # per tensor and device), however many layers there read it; their
        # gradients are summed there and sent back once.
        links = {}  # (src, src device, dst device, first, last sample) -> link
        for src, dst, nbytes in graph.edges:
            gs, gd = layer_group[src], layer_group[dst]
            if gs == gd:
                pairs = same_group_pairs[gs]
            else:
                pairs = list(range_overlaps(group_ranges[gs], group_ranges[gd]))
            for rs, rd, samples in pairs:
                ds, dd = group_devs[gs][rs], group_devs[gd][rd]
                fs, fd = F[(src, rep(gs, rs))], F[(dst, rep(gd, rd))]
                bs, bd = B[(src, rep(gs, rs))], B[(dst, rep(gd, rd))]
                if ds == dd:
                    T.dep(fs, fd)
                    T.dep(bd, bs)
                    continue
                a0, a1 = group_ranges[gs][rs]
                b0, b1 = group_ranges[gd][rd]
                key = (src, ds, dd, max(a0, b0), min(a1, b1))
                link = links.get(key)
                if link is None:
                    link = links[key] = {"bytes": 0, "samples": samples, "fs": fs, "bs": bs,
                                         "to": []}
                link["bytes"] += nbytes
                link["to"].append((dst, fd, bd))
        for (src, ds, dd, _, _), link in links.items():
            per_sample = link["bytes"]
            produced = graph.nodes[src].output_bytes
            if produced and len(link["to"]) > 1:
                # The distinct tensors of `src` that reach `dd`: at most all its outputs.
                per_sample = min(per_sample, produced)
            size = per_sample * link["samples"]
            first = link["to"][0][0]
            more = f" (+{len(link['to']) - 1} more)" if len(link["to"]) > 1 else ""
            fwd = T.add(
                _XFER, f"{src}->{first}{more} activations",
                cost.transfer_time(size, self.dev_names[ds], self.dev_names[dd]),
                -1, self._p2p_ports(ds, dd), 0, (ds, dd), "transfer",
            )
            T.dep(link["fs"], fwd)
            bwd = T.add(
                _XFER, f"{first}{more}->{src} gradients",
                cost.transfer_time(size, self.dev_names[dd], self.dev_names[ds]),
                -1, self._p2p_ports(dd, ds), 0, (dd, ds), "transfer",
            )
            for _, fd, bd in link["to"]:
                T.dep(fwd, fd)
                T.dep(bd, bwd)
            T.dep(bwd, link["bs"])
            if size:
                T.alloc[fwd] = [(dd, size)]
                # Held until its last reader's backward: with one reader, freed
                # when that backward ends; with several, after the summed gradient
                # is sent (which waits for all of them).
                holder = link["to"][0][2] if len(link["to"]) == 1 else bwd
                T.free[holder] = (T.free[holder] or []) + [(dd, size)]

        # Loss: the backward of every output waits for the forward of every
        # output of its replica.
        outputs = [o for o in graph.outputs if o in layer_group]
        for o in outputs:
            for o2 in outputs:
                if o2 != o and layer_group[o2] == layer_group[o]:
                    gi = layer_group[o]
                    for ri in range(len(plan.groups[gi].replicas)):
                        if rep(gi, ri) == ri:
                            T.dep(F[(o2, ri)], B[(o, ri)])

        self._build_sync(F, B, group_devs)
        return T

    def _build_sync(self, F, B, group_devs):
        graph, plan, cost, T = self.graph, self.plan, self.cost, self.tasks
        n_dev = len(self.devs)
        var_layer, var_bytes = {}, {}
        for layer, node in graph.nodes.items():
            for v in node.variables:
                var_layer.setdefault(v.name, layer)
                var_bytes.setdefault(v.name, int(v.bytes))
        heads = {}
        if plan.op_fusion:
            from autodist_keras.fusion.op_fusion import region_heads

            heads = {
                layer: head for layer, head in region_heads(graph, plan.op_fusion).items()
                if self.layer_group[head] == self.layer_group[layer]
            }
        buckets = [list(b) for b in (plan.buckets or [])]
        covered = {v for b in buckets for v in b}
        for layer in reversed(list(graph.nodes)):
            for v in reversed(graph.nodes[layer].variables):
                if v.name not in covered:
                    buckets.append([v.name])
                    covered.add(v.name)

        # Static memory per device.
        params = [0] * n_dev
        grads = [0] * n_dev
        slots = [0] * n_dev
        n_slots = optimizer_slots_of(graph)
        local_update = [[0, 0] for _ in range(n_dev)]  # bytes, tensors
        update_deps = [[] for _ in range(n_dev)]
        for gi, group in enumerate(plan.groups):
            non_trainable = sum(
                int(graph.nodes[layer].non_trainable_bytes or 0) for layer in group.layers
            )
            for di in group_devs[gi]:
                params[di] += non_trainable

        comm_last = {}
        self.comm_tasks = []
        self._done_barrier = {}
        for bi, bucket in enumerate(buckets):
            parts = {}
            for v in bucket:
                layer = var_layer.get(v)
                if layer is None:
                    continue
                gi = self.layer_group[layer]
                spec = plan.sync.get(v)
                if spec is None or spec.method == "allreduce":
                    key = (gi, "allreduce", spec.algorithm if spec and spec.algorithm else "ring")
                else:
                    key = (gi, "ps", spec.server)
                parts.setdefault(key, []).append(v)
            for (gi, method, arg), names in parts.items():
                group = plan.groups[gi]
                members = group_devs[gi]
                nbytes = sum(var_bytes[v] for v in names)
                # A fused region's gradients are ready when its first layer's backward ends.
                layers = sorted(
                    {heads.get(var_layer[v], var_layer[v]) for v in names},
                    key=list(graph.nodes).index,
                )
                ready = [
                    [B[(layer, self.alias[gi][ri])] for layer in layers]
                    for ri in range(len(members))
                ]
                for di in members:
                    params[di] += nbytes
                    grads[di] += nbytes
                local = len(members) == 1 and (method == "allreduce" or members[0] == self.dev_index[arg])
                if method == "allreduce" or local:
                    for di in members:
                        slots[di] += n_slots * nbytes
                        local_update[di][0] += nbytes
                        local_update[di][1] += len(names)
                    if local:
                        continue
                    names_m = [self.dev_names[d] for d in members]
                    dur = cost.allreduce_time(nbytes, names_m, arg)
                    t = T.add(
                        _COLLECTIVE, f"allreduce b{bi} ({arg}, {nbytes} B)", dur, -1,
                        self._group_ports(members), 0, tuple(members), "allreduce",
                    )
                    seen = set()
                    for row in ready:
                        for b in row:
                            if b not in seen:
                                seen.add(b)
                                T.dep(b, t)
                    comm_key = frozenset(members)
                    if comm_key in comm_last:
                        T.dep(comm_last[comm_key], t)
                    comm_last[comm_key] = t
                    for di in members:
                        update_deps[di].append(t)
                    self.comm_tasks.append(t)
                    continue
                # Parameter server.
                server = self.dev_index[arg]
                if server not in members:
                    params[server] += nbytes
                    grads[server] += nbytes
                slots[server] += n_slots * nbytes
                upd = T.add(
                    _UPDATE, f"ps apply b{bi} ({nbytes} B)",
                    cost.aggregate_time(nbytes, len(members), self.dev_names[server])
                    + cost.update_time(nbytes, self.dev_names[server], len(names)),
                    server, None, self.update_prio - 5, (server,), "ps_update",
                )
                # The server's own end of step (its host time, any local update)
                # follows the applies, as a client's follows its pulls: ready
                # earlier, it would hold the compute stream between two applies and
                # delay every later pull (session 30: a server 2x faster made a PS
                # step under PyTorch 47% slower).
                update_deps[server].append(upd)
                for ri, di in enumerate(members):
                    if di == server:
                        for b in ready[ri]:
                            T.dep(b, upd)
                        continue
                    name = self.dev_names[di]
                    push = T.add(
                        _XFER, f"ps push b{bi} ({nbytes} B)",
                        cost.transfer_time(nbytes, name, arg), -1,
                        self._p2p_ports(di, server), 0, (di, server), "ps_push",
                    )
                    for b in ready[ri]:
                        T.dep(b, push)
                    T.dep(push, upd)
                    pull = T.add(
                        _XFER, f"ps pull b{bi} ({nbytes} B)",
                        cost.transfer_time(nbytes, arg, name), -1,
                        self._p2p_ports(server, di), 0, (server, di), "ps_pull",
                    )
                    T.dep(upd, pull)
                    # The replica's own end of step (its host time, any local update)
                    # follows its pull.
                    update_deps[di].append(pull)
                    self.comm_tasks += [push, pull]

        # Per-device optimizer update, after the device's compute and all-reduces.
        self.memory_static = [
            {"parameters": params[i], "gradients": grads[i], "optimizer_slots": slots[i]}
            for i in range(n_dev)
        ]
        replica_devices = {self.dev_index[r.device] for g in self.plan.groups for r in g.replicas}
        for di in range(n_dev):
            nbytes, ntensors = local_update[di]
            if ntensors:
                duration = self.cost.replica_update_time(nbytes, self.devs[di], ntensors)
                label = f"optimizer update ({nbytes} B)"
            else:
                # Every replica pays the step's fixed host time, also when a parameter
                # server applies all of its updates (the runtime's ranks step anyway).
                duration = (self.cost.step_overhead_time(self.devs[di])
                            if di in replica_devices else 0.0)
                label = "step host time"
            if duration <= 0 and not ntensors:
                continue
            t = T.add(
                _UPDATE, label, duration, di, None, self.update_prio, (di,), "update",
            )
            T.dep(self._compute_done(self._rep_device(di)), t)
            for c in update_deps[di]:
                T.dep(c, t)

    def _rep_device(self, di):
        """The device whose compute timeline device `di` copies (itself if none)."""
        if self.dev_compute[di] or len(self.plan.groups) != 1:
            return di
        group = self.plan.groups[0]
        name = self.dev_names[di]
        for ri, r in enumerate(group.replicas):
            if r.device == name:
                return self.dev_index[group.replicas[self.alias[0][ri]].device]
        return di

    def _compute_done(self, di):
        """A zero-time barrier task that ends when device `di` has no compute left."""
        done = self._done_barrier.get(di)
        if done is None:
            T = self.tasks
            done = T.add(_BARRIER, "compute done", 0.0, -1, None, 0, (di,), "barrier")
            for c in self.dev_compute[di]:
                T.dep(c, done)
            self._done_barrier[di] = done
        return done

    # -------------------------------------------------------------- running
    def run(self):
        T = self.build()
        n = len(T.kind)
        n_dev = len(self.devs)
        dur, stream, ports, prio, succ = T.dur, T.stream, T.ports, T.prio, T.succ
        ndeps = list(T.ndeps)
        alloc, free = T.alloc, T.free
        span, spans = T.span, [list(sp) for sp in T.spans]
        start = [0.0] * n
        end = [0.0] * n
        port_free = [0.0] * self.num_ports
        busy = [False] * n_dev
        ready_q = [[] for _ in range(n_dev)]
        events = []
        live = [0] * n_dev
        peak_live = [0] * n_dev
        buffers = [0] * n_dev  # live backward gradient buffers (part of `live`)
        peak_buffers = [0] * n_dev
        dirty = set()
        pending = []  # link tasks made ready at `now`, not yet given their ports
        done = 0
        now = 0.0

        def begin(t, now):
            start[t] = now
            e = now + dur[t]
            end[t] = e
            sp = span[t]
            if sp is not None and not spans[sp][3]:
                spans[sp][3] = True
                di, size = spans[sp][0], spans[sp][1]
                live[di] += size
                buffers[di] += size
                if live[di] > peak_live[di]:
                    peak_live[di] = live[di]
                    peak_buffers[di] = buffers[di]
            a = alloc[t]
            if a is not None:
                for di, size in a:
                    live[di] += size
                    if live[di] > peak_live[di]:
                        peak_live[di] = live[di]
                        peak_buffers[di] = buffers[di]
            heapq.heappush(events, (e, t))

        def make_ready(t, now):
            s = stream[t]
            if s >= 0:
                heapq.heappush(ready_q[s], (prio[t], t))
                dirty.add(s)
                return
            # Link tasks wait until every event of this instant is processed: those
            # that became ready together reserve their ports in task order below.
            pending.append(t)

        def reserve(t, now):
            p = ports[t]
            at = now
            if p:
                for q in p:
                    if port_free[q] > at:
                        at = port_free[q]
                e = at + dur[t]
                for q in p:
                    port_free[q] = e
            begin(t, at)

        for t in range(n):
            if ndeps[t] == 0:
                make_ready(t, 0.0)
        while True:
            if pending:
                # Transfers and collectives that became ready at the same instant
                # take their ports in task order (bucket order, then replica order),
                # not in the order their dependencies' events were processed: with
                # de-duplication one representative's event releases the transfers
                # of all its copies at once, so that order would differ from
                # simulating every device (session 30: a PS plan, 1.3% apart).
                pending.sort()
                for t in pending:
                    reserve(t, now)
                pending.clear()
            for s in list(dirty):
                if not busy[s] and ready_q[s]:
                    _, t = heapq.heappop(ready_q[s])
                    busy[s] = True
                    begin(t, now)
            dirty.clear()
            if not events:
                break
            now = events[0][0]
            while events and events[0][0] == now:
                _, t = heapq.heappop(events)
                done += 1
                fr = free[t]
                if fr is not None:
                    for di, size in fr:
                        live[di] -= size
                sp = span[t]
                if sp is not None:
                    spans[sp][2] -= 1
                    if not spans[sp][2]:
                        live[spans[sp][0]] -= spans[sp][1]
                        buffers[spans[sp][0]] -= spans[sp][1]
                s = stream[t]
                if s >= 0:
                    busy[s] = False
                    dirty.add(s)
                for u in succ[t]:
                    ndeps[u] -= 1
                    if ndeps[u] == 0:
                        make_ready(u, now)
        if done != n:
            stuck = [T.name[t] for t in range(n) if ndeps[t] > 0][:5]
            raise EstimatorError(
                "The simulation stopped with tasks still waiting: the plan's layer "
                "groups depend on each other in a cycle. Check the plan's groups and "
                f"order. Received: waiting tasks {stuck}"
            )
        self.start, self.end, self.peak_live = start, end, peak_live
        self.peak_buffers = peak_buffers
        return self._result()

    # ------------------------------------------------------------- results
    def _result(self):
        T = self.tasks
        n_dev = len(self.devs)
        start, end, kinds = self.start, self.end, T.kind
        step = max(end) if end else 0.0
        # Aliased devices copy their representative's compute timeline.
        copies = {}
        if len(self.plan.groups) == 1:
            group = self.plan.groups[0]
            for ri, r in enumerate(group.replicas):
                a = self.alias[0][ri]
                if a != ri:
                    src = self.dev_index[group.replicas[a].device]
                    copies.setdefault(src, []).append(self.dev_index[r.device])
        layer_iv = [[] for _ in range(n_dev)]  # forward/backward, shared by copies
        own_iv = [[] for _ in range(n_dev)]  # updates on the device itself
        comm_iv = [[] for _ in range(n_dev)]
        for t in range(len(kinds)):
            s, e = start[t], end[t]
            if e <= s:
                continue
            k = kinds[t]
            where = T.where[t][0]
            if k == _COMPUTE:
                layer_iv[where[0]].append((s, e))
            elif k == _UPDATE:
                own_iv[where[0]].append((s, e))
            elif k != _BARRIER:
                for d in where:
                    comm_iv[d].append((s, e))
        source = list(range(n_dev))
        for src, targets in copies.items():
            for d in targets:
                source[d] = src

        peak_live = list(self.peak_live)
        per_device, peaks, short = {}, {}, []
        last_end = [0.0] * n_dev
        merged_layers = {}
        for d, name in enumerate(self.dev_names):
            src = source[d]
            if src not in merged_layers:
                merged_layers[src] = (
                    _merge(layer_iv[src]), sum(e - s for s, e in layer_iv[src])
                )
            merged, layer_busy = merged_layers[src]
            compute = merged + [list(iv) for iv in own_iv[d]] if own_iv[d] else merged
            busy = layer_busy + sum(e - s for s, e in own_iv[d])
            comm_len = _union_length(comm_iv[d])
            exposed = _subtract_length(comm_iv[d], compute) if comm_iv[d] else 0.0
            last_end[d] = max(
                [e for _, e in compute[-1:]] + [e for _, e in own_iv[d]]
                + [e for _, e in comm_iv[d]] + [0.0]
            )
            at = d if peak_live[d] >= peak_live[src] else src
            live = peak_live[at]
            buffer = self.peak_buffers[at]
            static = self.memory_static[d]
            peak = int(sum(static.values()) + live)
            capacity = int(self.devs[d].memory_bytes)
            usable = usable_memory_bytes(self.devs[d])
            per_device[name] = DeviceStats(
                busy_s=busy,
                exposed_comm_s=exposed,
                idle_s=max(step - busy - exposed, 0.0),
                comm_s=comm_len,
                peak_memory_bytes=peak,
                memory_bytes=capacity,
                memory_breakdown=dict(static, activations_peak=int(live - buffer),
                                      gradient_buffer=int(buffer)),
                usable_memory_bytes=usable,
            )
            peaks[name] = peak
            if peak > usable:
                has = (
                    f"has {capacity}" if usable == capacity else
                    f"can use {usable} of its {capacity} ({capacity - usable} reserved for "
                    "the CUDA context and allocator)"
                )
                # The first shortfall says which optimizer's slots were counted
                # (long reasons are shortened at their end).
                counted = "" if short else f", counting {optimizer_label(self.graph)},"
                short.append(
                    f"{name} needs {peak} bytes{counted} but {has} "
                    f"(short by {peak - usable} bytes, {_format_bytes(peak - usable)})"
                )
        critical = None
        if n_dev:
            # The device finishing last, then the busiest of those; ties within
            # CRITICAL_RTOL of the step go to the first in device order.
            tol = CRITICAL_RTOL * step
            latest = max(last_end)
            last = [d for d in range(n_dev) if last_end[d] >= latest - tol]
            busy = [per_device[self.dev_names[d]].busy_s for d in last]
            busiest = max(busy)
            critical = self.dev_names[next(d for d, b in zip(last, busy) if b >= busiest - tol)]
        config = (
            self.cost.config() if hasattr(self.cost, "config")
            else {"type": type(self.cost).__name__}
        )
        result = SimResult(
            step_time_s=step,
            per_device=per_device,
            peak_memory_bytes=peaks,
            feasible=not short,
            infeasible_reason="; ".join(short) if short else None,
            critical_device=critical,
            num_tasks=len(kinds),
            cost_model=config,
        )
        result._timeline_source = (T, start, end, copies, list(self.dev_names))
        return result


def _build_timeline(tasks, start, end, copies, dev_names):
    events = []
    for t in range(len(tasks.kind)):
        s, e = start[t], end[t]
        k = tasks.kind[t]
        if e <= s or k == _BARRIER:
            continue
        where, evkind = tasks.where[t]
        name = tasks.name[t]
        if k == _COMPUTE or k == _UPDATE:
            targets = [where[0]] + (copies.get(where[0], []) if k == _COMPUTE else [])
            for d in targets:
                events.append(SimEvent(dev_names[d], "compute", name, s, e, evkind))
        else:
            for d in where:
                events.append(SimEvent(dev_names[d], "comm", name, s, e, evkind))
    events.sort(key=lambda ev: (ev.start, ev.device, ev.stream))
    return events
