"""`ModelGraph`: the DAG of a Keras model's layer calls, with costs and sizes.

`ModelGraph.from_keras(model)` reads a built Keras 3 model through its
functional-API structures (read-only) and returns one node per layer call:

- Sequential and Functional models; models used as layers inside another
  model are flattened into their own layer calls.
- A layer called several times (shared weights) gives one node per call,
  named `"name"`, `"name#1"`, `"name#2"`, ...; its variables belong to the
  first call.
- Input layers are nodes (`kind="input"`, 0 FLOPs) so the bytes fed to the
  first layers appear on edges; planners place them like any layer.
- `keras.ops` calls in a functional model are nodes too (`kind="op"`).
- A subclassed model without a functional graph is one node holding every
  variable (`kind="model"`); `graph.data_parallel_only` is then True.

Per-sample figures exclude the batch dimension; FLOPs count 2 per
multiply-add. The formulas are in `autodist_keras.graph.flops` and
`docs/graph.md`.

Example:

```python
graph = ModelGraph.from_keras(keras.applications.ResNet50(weights=None))
print(graph.forward_flops / 1e9, "GFLOPs per image (multiply-adds count 2, elementwise ops 1)")
print(graph.summary())
```
"""

import dataclasses
import functools
import hashlib
import inspect
import io
import json
import math

import networkx

from autodist_keras.errors import GraphError
from autodist_keras.graph import flops as flops_lib

SCHEMA_VERSION = 1
KINDS = ("input", "layer", "op", "model")

DEFAULT_OPTIMIZER_SLOTS = 2  # Adam's m and v: assumed when the optimizer is unknown
# Optimizer state tensors of the size of a parameter that each Keras optimizer keeps
# per trainable variable, before its options (`optimizer_slots` adds them).
_OPTIMIZER_SLOTS = {
    "SGD": 0, "RMSprop": 1, "Adagrad": 1, "Adam": 2, "AdamW": 2, "Nadam": 2,
    "Adamax": 2, "Lamb": 2, "Adadelta": 2, "Ftrl": 2, "Lion": 1, "Adafactor": 1,
}


@dataclasses.dataclass
class TensorInfo:
    """A trainable tensor (a Keras variable).

    Args:
        name: The variable's Keras path (`v.path`), e.g. `"dense/kernel"`.
        shape: Its shape.
        dtype: Its dtype name.
        bytes: Its size in bytes.
    """

    name: str
    shape: tuple
    dtype: str
    bytes: int

    @property
    def size(self):
        """Number of elements."""
        return math.prod(self.shape)

    def to_dict(self):
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype,
                "bytes": self.bytes}

    @classmethod
    def from_dict(cls, data):
        return cls(name=data["name"], shape=tuple(data["shape"]), dtype=data["dtype"],
                   bytes=int(data["bytes"]))


@dataclasses.dataclass
class LayerNode:
    """One layer call (or op call) in the model graph. Figures are per sample.

    Args:
        name: Unique node id: the layer name, or `"name#k"` for the k-th
            extra call of a shared layer.
        layer_name: The Keras layer (or op) name.
        layer_type: Its class name, e.g. `"Conv2D"`.
        input_shapes: Per-sample input shapes (None for unknown dims).
        output_shapes: Per-sample output shapes.
        forward_flops: Forward FLOPs per sample.
        backward_flops: Backward FLOPs per sample.
        variables: Trainable tensors owned by this node.
        non_trainable_bytes: Bytes of non-trainable weights owned by this node.
        output_bytes: Bytes of the output activations per sample.
        estimated: True when the FLOPs are a fallback estimate.
        kind: `"input"`, `"layer"`, `"op"` (a `keras.ops` call) or `"model"`
            (an opaque subclassed model).
        multiply_adds: Multiply-accumulates of matrix products per sample.
        non_trainable_params: Number of non-trainable scalars owned.
        output_dtypes: Dtypes of the outputs.
        saved_bytes: Bytes per sample the layer keeps for its backward pass
            besides its outputs (attention: projections and probabilities).
        draws_random: Whether the layer (or one nested in it) draws random
            numbers (`random_layer`): Dropout, GaussianNoise. Not part of
            the fingerprint.
        computes_mask: Whether the layer computes a Keras mask for the
            layers after it (`computes_mask`): Embedding, Masking, merge
            layers. Not part of the fingerprint.
        autocasts: Whether the layer computes in another dtype than its
            variables' (mixed precision, `autocasts`). Not part of the
            fingerprint.
        nested: Whether the call is inside a nested model (a functional or
            Sequential model used as a layer). Not part of the fingerprint.
        extra_arguments: Whether the call passes more than its one input
            positionally, or a keyword argument that is not None (e.g.
            `training=False`). Not part of the fingerprint.
    """

    name: str
    layer_name: str
    layer_type: str
    input_shapes: list
    output_shapes: list
    forward_flops: float
    backward_flops: float
    variables: list
    non_trainable_bytes: int
    output_bytes: int
    estimated: bool = False
    kind: str = "layer"
    multiply_adds: float = 0.0
    non_trainable_params: int = 0
    output_dtypes: list = dataclasses.field(default_factory=list)
    saved_bytes: int = 0
    draws_random: bool = False
    computes_mask: bool = False
    autocasts: bool = False
    nested: bool = False
    extra_arguments: bool = False

    @property
    def activation_bytes(self):
        """Bytes per sample held from the forward to the backward pass: the
        outputs and what the layer saves inside (`saved_bytes`)."""
        return self.output_bytes + self.saved_bytes

    @property
    def trainable_params(self):
        """Number of trainable scalars owned by this node."""
        return sum(v.size for v in self.variables)

    @property
    def param_bytes(self):
        """Bytes of the trainable tensors owned by this node."""
        return sum(v.bytes for v in self.variables)

    def to_dict(self):
        return {
            "name": self.name,
            "layer_name": self.layer_name,
            "layer_type": self.layer_type,
            "kind": self.kind,
            "input_shapes": [list(s) for s in self.input_shapes],
            "output_shapes": [list(s) for s in self.output_shapes],
            "output_dtypes": list(self.output_dtypes),
            "forward_flops": self.forward_flops,
            "backward_flops": self.backward_flops,
            "multiply_adds": self.multiply_adds,
            "variables": [v.to_dict() for v in self.variables],
            "non_trainable_bytes": self.non_trainable_bytes,
            "non_trainable_params": self.non_trainable_params,
            "output_bytes": self.output_bytes,
            "saved_bytes": self.saved_bytes,
            "estimated": self.estimated,
            "draws_random": self.draws_random,
            "computes_mask": self.computes_mask,
            "autocasts": self.autocasts,
            "nested": self.nested,
            "extra_arguments": self.extra_arguments,
        }

    @classmethod
    def from_dict(cls, data):
        return cls(
            name=data["name"],
            layer_name=data["layer_name"],
            layer_type=data["layer_type"],
            kind=data.get("kind", "layer"),
            input_shapes=[tuple(s) for s in data["input_shapes"]],
            output_shapes=[tuple(s) for s in data["output_shapes"]],
            output_dtypes=list(data.get("output_dtypes", [])),
            forward_flops=float(data["forward_flops"]),
            backward_flops=float(data["backward_flops"]),
            multiply_adds=float(data.get("multiply_adds", 0.0)),
            variables=[TensorInfo.from_dict(v) for v in data["variables"]],
            non_trainable_bytes=int(data["non_trainable_bytes"]),
            non_trainable_params=int(data.get("non_trainable_params", 0)),
            output_bytes=int(data["output_bytes"]),
            saved_bytes=int(data.get("saved_bytes", 0)),
            estimated=bool(data["estimated"]),
            draws_random=bool(data.get("draws_random", False)),
            computes_mask=bool(data.get("computes_mask", False)),
            autocasts=bool(data.get("autocasts", False)),
            nested=bool(data.get("nested", False)),
            extra_arguments=bool(data.get("extra_arguments", False)),
        )


