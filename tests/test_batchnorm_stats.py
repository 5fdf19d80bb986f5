"""BatchNormalization's moving statistics under data parallelism (both backends).

Each replica normalises with its own batch statistics (documented), but the
moving mean and the moving variance after a step equal those of one device
that saw the whole batch: the variance includes how far the replicas' means
lie apart (`backends/batchnorm_stats.py`)."""

import keras
import numpy as np
import pytest

from autodist_keras import AutoStrategy
from autodist_keras import Cluster


def _model(momentum):
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, name="dense"),
                              keras.layers.BatchNormalization(momentum=momentum, name="bn")])
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    return model


@pytest.mark.parametrize("strategy_name, momentum", [("data_parallel", 0.0),
                                                     ("proportional", 0.9)])
def test_moving_mean_and_variance_are_those_of_the_global_batch(strategy_name, momentum):
    rng = np.random.default_rng(0)
    # Each block of rows has its own mean, so the replicas' batch means differ.
    shift = np.repeat([[0.0], [3.0], [-3.0]], 4, axis=0)
    x = (rng.normal(size=(12, 4)) + shift).astype("float32")
    y = np.zeros((12, 4), "float32")
    plain = _model(momentum)
    plain.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    strategy = AutoStrategy(strategy_name, cluster=Cluster.cpu_testbed())
    with strategy.scope():
        model = _model(momentum)
    model.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    assert len(strategy.plan.replicas) == 3
    got, want = model.get_layer("bn"), plain.get_layer("bn")
    for name in ("moving_mean", "moving_variance"):
        np.testing.assert_allclose(keras.ops.convert_to_numpy(getattr(got, name)),
                                   keras.ops.convert_to_numpy(getattr(want, name)),
                                   rtol=1e-4, atol=1e-5, err_msg=name)
    if hasattr(strategy.adapter, "close"):
        strategy.adapter.close()
