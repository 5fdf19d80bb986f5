"""The PyTorch runtime: distributed model.fit matches single-device training.

Real processes (spawned workers, gloo process groups on 127.0.0.1), real Keras
models, real files. Every distributed run is compared with plain Keras
training of the same model from the same initial weights on the same batches
(shuffle=False). The global batch is 24 and the data set has 458 samples, so
an epoch is 20 steps whose last batch holds 2 samples: with 3 replicas that
batch gives one replica no sample at all, which the runtime must handle.
"""

import contextlib
import os
import sys
import time

import keras
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "torch", reason="PyTorch runtime tests run under KERAS_BACKEND=torch"
)

BATCH = 24
SAMPLES = 458  # 19 full batches + one of 2 samples = 20 steps
RTOL, ATOL = 1e-5, 1e-6


# ------------------------------------------------------------------ models
def _mlp():
    # An L2 regulariser checks that model.losses count once over the replicas.
    inputs = keras.Input((16,), name="mlp_input")
    x = keras.layers.Dense(32, activation="relu", name="mlp_dense0",
                           kernel_regularizer=keras.regularizers.L2(1e-3))(inputs)
    x = keras.layers.Dense(32, activation="relu", name="mlp_dense1")(x)
    outputs = keras.layers.Dense(4, name="mlp_logits")(x)
    return keras.Model(inputs, outputs, name="mlp")


def _cnn(freeze_bn=True):
    from autodist_keras.graph import zoo

    model = zoo.small_cnn(input_shape=(8, 8, 3), filters=(4, 8), num_classes=4)
    if freeze_bn:
        for layer in model.layers:
            if isinstance(layer, keras.layers.BatchNormalization):
                layer.trainable = False  # inference mode: global = per-replica statistics
    return model


def _transformer():
    from autodist_keras.graph import zoo

    return zoo.transformer_encoder(num_layers=1, d_model=16, heads=2, seq_len=8, vocab=50,
                                   num_classes=4)


MODELS = {"mlp": _mlp, "cnn": _cnn, "transformer": _transformer}


def _data(kind, n=SAMPLES, seed=0):
    rng = np.random.default_rng(seed)
    if kind == "mlp":
        x = rng.normal(size=(n, 16)).astype("float32")
    elif kind == "cnn":
        x = rng.normal(size=(n, 8, 8, 3)).astype("float32")
    else:
        x = rng.integers(0, 50, size=(n, 8)).astype("int32")
    y = rng.integers(0, 4, size=(n,)).astype("int32")
    return x, y


def _optimizer(name):
    if name == "sgd":
        return keras.optimizers.SGD(learning_rate=0.05, momentum=0.9)
    return keras.optimizers.Adam(learning_rate=0.01)


def _compile(model, optimizer):
    model.compile(
        optimizer=_optimizer(optimizer),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["sparse_categorical_accuracy"],
    )


def _build(kind, seed=1, **kwargs):
    keras.utils.set_random_seed(seed)
    return MODELS[kind](**kwargs)


def _strategy(plan, ndev, **options):
    from autodist_keras import AutoStrategy
    from autodist_keras.devices import Cluster

    cluster = Cluster.cpu_testbed()
    devices = cluster.names[:ndev]
    if plan == "ps":
        # Uneven shares, and the server on rank 1 (not the user's process).
        options.update(sync="ps", ps_server=devices[1])
        return AutoStrategy(strategy="proportional", cluster=cluster, devices=devices, **options)
    name = {"even": "data_parallel", "proportional": "proportional"}[plan]
    return AutoStrategy(strategy=name, cluster=cluster, devices=devices, **options)


