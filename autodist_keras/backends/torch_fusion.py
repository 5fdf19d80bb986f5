"""Op-fusion regions as `torch.compile`d functions in the PyTorch runtime.

Disco plans carry `plan.op_fusion`: lists of adjacent layers to compile as one
unit. On the torch backend Keras runs a functional model layer by layer
(`Function._run_through_graph`); `TorchFusionRegions` replaces the model's
`call` while a fit runs with the same graph walk, in which each realised
region is one `torch.compile`d function: its first layer's node runs every
layer of the region (each layer's own `call`, with the `training` flag, so
training-mode updates such as BatchNormalization's moving statistics happen
as without fusion), and its other nodes pass the result through.
TorchInductor (the default compiler) then fuses the region's element-wise
work into a few kernels, forward and backward.

A region is realised when it is a chain: every layer is called once in the
model, each layer after the first takes exactly the previous layer's output,
no output but the last is used outside the region, and no layer needs what
Keras's `__call__` adds around `call` (mixed-precision casts, masks) or draws
random numbers. Other regions run layer by layer, and `fallbacks` says why;
nothing is dropped silently.

Example:

```python
fusion = TorchFusionRegions(model, [["conv0", "bn0", "relu0"]])
fusion.install()          # model.call now runs the region compiled
model.fit(x, y)
fusion.uninstall()        # model.call is Keras's own again
print(fusion.realised, fusion.fallbacks, fusion.calls)
```
"""

from autodist_keras.errors import BackendError

DEFAULT_COMPILER = "inductor"


