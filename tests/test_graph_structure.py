"""ModelGraph structure: shared layers, nested models, multi-I/O, subclassed models,
errors, fingerprints, JSON and display, on real Keras models (both backends)."""

import json
import os
import subprocess
import sys

import keras
import networkx
import pytest

from autodist_keras.errors import GraphError
from autodist_keras.graph import LayerNode
from autodist_keras.graph import ModelGraph
from autodist_keras.graph import TensorInfo

L = keras.layers
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _siamese():
    """Two inputs, a shared Dense, a nested Functional model called twice, a nested
    Sequential, a keras.ops call, two outputs."""
    a = keras.Input((8,), name="a")
    b = keras.Input((8,), name="b")
    shared = L.Dense(4, name="shared")
    inner_in = keras.Input((4,))
    inner = keras.Model(inner_in, L.Dense(2, name="inner_dense")(inner_in), name="inner")
    seq = keras.Sequential(
        [keras.Input((4,)), L.Dense(3, name="seq_dense"), L.ReLU(name="seq_relu")], name="seq"
    )
    ha, hb = shared(a), shared(b)
    oa, ob = inner(ha), inner(hb)
    s = seq(ha)
    c = keras.ops.concatenate([oa, ob], axis=-1) * 2.0
    out = L.Dense(1, name="head")(L.Concatenate(name="cat")([c, s]))
    return keras.Model([a, b], [out, oa], name="siamese")


@pytest.fixture(scope="module")
def siamese():
    model = _siamese()
    return model, ModelGraph.from_keras(model)


def test_shared_and_nested_calls_are_flattened(siamese):
    model, graph = siamese
    # keras.ops calls get names Keras numbers per process ("concatenate_3"): compare types.
    named = [n.name if n.kind != "op" else n.layer_type for n in graph.nodes.values()]
    assert named == [
        "a", "b", "shared", "shared#1", "inner_dense", "inner_dense#1", "Concatenate",
        "Multiply", "seq_dense", "seq_relu", "cat", "head",
    ]
    kinds = [n.kind for n in graph.nodes.values()]
    assert kinds == ["input"] * 2 + ["layer"] * 4 + ["op"] * 2 + ["layer"] * 4
    assert not any(n.layer_type in ("Functional", "Sequential") for n in graph.nodes.values())
    # The first call owns the shared variables; later calls own none but still cost FLOPs.
    assert [v.name for v in graph.nodes["shared"].variables] == ["shared/kernel", "shared/bias"]
    assert graph.nodes["shared#1"].variables == []
    assert graph.nodes["shared#1"].forward_flops == graph.nodes["shared"].forward_flops
    assert graph.nodes["shared#1"].backward_flops == graph.nodes["shared"].backward_flops
    assert graph.nodes["shared#1"].layer_name == "shared"
    assert graph.inputs == ["a", "b"]
    assert graph.outputs == ["head", "inner_dense"]


def test_calls_map_nodes_back_to_keras_objects(siamese):
    model, graph = siamese
    assert set(graph.calls) == set(graph.nodes)
    layer, first = graph.calls["shared"]
    _, second = graph.calls["shared#1"]
    assert layer is model.get_layer("shared")
    assert layer._inbound_nodes.index(first) == 0 and layer._inbound_nodes.index(second) == 1
    assert graph.calls["a"][0] is model.get_layer("a")
    assert ModelGraph.from_dict(graph.to_dict()).calls == {}


def test_variables_and_params_match_keras(siamese):
    model, graph = siamese
    assert [v.name for v in graph.variables] == [v.path for v in model.trainable_weights]
    assert graph.params == model.count_params()
    assert graph.param_bytes == 4 * sum(int(v.numpy().size) for v in model.trainable_weights)
    owned = [v.name for n in graph.nodes.values() for v in n.variables]
    assert sorted(owned) == sorted(v.name for v in graph.variables)
    assert graph.variable_owner["head/kernel"] == "head"


def test_edges_carry_bytes_and_respect_topological_order(siamese):
    _, graph = siamese
    edges = {(s, d): b for s, d, b in graph.edges}
    assert edges[("a", "shared")] == 8 * 4
    assert edges[("shared", "inner_dense")] == 4 * 4
    assert edges[("shared", "seq_dense")] == 4 * 4  # into the nested Sequential
    concat, multiply = [n.name for n in graph.nodes.values() if n.kind == "op"]
    assert edges[("inner_dense#1", concat)] == 2 * 4
    assert edges[(multiply, "cat")] == 4 * 4 and edges[("seq_relu", "cat")] == 3 * 4
    index = {name: i for i, name in enumerate(graph.nodes)}
    assert all(index[s] < index[d] for s, d, _ in graph.edges)
    g = graph.nx
    assert networkx.is_directed_acyclic_graph(g)
    assert set(g.nodes) == set(graph.nodes)
    assert g.edges["cat", "head"]["bytes"] == 7 * 4
    assert isinstance(g.nodes["head"]["node"], LayerNode)
    assert g.nodes["head"]["forward_flops"] == graph.nodes["head"].forward_flops


