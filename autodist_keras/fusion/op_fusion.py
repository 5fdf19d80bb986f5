"""Op fusion: which layers run as one compiled region, and what that saves (predicted).

A plan's `op_fusion` lists regions: groups of layers compiled together. The
backends realise a region as an XLA `jit_compile` region (TensorFlow) or a
`torch.compile` region (PyTorch); this module says what a region is worth to
the estimator and hands the regions to the adapters (`regions_for`).

The fusion cost model (predicted, documented in `docs/disco.md`). A layer is
*absorbed* by its region when it is memory-bound (roofline category `"other"`:
BatchNormalization, activations, Add, LayerNormalization, pooling, ...) and at
least one of its producers is in the same region: the compiler emits it as
the epilogue of the producer's kernel (forward) and the prologue of the
backward chain. For an absorbed layer:

- no kernel launches, forward or backward (they were `launch_overhead_s`
  each); on PyTorch on a GPU the layer's host dispatch time stays its floor,
  as for an unfused layer (`torch.compile` regions measured no faster than
  eager layers, docs/disco.md);
- forward: its input is read from registers, not memory, for the inputs that
  come from producers in the region (the edge bytes from those producers);
- backward: the gradient of its output is not read from memory when every
  consumer is an absorbed member of the same region (the gradient never
  leaves the fused kernel), and the gradient of its input is not written for
  the inputs whose producers are absorbed members of the region. Its input
  activation is still read once (backward needs it).

Everything else is unchanged: matmul-like layers (Dense, Conv, attention) in
a region still run their library kernel with its launch and its memory
traffic; the first layer of a region is never absorbed; activations are kept
for backward as before (the simulator's memory model is unchanged). The
price of fusion is in the simulator, not here: the gradients of every layer
in a region are ready only when the whole region's backward has finished,
which delays the all-reduce of the region's buckets.

`FusionAwareCostModel` wraps any cost model: for an absorbed layer it scales
the wrapped model's answer by `fused roofline / unfused roofline` (the
analytic roofline of `estimator.cost_model`), so a learned correction keeps
applying; wrapping `AnalyticCostModel` itself returns the fused roofline.

Example:

```python
regions = [["conv1", "bn1", "relu1"], ["conv2", "bn2"]]
cost = FusionAwareCostModel(AnalyticCostModel(cluster), graph, regions)
t = cost.layer_time(graph.nodes["bn1"], "node0/gpu0", 32, "forward")
```
"""

import dataclasses

from autodist_keras.errors import PlanError
from autodist_keras.estimator.cost_model import PHASES
from autodist_keras.estimator.cost_model import AnalyticCostModel
from autodist_keras.estimator.cost_model import WrappedCostModel
from autodist_keras.estimator.cost_model import input_bytes_per_sample
from autodist_keras.estimator.cost_model import op_category


@dataclasses.dataclass(frozen=True)
class FusionContext:
    """How a layer sits in its fusion region.

    Args:
        absorbed: True when the layer is fused into a producer's kernel (it is
            memory-bound and a producer is in its region).
        input_read_internal: Fraction of its input bytes that come from
            producers in its region (not read from memory in forward).
        input_grad_internal: Fraction of its input bytes whose producers are
            absorbed members of its region (input gradient not written).
        output_grad_internal: True when every consumer is an absorbed member
            of its region (output gradient not read in backward).
    """

    absorbed: bool = False
    input_read_internal: float = 0.0
    input_grad_internal: float = 0.0
    output_grad_internal: bool = False


# Graph node kinds that are no layer a runtime could compile: inputs, and the
# `keras.ops` calls of a functional model (and the masks Keras computes with them).
NOT_LAYER_KINDS = ("input", "op")


def is_fusible_follower(node):
    """True when `node` can be absorbed into a producer's kernel (memory-bound type)."""
    return node.kind not in NOT_LAYER_KINDS and op_category(node.layer_type) == "other"


def _extra_call(graph, name):
    """Whether graph node `name` is a shared layer's second or later call (`"sh#1"`)."""
    first_call, _, k = name.rpartition("#")
    return k.isdigit() and first_call in graph.nodes


def _shared(graph, name):
    """Whether graph node `name` is a call of a layer called more than once."""
    return _extra_call(graph, name) or f"{name}#1" in graph.nodes


