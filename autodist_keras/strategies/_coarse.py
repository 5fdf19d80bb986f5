"""Coarse views of a model graph, for fast plan search.

A planner that scores thousands of candidates cannot schedule or simulate
every layer of a 500-layer model each time. This module fuses layers into
*units* and builds a smaller `ModelGraph` whose nodes are the units, plus a
cost model that prices a unit as the sum of its layers on the same device and
batch (so the coarse graph's compute times equal the fine graph's). The
simulator runs unchanged on the coarse graph; the planners map the chosen
unit placement back to layers and score the final plan on the real graph.

Two partitions:

- `chain_partition`: linear chains (a layer with one input that is its
  producer's only consumer joins the producer's chain), capped in compute
  and memory so units stay small enough to place. Chains have no internal
  parallelism, so fusing them loses nothing for list scheduling.
- `contiguous_partition`: `k` runs of consecutive layers (topological order)
  with about equal compute, cut after the costliest layers: HeteroG's layer
  groups.

Example:

```python
units = chain_partition(graph, cost_of=lambda n: n.forward_flops)
coarse = CoarseGraph(graph, units)
cost = CoarseCostModel(AnalyticCostModel(cluster), coarse)
result = simulate(coarse.graph, cluster, coarse_plan, cost_model=cost)
```
"""

import bisect

import networkx

from autodist_keras.estimator.cost_model import WrappedCostModel
from autodist_keras.estimator.simulator import optimizer_slots_of
from autodist_keras.graph.model_graph import LayerNode
from autodist_keras.graph.model_graph import ModelGraph


def chain_partition(graph, cost_of, max_cost=None, max_bytes=None, bytes_of=None):
    """Fuses linear chains of layers into units.

    Args:
        graph: The `ModelGraph`.
        cost_of: Function from `LayerNode` to a cost (e.g. FLOPs or seconds).
        max_cost: A unit's summed cost stays at most this (None: no cap).
        max_bytes: A unit's summed `bytes_of` stays at most this.
        bytes_of: Function from `LayerNode` to bytes (memory) for the cap.

    Returns:
        A list of units, each a list of layer names; units are in a
        topological order of the fused graph.
    """
    preds, succs = _adjacency(graph)
    outputs = set(graph.outputs)
    chain_of = {}
    units = []
    totals = []
    for name, node in graph.nodes.items():
        p = preds[name]
        joined = False
        if len(p) == 1:
            (u,) = p
            k = chain_of[u]
            if (
                len(succs[u]) == 1
                and units[k][-1] == u
                and u not in outputs
                and (max_cost is None or totals[k][0] + cost_of(node) <= max_cost)
                and (max_bytes is None or totals[k][1] + bytes_of(node) <= max_bytes)
            ):
                units[k].append(name)
                totals[k][0] += cost_of(node)
                totals[k][1] += bytes_of(node) if bytes_of else 0
                chain_of[name] = k
                joined = True
        if not joined:
            chain_of[name] = len(units)
            units.append([name])
            totals.append([cost_of(node), bytes_of(node) if bytes_of else 0])
    return _topological_units(graph, units, chain_of)


def _topological_units(graph, units, unit_index):
    """Orders units topologically in the fused graph (networkx), ties by first layer."""
    position = {n: i for i, n in enumerate(graph.nodes)}
    fused = networkx.DiGraph()
    fused.add_nodes_from(range(len(units)))
    for src, dst, _ in graph.edges:
        a, b = unit_index[src], unit_index[dst]
        if a != b:
            fused.add_edge(a, b)
    order = networkx.lexicographical_topological_sort(
        fused, key=lambda k: position[units[k][0]]
    )
    return [units[k] for k in order]