def test_layer_sharing_inside_one_model_counts_every_call():
    x = keras.Input((6,))
    block = L.Dense(6, name="block")
    h = x
    for _ in range(3):
        h = block(h)
    graph = ModelGraph.from_keras(keras.Model(x, h))
    assert list(graph.nodes)[1:] == ["block", "block#1", "block#2"]
    assert graph.forward_flops == 3 * (2 * 36 + 6)
    assert graph.params == 42 and len(graph.variables) == 2


def test_sequential_built_without_input_layer():
    model = keras.Sequential([L.Dense(5, name="d0"), L.Dense(2, name="d1")])
    with pytest.raises(GraphError, match="not built"):
        ModelGraph.from_keras(model)
    model.build((None, 3))
    graph = ModelGraph.from_keras(model)
    assert [n.kind for n in graph.nodes.values()] == ["input", "layer", "layer"]
    assert graph.nodes["d0"].input_shapes == [(3,)]
    assert graph.params == model.count_params() == 3 * 5 + 5 + 5 * 2 + 2


class _Subclassed(keras.Model):
    def __init__(self):
        super().__init__(name="subclassed")
        self.conv = L.Conv2D(4, 3)
        self.bn = L.BatchNormalization()
        self.dense = L.Dense(3)

    def call(self, x):
        return self.dense(keras.ops.mean(self.bn(self.conv(x)), axis=(1, 2)))


def test_subclassed_model_is_one_data_parallel_node():
    model = _Subclassed()
    with pytest.raises(GraphError, match="not built.*Received"):
        ModelGraph.from_keras(model)
    model(keras.ops.ones((2, 8, 8, 3)))
    graph = ModelGraph.from_keras(model)
    assert graph.data_parallel_only
    assert list(graph.nodes) == ["subclassed"] and graph.nodes["subclassed"].kind == "model"
    assert graph.calls["subclassed"][0] is model
    assert any("data-parallel" in w for w in graph.warnings)
    assert [v.name for v in graph.variables] == [v.path for v in model.trainable_weights]
    assert graph.params == model.count_params()
    node = graph.nodes["subclassed"]
    assert node.input_shapes == [(8, 8, 3)] and node.output_shapes == [(3,)]
    # Built sublayers are costed: conv (6*6*4 outputs x 27 taps) + dense (4 -> 3).
    assert node.multiply_adds == 6 * 6 * 4 * 27 + 4 * 3
    assert node.non_trainable_bytes == 2 * 4 * 4  # BN moving mean and variance
    assert node.estimated


def test_not_a_model_is_rejected():
    with pytest.raises(GraphError, match="Received: .*Dense"):
        ModelGraph.from_keras(L.Dense(3))


def test_to_dict_is_json_and_round_trips(siamese):
    _, graph = siamese
    data = json.loads(json.dumps(graph.to_dict()))
    for key in ("nodes", "edges", "forward_flops", "params", "param_bytes", "warnings"):
        assert key in data
    assert data["params"] == graph.params and data["forward_flops"] == graph.forward_flops
    again = ModelGraph.from_dict(data)
    assert again.to_dict() == graph.to_dict()
    assert again.fingerprint() == graph.fingerprint()
    assert isinstance(again.variables[0], TensorInfo)
    assert again.variables[0] is again.nodes["shared"].variables[0]
    with pytest.raises(GraphError, match="schema version"):
        ModelGraph.from_dict({"nodes": []})


def test_summary_lists_nodes_and_totals(siamese):
    _, graph = siamese
    text = graph.summary()
    for name in graph.nodes:
        assert name in text
    assert f"Params: {graph.params:,}" in text
    short = graph.summary(max_rows=3)
    assert "(9 more)" in short


def _anonymous_mlp(units=32):
    inputs = keras.Input((16,))
    x = L.Dense(units, activation="relu")(inputs)
    x = L.BatchNormalization()(x)
    return keras.Model(inputs, L.Dense(4)(x))