def check_regions(graph, regions):
    """Checks op-fusion regions against a graph.

    Args:
        graph: The `ModelGraph`.
        regions: A list of lists of layer (node) names.

    Returns:
        The regions as a list of lists.

    Raises:
        PlanError: If a region is not a list, names an unknown layer, an
            input, a `keras.ops` call or a shared layer's extra call, or a
            layer is in two regions.
    """
    seen = {}
    out = []
    for ri, region in enumerate(regions or ()):
        if isinstance(region, str) or not hasattr(region, "__iter__"):
            raise PlanError(
                f"op_fusion[{ri}] must be a list of layer names. Received: {region!r}"
            )
        region = list(region)
        for layer in region:
            if layer not in graph.nodes:
                raise PlanError(
                    f"op_fusion[{ri}]: unknown layer {layer!r}; fusion regions name graph "
                    f"nodes such as {list(graph.nodes)[:4]}. Received: {layer!r}"
                )
            if graph.nodes[layer].kind in NOT_LAYER_KINDS:
                what = ("an input" if graph.nodes[layer].kind == "input" else
                        "a keras.ops call (or a mask Keras computes), not a layer")
                raise PlanError(
                    f"op_fusion[{ri}]: {layer!r} is {what}; regions compile layers, so leave "
                    f"it out. Received: {layer!r}"
                )
            if _extra_call(graph, layer):
                first_call, _, k = layer.rpartition("#")
                raise PlanError(
                    f"op_fusion[{ri}]: {layer!r} is call {int(k) + 1} of the shared layer "
                    f"{first_call!r}. Regions compile layers, with all their calls, so name "
                    f"the layer by its first call, {first_call!r}, or leave it out. "
                    f"Received: {layer!r}"
                )
            if layer in seen:
                raise PlanError(
                    f"op_fusion[{ri}]: layer {layer!r} is already in region {seen[layer]}; "
                    f"each layer is in at most one region. Received: {layer!r}"
                )
            seen[layer] = ri
        out.append(region)
    return out


def region_contexts(graph, regions):
    """The `FusionContext` of every layer in a region.

    Args:
        graph: The `ModelGraph`.
        regions: A list of lists of layer names (need not be contiguous).

    Returns:
        A dict from layer name to `FusionContext`; layers in no region, and
        regions of a single layer, are left out.
    """
    regions = check_regions(graph, regions)
    if not any(len(region) > 1 for region in regions):
        return {}
    producers, consumers = adjacency(graph)
    contexts = {}
    for ri, region in enumerate(regions):
        if len(region) > 1:
            contexts.update(
                contexts_of_region(graph, region, producers, consumers, set(graph.outputs))
            )
    return contexts


def adjacency(graph):
    """`(producers, consumers)`: dicts from layer name to `[(src, bytes)]` and `[dst]`."""
    producers, consumers = {}, {}
    for src, dst, nbytes in graph.edges:
        producers.setdefault(dst, []).append((src, nbytes))
        consumers.setdefault(src, []).append(dst)
    return producers, consumers


def contexts_of_region(graph, region, producers, consumers, outputs):
    """The `FusionContext` of each layer of one region (see `region_contexts`).

    Args:
        graph: The `ModelGraph`.
        region: Layer names of the region.
        producers, consumers: From `adjacency(graph)`.
        outputs: Set of the graph's output layer names.

    Returns:
        A dict from layer name to `FusionContext`.
    """
    members = set(region)
    absorbed = {
        layer: is_fusible_follower(graph.nodes[layer])
        and any(src in members for src, _ in producers.get(layer, ()))
        for layer in region
    }
    contexts = {}
    for layer in region:
        ins = producers.get(layer, ())
        total = float(sum(b for _, b in ins))
        read = sum(b for s, b in ins if s in members)
        grad = sum(b for s, b in ins if s in members and absorbed[s])
        outs = consumers.get(layer, ())
        out_internal = bool(outs) and layer not in outputs and all(
            d in members and absorbed[d] for d in outs
        )
        contexts[layer] = FusionContext(
            absorbed=absorbed[layer],
            input_read_internal=read / total if total > 0 else 0.0,
            input_grad_internal=grad / total if total > 0 else 0.0,
            output_grad_internal=out_internal,
        )
    return contexts


