"""A one-device plan under TensorFlow runs Keras's own train function.

For a single-device plan on the process's default device, AutoStrategy's fit
must cost nothing over plain Keras: after the first step (which makes the
plan) the adapter hands the loop Keras's own `train_function`. Real Keras
models and real training; weights must equal plain Keras fit's.
"""

import keras
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow",
    reason="TensorFlow runtime tests run under KERAS_BACKEND=tensorflow",
)


def _model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    x = keras.layers.Dense(16, activation="relu")(inputs)
    x = keras.layers.BatchNormalization()(x)
    outputs = keras.layers.Dense(3)(x)
    return keras.Model(inputs, outputs)


def _compile(model):
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def test_single_device_plan_uses_keras_train_function_and_matches_plain_keras():
    from autodist_keras import AutoStrategy
    from autodist_keras import Cluster

    rng = np.random.default_rng(0)
    x = rng.normal(size=(160, 8)).astype("float32")
    y = rng.integers(0, 3, size=(160,)).astype("int32")

    plain = _compile(_model())
    h_plain = plain.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)

    strategy = AutoStrategy("single_device", cluster=Cluster.detect())
    with strategy.scope():
        model = _compile(_model())
    runtime = model._autodist_runtime
    h_auto = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)

    assert runtime.keras_step_suffices()
    fn = model.train_function
    # Keras's own function (TensorFlowTrainer._make_function), not the adapter's.
    assert fn.__qualname__.startswith("TensorFlowTrainer."), fn.__qualname__
    for a, b in zip(plain.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(h_plain.history[key], h_auto.history[key], rtol=1e-5)
    # A second fit keeps Keras's function (the plan is the same).
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert model.train_function is fn


def test_multi_device_plan_keeps_the_adapter_step():
    from autodist_keras import AutoStrategy
    from autodist_keras import Cluster

    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = rng.integers(0, 3, size=(64,)).astype("int32")
    strategy = AutoStrategy("data_parallel", cluster=Cluster.cpu_testbed())
    with strategy.scope():
        model = _compile(_model())
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert not model._autodist_runtime.keras_step_suffices()
    assert model.train_function.__qualname__.endswith("make_function.<locals>.function")