def _distributed(kind, optimizer, strategy, fit_kwargs=None, build_kwargs=None, data=None):
    with strategy.scope():
        model = _build(kind, **(build_kwargs or {}))
        _compile(model, optimizer)
    x, y = data if data is not None else _data(kind)
    kwargs = dict(batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    kwargs.update(fit_kwargs or {})
    history = model.fit(x, y, **kwargs)
    return model, history


_REFERENCES = {}


def _reference_weights(kind, optimizer):
    """Single-device weights and History of the default run, computed once per process."""
    if (kind, optimizer) not in _REFERENCES:
        model, history = _reference(kind, optimizer)
        _REFERENCES[kind, optimizer] = (model, dict(history.history))
    return _REFERENCES[kind, optimizer]


def _reference(kind, optimizer, fit_kwargs=None, build_kwargs=None, data=None):
    model = _build(kind, **(build_kwargs or {}))
    _compile(model, optimizer)
    x, y = data if data is not None else _data(kind)
    kwargs = dict(batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    kwargs.update(fit_kwargs or {})
    history = model.fit(x, y, **kwargs)
    return model, history


# The key bias of attention has an identically zero true gradient (softmax is
# invariant to adding the same number to every logit), so what it "learns" is
# float rounding noise: Adam divides that noise by its own tiny second moment
# and moves the bias by ~lr * noise / epsilon (|w| ~ 1e-5). Summation order
# differs between 1 and n replicas, so the noise differs; such variables are
# checked to stay at noise level instead of being compared.
ZERO_GRADIENT_NOISE = ("attention/key/bias",)


def _assert_same_weights(actual, expected, rtol=RTOL, atol=ATOL):
    a, e = actual.get_weights(), expected.get_weights()
    assert len(a) == len(e)
    for wa, we, v in zip(a, e, expected.weights):
        if v.path.endswith(ZERO_GRADIENT_NOISE):
            assert np.abs(wa).max() < 1e-4 and np.abs(we).max() < 1e-4, v.path
            continue
        np.testing.assert_allclose(wa, we, rtol=rtol, atol=atol, err_msg=v.path)


def _assert_moved(model, initial):
    assert any(not np.array_equal(w, w0) for w, w0 in zip(model.get_weights(), initial))


# ------------------------------------------------------------ equivalence
# Each plan kind runs on 2 and on 3 devices, once with SGD (momentum) and
# once with Adam; every model runs all six.
CONFIGS = [
    ("even", 2, "sgd"), ("even", 3, "adam"),
    ("proportional", 2, "adam"), ("proportional", 3, "sgd"),
    ("ps", 2, "sgd"), ("ps", 3, "adam"),
]


@pytest.mark.parametrize("kind", ["mlp", "cnn", "transformer"])
@pytest.mark.parametrize("plan,ndev,optimizer", CONFIGS)
def test_weights_match_single_device(kind, plan, ndev, optimizer):
    strategy = _strategy(plan, ndev)
    model, history = _distributed(kind, optimizer, strategy)
    reference, ref_history = _reference_weights(kind, optimizer)
    run = strategy.adapter.last_run
    assert run["mode"] == "spawned" and run["world_size"] == ndev
    assert run["steps"] == 20 and run["in_sync"] is True
    shares = strategy.plan.shares_for(BATCH)
    assert len(shares) == ndev and sum(shares) == BATCH
    if plan != "even":
        assert len(set(shares)) > 1  # really uneven
    if plan == "ps":
        assert {s.method for s in strategy.plan.sync.values()} == {"ps"}
    _assert_moved(reference, _build(kind).get_weights())
    _assert_same_weights(model, reference)
    # Logged loss and metrics are global (whole batch), as on one device.
    for key in ("loss", "sparse_categorical_accuracy"):
        np.testing.assert_allclose(history.history[key], ref_history[key], rtol=1e-5)


def test_batchnorm_training_mode_is_per_replica_but_replicas_stay_identical():
    """BN in training mode normalises each shard with its own statistics, so the
    trainable weights differ from single-device training (documented). What
    holds: replicas stay bit-identical, and after one step the first BN layer's
    moving mean (its input does not depend on batch statistics) equals the
    single-device one, because each replica's update is weighted by its share."""
    strategy = _strategy("proportional", 3)
    kwargs = {"build_kwargs": {"freeze_bn": False}, "fit_kwargs": {"steps_per_epoch": 1}}
    model, _ = _distributed("cnn", "sgd", strategy, **kwargs)
    reference, _ = _reference("cnn", "sgd", **kwargs)
    assert strategy.adapter.last_run["in_sync"] is True
    initial = {v.path: np.array(v) for v in _build("cnn", freeze_bn=False).weights}
    checked = 0
    for v, ref in zip(model.weights, reference.weights):
        if v.path.endswith("bn0/moving_mean"):
            checked += 1
            assert not np.allclose(np.array(v), initial[v.path])
            np.testing.assert_allclose(np.array(v), np.array(ref), rtol=1e-5, atol=1e-6)
    assert checked == 1


@pytest.mark.parametrize("bucket_bytes", [0, 1024, 25 * 1024 * 1024])
def test_tensor_fusion_buckets_give_the_same_weights(bucket_bytes):
    strategy = _strategy("proportional", 3, bucket_bytes=bucket_bytes)
    model, _ = _distributed("mlp", "adam", strategy)
    reference, _ = _reference_weights("mlp", "adam")
    buckets = strategy.plan.buckets
    variables = len(model.trainable_weights)
    expected = {0: variables, 25 * 1024 * 1024: 1}.get(bucket_bytes)
    if expected is not None:
        assert len(buckets) == expected
    else:
        assert 1 < len(buckets) < variables
    reducer = strategy.adapter._run.driver.trainer.reducer
    assert reducer.num_buckets == len(buckets)
    if bucket_bytes == 0:
        # Buckets of the last layers were launched while backward still ran.
        assert reducer.launched_during_backward >= len(buckets) - 1
    _assert_same_weights(model, reference)


def _two_node_cluster():
    from autodist_keras.devices import Cluster

    return Cluster.from_dict({"nodes": [
        {"name": "node0", "address": "127.0.0.1", "cpus": [{"cores": [0], "threads": 1},
                                                          {"cores": [1], "threads": 1}]},
        {"name": "node1", "address": "127.0.0.2", "cpus": [{"cores": [1], "threads": 1}]},
    ]})


def test_hierarchical_allreduce_across_two_nodes():
    from autodist_keras import AutoStrategy

    cluster = _two_node_cluster()
    strategy = AutoStrategy(strategy="data_parallel", cluster=cluster, algorithm="hierarchical")
    model, _ = _distributed("mlp", "sgd", strategy)
    reference, _ = _reference_weights("mlp", "sgd")
    reducer = strategy.adapter._run.driver.trainer.reducer
    assert {b.kind for b in reducer.buckets} == {"hierarchical"}
    _assert_same_weights(model, reference)


def test_hierarchical_allreduce_through_gloo(monkeypatch):
    """The same plan with gradient sums through gloo (spawned workers sum in
    shared memory by default): reduce in each node, all-reduce among the
    leaders, broadcast in each node."""
    from autodist_keras import AutoStrategy

    monkeypatch.setenv("AUTODIST_KERAS_TORCH_SHM_REDUCE", "0")
    cluster = _two_node_cluster()
    strategy = AutoStrategy(strategy="data_parallel", cluster=cluster, algorithm="hierarchical")
    model, _ = _distributed("mlp", "sgd", strategy)
    assert strategy.adapter.last_run["gradient_transport"] == "gloo"
    assert strategy.adapter._run.driver.trainer.reducer.area is None
    _assert_same_weights(model, _reference_weights("mlp", "sgd")[0])


# --------------------------------------------------------- Keras features
def test_fit_features_history_save_and_evaluate(tmp_path):
    x, y = _data("mlp")
    xv, yv = _data("mlp", n=50, seed=3)
    sample_weight = np.random.default_rng(4).uniform(0.5, 2.0, size=len(x)).astype("float32")
    seen = []
    fit_kwargs = dict(
        sample_weight=sample_weight, validation_data=(xv, yv), epochs=2, steps_per_epoch=8,
        callbacks=[keras.callbacks.ModelCheckpoint(str(tmp_path / "ckpt.weights.h5"),
                                                   save_weights_only=True),
                   keras.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: seen.append(dict(logs)))],
    )
    strategy = _strategy("proportional", 3)
    model, history = _distributed("mlp", "sgd", strategy, fit_kwargs=fit_kwargs)
    ref_kwargs = dict(fit_kwargs, callbacks=[])
    reference, ref_history = _reference("mlp", "sgd", fit_kwargs=ref_kwargs)
    _assert_same_weights(model, reference)
    assert strategy.adapter.last_run["steps"] == 16
    assert history.epoch == [0, 1] and len(seen) == 2
    for key in ("loss", "sparse_categorical_accuracy", "val_loss", "val_sparse_categorical_accuracy"):
        np.testing.assert_allclose(history.history[key], ref_history.history[key], rtol=1e-5)
    # The checkpoint written during fit holds the trained weights.
    restored = _build("mlp")
    restored.load_weights(str(tmp_path / "ckpt.weights.h5"))
    _assert_same_weights(restored, model, rtol=0, atol=0)
    # evaluate and predict (on rank 0) agree with the reference model.
    np.testing.assert_allclose(model.evaluate(xv, yv, verbose=0),
                               reference.evaluate(xv, yv, verbose=0), rtol=1e-5)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_allclose(loaded.predict(xv, verbose=0), reference.predict(xv, verbose=0),
                               rtol=1e-5, atol=1e-6)


def test_class_weight_matches_single_device():
    fit_kwargs = {"class_weight": {0: 1.0, 1: 3.0, 2: 0.5, 3: 1.5}}
    strategy = _strategy("even", 2)
    model, history = _distributed("mlp", "adam", strategy, fit_kwargs=fit_kwargs)
    reference, ref_history = _reference("mlp", "adam", fit_kwargs=fit_kwargs)
    _assert_same_weights(model, reference)
    np.testing.assert_allclose(history.history["loss"], ref_history.history["loss"], rtol=1e-5)


@pytest.mark.parametrize("plan", ["even", "ps"])
def test_learning_rate_schedule_reaches_every_worker(plan):
    # The rate changes every epoch on rank 0 (a callback); the other ranks apply
    # it too (with "ps" the server on rank 1 runs the optimizer), so the weights
    # match one device trained with the same schedule.
    def fit_kwargs():
        return {"epochs": 3, "callbacks": [
            keras.callbacks.LearningRateScheduler(lambda epoch: 0.05 * 0.2 ** epoch)]}

    strategy = _strategy(plan, 2)
    model, history = _distributed("mlp", "sgd", strategy, fit_kwargs=fit_kwargs())
    reference, ref_history = _reference("mlp", "sgd", fit_kwargs=fit_kwargs())
    assert history.history["learning_rate"] == pytest.approx([0.05, 0.01, 0.002])
    _assert_same_weights(model, reference)
    np.testing.assert_allclose(history.history["loss"], ref_history.history["loss"], rtol=1e-5)


class _SetOptimizerAttribute(keras.callbacks.Callback):
    """Sets an optimizer setting at the start of an epoch (rank 0 runs callbacks)."""

    def __init__(self, name, value, epoch=1):
        super().__init__()
        self.name, self.value, self.epoch = name, value, epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            setattr(self.model.optimizer, self.name, self.value)


def _fit_with_optimizer(make_optimizer, strategy=None, callbacks=()):
    """Trains the MLP with `make_optimizer()`, under `strategy` or on one device."""
    import contextlib

    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = _build("mlp")
        model.compile(optimizer=make_optimizer(),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data("mlp", n=96)
    history = model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0,
                        callbacks=list(callbacks))
    return model, history


@pytest.mark.parametrize("plan", ["proportional", "ps"])
def test_optimizer_settings_changed_by_a_callback_reach_every_worker(plan, recwarn):
    """Settings other than the learning rate (momentum, weight decay, clipping) set
    by a callback on rank 0 reach the workers' optimizers before the next step."""
    def make():
        return keras.optimizers.SGD(0.1, momentum=0.9)

    def callbacks():
        return [_SetOptimizerAttribute("momentum", 0.0), _SetOptimizerAttribute("clipnorm", 0.05, 2)]

    strategy = _strategy(plan, 3)
    model, history = _fit_with_optimizer(make, strategy, callbacks())
    reference, ref_history = _fit_with_optimizer(make, callbacks=callbacks())
    assert model.optimizer.momentum == 0.0 and model.optimizer.clipnorm == 0.05
    assert strategy.adapter.last_run["in_sync"] is True
    assert not [w for w in recwarn if "differ" in str(w.message)]
    np.testing.assert_allclose(history.history["loss"], ref_history.history["loss"], rtol=1e-5)
    _assert_same_weights(model, reference)


def test_weights_excluded_from_weight_decay_stay_excluded_on_every_worker(recwarn):
    """`exclude_from_weight_decay` is optimizer state outside its config, which the
    spawned workers rebuild the optimizer from; rank 0 sends the excluded variables."""
    def make():
        optimizer = keras.optimizers.AdamW(0.05, weight_decay=0.5)
        optimizer.exclude_from_weight_decay(var_names=["bias"])
        return optimizer

    strategy = _strategy("proportional", 3)
    model, history = _fit_with_optimizer(make, strategy)
    reference, ref_history = _fit_with_optimizer(make)
    assert strategy.adapter.last_run["in_sync"] is True
    assert not [w for w in recwarn if "differ" in str(w.message)]
    np.testing.assert_allclose(history.history["loss"], ref_history.history["loss"], rtol=1e-5)
    _assert_same_weights(model, reference)


class _SetInnerMomentum(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 1:
            self.model.optimizer.inner_optimizer.momentum = 0.0


def test_settings_of_an_optimizer_wrapped_for_loss_scaling_reach_every_worker(recwarn):
    """Keras wraps the optimizer in a LossScaleOptimizer under mixed_float16; its
    config holds only the scale settings, so the wrapped optimizer's momentum and
    weight-decay exclusions did not reach the workers (weights 1.8e-3 apart)."""
    def make():
        inner = keras.optimizers.AdamW(0.05, weight_decay=0.5)
        inner.exclude_from_weight_decay(var_names=["bias"])
        return keras.optimizers.LossScaleOptimizer(inner)

    def make_momentum():
        return keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))

    for factory, callbacks in ((make, ()), (make_momentum, (_SetInnerMomentum(),))):
        strategy = _strategy("proportional", 3)
        model, history = _fit_with_optimizer(factory, strategy, callbacks)
        reference, ref_history = _fit_with_optimizer(factory, callbacks=callbacks)
        assert strategy.adapter.last_run["in_sync"] is True
        np.testing.assert_allclose(history.history["loss"], ref_history.history["loss"],
                                   rtol=1e-5)
        _assert_same_weights(model, reference)
    assert not [w for w in recwarn if "differ" in str(w.message)]


