"""Fine-tuning under one AutoStrategy (both backends): fit, freeze a layer, compile again
inside the scope, fit again. Recompiling plans the model again, so the second fit trains
only what is still trainable, and the weights match plain Keras doing the same."""

import contextlib

import keras
import numpy as np
import pytest

from autodist_keras import AutoStrategy
from autodist_keras import Cluster


def _model():
    inputs = keras.Input((9,))
    hidden = keras.layers.Dense(16, activation="relu", name="base")(inputs)
    return keras.Model(inputs, keras.layers.Dense(3, name="head")(hidden))


@keras.saving.register_keras_serializable(package="test_fine_tuning")
class Backboned(keras.Model):
    """The transfer-learning recipe as a subclassed model: a functional backbone
    ("base") and a head. Its config holds no trainable flags, so the PyTorch
    workers must take the backbone's from rank 0."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        inputs = keras.Input((9,))
        self.base = keras.Model(
            inputs, keras.layers.Dense(16, activation="relu", name="hidden")(inputs), name="base")
        self.head = keras.layers.Dense(3, name="head")

    def call(self, inputs, training=None):
        return self.head(self.base(inputs, training=training))

    def get_config(self):
        return {"name": self.name}


def _subclassed_model():
    model = Backboned(name="backboned")
    model(np.zeros((1, 9), "float32"))
    return model


def _compile(model):
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def _stages(model, x, y, scope):
    for frozen in (False, True):
        model.get_layer("base").trainable = not frozen
        with scope():
            _compile(model)
        model.fit(x, y, batch_size=48, epochs=1, shuffle=False, verbose=0)


def test_freeze_and_recompile_in_scope_replans_and_matches_plain_keras():
    """A subclassed model whose backbone is frozen after construction: on PyTorch
    the workers rebuilt it trainable from its config (which keeps no trainable
    flags) and the second fit failed at SETUP with "This replica has 4 trainable
    variables but rank 0's model has 2" until session 29. (The functional
    `_model`'s flags travel in its config: the tests below freeze it.)"""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(192, 9)).astype("float32")
    y = rng.integers(0, 3, size=(192,))
    keras.utils.set_random_seed(0)
    reference = _subclassed_model()
    initial = reference.get_weights()
    _stages(reference, x, y, scope=contextlib.nullcontext)

    strategy = AutoStrategy("proportional", cluster=Cluster.cpu_testbed())
    with strategy.scope():
        model = _subclassed_model()
    model.set_weights(initial)
    _stages(model, x, y, scope=strategy.scope)
    assert strategy.plan is not None and len(strategy.plan.replicas) == 3
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    if hasattr(strategy.adapter, "close"):
        strategy.adapter.close()  # PyTorch: end the kept worker processes



class _ReadOnlyTrainable(keras.layers.Layer):
    """A layer whose `trainable` is a property without a setter (frozen by a flag)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.frozen = False
        self.w = self.add_weight(shape=(3,), initializer="ones")

    @property
    def trainable(self):
        return self._trainable and not self.frozen

    def call(self, inputs):
        return inputs * self.w


class _WithReadOnly(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        # (Explicit names: Keras left a name scope open after calling a model whose
        # auto-generated names start with "_", prefixing every later test's variables.)
        self.gate = _ReadOnlyTrainable(name="ro_gate")
        self.norm = keras.layers.BatchNormalization(name="ro_norm")
        self.head = keras.layers.Dense(2, name="ro_head")

    def call(self, inputs):
        return self.head(self.norm(self.gate(inputs)))


def test_trainable_flags_skip_a_read_only_trainable_property():
    """`use_trainable_flags` (what a PyTorch worker does at SETUP) raised
    AttributeError for a layer whose `trainable` has no setter, instead of
    leaving it for the SETUP checks to name; the other layers still take rank
    0's flags (a frozen BatchNormalization: inference mode in the worker too)."""
    from autodist_keras.backends.torch_session import trainable_flags
    from autodist_keras.backends.torch_session import use_trainable_flags

    rank0, replica = _WithReadOnly(name="ro_rank0"), _WithReadOnly(name="ro_replica")
    for model in (rank0, replica):
        model(np.zeros((1, 3), "float32"))
    rank0.gate.frozen = True
    rank0.norm.trainable = False
    use_trainable_flags(replica, trainable_flags(rank0))
    assert replica.gate.trainable and not replica.norm.trainable
    assert [w.trainable for w in replica.norm.weights] == [w.trainable for w in rank0.norm.weights]
    from keras.src.backend.common import global_state

    assert not global_state.get_global_attribute("name_scope_stack"), "a name scope leaked"


