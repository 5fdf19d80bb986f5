"""The plan is made for the first training batch: when later batches are larger,
the user is told (on the active Keras backend), and `plan_for` avoids it."""

import warnings

import keras
import numpy as np
import pytest

from autodist_keras import AutoStrategy
from autodist_keras import Cluster


def _model():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((16,), name="fb_in")
    hidden = keras.layers.Dense(32, activation="relu", name="fb_hidden")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(3, name="fb_out")(hidden))
    model.compile(optimizer="sgd",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


class _Growing(keras.utils.PyDataset):
    """A first batch of `first` rows, then batches of 24 (a generator warming up)."""

    def __init__(self, first):
        super().__init__()
        rng = np.random.default_rng(0)
        self.batches = [(rng.normal(size=(n, 16)).astype("float32"),
                         rng.integers(0, 3, size=(n,)).astype("int32"))
                        for n in [first, 24, 24, 24]]

    def __len__(self):
        return len(self.batches)

    def __getitem__(self, i):
        return self.batches[i]


def test_batches_larger_than_the_first_are_reported_once():
    cluster = Cluster.cpu_testbed()
    strategy = AutoStrategy("proportional", cluster=cluster)
    with strategy.scope():
        model = _model()
    with pytest.warns(UserWarning, match=r"has 24 rows, more than the first training batch "
                                         r"\(3 rows\).*strategy.plan_for\(model, 24\)") as record:
        model.fit(_Growing(3), epochs=2, shuffle=False, verbose=0)
    assert len([w for w in record if "more than the first training batch" in str(w.message)]) == 1
    assert strategy.plan.global_batch_size == 3 and strategy.plan.shares_for(24) == [8, 8, 8]

    # Planned for the larger batches first: their own shares, and no warning.
    strategy = AutoStrategy("proportional", cluster=cluster)
    with strategy.scope():
        model = _model()
    assert strategy.plan_for(model, 24).shares_for(24) == [12, 6, 6]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*first training batch")
        model.fit(_Growing(3), epochs=1, shuffle=False, verbose=0)
    assert strategy.plan.global_batch_size == 24


def test_a_first_batch_smaller_than_the_devices_says_the_fit_runs_on_fewer():
    """auto facing a 2-row first batch plans for fewer devices for the whole fit."""
    cluster = Cluster.cpu_testbed()
    strategy = AutoStrategy("auto", cluster=cluster)
    with strategy.scope():
        model = _model()
    with pytest.warns(UserWarning, match=r"first training batch, 2 row\(s\), fewer than the 3 "
                                         r"devices, so it runs on [12] device\(s\)") as record:
        model.fit(_Growing(2), epochs=1, shuffle=False, verbose=0)
    # The warning names the user's fit line (it named a line of the TensorFlow adapter,
    # or of Keras's trainer, many frames below).
    ours = [w for w in record if "first training batch" in str(w.message)]
    assert ours and all(w.filename == __file__ for w in ours), [w.filename for w in ours]


def _rows(n):
    rng = np.random.default_rng(1)
    return (rng.normal(size=(n, 16)).astype("float32"),
            rng.integers(0, 3, size=(n,)).astype("int32"))


def test_a_one_device_plan_reports_larger_batches_of_later_fits():
    """One replica runs Keras's own train function; later fits still check their batches."""
    strategy = AutoStrategy("auto", cluster=Cluster.cpu_testbed(), devices=["node0/cpu0"])
    with strategy.scope():
        model = _model()
    x, y = _rows(96)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*first training batch")
        model.fit(x, y, batch_size=12, epochs=1, shuffle=False, verbose=0)
    assert len(strategy.plan.devices) == 1 and strategy.plan.global_batch_size == 12
    with pytest.warns(UserWarning, match=r"has 48 rows, more than the first training batch "
                                         r"\(12 rows\)") as record:
        model.fit(x, y, batch_size=48, epochs=2, shuffle=False, verbose=0)
    assert len([w for w in record if "more than the first training batch" in str(w.message)]) == 1


def test_a_forced_single_device_plan_does_not_warn():
    strategy = AutoStrategy("single_device", cluster=Cluster.cpu_testbed())
    with strategy.scope():
        model = _model()
    x, y = _rows(48)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*first training batch")
        model.fit(x, y, batch_size=6, epochs=1, shuffle=False, verbose=0)
        model.fit(x, y, batch_size=24, epochs=1, shuffle=False, verbose=0)


class _ShortLast(keras.utils.PyDataset):
    """Three batches of 24 rows and a last one of 1; records the batches read."""

    def __init__(self):
        super().__init__()
        self.x, self.y = _rows(73)
        self.read = []

    def __len__(self):
        return 4

    def __getitem__(self, i):
        self.read.append(i)
        return self.x[i * 24:(i + 1) * 24], self.y[i * 24:(i + 1) * 24]


def test_a_short_batch_that_shuffling_puts_first_does_not_make_the_plan():
    """fit's default shuffle=True reorders a PyDataset's batches, so the 1-row last
    batch may come first: the plan is made for the full batches (it was made for
    1 row, and a proportional plan on 3 devices refused it with a StrategyError;
    "auto" ran such fits on one device), and the fit equals plain Keras's."""
    cluster = Cluster.cpu_testbed()
    for seed in range(1, 13):  # until Keras's shuffle hands over the short batch first (1 does)
        strategy = AutoStrategy("proportional", cluster=cluster)
        with strategy.scope():
            model = _model()
        data = _ShortLast()
        keras.utils.set_random_seed(seed)
        model.fit(data, epochs=1, verbose=0)
        if data.read[-4] == 3:
            break
    assert data.read[-4] == 3, data.read
    assert strategy.plan.global_batch_size == 24 and strategy.plan.shares_for(24) == [12, 6, 6]
    reference, expected = _model(), _ShortLast()
    keras.utils.set_random_seed(seed)
    reference.fit(expected, epochs=1, verbose=0)
    assert expected.read[-4:] == data.read[-4:]  # the same order as plain Keras
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