class _MomentumOffAtTrainBegin(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.model.optimizer.momentum = 0.0


def test_a_setting_that_decides_the_optimizer_variables_may_change_as_fit_begins(recwarn):
    """Keras builds the optimizer as fit begins, before on_train_begin; a callback
    setting momentum = 0.0 there was taken for the built value, and the workers made
    no momentum slots ('Rank 1's replica has 2 optimizer variables but rank 0's has 6')."""
    def make():
        return keras.optimizers.SGD(0.1, momentum=0.9)

    strategy = _strategy("proportional", 3)
    model, history = _fit_with_optimizer(make, strategy, [_MomentumOffAtTrainBegin()])
    reference, ref_history = _fit_with_optimizer(make, callbacks=[_MomentumOffAtTrainBegin()])
    assert len(model.optimizer.variables) == len(reference.optimizer.variables) > 2
    assert strategy.adapter.last_run["in_sync"] is True
    np.testing.assert_allclose(history.history["loss"], ref_history.history["loss"], rtol=1e-5)
    _assert_same_weights(model, reference)


@pytest.mark.parametrize("case", ["sgd_momentum", "adam_amsgrad", "loss_scaled_momentum"])
def test_a_setting_that_decides_the_optimizer_variables_may_change_between_fits(case, recwarn):
    """SGD makes momentum slots only when momentum is not 0, Adam more with amsgrad:
    workers rebuild their optimizer from the config at every fit, so after
    `momentum = 0.0` between fits they made fewer variables than rank 0 and the
    next fit failed ('Rank 1's replica has 2 optimizer variables but rank 0's has 6')."""
    make, target, name, value = {
        "sgd_momentum": (lambda: keras.optimizers.SGD(0.1, momentum=0.9), None, "momentum", 0.0),
        "adam_amsgrad": (lambda: keras.optimizers.Adam(0.01, amsgrad=True), None, "amsgrad",
                         False),
        "loss_scaled_momentum": (lambda: keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.1, momentum=0.9)), "inner_optimizer", "momentum", 0.0),
    }[case]
    strategy = _strategy("proportional", 3)
    x, y = _data("mlp", n=96)
    models = []
    for scope in (strategy.scope(), contextlib.nullcontext()):
        with scope:
            model = _build("mlp")
            model.compile(optimizer=make(),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        optimizer = getattr(model.optimizer, target) if target else model.optimizer
        setattr(optimizer, name, value)
        history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        models.append((model, history))
    (model, history), (reference, ref_history) = models
    assert strategy.adapter.last_run["in_sync"] is True
    assert not [w for w in recwarn if "differ" in str(w.message)]
    np.testing.assert_allclose(history.history["loss"], ref_history.history["loss"], rtol=1e-5)
    _assert_same_weights(model, reference)


def test_ema_optimizer_ends_fit_with_the_replicas_in_sync(recwarn):
    """With use_ema=True Keras swaps the moving averages into the weights at the end of
    fit; the workers do the same, so no 'replicas differ' warning and one-device weights."""
    import warnings

    def ema_compile(model):
        model.compile(optimizer=keras.optimizers.Adam(0.01, use_ema=True, ema_momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    strategy = _strategy("even", 2)
    with strategy.scope():
        model = _build("mlp")
        ema_compile(model)
    x, y = _data("mlp")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    assert strategy.adapter.last_run["in_sync"] is True
    reference = _build("mlp")
    ema_compile(reference)
    reference.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    _assert_same_weights(model, reference)


def _clipped_dense():
    inputs = keras.Input((8,), name="oc_in")
    hidden = keras.layers.Dense(16, activation="relu", name="oc_hidden")(inputs)
    return keras.Model(inputs, keras.layers.Dense(3, name="oc_logits")(hidden))


def _optimizer_feature_cases():
    """Optimizer factories of `test_optimizer_features_act_on_the_global_gradient`."""
    opt = keras.optimizers
    warmup = opt.schedules.CosineDecay(0.0, 6, alpha=0.1, warmup_target=0.02, warmup_steps=3)
    return [
        # Global clipping of an accumulated gradient, weight decay, a warm-up schedule,
        # EMA (swapped into the weights every 4 steps and at the end of fit) and dynamic
        # loss scaling (the scale grows every 2 finite steps).
        lambda: opt.LossScaleOptimizer(
            opt.AdamW(warmup, weight_decay=0.3, global_clipnorm=0.1,
                      gradient_accumulation_steps=3, use_ema=True, ema_momentum=0.8,
                      ema_overwrite_frequency=4),
            initial_scale=2.0 ** 15, dynamic_growth_steps=2),
        # Per-variable clipping, factored slots, a decaying schedule.
        lambda: opt.Adafactor(opt.schedules.ExponentialDecay(0.05, 2, 0.5), clipnorm=0.05),
        # Elementwise clipping and a constant loss scale factor; Ftrl's accumulators.
        lambda: opt.Ftrl(0.1, l1_regularization_strength=0.01,
                         l2_shrinkage_regularization_strength=0.01, loss_scale_factor=128.0,
                         clipvalue=0.01),
        lambda: opt.Lion(0.003, weight_decay=0.1, clipnorm=0.05),
    ]


def test_optimizer_features_act_on_the_global_gradient(recwarn):
    """Clipping (`clipnorm`, `clipvalue`, `global_clipnorm`), gradient accumulation,
    weight decay, EMA, schedules, loss scaling and optimizers with other slots
    (Adafactor, Ftrl, Lion) train as on one device: every rank's optimizer applies
    the summed gradient of the whole batch. The inputs are scaled so that every clip
    bites: on the first batch the gradient norm is 4.01 (per variable 2.92, 0.30,
    2.72, 0.27) and the replicas' weighted parts (shares 12/6/6) have norms 3.00,
    0.97 and 2.06, so clipping each part before the sum would train differently
    (the TensorFlow twin of this test fails when each replica clips its part).
    100 samples: the last batch of 4 is split 2/1/1; two epochs, so EMA,
    accumulation and the schedule cross epochs. Optimizer variables are compared
    too (slots, accumulators, EMA averages, the loss scale)."""
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(100, 8)) * 4).astype("float32")
    y = rng.integers(0, 3, size=(100,)).astype("int32")
    keras.utils.set_random_seed(3)
    initial = _clipped_dense().get_weights()
    for make_optimizer in _optimizer_feature_cases():
        strategy = _strategy("proportional", 3)
        results = []
        for scope in (strategy.scope(), contextlib.nullcontext()):
            with scope:
                model = _clipped_dense()
                model.compile(optimizer=make_optimizer(),
                              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            model.set_weights(initial)
            history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
            results.append((model, history.history["loss"]))
        (model, loss), (reference, ref_loss) = results
        name = type(model.optimizer).__name__
        assert strategy.plan.shares_for(BATCH) == [12, 6, 6], name
        assert strategy.adapter.last_run["in_sync"] is True, name
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, err_msg=name)
        _assert_same_weights(model, reference)
        ref_vars, got_vars = reference.optimizer.variables, model.optimizer.variables
        assert [v.name for v in got_vars] == [v.name for v in ref_vars], name
        # 10 steps; 3 updates applied with gradient accumulation over 3 steps.
        assert int(model.optimizer.iterations) == int(reference.optimizer.iterations) in (3, 10)
        for v, got, want in zip(ref_vars, got_vars, ref_vars):
            np.testing.assert_allclose(keras.ops.convert_to_numpy(got),
                                       keras.ops.convert_to_numpy(want), rtol=RTOL, atol=ATOL,
                                       err_msg=f"{name} {v.path}")
    assert not [w for w in recwarn if "differ" in str(w.message)]


@pytest.mark.parametrize("loss_scaled", [False, True], ids=["plain", "loss_scale"])
def test_a_callable_learning_rate_reaching_the_optimizer_trains_like_one_device(loss_scaled):
    """Keras allows a learning rate that is a function of no arguments. One that reads
    the optimizer (its iterations) made the workers' setup recurse without end (a raw
    RecursionError, as Keras's own model.save does); rank 0 now evaluates it and sends
    the value before every step, and the workers hold no function and no extra
    variable (also inside a LossScaleOptimizer)."""

    def compile_with_decay(model):
        inner = keras.optimizers.SGD(0.1)
        inner.learning_rate = lambda: 0.3 * 0.5 ** keras.ops.cast(inner.iterations, "float32")
        optimizer = keras.optimizers.LossScaleOptimizer(inner) if loss_scaled else inner
        model.compile(optimizer=optimizer,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    strategy = _strategy("proportional", 3)
    with strategy.scope():
        model = _build("mlp")
        compile_with_decay(model)
    x, y = _data("mlp")
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert strategy.adapter.last_run["in_sync"] is True
    reference = _build("mlp")
    compile_with_decay(reference)
    reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    _assert_same_weights(model, reference)
    # Still the user's function after fit, and it still decays.
    steps = int(reference.optimizer.iterations)
    assert float(model.optimizer.learning_rate) == pytest.approx(0.3 * 0.5 ** steps)


class _HalveWeights(keras.callbacks.Callback):
    """Writes rank 0's weights between epochs (as weight averaging or max-norm callbacks do)."""

    def on_epoch_end(self, epoch, logs=None):
        self.model.set_weights([w * 0.5 for w in self.model.get_weights()])


def test_weights_written_by_callbacks_between_steps_reach_every_worker(recwarn):
    """Callbacks run on rank 0 only; what they write goes to the workers before the
    next step, so training goes on from the same weights everywhere, and
    EarlyStopping's restored weights and ReduceLROnPlateau's last rate raise no
    'replicas differ' warning after fit."""
    import warnings

    def fit_kwargs():
        return {"epochs": 3, "callbacks": [
            _HalveWeights(),
            keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0,
                                              min_delta=10.0),
            # "max" on a falling loss: stops after the second epoch and restores the first's.
            keras.callbacks.EarlyStopping(monitor="loss", mode="max", patience=1,
                                          restore_best_weights=True)]}

    strategy = _strategy("even", 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model, history = _distributed("mlp", "sgd", strategy, fit_kwargs=fit_kwargs())
    assert strategy.adapter.last_run["in_sync"] is True
    reference, ref_history = _reference("mlp", "sgd", fit_kwargs=fit_kwargs())
    assert history.history["learning_rate"] == pytest.approx(ref_history.history["learning_rate"])
    np.testing.assert_allclose(history.history["loss"], ref_history.history["loss"], rtol=1e-5)
    _assert_same_weights(model, reference)


class _StopAtEpoch(keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError("interrupted on purpose")


def test_backup_and_restore_resumes_interrupted_training(tmp_path):
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    strategy = _strategy("proportional", 3)
    x, y = _data("mlp")
    with strategy.scope():
        model = _build("mlp")
        _compile(model, "adam")
    fit_kwargs = dict(batch_size=BATCH, epochs=3, shuffle=False, verbose=0)
    with pytest.raises(RuntimeError, match="interrupted on purpose"):
        model.fit(x, y, callbacks=[backup, _StopAtEpoch(2)], **fit_kwargs)
    # A fresh process would rebuild the model; the backup restores weights and
    # optimizer state and training resumes at epoch 2.
    with strategy.scope():
        resumed = _build("mlp", seed=7)
        _compile(resumed, "adam")
    history = resumed.fit(x, y, callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))],
                          **fit_kwargs)
    assert history.epoch == [2]
    reference, _ = _reference("mlp", "adam", fit_kwargs={"epochs": 3})
    _assert_same_weights(resumed, reference)