class ModelGraph:
    """The layer-call DAG of a Keras model, with per-sample costs.

    Build one with `ModelGraph.from_keras(model)` (or `from_dict` on
    `to_dict()` output).

    Attributes:
        name: The model name.
        nodes: Dict from node name to `LayerNode`, in topological order.
        edges: List of `(src, dst, bytes_per_sample)`.
        inputs: Names of the input nodes, in `model.inputs` order.
        outputs: Names of the nodes producing the model outputs.
        variables: Every trainable tensor, in `model.trainable_weights` order.
        warnings: Human-readable notes (estimates, unknown dims, ...).
        optimizer_slots: Optimizer state tensors kept per trainable
            parameter, each the parameter's size, read from the compiled
            model's optimizer by `from_keras` (`optimizer_slots()`): 0 for
            plain SGD, 2 for Adam. `DEFAULT_OPTIMIZER_SLOTS` (2, as Adam)
            when unknown: an uncompiled model, a graph read from JSON written
            before it was recorded. The memory model counts them. Not part
            of the fingerprint.
        optimizer: The optimizer's class name (e.g. `"SGD"`), or None when
            unknown. Not part of the fingerprint.
        data_parallel_only: True when the model has no functional graph
            (subclassed), so only data-parallel plans apply.
        params: Total number of scalars in the model's weights, trainable
            and non-trainable (equals `model.count_params()`).
        trainable_params: Number of trainable scalars.
        param_bytes: Bytes of the trainable tensors.
        non_trainable_bytes: Bytes of the non-trainable weights.
        forward_flops, backward_flops, multiply_adds: Per-sample totals.
        activation_bytes: Sum of every node's `activation_bytes` per sample
            (outputs, and what attention layers keep for backward).
        calls: For a graph made by `from_keras`, a dict from node name to
            `(operation, keras_node)`: the Keras layer (or op, or the
            subclassed model) and the `keras.src.ops.node.Node` of that call
            (`None` for a subclassed model). Empty for graphs read with
            `from_dict`. Not part of `to_dict()` or the fingerprint.
        nx: The same graph as a `networkx.DiGraph` (node attribute `node`
            holds the `LayerNode`, plus `layer_type`, `forward_flops`,
            `backward_flops`, `output_bytes`, `param_bytes`; edge attribute
            `bytes`).
    """

    def __init__(self, nodes, edges, inputs, outputs, variables, warnings=(),
                 data_parallel_only=False, name="model",
                 optimizer_slots=DEFAULT_OPTIMIZER_SLOTS, optimizer=None):
        self.name = name
        self.optimizer_slots = int(optimizer_slots)
        self.optimizer = optimizer
        self.nodes = dict(nodes)
        self.edges = [(s, d, int(b)) for s, d, b in edges]
        self.inputs = list(inputs)
        self.outputs = list(outputs)
        self.variables = list(variables)
        self.warnings = list(warnings)
        self.data_parallel_only = bool(data_parallel_only)
        self.calls = {}

    # ------------------------------------------------------------- totals
    @property
    def forward_flops(self):
        return float(sum(n.forward_flops for n in self.nodes.values()))

    @property
    def backward_flops(self):
        return float(sum(n.backward_flops for n in self.nodes.values()))

    @property
    def multiply_adds(self):
        return float(sum(n.multiply_adds for n in self.nodes.values()))

    @property
    def unknown_dims(self):
        """Names of the nodes with a shape dimension the model leaves unknown (None).

        Such a dimension (a sequence length of `Input((None,))`, say) counts as
        1 in FLOPs and bytes; `from_keras(model, input_shapes=...)` fills it.
        """
        return [n.name for n in self.nodes.values()
                if _has_unknown(list(n.input_shapes) + list(n.output_shapes))]

    @property
    def trainable_params(self):
        return sum(v.size for v in self.variables)

    @property
    def params(self):
        return self.trainable_params + sum(
            n.non_trainable_params for n in self.nodes.values()
        )

    @property
    def param_bytes(self):
        return sum(v.bytes for v in self.variables)

    @property
    def non_trainable_bytes(self):
        return sum(n.non_trainable_bytes for n in self.nodes.values())

    @property
    def activation_bytes(self):
        return sum(n.activation_bytes for n in self.nodes.values())

    @functools.cached_property
    def variable_owner(self):
        """Dict from variable name to the name of the node owning it."""
        return {v.name: n.name for n in self.nodes.values() for v in n.variables}

    @functools.cached_property
    def nx(self):
        g = networkx.DiGraph(name=self.name)
        for node in self.nodes.values():
            g.add_node(
                node.name, node=node, layer_type=node.layer_type,
                forward_flops=node.forward_flops, backward_flops=node.backward_flops,
                output_bytes=node.output_bytes, param_bytes=node.param_bytes,
            )
        for src, dst, nbytes in self.edges:
            g.add_edge(src, dst, bytes=nbytes)
        return g

    def __len__(self):
        return len(self.nodes)

    def __repr__(self):
        return (
            f"<ModelGraph {self.name!r}: {len(self.nodes)} nodes, {len(self.edges)} edges, "
            f"{self.params:,} params, {self.forward_flops / 1e9:.3f} GFLOP fwd/sample>"
        )

    # -------------------------------------------------------- construction
    @classmethod
    def from_keras(cls, model, input_shapes=None):
        """Builds the graph of a built Keras model.

        Args:
            model: A `keras.Model` (Functional, Sequential or subclassed).
                It must be built: a Sequential needs an input shape (an
                `Input` first or a `build()` call); a subclassed model must
                have been called or built.
            input_shapes: Optional per-sample shapes (without the batch axis)
                of the model's inputs, in the order of `model.inputs`, such as
                those of the first training batch. They fill the dimensions
                the model leaves unknown (`keras.Input((None,))`: a sequence
                length), which otherwise count as 1 in FLOPs and bytes; every
                layer's shapes are derived again from them (Keras's
                `compute_output_spec`). Dimensions the model fixes are kept.
                Functional and Sequential models only; ignored, with a
                warning in `graph.warnings`, where they do not fit.

        Returns:
            A `ModelGraph`.

        Raises:
            GraphError: If `model` is not a Keras model or is not built.

        Example:

        ```python
        inputs = keras.Input((16,))
        outputs = keras.layers.Dense(4)(inputs)
        graph = ModelGraph.from_keras(keras.Model(inputs, outputs))
        assert graph.forward_flops == 2 * 16 * 4 + 4
        ```
        """
        import keras

        if not isinstance(model, keras.Model):
            raise GraphError(
                "ModelGraph.from_keras expects a keras.Model (Functional, Sequential or "
                "subclassed). Wrap a layer in a model first, e.g. "
                "`keras.Model(inputs, layer(inputs))`. "
                f"Received: {type(model).__module__}.{type(model).__name__}"
            )
        functional = _functional_of(model)
        if functional is None:
            if isinstance(model, keras.Sequential):
                raise GraphError(
                    f"The Sequential model {model.name!r} is not built, so its layer "
                    "shapes are unknown. Start it with `keras.Input(shape)` or call "
                    "`model.build((None, ...))` (or the model on a batch) first. "
                    f"Received: an unbuilt Sequential with {len(model.layers)} layers."
                )
            graph = _from_subclassed(cls, model)
        else:
            builder = _Builder(model)
            if input_shapes is not None:
                builder.concrete, problem = _concrete_tensors(functional, input_shapes)
                if problem:
                    builder.warnings.append(problem)
            elif _nested_shapes_open(functional):
                # A nested model built on `Input((None, d))` and called on a tensor of
                # known length: its own tensors leave the length open, so its layers
                # are derived again from the model's own input shapes.
                own = [_per_sample(t.shape) for t in functional.inputs]
                builder.concrete, problem = _concrete_tensors(functional, own)
                if problem:
                    builder.warnings.append(
                        "The shapes of a nested model's layers could not be derived from "
                        "the shapes it is called on; its own (unknown) dimensions are "
                        f"counted. {problem}")
            builder.walk(functional, container=model.name, seed=None, top=True)
            graph = builder.finish(cls)
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None:
            graph.optimizer_slots, graph.optimizer = optimizer_slots(optimizer)
        return graph

    # ------------------------------------------------------------ identity
    def _canonical(self):
        index = {name: i for i, name in enumerate(self.nodes)}
        nodes = []
        for node in self.nodes.values():
            nodes.append([
                node.kind,
                node.layer_type,
                [list(s) for s in node.input_shapes],
                [list(s) for s in node.output_shapes],
                list(node.output_dtypes),
                [[list(v.shape), v.dtype] for v in node.variables],
                node.non_trainable_bytes,
                int(round(node.forward_flops)),
                int(round(node.backward_flops)),
            ])
        return {
            "schema_version": SCHEMA_VERSION,
            "data_parallel_only": self.data_parallel_only,
            "nodes": nodes,
            "edges": [[index[s], index[d], b] for s, d, b in self.edges],
            "inputs": [index[n] for n in self.inputs],
            "outputs": [index[n] for n in self.outputs],
        }

    def fingerprint(self):
        """A sha256 hex digest of the graph's structure.

        Covers layer types, shapes, dtypes, variable shapes, costs and the
        edges in topological-index form; not layer or variable names, which
        Keras numbers per process (`dense_3`). The same model code gives the
        same fingerprint in every process.
        """
        text = json.dumps(self._canonical(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode("utf-8")).hexdigest()

    # ---------------------------------------------------------------- JSON
    def to_dict(self):
        """Returns a JSON-safe dict (nodes, edges, totals, warnings, ...)."""
        return {
            "schema_version": SCHEMA_VERSION,
            "name": self.name,
            "nodes": [n.to_dict() for n in self.nodes.values()],
            "edges": [[s, d, b] for s, d, b in self.edges],
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
            "variables": [v.to_dict() for v in self.variables],
            "forward_flops": self.forward_flops,
            "backward_flops": self.backward_flops,
            "multiply_adds": self.multiply_adds,
            "params": self.params,
            "trainable_params": self.trainable_params,
            "param_bytes": self.param_bytes,
            "non_trainable_bytes": self.non_trainable_bytes,
            "activation_bytes": self.activation_bytes,
            "data_parallel_only": self.data_parallel_only,
            "optimizer": self.optimizer,
            "optimizer_slots": self.optimizer_slots,
            "warnings": list(self.warnings),
        }

    @classmethod
    def from_dict(cls, data, source="<dict>"):
        """Rebuilds a graph from `to_dict()` output (e.g. read from JSON).

        Raises:
            GraphError: If the dict is not a graph of a supported version.
        """
        if not isinstance(data, dict) or data.get("schema_version") != SCHEMA_VERSION:
            version = data.get("schema_version") if isinstance(data, dict) else None
            raise GraphError(
                f"{source}: not a ModelGraph dict of schema version {SCHEMA_VERSION}. "
                "Write graphs with ModelGraph.to_dict(). "
                f"Received: schema_version={version!r}"
            )
        try:
            nodes = {}
            for item in data["nodes"]:
                node = LayerNode.from_dict(item)
                nodes[node.name] = node
            by_name = {v.name: v for n in nodes.values() for v in n.variables}
            variables = [by_name.get(v["name"]) or TensorInfo.from_dict(v) for v in data["variables"]]
            return cls(
                nodes=nodes,
                edges=[tuple(e) for e in data["edges"]],
                inputs=data["inputs"],
                outputs=data["outputs"],
                variables=variables,
                warnings=data.get("warnings", []),
                data_parallel_only=data.get("data_parallel_only", False),
                name=data.get("name", "model"),
                optimizer_slots=_slots_field(data.get("optimizer_slots"), source),
                optimizer=data.get("optimizer"),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise GraphError(
                f"{source}: malformed ModelGraph dict ({type(e).__name__}: {e}). "
                "Write graphs with ModelGraph.to_dict()."
            ) from None

    # ------------------------------------------------------------- display
    def summary(self, max_rows=None):
        """Returns a readable table of the nodes and the totals.

        Args:
            max_rows: Show at most this many nodes (the costliest are not
                singled out: the first rows are shown, then a count).

        Returns:
            The table as a string.
        """
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text

        # Text, not markup: a layer named "[bold]dense" or "head[x]" lost its brackets
        # (and a "[/]" in a graph read from JSON stopped it with rich's MarkupError).
        table = Table(title=Text(f"{self.name}: {len(self.nodes)} nodes, "
                                 f"{len(self.edges)} edges"),
                      title_justify="left")
        for column, justify in (("#", "right"), ("node", "left"), ("type", "left"),
                                ("output shape", "left"), ("params", "right"),
                                ("fwd FLOP", "right"), ("bwd FLOP", "right"),
                                ("out bytes", "right")):
            table.add_column(column, justify=justify)
        rows = list(self.nodes.values())
        shown = rows if max_rows is None else rows[:max_rows]
        for i, node in enumerate(shown):
            shapes = ", ".join(_shape_text(s) for s in node.output_shapes)
            table.add_row(*(Text(cell) for cell in (
                str(i), node.name, node.layer_type + ("*" if node.estimated else ""), shapes,
                f"{node.trainable_params + node.non_trainable_params:,}",
                _si(node.forward_flops), _si(node.backward_flops), _si(node.output_bytes),
            )))
        if len(shown) < len(rows):
            table.add_row("...", f"({len(rows) - len(shown)} more)", "", "", "", "", "", "")
        buffer = io.StringIO()
        console = Console(file=buffer, width=130, force_terminal=False, color_system=None)
        console.print(table)
        lines = [
            buffer.getvalue().rstrip(),
            f"Params: {self.params:,} ({self.trainable_params:,} trainable, "
            f"{_si(self.param_bytes)}B trainable)",
            f"Per sample: forward {_si(self.forward_flops)}FLOP "
            f"({_si(self.multiply_adds)} multiply-adds), backward "
            f"{_si(self.backward_flops)}FLOP, activations {_si(self.activation_bytes)}B",
        ]
        if any(n.estimated for n in self.nodes.values()):
            lines.append("* FLOPs estimated (no formula for this type)")
        if self.data_parallel_only:
            lines.append("Only data-parallel plans apply to this model (no functional graph).")
        for warning in self.warnings:
            lines.append(f"warning: {warning}")
        return "\n".join(lines)


# ---------------------------------------------------------------------------
# Extraction
# ---------------------------------------------------------------------------
def optimizer_slots(optimizer):
    """Optimizer state tensors a Keras optimizer keeps per trainable parameter.

    Each slot is a tensor of the parameter's size (Adam's `m` and `v`: 2).
    The memory model counts `slots x parameter bytes` on every device that
    updates a variable. Counts: `SGD` 0 (1 with momentum); `RMSprop` 1, plus
    1 if `centered` and 1 with momentum; `Adagrad` 1; `Adam`, `AdamW`,
    `Nadam`, `Adamax`, `Lamb` 2 (`Adam`/`AdamW` 3 with `amsgrad`);
    `Adadelta` 2; `Ftrl` 2; `Lion` 1; `Adafactor` 1 (its row and column
    statistics of a matrix are much smaller than the matrix; counted as one
    slot); `use_ema=True` adds 1 (the moving average of the weights), and
    `gradient_accumulation_steps` above 1 adds 1 (the accumulated gradient). A
    `LossScaleOptimizer` counts its inner optimizer's. Subclasses count as
    their Keras base class. Any other optimizer class counts
    `DEFAULT_OPTIMIZER_SLOTS` (2, as Adam), a conservative guess.

    Args:
        optimizer: A Keras optimizer instance (`model.optimizer` after
            `compile`).

    Returns:
        `(slots, name)`: the number of slots and the optimizer's class name
        (the inner optimizer's for a `LossScaleOptimizer`, with
        `" (unknown: N assumed)"` appended for unknown classes).

    Example:

    ```python
    optimizer_slots(keras.optimizers.SGD(0.1))                # (0, "SGD")
    optimizer_slots(keras.optimizers.Adam(amsgrad=True))      # (3, "Adam")
    ```
    """
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None and type(optimizer).__name__ == "LossScaleOptimizer":
        optimizer = inner
    name = type(optimizer).__name__
    base = None
    for klass in type(optimizer).__mro__:
        if klass.__module__.startswith("keras") and klass.__name__ in _OPTIMIZER_SLOTS:
            base = klass.__name__
            break
    if base is None:
        return DEFAULT_OPTIMIZER_SLOTS, f"{name} (unknown: {DEFAULT_OPTIMIZER_SLOTS} assumed)"
    slots = _OPTIMIZER_SLOTS[base]

    def number(attr):
        try:
            return float(getattr(optimizer, attr, 0) or 0)
        except (TypeError, ValueError):
            return 1.0  # a schedule or variable: assume it is used

    if base == "SGD" and number("momentum"):
        slots += 1
    if base == "RMSprop":
        slots += int(bool(getattr(optimizer, "centered", False))) + int(bool(number("momentum")))
    if base in ("Adam", "AdamW") and getattr(optimizer, "amsgrad", False):
        slots += 1
    if getattr(optimizer, "use_ema", False):
        slots += 1
    try:
        accumulating = int(getattr(optimizer, "gradient_accumulation_steps", None) or 0) > 1
    except (TypeError, ValueError):
        accumulating = False
    if accumulating:
        slots += 1  # a gradient accumulator per variable
    return slots, name


def _slots_field(value, source):
    if value is None:
        return DEFAULT_OPTIMIZER_SLOTS
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise GraphError(
            f"{source}: `optimizer_slots` must be a non-negative integer (optimizer state "
            "tensors per parameter). Write graphs with ModelGraph.to_dict(). "
            f"Received: {value!r}"
        )
    return value


def _concrete_tensors(functional, input_shapes):
    """The tensors of `functional` re-derived from per-sample `input_shapes`.

    Each input's unknown (None) per-sample dimensions take the given ones;
    every layer call is then run symbolically (`compute_output_spec`, nested
    models call by call), as Keras's own `Functional.compute_output_spec`
    does, without adding nodes to the layers.

    Args:
        functional: The model's Functional graph.
        input_shapes: Per-sample shapes of `functional.inputs`, in order.

    Returns:
        `(tensors, problem)`: `{id(symbolic tensor): KerasTensor}` (with,
        under `_nested_key(node)`, the same map of each nested model's call)
        and None,
        or `({}, sentence)` when the shapes do not fit the inputs or a layer
        cannot derive its output from them (the graph then keeps the
        model's own shapes).
    """
    from keras import KerasTensor

    inputs = list(functional.inputs)
    try:
        shapes = [tuple(None if d is None else int(d) for d in shape) for shape in input_shapes]
    except (TypeError, ValueError):
        shapes = None
    if shapes is None or len(shapes) != len(inputs):
        return {}, (f"input_shapes do not match the model's {len(inputs)} input(s); shapes "
                    f"kept as the model gives them. Received: input_shapes={input_shapes!r}")
    given = []
    for tensor, shape in zip(inputs, shapes):
        own = tuple(tensor.shape)[1:]
        if len(shape) != len(own) or any(
                d is not None and g is not None and d != g for d, g in zip(own, shape)):
            return {}, (f"input_shapes do not fit input {tensor.name!r} of shape {own}; shapes "
                        f"kept as the model gives them. Received: input_shapes={input_shapes!r}")
        filled = tuple(d if d is not None else g for d, g in zip(own, shape))
        given.append(KerasTensor((tensor.shape[0],) + filled, dtype=tensor.dtype,
                                 sparse=getattr(tensor, "sparse", False)))
    found = {}
    try:
        _derive(functional, given, found)
    except Exception as e:  # noqa: BLE001  (a layer's own shape inference failing)
        return {}, (f"The layers' shapes could not be derived from input_shapes "
                    f"({type(e).__name__}: {str(e)[:200]}); shapes kept as the model gives "
                    f"them. Received: input_shapes={input_shapes!r}")
    return found, None


def _derive(functional, given, found):
    """Adds `functional`'s tensors computed from `given` to `found`; returns its outputs."""
    from keras import tree

    for x, y in zip(functional.inputs, given):
        found[id(x)] = y
    for node in _Builder._ordered_nodes(functional):
        op = node.operation
        if op is None or node.is_input or any(id(x) not in found for x in node.input_tensors):
            continue
        args, kwargs = node.arguments.fill_in(found)
        inner = _functional_of(op)
        if inner is not None:  # a nested model: its own layers, call by call
            passed = args[0] if args else next(iter(kwargs.values()), None)
            # `inner.inputs` is its input structure flattened (a dict by sorted key).
            # Each call has its own map: the inner tensors are the same objects in
            # every call of a shared model (a siamese encoder's query and document).
            inner_found = found[_nested_key(node)] = {}
            outputs = _derive(inner, tree.flatten(passed), inner_found)
        else:
            outputs = tree.flatten(op.compute_output_spec(*args, **kwargs))
        for x, y in zip(node.outputs, outputs):
            found[id(x)] = y
    return [found.get(id(x)) for x in functional.outputs]


def _nested_shapes_open(functional, seen=None):
    """Whether a nested model in `functional` leaves open a dimension its call fixes.

    A model built on `keras.Input((None, 8))` and called as a layer on a
    `(40, 8)` tensor has layers whose own tensors say length None; the call
    says 40.

    Args:
        functional: A Functional graph (a model's, or a nested model's).
        seen: Ids of the nested models already looked at.

    Returns:
        True when some nested model's input has an unknown (None) per-sample
        dimension that the tensor it is called on knows, at any depth.
    """
    seen = set() if seen is None else seen
    for node in _Builder._ordered_nodes(functional):
        op = node.operation
        inner = _functional_of(op) if op is not None and not node.is_input else None
        if inner is None:
            continue
        _, outer, own_inputs = _nested_call_inputs(node, inner)
        for given, own in zip(outer, own_inputs):
            given_shape = tuple(getattr(given, "shape", ()) or ())[1:]
            own_shape = tuple(own.shape)[1:]
            if len(given_shape) == len(own_shape) and any(
                    o is None and g is not None for o, g in zip(own_shape, given_shape)):
                return True
        if id(inner) not in seen:
            seen.add(id(inner))
            if _nested_shapes_open(inner, seen):
                return True
    return False


def _nested_call_inputs(node, inner):
    """The tensors a nested model's call passes, paired with the model's inputs.

    Args:
        node: The Keras node of the call.
        inner: The nested model's Functional graph.

    Returns:
        `(given, outer, own)`: the call's first argument as passed, its
        tensors flattened, and the nested model's input tensors in the same
        order (a dict argument is matched to a dict-input model by key).
    """
    from keras import tree

    args = node.arguments.args
    given = args[0] if args else next(iter(node.arguments.kwargs.values()), None)
    outer = list(tree.flatten(given)) if given is not None else []
    own = list(inner.inputs)
    struct = getattr(inner, "_inputs_struct", None)
    if isinstance(struct, dict) and isinstance(given, dict):
        outer = [given[k] for k in struct]
        own = [struct[k] for k in struct]
    return given, outer, own


def _nested_key(node):
    """The key of a nested model's call in `_concrete_tensors`'s map (its inner map)."""
    return ("nested call", id(node))


def _functional_of(model):
    """The Functional graph object of a model, or None (unbuilt Sequential, subclassed)."""
    from keras.src.models.functional import Functional
    from keras.src.models.sequential import Sequential

    if isinstance(model, Sequential):
        return getattr(model, "_functional", None)
    if isinstance(model, Functional):
        return model
    return None


def random_layer(layer):
    """`layer`, or a layer nested in it, that draws random numbers, or None.

    A layer draws random numbers when it holds a `keras.random.SeedGenerator`
    (Dropout, GaussianNoise, random augmentation layers). Compiled regions
    (XLA, `torch.compile`) would draw other numbers than Keras's own call, so
    op fusion leaves such layers out.

    Args:
        layer: A Keras layer.

    Returns:
        The layer holding a seed generator, or None.
    """
    from keras.random import SeedGenerator

    flatten = getattr(layer, "_flatten_layers", None)
    for inner in (flatten(include_self=True) if flatten else [layer]):
        if getattr(inner, "_seed_generators", None) or any(
                isinstance(v, SeedGenerator) for v in vars(inner).values()):
            return inner
    return None


def computes_mask(layer):
    """Whether `layer` computes a Keras mask for the layers after it.

    True for a layer that supports masking and has its own `compute_mask`
    (Embedding, Masking, the merge layers, recurrent layers returning
    sequences). The PyTorch runtime's compiled regions carry no masks, so
    they leave such layers out.

    Args:
        layer: A Keras layer.

    Returns:
        A bool.
    """
    from keras.src.layers.layer import Layer

    return bool(getattr(layer, "supports_masking", False)) and (
        type(layer).compute_mask is not Layer.compute_mask)


def autocasts(layer):
    """Whether `layer` computes in another dtype than its variables' (mixed precision).

    Keras's `__call__` casts such a layer's inputs; the PyTorch runtime's
    compiled regions call `call` directly, so they leave such layers out.

    Args:
        layer: A Keras layer.

    Returns:
        A bool.
    """
    policy = getattr(layer, "dtype_policy", None)
    return policy is not None and policy.compute_dtype != policy.variable_dtype


def _per_sample(shape):
    shape = tuple(shape)
    return tuple(None if d is None else int(d) for d in shape[1:])


def _has_unknown(shapes):
    """Whether any of the per-sample `shapes` has an unknown (None) dimension."""
    return any(d is None for s in shapes for d in s)


def _known(shape):
    return tuple(1 if d is None else d for d in shape)


def _tensor_bytes(tensor):
    return flops_lib.elements(_per_sample(tensor.shape)) * flops_lib.dtype_bytes(tensor.dtype)


def _element_bytes(outputs):
    """Bytes of one element of a layer's (first) output: its compute dtype."""
    return flops_lib.dtype_bytes(outputs[0].dtype) if outputs else 4


def _si(value):
    """Compact number: 950, 12.3k, 4.56M, 7.89G, 1.23T."""
    for factor, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g}{suffix}"
    return f"{value:.3g}"


def _shape_text(shape):
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + ")"


def _variable_info(v):
    shape = tuple(int(d) for d in v.shape)
    return TensorInfo(
        name=v.path, shape=shape, dtype=str(v.dtype),
        bytes=math.prod(shape) * flops_lib.dtype_bytes(v.dtype),
    )


_SIGNATURES = {}


def _bound_arguments(layer, node, spec=lambda tensor: tensor):
    """Dict from call-argument name to a per-sample shape (tensors only); `spec`
    maps a symbolic tensor to the one whose shape counts (`_Builder._spec`)."""
    from keras import KerasTensor

    cls = type(layer)
    sig = _SIGNATURES.get(cls)
    if sig is None:
        try:
            sig = inspect.signature(layer.call)
        except (TypeError, ValueError):
            sig = False
        _SIGNATURES[cls] = sig
    if not sig:
        return {}
    try:
        bound = sig.bind_partial(*node.arguments.args, **node.arguments.kwargs)
    except TypeError:
        return {}
    out = {}
    for name, value in bound.arguments.items():
        if isinstance(value, KerasTensor):
            out[name] = _known(_per_sample(spec(value).shape))
        elif isinstance(value, (list, tuple)) and value and all(
            isinstance(v, KerasTensor) for v in value
        ):
            out[name] = [_known(_per_sample(spec(v).shape)) for v in value]
    return out


class _Builder:
    """Walks a functional graph (recursively through nested models)."""

    def __init__(self, model):
        self.model = model
        self.nodes = {}
        self.edges = {}
        self.inputs = []
        self.outputs = []
        self.warnings = []
        self.unknown_dims = []
        self.estimated = {}
        self.call_counts = {}
        self.base_names = {}
        self.taken = set()
        self.claimed = set()
        self.info_by_id = {}
        self.calls = {}
        self.trainable_ids = {id(v) for v in model.trainable_weights}
        # {id(symbolic tensor): tensor of the same value with the shapes of
        # `from_keras(input_shapes=...)`}; shapes, dtypes and bytes are read there.
        self.concrete = {}

    def _spec(self, tensor):
        return self.concrete.get(id(tensor), tensor)

    # -- naming ----------------------------------------------------------
    def _name_for(self, obj, container):
        key = id(obj)
        k = self.call_counts.get(key, 0)
        self.call_counts[key] = k + 1
        base = self.base_names.get(key)
        if base is None:
            base = obj.name
            if base in self.taken:
                base = f"{container}/{obj.name}"
            candidate, i = base, 1
            while candidate in self.taken:
                candidate = f"{base}~{i}"
                i += 1
            base = candidate
            self.taken.add(base)
            self.base_names[key] = base
        name = base if k == 0 else f"{base}#{k}"
        while name in self.nodes:
            name += "~"
        return name

    # -- ordering --------------------------------------------------------
    @staticmethod
    def _ordered_nodes(functional):
        index = {id(op): i for i, op in enumerate(functional._operations)}
        ordered = []
        for depth in sorted(functional._nodes_by_depth, reverse=True):
            nodes = functional._nodes_by_depth[depth]
            ordered.extend(
                sorted(
                    nodes,
                    key=lambda n: (index.get(id(n.operation), 1 << 30),
                                   n.operation._inbound_nodes.index(n)),
                )
            )
        return ordered

    # -- walking ---------------------------------------------------------
    def walk(self, functional, container, seed, top=False):
        """Adds the nodes of `functional`; returns its tensor->producer map."""
        from keras.src.layers.core.input_layer import InputLayer

        produced = dict(seed or {})
        for node in self._ordered_nodes(functional):
            op = node.operation
            if isinstance(op, InputLayer) or node.is_input:
                if top:
                    name = self._add_input(op, node)
                    for t in node.outputs:
                        produced[id(t)] = name
                continue
            inner = _functional_of(op)
            if inner is not None:
                self._walk_nested(op, inner, node, produced, container)
                continue
            name = self._add_call(op, node, produced, container, nested=not top)
            for t in node.outputs:
                produced[id(t)] = name
        if top:
            ordered = [produced.get(id(t)) for t in functional.inputs]
            self.inputs = [n for n in ordered if n is not None] + [
                n for n in self.inputs if n not in ordered
            ]
            for t in functional.outputs:
                producer = produced.get(id(t))
                if producer is not None and producer not in self.outputs:
                    self.outputs.append(producer)
        return produced

    def _walk_nested(self, model, inner, node, produced, container):
        given, outer_flat, inner_inputs = _nested_call_inputs(node, inner)
        if len(outer_flat) != len(inner_inputs):
            raise GraphError(
                f"Cannot map the inputs of nested model {model.name!r} inside "
                f"{container!r}: it takes {len(inner_inputs)} input tensor(s) but was "
                f"called with {len(outer_flat)}. Call nested models with a list or dict "
                f"matching their `inputs`. Received: {given!r}"
            )
        seed = {}
        for outer_t, inner_t in zip(outer_flat, inner_inputs):
            producer = produced.get(id(outer_t))
            if producer is not None:
                seed[id(inner_t)] = producer
        outer_concrete = self.concrete  # this call's shapes inside the nested model
        self.concrete = outer_concrete.get(_nested_key(node), {}) if outer_concrete else {}
        try:
            inner_produced = self.walk(inner, container=model.name, seed=seed)
        finally:
            self.concrete = outer_concrete
        for outer_t, inner_t in zip(node.outputs, inner.outputs):
            producer = inner_produced.get(id(inner_t))
            if producer is not None:
                produced[id(outer_t)] = producer

    def _add_input(self, layer, node):
        name = self._name_for(layer, self.model.name)
        outputs = [self._spec(t) for t in node.outputs]
        self.nodes[name] = LayerNode(
            name=name,
            layer_name=layer.name,
            layer_type=type(layer).__name__,
            kind="input",
            input_shapes=[],
            output_shapes=[_per_sample(t.shape) for t in outputs],
            output_dtypes=[str(t.dtype) for t in outputs],
            forward_flops=0.0,
            backward_flops=0.0,
            variables=[],
            non_trainable_bytes=0,
            output_bytes=sum(_tensor_bytes(t) for t in outputs),
        )
        self.inputs.append(name)
        self.calls[name] = (layer, node)
        self._check_unknown(name, self.nodes[name].output_shapes)
        return name

    def _add_call(self, op, node, produced, container, nested=False):
        from keras.layers import Layer

        is_layer = isinstance(op, Layer)
        name = self._name_for(op, container)
        first_call = self.call_counts[id(op)] == 1
        symbolic_inputs = list(node.input_tensors)
        inputs = [self._spec(t) for t in symbolic_inputs]
        outputs = [self._spec(t) for t in node.outputs]
        in_shapes = [_per_sample(t.shape) for t in inputs]
        out_shapes = [_per_sample(t.shape) for t in outputs]
        call = flops_lib.CallInfo(
            inputs=[_known(s) for s in in_shapes],
            outputs=[_known(s) for s in out_shapes],
            arguments=_bound_arguments(op, node, self._spec) if is_layer else {},
        )
        cost = flops_lib.cost_of(op, call, is_op=not is_layer)
        estimated = cost.estimated
        if cost.note:
            self.estimated.setdefault(cost.note, []).append(name)
        if self._check_unknown(name, in_shapes + out_shapes):
            estimated = True

        variables, nt_bytes, nt_params = [], 0, 0
        has_trainable = False
        if is_layer:
            weights = op.weights
            has_trainable = any(id(v) in self.trainable_ids for v in weights)
            if first_call:
                for v in weights:
                    if id(v) in self.claimed:
                        continue
                    self.claimed.add(id(v))
                    info = _variable_info(v)
                    if id(v) in self.trainable_ids:
                        self.info_by_id[id(v)] = info
                        variables.append(info)
                    else:
                        nt_bytes += info.bytes
                        nt_params += info.size
        self.nodes[name] = LayerNode(
            name=name,
            layer_name=op.name,
            layer_type=type(op).__name__,
            kind="layer" if is_layer else "op",
            input_shapes=in_shapes,
            output_shapes=out_shapes,
            output_dtypes=[str(t.dtype) for t in outputs],
            forward_flops=float(cost.flops),
            backward_flops=flops_lib.backward_flops(cost, has_trainable),
            multiply_adds=float(cost.multiply_adds),
            variables=variables,
            non_trainable_bytes=nt_bytes,
            non_trainable_params=nt_params,
            output_bytes=sum(_tensor_bytes(t) for t in outputs),
            saved_bytes=int(cost.saved_elements * _element_bytes(outputs)),
            estimated=estimated,
            draws_random=is_layer and random_layer(op) is not None,
            computes_mask=is_layer and computes_mask(op),
            autocasts=is_layer and autocasts(op),
            nested=nested,
            extra_arguments=len(node.arguments.args) != 1 or any(
                v is not None for v in node.arguments.kwargs.values()),
        )
        self.calls[name] = (op, node)
        # Edges: bytes of the distinct tensors each producer feeds this call.
        seen = set()
        for t in symbolic_inputs:
            if id(t) in seen:
                continue
            seen.add(id(t))
            producer = produced.get(id(t))
            if producer is None:
                continue
            key = (producer, name)
            self.edges[key] = self.edges.get(key, 0) + _tensor_bytes(self._spec(t))
        return name

    def _check_unknown(self, name, shapes):
        if _has_unknown(shapes):
            self.unknown_dims.append(name)
            return True
        return False

    # -- finishing -------------------------------------------------------
    def finish(self, cls):
        model = self.model
        layer_nodes = [n for n in self.nodes.values() if n.kind != "input"]
        leftovers = [v for v in model.weights if id(v) not in self.claimed]
        if leftovers:
            host = layer_nodes[0] if layer_nodes else next(iter(self.nodes.values()))
            for v in leftovers:
                self.claimed.add(id(v))
                info = _variable_info(v)
                if id(v) in self.trainable_ids:
                    self.info_by_id[id(v)] = info
                    host.variables.append(info)
                else:
                    host.non_trainable_bytes += info.bytes
                    host.non_trainable_params += info.size
            self.warnings.append(
                f"{len(leftovers)} variable(s) belong to no layer call in the graph "
                f"({', '.join(v.path for v in leftovers[:4])}"
                f"{', ...' if len(leftovers) > 4 else ''}); attached to node {host.name!r}."
            )
        variables = [self.info_by_id[id(v)] for v in model.trainable_weights]
        used = {}
        for info in variables:
            used[info.name] = used.get(info.name, 0) + 1
        duplicates = sorted(p for p, c in used.items() if c > 1)
        if duplicates:
            self.warnings.append(
                f"Several trainable variables share the path(s) {duplicates[:4]}; plans key "
                "variables by path, so give the layers of nested models distinct names."
            )
        for note, names in self.estimated.items():
            shown = ", ".join(names[:5]) + (f", ... ({len(names)} in all)" if len(names) > 5 else "")
            self.warnings.append(f"{note}: {shown}.")
        if self.unknown_dims:
            names = self.unknown_dims
            shown = ", ".join(names[:5]) + (f", ... ({len(names)} in all)" if len(names) > 5 else "")
            self.warnings.append(
                "Some shapes have unknown (None) dimensions, counted as 1 in FLOPs and "
                f"bytes: {shown}. Give the model's Input a fixed shape for exact figures."
            )
        edges = [(s, d, b) for (s, d), b in self.edges.items()]
        graph = cls(
            nodes=self.nodes, edges=edges, inputs=self.inputs, outputs=self.outputs,
            variables=variables, warnings=self.warnings, name=model.name,
        )
        graph.calls = dict(self.calls)
        return graph


# ---------------------------------------------------------------------------
# Subclassed models
# ---------------------------------------------------------------------------
def _shapes_from_build_dict(shapes_dict):
    """Per-sample shapes from a layer's recorded build shapes."""
    shapes = {}
    for key, value in (shapes_dict or {}).items():
        name = key[:-6] if key.endswith("_shape") else key
        if isinstance(value, (list, tuple)) and value and all(
            d is None or isinstance(d, int) for d in value
        ):
            shapes[name] = tuple(value)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                if isinstance(item, (list, tuple)):
                    shapes[f"{name}[{i}]"] = tuple(item)
        elif isinstance(value, dict):
            for k, item in value.items():
                if isinstance(item, (list, tuple)):
                    shapes[f"{name}.{k}"] = tuple(item)
    return shapes


def _sublayer_costs(layer, totals, notes, seen):
    """Adds the cost of `layer`'s built sublayers (each counted once)."""
    if id(layer) in seen:
        return
    seen.add(id(layer))
    shapes = _shapes_from_build_dict(getattr(layer, "_build_shapes_dict", None))
    formula = flops_lib.find_formula(layer)
    sublayers = list(getattr(layer, "_layers", []) or [])
    if formula is not None and shapes:
        full = list(shapes.values())
        in_shapes = [_per_sample(s) for s in full]
        try:
            out = layer.compute_output_shape(*full) if len(full) > 1 else layer.compute_output_shape(full[0])
            out_list = [out] if out and all(d is None or isinstance(d, int) for d in out) else list(out)
            out_shapes = [_per_sample(s) for s in out_list]
        except Exception:  # noqa: BLE001 - any failure means "shape unknown"
            out_shapes = in_shapes[:1]
        call = flops_lib.CallInfo(
            inputs=[_known(s) for s in in_shapes],
            outputs=[_known(s) for s in out_shapes],
            arguments={k: _known(_per_sample(v)) for k, v in shapes.items()},
        )
        cost = flops_lib.cost_of(layer, call)
        has_trainable = bool(layer.trainable_weights)
        totals[0] += cost.flops
        totals[1] += flops_lib.backward_flops(cost, has_trainable)
        totals[2] += cost.multiply_adds
        if cost.note:
            notes.append(cost.note)
        return
    if sublayers:
        for sub in sublayers:
            _sublayer_costs(sub, totals, notes, seen)
    elif layer.weights:
        notes.append(f"sublayer {layer.name!r} ({type(layer).__name__}) has no recorded shape")


def _from_subclassed(cls, model):
    from keras import KerasTensor

    if not model.built:
        raise GraphError(
            f"The subclassed model {model.name!r} is not built, so its variables and "
            "shapes are unknown. Call it on a batch (e.g. `model(x[:1])`) or call "
            "`model.build(input_shape)` before extracting its graph. "
            f"Received: {type(model).__name__} with built=False."
        )
    warnings = [
        f"{type(model).__name__} {model.name!r} has no functional graph (a subclassed "
        "model): it is one node holding every variable, and only data-parallel plans "
        "apply to it."
    ]
    shapes = _shapes_from_build_dict(getattr(model, "_build_shapes_dict", None))
    in_full = list(shapes.values())
    out_full, out_dtypes = [], []
    if in_full:
        try:
            specs = [KerasTensor(s, dtype=model.input_dtype) for s in in_full]
            spec = model.compute_output_spec(specs[0] if len(specs) == 1 else specs)
            from keras import tree

            for t in tree.flatten(spec):
                out_full.append(tuple(t.shape))
                out_dtypes.append(str(t.dtype))
        except Exception as e:  # noqa: BLE001 - tracing user code may fail in any way
            warnings.append(
                f"Could not trace {model.name!r} symbolically to learn its output shape "
                f"({type(e).__name__}: {e}); output bytes are unknown (0)."
            )
    else:
        warnings.append(
            f"The input shape of {model.name!r} was not recorded when it was built; "
            "input and output shapes are unknown."
        )
    totals, notes = [0.0, 0.0, 0.0], []
    for sub in getattr(model, "_layers", []) or []:
        _sublayer_costs(sub, totals, notes, set())
    if notes:
        warnings.append(
            "FLOPs of the subclassed model are the sum of its built sublayers, each "
            "counted once (a sublayer called several times is under-counted); "
            + "; ".join(sorted(set(notes))[:3]) + "."
        )
    trainable_ids = {id(v) for v in model.trainable_weights}
    variables = [_variable_info(v) for v in model.trainable_weights]
    nt = [_variable_info(v) for v in model.weights if id(v) not in trainable_ids]
    in_shapes = [_per_sample(s) for s in in_full]
    out_shapes = [_per_sample(s) for s in out_full]
    output_bytes = sum(
        flops_lib.elements(s) * flops_lib.dtype_bytes(d) for s, d in zip(out_shapes, out_dtypes)
    )
    unknown = any(d is None for s in in_shapes + out_shapes for d in s)
    if unknown:
        warnings.append(
            "Some shapes have unknown (None) dimensions, counted as 1 in FLOPs and bytes."
        )
    name = model.name
    node = LayerNode(
        name=name, layer_name=name, layer_type=type(model).__name__, kind="model",
        input_shapes=in_shapes, output_shapes=out_shapes, output_dtypes=out_dtypes,
        forward_flops=totals[0], backward_flops=totals[1], multiply_adds=totals[2],
        variables=variables, non_trainable_bytes=sum(v.bytes for v in nt),
        non_trainable_params=sum(v.size for v in nt), output_bytes=output_bytes,
        estimated=True,
    )
    graph = cls(
        nodes={name: node}, edges=[], inputs=[name], outputs=[name], variables=variables,
        warnings=warnings, data_parallel_only=True, name=name,
    )
    graph.calls = {name: (model, None)}
    return graph
