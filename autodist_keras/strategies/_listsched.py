"""List scheduling of a model's training graph over devices (HEFT and CPOP).

Shared by the FastT and HeteroG planners. The training graph has a forward
task and a backward task per layer replica: forward follows the model's
edges, backward runs them in reverse, each layer's backward needs its own
forward, and the backward of every output needs the forward of every output
(the loss). A layer is either *free* (one replica with the whole batch, its
device chosen by the scheduler) or *fixed* (replicas on given devices with
given batch shares: a pinned layer or a FastT split op).

Two list schedulers (Topcuoglu et al., IEEE TPDS 2002):

- HEFT: tasks by decreasing upward rank (mean cost of the task plus the
  longest mean-cost path to the end), each free forward task on the device
  where it finishes earliest.
- CPOP: tasks by decreasing upward + downward rank; the critical path's free
  tasks all go to the one device that runs the whole path fastest, the
  others to their earliest-finish device.

Both are memory-aware: a device takes a free layer only if its parameters,
gradients, optimizer slots, activations and received inputs still fit
(the same accounting as the simulator, counting every activation as live,
so a schedule that fits here fits there). The schedule's makespan is a
cheap proxy used during search; plans are always scored by
`estimator.simulate` in the end.

Example:

```python
tables = CostTables(graph, cluster, AnalyticCostModel(cluster))
schedule = list_schedule(tables, batch=256, method="heft")
print(schedule.makespan, schedule.placement())
```
"""

import heapq

from autodist_keras.estimator.cost_model import AnalyticCostModel
from autodist_keras.estimator.simulator import batch_ranges
from autodist_keras.estimator.simulator import optimizer_slots_of
from autodist_keras.estimator.simulator import range_overlaps
from autodist_keras.estimator.simulator import usable_memory_bytes
from autodist_keras.graph.model_graph import DEFAULT_OPTIMIZER_SLOTS
from autodist_keras.strategies.baselines import DDP_BUCKET_BYTES
from autodist_keras.strategies.plan import split_batch

MEMORY_MARGIN = 0.99  # use at most this fraction of a device's usable memory
FORWARD, BACKWARD = 0, 1
PHASE_NAMES = ("forward", "backward")
_EPS = 1e-12


def resolve_cost_model(cluster, cost_model):
    """Returns `cost_model` bound to `cluster` (default: `AnalyticCostModel`)."""
    if cost_model is None:
        return AnalyticCostModel(cluster)
    if hasattr(cost_model, "with_cluster"):
        return cost_model.with_cluster(cluster)
    return cost_model


def static_bytes(node, optimizer_slots=DEFAULT_OPTIMIZER_SLOTS):
    """Bytes a layer keeps on every device holding a replica of it (predicted).

    Parameters, gradients and `optimizer_slots` slots per trainable
    parameter (the graph's `optimizer_slots`; Adam's two by default), plus
    non-trainable state: what the simulator charges an all-reduce or local
    replica.
    """
    return (2 + int(optimizer_slots)) * int(node.param_bytes) + int(node.non_trainable_bytes or 0)


