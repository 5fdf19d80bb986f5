"""Models that cannot be split by batch share are refused or flagged (both backends).

Each replica's loss is weighted by its share of the batch, which is exact for
batch means. A term that sums over the batch would train silently wrong, so
`fit` refuses it before the first step; masked outputs, `ignore_class` and
other losses that are not a mean of per-sample losses get a warning. The
probes must leave ordinary models alone, and their metric states and the
variables their layers assign untouched.
"""

import warnings

import keras
import numpy as np
import pytest

from autodist_keras import AutoStrategy
from autodist_keras import Cluster
from autodist_keras.backends import model_checks
from autodist_keras.errors import BackendError


def _data(n=24):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 6)).astype("float32"), rng.normal(size=(n, 2)).astype("float32")


def _mlp():
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="relu",
                                activity_regularizer=keras.regularizers.L1(0.01),
                                kernel_regularizer=keras.regularizers.L2(0.01))(inputs)
    return keras.Model(inputs, keras.layers.Dense(2)(hidden))


def summed_squares(y_true, y_pred):
    return keras.ops.sum(keras.ops.square(y_true - y_pred))


def mean_squares(y_true, y_pred):
    return keras.ops.mean(keras.ops.square(y_true - y_pred))


def in_batch_logsumexp(y_true, y_pred):
    # Compares samples within the batch (like in-batch negatives): not a sum.
    return keras.ops.logsumexp(keras.ops.sum(y_pred * y_true, axis=-1))


class SumPenalty(keras.layers.Layer):
    def call(self, inputs):
        self.add_loss(0.1 * keras.ops.sum(keras.ops.square(inputs)))
        return inputs


class TrainingSumPenalty(keras.layers.Layer):
    """A batch-sum penalty added only in training (invisible to an inference probe)."""

    def call(self, inputs, training=None):
        if training:
            self.add_loss(0.1 * keras.ops.sum(keras.ops.square(inputs)))
        return inputs


class TrainingBatchMeanPenalty(keras.layers.Layer):
    """A penalty on the batch's mean added only in training: not per-sample."""

    def call(self, inputs, training=None):
        if training:
            self.add_loss(keras.ops.sum(keras.ops.square(keras.ops.mean(inputs, axis=0))))
        return inputs


def _close(strategy):
    if hasattr(strategy.adapter, "close"):
        strategy.adapter.close()


@pytest.mark.parametrize("case", ["loss_function", "add_loss", "training_only_add_loss"])
def test_fit_refuses_a_loss_that_sums_over_the_batch(case):
    """A summed term added only when training=True trained silently wrong (weights
    0.11 off, loss 40% low): the probe ran in inference mode only."""
    x, y = _data()
    strategy = AutoStrategy("proportional", cluster=Cluster.cpu_testbed())
    with strategy.scope():
        model = _mlp()
        if case == "add_loss":
            model = keras.Sequential([model, SumPenalty()])
        elif case == "training_only_add_loss":
            model = keras.Sequential([model, TrainingSumPenalty()])
        model.compile(optimizer="sgd", loss=summed_squares if case == "loss_function" else "mse")
    before = [w.copy() for w in model.get_weights()]
    try:
        with pytest.raises(BackendError, match="grows with the batch size") as info:
            model.fit(x, y, batch_size=12, epochs=1, shuffle=False, verbose=0)
    finally:
        _close(strategy)
    assert "Received: total losses" in str(info.value)
    assert ("(training mode)" in str(info.value)) == (case == "training_only_add_loss")
    for got, want in zip(model.get_weights(), before):  # nothing was trained
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("loss", [mean_squares, in_batch_logsumexp, "mse"])
def test_probe_leaves_means_and_in_batch_losses_alone_and_metrics_untouched(loss):
    x, y = _data()
    model = _mlp()
    model.compile(optimizer="sgd", loss=loss, metrics=["mae"])
    model.evaluate(x[:12], y[:12], verbose=0)  # builds the model and fills the metric states
    states = [keras.ops.convert_to_numpy(v).copy() for v in model.metrics_variables]
    model_checks.check_summed_losses(model, x, y)
    for variable, state in zip(model.metrics_variables, states):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(variable), state)


@keras.saving.register_keras_serializable(package="test_model_checks")
class CallCounter(keras.layers.Layer):
    """Adds 1 to a non-trainable variable on every call, inference mode included."""

    def build(self, input_shape):
        self.count = self.add_weight(shape=(), initializer="zeros", trainable=False,
                                     name="count")

    def call(self, inputs):
        self.count.assign(self.count + 1.0)
        return inputs