# ------------------------------------------------------------------ inputs
class _Sequence(keras.utils.PyDataset):
    def __init__(self, x, y):
        super().__init__()
        self.x, self.y = x, y

    def __len__(self):
        return (len(self.x) + BATCH - 1) // BATCH

    def __getitem__(self, i):
        s = slice(i * BATCH, (i + 1) * BATCH)
        return self.x[s], self.y[s]


@pytest.mark.parametrize("source", ["tf_data", "py_dataset", "torch_dataloader"])
def test_input_pipelines_are_split_by_share(source):
    x, y = _data("mlp")
    if source == "tf_data":
        tf = pytest.importorskip("tensorflow")
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    elif source == "py_dataset":
        data = _Sequence(x, y)
    else:
        import torch

        dataset = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y).long())
        data = torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=False)
    strategy = _strategy("proportional", 3)
    with strategy.scope():
        model = _build("mlp")
        _compile(model, "sgd")
    model.fit(data, epochs=1, verbose=0, shuffle=False)
    reference, _ = _reference_weights("mlp", "sgd")
    assert strategy.adapter.last_run["steps"] == 20
    _assert_same_weights(model, reference)


class _PaddedPerBatch(keras.utils.PyDataset):
    """Sequences padded per batch: the time length changes from batch to batch."""

    def __init__(self, x, y, batches):
        super().__init__()
        self.x, self.y, self.batches = x, y, batches  # [(rows, time length), ...]

    def __len__(self):
        return len(self.batches)

    def __getitem__(self, i):
        start = sum(rows for rows, _ in self.batches[:i])
        rows, length = self.batches[i]
        return self.x[start:start + rows, :length], self.y[start:start + rows, :length]


def _per_timestep_model():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((None, 4), name="steps_in")
    x = keras.layers.Conv1D(6, 3, padding="same", activation="relu", name="steps_conv")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2, activation="softmax", name="steps_out")(x))
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


