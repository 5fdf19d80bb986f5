"""Per-layer FLOP and byte formulas.

Every formula returns the cost of one layer call for ONE sample (no batch
dimension), as a `Cost`:

- `multiply_adds`: multiply-accumulate operations of the layer's matrix
  products (Dense, convolutions, attention products, recurrent kernels). This
  is the figure papers report as "FLOPs" or "Mult-Adds".
- `flops`: forward FLOPs, counting 2 per multiply-add plus every elementwise
  operation (bias adds, activations, normalisation, pooling), by the
  conventions listed in `docs/graph.md`.

Formulas are looked up by the layer's class name, walking its MRO, so a
subclass of `Conv2D` costs like a `Conv2D`. Layers and ops without a formula
get a fallback estimate with `estimated=True`. Register a formula for your own
layer with `register_formula`.

Example:

```python
from autodist_keras.graph import flops

@flops.register_formula("MyGatedDense")
def _my_gated_dense(layer, call):
    n = flops.elements(call.outputs[0])
    macs = 2 * n * call.inputs[0][-1]
    return flops.Cost(multiply_adds=macs, flops=2 * macs + 2 * n)
```

This module imports neither Keras nor a framework; it reads layers through
their public attributes.
"""

import dataclasses
import math

# Bytes per element of the dtypes Keras uses (numpy names).
DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "int4": 1,
    "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1,
    "bool": 1, "complex64": 8, "complex128": 16, "string": 8,
}

# FLOPs per element of Keras activation functions (a convention; see docs/graph.md).
ACTIVATION_FLOPS = {
    "linear": 0, "relu": 1, "relu6": 2, "leaky_relu": 2, "elu": 3, "selu": 4,
    "celu": 4, "gelu": 8, "sigmoid": 4, "hard_sigmoid": 3, "tanh": 4,
    "softmax": 5, "log_softmax": 5, "swish": 5, "silu": 5, "hard_swish": 4,
    "hard_silu": 4, "mish": 7, "softplus": 3, "softsign": 3, "exponential": 1,
    "glu": 5, "sparse_plus": 3, "squareplus": 4, "tanh_shrink": 5,
    "hard_tanh": 2, "soft_shrink": 2, "hard_shrink": 2, "threshold": 1,
    "sparsemax": 8,
}

BATCH_NORM_FLOPS = 6  # per element: sum + sum of squares, then (x - mean) * inv_std * gamma + beta
LAYER_NORM_FLOPS = 6
RMS_NORM_FLOPS = 4
SOFTMAX_FLOPS = 5  # per element: max, subtract, exp, sum, divide
DROPOUT_FLOPS = 2  # per element: compare against a uniform draw, multiply by the scaled mask
UNKNOWN_FLOPS_PER_OUTPUT = 1  # fallback for layers and ops without a formula


@dataclasses.dataclass
class Cost:
    """The forward cost of one layer call for one sample.

    Args:
        multiply_adds: Multiply-accumulates of matrix products.
        flops: Forward FLOPs (2 per multiply-add plus elementwise work).
        estimated: True when no formula applies and this is a fallback.
        backward_flops: Backward FLOPs when the layer departs from the
            general rule (see `backward_flops`); None to use the rule.
        note: Why the figure is an estimate, for `graph.warnings`.
        saved_elements: Elements per sample the layer keeps for its backward
            pass besides its outputs (attention's projections and
            probabilities); they count in activation memory.
        frozen_backward_flops: Backward FLOPs of a call of the layer without
            trainable weights (frozen) when that departs from the rule; None
            to use the rule. An `Embedding`'s backward is only the
            scatter-add into its table, so a frozen one costs 0.
    """

    multiply_adds: float = 0.0
    flops: float = 0.0
    estimated: bool = False
    backward_flops: float = None
    note: str = None
    saved_elements: float = 0.0
    frozen_backward_flops: float = None