def _counting_model():
    inputs = keras.Input((6,))
    hidden = CallCounter(name="counter")(keras.layers.Dense(8, name="hidden")(inputs))
    return keras.Model(inputs, keras.layers.Dense(2, name="out")(hidden))


def test_probes_undo_what_the_model_assigns_in_call():
    x, y = _data()
    model = _counting_model()
    model.compile(optimizer="sgd", loss="mse")
    plan = AutoStrategy("data_parallel", cluster=Cluster.cpu_testbed()).plan_for(model, 24)
    model_checks.check_model_for_plan(model, x, y, plan)
    assert float(keras.ops.convert_to_numpy(model.get_layer("counter").count)) == 0.0


def test_a_counter_assigned_in_call_counts_the_steps_as_on_one_device():
    """The loss probes before the first step ran the model 8 times and left their
    writes in place: the counter read 9 after one step."""
    x, y = _data(48)
    strategy = AutoStrategy("proportional", cluster=Cluster.cpu_testbed())
    with strategy.scope():
        model = _counting_model()
        model.compile(optimizer="sgd", loss="mse")
    try:
        model.fit(x, y, batch_size=24, epochs=1, shuffle=False, verbose=0)
    finally:
        _close(strategy)
    assert float(keras.ops.convert_to_numpy(model.get_layer("counter").count)) == 2.0


def test_sum_reduction_is_refused_inside_a_loss_dict():
    inputs = keras.Input((6,))
    model = keras.Model(inputs, {"a": keras.layers.Dense(2, name="a")(inputs),
                                 "b": keras.layers.Dense(2, name="b")(inputs)})
    model.compile(optimizer="sgd", loss={"a": "mse", "b": keras.losses.MeanSquaredError(
        reduction="sum")})
    with pytest.raises(BackendError, match="reduction='sum'"):
        model_checks.check_loss_reductions(model)


def test_masked_output_warns():
    inputs = keras.Input((5,), dtype="int32")
    hidden = keras.layers.Embedding(10, 4, mask_zero=True)(inputs)
    hidden = keras.layers.GRU(3, return_sequences=True)(hidden)
    masked = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    with pytest.warns(UserWarning, match="carry a Keras mask"):
        model_checks.warn_masked_outputs(masked)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model_checks.warn_masked_outputs(_mlp())


def test_fit_refuses_stateful_layers():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(24, 5, 3)).astype("float32")
    y = rng.normal(size=(24, 1)).astype("float32")
    strategy = AutoStrategy("proportional", cluster=Cluster.cpu_testbed())
    with strategy.scope():
        inputs = keras.Input((5, 3), batch_size=12)
        model = keras.Model(inputs, keras.layers.Dense(1)(
            keras.layers.GRU(4, stateful=True, name="memory")(inputs)))
        model.compile(optimizer="sgd", loss="mse")
    try:
        with pytest.raises(BackendError, match=r"\['memory'\] are stateful .*stateful=False"):
            model.fit(x, y, batch_size=12, epochs=1, shuffle=False, verbose=0)
    finally:
        _close(strategy)


def _classifier():
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    return keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(hidden))


def _rows_8_to_13_ignored():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 6)).astype("float32")
    y = rng.integers(0, 3, size=(16,)).astype("int32")
    y[8:14] = -1
    return x, y


def test_fit_warns_for_ignore_class():
    # Rows 8..13 ignored: with shares 8/4/4 one replica has no valid row, and its
    # loss would be weighted as a quarter of the batch.
    x, y = _rows_8_to_13_ignored()
    strategy = AutoStrategy("proportional", cluster=Cluster.cpu_testbed())
    with strategy.scope():
        model = _classifier()
        model.compile(optimizer="sgd",
                      loss=keras.losses.SparseCategoricalCrossentropy(ignore_class=-1))
    try:
        with pytest.warns(UserWarning, match=r"ignore_class=-1.*sample weights of 0"):
            model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        # With sample weights too: Keras's masked loss scales them in place, which
        # made the PyTorch workers' backward refuse their input rows (views of one
        # buffer share autograd's version counter).
        weights = np.linspace(0.5, 1.5, len(y)).astype("float32")
        history = model.fit(x, y, sample_weight=weights, batch_size=16, epochs=1,
                            shuffle=False, verbose=0)
        assert np.isfinite(history.history["loss"][0])
    finally:
        _close(strategy)


def _segmenter():
    inputs = keras.Input((4, 4, 1))
    return keras.Model(inputs, keras.layers.Conv2D(1, 1, activation="sigmoid")(inputs))