def contiguous_partition(graph, k, cost_of, isolate=()):
    """Cuts the layers (topological order) into at most `k` runs of similar cost.

    A run closes once it holds its share of the remaining cost, so each of
    the costliest layers ends up near the middle or end of its group, and no
    run is empty.

    Args:
        graph: The `ModelGraph`.
        k: Number of groups wanted (not counting isolated layers).
        cost_of: Function from `LayerNode` to a non-negative cost.
        isolate: Layer names that get a run of their own (e.g. layers with
            large gradients and little compute, which a planner wants to
            place or replicate differently from their neighbours). The `k`
            runs are spread over the segments between them in proportion to
            the segments' cost (at least one run per non-empty segment).

    Returns:
        A list of runs, each a non-empty list of layer names.
    """
    isolate = set(isolate)
    if isolate:
        segments, current = [], []
        for name in graph.nodes:
            if name in isolate:
                if current:
                    segments.append(current)
                segments.append([name])
                current = []
            else:
                current.append(name)
        if current:
            segments.append(current)
        costs = {n: max(float(cost_of(graph.nodes[n])), 0.0) for n in graph.nodes}
        free = [seg for seg in segments if seg[0] not in isolate]
        total = sum(costs[n] for seg in free for n in seg) or 1.0
        runs, carry = [], []
        for seg in segments:
            if seg[0] in isolate:
                runs.append(carry + seg)
                carry = []
                continue
            seg_cost = sum(costs[n] for n in seg)
            if seg_cost <= 0:  # e.g. only the input layer: joins the next run
                carry += seg
                continue
            runs.extend(_partition_names(carry + seg, max(1, round(k * seg_cost / total)), costs))
            carry = []
        if carry:
            if runs:
                runs[-1] = runs[-1] + carry
            else:
                runs.append(carry)
        return runs
    names = list(graph.nodes)
    costs = {n: max(float(cost_of(graph.nodes[n])), 0.0) for n in names}
    return _partition_names(names, k, costs)


def _partition_names(names, k, cost_by_name):
    """`contiguous_partition` of a list of names with known costs."""
    costs = [cost_by_name[n] for n in names]
    k = max(1, min(int(k), len(names)))
    runs = []
    current = []
    acc = 0.0
    remaining = sum(costs)
    for i, name in enumerate(names):
        current.append(name)
        acc += costs[i]
        groups_after = k - len(runs) - 1
        layers_after = len(names) - i - 1
        if groups_after <= 0:
            continue
        share = remaining / (groups_after + 1)
        if layers_after == groups_after or (
            remaining > 0 and acc >= share and layers_after >= groups_after
        ):
            runs.append(current)
            remaining -= acc
            current, acc = [], 0.0
    if current:
        runs.append(current)
    return runs


def _device_key(device):
    if isinstance(device, str):
        return device
    return (device.kind, device.model, device.peak_flops_fp32, device.peak_flops_fp16,
            device.memory_bandwidth)


def _adjacency(graph):
    preds = {n: [] for n in graph.nodes}
    succs = {n: [] for n in graph.nodes}
    for src, dst, _ in graph.edges:
        if src not in preds[dst]:
            preds[dst].append(src)
        if dst not in succs[src]:
            succs[src].append(dst)
    return preds, succs


