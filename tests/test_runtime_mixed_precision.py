"""Mixed precision (`mixed_float16`, `mixed_bfloat16`) under AutoStrategy, on the active backend.

A user sets `keras.mixed_precision.set_global_policy(...)` before building the
model; under "mixed_float16" `compile` wraps the optimizer in a
`LossScaleOptimizer` (dynamic loss scale 32768, growth every 2000 steps).
Each test trains the same model from the same initial weights on the same
global batches (shuffle=False) with a proportional plan on the CPU testbed
(3 replicas, shares 12/6/6 of 24: uneven) and with plain single-device Keras,
and compares them after every step.

Tolerances, from measurements (session 29, this machine, both backends):
- float16: a replica's gradient is its share's part of a sum that Keras
  computes in float16 on one device; the parts are rounded to float16 (11-bit
  mantissa, relative 2**-11 = 4.9e-4) separately and summed in float32, so a
  step's gradients differ from one device's by up to ~5e-4 relative, where
  float32 rounding gives ~1e-7: no 1e-5 tolerance can hold. Measured over the
  24 steps: weights at most 1.1e-4 apart (TF and PyTorch; the same runs in
  float32: 6e-8 / 7e-8), momentum slots 3e-5, evaluate's loss and metric
  9e-5 relative; checked with atol 1e-3 and rtol 1e-3. A step applied on one
  side and skipped on the other moves the weights by 0.02-0.08 here, far
  outside. (With ReLU before the LayerNormalization a step where few units
  fire amplified the difference tenfold on TF, so the hidden layer is tanh.)
  The History's loss and MAE are dominated by the poisoned rows (below), which
  both sides compute alike: 1.2e-7 relative, checked with 1e-5.
- bfloat16 (8-bit mantissa, relative 2**-8 = 3.9e-3): weights measured at most
  8.7e-4 apart over 12 steps, History 2.1e-4 and evaluate 2.7e-4 relative;
  checked with atol 1e-2 and rtol 3e-3.
- The loss scale's state (scale, growth counter, iteration count) after every
  step must be equal, exactly: the skip decisions are the same.

What is not checked, because it does not hold on any data-parallel runtime:
that a step whose float16 gradient sum lies near float16's limit (65504) is
skipped exactly when one device skips it. The replicas' parts of the sum are
smaller (they overflow less often than the whole batch) but may also be
larger (rows whose gradients cancel across replicas: session 29 measured a
replica's part inf where the whole batch's was 54304), so near the limit the
decisions differ either way (docs/runtime_tensorflow.md, "Mixed precision").
The overflows forced here lie far beyond it (a row whose float16 gradient
alone is ~416 x the loss scale, 4e5 or more), as a diverging batch's does.
"""

import contextlib

import keras
import numpy as np
import pytest

from autodist_keras import AutoStrategy
from autodist_keras import Cluster

BATCH = 24
STEPS = 12
# (step, row): rows 2, 15 and 21 lie in the first, second and third replica's
# share (12/6/6): each replica alone overflows once.
POISONED = ((2, 2), (5, 15), (9, 21))


@pytest.fixture
def policy():
    """`policy(name)` sets the global dtype policy; float32 again after the test."""
    try:
        yield keras.mixed_precision.set_global_policy
    finally:
        keras.mixed_precision.set_global_policy("float32")


def _data(poison):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * BATCH, 8)).astype("float32")
    y = rng.normal(size=(STEPS * BATCH, 2)).astype("float32")
    if poison:
        # Forward and loss stay finite (the loss computes in float32), but the
        # row's gradient times the loss scale (~416 x scale) is no float16.
        for step, row in POISONED:
            y[step * BATCH + row] = 1e4
    return x, y


def _build():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="tanh", name="dense")(inputs)
    hidden = keras.layers.LayerNormalization(name="norm")(hidden)  # computes in float32
    return keras.Model(inputs, keras.layers.Dense(2, name="head")(hidden))


class _PerStep(keras.callbacks.Callback):
    """Weights and loss-scale state after every training step."""

    def __init__(self):
        super().__init__()
        self.weights, self.states = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.weights.append(self.model.get_weights())
        optimizer = self.model.optimizer
        state = [int(optimizer.iterations)]
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            state += [float(optimizer.dynamic_scale), int(optimizer.step_counter)]
        self.states.append(tuple(state))