@pytest.mark.parametrize("loss", [keras.losses.Dice(), in_batch_logsumexp])
def test_losses_over_the_whole_batch_warn(loss):
    keras.utils.set_random_seed(1)
    rng = np.random.default_rng(1)
    if isinstance(loss, keras.losses.Loss):
        model, x = _segmenter(), rng.normal(size=(8, 4, 4, 1)).astype("float32")
        # Rows with 1 to 16 positive pixels: Dice over the batch is dominated by the full ones.
        y = (np.arange(16)[None, :] < np.arange(1, 17, 2)[:, None]).astype("float32")
        y = y.reshape(8, 4, 4, 1)
    else:
        model, (x, y) = _mlp(), _data(8)
    model.compile(optimizer="sgd", loss=loss, metrics=["mae"])
    model.evaluate(x, y, verbose=0)
    states = [keras.ops.convert_to_numpy(v).copy() for v in model.metrics_variables]
    with pytest.warns(UserWarning, match="not a mean of per-sample losses.*Received: loss of 4 rows"):
        assert model_checks.warn_loss_not_per_sample(model, x, y)
    for variable, state in zip(model.metrics_variables, states):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(variable), state)


def test_a_training_only_term_over_the_batch_warns():
    """The per-sample probe runs in training mode too (no random layer here)."""
    model, (x, y) = keras.Sequential([_mlp(), TrainingBatchMeanPenalty()]), _data(8)
    model.compile(optimizer="sgd", loss="mse")
    model.evaluate(x, y, verbose=0)
    with pytest.warns(UserWarning, match="In training mode the loss .* is not a mean of "
                                         "per-sample losses .*Received: .*training mode"):
        assert model_checks.warn_loss_not_per_sample(model, x, y)


@pytest.mark.parametrize("case", ["mse_with_regularisers", "dice_per_sample", "one_row",
                                  "batchnorm", "dropout"])