def roofline_time(analytic, node, device, batch, phase, context=None):
    """The analytic roofline time of one layer call, fused or not (predicted).

    With `context=None` (or a context that is not absorbed) this is exactly
    `AnalyticCostModel.layer_time`; for an absorbed layer the memory traffic
    and the launches listed in the module docs are removed.

    Args:
        analytic: An `AnalyticCostModel` (its constants are used).
        node: The `graph.LayerNode`.
        device: A `Device` or a device name.
        batch: Samples.
        phase: `"forward"` or `"backward"`.
        context: The layer's `FusionContext`, or None.

    Returns:
        Seconds.
    """
    # The roofline itself, even when `analytic` is a subclass that corrects it.
    if context is None or not context.absorbed or phase not in PHASES:
        return AnalyticCostModel.layer_time(analytic, node, device, batch, phase)
    category = op_category(node.layer_type)
    if batch <= 0 or category == "free" or getattr(node, "kind", None) == "input":
        return 0.0
    device = analytic._device(device)
    kind = analytic._kind(device)
    weight_bytes = sum(v.bytes for v in node.variables) + int(node.non_trainable_bytes or 0)
    in_bytes = input_bytes_per_sample(node, analytic.dtype_bytes)
    out_bytes = node.output_bytes
    if phase == "forward":
        flops = node.forward_flops * batch
        moved = weight_bytes + (in_bytes * (1.0 - context.input_read_internal) + out_bytes) * batch
    else:
        flops = node.backward_flops * batch
        out_grad = 0.0 if context.output_grad_internal else out_bytes
        moved = 2 * weight_bytes + (
            in_bytes + in_bytes * (1.0 - context.input_grad_internal) + out_grad
        ) * batch
    peak = device.peak_flops_fp32
    efficiency = analytic.compute_efficiency[kind].get(
        category, analytic.compute_efficiency[kind]["other"]
    )
    compute = flops / (peak * efficiency) if flops else 0.0
    memory = moved / (device.memory_bandwidth * analytic.memory_efficiency[kind])
    # The host's dispatch time stays (PyTorch on a GPU): a torch.compile region
    # measured no faster than eager layers (docs/disco.md), so fusion is not
    # credited with removing it.
    return max(compute, memory, analytic.host_time(node.layer_type, device, phase))


class FusionAwareCostModel(WrappedCostModel):
    """A cost model that prices layers inside op-fusion regions as fused.

    Layers outside regions, and transfers, collectives and updates, are
    priced by the wrapped model unchanged.

    Args:
        base: The wrapped `CostModel` (analytic, profiled or learned).
        graph: The `ModelGraph` the regions refer to.
        regions: List of lists of layer names (a plan's `op_fusion`).
        analytic: The `AnalyticCostModel` whose roofline (its constants,
            without any subclass correction) gives the fused / unfused ratio;
            default `base` when it is analytic, else a default
            `AnalyticCostModel` on `base`'s cluster.

    Example:

    ```python
    cost = FusionAwareCostModel(AnalyticCostModel(cluster), graph, plan.op_fusion)
    result = simulate(graph, cluster, plan, cost_model=cost)
    ```
    """

    def __init__(self, base, graph, regions, analytic=None):
        if base is None:
            raise PlanError(
                "FusionAwareCostModel wraps a cost model; pass one (e.g. "
                "AnalyticCostModel(cluster)). Received: base=None"
            )
        super().__init__(base)
        self.graph = graph
        self.regions = check_regions(graph, regions)
        self.contexts = region_contexts(graph, self.regions)
        if analytic is None:
            analytic = base if isinstance(base, AnalyticCostModel) else AnalyticCostModel(
                self.cluster
            )
        self.analytic = analytic
        self._exact = type(base) is AnalyticCostModel and analytic is base

    def with_cluster(self, cluster):
        if cluster is self.cluster:
            return self
        base = self.base_with_cluster(cluster)
        analytic = base if self.analytic is self.base else self.analytic.with_cluster(cluster)
        return FusionAwareCostModel(base, self.graph, self.regions, analytic=analytic)

    def config(self):
        config = self.base.config() if hasattr(self.base, "config") else {
            "type": type(self.base).__name__
        }
        return dict(
            config,
            op_fusion={
                "regions": len(self.regions),
                "absorbed_layers": sum(1 for c in self.contexts.values() if c.absorbed),
            },
        )

    def context(self, layer):
        """The `FusionContext` of a layer name, or None outside regions."""
        return self.contexts.get(layer)

    def layer_time(self, node, device, batch, phase):
        return self.layer_time_in(node, device, batch, phase, self.contexts.get(node.name))

    def layer_time_in(self, node, device, batch, phase, context):
        """`layer_time` for a layer in the given `FusionContext` (None: unfused).

        Lets a search price candidate regions without building a model per
        candidate.
        """
        if context is None or not context.absorbed:
            return self.base.layer_time(node, device, batch, phase)
        fused = roofline_time(self.analytic, node, device, batch, phase, context)
        if self._exact:
            return fused
        base = self.base.layer_time(node, device, batch, phase)
        full = roofline_time(self.analytic, node, device, batch, phase)
        return base * fused / full if full > 0 else base

    def __getattr__(self, name):
        # Anything else (e.g. `link`, `comm`) is the wrapped model's.
        if name == "base" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.base, name)


