"""The built-in zoo: deterministic, configurable, and with the costs its shapes imply."""

import keras
import numpy as np
import pytest

from autodist_keras.graph import ModelGraph
from autodist_keras.graph import zoo


def _weights(model):
    return [np.asarray(keras.ops.convert_to_numpy(v.value)) for v in model.weights]


def test_builders_are_deterministic_under_set_random_seed():
    keras.utils.set_random_seed(7)
    first = _weights(zoo.small_cnn())
    keras.utils.set_random_seed(7)
    second = _weights(zoo.small_cnn())
    keras.utils.set_random_seed(8)
    third = _weights(zoo.small_cnn())
    assert all(np.array_equal(a, b) for a, b in zip(first, second))
    assert not all(np.array_equal(a, c) for a, c in zip(first, third))


def test_transformer_encoder_trains_one_step():
    keras.utils.set_random_seed(0)
    model = zoo.transformer_encoder()
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    x = np.random.randint(0, 1000, (8, 32)).astype("int32")
    loss = model.train_on_batch(x, np.random.randint(0, 2, (8,)))
    assert np.isfinite(float(np.asarray(loss).reshape(-1)[0]))
    types = {type(layer).__name__ for layer in zoo.small_cnn().layers}
    assert "BatchNormalization" in types


def _encoder_macs(layers, d, t, ff, vocab, classes):
    attention = 4 * t * d * d + 2 * t * t * d  # Q, K, V, output projections + QK^T, AV
    feed_forward = 2 * t * d * ff
    return layers * (attention + feed_forward) + d * classes


def _encoder_params(layers, d, t, ff, vocab, classes):
    block = (4 * d * d + 4 * d) + (d * ff + ff) + (ff * d + d) + 2 * (2 * d)
    return vocab * d + t * d + layers * block + d * classes + classes


def test_transformer_encoder_costs_follow_its_shape():
    cfg = dict(num_layers=3, d_model=32, heads=4, seq_len=16, vocab=100)
    model = zoo.transformer_encoder(**cfg, num_classes=5)
    graph = ModelGraph.from_keras(model)
    assert graph.multiply_adds == _encoder_macs(3, 32, 16, 128, 100, 5)
    assert graph.params == model.count_params() == _encoder_params(3, 32, 16, 128, 100, 5)
    assert not graph.warnings
    assert [n.layer_type for n in graph.nodes.values()].count("MultiHeadAttention") == 3


@pytest.mark.slow
def test_bert_large_shape():
    model = zoo.bert_large()
    graph = ModelGraph.from_keras(model)
    attention = [n for n in graph.nodes.values() if n.layer_type == "MultiHeadAttention"]
    assert len(attention) == 24
    assert graph.nodes["bert_large_block0_attention"].variables[0].shape == (1024, 16, 64)
    assert graph.params == model.count_params() == _encoder_params(24, 1024, 512, 4096, 30522, 2)
    assert graph.multiply_adds == _encoder_macs(24, 1024, 512, 4096, 30522, 2)
