"""The TensorFlow runtime in one process: distributed model.fit matches single-device training.

Replicas run on the logical CPU devices tests/conftest.py creates (4 of
them). Every distributed run is compared with plain Keras training of the
same model, from the same initial weights, on the same batches
(shuffle=False). The global batch is 24; an epoch is 20 steps (480 samples),
and the sample-weight test uses 476 samples so that its last batch (20
samples) is split with `plan.shares_for(20)`.

Known exceptions to exact agreement, tested for what does hold:
- BatchNormalization in training mode normalises each replica with its own
  batch statistics; the CNN tests freeze BN (inference mode), and a separate
  test uses batches whose replica slices have identical statistics.
- Under Adam, a variable whose true gradient is exactly zero (the attention
  key bias: softmax ignores a constant shift of the scores) is driven by
  float rounding noise, which Adam normalises to steps of order lr; its
  values are compared with a looser absolute tolerance.
"""

import contextlib
import os
import warnings

import keras
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow",
    reason="TensorFlow runtime tests run under KERAS_BACKEND=tensorflow",
)

BATCH = 24
SAMPLES = 480  # 20 full batches
PARTIAL_SAMPLES = 476  # 19 full batches + one of 20
RTOL, ATOL = 1e-5, 1e-6
ZERO_GRADIENT_ATOL = 1e-3  # Adam on a zero-true-gradient variable (see module docstring)


# ------------------------------------------------------------------ models
def _mlp():
    # The regularisers check that model.losses count once over the replicas: a weight
    # regulariser (the same on every replica) and an activity regulariser (added with
    # add_loss during each replica's forward pass).
    inputs = keras.Input((8,), name="mlp_input")
    x = keras.layers.Dense(32, activation="relu", name="mlp_dense0",
                           kernel_regularizer=keras.regularizers.L2(1e-3))(inputs)
    outputs = keras.layers.Dense(3, name="mlp_logits",
                                 activity_regularizer=keras.regularizers.L2(1e-2))(x)
    return keras.Model(inputs, outputs, name="mlp")


def _cnn(freeze_bn=True):
    from autodist_keras.graph import zoo

    model = zoo.small_cnn(input_shape=(6, 6, 2), filters=(4, 4), num_classes=3)
    if freeze_bn:
        for layer in model.layers:
            if isinstance(layer, keras.layers.BatchNormalization):
                layer.trainable = False  # inference mode: per-replica = global statistics
    return model


def _transformer():
    from autodist_keras.graph import zoo

    return zoo.transformer_encoder(num_layers=1, d_model=8, heads=2, seq_len=4, vocab=20,
                                   num_classes=3)


MODELS = {"mlp": _mlp, "cnn": _cnn, "transformer": _transformer}


def _data(name, samples=SAMPLES, seed=0):
    rng = np.random.default_rng(seed)
    if name == "mlp":
        x = rng.normal(size=(samples, 8)).astype("float32")
    elif name == "cnn":
        x = rng.normal(size=(samples, 6, 6, 2)).astype("float32")
    else:
        x = rng.integers(0, 20, size=(samples, 4)).astype("int32")
    y = rng.integers(0, 3, size=(samples,)).astype("int32")
    return x, y


def _optimizer(name):
    if name == "sgd":
        return keras.optimizers.SGD(learning_rate=0.1, momentum=0.5)
    return keras.optimizers.Adam(learning_rate=1e-2)


def _compile(model, optimizer, loss=None):
    model.compile(
        optimizer=_optimizer(optimizer),
        loss=loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )


def _initial_weights(name):
    keras.utils.set_random_seed(7)
    return MODELS[name]().get_weights()


_REFERENCE = {}


def _reference(name, optimizer):
    """Plain single-device Keras training (cached per worker)."""
    key = (name, optimizer)
    if key not in _REFERENCE:
        model = MODELS[name]()
        model.set_weights(_initial_weights(name))
        _compile(model, optimizer)
        x, y = _data(name)
        history = model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        _REFERENCE[key] = (model.get_weights(), history.history, [w.path for w in model.weights])
    return _REFERENCE[key]


def _strategy(plan_name, **options):
    from autodist_keras import AutoStrategy
    from autodist_keras.devices import Cluster

    cluster = Cluster.cpu_testbed()
    if plan_name == "even2":
        return AutoStrategy("data_parallel", cluster=cluster,
                            devices=["node0/cpu0", "node0/cpu1"], **options)
    if plan_name == "prop3":
        return AutoStrategy("proportional", cluster=cluster, **options)
    if plan_name == "ps3":
        return AutoStrategy("data_parallel", cluster=cluster, sync="ps",
                            ps_server="node0/cpu2", **options)
    raise ValueError(plan_name)


def _distributed(name, optimizer, strategy, build=None):
    with strategy.scope():
        model = (build or MODELS[name])()
        _compile(model, optimizer)
    model.set_weights(_initial_weights(name))
    return model


def _assert_weights_match(paths, expected, actual, optimizer):
    assert len(expected) == len(actual)
    for path, want, got in zip(paths, expected, actual):
        atol = ATOL
        if optimizer == "adam" and path.endswith("attention/key/bias"):
            atol = ZERO_GRADIENT_ATOL
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=atol, err_msg=path)


# --------------------------------------------------------------- equality
CASES = [
    ("mlp", "even2", "sgd"), ("mlp", "even2", "adam"),
    ("mlp", "prop3", "sgd"), ("mlp", "prop3", "adam"),
    ("mlp", "ps3", "sgd"), ("mlp", "ps3", "adam"),
    ("cnn", "even2", "sgd"), ("cnn", "prop3", "adam"), ("cnn", "ps3", "sgd"),
    ("transformer", "even2", "adam"), ("transformer", "prop3", "sgd"),
    ("transformer", "ps3", "adam"),
]