class TorchFusionRegions:
    """Runs the chains among `regions` as compiled units in a Keras model.

    Args:
        model: A built Keras functional or Sequential model (torch backend).
        regions: Lists of layer names (`fusion.op_fusion.regions_for(plan)`);
            regions of one layer are ignored. A name that is not a layer of
            `model` raises `BackendError`.
        compiler: The `torch.compile` backend (`"inductor"` by default;
            `"aot_eager"` traces the same graphs without generating code).

    Attributes:
        realised: Indexes (into the regions of two or more layers) of the
            regions run as one compiled function.
        fallbacks: Dict `{index: reason}` of the regions run layer by layer.
        calls: Per region, how many times its compiled function ran.
    """

    def __init__(self, model, regions, compiler=DEFAULT_COMPILER):
        if not isinstance(compiler, str) or not compiler:
            raise BackendError(
                "op_fusion_compiler must name a torch.compile backend, e.g. 'inductor'. "
                f"Received: {compiler!r}"
            )
        self.compiler = compiler
        from autodist_keras.fusion.op_fusion import region_layers

        self.regions, layers = region_layers(model, regions)
        self.graph = _functional_of(model)
        self.realised = []
        self.fallbacks = {}
        self.calls = [0] * len(self.regions)
        self._role = {}  # id(layer) -> (region index, position in the chain)
        self._chains = {}  # region index -> list of layers
        self._compiled = {}
        self._installed = None
        self._analyse(layers)

    # ------------------------------------------------------------ analysis
    def _analyse(self, layers):
        if self.graph is None:
            for index in range(len(self.regions)):
                self.fallbacks[index] = (
                    "the model is not a functional or built Sequential model, whose graph "
                    "the runtime walks"
                )
            return
        nodes = [n for depth in self.graph._nodes_by_depth.values() for n in depth
                 if n.operation is not None and not n.is_input]
        node_of = {}
        for node in nodes:
            node_of.setdefault(id(node.operation), []).append(node)
        output_ids = {id(t) for t in self.graph.outputs}
        for index, region in enumerate(self.regions):
            reason = None
            chain = [layers[name] for name in region]
            chain_nodes = []
            for layer in chain:
                found = node_of.get(id(layer), [])
                if len(found) != 1:
                    reason = (f"layer {layer.name!r} is called {len(found)} times in the "
                              "model's graph (a region needs each layer called once)")
                    break
                chain_nodes.append(found[0])
            if reason is None:
                reason = _chain_problem(chain, chain_nodes, nodes, output_ids)
            if reason is None and any(id(layer) in self._role for layer in chain):
                reason = "a layer of the region is already in an earlier region"
            if reason is not None:
                self.fallbacks[index] = reason
                continue
            for position, layer in enumerate(chain):
                self._role[id(layer)] = (index, position)
            self._chains[index] = chain
            self.realised.append(index)

    @property
    def active(self):
        """True when at least one region runs compiled."""
        return bool(self.realised)

    # ------------------------------------------------------------ install
    def install(self):
        """Makes the model's `call` run the realised regions compiled."""
        if not self.active or self._installed is not None:
            return
        graph = self.graph
        had_own = "call" in graph.__dict__
        self._installed = (graph, had_own, graph.__dict__.get("call"))
        graph.call = self._call

    def uninstall(self):
        """Gives the model back its own `call`."""
        if self._installed is None:
            return
        graph, had_own, own = self._installed
        if had_own:
            graph.call = own
        else:
            graph.__dict__.pop("call", None)
        self._installed = None

    # ------------------------------------------------------------ running
    def _call(self, inputs, training=None, mask=None, **kwargs):
        from keras.src.models.functional import operation_fn
        from keras.src.models.functional import unpack_singleton

        graph = self.graph
        if mask is not None:
            # Masks ride on tensors between layers; keep Keras's own walk for them.
            return type(graph).call(graph, inputs, training=training, mask=mask, **kwargs)
        inputs = graph._standardize_inputs(inputs)
        context = dict(kwargs, training=training)

        def op_fn(op):
            role = self._role.get(id(op))
            if role is None:
                return operation_fn(op, **context)
            index, position = role
            if position > 0:
                # The region's first node already ran this layer: pass its result on.
                return lambda *args, **kw: args[0]
            return lambda x, **kw: self._run_region(index, x, training)

        outputs = graph._run_through_graph(inputs, operation_fn=op_fn)
        return unpack_singleton(outputs)

    def _run_region(self, index, x, training):
        compiled = self._compiled.get(index)
        if compiled is None:
            compiled = self._compiled[index] = _compile_chain(
                self._chains[index], index, self.compiler)
        self.calls[index] += 1
        return compiled(x, training)

    def summary(self):
        """A JSON-ready dict: regions, realised, fallbacks (with reasons), calls, compiler."""
        return {
            "regions": [list(r) for r in self.regions],
            "realised": list(self.realised),
            "fallbacks": {str(k): v for k, v in self.fallbacks.items()},
            "calls": list(self.calls),
            "compiler": self.compiler,
        }


def run_info(fusion):
    """The adapter's `last_run` facts for `fusion` (a `TorchFusionRegions` or None)."""
    return {"op_fusion_regions": len(fusion.realised) if fusion else 0,
            "op_fusion": fusion.summary() if fusion else None}


def _compile_chain(chain, index, compiler):
    """`torch.compile` of one region: each layer's `call` on the previous output.

    The layers' `call` methods run directly (Keras's `__call__` bookkeeping
    would break the traced graph at every layer); `_analyse` only admits
    layers for which that is what `__call__` would do: one tensor in, no
    mask, compute dtype equal to the variable dtype (no autocast). Every
    region gets its own code object, because TorchDynamo keeps its compiled
    variants per code object and would otherwise recompile as regions
    alternate.
    """
    import types

    import torch

    takes_training = [bool(getattr(layer, "_call_has_training_arg", False)) for layer in chain]

    def run_chain(x, training):
        for layer, with_training in zip(chain, takes_training):
            x = layer.call(x, training=training) if with_training else layer.call(x)
        return x

    code = run_chain.__code__.replace(co_name=f"autodist_fusion_region_{index}")
    fn = types.FunctionType(code, run_chain.__globals__, code.co_name,
                            run_chain.__defaults__, run_chain.__closure__)
    return torch.compile(fn, backend=compiler)