def test_per_sample_losses_do_not_warn(case):
    import warnings

    rng = np.random.default_rng(2)
    if case == "dice_per_sample":
        model, x = _segmenter(), rng.normal(size=(8, 4, 4, 1)).astype("float32")
        y = (rng.random(size=(8, 4, 4, 1)) > 0.5).astype("float32")
        model.compile(optimizer="sgd", loss=keras.losses.Dice(axis=(1, 2, 3)))
    elif case in ("batchnorm", "dropout"):
        # Training mode mixes samples (BatchNormalization, by design; warned about
        # elsewhere when inexact) or is random (Dropout): not probed there.
        extra = (keras.layers.BatchNormalization() if case == "batchnorm"
                 else keras.layers.Dropout(0.5))
        model, (x, y) = keras.Sequential([_mlp(), extra]), _data(8)
        model.compile(optimizer="sgd", loss="mse")
    else:
        model, (x, y) = _mlp(), _data(8 if case != "one_row" else 1)
        model.compile(optimizer="sgd", loss="mse")
    model.evaluate(x, y, verbose=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert not model_checks.warn_loss_not_per_sample(model, x, y)


def test_a_loss_that_is_nan_on_the_probe_rows_is_not_taken_for_a_sum():
    """Probabilities expected, logits given: Keras's torch backend divides by their sum
    (0 on zero inputs), so the probe's losses are NaN; that is no summed term."""
    import warnings

    model = _mlp()
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    x = np.zeros((8, 6), "float32")
    y = np.zeros((8,), "int32")
    model(x)
    model_checks.check_summed_losses(model, x, y)  # no BackendError
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model_checks.warn_loss_not_per_sample(model, x, y)


def test_a_plan_that_does_not_split_the_batch_is_neither_refused_nor_warned_about():
    """One replica runs each batch whole, as plain Keras does: ignore_class or a summed
    loss are exact there (the checks ran before planning and warned on one device)."""
    import warnings

    x, y = _rows_8_to_13_ignored()
    valid = np.where(y < 0, 0, y)
    for loss, y in ((keras.losses.SparseCategoricalCrossentropy(ignore_class=-1), y),
                    (keras.losses.SparseCategoricalCrossentropy(reduction="sum"), valid)):
        keras.utils.set_random_seed(0)
        plain = _classifier()
        plain.compile(optimizer="sgd", loss=loss)
        plain.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        strategy = AutoStrategy("single_device", cluster=Cluster.cpu_testbed())
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = _classifier()
            model.compile(optimizer="sgd", loss=loss)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", UserWarning)
                model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        finally:
            _close(strategy)
        for got, want in zip(model.get_weights(), plain.get_weights()):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_batchnorm_whose_moving_statistics_combine_inexactly_warns():
    """A trainable BatchNormalization called twice per step, or fed a Keras mask:
    the runtimes combine the replicas' moving statistics as for one unmasked call,
    so the moving variance (and, with a mask, the mean) differs from one device."""
    a, b = keras.Input((4,)), keras.Input((4,))
    shared = keras.layers.BatchNormalization(name="shared_bn")
    outer = keras.Model([a, b], keras.layers.Concatenate()([shared(a), shared(b)]), name="twice")
    with pytest.warns(UserWarning, match=r"\['shared_bn'\] of model 'twice' run more than once"):
        assert model_checks.warn_inexact_batchnorm(outer) == ["shared_bn"]

    # Nested in another model, and fed a mask.
    tokens = keras.Input((5, 3))
    masked = keras.layers.BatchNormalization(name="masked_bn")(keras.layers.Masking()(tokens))
    inner = keras.Model(tokens, masked, name="inner")
    x = keras.Input((5, 3))
    nested = keras.Model(x, keras.layers.GlobalAveragePooling1D()(inner(x)), name="outer")
    with pytest.warns(UserWarning, match=r"\['masked_bn'\] of model 'outer' get a Keras mask"):
        assert model_checks.warn_inexact_batchnorm(nested) == ["masked_bn"]

    # A Sequential's graph, and a nested model called twice per step.
    sequential = keras.Sequential([keras.Input((5,), dtype="int32"),
                                   keras.layers.Embedding(10, 3, mask_zero=True),
                                   keras.layers.BatchNormalization(name="seq_bn")],
                                  name="seq")
    with pytest.warns(UserWarning, match=r"\['seq_bn'\] of model 'seq' get a Keras mask"):
        assert model_checks.warn_inexact_batchnorm(sequential) == ["seq_bn"]
    block = keras.Sequential([keras.Input((4,)), keras.layers.BatchNormalization(name="blk_bn")])
    siamese = keras.Model([a, b], keras.layers.Concatenate()([block(a), block(b)]),
                          name="siamese")
    with pytest.warns(UserWarning, match=r"\['blk_bn'\] of model 'siamese' run more than"):
        assert model_checks.warn_inexact_batchnorm(siamese) == ["blk_bn"]

    # Called once without a mask, or frozen (its statistics do not move): no warning.
    plain = keras.Sequential([keras.Input((4,)), keras.layers.BatchNormalization(),
                              keras.layers.Dense(2)])
    shared.trainable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert model_checks.warn_inexact_batchnorm(plain) == []
        assert model_checks.warn_inexact_batchnorm(outer) == []


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="TorchModuleWrapper is PyTorch's")
def test_probes_leave_a_wrapped_torch_module_as_it_was():
    """A torch.nn.BatchNorm1d's running statistics are torch buffers, which the probe
    cannot restore: training mode is not probed for such a model (they moved by 0.23)."""
    import torch

    module = torch.nn.BatchNorm1d(8)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8),
                              keras.layers.TorchModuleWrapper(module), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = _data(8)
    model.evaluate(x, y, verbose=0)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    training = module.training
    model_checks.check_summed_losses(model, x, y)
    model_checks.warn_loss_not_per_sample(model, x, y)
    for key, value in module.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert module.training == training


def _spectral_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    hidden = keras.layers.SpectralNormalization(keras.layers.Dense(4), power_iterations=1,
                                                name="sn")(inputs)
    return keras.Model(inputs, keras.layers.Dense(2, name="out")(hidden))


def test_probes_leave_trainable_variables_assigned_in_call_and_compare_one_model():
    """SpectralNormalization assigns its trainable kernel (kernel / sigma) in training.
    The probes restored metric and non-trainable variables only: the checks left the
    kernel rescaled (by up to 0.19 here), and since each probe call renormalised the
    kernel the previous one left, the rows' losses came from different models and the
    check warned that the loss was not a mean of per-sample losses."""
    x, y = _data()
    model = _spectral_model()
    model.compile(optimizer="sgd", loss="mse")
    before = [keras.ops.convert_to_numpy(v) for v in model.variables]
    plan = AutoStrategy("data_parallel", cluster=Cluster.cpu_testbed()).plan_for(model, 24)
    assert model_checks.splits_batch(plan)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model_checks.check_model_for_plan(model, x, y, plan)
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert not [m for m in messages if "per-sample" in m], messages
    for variable, want in zip(model.variables, before):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(variable), want,
                                      err_msg=variable.path)