@pytest.mark.parametrize("reverse", [False, True])
def test_predictions_whose_shape_changes_per_batch(reverse):
    """Per-timestep predictions of sequences padded per batch: rank 0 sized the
    workers' predictions from the first batch (a longer sequence later aborted
    the process inside gloo, a shorter one failed in the metrics). With the
    devices reversed rank 0 is the slower device and gets no row of the last,
    one-row batch, so it works out the shape with a forward pass of its own."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(73, 9, 4)).astype("float32")
    y = rng.integers(0, 2, size=(73, 9))
    batches = [(24, 5), (24, 7), (24, 4), (1, 9)]
    from autodist_keras import AutoStrategy
    from autodist_keras.devices import Cluster

    cluster = Cluster.cpu_testbed()
    devices = cluster.names[:2][::-1] if reverse else cluster.names[:2]
    strategy = AutoStrategy(strategy="proportional", cluster=cluster, devices=devices)
    with strategy.scope():
        model = _per_timestep_model()
    history = model.fit(_PaddedPerBatch(x, y, batches), epochs=2, verbose=0, shuffle=False)
    assert strategy.adapter.last_run["steps"] == 8 and strategy.adapter.last_run["in_sync"]
    if reverse:
        assert strategy.plan.shares_for(1)[0] == 0  # rank 0 had no row of the last batch
    reference = _per_timestep_model()
    expected = reference.fit(_PaddedPerBatch(x, y, batches), epochs=2, verbose=0, shuffle=False)
    _assert_same_weights(model, reference)
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(history.history[key], expected.history[key], rtol=1e-5)


def _head_without_loss():
    keras.utils.set_random_seed(4)
    inputs = keras.Input((16,), name="nl_in")
    hidden = keras.layers.Dense(16, activation="relu", name="nl_hidden")(inputs)
    model = keras.Model(inputs, {
        "cls": keras.layers.Dense(4, name="cls")(hidden),
        "aux": keras.layers.Dense(1, name="aux")(hidden),  # no loss: no gradient
    })
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9, weight_decay=0.1),
                  loss={"cls": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                        "aux": None})
    return model


@pytest.mark.parametrize("plan,transport", [("proportional", "shared_memory"),
                                            ("proportional", "gloo"), ("ps", "gloo")])
def test_variables_without_a_gradient_are_left_alone_by_the_optimizer(
        plan, transport, monkeypatch):
    """A head without a loss gets no gradient. Keras's step passes None for it,
    so weight decay and momentum leave it alone; the runtime passed zeros, and
    weight decay moved it. With 3 devices and a last batch of 2 samples one
    rank has no row at all (no gradient for anything) while the others have
    the hidden layer's."""
    if transport == "gloo":
        monkeypatch.setenv("AUTODIST_KERAS_TORCH_SHM_REDUCE", "0")
    x, y = _data("mlp")
    y_aux = np.zeros((len(x), 1), "float32")
    strategy = _strategy(plan, 3)
    with strategy.scope():
        model = _head_without_loss()
    initial = model.get_weights()
    with pytest.warns(UserWarning, match="Gradients do not exist for variables"):
        model.fit(x, {"cls": y, "aux": y_aux}, batch_size=BATCH, epochs=1, shuffle=False,
                  verbose=0)
    assert strategy.adapter.last_run["gradient_transport"] == transport
    assert strategy.adapter.last_run["in_sync"] is True
    reference = _head_without_loss()
    reference.fit(x, {"cls": y, "aux": y_aux}, batch_size=BATCH, epochs=1, shuffle=False,
                  verbose=0)
    _assert_same_weights(model, reference)
    paths = [v.path for v in model.weights]
    for name in ("aux/kernel", "aux/bias"):
        np.testing.assert_array_equal(model.get_weights()[paths.index(name)],
                                      initial[paths.index(name)])


class _TrainProbe(keras.callbacks.Callback):
    """Fits another model at each epoch's end (a linear probe), as users do; with
    `close`, its strategy's adapter is closed after each probe fit."""

    def __init__(self, probe, x, y, close=None):
        super().__init__()
        self.probe, self.x, self.y, self.close = probe, x, y, close

    def on_epoch_end(self, epoch, logs=None):
        self.probe.fit(self.x, self.y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        if self.close is not None:
            self.close.adapter.close()


def _outer_and_probe(outer_strategy, inner_strategy):
    """An outer model and a probe (seeds 1 and 2), compiled in the strategies' scopes
    (None: plain Keras)."""
    import contextlib

    models = []
    for seed, strategy in ((1, outer_strategy), (2, inner_strategy)):
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            model = _build("mlp", seed=seed)
            _compile(model, "sgd")
        models.append(model)
    return models


@pytest.mark.parametrize("same_strategy", [True, False])
def test_a_fit_inside_another_fit_on_the_same_number_of_devices(same_strategy):
    """A fit started from another fit's callback got the outer fit's busy
    workers, which failed with 'Rank 1 got an unknown command'; now it leases
    a pool of its own (kept for the next epoch's probe), and both models train
    as on one device."""
    x, y = _data("mlp", n=96)
    outer_strategy = _strategy("proportional", 2)
    inner_strategy = outer_strategy if same_strategy else _strategy("even", 2)
    outer, probe = _outer_and_probe(outer_strategy, inner_strategy)
    outer.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
              callbacks=[_TrainProbe(probe, x, y)])
    assert outer_strategy.adapter.last_run["in_sync"] is True
    outer_ref, probe_ref = _outer_and_probe(None, None)
    outer_ref.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                  callbacks=[_TrainProbe(probe_ref, x, y)])
    _assert_same_weights(outer, outer_ref)
    _assert_same_weights(probe, probe_ref)


def test_closing_a_strategy_inside_another_fit_leaves_that_fit_its_workers():
    """close() ended every pool, also the one the outer fit was using: the outer fit
    then failed with an AttributeError. Now the outer pool ends when its fit is done."""
    from autodist_keras.backends import torch_pool

    x, y = _data("mlp", n=96)
    outer_strategy, inner_strategy = _strategy("proportional", 2), _strategy("even", 2)
    outer, probe = _outer_and_probe(outer_strategy, inner_strategy)
    outer.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
              callbacks=[_TrainProbe(probe, x, y, close=inner_strategy)])
    assert outer_strategy.adapter.last_run["in_sync"] is True
    pids = outer_strategy.adapter.worker_pids()
    assert not any(p for ps in torch_pool._pools.values() for p in ps if p.pids == pids)
    for pid in pids.values():  # the outer fit's workers ended when it gave them back
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pid)
    outer_ref, probe_ref = _outer_and_probe(None, None)
    outer_ref.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                  callbacks=[_TrainProbe(probe_ref, x, y)])
    _assert_same_weights(outer, outer_ref)


class _ProbeMadeInCallback(keras.callbacks.Callback):
    """Makes a strategy (and its cpu_testbed cluster) inside the callback, as users
    write a probe, and fits a fresh model with it."""

    def __init__(self, x, y):
        super().__init__()
        self.x, self.y, self.losses = x, y, []

    def on_epoch_end(self, epoch, logs=None):
        strategy = _strategy("proportional", 3)
        with strategy.scope():
            probe = _build("mlp", seed=2)
            _compile(probe, "sgd")
        history = probe.fit(self.x, self.y, batch_size=BATCH, epochs=1, shuffle=False,
                            verbose=0)
        self.losses.append(history.history["loss"][0])


def test_a_cpu_testbed_made_during_a_fit_sees_every_core():
    """Rank 0 is pinned to its device's cores during fit: Cluster.cpu_testbed() in a
    callback refused the other cores ('Core 1 is not available to this process')."""
    x, y = _data("mlp", n=96)
    before = sorted(os.sched_getaffinity(0))
    strategy = _strategy("proportional", 2)
    with strategy.scope():
        outer = _build("mlp", seed=1)
        _compile(outer, "sgd")
    probe = _ProbeMadeInCallback(x, y)
    outer.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[probe])
    assert len(probe.losses) == 2 and strategy.adapter.last_run["in_sync"] is True
    assert sorted(os.sched_getaffinity(0)) == before