def _chain_problem(chain, chain_nodes, nodes, output_ids):
    """Why `chain_nodes` cannot run as one unit, or None."""
    first = chain_nodes[0]
    if (len(first.input_tensors) != 1 or len(first.arguments.args) != 1
            or any(v is not None for v in first.arguments.kwargs.values())):
        return (f"its first layer {chain[0].name!r} takes {len(first.input_tensors)} input "
                "tensors or keyword arguments (a region starts with a one-input layer)")
    from autodist_keras.graph.model_graph import autocasts, computes_mask, random_layer

    for layer in chain:
        if autocasts(layer):
            policy = layer.dtype_policy
            return (f"layer {layer.name!r} computes in {policy.compute_dtype} with "
                    f"{policy.variable_dtype} variables (mixed precision runs through "
                    "Keras's own layer call, which casts)")
        if computes_mask(layer):
            return f"layer {layer.name!r} computes masks, which a region does not carry"
        if random_layer(layer) is not None:
            return (f"layer {layer.name!r} draws random numbers (e.g. Dropout), which "
                    "compiled code would draw differently from Keras's own call")
    members = {id(n) for n in chain_nodes}
    inner = set()
    for previous, node, layer in zip(chain_nodes, chain_nodes[1:], chain[1:]):
        if len(previous.outputs) != 1:
            return f"layer {previous.operation.name!r} has {len(previous.outputs)} outputs"
        if (len(node.input_tensors) != 1 or len(node.arguments.args) != 1
                or any(v is not None for v in node.arguments.kwargs.values())
                or id(node.input_tensors[0]) != id(previous.outputs[0])):
            return (f"layer {layer.name!r} does not take exactly the output of "
                    f"{previous.operation.name!r}, and nothing else (a region must be a "
                    "chain)")
        inner.add(id(previous.outputs[0]))
    if inner & output_ids:
        return "an inner layer's output is also a model output"
    for node in nodes:
        if id(node) not in members and any(id(t) in inner for t in node.input_tensors):
            return (f"layer {node.operation.name!r} outside the region uses an inner "
                    "layer's output")
    return None


def _functional_of(model):
    """The `Functional` whose graph runs `model`, or None."""
    from keras.src.models.functional import Functional
    from keras.src.models.sequential import Sequential

    if isinstance(model, Sequential):
        return model._functional  # None until built with a known input shape
    if isinstance(model, Functional):
        return model
    return None


def for_plan(model, plan, device_kinds, policy="auto", compiler=DEFAULT_COMPILER):
    """The `TorchFusionRegions` to realise for `plan`, or None.

    Args:
        model: The Keras model (torch backend).
        plan: The `Plan` (its `op_fusion` regions).
        device_kinds: Kinds of the replicas' devices (`"gpu"`, `"cpu"`).
        policy: `"auto"` realises none (`fusion.op_fusion.compiled_by_default`:
            torch.compile regions were measured slower than eager Keras on the
            CPU and on an NVIDIA H200), `"on"` always, `"off"` never.
        compiler: The `torch.compile` backend.

    Returns:
        A `TorchFusionRegions`, or None when nothing is realised. When it
        compiles regions, a line on stderr says the first step will take
        longer (TorchInductor compiles while it runs).

    Raises:
        BackendError: For an unknown policy or a region naming an unknown layer.
    """
    from autodist_keras.fusion.op_fusion import regions_to_realise

    regions = regions_to_realise(plan, device_kinds, policy)
    if regions is None:
        return None
    fusion = TorchFusionRegions(model, regions, compiler=compiler)
    if fusion.active:
        _announce_compilation(fusion)
    return fusion


def _announce_compilation(fusion):
    """Says on stderr why the first step will pause: `torch.compile` runs then."""
    import sys

    print(
        f"autodist_keras: {len(fusion.realised)} op-fusion region(s) run compiled with "
        f"torch.compile (backend {fusion.compiler!r}); the first step compiles them, which "
        "took 20-45 s with TorchInductor on a 2-core CPU machine (docs/disco.md). "
        "op_fusion='off' runs the layers uncompiled.",
        file=sys.stderr, flush=True,
    )