@pytest.mark.parametrize("name,plan_name,optimizer", CASES)
def test_weights_match_single_device(name, plan_name, optimizer):
    expected, ref_history, paths = _reference(name, optimizer)
    strategy = _strategy(plan_name)
    model = _distributed(name, optimizer, strategy)
    x, y = _data(name)
    history = model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)

    plan = strategy.plan
    want_devices = {"even2": 2, "prop3": 3, "ps3": 3}[plan_name]
    assert len(plan.replicas) == want_devices
    if plan_name == "prop3":
        assert plan.shares_for(BATCH) == [12, 6, 6]  # cpu0 owns a core, cpu1/cpu2 share one
    if plan_name == "ps3":
        assert {s.method for s in plan.sync.values()} == {"ps"}
        assert strategy.adapter.home == "/CPU:2"  # variables live on the server
        assert "CPU:2" in model.trainable_variables[0].value.device
    _assert_weights_match(paths, expected, model.get_weights(), optimizer)
    # Logged loss and metrics are global: they equal the single-device ones.
    np.testing.assert_allclose(history.history["loss"], ref_history["loss"], rtol=1e-5)
    np.testing.assert_allclose(history.history["accuracy"], ref_history["accuracy"], rtol=1e-6)


@pytest.mark.parametrize(
    "bucket_bytes,algorithm,buckets",
    [(0, "tree", 4), (1024, "ring", 2), (25 * 1024 * 1024, "hierarchical", 1)],
)
def test_fusion_buckets_give_same_weights(bucket_bytes, algorithm, buckets):
    expected, _, paths = _reference("mlp", "adam")
    strategy = _strategy("prop3", bucket_bytes=bucket_bytes, algorithm=algorithm)
    model = _distributed("mlp", "adam", strategy)
    x, y = _data("mlp")
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    # mlp variables: kernel 8x32 (1024 B), bias 32 (128 B), kernel 32x3 (384 B), bias 3 (12 B);
    # buckets fill from the last layer: 1 KB gives [logits bias+kernel, dense0 bias], [dense0 kernel]
    assert len(strategy.plan.buckets) == buckets
    assert {s.algorithm for s in strategy.plan.sync.values()} == {algorithm}
    assert strategy.adapter.runtime_info["buckets"] == buckets
    _assert_weights_match(paths, expected, model.get_weights(), "adam")


def test_batchnorm_training_mode_with_identical_replica_statistics():
    """BN in training mode matches when every replica's slice has the global statistics.

    Each global batch is one block of 6 samples repeated 4 times; the plan's
    shares (12, 6, 6) are multiples of 6, so every replica's batch mean and
    variance equal the global ones. Weights and moving statistics must then
    match single-device training exactly, which checks that the replicas'
    moving-statistic updates are combined once per step (share-weighted),
    not applied once per replica.
    """
    rng = np.random.default_rng(3)
    blocks = rng.normal(size=(20, 6, 6, 6, 2)).astype("float32")
    x = np.concatenate([np.concatenate([b] * 4) for b in blocks])  # 480 samples
    y = rng.integers(0, 3, size=(480,)).astype("int32")
    keras.utils.set_random_seed(7)
    initial = _cnn(freeze_bn=False).get_weights()

    reference = _cnn(freeze_bn=False)
    reference.set_weights(initial)
    _compile(reference, "sgd")
    reference.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)

    strategy = _strategy("prop3")
    with strategy.scope():
        model = _cnn(freeze_bn=False)
        _compile(model, "sgd")
    model.set_weights(initial)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    assert strategy.plan.shares_for(BATCH) == [12, 6, 6]
    moving = [w.path for w in model.weights if "moving" in w.path]
    assert len(moving) == 4
    for w, want, got in zip(model.weights, reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=w.path)