class CostTables:
    """Cached costs of one model on a set of devices, from a cost model.

    Args:
        graph: The `ModelGraph`.
        cluster: The `Cluster`.
        cost_model: A `CostModel` bound to `cluster`.
        devices: Device names to use (default: all of the cluster's).
        buffer_bytes: Optional dict from node name to its backward gradient
            buffer per sample, for a graph whose nodes stand for several
            layers (default: each node's `output_bytes`).

    Attributes:
        devices: Device names; schedules refer to devices by index in it.
        layers: Layer names in topological order; layers are referred to by
            index in it.
        preds, succs: Per layer, lists of `(layer index, bytes per sample)`.
        static: Per layer, `static_bytes(node, graph's optimizer slots)`.
        act: Per layer, output activation bytes per sample.
        buffer: Per layer, bytes per sample of the backward gradient buffer
            a device running it needs (`simulator.gradient_buffer_bytes`: the
            largest output among the layers it stands for); a device keeps
            the largest of its layers'.
        capacity: Per device, `MEMORY_MARGIN` of its usable memory
            (`simulator.usable_memory_bytes`: less a GPU's reserve).
    """

    def __init__(self, graph, cluster, cost_model, devices=None, buffer_bytes=None):
        self.graph = graph
        self.cluster = cluster
        self.cost = cost_model
        self.devices = list(devices) if devices is not None else list(cluster.names)
        self.n_dev = len(self.devices)
        self.dev = [cluster.device(d) for d in self.devices]
        classes = {}
        self.dev_class = []
        self.class_rep = []
        for i, d in enumerate(self.dev):
            key = (d.kind, d.model, d.peak_flops_fp32, d.peak_flops_fp16, d.memory_bandwidth)
            if key not in classes:
                classes[key] = len(classes)
                self.class_rep.append(i)
            self.dev_class.append(classes[key])
        self.n_class = len(classes)
        self.class_count = [self.dev_class.count(c) for c in range(self.n_class)]
        self.layers = list(graph.nodes)
        self.nodes = [graph.nodes[n] for n in self.layers]
        self.index = {n: i for i, n in enumerate(self.layers)}
        self.preds = [[] for _ in self.layers]
        self.succs = [[] for _ in self.layers]
        for src, dst, nbytes in graph.edges:
            s, d = self.index[src], self.index[dst]
            self.preds[d].append((s, int(nbytes)))
            self.succs[s].append((d, int(nbytes)))
        self.outputs = [self.index[o] for o in graph.outputs if o in self.index]
        self.optimizer_slots = optimizer_slots_of(graph)
        self.static = [static_bytes(n, self.optimizer_slots) for n in self.nodes]
        self.act = [int(n.activation_bytes) for n in self.nodes]
        self.buffer = [
            int(buffer_bytes[n.name]) if buffer_bytes is not None else int(n.output_bytes)
            for n in self.nodes
        ]
        self.param_bytes = [int(n.param_bytes) for n in self.nodes]
        self.n_tensors = [len(n.variables) for n in self.nodes]
        self.capacity = [int(usable_memory_bytes(d) * MEMORY_MARGIN) for d in self.dev]
        self.bucket_bytes = DDP_BUCKET_BYTES  # gradient buckets of the sync proxy
        node_names = []
        for d in self.dev:
            if d.node not in node_names:
                node_names.append(d.node)
        self.dev_node = [node_names.index(d.node) for d in self.dev]
        self.n_nodes = len(node_names)
        self._time = {}
        self._overhead = {}
        self._ar = {}
        self._per_sample = {}
        self._fit_links()

    # ------------------------------------------------------------- compute
    def time(self, layer, device, batch, phase):
        """Seconds of `phase` (0 forward, 1 backward) of a layer on a device index."""
        key = (layer, self.dev_class[device], batch, phase)
        t = self._time.get(key)
        if t is None:
            t = self._time[key] = float(
                self.cost.layer_time(self.nodes[layer], self.dev[device], batch,
                                     PHASE_NAMES[phase])
            )
        return t

    def mean_time(self, layer, batch, phase):
        """Mean over the devices of `time(layer, device, batch, phase)`."""
        key = (layer, -1, batch, phase)
        t = self._time.get(key)
        if t is None:
            t = self._time[key] = sum(
                self.time(layer, self.class_rep[c], batch, phase) * self.class_count[c]
                for c in range(self.n_class)
            ) / self.n_dev
        return t

    def layer_total(self, layer, device, batch):
        """Forward plus backward seconds of one layer."""
        return self.time(layer, device, batch, FORWARD) + self.time(layer, device, batch, BACKWARD)

    def per_sample_time(self, device, batch, layers=None):
        """Forward + backward seconds per sample of `layers` (default all) at `batch`."""
        batch = max(int(batch), 1)
        key = (self.dev_class[device], batch, None if layers is None else tuple(layers))
        found = self._per_sample.get(key)
        if found is None:
            which = range(len(self.layers)) if layers is None else layers
            found = sum(self.layer_total(i, device, batch) for i in which) / batch
            self._per_sample[key] = found = max(found, _EPS)
        return found

    # ------------------------------------------------------- communication
    def _fit_links(self):
        """Alpha-beta fit of every device pair's `transfer_time`."""
        n = self.n_dev
        big = float(2**30)
        self.alpha = [[0.0] * n for _ in range(n)]
        self.beta = [[0.0] * n for _ in range(n)]
        total_a = total_b = 0.0
        pairs = 0
        for a in range(n):
            for b in range(n):
                if a == b:
                    continue
                t1 = float(self.cost.transfer_time(1, self.devices[a], self.devices[b]))
                t2 = float(self.cost.transfer_time(big, self.devices[a], self.devices[b]))
                beta = max((t2 - t1) / (big - 1), 0.0)
                alpha = max(t1 - beta, 0.0)
                self.alpha[a][b], self.beta[a][b] = alpha, beta
                total_a += alpha
                total_b += beta
                pairs += 1
        self.mean_alpha = total_a / pairs if pairs else 0.0
        self.mean_beta = total_b / pairs if pairs else 0.0
        # Rounded so that equally placed devices tie exactly (then: by index).
        self.link_cost = [float(f"{sum(row):.6g}") for row in self.beta]

    def transfer(self, src, dst, nbytes):
        """Seconds to move `nbytes` between device indices (0 on one device)."""
        if src == dst or nbytes <= 0:
            return 0.0
        return self.alpha[src][dst] + nbytes * self.beta[src][dst]

    def mean_transfer(self, nbytes):
        """Average transfer seconds over distinct device pairs (HEFT's mean cost)."""
        if nbytes <= 0 or self.n_dev < 2:
            return 0.0
        return self.mean_alpha + nbytes * self.mean_beta

    def allreduce(self, nbytes, devices, algorithm="ring"):
        """Seconds of one all-reduce of `nbytes` over device indices."""
        if nbytes <= 0 or len(devices) < 2:
            return 0.0
        key = (int(nbytes), tuple(devices), algorithm)
        t = self._ar.get(key)
        if t is None:
            names = [self.devices[d] for d in devices]
            t = self._ar[key] = float(self.cost.allreduce_time(nbytes, names, algorithm))
        return t

    def update(self, device, nbytes, ntensors):
        """Seconds of the optimizer update of `nbytes` in `ntensors` tensors."""
        if nbytes <= 0 and ntensors <= 0:
            return 0.0
        return float(self.cost.update_time(nbytes, self.dev[device], ntensors))

    def step_overhead(self, device):
        """Seconds of the step's fixed host time on a device that runs part of
        the step (`CostModel.step_overhead_time`; PyTorch on GPUs), as the
        simulator charges it."""
        t = self._overhead.get(device)
        if t is None:
            t = self._overhead[device] = float(self.cost.step_overhead_time(self.dev[device]))
        return t

    # ------------------------------------------------------------- helpers
    def speed_order(self, batch, layers=None, candidates=None):
        """Device indices, fastest first (per-sample time of `layers`).

        Devices equally fast are ordered by how well they are connected (the
        sum of their links' seconds per byte to every other device: devices
        on a large node with fast links first), then by index, so the order
        of the nodes in the cluster spec does not decide which devices a
        split takes.
        """
        candidates = range(self.n_dev) if candidates is None else candidates
        return sorted(candidates, key=lambda d: (self.per_sample_time(d, batch, layers),
                                                 self.link_cost[d], d))

    def speed_shares(self, devices, batch, layers=None, caps=None):
        """Whole-sample shares of `batch` over `devices`, proportional to speed.

        Every device gets at least one sample (requires `batch >= len(devices)`).
        With `caps` (max samples per device), a device keeps at most its cap
        and the excess goes to the others in proportion to speed; returns
        None when the caps cannot hold the batch.
        """
        m = len(devices)
        per = max(batch // max(m, 1), 1)
        weights = [1.0 / self.per_sample_time(d, per, layers) for d in devices]
        if caps is not None:
            caps = [max(int(c), 0) for c in caps]
            if sum(caps) < batch or min(caps) < 1:
                return None
        shares = split_batch(weights, batch)
        if caps is not None:
            for _ in range(m):
                excess = sum(max(s - c, 0) for s, c in zip(shares, caps))
                if not excess:
                    break
                shares = [min(s, c) for s, c in zip(shares, caps)]
                room = [i for i in range(m) if shares[i] < caps[i]]
                extra = split_batch([weights[i] for i in room], excess)
                for i, e in zip(room, extra):
                    shares[i] += e
            if any(s > c for s, c in zip(shares, caps)):
                return None
        for i, s in enumerate(shares):
            if s == 0:
                donor = max(range(m), key=lambda j: (shares[j], -j))
                shares[donor] -= 1
                shares[i] = 1
        return shares


class Schedule:
    """The result of `list_schedule`: placement, timing and a makespan proxy.

    Attributes:
        replicas: Per layer, a list of `(device index, batch share)`.
        makespan: Predicted step time of this schedule (a proxy: no link
            contention; plans are scored by the simulator).
        critical_layers: Layer indices on the critical path, last first.
        memory: Per device, bytes the placement needs (every activation live).
        overflow: Total bytes over capacity summed over devices (0 = fits).
        method: `"heft"` or `"cpop"`.
    """

    def __init__(self, tables, method):
        self.tables = tables
        self.method = method
        self.replicas = None
        self.makespan = 0.0
        self.critical_layers = []
        self.memory = []
        self.overflow = 0
        self.task_meta = []
        self.start = []
        self.end = []
        self.task_dev = []

    @property
    def feasible(self):
        return self.overflow <= 0

    def score(self):
        """Sort key: fitting schedules first, then by makespan."""
        return (self.overflow > 0, self.overflow, self.makespan)

    def device_order(self):
        """Per device name, `(layer name, phase)` entries in start-time order."""
        t = self.tables
        per = {}
        for k, (layer, _rep, phase) in enumerate(self.task_meta):
            per.setdefault(self.task_dev[k], []).append((self.start[k], k, layer, phase))
        order = {}
        for d in sorted(per):
            entries = sorted(per[d])
            order[t.devices[d]] = [(t.layers[layer], PHASE_NAMES[phase]) for _, _, layer, phase in entries]
        return order

    def placement(self):
        """Per layer name, the list of `(device name, batch share)`."""
        t = self.tables
        return {
            t.layers[i]: [(t.devices[d], s) for d, s in reps]
            for i, reps in enumerate(self.replicas)
        }


def list_schedule(tables, batch, method="heft", fixed=None, memory=True):
    """Schedules one training step's forward and backward tasks.

    Args:
        tables: `CostTables`.
        batch: Global batch size.
        method: `"heft"` or `"cpop"`.
        fixed: Dict from layer index to a list of `(device index, share)`
            replicas whose shares sum to `batch`; other layers are free.
        memory: Respect device memory when placing free layers.

    Returns:
        A `Schedule`.
    """
    if method not in ("heft", "cpop"):
        raise ValueError(f"method must be 'heft' or 'cpop'. Received: {method!r}")
    fixed = fixed or {}
    t = tables
    n_layers = len(t.layers)
    n_dev = t.n_dev
    reps = [list(fixed[i]) if i in fixed else None for i in range(n_layers)]
    whole = [(0, batch)]
    ranges = [batch_ranges([s for _, s in r]) if r is not None else whole for r in reps]

    # Tasks, in a topological order: forward by layer, then backward reversed.
    meta = []
    f_ids = [None] * n_layers
    b_ids = [None] * n_layers
    for i in range(n_layers):
        base = len(meta)
        f_ids[i] = list(range(base, base + len(ranges[i])))
        meta.extend((i, ri, FORWARD) for ri in range(len(ranges[i])))
    for i in reversed(range(n_layers)):
        base = len(meta)
        b_ids[i] = list(range(base, base + len(ranges[i])))
        meta.extend((i, ri, BACKWARD) for ri in range(len(ranges[i])))
    n_tasks = len(meta)
    preds = [[] for _ in range(n_tasks)]
    succs = [[] for _ in range(n_tasks)]
    single = ((0, 0, batch),)
    for i in range(n_layers):
        fi, bi = f_ids[i], b_ids[i]
        for ri in range(len(fi)):
            preds[bi[ri]].append((fi[ri], 0))
            succs[fi[ri]].append((bi[ri], 0))
        for src, nbytes in t.preds[i]:
            fs, bs = f_ids[src], b_ids[src]
            if len(fs) == 1 and len(fi) == 1:
                pairs = single
            else:
                pairs = range_overlaps(ranges[src], ranges[i])
            for a, b, n in pairs:
                x = nbytes * n
                preds[fi[b]].append((fs[a], x))
                succs[fs[a]].append((fi[b], x))
                preds[bs[a]].append((bi[b], x))
                succs[bi[b]].append((bs[a], x))
    outs = t.outputs
    for o in outs:
        for o2 in outs:
            if o2 != o:
                for r2, r1, _n in range_overlaps(ranges[o2], ranges[o]):
                    preds[b_ids[o][r1]].append((f_ids[o2][r2], 0))
                    succs[f_ids[o2][r2]].append((b_ids[o][r1], 0))

    # Fixed devices, shares and mean costs for the ranks.
    dev = [-1] * n_tasks
    share = [batch] * n_tasks
    w = [0.0] * n_tasks
    for k, (i, ri, phase) in enumerate(meta):
        r = reps[i]
        if r is not None:
            dev[k], share[k] = r[ri]
            w[k] = t.time(i, dev[k], share[k], phase)
        else:
            w[k] = t.mean_time(i, batch, phase)
    mean_alpha, mean_beta = t.mean_alpha, t.mean_beta
    alpha, beta = t.alpha, t.beta

    def comm(a, b, nbytes):
        if nbytes <= 0:
            return 0.0
        da, db = dev[a], dev[b]
        if da >= 0 and db >= 0:
            return 0.0 if da == db else alpha[da][db] + nbytes * beta[da][db]
        return mean_alpha + nbytes * mean_beta

    rank_u = [0.0] * n_tasks
    for k in range(n_tasks - 1, -1, -1):
        best = 0.0
        for s, nbytes in succs[k]:
            v = rank_u[s] + (comm(k, s, nbytes) if nbytes > 0 else 0.0)
            if v > best:
                best = v
        rank_u[k] = w[k] + best
    prio = rank_u
    cp_tasks, cp_device = set(), None
    if method == "cpop":
        rank_d = [0.0] * n_tasks
        for k in range(n_tasks):
            best = 0.0
            for p, nbytes in preds[k]:
                v = rank_d[p] + w[p] + (comm(p, k, nbytes) if nbytes > 0 else 0.0)
                if v > best:
                    best = v
            rank_d[k] = best
        prio = [rank_u[k] + rank_d[k] for k in range(n_tasks)]
        cp_tasks, cp_device = _critical_path(tables, meta, dev, prio, preds, succs, batch)

    # Scheduling state.
    start = [0.0] * n_tasks
    end = [0.0] * n_tasks
    crit = [-1] * n_tasks
    dev_free = [0.0] * n_dev
    last_task = [-1] * n_dev
    mem = [0] * n_dev
    # Each device's backward gradient buffer (counted in `mem`): its largest
    # replica's `buffer x share`, as the simulator counts it.
    buf = [0] * n_dev

    def rows(a, b):
        """The samples two tasks' replicas share (the rows that move between them)."""
        ia, ra, _ = meta[a]
        ib, rb, _ = meta[b]
        a0, a1 = ranges[ia][ra]
        b0, b1 = ranges[ib][rb]
        return max(a0, b0), min(a1, b1)

    # An output read by several layers on one device is received there once
    # (TensorFlow sends one copy of a tensor per device), and held once:
    # `held` lists the (producer task, device, rows) counted in `mem`.
    held = set()
    # Fixed layers reserve their memory up front (counting every input as
    # received from another device), so free layers avoid it.
    for k, (i, ri, phase) in enumerate(meta):
        if phase == FORWARD and reps[i] is not None:
            d = dev[k]
            received = 0
            for p, x in preds[k]:
                if dev[p] != d:
                    key = (p, d) + rows(p, k)
                    if key not in held:
                        held.add(key)
                        received += x
            mem[d] += t.static[i] + t.act[i] * share[k] + received
            grad = t.buffer[i] * share[k]
            if grad > buf[d]:
                mem[d] += grad - buf[d]
                buf[d] = grad
    fixed_layer = [r is not None for r in reps]
    # Link ports, as in the simulator: a send and a receive port per device
    # and per node NIC; transfers through one port are serialised.
    send_free = [0.0] * n_dev
    recv_free = [0.0] * n_dev
    nic_send = [0.0] * t.n_nodes
    nic_recv = [0.0] * t.n_nodes
    node = t.dev_node

    # Forward outputs already sent: (producer task, device, rows) -> (arrival,
    # bytes); a second reader of those rows there reuses the copy.
    arrived = {}

    def arrival(k, d, commit=False):
        at, who = 0.0, -1
        recv = recv_free[d]
        nd = node[d]
        nrecv = nic_recv[nd]
        forward = meta[k][2] == FORWARD
        sends = {}  # (source device, rows) -> [ready, bytes, task, reuse key]
        for p, nbytes in preds[k]:
            sp = dev[p]
            if sp == d or nbytes <= 0:
                if end[p] > at:
                    at, who = end[p], p
                continue
            if forward:
                key = (p, d) + rows(p, k)
                sent = arrived.get(key)
                if sent is not None and sent[1] >= nbytes:
                    if sent[0] > at:
                        at, who = sent[0], p
                    continue
                sends[(p,) + key[2:]] = [end[p], nbytes, p, key]
            else:
                # The gradients of this layer's readers on one device are
                # summed there and sent once, when the last of them is done.
                group = sends.setdefault((sp,) + rows(k, p), [end[p], nbytes, p, None])
                if end[p] > group[0]:
                    group[0], group[2] = end[p], p
                group[1] = max(group[1], nbytes)
        for ready_at, nbytes, p, key in sends.values():
            sp = dev[p]
            s = ready_at
            if send_free[sp] > s:
                s = send_free[sp]
            if recv > s:
                s = recv
            ns = node[sp]
            if ns != nd:
                if nic_send[ns] > s:
                    s = nic_send[ns]
                if nrecv > s:
                    s = nrecv
            v = s + alpha[sp][d] + nbytes * beta[sp][d]
            recv = v
            if ns != nd:
                nrecv = v
            if commit:
                send_free[sp] = v
                if ns != nd:
                    nic_send[ns] = v
                if key is not None:
                    arrived[key] = (v, nbytes)
            if v > at:
                at, who = v, p
        if commit:
            recv_free[d] = recv
            nic_recv[nd] = nrecv
        return at, who

    def mem_need(k, d, commit=False):
        i = meta[k][0]
        need = t.static[i] + t.act[i] * share[k]
        grad = t.buffer[i] * share[k]
        if grad > buf[d]:
            need += grad - buf[d]
            if commit:
                buf[d] = grad
        for p, nbytes in preds[k]:
            if dev[p] == d:
                continue
            key = (p, d) + rows(p, k)
            if key not in held:
                need += nbytes
                if commit:
                    held.add(key)
        return need

    waiting = [len(p) for p in preds]
    ready = [(-prio[k], k) for k in range(n_tasks) if waiting[k] == 0]
    heapq.heapify(ready)
    while ready:
        _, k = heapq.heappop(ready)
        i, ri, phase = meta[k]
        d = dev[k]
        if d < 0:
            if phase == BACKWARD:
                d = dev[f_ids[i][ri]]
            else:
                d = _choose_device(
                    tables, k, i, batch, cp_device if k in cp_tasks else None,
                    dev_free, mem, memory, arrival, mem_need,
                )
                reps[i] = [(d, batch)]
            dev[k] = d
        at, who = arrival(k, d, commit=True)
        if dev_free[d] >= at and last_task[d] >= 0:
            s, crit[k] = dev_free[d], last_task[d]
        else:
            s, crit[k] = at, who
        e = s + t.time(i, d, share[k], phase)
        start[k], end[k] = s, e
        dev_free[d] = e
        last_task[d] = k
        if phase == FORWARD and not fixed_layer[i]:
            mem[d] += mem_need(k, d, commit=True)
        for v, _ in succs[k]:
            waiting[v] -= 1
            if waiting[v] == 0:
                heapq.heappush(ready, (-prio[v], v))

    # Gradient sync of replicated layers, then each device's optimizer update.
    sync_end = [0.0] * n_dev
    upd_bytes = [0] * n_dev
    upd_tensors = [0] * n_dev
    comm_free = {}
    syncs = []
    for i in range(n_layers):
        for d, _s in reps[i]:
            upd_bytes[d] += t.param_bytes[i]
            upd_tensors[d] += t.n_tensors[i]
        if len(reps[i]) > 1 and t.param_bytes[i] > 0:
            syncs.append((max(end[k] for k in b_ids[i]), i))
    syncs.sort()
    # DDP-style buckets per replica set: gradients in the order they are
    # ready, one all-reduce per `bucket_bytes` (and one for the remainder).
    by_members = {}
    for ready_at, i in syncs:
        members = tuple(sorted(d for d, _ in reps[i]))
        by_members.setdefault(members, []).append((ready_at, i))
    launches = []
    for members, items in by_members.items():
        acc, last = 0, 0.0
        for n, (ready_at, i) in enumerate(items):
            acc += t.param_bytes[i]
            last = ready_at
            if acc >= t.bucket_bytes or n == len(items) - 1:
                launches.append((last, members, acc))
                acc = 0
    launches.sort()
    for ready_at, members, nbytes in launches:
        s = max(ready_at, comm_free.get(members, 0.0))
        e = s + t.allreduce(nbytes, members)
        comm_free[members] = e
        for d in members:
            if e > sync_end[d]:
                sync_end[d] = e
    makespan, last_dev = 0.0, 0
    for d in range(n_dev):
        if last_task[d] < 0:
            continue
        e = (max(dev_free[d], sync_end[d]) + t.update(d, upd_bytes[d], upd_tensors[d])
             + t.step_overhead(d))
        if e > makespan:
            makespan, last_dev = e, d

    sched = Schedule(tables, method)
    sched.replicas = reps
    sched.makespan = makespan
    sched.memory = mem
    sched.overflow = sum(max(m - c, 0) for m, c in zip(mem, t.capacity))
    sched.task_meta = meta
    sched.start, sched.end, sched.task_dev = start, end, dev
    path, seen = [], set()
    k = last_task[last_dev]
    while k >= 0:
        i = meta[k][0]
        if i not in seen:
            seen.add(i)
            path.append(i)
        k = crit[k]
    sched.critical_layers = path
    return sched


def _choose_device(tables, k, layer, batch, cp_device, dev_free, mem, memory, arrival, mem_need):
    t = tables
    if cp_device is not None and (
        not memory or mem[cp_device] + mem_need(k, cp_device) <= t.capacity[cp_device]
    ):
        return cp_device
    best, best_key = -1, None
    fallback, fallback_room = 0, None
    for d in range(t.n_dev):
        need = mem_need(k, d)
        room = t.capacity[d] - mem[d] - need
        if fallback_room is None or room > fallback_room:
            fallback, fallback_room = d, room
        if memory and room < 0:
            continue
        at, _ = arrival(k, d)
        eft = max(at, dev_free[d]) + t.time(layer, d, batch, FORWARD)
        # Ties go to the device that is faster over the whole model, then to the
        # lower index, so the schedule does not depend on the order of the nodes.
        key = (eft, t.per_sample_time(d, batch), d)
        if best_key is None or key < best_key:
            best, best_key = d, key
    return best if best >= 0 else fallback


def _critical_path(tables, meta, dev, prio, preds, succs, batch):
    """CPOP: the tasks on the critical path and the device that runs it fastest."""
    t = tables
    n = len(meta)
    if not n:
        return set(), None
    top = max(prio)
    tol = 1e-9 * max(top, 1.0)
    entries = [k for k in range(n) if not preds[k]]
    k = max(entries, key=lambda x: (prio[x], -x))
    path = {k}
    while succs[k]:
        nxt = [s for s, _ in succs[k] if abs(prio[s] - top) <= tol]
        if not nxt:
            nxt = [max((s for s, _ in succs[k]), key=lambda s: (prio[s], -s))]
        k = min(nxt)
        path.add(k)
    free = [x for x in path if dev[x] < 0]
    if not free:
        return set(), None
    layers = sorted({meta[x][0] for x in free})
    need = sum(t.static[i] + t.act[i] * batch for i in layers)
    options = [d for d in range(t.n_dev) if need <= t.capacity[d]] or list(range(t.n_dev))
    cp_device = min(
        options,
        key=lambda d: (sum(t.time(meta[x][0], d, batch, meta[x][2]) for x in free), d),
    )
    return set(free), cp_device


def rank_order(tables, batch):
    """HEFT upward-rank order of every `(layer, phase)` of the training graph.

    Ranks use each layer's mean time over the devices at `batch / devices`
    samples and the mean transfer cost of its edges; entries come highest
    rank first (ties in topological order), which is a valid execution
    order: forward before backward, producers before consumers.

    Returns:
        A list of `(layer name, phase name)`.
    """
    t = tables
    n = len(t.layers)
    per = max(batch // max(t.n_dev, 1), 1)
    wf = [t.mean_time(i, per, FORWARD) for i in range(n)]
    wb = [t.mean_time(i, per, BACKWARD) for i in range(n)]
    rb = [0.0] * n
    for i in range(n):  # backward runs from the outputs to the inputs
        best = 0.0
        for p, nbytes in t.preds[i]:
            v = rb[p] + t.mean_transfer(nbytes * per)
            if v > best:
                best = v
        rb[i] = wb[i] + best
    rf = [0.0] * n
    for i in reversed(range(n)):
        best = rb[i]
        for s, nbytes in t.succs[i]:
            v = rf[s] + t.mean_transfer(nbytes * per)
            if v > best:
                best = v
        rf[i] = wf[i] + best
    entries = [(-rf[i], i, FORWARD) for i in range(n)]
    entries += [(-rb[i], 2 * n - 1 - i, BACKWARD) for i in range(n)]
    entries.sort()
    out = []
    for _, pos, phase in entries:
        i = pos if phase == FORWARD else 2 * n - 1 - pos
        out.append((t.layers[i], PHASE_NAMES[phase]))
    return out