def _alive(pid):
    """Whether process `pid` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\tZ" not in next(line for line in f if line.startswith("State:"))
    except (OSError, StopIteration):
        return False


def test_strategies_with_other_timeouts_keep_their_own_workers():
    """Each timeout gets its pool (the groups' timeout is fixed when they are
    made); alternating fits no longer restart each other's workers."""
    x, y = _data("mlp", n=96)
    runs = []
    for timeout_s in (120, 150):
        strategy = _strategy("proportional", 2, timeout_s=timeout_s)
        with strategy.scope():
            model = _build("mlp")
            _compile(model, "sgd")
        runs.append((strategy, model))
    pids = []
    for _ in range(2):
        for strategy, model in runs:
            model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
            pids.append(strategy.adapter.worker_pids()[1])
    assert pids[0] == pids[2] and pids[1] == pids[3] and pids[0] != pids[1]


# ----------------------------------------------------------------- errors
def test_steps_per_execution_above_one_is_refused_as_keras_does():
    # Keras's torch trainer refuses it; the runtime's own train function must
    # too, or it would train on every other batch only.
    from autodist_keras.errors import BackendError

    strategy = _strategy("even", 2)
    with strategy.scope():
        model = _build("mlp")
        model.compile(optimizer="sgd", steps_per_execution=2,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data("mlp", n=48)
    with pytest.raises(BackendError, match="Received: steps_per_execution=2"):
        model.fit(x, y, batch_size=BATCH, verbose=0)


def test_a_shape_error_on_a_replica_says_its_shapes_count_the_replicas_rows():
    """Keras names the replica's rows (8 of 24 here), not the batch's: a note says so."""
    strategy = _strategy("even", 3)
    with strategy.scope():
        model = _build("mlp")
        _compile(model, "sgd")
    x, y = _data("mlp", n=48)
    model.fit(x, y, batch_size=BATCH, verbose=0)  # the workers are up
    wrong = np.zeros((48, 17), "float32")
    with pytest.raises(ValueError, match=r"found shape=\(8, 17\)") as caught:
        model.fit(wrong, y, batch_size=BATCH, verbose=0)
    notes = getattr(caught.value, "__notes__", None)
    if sys.version_info < (3, 11):
        assert notes is None  # exceptions have add_note from Python 3.11
    else:
        assert notes == [
            "autodist_keras: this replica computed 8 of the step's 24 rows (its share of "
            "the batch), so the shapes above count 8 rows where plain Keras would show 24."]


_LAMBDA_SCALE = 3.0


def test_lambda_layers_using_outside_names_are_refused_before_the_workers_start():
    """Keras saves a lambda's bytecode without its globals: the workers would fail
    with a misleading shape error. A lambda that needs nothing outside trains."""
    from autodist_keras.errors import BackendError

    x, y = _data("mlp", n=48)
    for function, ok in ((lambda t: t * 3.0, True),
                         (lambda t: keras.ops.square(t), False),
                         (lambda t: t * _LAMBDA_SCALE, False)):
        strategy = _strategy("even", 2)
        with strategy.scope():
            inputs = keras.Input((16,))
            model = keras.Model(inputs, keras.layers.Dense(4)(keras.layers.Lambda(function)(inputs)))
            _compile(model, "sgd")
        if ok:
            model.fit(x, y, batch_size=BATCH, verbose=0)
            assert strategy.adapter.last_run["in_sync"] is True
        else:
            with pytest.raises(BackendError, match="Lambda layer .* uses names from its surroundings"):
                model.fit(x, y, batch_size=BATCH, verbose=0)


def test_unregistered_custom_layer_is_a_clear_error():
    from autodist_keras.errors import BackendError

    class Unregistered(keras.layers.Layer):
        def call(self, inputs):
            return inputs * 2.0

    strategy = _strategy("even", 2)
    with strategy.scope():
        inputs = keras.Input((16,))
        model = keras.Model(inputs, keras.layers.Dense(4)(Unregistered()(inputs)))
        _compile(model, "sgd")
    x, y = _data("mlp", n=48)
    with pytest.raises(BackendError, match="Unregistered.*register_keras_serializable"):
        model.fit(x, y, batch_size=BATCH, verbose=0)


@keras.saving.register_keras_serializable(package="test_runtime_torch")
class ScaledSGD(keras.optimizers.SGD):
    """Registered, but its get_config() (SGD's) leaves out `grad_scale`."""

    def __init__(self, grad_scale=1.0, **kwargs):
        super().__init__(**kwargs)
        self.grad_scale = grad_scale

    def update_step(self, gradient, variable, learning_rate):
        super().update_step(gradient * self.grad_scale, variable, learning_rate)


def test_a_setting_whose_property_raises_is_not_compared():
    """A custom loss whose property named like a constructor argument raises until
    the loss is used: the check skips it instead of failing fit with that error."""
    from autodist_keras.backends.torch_session import _lost_settings

    class Lazy(keras.losses.Loss):
        def __init__(self, table=None, **kwargs):
            super().__init__(**kwargs)
            self._table = table

        @property
        def table(self):
            if self._table is None:
                raise RuntimeError("table not built yet")
            return self._table

        def call(self, y_true, y_pred):
            return keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1)

    keras.saving.register_keras_serializable(package="test_runtime_torch")(Lazy)
    assert _lost_settings(Lazy()) == []


def test_a_nan_optimizer_setting_is_not_seen_as_changed_at_every_step():
    """The settings watch (`torch_state_watch.OptimizerSettingsWatch`: the PyTorch
    runtime sends what changed, the TensorFlow runtime traces its step again)
    compared values with `==`, and NaN is unequal to itself: a callback that set
    a NaN setting again at each step (a new float object each time) made every
    step a change, and a setting that was NaN from the start was never watched,
    so a later change of it was missed. Real Keras optimizers, no training."""
    import math

    from autodist_keras.backends.torch_state_watch import OptimizerSettingsWatch

    optimizer = keras.optimizers.SGD(0.1, momentum=0.5)
    watch = OptimizerSettingsWatch(optimizer)
    optimizer.momentum = float("nan")  # a callback, between steps
    assert watch.moved_keys() == ["momentum"]
    changed = watch.changed()
    assert list(changed) == ["momentum"] and math.isnan(changed["momentum"])
    watch.mark()
    for _ in range(3):  # the callback sets it again at every step
        optimizer.momentum = float("nan")
        assert watch.moved_keys() == [] and watch.changed() == {}
        watch.mark()
    optimizer.momentum = 0.25
    assert watch.moved_keys() == ["momentum"] and watch.changed() == {"momentum": 0.25}

    from_start = keras.optimizers.SGD(0.1, momentum=float("nan"))
    watch = OptimizerSettingsWatch(from_start)
    assert "momentum" in watch.keys and watch.changed() == {}
    from_start.momentum = 0.5
    assert watch.changed() == {"momentum": 0.5}


def test_a_torchrun_rank_that_freezes_other_layers_than_rank_0_is_refused():
    """Under torchrun each rank builds and freezes its own model; rank 0's
    `trainable` flags go to spawned workers only. Two ranks freezing different
    layers of one shape (as many trainable variables) trained silently: each
    rank's gradients were added to the other's layer (a 2-rank launch: rank 0's
    frozen `a/kernel` and rank 1's `a/kernel` ended 7.058 and 6.684 apart in
    sum |w|, and only a warning after fit said the replicas differ). SETUP now
    compares the flags (`torch_session.check_trainable_flags`, run by `serve`
    for a rank's own model); checked here on real models, without a launch."""
    from autodist_keras.backends.torch_session import check_trainable_flags
    from autodist_keras.backends.torch_session import trainable_flags
    from autodist_keras.errors import BackendError

    def build(frozen):
        inputs = keras.Input((4,))
        a, b = keras.layers.Dense(4, name="a"), keras.layers.Dense(4, name="b")
        model = keras.Model(inputs, keras.layers.Dense(2, name="out")(b(a(inputs))))
        model.get_layer(frozen).trainable = False
        return model

    rank0 = trainable_flags(build("a"))
    check_trainable_flags(build("a"), rank0, rank=1)  # the same flags pass
    with pytest.raises(BackendError, match=r"Rank 1's model freezes other weights than rank "
                       r"0's.*'a/kernel' trainable=True.*'b/kernel' trainable=False"):
        check_trainable_flags(build("b"), rank0, rank=1)