@pytest.mark.parametrize("optimizer, second_batch", [
    ("sgd", 48),
    # Optimizers with slots: the PyTorch workers rebuilt the optimizer for the
    # variables still trainable, fewer slots than rank 0's ("6 optimizer variables
    # but rank 0's has 10"). TensorFlow with a new batch size: IndexError.
    ("adam", 48), ("momentum", 32),
])
def test_freezing_without_compiling_again_replans_and_matches_plain_keras(optimizer,
                                                                          second_batch):
    """A layer frozen between fits without compile() stops training at the next fit,
    on both backends, as plain Keras on PyTorch does. (Plain Keras on TensorFlow
    applies it only when it traces its step again; the reference forces that.)"""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(192, 9)).astype("float32")
    y = rng.integers(0, 3, size=(192,))
    make = {"sgd": lambda: keras.optimizers.SGD(0.1),
            "adam": lambda: keras.optimizers.Adam(0.01),
            "momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9)}[optimizer]

    def fit_twice(model, retrace=False):
        model.fit(x, y, batch_size=48, epochs=1, shuffle=False, verbose=0)
        model.get_layer("base").trainable = False  # no compile() after it
        if retrace:
            model.train_function = None
        frozen = model.get_layer("base").get_weights()
        model.fit(x, y, batch_size=second_batch, epochs=1, shuffle=False, verbose=0)
        for got, want in zip(model.get_layer("base").get_weights(), frozen):
            np.testing.assert_array_equal(got, want)

    keras.utils.set_random_seed(0)
    reference = _model()
    initial = reference.get_weights()
    reference.compile(optimizer=make(),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    fit_twice(reference, retrace=True)

    strategy = AutoStrategy("proportional", cluster=Cluster.cpu_testbed())
    with strategy.scope():
        model = _model()
        model.compile(optimizer=make(),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.set_weights(initial)
    try:
        fit_twice(model)
    finally:
        if hasattr(strategy.adapter, "close"):
            strategy.adapter.close()
    # The strategy planned again for the head alone.
    assert {n for b in strategy.plan.buckets for n in b} == {"head/kernel", "head/bias"}
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_fully_frozen_model_fits_like_plain_keras():
    """No trainable weights (a frozen model kept for its metrics): Keras warns and
    trains nothing; the distributed fit does the same instead of failing."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(96, 9)).astype("float32")
    y = rng.integers(0, 3, size=(96,))
    keras.utils.set_random_seed(0)
    strategy = AutoStrategy("data_parallel", cluster=Cluster.cpu_testbed())
    with strategy.scope():
        model = _model()
        model.trainable = False
        _compile(model)
    before = model.get_weights()
    history = model.fit(x, y, batch_size=48, epochs=1, shuffle=False, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    assert len(strategy.plan.replicas) == 3
    for got, want in zip(model.get_weights(), before):
        np.testing.assert_array_equal(got, want)
    if hasattr(strategy.adapter, "close"):
        strategy.adapter.close()


def test_compiling_again_outside_the_scope_trains_with_the_new_optimizer():
    """A one-device plan runs Keras's own train function after each fit's first step;
    the one traced before a compile held the old optimizer (learning rate 0 here), so
    the next fit silently did not train."""
    x = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
    y = np.arange(64) % 3
    results = []
    for name in (None, "single_device", "data_parallel"):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        scope = (AutoStrategy(name, cluster=Cluster.cpu_testbed()).scope() if name
                 else contextlib.nullcontext())
        with scope:
            model.compile(optimizer=keras.optimizers.SGD(0.0), loss=loss)
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss)  # outside every scope
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        results.append((int(model.optimizer.iterations), model.get_weights()[0]))
    (plain_steps, plain), *ours = results
    assert plain_steps == 4
    for steps, weights in ours:
        assert steps == plain_steps, [r[0] for r in results]
        np.testing.assert_allclose(weights, plain, rtol=1e-5, atol=1e-6)


class _FreezeBaseAfterBatch(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 1:
            self.model.get_layer("base").trainable = False


@pytest.mark.parametrize("rows", [200, 192])
def test_freezing_during_fit_is_a_clear_error_and_the_next_fit_trains_the_rest(rows):
    """A callback freezing a layer mid-fit crashed deep in the runtimes ('Tensor lists
    must have the same number of tensors' on PyTorch, IndexError on TensorFlow once a
    step traced again: 200 rows end with a batch of 8), or on TensorFlow without a new
    trace (192 rows) trained the frozen layer on. It is refused before the next step,
    and the next fit plans for what is still trainable."""
    from autodist_keras.errors import BackendError

    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 9)).astype("float32")
    y = rng.integers(0, 3, size=(rows,))
    strategy = AutoStrategy("proportional", cluster=Cluster.cpu_testbed())
    with strategy.scope():
        model = _model()
        _compile(model)
    seen = []
    try:
        with pytest.raises(BackendError, match="trainable variables changed during fit .*"
                                               "Received: 2 trainable variables now, 4 at"):
            model.fit(x, y, batch_size=48, epochs=1, shuffle=False, verbose=0,
                      callbacks=[_FreezeBaseAfterBatch(), keras.callbacks.LambdaCallback(
                          on_train_batch_begin=lambda batch, logs: seen.append(batch))])
        assert seen == [0, 1, 2]  # batch 2 began, and its step was refused
        frozen = [w.copy() for w in model.get_layer("base").get_weights()]
        head = [w.copy() for w in model.get_layer("head").get_weights()]
        model.fit(x, y, batch_size=48, epochs=1, shuffle=False, verbose=0)
    finally:
        if hasattr(strategy.adapter, "close"):
            strategy.adapter.close()
    for got, want in zip(model.get_layer("base").get_weights(), frozen):
        np.testing.assert_array_equal(got, want)
    assert any(not np.array_equal(got, want)
               for got, want in zip(model.get_layer("head").get_weights(), head))


def test_fit_takes_a_single_callback_or_a_callback_list_as_keras_does():
    """`fit(callbacks=cb)` and `fit(callbacks=CallbackList([...]))` are Keras's too;
    the strategy's fit raised "'LambdaCallback' object is not iterable"."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 9)).astype("float32")
    y = rng.integers(0, 3, size=(96,))
    strategy = AutoStrategy("proportional", cluster=Cluster.cpu_testbed())
    with strategy.scope():
        model = _model()
        _compile(model)
    seen = []
    single = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: seen.append(b))
    # (EarlyStopping alone is safe to run on a thread: on PyTorch Keras runs such a
    # list's batch hooks on one, and the strategy's step timer lost steps there.)
    given = keras.callbacks.CallbackList(
        [keras.callbacks.EarlyStopping(monitor="loss", patience=5)], add_history=True,
        model=model)
    try:
        model.fit(x, y, batch_size=24, epochs=1, shuffle=False, verbose=0, callbacks=single)
        history = model.fit(x, y, batch_size=24, epochs=1, shuffle=False, verbose=0,
                            callbacks=given)
    finally:
        if hasattr(strategy.adapter, "close"):
            strategy.adapter.close()
    assert seen == [0, 1, 2, 3]
    assert len(given.callbacks) == 2  # the caller's list is left as it was (and its History)
    assert len(history.history["loss"]) == 1
    assert strategy.measured["steps"] == 2  # 4 steps, 2 of warm-up: none lost
