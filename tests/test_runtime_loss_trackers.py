"""Metric trackers a model updates in its own `compute_loss`, on the active backend.

The Keras guides' pattern: the model holds `self.penalty_tracker =
keras.metrics.Mean(...)` and updates it inside a `compute_loss` override. Every
replica runs `compute_loss` on its shard, so until session 21 the tracker
logged another value than one device, silently: on TensorFlow each replica
added its shard's mean (an unweighted mean over replicas, and a count growing
per replica), on PyTorch only rank 0's tracker was read (rank 0's rows only).
The runtimes now make the tracker's step one update of the whole batch
(`backends/loss_trackers.py`), so History and `evaluate` equal plain Keras.
The model also has a layer that logs its input with a Mean of its own in
`call`: on PyTorch that tracker covered rank 0's rows only in training, and on
TensorFlow `evaluate` logged 0.0 for it (the forward pass's assignments were
dropped in the test step).

Uneven shares (a proportional plan on the CPU testbed: 24/12/12 of 48, then a
partial last batch of 24 split 12/6/6) make an unweighted mean over replicas
differ from the batch mean.
"""

import keras
import numpy as np
import pytest
from keras import ops

from autodist_keras import AutoStrategy
from autodist_keras import Cluster

BATCH = 48
SAMPLES = 120  # two full batches and one of 24