def fused_cost_model(base, graph, regions):
    """Returns `base` wrapped for `regions`, or `base` itself when there are none."""
    if not regions or not any(len(r) > 1 for r in regions):
        return base
    if isinstance(base, FusionAwareCostModel):
        base = base.base
    return FusionAwareCostModel(base, graph, regions)


def region_heads(graph, regions):
    """Dict from layer name to the first layer (in graph order) of its region.

    The backward of a region ends with its first layer, so that is when every
    gradient of the region is ready.
    """
    index = {name: i for i, name in enumerate(graph.nodes)}
    heads = {}
    for region in regions or ():
        members = [layer for layer in region if layer in index]
        if len(members) < 2:
            continue
        head = min(members, key=index.__getitem__)
        for layer in members:
            heads[layer] = head
    return heads


def candidate_joins(graph, framework=None):
    """Positions where two adjacent layers may be fused.

    Layer `i + 1` (in graph order) may join layer `i`'s region when it
    consumes layer `i`'s output and is memory-bound (so the fusion model
    can absorb it); input layers never join, nor do `keras.ops` calls of a
    functional model (and the masks Keras computes with them), which are
    graph nodes but no layers the runtimes could compile, nor layers that draw random
    numbers (`LayerNode.draws_random`: compiled, they would draw other
    numbers than Keras's own call, so the runtimes do not compile them), nor
    any call of a shared layer (regions name layers and compile all of a
    layer's calls, which the cost model does not price; the PyTorch runtime
    compiles only layers called once).

    Under PyTorch (`framework="torch"`) a join must also keep the region a
    chain that `backends/torch_fusion.py` compiles: both layers take one
    input tensor and no other argument (`BatchNormalization()(x,
    training=False)` has one), the first one's only output feeds the second
    alone (and is no model output), and neither computes a mask, casts for mixed precision
    or sits inside a nested model. So Disco plans no region the PyTorch
    runtime would run layer by layer while the prediction counted it fused.

    Args:
        graph: The `ModelGraph`.
        framework: The Keras backend the plan is for (`"torch"` adds the
            chain rules above); None or another backend: the general rules.

    Returns:
        A sorted list of indices `i`.
    """
    names = list(graph.nodes)
    index = {name: i for i, name in enumerate(names)}
    consumers = adjacency(graph)[1]
    joins = set()
    for src, dst, _ in graph.edges:
        i = index.get(src)
        if i is None or index.get(dst) != i + 1:
            continue
        if graph.nodes[src].kind in NOT_LAYER_KINDS or op_category(graph.nodes[src].layer_type) == "free":
            continue  # `keras.ops` calls are no layers: the runtimes compile layers
        if graph.nodes[src].draws_random or graph.nodes[dst].draws_random:
            continue  # the runtimes run such layers uncompiled (other random numbers)
        if _shared(graph, src) or _shared(graph, dst):
            continue  # regions compile layers with all their calls; PyTorch's only once-called ones
        if framework == "torch" and _torch_chain_problem(graph, src, dst, consumers):
            continue
        if is_fusible_follower(graph.nodes[dst]):
            joins.add(i)
    return sorted(joins)


def _torch_chain_problem(graph, src, dst, consumers):
    """True when joining `src` and `dst` would make a region PyTorch runs layer by layer."""
    for node in (graph.nodes[src], graph.nodes[dst]):
        if (len(node.input_shapes) != 1 or node.extra_arguments or node.computes_mask
                or node.autocasts or node.nested):
            return True
    return (len(graph.nodes[src].output_shapes) != 1 or consumers.get(src) != [dst]
            or src in graph.outputs)