@pytest.mark.parametrize("case", ["keras_huber", "custom_optimizer"])
def test_settings_a_config_does_not_keep_are_refused_before_training(case):
    """The workers rebuild the optimizer and losses from their configs: Keras's
    Huber(delta=0.25) trained with delta 1.0 there (loss 0.398 vs 0.191), silently,
    and an optimizer without its own get_config() trained with its default setting."""
    from autodist_keras.errors import BackendError

    strategy = _strategy("even", 2)
    with strategy.scope():
        inputs = keras.Input((16,))
        model = keras.Model(inputs, keras.layers.Dense(4)(inputs))
        if case == "keras_huber":
            model.compile(optimizer="sgd", loss=keras.losses.Huber(delta=0.25))
            expected = r"the loss .* does not keep delta=0.25 \(rebuilt: 1.0\).*Huber.get_config"
        else:
            model.compile(optimizer=ScaledSGD(grad_scale=3.0), loss="mse")
            expected = r"the optimizer .* does not keep grad_scale=3.0 .*ScaledSGD.get_config"
    x, _ = _data("mlp", n=48)
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(BackendError, match=expected):
        model.fit(x, np.zeros((48, 4), "float32"), batch_size=BATCH, verbose=0)
    for got, want in zip(model.get_weights(), before):
        np.testing.assert_array_equal(got, want)  # nothing trained