@keras.saving.register_keras_serializable(package="test_runtime_loss_trackers")
class ActivityMean(keras.layers.Layer):
    """Passes its input through, logs its mean square with a Mean and counts its
    rows in an integer declared aggregation="sum", in call."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.tracker = keras.metrics.Mean(name="activity")
        self.seen = self.add_weight(shape=(), dtype="int32", initializer="zeros",
                                    trainable=False, aggregation="sum", name="seen")

    def call(self, inputs):
        self.tracker.update_state(ops.mean(ops.square(inputs)))
        self.seen.assign_add(ops.shape(inputs)[0])
        return inputs


def _eager(tensor):
    """Whether `tensor` has a value (not a symbolic tensor of a traced function)."""
    try:
        ops.convert_to_numpy(tensor)
    except NotImplementedError:
        return False
    return True


@keras.saving.register_keras_serializable(package="test_runtime_loss_trackers")
class PenaltyTracked(keras.Model):
    """A subclassed model whose compute_loss adds a penalty and logs it with a Mean."""

    def __init__(self, two_outputs=False, **kwargs):
        super().__init__(**kwargs)
        self.two_outputs = two_outputs
        self.hidden = keras.layers.Dense(8, activation="tanh", name="hidden")
        self.activity = ActivityMean(name="activity_mean")
        self.first = keras.layers.Dense(3, name="first")
        self.second = keras.layers.Dense(3, name="second") if two_outputs else None
        self.penalty_tracker = keras.metrics.Mean(name="penalty")
        # State compute_loss assigns that is no metric: a moving average of the
        # loss (in training and evaluation) and a step count (training only).
        self.loss_average = self.add_weight(shape=(), initializer="zeros", trainable=False,
                                            name="loss_average")
        self.steps = self.add_weight(shape=(), dtype="int32", initializer="zeros",
                                     trainable=False, name="steps")
        # A count of the rows trained on, declared to sum over replicas.
        self.rows = self.add_weight(shape=(), dtype="int32", initializer="zeros",
                                    trainable=False, aggregation="sum", name="rows")
        # Noise compute_loss draws (times 0: the loss stays that of one device);
        # an eager step keeps each draw in `draws`.
        self.noise_seed = keras.random.SeedGenerator(3)
        self.draws = []

    def call(self, inputs):
        hidden = self.activity(self.hidden(inputs))
        if self.two_outputs:
            return {"a": self.first(hidden), "b": self.second(hidden)}
        return self.first(hidden)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                                    training=training)
        penalty = 0.0
        for pred in keras.tree.flatten(y_pred):
            penalty = penalty + 0.1 * ops.mean(ops.square(pred))
        self.penalty_tracker.update_state(penalty)

        def update_average():  # in a branch (a tf.cond in a traced step)
            self.loss_average.assign(0.8 * self.loss_average + 0.2 * ops.stop_gradient(loss))
            return ops.zeros(())

        ops.cond(ops.isfinite(loss), update_average, lambda: ops.zeros(()))
        rows = ops.shape(y_pred if self.second is None else y_pred["a"])[0]
        if training:
            self.steps.assign_add(1)
            self.rows.assign_add(rows)
        noise = keras.random.normal((rows,), seed=self.noise_seed)
        if self.run_eagerly and _eager(noise):
            self.draws.append(ops.convert_to_numpy(noise))
        return loss + penalty + 0.0 * ops.mean(noise)

    def get_config(self):
        return {"two_outputs": self.two_outputs, "name": self.name}


def _build(two_outputs, run_eagerly=False):
    keras.utils.set_random_seed(0)
    model = PenaltyTracked(two_outputs=two_outputs, name="tracked")
    model(np.zeros((2, 6), "float32"))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=keras.optimizers.SGD(0.05),
                  loss={"a": loss, "b": loss} if two_outputs else loss,
                  metrics={"a": ["accuracy"], "b": ["accuracy"]} if two_outputs
                  else ["accuracy"],
                  run_eagerly=run_eagerly)
    return model


def _data(two_outputs):
    rng = np.random.default_rng(0)
    # Rows of growing scale: the shards' penalties differ a lot.
    x = (rng.normal(size=(SAMPLES, 6))
         * np.linspace(0.2, 3.0, SAMPLES)[:, None]).astype("float32")
    y = rng.integers(0, 3, size=(SAMPLES,)).astype("int32")
    if two_outputs:
        y = {"a": y, "b": rng.integers(0, 3, size=(SAMPLES,)).astype("int32")}
    return x, y


def _strategy():
    cluster = Cluster.cpu_testbed()
    return AutoStrategy("proportional", cluster=cluster, devices=cluster.names[:3])


@pytest.mark.parametrize("run_eagerly", [False, True], ids=["traced", "eager"])
@pytest.mark.parametrize("two_outputs", [False, True], ids=["one_output", "two_outputs"])
def test_a_tracker_updated_in_compute_loss_logs_what_one_device_logs(two_outputs, run_eagerly):
    if run_eagerly and keras.backend.backend() != "tensorflow":
        pytest.skip("the PyTorch runtime has no traced step")
    x, y = _data(two_outputs)
    # Plain Keras's traced step weighs the per-output loss metrics of a partial
    # last batch as 1 (docs/runtime_tensorflow.md); eager Keras weighs them by size.
    reference = _build(two_outputs, run_eagerly=two_outputs or run_eagerly)
    initial = reference.get_weights()
    expected = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
    expected_eval = reference.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)

    strategy = _strategy()
    with strategy.scope():
        model = _build(two_outputs, run_eagerly=run_eagerly)
    model.set_weights(initial)
    try:
        history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
        evaluated = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    finally:
        if hasattr(strategy.adapter, "close"):
            strategy.adapter.close()
    assert strategy.plan.shares_for(BATCH) == [24, 12, 12]
    assert strategy.plan.shares_for(SAMPLES % BATCH) == [12, 6, 6]
    assert {"penalty", "activity"} <= set(expected) and sorted(history) == sorted(expected)
    for key, values in expected.items():
        np.testing.assert_allclose(history[key], values, rtol=1e-5, err_msg=key)
    assert sorted(evaluated) == sorted(expected_eval)
    for key, value in expected_eval.items():
        np.testing.assert_allclose(evaluated[key], value, rtol=1e-5, err_msg=key)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # One update per step, as on one device (the count was 3 per step on TensorFlow).
    assert float(model.penalty_tracker.count.numpy()) == float(
        reference.penalty_tracker.count.numpy())
    # State compute_loss assigns that is no metric: on TensorFlow every replica
    # assigned it in turn until session 29 (6 steps counted 18; the average
    # followed the shards' losses: 1.2972 against 0.9336 after fit, 1.2864 against
    # 1.0781 after evaluate, one output, traced).
    assert int(ops.convert_to_numpy(model.steps)) == int(ops.convert_to_numpy(reference.steps))
    # An integer declared aggregation="sum" adds up the replicas' changes: every
    # row counted once (240; it took the first replica's 24 + 24 + 12 per epoch,
    # 120, until session 30).
    assert int(ops.convert_to_numpy(model.rows)) == int(ops.convert_to_numpy(reference.rows)) == 240
    # The same for such a count in a layer's call (the forward pass's state): 2 rows
    # at build, 240 in fit, 120 in evaluate (it was 182 on TensorFlow).
    seen = [int(ops.convert_to_numpy(m.activity.seen)) for m in (model, reference)]
    assert seen == [362, 362]
    np.testing.assert_allclose(ops.convert_to_numpy(model.loss_average),
                               ops.convert_to_numpy(reference.loss_average), rtol=1e-5)
    # (The average is assigned in an `ops.cond` branch: the traced step failed
    # with InaccessibleTensorError until session 29's review.) Each replica draws
    # its own noise: with its seed state restored after each replica, the 12-row
    # replicas drew the first 12 numbers of the 24-row replica's draw.
    if run_eagerly:  # the last 9 steps (2 epochs, evaluate) of 3 replicas each
        draws = model.draws[-27:]
        assert [len(d) for d in draws[:6]] == [24, 12, 12, 24, 12, 12]
        for k in range(0, 27, 3):
            a, b, c = draws[k:k + 3]
            assert not np.array_equal(a[:len(b)], b) and not np.array_equal(b, c)


def tracker_worker_model():
    """The one-output model for two TensorFlow workers (they import and call this)."""
    return _build(False)


def two_tensorflow_workers_job(cluster, batch):
    """The trackers' changes travel in the gradient all-reduce with the other state:
    two TensorFlow workers (shares 16 and 8) must log the tracker of the whole batch.

    A job of `test_runtime_tensorflow_multiworker.test_two_workers_match_single_device`,
    which trains it in the same two workers as its other models (one launch of two
    TensorFlow processes for them all).

    Args:
        cluster: Two CPU-testbed devices, one core each.
        batch: The global batch size, 24.

    Returns:
        The job: its model function, plan, data, and the history to match.
    """
    from autodist_keras.graph import ModelGraph
    from autodist_keras.strategies import baselines

    x, y = _data(False)
    x, y = x[:96], y[:96]
    reference = tracker_worker_model()
    initial = reference.get_weights()
    expected = reference.fit(x, y, batch_size=batch, shuffle=False, verbose=0).history
    plan = baselines.proportional(ModelGraph.from_keras(reference), cluster, batch,
                                  speeds={"node0/cpu0": 2.0, "node0/cpu1": 1.0})
    assert plan.shares_for(batch) == [16, 8]
    return {"name": "loss tracker", "model_fn": tracker_worker_model, "x": x, "y": y,
            "plan": plan, "initial": initial, "steps": 4,
            "history": {"penalty": expected["penalty"], "loss": expected["loss"]},
            # The weights include the state compute_loss assigns (`loss_average`,
            # `steps`, and `rows`, declared aggregation="sum": its changes travel
            # in the all-reduce): each worker must end with one device's value.
            "weights": [(w.path, value) for w, value in zip(reference.weights,
                                                            reference.get_weights())],
            "share": [16, 8]}


@keras.saving.register_keras_serializable(package="test_runtime_loss_trackers")
class RunningMax(keras.metrics.Metric):
    """The largest value fed so far (its update depends on the value it holds)."""

    def __init__(self, name="running_max", **kwargs):
        super().__init__(name=name, **kwargs)
        self.largest = self.add_variable(shape=(), initializer="zeros", name="largest")

    def update_state(self, value):
        self.largest.assign(ops.maximum(self.largest, ops.cast(value, self.largest.dtype)))

    def result(self):
        return self.largest


@keras.saving.register_keras_serializable(package="test_runtime_loss_trackers")
class MaxTracked(PenaltyTracked):
    """Logs the penalty's running maximum besides its mean."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.max_tracker = RunningMax(name="max_penalty")

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                                    training=training)
        self.max_tracker.update_state(0.1 * ops.mean(ops.square(y_pred)))
        return loss