class CoarseGraph:
    """A `ModelGraph` whose nodes are units of fused layers.

    Args:
        graph: The fine `ModelGraph`.
        units: Lists of layer names covering every layer once, in a
            topological order of the fused graph.

    Attributes:
        graph: The coarse `ModelGraph` (node names are unit names).
        members: Dict from unit name to its layer names.
        unit_of: Dict from layer name to unit name.
        fine: The fine graph.
    """

    def __init__(self, graph, units):
        self.fine = graph
        self.members = {}
        self.unit_of = {}
        nodes = {}
        for unit in units:
            name = unit[0] if len(unit) == 1 else f"{unit[0]}..{unit[-1]}"
            if name in self.members:
                name = f"{name}#{len(self.members)}"
            self.members[name] = list(unit)
            for layer in unit:
                self.unit_of[layer] = name
            fine = [graph.nodes[layer] for layer in unit]
            nodes[name] = LayerNode(
                name=name,
                layer_name=name,
                layer_type="FusedLayers" if len(unit) > 1 else fine[0].layer_type,
                input_shapes=list(fine[0].input_shapes),
                output_shapes=list(fine[-1].output_shapes),
                forward_flops=float(sum(n.forward_flops for n in fine)),
                backward_flops=float(sum(n.backward_flops for n in fine)),
                variables=[v for n in fine for v in n.variables],
                non_trainable_bytes=int(sum(n.non_trainable_bytes or 0 for n in fine)),
                output_bytes=int(sum(n.output_bytes for n in fine)),
                saved_bytes=int(sum(n.saved_bytes for n in fine)),
                estimated=any(n.estimated for n in fine),
                kind="layer",
            )
        edges = {}
        for src, dst, nbytes in graph.edges:
            a, b = self.unit_of[src], self.unit_of[dst]
            if a != b:
                edges[(a, b)] = edges.get((a, b), 0) + int(nbytes)
        outputs = []
        for o in graph.outputs:
            u = self.unit_of.get(o)
            if u is not None and u not in outputs:
                outputs.append(u)
        inputs = []
        for i in graph.inputs:
            u = self.unit_of.get(i)
            if u is not None and u not in inputs:
                inputs.append(u)
        self.graph = ModelGraph(
            nodes, [(a, b, n) for (a, b), n in edges.items()], inputs, outputs,
            list(graph.variables), name=f"{getattr(graph, 'name', 'model')}_coarse",
            # (the memory model counts the fine graph's optimizer slots)
            optimizer_slots=optimizer_slots_of(graph), optimizer=getattr(graph, "optimizer", None),
        )

    def expand(self, per_unit):
        """Maps a per-unit dict to a per-layer dict (each layer gets its unit's value)."""
        return {layer: per_unit[unit] for unit, layers in self.members.items() for layer in layers}

    def expand_order(self, order):
        """Maps per-device `(unit, phase)` entries to `(layer, phase)` entries.

        A unit's layers run forward in topological order and backward in
        reverse.
        """
        out = {}
        for device, entries in order.items():
            rows = []
            for unit, phase in entries:
                layers = self.members[unit]
                rows.extend((layer, phase) for layer in (layers if phase == "forward" else reversed(layers)))
            out[device] = rows
        return out


class CoarseCostModel(WrappedCostModel):
    """Prices a fused unit as the sum of its layers; delegates everything else.

    Args:
        base: The fine `CostModel` (bound to the cluster).
        coarse: The `CoarseGraph` whose units it prices.
        grid: Optional sorted batch sizes. When given, a unit's time at a
            batch between two grid points is interpolated linearly between
            the exact sums there (exact on the grid). Layer times are convex
            piecewise-linear in the batch under the roofline, so this is an
            upper bound, and it keeps search evaluations cheap when batch
            shares change from one candidate to the next.
    """

    def __init__(self, base, coarse, grid=None):
        super().__init__(base)
        self.coarse = coarse
        self.grid = sorted(set(int(g) for g in grid)) if grid else None
        self._cache = {}

    def with_cluster(self, cluster):
        if cluster is self.cluster:
            return self
        base = self.base_with_cluster(cluster)
        return CoarseCostModel(base, self.coarse, self.grid)

    def config(self):
        inner = self.base.config() if hasattr(self.base, "config") else {}
        return {"type": "CoarseCostModel", "base": inner, "grid": self.grid}

    def unit_time(self, unit, device, batch, phase):
        """Exact summed time of a unit's layers (cached)."""
        key = (unit, _device_key(device), batch, phase)
        t = self._cache.get(key)
        if t is None:
            fine = self.coarse.fine.nodes
            t = self._cache[key] = float(
                sum(
                    self.base.layer_time(fine[m], device, batch, phase)
                    for m in self.coarse.members[unit]
                )
            )
        return t

    def layer_time(self, node, device, batch, phase):
        if node.name not in self.coarse.members:
            return self.base.layer_time(node, device, batch, phase)
        grid = self.grid
        if grid is None or batch <= 0 or batch in grid or batch < grid[0] or batch > grid[-1]:
            return self.unit_time(node.name, device, batch, phase)
        hi = bisect.bisect_left(grid, batch)
        x0, x1 = grid[hi - 1], grid[hi]
        y0 = self.unit_time(node.name, device, x0, phase)
        y1 = self.unit_time(node.name, device, x1, phase)
        return y0 + (y1 - y0) * (batch - x0) / (x1 - x0)