def _fit_both(poison, fits=1):
    """(model, histories, per-step record, evaluation) distributed and on one device.

    With `fits` > 1 `fit` runs that many times, each over the same batches
    (the loss scale and the optimizer slots go on from one fit to the next).
    """
    strategy = AutoStrategy("proportional", cluster=Cluster.cpu_testbed())
    initial = _build().get_weights()
    x, y = _data(poison)
    clean_x, clean_y = _data(False)
    runs = []
    for scope in (strategy.scope(), contextlib.nullcontext()):
        with scope:
            model = _build()
            model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.5), loss="mse",
                          metrics=["mae"])
        model.set_weights(initial)
        record = _PerStep()
        history = {}
        for _ in range(fits):
            logs = model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0,
                             callbacks=[record]).history
            for key, values in logs.items():
                history.setdefault(key, []).extend(values)
        evaluation = model.evaluate(clean_x, clean_y, batch_size=BATCH, verbose=0)
        runs.append((model, history, record, evaluation))
    assert strategy.plan.shares_for(BATCH) == [12, 6, 6]
    last_run = getattr(strategy.adapter, "last_run", None)
    if last_run is not None and "in_sync" in last_run:  # PyTorch: every rank's variables
        assert last_run["in_sync"] is True
    return initial, runs


def test_mixed_float16_trains_and_skips_overflowing_steps_as_one_device(policy):
    """Two fits of 12 steps check: the loss-scale optimizer Keras wraps in,
    float32 variables and float16 compute, losses, metrics and weights after
    every step within the float16 tolerance (module docstring), and per fit
    three steps whose gradients overflow in one replica only: every replica
    skips them (weights bit-for-bit unchanged, no iteration counted), the scale
    halves as on one device (32768 -> 512 over the six), the second fit goes
    on from the first's scale on every replica, and no weight turns NaN/inf."""
    policy("mixed_float16")
    fits = 2
    initial, runs = _fit_both(poison=True, fits=fits)
    (model, history, record, evaluation), (ref, ref_history, ref_record, ref_evaluation) = runs

    for m in (model, ref):
        assert isinstance(m.optimizer, keras.optimizers.LossScaleOptimizer)
        assert {v.dtype for v in m.weights} == {"float32"}
        assert m.get_layer("dense").compute_dtype == "float16"

    # The loss scale's state after every step, exactly as on one device.
    assert record.states == ref_record.states
    skipped = {fit * STEPS + step for fit in range(fits) for step, _ in POISONED}
    assert record.states[-1] == (fits * STEPS - len(skipped), 32768.0 / 2 ** len(skipped),
                                 STEPS - 1 - POISONED[-1][0])
    for step, (weights, ref_weights) in enumerate(zip(record.weights, ref_record.weights)):
        for per_step in (record.weights, ref_record.weights):
            before = per_step[step - 1] if step else initial
            unchanged = all(np.array_equal(a, b) for a, b in zip(per_step[step], before))
            assert unchanged == (step in skipped), step
        for w, r, v in zip(weights, ref_weights, ref.weights):
            np.testing.assert_allclose(w, r, rtol=0, atol=1e-3, err_msg=f"step {step} {v.path}")
    assert len(record.weights) == fits * STEPS
    assert all(np.isfinite(w).all() for w in model.get_weights())
    # Optimizer slots (momentum) too; the scale's variables were compared above.
    for v, r in zip(model.optimizer.variables, ref.optimizer.variables):
        np.testing.assert_allclose(np.asarray(v), np.asarray(r), rtol=0, atol=1e-3,
                                   err_msg=v.path)

    for key in ("loss", "mae"):  # global: the poisoned rows dominate both
        np.testing.assert_allclose(history[key], ref_history[key], rtol=1e-5, err_msg=key)
    np.testing.assert_allclose(evaluation, ref_evaluation, rtol=1e-3)  # clean data


def test_mixed_bfloat16_trains_as_one_device(policy):
    """bfloat16 has float32's range, so Keras scales no loss: plain optimizer,
    float32 variables, bfloat16 compute, History, evaluate and the weights after
    every step within the bfloat16 tolerance (module docstring)."""
    policy("mixed_bfloat16")
    _, runs = _fit_both(poison=False)
    (model, history, record, evaluation), (ref, ref_history, ref_record, ref_evaluation) = runs
    for m in (model, ref):
        assert not isinstance(m.optimizer, keras.optimizers.LossScaleOptimizer)
        assert {v.dtype for v in m.weights} == {"float32"}
        assert m.get_layer("dense").compute_dtype == "bfloat16"
    assert record.states == ref_record.states
    for step, (weights, ref_weights) in enumerate(zip(record.weights, ref_record.weights)):
        for w, r, v in zip(weights, ref_weights, ref.weights):
            np.testing.assert_allclose(w, r, rtol=0, atol=1e-2, err_msg=f"step {step} {v.path}")
    for key in ("loss", "mae"):
        np.testing.assert_allclose(history[key], ref_history[key], rtol=3e-3, err_msg=key)
    np.testing.assert_allclose(evaluation, ref_evaluation, rtol=3e-3)
