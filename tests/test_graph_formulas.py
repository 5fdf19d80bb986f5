"""FLOP formulas per layer type, checked against hand-derived counts on real Keras layers.

Each case builds a one-layer Functional model and compares the layer node's
per-sample forward FLOPs and multiply-adds with the count written out by hand
(the conventions are in docs/graph.md). Runs under both backends.
"""

import keras
import numpy as np
import pytest

from autodist_keras.graph import ModelGraph
from autodist_keras.graph import flops as flops_lib

L = keras.layers


def _graph(layer, *shapes, dtype="float32"):
    inputs = [keras.Input(s, dtype=dtype) for s in shapes]
    outputs = layer(inputs[0] if len(inputs) == 1 else inputs)
    return ModelGraph.from_keras(keras.Model(inputs, outputs))


def _node(graph):
    (node,) = [n for n in graph.nodes.values() if n.kind != "input"]
    return node


# (id, layer factory, input shapes, expected multiply-adds, expected forward FLOPs)
CASES = [
    # Dense on a 3D input: every one of the 5 positions is a (7 -> 3) matmul; + bias + relu.
    ("dense_3d", lambda: L.Dense(3, activation="relu"), [(5, 7)], 5 * 7 * 3, 2 * 105 + 15 + 15),
    ("dense_no_bias", lambda: L.Dense(4, use_bias=False), [(6,)], 24, 48),
    # Conv1D, groups=2: out (8, 4), each output sums 3 taps x 6/2 channels; + bias.
    ("conv1d_groups", lambda: L.Conv1D(4, 3, groups=2), [(10, 6)], 8 * 4 * 3 * 3, 2 * 288 + 32),
    # Conv2D stride 2 same: out (5, 5, 8), 3x3x4 taps each.
    ("conv2d", lambda: L.Conv2D(8, 3, strides=2, padding="same"), [(9, 9, 4)],
     5 * 5 * 8 * 9 * 4, 2 * 7200 + 200),
    ("conv3d", lambda: L.Conv3D(2, 2, use_bias=False), [(4, 4, 4, 3)], 27 * 2 * 8 * 3, 2 * 1296),
    # Depthwise, multiplier 2: out (4, 4, 8), 9 taps each.
    ("depthwise", lambda: L.DepthwiseConv2D(3, depth_multiplier=2), [(6, 6, 4)],
     4 * 4 * 8 * 9, 2 * 1152 + 128),
    # Separable: depthwise (4*4*4 outputs x 9 taps) + pointwise (4*4*5 outputs x 4 inputs).
    ("separable", lambda: L.SeparableConv2D(5, 3), [(6, 6, 4)],
     4 * 4 * 4 * 9 + 4 * 4 * 5 * 4, 2 * 896 + 80),
    # Transposed: each of the 4*4*5 inputs is scattered through 2x2 taps into 3 filters.
    ("conv2d_transpose", lambda: L.Conv2DTranspose(3, 2, strides=2, use_bias=False),
     [(4, 4, 5)], 4 * 4 * 5 * 4 * 3, 2 * 960),
    ("batchnorm", lambda: L.BatchNormalization(), [(4, 4, 8)], 0, 6 * 128),
    ("layernorm", lambda: L.LayerNormalization(), [(5, 7)], 0, 6 * 35),
    ("embedding", lambda: L.Embedding(100, 8), [(5,)], 0, 0),
    ("maxpool2d", lambda: L.MaxPooling2D(2), [(4, 4, 8)], 0, 2 * 2 * 8 * 4),
    ("avgpool1d", lambda: L.AveragePooling1D(2), [(6, 4)], 0, 3 * 4 * 2),
    ("maxpool3d", lambda: L.MaxPooling3D(2), [(4, 4, 4, 2)], 0, 8 * 2 * 8),
    ("global_avg2d", lambda: L.GlobalAveragePooling2D(), [(4, 4, 8)], 0, 128 + 8),
    ("global_max1d", lambda: L.GlobalMaxPooling1D(), [(6, 4)], 0, 24 + 4),
    ("relu", lambda: L.ReLU(), [(10,)], 0, 10),
    ("relu6", lambda: L.ReLU(max_value=6.0), [(10,)], 0, 20),
    ("softmax", lambda: L.Softmax(), [(10,)], 0, 50),
    ("activation_sigmoid", lambda: L.Activation("sigmoid"), [(10,)], 0, 40),
    ("activation_linear", lambda: L.Activation("linear"), [(10,)], 0, 0),
    ("leaky_relu", lambda: L.LeakyReLU(), [(10,)], 0, 20),
    ("add3", lambda: L.Add(), [(6,), (6,), (6,)], 0, 12),
    ("subtract", lambda: L.Subtract(), [(6,), (6,)], 0, 6),
    ("multiply", lambda: L.Multiply(), [(6,), (6,)], 0, 6),
    ("average", lambda: L.Average(), [(6,), (6,)], 0, 12),
    ("concatenate", lambda: L.Concatenate(), [(6,), (2,)], 0, 0),
    ("dropout", lambda: L.Dropout(0.5), [(10,)], 0, 20),
    ("dropout_zero", lambda: L.Dropout(0.0), [(10,)], 0, 0),
    ("reshape", lambda: L.Reshape((2, 5)), [(10,)], 0, 0),
    ("flatten", lambda: L.Flatten(), [(2, 5)], 0, 0),
    ("permute", lambda: L.Permute((2, 1)), [(2, 5)], 0, 0),
    ("zero_padding2d", lambda: L.ZeroPadding2D(1), [(3, 3, 2)], 0, 0),
    ("cropping2d", lambda: L.Cropping2D(1), [(4, 4, 2)], 0, 0),
    ("rescaling", lambda: L.Rescaling(1 / 255.0, offset=-1), [(4, 4, 3)], 0, 2 * 48),
    ("normalization", lambda: L.Normalization(mean=0.5, variance=2.0), [(6,)], 0, 12),
    # SimpleRNN over 4 steps of 3 features, 5 units: (3 + 5) x 5 per step; bias + tanh per unit.
    ("simple_rnn", lambda: L.SimpleRNN(5), [(4, 3)], 4 * 8 * 5, 2 * 160 + 4 * 5 * 5),
    ("lstm", lambda: L.LSTM(5), [(4, 3)], 4 * 4 * 8 * 5, 2 * 640 + 4 * 5 * 30),
    ("gru", lambda: L.GRU(2), [(4, 6)], 4 * 3 * 8 * 2, 2 * 192 + 4 * 2 * 24),
    # Both directions of an LSTM(3) over 4 steps of 5 features, concatenated.
    ("bidirectional", lambda: L.Bidirectional(L.LSTM(3)), [(4, 5)],
     2 * 4 * 4 * 8 * 3, 2 * (2 * 384 + 4 * 3 * 30)),
    ("time_distributed", lambda: L.TimeDistributed(L.Dense(5)), [(4, 6)],
     4 * 6 * 5, 4 * (2 * 30 + 5)),
    ("conv1d_transpose", lambda: L.Conv1DTranspose(2, 3, use_bias=False), [(5, 4)],
     5 * 4 * 3 * 2, 2 * 120),
    ("upsampling_nearest", lambda: L.UpSampling2D(2), [(3, 3, 2)], 0, 0),
    ("upsampling_bilinear", lambda: L.UpSampling2D(2, interpolation="bilinear"), [(3, 3, 2)],
     0, 8 * 72),
    # Dot-product attention, query 5x8, value 7x8: scores and weighted sum, softmax + scale.
    ("attention", lambda: L.Attention(), [(5, 8), (7, 8)], 2 * 5 * 7 * 8, 2 * 560 + 6 * 35),
    ("dot", lambda: L.Dot(axes=(2, 2)), [(5, 8), (7, 8)], 5 * 7 * 8, 2 * 280),
    ("einsum_dense", lambda: L.EinsumDense("abc,cd->abd", output_shape=(5, 3), bias_axes="d"),
     [(5, 8)], 5 * 8 * 3, 2 * 120 + 15),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_layer_formula(case):
    _, factory, shapes, macs, fwd = case
    dtype = "int32" if case[0] == "embedding" else "float32"
    node = _node(_graph(factory(), *shapes, dtype=dtype))
    assert node.multiply_adds == macs
    assert node.forward_flops == fwd
    assert not node.estimated


def test_multi_head_attention_counts_projections_scores_softmax_and_output():
    heads, key_dim, t, s, dq, dv = 2, 3, 5, 6, 7, 4
    query, value = keras.Input((t, dq)), keras.Input((s, dv))
    out = L.MultiHeadAttention(heads, key_dim)(query, value)
    node = _node(ModelGraph.from_keras(keras.Model([query, value], out)))
    projections = t * dq * heads * key_dim + 2 * s * dv * heads * key_dim + t * heads * key_dim * dq
    products = 2 * heads * t * s * key_dim  # Q K^T and attention x V
    assert node.multiply_adds == projections + products
    softmax_and_scale = 6 * heads * t * s
    biases = t * heads * key_dim + 2 * s * heads * key_dim + t * dq
    assert node.forward_flops == 2 * (projections + products) + softmax_and_scale + biases
    assert node.output_shapes == [(t, dq)]
    assert node.input_shapes == [(t, dq), (s, dv)]
    # Kept for backward besides the output (float32): the query, key and value
    # projections, the H x T x S probabilities and the context.
    saved = t * heads * key_dim + 2 * s * heads * key_dim + heads * t * s + t * heads * key_dim
    assert node.saved_bytes == 4 * saved
    assert node.activation_bytes == node.output_bytes + 4 * saved


@pytest.mark.parametrize("layer, gates", [
    (lambda: L.SimpleRNN(64), 1), (lambda: L.GRU(64), 3), (lambda: L.LSTM(64), 4),
    (lambda: L.LSTM(64, return_sequences=True), 4),
], ids=["simple_rnn", "gru", "lstm", "lstm_sequences"])
def test_recurrent_layers_keep_every_step_for_backpropagation_through_time(layer, gates):
    """An LSTM returning its last state (256 bytes a sample) counted no more memory:
    backpropagation through time keeps every step's gates and states (75 KiB for 50
    steps), so plans that fitted on paper ran out of memory."""
    steps, units = 50, 64
    node = _node(_graph(layer(), (steps, 32)))
    assert node.saved_bytes == 4 * steps * units * (gates + 2)
    assert node.activation_bytes == node.output_bytes + node.saved_bytes
    both = _node(_graph(L.Bidirectional(layer()), (steps, 32)))
    assert both.saved_bytes == 2 * node.saved_bytes


def test_attention_memory_grows_with_the_square_of_the_sequence():
    """At long sequences attention's probabilities (H x T x T per sample) dwarf its
    output; they count in the activation memory the simulator and planners use."""
    from autodist_keras.devices import Cluster
    from autodist_keras.estimator import simulate
    from autodist_keras.strategies import baselines

    heads, d, t = 4, 32, 256
    tokens = keras.Input((t, d))
    out = L.MultiHeadAttention(heads, d // heads, name="mha")(tokens, tokens)
    graph = ModelGraph.from_keras(keras.Model(tokens, out))
    node = graph.nodes["mha"]
    assert node.saved_bytes > 8 * node.output_bytes  # 4 x 256 x 256 probabilities vs 256 x 32
    cluster = Cluster.from_string("1xV100")
    peaks = {}
    for batch in (8, 16):
        plan = baselines.single_device(graph, cluster, batch)
        peaks[batch] = simulate(graph, cluster, plan).peak_memory_bytes["node0/gpu0"]
    assert peaks[16] - peaks[8] >= 8 * node.activation_bytes


def test_backward_rule():
    x = keras.Input((5,), dtype="int32")
    e = L.Embedding(50, 8, name="emb")(x)
    h = L.Dense(4, name="trainable_dense")(e)
    frozen = L.Dense(4, name="frozen_dense")
    frozen.trainable = False
    h = frozen(h)
    h = L.ReLU(name="relu")(h)
    graph = ModelGraph.from_keras(keras.Model(x, h))
    nodes = graph.nodes
    assert nodes["trainable_dense"].backward_flops == 2 * nodes["trainable_dense"].forward_flops
    assert nodes["frozen_dense"].backward_flops == nodes["frozen_dense"].forward_flops
    assert nodes["relu"].backward_flops == nodes["relu"].forward_flops
    # A lookup has no forward arithmetic; its gradient scatter-adds one value per output.
    assert nodes["emb"].forward_flops == 0 and nodes["emb"].backward_flops == 5 * 8
    assert nodes["frozen_dense"].variables == []
    assert nodes["frozen_dense"].non_trainable_bytes == (4 * 4 + 4) * 4
    assert graph.backward_flops == sum(n.backward_flops for n in nodes.values())
    # A frozen table gets no gradient (and integer ids none either): no scatter-add
    # (it was counted one add per output element, as a trainable table).
    frozen_emb = L.Embedding(50, 8, name="frozen_emb")
    frozen_emb.trainable = False
    graph = ModelGraph.from_keras(keras.Model(x, L.Dense(2)(frozen_emb(x))))
    assert graph.nodes["frozen_emb"].backward_flops == 0


def test_time_distributed_repeats_the_inner_layers_memory_and_backward():
    """TimeDistributed kept only the inner layer's forward figures: a wrapped LSTM kept
    nothing for backpropagation through time (saved_bytes 0 instead of steps x the
    LSTM's), and a wrapped Embedding had no backward scatter-add."""
    words = keras.Input((5, 7, 3))  # 5 sentences of 7 words
    wrapped = _node(ModelGraph.from_keras(keras.Model(words, L.TimeDistributed(L.LSTM(4))(words))))
    single = _node(_graph(L.LSTM(4), (7, 3)))
    assert single.saved_bytes == 4 * 7 * 4 * 6
    assert wrapped.saved_bytes == 5 * single.saved_bytes
    assert wrapped.forward_flops == 5 * single.forward_flops
    ids = keras.Input((5, 7), dtype="int32")
    emb = _node(ModelGraph.from_keras(keras.Model(ids, L.TimeDistributed(L.Embedding(20, 4))(ids))))
    assert emb.forward_flops == 0 and emb.backward_flops == 5 * 7 * 4


def test_grouped_query_attention_counts_its_query_heads_and_key_value_heads():
    """Keras 3.15 names GroupedQueryAttention's settings without an underscore; the
    formula read them as one head of size 1 with no dropout or bias (scores and context
    35 + 35 multiply-adds instead of 560 + 560)."""
    t, s, heads, kv_heads, head_dim = 5, 7, 4, 2, 4
    query, value = keras.Input((t, 8)), keras.Input((s, 8))
    layer = L.GroupQueryAttention(head_dim, heads, kv_heads, dropout=0.1)
    node = _node(ModelGraph.from_keras(keras.Model([query, value], layer(query, value))))
    projections = t * 8 * heads * head_dim + 2 * s * 8 * kv_heads * head_dim \
        + t * heads * head_dim * 8
    products = 2 * heads * t * s * head_dim
    assert node.multiply_adds == projections + products
    softmax_scale_dropout = (6 + 2) * heads * t * s
    biases = t * heads * head_dim + 2 * s * kv_heads * head_dim + t * 8
    assert node.forward_flops == 2 * (projections + products) + softmax_scale_dropout + biases
    saved = 2 * t * heads * head_dim + 2 * s * kv_heads * head_dim + 2 * heads * t * s
    assert node.saved_bytes == 4 * saved


def test_multi_head_attention_over_some_axes_pairs_positions_along_them_only():
    """With `attention_axes` each query attends only along those axes; the scores were
    counted for every pair of positions (4x too many on a 4 x 5 grid attending along 5)."""
    heads, key_dim = 2, 3
    x = keras.Input((4, 5, 6))
    along = _node(ModelGraph.from_keras(keras.Model(
        x, L.MultiHeadAttention(heads, key_dim, attention_axes=(2,))(x, x))))
    projections = 4 * 20 * 6 * heads * key_dim  # query, key, value and output kernels
    pairs = 4 * 5 * 5
    assert along.multiply_adds == projections + 2 * heads * pairs * key_dim
    assert along.forward_flops == (2 * along.multiply_adds + 6 * heads * pairs
                                   + 3 * 20 * heads * key_dim + 20 * 6)
    everything = _node(ModelGraph.from_keras(keras.Model(
        x, L.MultiHeadAttention(heads, key_dim)(x, x))))
    assert everything.multiply_adds == projections + 2 * heads * 20 * 20 * key_dim
    assert everything.saved_bytes - along.saved_bytes == 4 * heads * (400 - 100)


def test_keras_ops_are_nodes_with_estimates():
    x = keras.Input((5, 7))
    y = keras.Input((6, 7))
    scores = keras.ops.matmul(x, keras.ops.transpose(y, (0, 2, 1)))
    out = keras.ops.exp(scores) + 1.0
    graph = ModelGraph.from_keras(keras.Model([x, y], out))
    ops = {n.layer_type: n for n in graph.nodes.values() if n.kind == "op"}
    assert set(ops) == {"Transpose", "Matmul", "Exp", "Add"}
    assert ops["Matmul"].multiply_adds == 5 * 6 * 7
    assert ops["Transpose"].forward_flops == 0
    assert ops["Exp"].forward_flops == 30 and ops["Add"].forward_flops == 30
    assert not any(n.estimated for n in graph.nodes.values())


def test_unknown_layer_is_estimated_and_warned_never_fatal():
    class Triple(L.Layer):
        def call(self, x):
            return x * 3

    class Scale(L.Layer):
        def build(self, shape):
            self.w = self.add_weight(shape=(shape[-1],), initializer="ones")

        def call(self, x):
            return x * self.w

    x = keras.Input((4, 6))
    h = Triple(name="triple")(x)
    h = Scale(name="scale")(h)
    h = L.Lambda(lambda t: t + 1.0, name="plus_one")(h)
    model = keras.Model(x, h)
    graph = ModelGraph.from_keras(model)
    for name in ("triple", "scale", "plus_one"):
        assert graph.nodes[name].estimated
        assert graph.nodes[name].forward_flops > 0
    text = " ".join(graph.warnings)
    assert "'Triple'" in text and "'Lambda'" in text and "'Scale'" in text
    # A layer with weights is estimated from its parameter count (6 per each of 4 positions).
    assert graph.nodes["scale"].multiply_adds == 6 * 4
    assert [v.name for v in graph.nodes["scale"].variables] == [
        v.path for v in model.trainable_weights
    ]


def test_unknown_dimensions_are_flagged():
    x = keras.Input((None, 8))
    y = L.Dense(4)(x)
    graph = ModelGraph.from_keras(keras.Model(x, y))
    node = _node(graph)
    assert node.input_shapes == [(None, 8)]
    assert node.estimated
    assert any("unknown" in w for w in graph.warnings)


def test_activation_bytes_follow_dtype():
    x = keras.Input((10,), dtype="int32")
    e = L.Embedding(20, 4, dtype="float16")(x)
    graph = ModelGraph.from_keras(keras.Model(x, e))
    inp, emb = graph.nodes.values()
    assert inp.output_bytes == 10 * 4
    assert emb.output_dtypes == ["float16"] and emb.output_bytes == 10 * 4 * 2


def test_dtype_bytes_table():
    assert flops_lib.dtype_bytes("float32") == 4
    assert flops_lib.dtype_bytes("bfloat16") == 2
    assert flops_lib.dtype_bytes("int8") == 1
    assert flops_lib.dtype_bytes(np.dtype("float64")) == 8