@keras.saving.register_keras_serializable(package="test_runtime_torch")
class WithoutConfig(keras.Model):
    """Registered, but its constructor takes an argument and it has no get_config()."""

    def __init__(self, hidden, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(hidden, activation="relu")
        self.out = keras.layers.Dense(4)

    def call(self, inputs):
        return self.out(self.hidden(inputs))


def test_a_model_without_config_is_a_clear_error():
    """Keras's bare NotImplementedError named serialization nobody asked for."""
    from autodist_keras.errors import BackendError

    strategy = _strategy("even", 2)
    with strategy.scope():
        model = WithoutConfig(8)
        _compile(model, "sgd")
    x, y = _data("mlp", n=48)
    with pytest.raises(BackendError, match="rebuilds the model in each spawned worker process.*"
                                           "Implement get_config"):
        model.fit(x, y, batch_size=BATCH, verbose=0)


@keras.saving.register_keras_serializable(package="test_runtime_torch")
class FunctionalWithOwnInit(keras.Model):
    """Registered, built the Functional way, with a constructor whose keyword
    catch-all is not named `kwargs`: Keras then passes the Functional config
    (layers, inputs, outputs) to the constructor, which refuses it."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)


def test_a_registered_model_its_config_cannot_rebuild_gets_the_get_config_advice():
    """The worker's error said to register the class, which was registered."""
    from autodist_keras.errors import WorkerError

    strategy = _strategy("even", 2)
    with strategy.scope():
        inputs = keras.Input((16,))
        model = FunctionalWithOwnInit(inputs, keras.layers.Dense(4)(inputs))
        _compile(model, "sgd")
    x, y = _data("mlp", n=48)
    with pytest.raises(WorkerError) as info:
        model.fit(x, y, batch_size=BATCH, verbose=0)
    message = str(info.value)
    assert "is registered, so its constructor did not accept the config" in message
    assert "give the class a get_config()" in message and " ..." in message


def test_an_adapted_lookup_layer_reaches_the_workers():
    # IntegerLookup keeps what adapt() learned in a table, neither config nor
    # variables: the workers get it as Keras's asset files (layer_assets).
    rng = np.random.default_rng(0)
    x = rng.integers(0, 20, size=(96, 4)).astype("int64")
    y = (x[:, 0] % 2).astype("float32")

    def build():
        lookup = keras.layers.IntegerLookup(output_mode="multi_hot", name="lookup")
        lookup.adapt(x)
        inputs = keras.Input((4,), dtype="int64")
        hidden = keras.layers.Dense(4, activation="relu", name="hidden")(lookup(inputs))
        model = keras.Model(inputs, keras.layers.Dense(1, name="out")(hidden))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return model

    keras.utils.set_random_seed(5)
    reference = build()
    initial = reference.get_weights()
    ref_history = reference.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    strategy = _strategy("proportional", 3)
    with strategy.scope():
        model = build()
    model.set_weights(initial)
    try:
        history = model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        assert strategy.adapter.last_run["in_sync"] is True
    finally:
        strategy.adapter.close()
    np.testing.assert_allclose(history.history["loss"], ref_history.history["loss"], rtol=RTOL)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def test_sum_reduction_loss_is_rejected():
    from autodist_keras.errors import BackendError

    strategy = _strategy("even", 2)
    with strategy.scope():
        model = _build("mlp")
        model.compile(optimizer="sgd",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum"))
    x, y = _data("mlp", n=48)
    with pytest.raises(BackendError, match="reduction='sum_over_batch_size'"):
        model.fit(x, y, batch_size=BATCH, verbose=0)


# ------------------------------------------------------- shard transport
def _mapped_files():
    """Paths this process maps (from /proc/self/maps, ' (deleted)' dropped)."""
    with open("/proc/self/maps") as f:
        return {line.split(None, 5)[5].strip().removesuffix(" (deleted)")
                for line in f if len(line.split(None, 5)) == 6}


def test_shards_by_shared_memory_and_by_message_give_the_same_weights(monkeypatch):
    """Spawned workers read their rows from shared-memory slots (torch_shm);
    AUTODIST_KERAS_TORCH_SHM=0 sends them as messages instead. Both match
    single-device training, and the run's file is gone from /dev/shm."""
    strategy = _strategy("proportional", 3)
    model, _ = _distributed("mlp", "adam", strategy)
    driver = strategy.adapter._run.driver
    assert driver._slots is not None and driver._use_shm
    _assert_same_weights(model, _reference_weights("mlp", "adam")[0])
    # This run's own file: under pytest-xdist another test's live file may exist.
    assert driver._slots.path.startswith("/dev/shm/autodist_keras_batch_")
    assert not os.path.exists(driver._slots.path)
    assert driver._slots.path not in _mapped_files()  # no space held after fit

    monkeypatch.setenv("AUTODIST_KERAS_TORCH_SHM", "0")
    strategy = _strategy("proportional", 3)
    model, _ = _distributed("mlp", "adam", strategy)
    assert strategy.adapter._run.driver._slots is None
    assert strategy.adapter.last_run["in_sync"] is True
    _assert_same_weights(model, _reference_weights("mlp", "adam")[0])


@pytest.mark.parametrize("plan,ndev", [("even", 3), ("ps", 2), ("ps", 3)])
def test_gradient_sums_through_shared_memory_and_through_gloo_give_the_same_weights(
        plan, ndev, monkeypatch):
    """Spawned CPU workers sum gradients in a shared file (torch_shm_reduce):
    all-reduce buckets slice by slice, PS buckets by the server alone.
    AUTODIST_KERAS_TORCH_SHM_REDUCE=0 sums them through gloo instead. Both
    match single-device training, the replicas end bit-identical, and the file
    is gone from /dev/shm once every rank mapped it."""
    strategy = _strategy(plan, ndev)
    model, _ = _distributed("mlp", "sgd", strategy)
    run = strategy.adapter.last_run
    assert run["gradient_transport"] == "shared_memory" and run["in_sync"] is True
    reducer = strategy.adapter._run.driver.trainer.reducer
    assert reducer.area is not None and reducer.area.world == ndev
    assert reducer.area.path.startswith("/dev/shm/autodist_keras_grads_")
    assert not os.path.exists(reducer.area.path)
    # A deleted file still takes /dev/shm space while mapped: fit ends its mapping,
    # also when the strategy is left to the garbage collector (it is alive here).
    assert reducer.area.path not in _mapped_files()
    if plan == "ps":
        assert {b.kind for b in reducer.buckets} == {"ps"}
    reference = _reference_weights("mlp", "sgd")[0]
    _assert_same_weights(model, reference)

    monkeypatch.setenv("AUTODIST_KERAS_TORCH_SHM_REDUCE", "0")
    strategy = _strategy(plan, ndev)
    model_gloo, _ = _distributed("mlp", "sgd", strategy)
    run = strategy.adapter.last_run
    assert run["gradient_transport"] == "gloo" and run["in_sync"] is True
    assert strategy.adapter._run.driver.trainer.reducer.area is None
    _assert_same_weights(model_gloo, reference)


def test_pack_into_writes_the_pack_layout():
    import torch

    from autodist_keras.backends import torch_transport as tt

    leaves = [torch.arange(15, dtype=torch.float32).reshape(5, 3),
              torch.tensor([True, False, True, True, False]),
              torch.arange(5, dtype=torch.int64)]
    metas = [tt.leaf_meta(t) for t in leaves]
    buffer = torch.zeros(tt.packed_size(metas, rows=5) + 16, dtype=torch.uint8)
    assert tt.pack_into(buffer, leaves, start=2) == tt.packed_size(metas, rows=5)
    out = tt.unpack(buffer, metas, rows=5)
    for got, want in zip(out, leaves):
        assert got.dtype == want.dtype
        assert torch.equal(got[2:], want[2:])
        assert not got[:2].any()  # rows before `start` are not written
    # Each tensor is one of its own, sharing the buffer's memory: an in-place op on
    # one (Keras's masked losses scale sample_weight in place) leaves the others'
    # autograd version alone, and a change of the buffer shows in them.
    empty = tt.unpack(torch.zeros(0, dtype=torch.uint8), [["float32", [0]]], rows=2)
    assert empty[0].shape == (2, 0)  # zero-size leaves (a review found they raised)
    versions = [t._version for t in out]
    out[2].mul_(2)
    assert [t._version for t in out[:2]] == versions[:2]
    buffer[:4] = 255
    assert out[0].view(-1)[0].isnan() or out[0].view(-1)[0] != 0


def test_one_replica_plan_runs_keras_own_train_function():
    """A one-replica plan plans at the first step, then hands Keras's loop
    Keras's own train function; weights equal plain Keras bit for bit, and a
    second fit plans again through the adapter."""
    from autodist_keras import AutoStrategy
    from autodist_keras.devices import Cluster

    strategy = AutoStrategy(strategy="single_device", cluster=Cluster.detect())  # no pinning
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(getattr(self.model.train_function, "__name__", None))

    model, _ = _distributed("mlp", "sgd", strategy, fit_kwargs={"callbacks": [Record()]})
    assert strategy.adapter.last_run["mode"] == "local"
    assert seen[0] == "one_step_on_data" and set(seen) == {"one_step_on_data"}
    assert model.train_function is None
    reference, _ = _reference("mlp", "sgd")
    for wa, we in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_array_equal(wa, we)
    model.fit(*_data("mlp", n=48), batch_size=BATCH, epochs=1, verbose=0)
    assert strategy.adapter.last_run["mode"] == "local"


@keras.saving.register_keras_serializable(package="test_runtime_torch")
class RowCounter(keras.layers.Layer):
    """Counts the rows it has seen while training, in an int32 variable."""

    def build(self, input_shape):
        self.rows = self.add_weight(shape=(), dtype="int32", initializer="zeros",
                                    trainable=False, name="rows")

    def call(self, inputs, training=False):
        if training:
            self.rows.assign_add(keras.ops.cast(keras.ops.shape(inputs)[0], "int32"))
        return inputs


def test_replicas_that_differ_are_named_with_the_reason():
    strategy = _strategy("proportional", 3)
    with strategy.scope():
        inputs = keras.Input((16,))
        model = keras.Model(inputs, keras.layers.Dense(4)(RowCounter(name="counter")(inputs)))
        _compile(model, "sgd")
    x, y = _data("mlp", n=48)
    try:
        with pytest.warns(UserWarning, match=r"values of \['counter/rows'\] differ\. These are "
                                             "non-trainable variables"):
            model.fit(x, y, batch_size=BATCH, verbose=0, shuffle=False)
    finally:
        strategy.adapter.close()
    assert strategy.adapter.last_run["in_sync"] is False


def test_a_layer_with_bfloat16_variables_trains_and_ends_fit_in_sync():
    """fit's end-of-fit check hashed each variable through NumPy, which has no
    bfloat16: 'Got unsupported ScalarType BFloat16' after the last step, no History."""
    strategy = _strategy("proportional", 3)
    x, y = _data("mlp", n=48)
    with strategy.scope():
        inputs = keras.Input((x.shape[1],))
        hidden = keras.layers.Dense(8, dtype="bfloat16", name="half")(inputs)
        model = keras.Model(inputs, keras.layers.Dense(int(y.max()) + 1, name="logits")(hidden))
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert model.get_layer("half").kernel.dtype == "bfloat16"
    assert len(history.history["loss"]) == 1
    assert strategy.adapter.last_run["in_sync"] is True


# ------------------------------------------------------------- lifetimes
def test_the_strategy_does_not_keep_the_last_fitted_model_alive():
    """As the README says, a strategy holds its models weakly: after a good
    fit, `del model` frees the model (the adapter's last run kept it, its
    optimizer state and the run's buffers). The run stays readable while its
    model lives."""
    import gc
    import weakref

    strategy = _strategy("proportional", 3)
    x, y = _data("mlp", n=96)
    models = []
    for _ in range(2):
        with strategy.scope():
            model = _build("mlp")
            _compile(model, "sgd")
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        models.append(weakref.ref(model))
        assert strategy.adapter._run.driver.model is model
        del model
    gc.collect()
    assert [ref() for ref in models] == [None, None]
    assert strategy.adapter._run is None
    assert strategy.adapter.last_run["in_sync"] is True


def test_idle_workers_of_at_most_two_timeouts_are_kept():
    """A search that gives each trial its own timeout_s kept every trial's
    workers until exit. Idle pools of the two timeouts used last are kept per
    world size (alternating two strategies stays fast); a third timeout ends
    the idle workers of the least recently used one."""
    from autodist_keras.backends import torch_pool

    x, y = _data("mlp", n=48)
    pids = {}
    for timeout_s in (121, 122, 123, 122):
        strategy = _strategy("proportional", 2, timeout_s=timeout_s)
        with strategy.scope():
            model = _build("mlp")
            _compile(model, "sgd")
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        pids.setdefault(timeout_s, []).append(strategy.adapter.worker_pids()[1])
    assert pids[122][0] == pids[122][1]  # the second fit with 122 s reused its workers
    deadline = time.monotonic() + 10
    while _alive(pids[121][0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pids[121][0])
    assert _alive(pids[122][0]) and _alive(pids[123][0])
    with torch_pool._pools_lock:
        kept = [key for key, pools in torch_pool._pools.items() if key[:2] == (2, "gloo") and pools]
    assert len(kept) <= 2


@keras.saving.register_keras_serializable(package="test_runtime_torch")
class _ForwardCounter(keras.layers.Layer):
    """Counts its calls in the process it runs in (rank 0: the test's)."""

    calls = 0

    def call(self, x):
        type(self).calls += 1
        return x


def test_a_later_fit_of_the_same_compiled_model_skips_the_model_checks():
    """The pre-step model checks (several forward passes: 18 s of a ResNet50
    fit's first step on this CPU) ran at every fit. They run again only when
    the model is compiled again, a layer is frozen or the plan changes."""
    strategy = _strategy("even", 2)
    with strategy.scope():
        keras.utils.set_random_seed(1)
        inputs = keras.Input((16,))
        hidden = _ForwardCounter()(keras.layers.Dense(8)(inputs))
        model = keras.Model(inputs, keras.layers.Dense(4)(hidden))
        _compile(model, "sgd")
    x, y = _data("mlp", n=48)  # two steps of 24

    def forward_calls():
        _ForwardCounter.calls = 0
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        return _ForwardCounter.calls

    first, second = forward_calls(), forward_calls()
    assert second == 2  # rank 0's replica, once per step
    assert first > second  # the probes ran before the first fit's first step
    with strategy.scope():
        _compile(model, "sgd")
    assert forward_calls() > 2  # compiled again: checked again