def regions_from_joins(layer_names, joins):
    """Turns join positions into regions: maximal runs of joined adjacent layers.

    Args:
        layer_names: Layer names in graph order.
        joins: Indices `i` meaning layers `i` and `i + 1` are in one region.

    Returns:
        A list of lists of layer names (regions of two or more layers).
    """
    regions, current = [], None
    for i in sorted(set(joins)):
        if current is not None and current[1] == i:
            current[1] = i + 1
        else:
            if current is not None:
                regions.append(current)
            current = [i, i + 1]
    if current is not None:
        regions.append(current)
    return [list(layer_names[a:b + 1]) for a, b in regions]


def regions_for(plan):
    """The op-fusion regions a backend should compile, as lists of layer names.

    Args:
        plan: A `Plan`.

    Returns:
        A list of lists of layer (graph node) names, one per region of two or
        more layers, in the plan's order.
    """
    return [list(region) for region in plan.op_fusion if len(region) > 1]


# How the runtimes treat op-fusion regions (AutoStrategy's `op_fusion` option).
OP_FUSION_POLICIES = ("auto", "on", "off")


def compiled_by_default(device_kinds, framework=None):
    """Whether `op_fusion="auto"` compiles regions on devices of these kinds.

    Only GPUs, and only under TensorFlow (XLA): on this project's CPU
    measurements XLA regions were slower than TensorFlow's own kernels
    (benchmarks/op_fusion_xla.py, docs/disco.md), and `torch.compile`
    regions were slower than eager Keras both on the CPU (0.931x) and on an
    NVIDIA H200 (0.813x, benchmarks/op_fusion_torch.py --cluster detect).
    Disco plans regions by the same rule, so its predictions count no savings
    the runtime will not make. `op_fusion="on"` still compiles them.

    Args:
        device_kinds: Kinds of the plan's devices (`"gpu"`, `"cpu"`).
        framework: The Keras backend (default: the active one).

    Returns:
        True when every device is a GPU and the backend is not PyTorch.
    """
    if framework is None:
        from autodist_keras.devices.detect import active_keras_backend

        framework = active_keras_backend()
    return framework != "torch" and all(kind == "gpu" for kind in device_kinds)


def region_layers(model, regions):
    """The regions of two or more layers and the model's layers by name, checked.

    Args:
        model: A Keras model.
        regions: Lists of layer names (`regions_for(plan)`).

    Returns:
        `(regions, layers)`: the regions with two or more layers (lists), and
        a dict `{name: layer}` of every layer of `model`, nested ones included.

    Raises:
        BackendError: If a region names a layer `model` does not have.
    """
    from autodist_keras.errors import BackendError

    layers, stack = {}, list(getattr(model, "layers", []) or [])
    while stack:
        layer = stack.pop()
        layers.setdefault(layer.name, layer)
        stack.extend(getattr(layer, "layers", []) or [])
    kept = [list(r) for r in regions if len(r) > 1]
    for index, region in enumerate(kept):
        for name in region:
            if name not in layers:
                raise BackendError(
                    f"Op-fusion region {index} names a layer the model does not have. "
                    f"Make the plan for this model. Received: {name!r}; the model's "
                    f"layers include {sorted(layers)[:8]}"
                )
    return kept, layers


def regions_to_realise(plan, device_kinds, policy="auto"):
    """The regions a runtime compiles under AutoStrategy's `op_fusion` policy.

    Args:
        plan: The `Plan` (its `op_fusion` regions).
        device_kinds: Kinds of the replicas' devices (`"gpu"`, `"cpu"`).
        policy: `"auto"` (the regions when every replica is a GPU,
            `compiled_by_default`), `"on"` (always) or `"off"` (never).

    Returns:
        The list of regions (`regions_for(plan)`), or None when nothing is
        to be compiled.

    Raises:
        BackendError: For an unknown policy.
    """
    from autodist_keras.errors import BackendError

    if policy not in OP_FUSION_POLICIES:
        raise BackendError(
            f"Unknown op_fusion policy {policy!r}. "
            f"Valid: {', '.join(OP_FUSION_POLICIES)}. Received: op_fusion={policy!r}"
        )
    regions = regions_for(plan)
    if not regions or policy == "off":
        return None
    if policy == "auto" and not compiled_by_default(device_kinds):
        return None
    return regions