# ------------------------------------------------------------- fit features
class _StopAtEpoch(keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError("interrupted on purpose")


def test_fit_features_save_and_callbacks(tmp_path):
    """validation_data, class_weight, steps_per_epoch, callbacks, save/load, evaluate, predict."""
    x, y = _data("mlp", samples=10 * BATCH)  # each epoch is the whole data set: 10 steps
    xv, yv = _data("mlp", samples=50, seed=1)
    class_weight = {0: 1.0, 1: 2.0, 2: 0.5}
    fit_args = dict(batch_size=BATCH, epochs=2, steps_per_epoch=10, shuffle=False, verbose=0,
                    validation_data=(xv, yv), class_weight=class_weight)

    reference = _mlp()
    reference.set_weights(_initial_weights("mlp"))
    _compile(reference, "adam")
    ref_history = reference.fit(x, y, **fit_args)

    strategy = _strategy("prop3")
    model = _distributed("mlp", "adam", strategy)
    # First attempt dies at the start of epoch 1; BackupAndRestore resumes it there.
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    with pytest.raises(RuntimeError, match="on purpose"):
        model.fit(x, y, callbacks=[backup, _StopAtEpoch(1)], **fit_args)
    checkpoint_path = str(tmp_path / "best.keras")
    checkpoint = keras.callbacks.ModelCheckpoint(checkpoint_path, monitor="val_loss")
    seen = []
    logger = keras.callbacks.LambdaCallback(on_epoch_begin=lambda epoch, logs: seen.append(epoch))
    history = model.fit(x, y, callbacks=[backup, checkpoint, logger], **fit_args)
    assert seen == [1]  # resumed at epoch 1
    # explain() says the one-process run is not the pinned testbed step it predicted.
    assert strategy.measured["step_time_s"] > 0
    assert "about the measurement: TensorFlow drove the testbed devices" in strategy.explain()
    for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
        np.testing.assert_allclose(history.history[key], ref_history.history[key][1:],
                                   rtol=1e-5, err_msg=key)
    _assert_weights_match([w.path for w in model.weights], reference.get_weights(),
                          model.get_weights(), "adam")

    # evaluate and predict run distributed over the plan's replicas.
    np.testing.assert_allclose(model.evaluate(xv, yv, batch_size=BATCH, verbose=0),
                               reference.evaluate(xv, yv, batch_size=BATCH, verbose=0),
                               rtol=1e-5)
    expected = reference.predict(xv, batch_size=BATCH, verbose=0)
    np.testing.assert_allclose(model.predict(xv, batch_size=BATCH, verbose=0), expected,
                               rtol=1e-5, atol=1e-6)

    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_allclose(loaded.predict(xv, verbose=0), expected, rtol=1e-5, atol=1e-6)
    assert os.path.exists(checkpoint_path)
    restored = keras.models.load_model(checkpoint_path)
    np.testing.assert_allclose(restored.predict(xv, verbose=0), expected, rtol=1e-5, atol=1e-6)


def test_sample_weight_and_last_partial_batch():
    x, y = _data("mlp", samples=PARTIAL_SAMPLES)
    sample_weight = np.random.default_rng(5).uniform(0.1, 2.0, size=len(x)).astype("float32")
    reference = _mlp()
    reference.set_weights(_initial_weights("mlp"))
    _compile(reference, "sgd")
    reference.fit(x, y, sample_weight=sample_weight, batch_size=BATCH, shuffle=False, verbose=0)

    strategy = _strategy("prop3")
    model = _distributed("mlp", "sgd", strategy)
    model.fit(x, y, sample_weight=sample_weight, batch_size=BATCH, shuffle=False, verbose=0)
    assert strategy.plan.shares_for(PARTIAL_SAMPLES % BATCH) == [10, 5, 5]
    _assert_weights_match([w.path for w in model.weights], reference.get_weights(),
                          model.get_weights(), "sgd")


class _Batches(keras.utils.PyDataset):
    def __init__(self, x, y):
        super().__init__()
        self.x, self.y = x, y

    def __len__(self):
        return -(-len(self.x) // BATCH)

    def __getitem__(self, i):
        s = slice(i * BATCH, (i + 1) * BATCH)
        return self.x[s], self.y[s]


@pytest.mark.parametrize("kind", ["tf.data", "PyDataset"])
def test_dataset_inputs_are_split_by_share(kind):
    import tensorflow as tf

    expected, _, paths = _reference("mlp", "sgd")
    x, y = _data("mlp")
    data = (tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH) if kind == "tf.data"
            else _Batches(x, y))
    strategy = _strategy("prop3")
    model = _distributed("mlp", "sgd", strategy)
    model.fit(data, shuffle=False, verbose=0)
    _assert_weights_match(paths, expected, model.get_weights(), "sgd")


def test_sparse_inputs_are_split_by_rows():
    import tensorflow as tf

    rng = np.random.default_rng(0)
    dense = rng.normal(size=(60, 8)).astype("float32")
    x = tf.sparse.from_dense(dense * (dense > 0.5))
    y = rng.integers(0, 3, size=(60,))

    def build():
        keras.utils.set_random_seed(3)
        inputs = keras.Input((8,), sparse=True)
        model = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(inputs))
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        return model

    reference = build()
    ref_history = reference.fit(x, y, batch_size=12, shuffle=False, verbose=0)
    strategy = _strategy("prop3")
    with strategy.scope():
        model = build()
    history = model.fit(x, y, batch_size=12, shuffle=False, verbose=0)
    assert len(strategy.plan.replicas) == 3
    np.testing.assert_allclose(history.history["loss"], ref_history.history["loss"], rtol=1e-5)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def test_per_output_losses_of_evaluate_before_fit_weigh_batches_by_size():
    """Before a plan exists evaluate runs one device; a short last batch counts by its
    size in the per-output loss metrics, as in the planned steps and eager Keras
    (a trace with a relaxed batch dimension used to count it as a full batch)."""
    rng = np.random.default_rng(0)
    x = {"a": rng.normal(size=(40, 5)).astype("float32")}
    y = {"cls": rng.integers(0, 3, size=(40,)), "reg": rng.normal(size=(40, 1)).astype("float32")}

    def build(run_eagerly=False):
        keras.utils.set_random_seed(3)
        a = keras.Input((5,), name="a")
        h = keras.layers.Dense(8, activation="relu")(a)
        model = keras.Model({"a": a}, {"cls": keras.layers.Dense(3, activation="softmax",
                                                                 name="cls")(h),
                                       "reg": keras.layers.Dense(1, name="reg")(h)})
        model.compile(optimizer="sgd", run_eagerly=run_eagerly,
                      loss={"cls": "sparse_categorical_crossentropy", "reg": "mse"})
        return model

    truth = build(run_eagerly=True).evaluate(x, y, batch_size=9, verbose=0, return_dict=True)
    strategy = _strategy("prop3")
    with strategy.scope():
        model = build()
    got = model.evaluate(x, y, batch_size=9, verbose=0, return_dict=True)
    for key in ("loss", "cls_loss", "reg_loss"):
        assert got[key] == pytest.approx(truth[key], rel=1e-5), key


# ------------------------------------------------------------------ errors
def test_too_few_logical_devices_is_a_backend_error():
    import tensorflow as tf

    from autodist_keras import AutoStrategy
    from autodist_keras import BackendError
    from autodist_keras.devices import Cluster

    tf.constant(1.0) + 1.0  # TensorFlow is now initialised with conftest's 4 devices
    cluster = Cluster.cpu_testbed([{"cores": [0], "threads": 1, "count": 5}])
    with pytest.raises(BackendError, match="before building models or running any TensorFlow op") as info:
        AutoStrategy("data_parallel", cluster=cluster).adapter
    assert "Received: 4 logical CPU device(s)" in str(info.value)


