"""Masked outputs under data-parallel plans, on the active Keras backend.

The metrics and per-output losses of an output that carries a Keras mask
(Embedding(mask_zero=True) feeding per-timestep layers) must read the mask,
as single-device Keras does. Both runtimes joined the replicas' predictions
without their masks, so accuracy counted the padding.

Every row here has the same padding, so each replica's masked-mean loss splits
exactly by share (the documented limitation of masked losses does not apply)
and every figure can be compared with single-device Keras.
"""

import keras
import numpy as np
import pytest

from autodist_keras import AutoStrategy
from autodist_keras import Cluster


def _build(two_outputs):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((None,), dtype="int32", name="tokens")
    hidden = keras.layers.Embedding(20, 6, mask_zero=True, name="embed")(inputs)
    hidden = keras.layers.Dense(8, activation="relu", name="hidden")(hidden)
    first = keras.layers.Dense(3, name="first")(hidden)
    outputs = {"a": first, "b": keras.layers.Dense(3, name="second")(hidden)} if two_outputs \
        else first
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.05),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics={"a": ["accuracy"], "b": ["accuracy"]} if two_outputs
                  else ["accuracy"])
    return model


def _batches(two_outputs):
    rng = np.random.default_rng(0)
    batches = []
    for rows, length in [(12, 6), (12, 9), (12, 4)]:
        x = rng.integers(1, 20, size=(rows, length)).astype("int32")
        x[:, length // 2:] = 0  # the same padding in every row
        y = rng.integers(0, 3, size=(rows, length)).astype("int32")
        if two_outputs:
            y = {"a": y, "b": rng.integers(0, 3, size=(rows, length)).astype("int32")}
        batches.append((x, y))

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return len(batches)

        def __getitem__(self, i):
            return batches[i]

    return Batches()


@pytest.mark.filterwarnings("ignore:Output\\(s\\).*carry a Keras mask")
@pytest.mark.parametrize("two_outputs", [False, True], ids=["one_output", "two_outputs"])
def test_metrics_of_masked_outputs_read_the_mask(two_outputs):
    cluster = Cluster.cpu_testbed()
    strategy = AutoStrategy("proportional", cluster=cluster, devices=cluster.names[:3])
    with strategy.scope():
        model = _build(two_outputs)
    history = model.fit(_batches(two_outputs), epochs=2, shuffle=False, verbose=0)
    evaluated = model.evaluate(_batches(two_outputs), verbose=0, return_dict=True)
    assert [r.batch_share for r in strategy.plan.replicas] == [6, 3, 3]

    reference = _build(two_outputs)
    expected = reference.fit(_batches(two_outputs), epochs=2, shuffle=False, verbose=0)
    expected_eval = reference.evaluate(_batches(two_outputs), verbose=0, return_dict=True)
    assert sorted(history.history) == sorted(expected.history)
    for key, values in expected.history.items():
        np.testing.assert_allclose(history.history[key], values, rtol=1e-5, err_msg=key)
    for key, value in expected_eval.items():
        np.testing.assert_allclose(evaluated[key], value, rtol=1e-5, err_msg=key)