@pytest.mark.skipif(keras.backend.backend() != "torch",
                    reason="PyTorch: a worker's trackers keep their starting values")
def test_a_tracker_that_is_not_a_sum_or_mean_is_rank_0s_and_named_in_a_warning():
    """A running maximum's change depends on the value it starts from, which a
    worker's tracker does not hold: combined like a Mean it logged twice the
    largest value ever fed (0.144 vs 0.069, found in review). It now logs rank 0's
    rows exactly, and the fit warns, naming it; the Mean beside it is still the
    whole batch's."""
    x, y = _data(False)

    def build():
        keras.utils.set_random_seed(0)
        model = MaxTracked(name="max_tracked")
        model(np.zeros((2, 6), "float32"))
        model.compile(optimizer=keras.optimizers.SGD(0.05),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    rank0_max = []  # per epoch: the largest penalty of rank 0's rows (24 of 48, 12 of 24)

    class Rank0Rows(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            rank0_max.append(0.0)

        def on_train_batch_begin(self, batch, logs=None):
            start = batch * BATCH
            rows = x[start:start + (24 if SAMPLES - start >= BATCH else 12)]
            pred = ops.convert_to_numpy(self.model(rows))
            rank0_max[-1] = max(rank0_max[-1], float(0.1 * np.mean(np.square(pred))))

    reference = build()
    expected = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                             callbacks=[Rank0Rows()]).history
    strategy = _strategy()
    with strategy.scope():
        model = build()
    try:
        with pytest.warns(UserWarning, match=r"\['max_penalty'\].*rank 0's rows only"):
            history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False,
                                verbose=0).history
    finally:
        strategy.adapter.close()
    np.testing.assert_allclose(history["max_penalty"], rank0_max, rtol=1e-5)
    np.testing.assert_allclose(history["penalty"], expected["penalty"], rtol=1e-5)
