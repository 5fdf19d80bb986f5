"""Replicas draw their own random numbers: Dropout masks differ between replicas."""

import numpy as np
import keras
import pytest

from autodist_keras import AutoStrategy
from autodist_keras import Cluster
from autodist_keras.backends import replica_random


def _dropout_model(seed):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((64,))
    dropped = keras.layers.Dropout(0.5, seed=seed)(inputs)
    outputs = keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")(dropped)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
    return model


def _seed_states(model):
    return [keras.ops.convert_to_numpy(v.value).tolist()
            for v in replica_random.seed_state_variables(model)]


@pytest.mark.parametrize("seed", [None, 7])
def test_replicas_apply_their_own_dropout_masks(seed):
    # Three replicas of 4 rows; replica k's rows are 5**k everywhere, the
    # kernel starts at zero and the targets are 3. After one SGD step (lr 1)
    # kernel_j = sum_k 5**k * c_kj, with c_kj in 0..4 the number of replica
    # k's rows whose mask kept feature j: base-5 digits that give each
    # replica's mask counts. Copies of one mask make them equal everywhere.
    x = np.repeat(np.array([1.0, 5.0, 25.0], "float32"), 4)[:, None] * np.ones((1, 64), "float32")
    y = np.full((12, 1), 3.0, "float32")
    plain = _dropout_model(seed)
    plain.fit(x, y, batch_size=12, epochs=1, shuffle=False, verbose=0)

    strategy = AutoStrategy("data_parallel", cluster=Cluster.cpu_testbed())
    with strategy.scope():
        model = _dropout_model(seed)
    model.fit(x, y, batch_size=12, epochs=1, shuffle=False, verbose=0)
    assert [r.batch_share for r in strategy.plan.replicas] == [4, 4, 4]

    for name, trained in (("plain", plain), ("distributed", model)):
        total = np.rint(keras.ops.convert_to_numpy(trained.weights[0]).ravel()).astype(int)
        counts = [total % 5, total // 5 % 5, total // 25]
        assert total.min() >= 0 and counts[2].max() <= 4, name
        for a, b in ((0, 1), (0, 2), (1, 2)):
            assert (counts[a] != counts[b]).any(), f"{name}: replicas {a} and {b}, one mask"
    # The seed generators go on as on one device (replica 0 draws what Keras would).
    assert _seed_states(model) == _seed_states(plain)


def test_replica_seeds_are_distinct_and_wrap_into_the_seed_dtype():
    for dtype, bits in (("int32", 32), ("int64", 64)):
        offsets = [replica_random.seed_offset(r, dtype) for r in range(64)]
        assert offsets[0] == 0 and len(set(offsets)) == 64
        assert all(-(1 << (bits - 1)) <= o < (1 << (bits - 1)) for o in offsets)
    assert replica_random.wrap_seed(2**31, "int32") == -(2**31)
    seeds = {replica_random.torch_rank_seed(12345, r) for r in range(1, 65)}
    assert len(seeds) == 64 and all(0 <= s < 2**63 for s in seeds)
    assert replica_random.torch_rank_seed(12345, 1) != replica_random.torch_rank_seed(12346, 1)
