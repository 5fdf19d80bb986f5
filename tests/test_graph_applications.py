"""keras.applications models against published multiply-add counts (both backends).

Each test builds one model (weights=None, default input size) once and checks
the multiply-adds, the parameter count, the variable names and the DAG.
"""

import keras
import networkx
import pytest

from autodist_keras.graph import ModelGraph
from autodist_keras.graph import load_model
from autodist_keras.graph.published import PUBLISHED_MULTIPLY_ADDS
from autodist_keras.graph.published import TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PUBLISHED_MULTIPLY_ADDS))
def test_application_matches_published_figures(name):
    reference = PUBLISHED_MULTIPLY_ADDS[name]
    model = load_model(name)
    assert tuple(model.input_shape[1:]) == reference["input"]
    graph = ModelGraph.from_keras(model)

    deviation = graph.multiply_adds / reference["value"] - 1.0
    assert abs(deviation) <= TOLERANCE, (
        f"{name}: {graph.multiply_adds / 1e9:.3f} G multiply-adds vs published "
        f"{reference['value'] / 1e9:.3f} G ({deviation:+.1%})"
    )
    # Elementwise work (BN, activations, pooling, adds) comes on top of 2 x multiply-adds.
    assert 2 * graph.multiply_adds < graph.forward_flops < 2.5 * graph.multiply_adds

    assert graph.params == model.count_params()
    assert [v.name for v in graph.variables] == [v.path for v in model.trainable_weights]
    assert graph.trainable_params == sum(
        int(keras.ops.size(v)) for v in model.trainable_weights
    )

    # One node per layer call: these models call every layer once.
    assert sorted(n.layer_name for n in graph.nodes.values()) == sorted(
        op.name for op in model._operations
    )
    assert not graph.warnings
    assert not any(n.estimated for n in graph.nodes.values())
    assert networkx.is_directed_acyclic_graph(graph.nx)
    assert networkx.is_weakly_connected(graph.nx)
    assert graph.inputs == [list(graph.nodes)[0]] and len(graph.outputs) == 1
    assert graph.nodes[graph.outputs[0]].output_shapes == [(1000,)]
    index = {n: i for i, n in enumerate(graph.nodes)}
    assert all(index[s] < index[d] for s, d, _ in graph.edges)