def test_plan_on_missing_gpus_is_a_backend_error():
    from autodist_keras import AutoStrategy
    from autodist_keras import BackendError

    strategy = AutoStrategy("data_parallel", cluster="2xV100")
    assert strategy.adapter.cluster_is_here() is False  # planning for it still works
    with strategy.scope():  # (it raised here, naming a replica before any plan existed)
        inputs = keras.Input((8,))
        model = keras.Model(inputs, keras.layers.Dense(3)(inputs))
        model.compile(optimizer="sgd", loss="mse")
    x, y = _data("mlp")
    with pytest.raises(BackendError, match=r"node0/gpu0.*0 GPU\(s\)"):
        model.fit(x, keras.utils.to_categorical(y, 3), batch_size=16, verbose=0)


def test_custom_train_step_and_sum_loss_are_rejected():
    from autodist_keras import BackendError

    class Custom(keras.Model):
        def train_step(self, data):
            return super().train_step(data)

    x, y = _data("mlp")
    strategy = _strategy("even2")
    with strategy.scope():
        inputs = keras.Input((8,))
        model = Custom(inputs, keras.layers.Dense(3)(inputs))
        _compile(model, "sgd")
    with pytest.raises(BackendError, match="overrides train_step"):
        model.fit(x, y, batch_size=BATCH, verbose=0)

    strategy = _strategy("even2")
    with strategy.scope():
        model = _mlp()
        _compile(model, "sgd", loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="sum"))
    with pytest.raises(BackendError, match="reduction='sum'"):
        model.fit(x, y, batch_size=BATCH, verbose=0)


def test_a_float64_model_with_thirds_for_shares_is_exact():
    """Shares of a third: each replica's loss weight went through tf.cast of a Python
    float, which TensorFlow makes a float32 first, so float64 gradients were 3e-8
    relative off (6.6e-9 absolute after one step); now 1e-15."""
    from autodist_keras import AutoStrategy
    from autodist_keras.devices import Cluster

    from keras.src.backend.common import global_state

    # (A global policy set earlier would win over floatx; reading it with
    # keras.config.dtype_policy() would pin one, so the raw setting is kept.)
    previous = keras.config.floatx()
    policy = global_state.get_global_attribute("dtype_policy", None)
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    try:
        rng = np.random.default_rng(0)
        x, y = rng.normal(size=(48, 8)), rng.integers(0, 3, size=(48,)).astype("int32")
        cluster = Cluster.cpu_testbed()
        strategy = AutoStrategy("data_parallel", cluster=cluster, devices=cluster.names[:3])
        models = []
        for scope in (strategy.scope(), contextlib.nullcontext()):
            with scope:
                keras.utils.set_random_seed(1)
                inputs = keras.Input((8,))
                hidden = keras.layers.Dense(16, activation="relu")(inputs)
                model = keras.Model(inputs, keras.layers.Dense(3)(hidden))
                model.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.
                              SparseCategoricalCrossentropy(from_logits=True))
            models.append(model)
        models[1].set_weights(models[0].get_weights())
        for model in models:
            model.fit(x, y, batch_size=24, epochs=2, shuffle=False, verbose=0)
        assert [r.batch_share for r in strategy.plan.replicas] == [8, 8, 8]
        for got, want in zip(models[0].get_weights(), models[1].get_weights()):
            assert got.dtype == np.float64
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-13)
    finally:
        keras.config.set_floatx(previous)
        global_state.set_global_attribute("dtype_policy", policy)


# ------------------------------------------------ state assigned in inference mode
def _stateful_rnn():
    inputs = keras.Input((6, 4), batch_size=BATCH, name="st_x")
    hidden = keras.layers.LSTM(4, stateful=True, name="st_rnn")(inputs)
    return keras.Model(inputs, keras.layers.Dense(3, name="st_out")(hidden), name="st_model")


def _fit_evaluate_predict_fit(model, layer, x, y, xv, yv):
    """fit with validation_data, evaluate, predict, fit again: what each gave, the
    weights and the state of layer `layer` (a stateful RNN's states, else its
    non-trainable variables)."""
    first = model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0,
                      validation_data=(xv, yv))
    evaluate = model.evaluate(xv, yv, batch_size=BATCH, verbose=0)
    predict = model.predict(xv, batch_size=BATCH, verbose=0)
    second = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    layer = model.get_layer(layer)
    state = [keras.ops.convert_to_numpy(v) for v in (
        layer.states if getattr(layer, "stateful", False) else layer.non_trainable_variables)]
    return dict(first=first.history, evaluate=evaluate, predict=predict, second=second.history,
                weights=model.get_weights(), state=state)


def _assert_same_run(got, want):
    for key in want["first"]:
        np.testing.assert_allclose(got["first"][key], want["first"][key], rtol=1e-5, err_msg=key)
    np.testing.assert_allclose(got["evaluate"], want["evaluate"], rtol=1e-5)
    np.testing.assert_allclose(got["predict"], want["predict"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["second"]["loss"], want["second"]["loss"], rtol=1e-5)
    for a, b in zip(got["weights"], want["weights"]):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)
    assert len(got["state"]) == len(want["state"])
    for a, b in zip(got["state"], want["state"]):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("plan_name", ["single_device", "fastt"])
def test_stateful_rnn_state_goes_on_through_evaluate_predict_and_validation(plan_name):
    """Keras's test and predict steps assign what the forward pass assigns, so a
    stateful RNN's state moves on in validation, evaluate and predict. The adapter's
    test step kept only metrics and its predict step nothing: with validation_data the
    second epoch's loss was 1.134008 against plain Keras's 1.133006, and a predict
    after evaluate 0.06 off. (FastT runs this model whole on one device.)"""
    from autodist_keras import AutoStrategy
    from autodist_keras.devices import Cluster

    strategy = AutoStrategy(plan_name, cluster=Cluster.cpu_testbed())
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 6, 4)).astype("float32")
    y = rng.integers(0, 3, size=(96,)).astype("int32")
    xv, yv = x[:48], y[:48]
    keras.utils.set_random_seed(1)
    initial = _stateful_rnn().get_weights()
    runs = []
    for scope in (strategy.scope(), contextlib.nullcontext()):
        with scope:
            model = _stateful_rnn()
            _compile(model, "sgd")
        model.set_weights(initial)
        runs.append(_fit_evaluate_predict_fit(model, "st_rnn", x, y, xv, yv))
    assert [len(g.replicas) for g in strategy.plan.groups] == [1]
    _assert_same_run(*runs)