@dataclasses.dataclass
class CallInfo:
    """What a formula knows about one layer call.

    Args:
        inputs: Per-sample shapes of the call's input tensors (unknown
            dimensions replaced by 1), in call-argument order.
        outputs: Per-sample shapes of the call's outputs.
        arguments: Dict from call-argument name to a per-sample shape (or to
            a non-tensor value), when the call signature could be bound.
    """

    inputs: list
    outputs: list
    arguments: dict = dataclasses.field(default_factory=dict)

    def argument(self, name, position=None):
        """Per-sample shape of the call argument `name`, else of input `position`."""
        value = self.arguments.get(name)
        if isinstance(value, tuple):
            return value
        if position is not None and position < len(self.inputs):
            return self.inputs[position]
        return None


_FORMULAS = {}


def register_formula(*class_names):
    """Decorator registering a cost formula for layer or op classes, by class name.

    The formula is called as `formula(layer, call)` with a `CallInfo` and
    returns a `Cost`. Subclasses of a registered class use its formula unless
    they have their own.

    Args:
        *class_names: Class names (e.g. `"Conv2D"`) or classes.

    Returns:
        The decorator.
    """

    def decorator(fn):
        for name in class_names:
            _FORMULAS[name if isinstance(name, str) else name.__name__] = fn
        return fn

    return decorator


def find_formula(obj):
    """Returns the formula for `obj`'s class (walking its MRO), or None."""
    # Layer formulas are keyed by class name; `keras.ops` classes share names with
    # layers ("Add", "Softmax"), so op formulas are keyed "ops.<Name>" instead.
    for cls in type(obj).__mro__:
        fn = _FORMULAS.get(cls.__name__)
        if fn is not None:
            return fn
    return None


def find_op_formula(op):
    """Returns the formula of a non-layer Keras operation, or None."""
    return _FORMULAS.get("ops." + type(op).__name__)


def elements(shape):
    """Number of elements of a per-sample shape (None counts as 1)."""
    return math.prod(1 if d is None else int(d) for d in shape)


