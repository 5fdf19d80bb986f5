"""The PyTorch runtime cannot run placement plans, and says so at plan time.

It runs one process per device, each with a whole model replica, so FastT
placements and HeteroG hybrid plans (several layer groups) are refused with
an error that names the way out (the TensorFlow backend, or a data-parallel
strategy), and `strategy="auto"` never picks such a plan under torch. No
worker process is started in these tests: the refusal comes first.
"""

import keras
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "torch", reason="PyTorch runtime tests run under KERAS_BACKEND=torch"
)

BATCH = 24


def _mlp():
    inputs = keras.Input((8,), name="tp_in")
    x = keras.layers.Dense(32, activation="relu", name="tp_d0")(inputs)
    x = keras.layers.Dense(32, activation="relu", name="tp_d1")(x)
    outputs = keras.layers.Dense(3, name="tp_out")(x)
    return keras.Model(inputs, outputs, name="tp_mlp")


def _data():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(2 * BATCH, 8)).astype("float32"),
            rng.integers(0, 3, size=(2 * BATCH,)).astype("int32"))


def _build(strategy):
    with strategy.scope():
        model = _mlp()
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    return model


def _fastt_plan():
    from autodist_keras.devices import Cluster
    from autodist_keras.graph import ModelGraph
    from autodist_keras.strategies import fastt

    plan = fastt.plan(ModelGraph.from_keras(_mlp()), Cluster.cpu_testbed(), BATCH)
    assert len(plan.groups) > 1, plan.summary()  # the case under test: a placement plan
    return plan


def test_fastt_strategy_fails_at_plan_time_with_a_clear_error():
    from autodist_keras import AutoStrategy
    from autodist_keras.devices import Cluster
    from autodist_keras.errors import StrategyError

    _fastt_plan()
    strategy = AutoStrategy("fastt", cluster=Cluster.cpu_testbed())
    model = _build(strategy)
    x, y = _data()
    with pytest.raises(StrategyError) as info:
        model.fit(x, y, batch_size=BATCH, verbose=0)
    message = str(info.value)
    assert "cannot run here on the torch backend" in message
    assert "KERAS_BACKEND=tensorflow" in message
    assert "data-parallel strategy" in message
    assert "Received: strategy='fastt'" in message
    assert strategy.adapter.last_run.get("worker_pids") in (None, {})


def test_fixed_placement_plan_is_refused_before_any_worker_starts():
    from autodist_keras import AutoStrategy
    from autodist_keras.devices import Cluster
    from autodist_keras.errors import BackendError

    plan = _fastt_plan()
    strategy = AutoStrategy(cluster=Cluster.cpu_testbed(), plan=plan)
    ok, why = strategy.adapter.can_execute(plan)
    assert not ok and "KERAS_BACKEND=tensorflow" in why
    model = _build(strategy)
    x, y = _data()
    with pytest.raises(BackendError, match="Run placement plans with KERAS_BACKEND=tensorflow"):
        model.fit(x, y, batch_size=BATCH, verbose=0)


def test_auto_never_picks_a_placement_plan_on_torch():
    from autodist_keras import AutoStrategy
    from autodist_keras.devices import Cluster

    strategy = AutoStrategy("auto", cluster=Cluster.cpu_testbed())
    model = _build(strategy)
    plan = strategy.plan_for(model, BATCH)
    assert plan.is_data_parallel
    placement = [c for c in strategy.candidates if c.plan is not None and not c.plan.is_data_parallel]
    assert placement, [c.name for c in strategy.candidates]  # FastT's plan was a candidate ...
    for candidate in placement:  # ... and was marked as not runnable here, with the reason
        assert candidate.executable is False
        assert "PyTorch runtime" in candidate.reason