class _InferenceState(keras.layers.Layer):
    """Counts its calls (a float and an integer counter) and keeps a moving average of
    its input's per-feature batch mean, in training and in inference alike."""

    def build(self, shape):
        self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False,
                                     name="calls")
        self.steps = self.add_weight(shape=(), initializer="zeros", dtype="int32",
                                     trainable=False, name="steps")
        self.moving = self.add_weight(shape=(shape[-1],), initializer="zeros",
                                      trainable=False, name="moving")

    def call(self, x):
        self.calls.assign(self.calls + 1.0)
        self.steps.assign(self.steps + 1)
        self.moving.assign(0.9 * self.moving + 0.1 * keras.ops.mean(x, axis=0))
        return x


def _inference_state_model():
    inputs = keras.Input((8,), name="is_x")
    hidden = keras.layers.Dense(16, activation="tanh", name="is_d0")(inputs)
    hidden = _InferenceState(name="is_state")(hidden)
    frozen = keras.layers.BatchNormalization(name="is_bn")
    frozen.trainable = False  # inference mode: assigns nothing
    hidden = frozen(hidden)
    return keras.Model(inputs, keras.layers.Dense(3, name="is_out")(hidden), name="is_model")


@pytest.mark.parametrize("plan_name", ["even2", "prop3"])
def test_split_batch_evaluate_and_predict_assign_state_as_one_device(plan_name):
    """A plan that splits the batch combines what the replicas' inference passes
    assigned as its train step does (float state: the share-weighted mean, integer
    state: the first replica's): counters advance once per batch and a moving average
    of a per-row mean follows the whole batch, as in plain Keras. Before, evaluate and
    predict left them as they were (and validation in fit too)."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(96, 8)).astype("float32")
    y = rng.integers(0, 3, size=(96,)).astype("int32")
    xv, yv = x[:48], y[:48]
    keras.utils.set_random_seed(3)
    initial = _inference_state_model().get_weights()
    strategy = _strategy(plan_name)
    runs = []
    for scope in (strategy.scope(), contextlib.nullcontext()):
        with scope:
            model = _inference_state_model()
            _compile(model, "sgd")
        model.set_weights(initial)
        runs.append(_fit_evaluate_predict_fit(model, "is_state", x, y, xv, yv))
    assert len(strategy.plan.replicas) > 1
    # 3 epochs of 4 training and 2 validation batches, evaluate's 2, predict's 2, 2 x 4
    calls, steps, _ = runs[0]["state"]
    assert float(calls) == int(steps) == 3 * 6 + 2 + 2 + 2 * 4
    _assert_same_run(*runs)


# ------------------------------------- sparse (IndexedSlices) gradients and Adam
def _sparse_dense_data():
    import tensorflow as tf

    rng = np.random.default_rng(0)
    dense = rng.normal(size=(96, 8)).astype("float32")
    return tf.sparse.from_dense(dense * (dense > 0.5)), rng.integers(0, 3, size=(96,))


def _fit_adam_both(build, x, y, plan_name, run_eagerly=False, epochs=2):
    """Plain Keras and `plan_name` fit the same model with Adam; (reference, model, histories)."""
    def compiled():
        model = build()
        model.compile(optimizer=keras.optimizers.Adam(learning_rate=1e-2),
                      loss="sparse_categorical_crossentropy", run_eagerly=run_eagerly)
        return model

    reference = compiled()
    ref_history = reference.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    strategy = _strategy(plan_name)
    with strategy.scope():
        model = compiled()
    history = model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    assert len(strategy.plan.replicas) > 1
    np.testing.assert_allclose(history.history["loss"], ref_history.history["loss"], rtol=1e-5)
    for w, got, want in zip(reference.weights, model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=w.path)
    return strategy


@pytest.mark.parametrize("plan_name, run_eagerly", [
    ("prop3", False), ("even2", False), ("ps3", False), ("prop3", True)])
def test_sparse_input_dense_with_adam_matches_keras(plan_name, run_eagerly):
    """Keras's Dense on a tf.SparseTensor looks the kernel up with
    tf.nn.embedding_lookup_sparse, which deduplicates ids: one device's kernel
    gradient has one row per input column of the global batch. The replicas' rows
    are merged likewise; concatenated, a column appeared once per replica and Adam
    (which squares the rows before adding them) drifted: loss 1.51330 against
    1.51672 after 4 steps of shares 12/6/6, weights 0.02 apart."""
    x, y = _sparse_dense_data()

    def build():
        keras.utils.set_random_seed(3)
        inputs = keras.Input((8,), sparse=True)
        hidden = keras.layers.Dense(6, activation="relu")(inputs)
        return keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(hidden))

    _fit_adam_both(build, x, y, plan_name, run_eagerly)


@pytest.mark.parametrize("run_eagerly", [False, True], ids=["traced", "eager"])
def test_embedding_with_adam_keeps_ids_repeated_across_replicas(run_eagerly):
    """An Embedding's gradient has one row per lookup, repeated ids included, and
    the replicas' rows are concatenated. Here no replica repeats an id within its
    rows but the replicas share ids (rows 0-11 and 12-23 of each batch hold the
    same 12 ids, shares 12/6/6), so merging repeated ids as for a deduplicating
    lookup would change Adam's steps: the rule reads how the rows were made."""
    ids = np.concatenate([np.r_[np.arange(12), np.arange(12)] + 12 * (k % 2)
                          for k in range(4)]).astype("int32")[:, None]
    y = np.random.default_rng(1).integers(0, 3, size=(96,))

    def build():
        keras.utils.set_random_seed(3)
        inputs = keras.Input((1,), dtype="int32")
        hidden = keras.layers.Flatten()(keras.layers.Embedding(40, 4)(inputs))
        return keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(hidden))

    strategy = _fit_adam_both(build, ids, y, "prop3", run_eagerly)
    assert [r.batch_share for r in strategy.plan.replicas] == [12, 6, 6]