def dtype_bytes(dtype):
    """Bytes per element of a dtype name (e.g. `"float32"` -> 4)."""
    name = str(dtype)
    if name in DTYPE_BYTES:
        return DTYPE_BYTES[name]
    name = name.rsplit(".", 1)[-1].replace("'>", "").replace("<dtype: '", "")
    if name in DTYPE_BYTES:
        return DTYPE_BYTES[name]
    digits = "".join(c for c in name if c.isdigit())
    return max(1, int(digits) // 8) if digits else 4


def activation_flops(activation):
    """FLOPs per element of a Keras activation (a function, a name, or None)."""
    if activation is None:
        return 0
    name = activation if isinstance(activation, str) else getattr(activation, "__name__", "")
    name = name.lower()
    if name in ACTIVATION_FLOPS:
        return ACTIVATION_FLOPS[name]
    return UNKNOWN_FLOPS_PER_OUTPUT


def backward_flops(cost, has_trainable_weights):
    """Backward FLOPs of a layer call, from its forward cost.

    The rule: a layer with trainable weights computes the gradient with
    respect to its input and with respect to its weights, each costing about
    as much as the forward pass, so backward = 2 x forward. A layer without
    trainable weights computes only the input gradient: backward = 1 x
    forward. A formula can override the rule (Embedding does): with
    `cost.backward_flops` for a call of a layer with trainable weights, with
    `cost.frozen_backward_flops` for one without.

    Args:
        cost: The forward `Cost`.
        has_trainable_weights: Whether the layer has trainable weights.

    Returns:
        Backward FLOPs per sample.

    Example:

    ```python
    backward_flops(Cost(flops=10.0), True)                   # 20.0
    backward_flops(Cost(flops=10.0), False)                  # 10.0
    lookup = Cost(flops=0.0, backward_flops=40.0, frozen_backward_flops=0.0)
    backward_flops(lookup, True), backward_flops(lookup, False)   # (40.0, 0.0)
    ```
    """
    if not has_trainable_weights and cost.frozen_backward_flops is not None:
        return float(cost.frozen_backward_flops)
    if cost.backward_flops is not None:
        return float(cost.backward_flops)
    return float(cost.flops) * (2.0 if has_trainable_weights else 1.0)


def fallback(call, what):
    """Estimate for a layer or op without a formula: output elements x a constant."""
    n = sum(elements(s) for s in call.outputs)
    return Cost(
        flops=float(UNKNOWN_FLOPS_PER_OUTPUT * n),
        estimated=True,
        note=f"{what} has no FLOP formula; estimated as {UNKNOWN_FLOPS_PER_OUTPUT} FLOP "
        "per output element",
    )


def params_estimate(num_params, call, what):
    """Estimate for an opaque layer with weights: 2 FLOPs per parameter per position."""
    positions = 1
    if call.inputs and len(call.inputs[0]) > 1:
        positions = elements(call.inputs[0][:-1])
    n = sum(elements(s) for s in call.outputs)
    macs = float(num_params) * positions
    return Cost(
        multiply_adds=macs,
        flops=2.0 * macs + n,
        estimated=True,
        note=f"{what} has no FLOP formula; estimated as one multiply-add per parameter "
        "per input position",
    )


# --------------------------------------------------------------------- helpers
def _out(call):
    return call.outputs[0] if call.outputs else ()


def _in(call, i=0):
    return call.inputs[i] if len(call.inputs) > i else ()


def _channels_last(layer):
    return getattr(layer, "data_format", "channels_last") != "channels_first"


def _split_channels(shape, layer):
    """(spatial dims, channels) of a per-sample feature map."""
    if not shape:
        return (), 1
    if _channels_last(layer):
        return tuple(shape[:-1]), shape[-1]
    return tuple(shape[1:]), shape[0]


def _elementwise(per_element):
    def formula(layer, call):
        return Cost(flops=float(per_element * elements(_out(call))))

    return formula


def _zero(layer, call):
    return Cost()


# ------------------------------------------------------------------ core layers
@register_formula("InputLayer")
def _input_layer(layer, call):
    return Cost()


@register_formula("Dense")
def _dense(layer, call):
    out = _out(call)
    n = elements(out)
    macs = float(n * _in(call)[-1]) if _in(call) else 0.0
    flops = 2 * macs
    if getattr(layer, "use_bias", False):
        flops += n
    flops += n * activation_flops(getattr(layer, "activation", None))
    return Cost(multiply_adds=macs, flops=flops)


def _einsum_macs(equation, shapes):
    """Multiply-adds of an einsum: the product of the sizes of all distinct indices."""
    lhs, _, rhs = equation.replace(" ", "").partition("->")
    operands = lhs.split(",")
    sizes = {}
    for letters, shape in zip(operands + [rhs], shapes):
        if "..." in letters:
            continue
        for letter, dim in zip(letters, shape):
            if dim is not None:
                sizes[letter] = max(sizes.get(letter, 1), int(dim))
    return float(math.prod(sizes.values())) if sizes else 0.0


@register_formula("EinsumDense")
def _einsum_dense(layer, call):
    out = _out(call)
    inp = (1,) + tuple(_in(call))
    kernel = tuple(getattr(getattr(layer, "kernel", None), "shape", ()) or ())
    equation = getattr(layer, "equation", "")
    try:
        macs = _einsum_macs(equation, [inp, kernel, (1,) + tuple(out)])
    except (ValueError, TypeError):
        macs = float(elements(out) * max(1, elements(kernel) // max(1, out[-1] if out else 1)))
    n = elements(out)
    flops = 2 * macs
    if getattr(layer, "bias", None) is not None:
        flops += n
    flops += n * activation_flops(getattr(layer, "activation", None))
    return Cost(multiply_adds=macs, flops=flops)


@register_formula("Embedding")
def _embedding(layer, call):
    # A lookup does no arithmetic; backward scatter-adds one value per output element
    # into the table. A frozen table gets no gradient and integer ids none either.
    n = elements(_out(call))
    return Cost(flops=0.0, backward_flops=float(n), frozen_backward_flops=0.0)


@register_formula("Identity", "Flatten", "Reshape", "Permute", "RepeatVector",
                  "Cropping1D", "Cropping2D", "Cropping3D", "ZeroPadding1D",
                  "ZeroPadding2D", "ZeroPadding3D", "Concatenate", "ActivityRegularization")
def _layout_only(layer, call):
    return Cost()


@register_formula("LayerScale")
def _layer_scale(layer, call):
    # keras.applications ConvNeXt: x * gamma.
    return Cost(flops=float(elements(_out(call))))


@register_formula("CustomScaleLayer")
def _custom_scale(layer, call):
    # keras.applications InceptionResNetV2: inputs[0] + inputs[1] * scale.
    return Cost(flops=2.0 * elements(_out(call)))


@register_formula("StochasticDepth")
def _stochastic_depth(layer, call):
    # keras.applications ConvNeXt drop-path: a per-sample mask times the input.
    return Cost(flops=float(DROPOUT_FLOPS * elements(_out(call))))


@register_formula("Masking")
def _masking(layer, call):
    return Cost(flops=2.0 * elements(_out(call)))


# ------------------------------------------------------------------ convolution
def _kernel_size(layer):
    return math.prod(int(k) for k in getattr(layer, "kernel_size", (1,)))


def _bias_and_activation(layer, n):
    flops = n if getattr(layer, "use_bias", False) else 0
    return flops + n * activation_flops(getattr(layer, "activation", None))


@register_formula("BaseConv", "Conv1D", "Conv2D", "Conv3D")
def _conv(layer, call):
    out = _out(call)
    _, in_channels = _split_channels(_in(call), layer)
    groups = int(getattr(layer, "groups", 1) or 1)
    n = elements(out)
    macs = float(n * _kernel_size(layer) * (in_channels // groups))
    return Cost(multiply_adds=macs, flops=2 * macs + _bias_and_activation(layer, n))


@register_formula("BaseDepthwiseConv", "DepthwiseConv1D", "DepthwiseConv2D")
def _depthwise_conv(layer, call):
    n = elements(_out(call))
    macs = float(n * _kernel_size(layer))
    return Cost(multiply_adds=macs, flops=2 * macs + _bias_and_activation(layer, n))


@register_formula("BaseSeparableConv", "SeparableConv1D", "SeparableConv2D")
def _separable_conv(layer, call):
    out = _out(call)
    spatial, _ = _split_channels(out, layer)
    _, in_channels = _split_channels(_in(call), layer)
    mid = elements(spatial) * in_channels * int(getattr(layer, "depth_multiplier", 1))
    depthwise = mid * _kernel_size(layer)
    pointwise = elements(out) * in_channels * int(getattr(layer, "depth_multiplier", 1))
    macs = float(depthwise + pointwise)
    n = elements(out)
    return Cost(multiply_adds=macs, flops=2 * macs + _bias_and_activation(layer, n))


@register_formula("BaseConvTranspose", "Conv1DTranspose", "Conv2DTranspose", "Conv3DTranspose")
def _conv_transpose(layer, call):
    # Every input element is scattered through the kernel into every output channel.
    groups = int(getattr(layer, "groups", 1) or 1)
    filters = int(getattr(layer, "filters", 1))
    macs = float(elements(_in(call)) * _kernel_size(layer) * filters // groups)
    n = elements(_out(call))
    return Cost(multiply_adds=macs, flops=2 * macs + _bias_and_activation(layer, n))


# ---------------------------------------------------------------- normalisation
@register_formula("BatchNormalization")
def _batch_norm(layer, call):
    return Cost(flops=float(BATCH_NORM_FLOPS * elements(_out(call))))


@register_formula("LayerNormalization", "GroupNormalization")
def _layer_norm(layer, call):
    return Cost(flops=float(LAYER_NORM_FLOPS * elements(_out(call))))


@register_formula("RMSNormalization")
def _rms_norm(layer, call):
    return Cost(flops=float(RMS_NORM_FLOPS * elements(_out(call))))


@register_formula("UnitNormalization")
def _unit_norm(layer, call):
    return Cost(flops=3.0 * elements(_out(call)))


@register_formula("Rescaling", "Normalization")
def _affine_per_element(layer, call):
    return Cost(flops=2.0 * elements(_out(call)))


# ---------------------------------------------------------------------- pooling
@register_formula("BasePooling", "MaxPooling1D", "MaxPooling2D", "MaxPooling3D",
                  "AveragePooling1D", "AveragePooling2D", "AveragePooling3D")
def _pooling(layer, call):
    window = math.prod(int(p) for p in getattr(layer, "pool_size", (1,)))
    return Cost(flops=float(elements(_out(call)) * window))


@register_formula("BaseGlobalPooling", "GlobalAveragePooling1D", "GlobalAveragePooling2D",
                  "GlobalAveragePooling3D", "GlobalMaxPooling1D", "GlobalMaxPooling2D",
                  "GlobalMaxPooling3D", "BaseAdaptivePooling")
def _global_pooling(layer, call):
    return Cost(flops=float(elements(_in(call)) + elements(_out(call))))


@register_formula("UpSampling1D", "UpSampling3D")
def _upsampling_nearest(layer, call):
    return Cost()


@register_formula("UpSampling2D")
def _upsampling2d(layer, call):
    if getattr(layer, "interpolation", "nearest") == "nearest":
        return Cost()
    # Bilinear: 4 multiplies and 3 adds per output element, plus index arithmetic.
    if getattr(layer, "interpolation", "") == "bilinear":
        return Cost(flops=8.0 * elements(_out(call)))
    return Cost(flops=8.0 * elements(_out(call)), estimated=True,
                note="UpSampling2D interpolation other than nearest/bilinear is estimated "
                "as bilinear")


# ------------------------------------------------------------------ activations
@register_formula("Activation")
def _activation(layer, call):
    return Cost(flops=float(elements(_out(call)) * activation_flops(getattr(layer, "activation", None))))


@register_formula("ReLU")
def _relu(layer, call):
    per = 1
    if getattr(layer, "max_value", None) is not None:
        per += 1
    if getattr(layer, "negative_slope", 0.0):
        per += 1
    if getattr(layer, "threshold", 0.0):
        per += 1
    return Cost(flops=float(per * elements(_out(call))))


register_formula("LeakyReLU", "PReLU")(_elementwise(2))
register_formula("ELU")(_elementwise(3))
register_formula("Softmax")(_elementwise(SOFTMAX_FLOPS))


# ---------------------------------------------------------------------- merging
@register_formula("Add", "Subtract", "Multiply", "Maximum", "Minimum")
def _merge(layer, call):
    return Cost(flops=float(max(1, len(call.inputs) - 1) * elements(_out(call))))


@register_formula("Average")
def _average(layer, call):
    return Cost(flops=float(len(call.inputs) * elements(_out(call))))


@register_formula("Dot")
def _dot(layer, call):
    axes = getattr(layer, "axes", -1)
    axis = axes[0] if isinstance(axes, (list, tuple)) else axes
    a = _in(call)
    k = a[axis - 1 if axis > 0 else axis] if a else 1
    n = elements(_out(call))
    macs = float(n * k)
    flops = 2 * macs
    if getattr(layer, "normalize", False):
        flops += 3 * (elements(a) + elements(_in(call, 1)))
    return Cost(multiply_adds=macs, flops=flops)


# ---------------------------------------------------------------- regularisation
@register_formula("Dropout", "SpatialDropout1D", "SpatialDropout2D", "SpatialDropout3D",
                  "GaussianDropout", "GaussianNoise")
def _dropout(layer, call):
    rate = getattr(layer, "rate", None)
    if rate is None:
        rate = getattr(layer, "stddev", 1.0)
    if not rate:
        return Cost()
    return Cost(flops=float(DROPOUT_FLOPS * elements(_out(call))))


@register_formula("AlphaDropout")
def _alpha_dropout(layer, call):
    if not getattr(layer, "rate", 0.0):
        return Cost()
    return Cost(flops=4.0 * elements(_out(call)))


# -------------------------------------------------------------------- attention
def _first_attribute(layer, *names):
    """The first of the attributes `names` that `layer` has and is not None, else None."""
    for name in names:
        value = getattr(layer, name, None)
        if value is not None:
            return value
    return None


def _dense_sublayer_macs(sublayer, positions):
    kernel = getattr(sublayer, "kernel", None)
    if sublayer is None or kernel is None:
        return 0.0
    return float(positions * math.prod(int(d) for d in kernel.shape))


@register_formula("MultiHeadAttention", "GroupedQueryAttention")
def _multi_head_attention(layer, call):
    query = call.argument("query", 0) or ()
    value = call.argument("value", 1) or query
    key = call.argument("key", 2) if "key" in call.arguments else None
    key = key or value
    t = elements(query[:-1]) if query else 1
    s = elements(value[:-1]) if value else 1
    query_heads = _first_attribute(layer, "num_query_heads", "_num_query_heads")
    if query_heads is not None:
        # GroupedQueryAttention (Keras 3.15 names its settings without an underscore;
        # they were read as one head of size 1): the query heads attend, the key and
        # value projections have the key-value heads.
        heads = int(query_heads)
        key_dim = value_dim = int(_first_attribute(layer, "head_dim", "_head_dim"))
        kv_heads = int(_first_attribute(layer, "num_key_value_heads", "_num_key_value_heads")
                       or heads)
    else:
        heads = int(getattr(layer, "_num_heads", 1))
        key_dim = int(getattr(layer, "_key_dim", 1))
        value_dim = int(getattr(layer, "_value_dim", None) or key_dim)
        kv_heads = heads
    dropout = _first_attribute(layer, "_dropout", "dropout") or 0.0
    use_bias = bool(_first_attribute(layer, "_use_bias", "use_bias"))
    projections = (
        _dense_sublayer_macs(getattr(layer, "_query_dense", None), t)
        + _dense_sublayer_macs(getattr(layer, "_key_dense", None), elements(key[:-1]) if key else s)
        + _dense_sublayer_macs(getattr(layer, "_value_dense", None), s)
        + _dense_sublayer_macs(getattr(layer, "_gate_dense", None), t)
        + _dense_sublayer_macs(getattr(layer, "_output_dense", None), t)
    )
    # Query-key pairs: every query position with every key position, or, with
    # `attention_axes` (axial attention over some of the axes), only the positions
    # that share the other axes' indices.
    pairs = t * s
    axes = getattr(layer, "_attention_axes", None)
    positions = tuple(query[:-1]) if query else ()
    kv_positions = tuple(value[:-1]) if value else ()
    if axes and positions and len(kv_positions) == len(positions):
        rank = len(positions) + 2  # batch, positions, features
        attended = {(a if a >= 0 else rank + a) - 1 for a in axes}
        if attended and all(0 <= a < len(positions) for a in attended):
            others = math.prod(d for i, d in enumerate(positions) if i not in attended)
            pairs = (others * math.prod(positions[i] for i in attended)
                     * math.prod(kv_positions[i] for i in attended))
    scores = float(heads * pairs * key_dim)
    context = float(heads * pairs * value_dim)
    macs = projections + scores + context
    flops = 2 * macs + SOFTMAX_FLOPS * heads * pairs + heads * pairs  # softmax + scaling
    if dropout:
        flops += DROPOUT_FLOPS * heads * pairs
    if use_bias:
        # Bias adds of the query, key, value and output projections.
        flops += t * heads * key_dim + s * kv_heads * (key_dim + value_dim) + elements(_out(call))
    # Kept for backward: the scaled query, key and value projections, the
    # attention probabilities (and their dropout output) and the context
    # before the output projection; at long sequences the H x T x S
    # probabilities dwarf the layer's output.
    probabilities = heads * pairs * (2 if dropout else 1)
    saved = t * heads * key_dim + s * kv_heads * (key_dim + value_dim) + probabilities \
        + t * heads * value_dim
    return Cost(multiply_adds=macs, flops=flops, saved_elements=float(saved))


@register_formula("Attention")
def _attention(layer, call):
    query = call.argument("inputs", 0) or ()
    value = _in(call, 1) or query
    t = elements(query[:-1]) if query else 1
    s = elements(value[:-1]) if value else 1
    d = query[-1] if query else 1
    dv = value[-1] if value else 1
    macs = float(t * s * d + t * s * dv)
    return Cost(multiply_adds=macs, flops=2 * macs + (SOFTMAX_FLOPS + 1) * t * s,
                saved_elements=float(t * s))  # the attention probabilities


@register_formula("AdditiveAttention")
def _additive_attention(layer, call):
    query = _in(call) or ()
    value = _in(call, 1) or query
    t = elements(query[:-1]) if query else 1
    s = elements(value[:-1]) if value else 1
    d = query[-1] if query else 1
    macs = float(t * s * d + t * s * (value[-1] if value else 1))
    # Broadcast add and tanh (5 FLOPs) per (t, s, d), then the weighted reduction.
    return Cost(multiply_adds=macs, flops=2 * macs + 5 * t * s * d + SOFTMAX_FLOPS * t * s)


# ------------------------------------------------------------------- recurrent
_GATES = {"SimpleRNN": 1, "SimpleRNNCell": 1, "LSTM": 4, "LSTMCell": 4, "GRU": 3, "GRUCell": 3}
_GATE_ELEMENTWISE = {1: 5, 4: 30, 3: 24}  # activations and gate products per unit and step


@register_formula("SimpleRNN", "LSTM", "GRU")
def _rnn(layer, call):
    inp = _in(call)
    steps = inp[0] if len(inp) >= 2 else 1
    features = inp[-1] if inp else 1
    units = int(getattr(layer, "units", 1))
    gates = 1
    for cls in type(layer).__mro__:
        if cls.__name__ in _GATES:
            gates = _GATES[cls.__name__]
            break
    macs = float(steps * gates * (features + units) * units)
    flops = 2 * macs + steps * units * _GATE_ELEMENTWISE[gates]
    # Backpropagation through time keeps every step's gate activations and
    # states (an LSTM's 4 gates, cell and hidden state: 6 x units a step),
    # whatever the layer returns: for LSTM(64) over 50 steps, 75 KiB a sample
    # against its 256-byte last output.
    saved = steps * units * (gates + 2)
    return Cost(multiply_adds=macs, flops=flops, saved_elements=float(saved))


@register_formula("Bidirectional")
def _bidirectional(layer, call):
    total = Cost()
    for sub in (getattr(layer, "forward_layer", None), getattr(layer, "backward_layer", None)):
        if sub is None:
            continue
        cost = cost_of(sub, CallInfo(inputs=call.inputs[:1], outputs=call.outputs))
        total.multiply_adds += cost.multiply_adds
        total.flops += cost.flops
        total.saved_elements += cost.saved_elements
        total.estimated = total.estimated or cost.estimated
        total.note = total.note or cost.note
    if getattr(layer, "merge_mode", None) in ("sum", "mul", "ave"):
        total.flops += elements(_out(call))
    return total


@register_formula("TimeDistributed")
def _time_distributed(layer, call):
    inp = _in(call)
    steps = inp[0] if inp else 1
    inner = CallInfo(
        inputs=[tuple(s[1:]) for s in call.inputs],
        outputs=[tuple(s[1:]) for s in call.outputs],
    )
    cost = cost_of(layer.layer, inner)

    def times_steps(value):
        return None if value is None else value * steps

    # Everything the inner layer costs per step, its backward overrides and what it
    # keeps for backward (a wrapped LSTM's every step) included, happens `steps` times.
    return Cost(multiply_adds=cost.multiply_adds * steps, flops=cost.flops * steps,
                estimated=cost.estimated, note=cost.note,
                backward_flops=times_steps(cost.backward_flops),
                frozen_backward_flops=times_steps(cost.frozen_backward_flops),
                saved_elements=cost.saved_elements * steps)


# ------------------------------------------------------- keras.ops operations
_OP_ZERO = (
    "Reshape", "Transpose", "ExpandDims", "Squeeze", "Concatenate", "Stack", "Split",
    "Take", "TakeAlongAxis", "Slice", "GetItem", "Cast", "BroadcastTo", "Tile", "Repeat",
    "Flip", "Roll", "Pad", "Copy", "Swapaxes", "Moveaxis", "Ravel", "ConvertToTensor",
    "StopGradient", "ZerosLike", "OnesLike", "Shape", "Hstack", "Vstack", "Append",
    "Unstack", "Flatten", "Identity", "Array", "Tril", "Triu", "SliceUpdate", "ScatterUpdate",
)
_OP_ONE_PER_ELEMENT = (
    "Add", "Subtract", "Multiply", "Divide", "TrueDivide", "FloorDivide", "Maximum",
    "Minimum", "Mod", "Equal", "NotEqual", "Greater", "GreaterEqual", "Less", "LessEqual",
    "LogicalAnd", "LogicalOr", "LogicalXor", "LogicalNot", "Where", "DivideNoNan",
    "Negative", "Abs", "Absolute", "Sign", "Floor", "Ceil", "Round", "Square", "Sqrt",
    "Rsqrt", "Reciprocal", "Exp", "Log", "Log1p", "Expm1", "Relu",
)
_OP_UNARY_COST = {
    "Power": 4, "Relu6": 2, "Sigmoid": 4, "Tanh": 4, "Softmax": 5, "LogSoftmax": 5,
    "Gelu": 8, "Silu": 5, "Swish": 5, "Softplus": 3, "Erf": 4, "Sin": 4, "Cos": 4,
    "Clip": 2, "LeakyRelu": 2, "Elu": 3, "Selu": 4, "HardSigmoid": 3, "HardSilu": 4,
    "Mish": 7, "Softsign": 3, "Exp2": 1, "Log2": 1, "Log10": 1,
}
_OP_REDUCE = {
    "Sum": 1, "Mean": 1, "Max": 1, "Min": 1, "Prod": 1, "Any": 1, "All": 1, "Argmax": 1,
    "Argmin": 1, "Std": 3, "Var": 3, "Logsumexp": 3, "Norm": 2, "Cumsum": 1, "Cumprod": 1,
}

for _name in _OP_ZERO:
    _FORMULAS["ops." + _name] = _zero
for _name in _OP_ONE_PER_ELEMENT:
    _FORMULAS["ops." + _name] = _elementwise(1)
for _name, _per in _OP_UNARY_COST.items():
    _FORMULAS["ops." + _name] = _elementwise(_per)


def _reduction(per):
    def formula(op, call):
        return Cost(flops=float(per * sum(elements(s) for s in call.inputs[:1])))

    return formula


for _name, _per in _OP_REDUCE.items():
    _FORMULAS["ops." + _name] = _reduction(_per)


def _op_matmul(op, call):
    a = _in(call)
    k = a[-1] if a else 1
    macs = float(elements(_out(call)) * k)
    return Cost(multiply_adds=macs, flops=2 * macs)


def _op_einsum(op, call):
    shapes = [(1,) + tuple(s) for s in call.inputs] + [(1,) + tuple(_out(call))]
    macs = _einsum_macs(getattr(op, "subscripts", ""), shapes)
    return Cost(multiply_adds=macs, flops=2 * macs)


_FORMULAS["ops.Matmul"] = _op_matmul
_FORMULAS["ops.Einsum"] = _op_einsum


# ----------------------------------------------------------------- dispatch
def cost_of(layer, call, is_op=False):
    """The forward `Cost` of one call of `layer` (a Keras layer or operation).

    Args:
        layer: The Keras layer or `keras.ops` operation.
        call: The `CallInfo` of the call.
        is_op: True for a non-layer Keras operation.

    Returns:
        A `Cost`. Never raises for an unknown type: it returns a fallback
        estimate with `estimated=True`.
    """
    name = type(layer).__name__
    formula = find_op_formula(layer) if is_op else find_formula(layer)
    if formula is None:
        if is_op:
            return fallback(call, f"Operation {name!r}")
        weights = getattr(layer, "weights", None) or []
        num = sum(math.prod(int(d) for d in w.shape) for w in weights)
        if num:
            return params_estimate(num, call, f"Layer type {name!r}")
        return fallback(call, f"Layer type {name!r}")
    try:
        cost = formula(layer, call)
    except (AttributeError, IndexError, TypeError, ValueError, ZeroDivisionError) as e:
        cost = fallback(call, f"{name} ({type(e).__name__} in its formula: {e})")
    return cost
