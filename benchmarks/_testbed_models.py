"""Compiled models of the testbed benchmarks, importable by worker processes."""

import keras

from autodist_keras.graph import zoo


def _compile(model):
    model.compile(optimizer="sgd",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def build_cnn():
    keras.utils.set_random_seed(0)
    return _compile(zoo.small_cnn(input_shape=(32, 32, 3), filters=(32, 64)))


def build_small_cnn():
    return build_cnn()


def build_mlp():
    keras.utils.set_random_seed(0)
    return _compile(zoo.mlp(input_dim=512, hidden=(1024, 1024), num_classes=10))