def test_sparse_gradient_rows_are_read_from_the_graph():
    """`tf_reduce.rows_from_unique` on the gradient of a deduplicating lookup (True), of a
    plain lookup (False), of a table read by both (rows concatenated: False), and of
    an eager step's gradient (no graph: None)."""
    import tensorflow as tf

    from autodist_keras.backends.tf_reduce import rows_from_unique

    table = tf.Variable(tf.ones((10, 3)))
    ids = tf.constant([[1, 4], [4, 2]])
    sparse_ids = tf.sparse.from_dense(ids)
    lookups = [
        lambda: tf.nn.embedding_lookup_sparse(table, sparse_ids, None, combiner="sum"),
        lambda: tf.gather(table, ids),
        lambda: tf.concat([tf.reshape(tf.gather(table, ids), [-1, 3]),
                           tf.nn.embedding_lookup_sparse(table, sparse_ids, None)], 0),
    ]

    def gradient(lookup):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(lookup())
        grad = tape.gradient(loss, table)
        assert isinstance(grad, tf.IndexedSlices)
        return grad

    found = []

    def trace():
        found.extend(rows_from_unique(gradient(lookup)) for lookup in lookups)
        return tf.constant(0)

    tf.function(trace, autograph=False).get_concrete_function()
    assert found == [True, False, False]
    assert rows_from_unique(gradient(lookups[0])) is None


# ------------------------------------- trainable variables assigned in call
def _spectral():
    inputs = keras.Input((8,), name="sn_x")
    hidden = keras.layers.Dense(16, activation="tanh", name="sn_d0")(inputs)
    hidden = keras.layers.SpectralNormalization(
        keras.layers.Dense(8, activation="relu"), power_iterations=1, name="sn_norm")(hidden)
    return keras.Model(inputs, keras.layers.Dense(3, name="sn_out")(hidden), name="sn_model")


@pytest.mark.parametrize("plan_name, run_eagerly", [
    ("single_device", False), ("single_cpu1", False), ("even2", False), ("prop3", False),
    ("ps3", False), ("prop3", True)])
def test_spectral_normalization_trains_as_plain_keras(plan_name, run_eagerly):
    """SpectralNormalization assigns `kernel := kernel / sigma(kernel)` to its trainable
    kernel in `call`, then reads the kernel. In plain Keras that read is the variable:
    the gradient is that of the normalised kernel as a leaf, applied to the variable
    holding it. The recording scope served the assigned tensor instead, so the
    gradient flowed back through the normalisation into the old kernel: one SGD step
    left the kernel 0.105 away from plain Keras's, on one device too (single_device on
    cpu0 runs the adapter's step for the first step only, which makes the plan)."""
    from autodist_keras import AutoStrategy
    from autodist_keras.devices import Cluster

    rng = np.random.default_rng(4)
    x = rng.normal(size=(96, 8)).astype("float32")
    y = rng.integers(0, 3, size=(96,)).astype("int32")
    keras.utils.set_random_seed(3)
    initial = _spectral().get_weights()
    if plan_name.startswith("single"):
        devices = ["node0/cpu1"] if plan_name == "single_cpu1" else None
        strategy = AutoStrategy("single_device", cluster=Cluster.cpu_testbed(), devices=devices)
    else:
        strategy = _strategy(plan_name)
    runs = []
    for scope in (strategy.scope(), contextlib.nullcontext()):
        with scope:
            model = _spectral()
            model.compile(optimizer=_optimizer("sgd"), run_eagerly=run_eagerly,
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.set_weights(initial)
        history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        runs.append((model, history.history["loss"]))
    (model, loss), (reference, want_loss) = runs
    assert (model._autodist_runtime.keras_step_suffices()) == (plan_name == "single_device")
    assert len(strategy.plan.replicas) == {"even2": 2, "prop3": 3, "ps3": 3}.get(plan_name, 1)
    for w, got, want in zip(reference.weights, model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=w.path)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)