def test_fingerprint_ignores_generated_names_but_not_structure():
    first = ModelGraph.from_keras(_anonymous_mlp())
    second = ModelGraph.from_keras(_anonymous_mlp())
    assert list(first.nodes) != list(second.nodes)  # Keras numbered the layers anew
    assert first.fingerprint() == second.fingerprint()
    assert ModelGraph.from_keras(_anonymous_mlp(units=33)).fingerprint() != first.fingerprint()


def test_fingerprint_stable_across_processes_via_cli():
    for _ in range(3):  # shift this process's automatic layer numbering
        _anonymous_mlp()
    graph = ModelGraph.from_keras(_anonymous_mlp())
    # A fresh process numbers layers from scratch; `autodist-keras graph --json` loads the
    # same builder through a module:function spec and prints to_dict() plus the fingerprint.
    out = subprocess.run(
        [sys.executable, "-m", "autodist_keras.cli", "graph", "--json",
         "--model", "test_graph_structure:_anonymous_mlp"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads(out.stdout[out.stdout.index("{"):])
    assert data["fingerprint"] == graph.fingerprint()
    assert list(graph.nodes) != [n["name"] for n in data["nodes"]]
    assert data["params"] == graph.params and data["forward_flops"] == graph.forward_flops


def test_inputs_follow_model_order_and_keyword_calls_bind():
    query = keras.Input((5, 8), name="query_in")
    value = keras.Input((7, 8), name="value_in")
    out = L.MultiHeadAttention(2, 4, name="mha")(query=query, value=value, key=value)
    model = keras.Model([query, value], out)
    graph = ModelGraph.from_keras(model)
    assert graph.inputs == ["query_in", "value_in"]
    node = graph.nodes["mha"]
    # Projections: Q 5x8x8, K and V 7x8x8, output 5x8x8; scores and context 2 x (2*5*7*4).
    assert node.multiply_adds == 5 * 64 + 2 * 7 * 64 + 5 * 64 + 2 * 2 * 5 * 7 * 4
    assert node.output_shapes == [(5, 8)]


def test_mixed_precision_activations_are_half_size():
    keras.config.set_dtype_policy("mixed_float16")
    try:
        x = keras.Input((6, 8))
        model = keras.Model(x, L.Dense(4, name="half")(x))
    finally:
        keras.config.set_dtype_policy("float32")
    graph = ModelGraph.from_keras(model)
    node = graph.nodes["half"]
    assert node.output_dtypes == ["float16"] and node.output_bytes == 6 * 4 * 2
    assert node.variables[0].dtype == "float32" and node.variables[0].bytes == 8 * 4 * 4


def test_frozen_nested_model_with_dict_inputs():
    p, r = keras.Input((3,), name="p"), keras.Input((3,), name="r")
    added = L.Add(name="inner_add")([L.Dense(2, name="dp")(p), L.Dense(2, name="dr")(r)])
    inner = keras.Model({"p": p, "r": r}, added, name="inner")
    inner.trainable = False
    a, b = keras.Input((3,), name="A"), keras.Input((3,), name="B")
    model = keras.Model([a, b], L.Dense(1, name="top")(inner({"p": a, "r": b})))
    graph = ModelGraph.from_keras(model)
    assert list(graph.nodes) == ["A", "B", "dp", "dr", "inner_add", "top"]
    edges = {(s, d) for s, d, _ in graph.edges}
    assert ("A", "dp") in edges and ("B", "dr") in edges
    assert [v.name for v in graph.variables] == ["top/kernel", "top/bias"]
    assert graph.nodes["dp"].non_trainable_params == 3 * 2 + 2
    assert graph.nodes["dp"].backward_flops == graph.nodes["dp"].forward_flops  # frozen: 1x
    assert graph.params == model.count_params()


def _text_model(length, dict_input=False):
    """Embedding, LSTM, a nested model, self-attention, pooling: every shape after the
    input follows the sequence length."""
    tokens = keras.Input((length,), dtype="int32", name="tokens")
    h = L.Embedding(1000, 16)(tokens)
    h = L.LSTM(32, return_sequences=True)(h)
    inner_in = keras.Input((length, 32))
    inner = keras.Model(inner_in, L.Dense(16)(inner_in), name="inner")
    h = inner(h)
    h = L.MultiHeadAttention(2, 8)(h, h)
    outputs = L.Dense(5)(L.GlobalAveragePooling1D()(h))
    return keras.Model({"tokens": tokens} if dict_input else tokens, outputs)


@pytest.mark.parametrize("dict_input", [False, True], ids=["array", "dict"])
def test_input_shapes_fill_an_unknown_sequence_length(dict_input):
    """A model on keras.Input((None,)) counted its sequence length as 1 (FLOPs 200x
    too low for 200 tokens, and the plans chosen on them); with the first batch's
    shapes every layer, the nested model's and attention's included, has the shapes
    and costs of the same model built for that length."""
    unknown = ModelGraph.from_keras(_text_model(None, dict_input))
    fixed = ModelGraph.from_keras(_text_model(200, dict_input))
    filled = ModelGraph.from_keras(_text_model(None, dict_input), input_shapes=[(200,)])
    assert len(unknown.unknown_dims) >= 5 and fixed.unknown_dims == []
    assert filled.unknown_dims == [] and not any("unknown (None)" in w for w in filled.warnings)
    assert filled.fingerprint() == fixed.fingerprint()
    assert filled.forward_flops == fixed.forward_flops > 150 * unknown.forward_flops
    assert filled.activation_bytes == fixed.activation_bytes
    # Shapes that do not fit the inputs leave the graph as the model gives it, and say so.
    for wrong in ([(200, 3)], [(200,), (4,)], [("x",)]):
        kept = ModelGraph.from_keras(_text_model(None, dict_input), input_shapes=wrong)
        assert kept.fingerprint() == unknown.fingerprint()
        assert any(w.startswith("input_shapes do not") and w.endswith(f"Received: "
                   f"input_shapes={wrong!r}") for w in kept.warnings), kept.warnings
    # A dimension the model fixes is kept; only the unknown ones are filled.
    again = ModelGraph.from_keras(_text_model(200, dict_input), input_shapes=[(None,)])
    assert again.fingerprint() == fixed.fingerprint()


def test_input_shapes_reach_each_call_of_a_shared_nested_model():
    """A siamese text model: one encoder model called on a 20-token query and a
    500-token document. Each call gets its own lengths (the second call's shapes
    were given to both)."""
    query = keras.Input((None,), dtype="int32", name="query")
    doc = keras.Input((None,), dtype="int32", name="doc")
    tokens = keras.Input((None,), dtype="int32")
    encoder = keras.Model(tokens, L.LSTM(8)(L.Embedding(50, 4)(tokens)), name="encoder")
    model = keras.Model([query, doc], L.Dot(axes=1)([encoder(query), encoder(doc)]))
    graph = ModelGraph.from_keras(model, input_shapes=[(20,), (500,)])
    lstm = [n for n in graph.nodes.values() if n.layer_type == "LSTM"]
    assert [n.input_shapes for n in lstm] == [[(20, 4)], [(500, 4)]]
    assert lstm[1].forward_flops == pytest.approx(25 * lstm[0].forward_flops)
    assert graph.unknown_dims == []


def _open_length_encoder(length):
    """An encoder model on an open length (keras.Input((None, 8))) called on known ones."""
    inner_in = keras.Input((None, 8))
    h = L.LSTM(16, return_sequences=True)(L.Conv1D(8, 3, padding="same")(inner_in))
    encoder = keras.Model(inner_in, h, name="encoder")
    query, doc = keras.Input((length, 8)), keras.Input((2 * length, 8))
    return keras.Model([query, doc], L.Dot(axes=(2, 2))([encoder(query), encoder(doc)]))


def test_nested_model_on_an_open_length_takes_its_callers_shapes():
    """An encoder built on keras.Input((None, 8)) and called on 40 and 80 steps counted
    its layers at length 1 (60x too few of their FLOPs; the model's 5.2x too few), with a
    warning to fix shapes the outer model already fixes; each call now has the shapes it
    is called on."""
    graph = ModelGraph.from_keras(_open_length_encoder(40))
    lstm = [n for n in graph.nodes.values() if n.layer_type == "LSTM"]
    assert [n.input_shapes for n in lstm] == [[(40, 8)], [(80, 8)]]
    assert lstm[1].forward_flops == 2 * lstm[0].forward_flops
    assert graph.unknown_dims == [] and not any("unknown" in w for w in graph.warnings)
    edges = {(s, d): b for s, d, b in graph.edges}
    conv_in = [n.name for n in graph.nodes.values() if n.layer_type == "Conv1D"]
    assert edges[(graph.inputs[1], conv_in[1])] == 80 * 8 * 4
    # The same counts as the unnested layers at those lengths.
    query, doc = keras.Input((40, 8)), keras.Input((80, 8))
    conv, rnn = L.Conv1D(8, 3, padding="same"), L.LSTM(16, return_sequences=True)
    flat = keras.Model([query, doc], L.Dot(axes=(2, 2))([rnn(conv(query)), rnn(conv(doc))]))
    flat = ModelGraph.from_keras(flat)
    assert graph.forward_flops == flat.forward_flops
    assert graph.activation_bytes == flat.activation_bytes