@pytest.mark.parametrize("plan_name, run_eagerly", [("ps3", False), ("prop3", True)])
def test_xla_compiled_convolutions_train_like_keras(plan_name, run_eagerly):
    """Keras's TF backend runs a grouped convolution (and a channels_first Conv3D)
    as its own tf.function(jit_compile=True) (keras/src/backend/tensorflow/nn.py
    `conv`); a replica's read of the kernel in there made XLA refuse the variable of
    another device ("Trying to access resource gconv/kernel located in device CPU:0
    from device CPU:2") at the first step.

    Both kinds of layer take the same `_conv_xla` path, so the grouped Conv1D (a
    fraction of the Conv3D's XLA compile time) stands for both. The replica's read
    is made in the traced step (ps3) or eagerly (prop3, run_eagerly): the two ways
    `_read_outside` reads; the sync mode does not change the read."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 6, 8)).astype("float32")
    y = rng.integers(0, 3, size=(48,))

    def build():
        keras.utils.set_random_seed(3)
        inputs = keras.Input((6, 8))
        h = keras.layers.Dense(8, activation="tanh")(inputs)  # trained through the XLA conv
        h = keras.layers.Conv1D(4, 3, groups=2, data_format="channels_first", name="gconv")(h)
        h = keras.layers.Flatten()(h)
        return keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(h))

    # One epoch of 2 steps: eagerly, every conv call is an XLA compile of its own.
    _fit_adam_both(build, x, y, plan_name, run_eagerly, epochs=1)


@pytest.mark.parametrize("plan_name", ["prop3", "ps3"])
def test_a_batch_of_no_rows_runs_as_in_plain_keras(plan_name):
    """`train_on_batch(x[:0])` (and test/predict) after a fit: no replica got a row,
    so nothing was gathered, and Keras's tree utilities raised `ValueError: Must
    provide at least one structure` (`IndexError` in training). Plain Keras runs
    its own step on such a batch; so does the strategy now."""
    def build():  # (no activity regulariser: plain Keras cannot sum one over no rows)
        inputs = keras.Input((8,), name="rows_input")
        hidden = keras.layers.Dense(16, activation="relu", name="rows_hidden")(inputs)
        return keras.Model(inputs, keras.layers.Dense(3, name="rows_logits")(hidden))

    x, y = _data("mlp")
    keras.utils.set_random_seed(4)
    reference = build()
    _compile(reference, "adam")
    strategy = _strategy(plan_name)
    with strategy.scope():
        model = build()
        _compile(model, "adam")
    model.set_weights(reference.get_weights())
    results = []
    for m in (reference, model):
        m.fit(x[:48], y[:48], batch_size=BATCH, shuffle=False, verbose=0)
        predicted = m.predict_on_batch(x[:0])
        tested = m.test_on_batch(x[:0], y[:0])
        trained = m.train_on_batch(x[:0], y[:0])
        m.train_on_batch(x[:BATCH], y[:BATCH])  # and a real batch after it
        results.append((predicted.shape, tested, trained, int(m.optimizer.iterations)))
    assert results[0] == results[1]
    _assert_weights_match([w.path for w in model.weights], reference.get_weights(),
                          model.get_weights(), "adam")


def test_add_guard_adds_as_numpy_broadcasting_and_keeps_real_biases_fused():
    """The guarded `keras.ops.add` agrees with numpy for static shapes where
    Keras's `bias_add` shortcut misplaces `x2`, and still emits `BiasAdd` (which
    TensorFlow fuses into the preceding MatMul) for real biases."""
    import tensorflow as tf

    from autodist_keras.backends import tf_add_guard

    assert tf_add_guard.install()
    cases = {  # (x1 shape, x2 shape): whether the graph should hold a BiasAdd
        ((8, 8), (8, 1)): False,         # per-row statistic, rows == width
        ((3, 4, 3), (3, 1, 1)): False,   # per-sample scalar, rows == axis 1 (NCHW path)
        ((4, 8), (8, 1, 1)): False,      # broadcasting raises the rank
        ((8, 8), (8,)): True,            # a real bias on the last axis
        ((8, 8), (1, 8)): True,
        ((2, 3, 5), (3, 1)): True,       # channels_first bias
    }
    rng = np.random.default_rng(0)
    for (shape1, shape2), fused in cases.items():
        a = rng.normal(size=shape1).astype("float32")
        b = rng.normal(size=shape2).astype("float32")
        add = tf.function(keras.ops.add, input_signature=[
            tf.TensorSpec(shape1, tf.float32), tf.TensorSpec(shape2, tf.float32)])
        np.testing.assert_allclose(add(a, b).numpy(), a + b, rtol=1e-6,
                                   err_msg=f"{shape1} + {shape2}")
        ops = {op.type for op in add.get_concrete_function().graph.get_operations()}
        assert ("BiasAdd" in ops) == fused, (shape1, shape2, sorted(ops))


# ----------------------------------------------------- optimizer features
def _clipped_dense():
    inputs = keras.Input((8,), name="oc_in")
    hidden = keras.layers.Dense(16, activation="relu", name="oc_hidden")(inputs)
    return keras.Model(inputs, keras.layers.Dense(3, name="oc_logits")(hidden))


def _clipped_embedding():
    inputs = keras.Input((5,), dtype="int32", name="oe_ids")
    hidden = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(30, 6, name="oe_emb")(
        inputs))
    return keras.Model(inputs, keras.layers.Dense(3, name="oe_logits")(hidden))


def _optimizer_feature_cases():
    """(build, data, optimizer) triples of `test_optimizer_features_act_on_the_global_gradient`."""
    opt = keras.optimizers
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, size=(96,)).astype("int32")
    dense_x = (rng.normal(size=(96, 8)) * 4).astype("float32")
    ids = rng.integers(0, 30, size=(96, 5)).astype("int32")
    warmup = opt.schedules.CosineDecay(0.0, 6, alpha=0.1, warmup_target=0.02, warmup_steps=3)
    return [
        # Global clipping of an accumulated gradient, weight decay, a warm-up schedule,
        # EMA (swapped into the weights every 4 steps and at the end of fit) and dynamic
        # loss scaling (the scale grows every 2 finite steps).
        (_clipped_dense, (dense_x, y), lambda: opt.LossScaleOptimizer(
            opt.AdamW(warmup, weight_decay=0.3, global_clipnorm=0.1,
                      gradient_accumulation_steps=3, use_ema=True, ema_momentum=0.8,
                      ema_overwrite_frequency=4),
            initial_scale=2.0 ** 15, dynamic_growth_steps=2)),
        # Per-variable clipping of a sparse (IndexedSlices) gradient, factored slots.
        (_clipped_embedding, (ids, y), lambda: opt.Adafactor(
            opt.schedules.ExponentialDecay(0.05, 2, 0.5), clipnorm=0.05)),
        # Elementwise clipping and a constant loss scale factor; Ftrl's accumulators.
        (_clipped_dense, (dense_x, y), lambda: opt.Ftrl(
            0.1, l1_regularization_strength=0.01, l2_shrinkage_regularization_strength=0.01,
            loss_scale_factor=128.0, clipvalue=0.01)),
    ]


def test_optimizer_features_act_on_the_global_gradient():
    """Clipping (`clipnorm`, `clipvalue`, `global_clipnorm`), gradient accumulation,
    weight decay, EMA, schedules, loss scaling and optimizers with other slots
    (Adafactor, Ftrl) train as on one device: the optimizer sees the summed
    gradient of the whole batch, once per step. The inputs are scaled so that every
    clip bites: on the first batch the dense model's gradient norm is 2.98 (per
    variable 1.92, 0.14, 2.28, 0.07) and the replicas' weighted parts (shares
    12/6/6) have norms 1.37, 1.42 and 1.90, so clipping each part before the sum
    trains differently (session 29: with each replica's part clipped, the three
    cases' losses ended 3.6e-3, 2.7e-3 and 2.3e-4 away from one device's, and this
    test failed on each). Two epochs of 4 batches, so EMA, accumulation and the
    schedule cross epochs; optimizer variables (slots, accumulators, EMA averages,
    the loss scale) are compared too."""
    for build, (x, y), make_optimizer in _optimizer_feature_cases():
        keras.utils.set_random_seed(3)
        initial = build().get_weights()
        if build is _clipped_embedding:
            initial[0] = initial[0] * 40  # large rows: clipnorm cuts the embedding's gradient
        results = []
        for strategy in (None, _strategy("prop3")):
            with strategy.scope() if strategy is not None else contextlib.nullcontext():
                model = build()
                model.compile(optimizer=make_optimizer(),
                              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            model.set_weights(initial)
            history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
            results.append((model, history.history["loss"]))
        (reference, ref_loss), (model, loss) = results
        assert strategy.plan.shares_for(BATCH) == [12, 6, 6]
        name = type(model.optimizer).__name__
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, err_msg=name)
        for w, got, want in zip(reference.weights, model.get_weights(), reference.get_weights()):
            np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=f"{name} {w.path}")
        ref_vars, got_vars = reference.optimizer.variables, model.optimizer.variables
        assert [v.name for v in got_vars] == [v.name for v in ref_vars], name
        # 8 steps; 2 updates applied with gradient accumulation over 3 steps.
        assert int(model.optimizer.iterations) == int(reference.optimizer.iterations) in (2, 8)
        for v, got, want in zip(ref_vars, got_vars, ref_vars):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=RTOL, atol=ATOL,
                                       err_msg=f"{name} {v.path}")


class _HalveMomentum(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 1:
            self.model.optimizer.momentum = 0.5 * self.model.optimizer.momentum


def test_optimizer_settings_a_callback_changes_apply_from_the_next_step():
    """A callback setting `optimizer.momentum` during fit: the traced steps held the
    old value as a constant, and only a step traced later (a partial last batch,
    another share tuple) used the new one (session 29: weights 0.07 off eager Keras
    after two epochs of 100 samples). The train steps trace again when a setting
    changed and follow eager Keras, as the PyTorch runtime does (plain Keras's own
    traced step keeps the old value until it happens to trace again)."""
    keras.utils.set_random_seed(3)
    initial = _clipped_dense().get_weights()
    x, y = _data("mlp", samples=4 * BATCH)
    results = []
    for strategy in (None, _strategy("prop3")):
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            model = _clipped_dense()
            model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          run_eagerly=strategy is None)
        model.set_weights(initial)
        history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                            callbacks=[_HalveMomentum()])
        results.append((model, history.history["loss"]))
    (reference, ref_loss), (model, loss) = results
    assert not model.run_eagerly and model.optimizer.momentum == pytest.approx(0.45)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for w, got, want in zip(reference.weights, model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=w.path)



def test_add_guard_covers_a_row_of_one_the_add_layer_and_the_loss_probe():
    """Other triggers of the `bias_add` shortcut that `tf_add_guard` corrects (session
    29's audit): a per-position mean `(1, 4, 1)` added to `(1, 4, 4)` when a partial
    batch of 3 gives each of 3 replicas one row (added along the last axis), and the
    `Add` merge layer (`ops.add`) with a per-row max when 8 rows meet 8 units.
    Without the guard the weights ended 0.16 off plain Keras's, and the plan's
    per-sample loss probe (`model_checks`, eager batches of 4 rows and of 1) warned
    falsely that the loss was not a mean of per-sample losses. Evaluate and predict
    after the fit run the replicas' steps too."""
    from autodist_keras import AutoStrategy
    from autodist_keras.devices import Cluster

    def build():
        inputs = keras.Input((4, 3), name="rows_seq")
        h = keras.layers.Dense(4, name="rows_d0")(inputs)
        h = h + keras.ops.mean(h, axis=-1, keepdims=True)  # (1, 4, 1) meets (1, 4, 4)
        g = keras.layers.Dense(8, name="rows_d1")(keras.layers.Flatten()(h))
        g = keras.layers.Add()([g, keras.ops.max(g, axis=-1, keepdims=True)])  # 8 rows, 8 wide
        return keras.Model(inputs, keras.layers.Dense(3, name="rows_logits")(g))

    rng = np.random.default_rng(11)
    x = rng.normal(size=(51, 4, 3)).astype("float32")  # batches of 24, 24 and 3
    y = rng.integers(0, 3, size=(51,)).astype("int32")
    keras.utils.set_random_seed(5)
    reference = build()
    _compile(reference, "sgd")
    strategy = AutoStrategy("data_parallel", cluster=Cluster.cpu_testbed(),
                            devices=["node0/cpu0", "node0/cpu1", "node0/cpu2"])
    with strategy.scope():
        model = build()
        _compile(model, "sgd")
    model.set_weights(reference.get_weights())
    results = []
    for m in (reference, model):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            m.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        assert not [w for w in caught if "per-sample" in str(w.message)]
        results.append((m.evaluate(x, y, batch_size=BATCH, verbose=0),
                        m.predict(x, batch_size=BATCH, verbose=0)))
    assert [r.batch_share for r in strategy.plan.replicas] == [8, 8, 8]
    assert strategy.plan.shares_for(3) == [1, 1, 1]
    _assert_weights_match([w.path for w in model.weights], reference.get_weights(),
                          model.get_weights(), "sgd")
    np.testing.assert_allclose(results[1][0], results[0][0], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(results[1][1], results[0][1], rtol=RTOL, atol=ATOL)
