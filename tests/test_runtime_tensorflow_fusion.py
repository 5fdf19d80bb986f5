"""Op-fusion regions (Disco's `plan.op_fusion`) realised as XLA clusters on TensorFlow.

Real Keras models, real traced steps on the logical CPU devices of
tests/conftest.py. XLA compiles a region's forward and backward ops into
fused kernels, so float rounding differs slightly from TensorFlow's own
kernels: weights are compared with single-device training at rtol 1e-4.
"""

import keras
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow",
    reason="XLA op-fusion regions are a TensorFlow runtime feature",
)

REGIONS = [
    ["small_cnn_conv0", "small_cnn_bn0", "small_cnn_relu0", "small_cnn_pool0"],
    ["small_cnn_conv1", "small_cnn_bn1", "small_cnn_relu1"],
]


def _cnn():
    from autodist_keras.graph import zoo

    keras.utils.set_random_seed(11)
    model = zoo.small_cnn(input_shape=(6, 6, 2), filters=(4, 4), num_classes=3)
    for layer in model.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            layer.trainable = False  # inference mode: per-replica = global statistics
    return model


def _compile(model):
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def _data():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(240, 6, 6, 2)).astype("float32")
    y = rng.integers(0, 3, size=(240,)).astype("int32")
    return x, y


def _fused_plan(model, devices, batch):
    from autodist_keras.devices import Cluster
    from autodist_keras.graph import ModelGraph
    from autodist_keras.strategies import baselines

    cluster = Cluster.cpu_testbed()
    graph = ModelGraph.from_keras(model)
    plan = baselines.data_parallel_even(graph, cluster, batch, devices=devices)
    plan.op_fusion = [list(r) for r in REGIONS]
    return cluster, plan


def _traced_ops(regions, model, x):
    import tensorflow as tf

    @tf.function(autograph=False)
    def step(x):
        with regions.recording(replica=0):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(model(x, training=True) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
        regions.mark()
        return grads

    graph = step.get_concrete_function(x).graph
    return {op.name: op for op in graph.get_operations()}


def _xla_scope(op):
    try:
        return op.get_attr("_XlaScope").decode()
    except ValueError:
        return None


def test_regions_mark_forward_and_gradient_ops_one_scope_per_region():
    import tensorflow as tf

    from autodist_keras.backends.tf_fusion import FusionRegions

    model = _cnn()
    ops = _traced_ops(FusionRegions(model, REGIONS), model, tf.zeros((4, 6, 6, 2)))
    scopes = {}
    for name, op in ops.items():
        scope = _xla_scope(op)
        if scope is not None:
            assert op.get_attr("_XlaCompile") is True
            scopes.setdefault(scope, []).append(name)
    assert sorted(scopes) == ["autodist_fusion_r0_p0", "autodist_fusion_r1_p0"]
    first = scopes["autodist_fusion_r0_p0"]
    # Forward convolution and its backward (gradient-tape) ops are in region 0.
    assert any("small_cnn_conv0" in n and not n.startswith("gradient_tape/") for n in first)
    assert any(n.startswith("gradient_tape/") and "small_cnn_conv0" in n for n in first)
    assert any("small_cnn_relu1" in n for n in scopes["autodist_fusion_r1_p0"])
    # Layers outside every region are not marked.
    for name, op in ops.items():
        if "small_cnn_logits" in name or "small_cnn_gap" in name:
            assert _xla_scope(op) is None, name


def test_unknown_layer_and_policy_raise_clear_errors():
    from autodist_keras.backends.tf_fusion import FusionRegions
    from autodist_keras.backends.tf_fusion import for_plan
    from autodist_keras.errors import BackendError

    model = _cnn()
    with pytest.raises(BackendError, match="Received: 'no_such_layer'"):
        FusionRegions(model, [["small_cnn_conv0", "no_such_layer"]])
    _, plan = _fused_plan(model, ["node0/cpu0", "node0/cpu1"], 24)
    with pytest.raises(BackendError, match="Valid: auto, on, off"):
        for_plan(model, plan, ["cpu", "cpu"], policy="always")
    assert for_plan(model, plan, ["cpu", "cpu"], policy="auto") is None  # XLA only on GPUs
    assert for_plan(model, plan, ["gpu", "gpu"], policy="auto").regions == REGIONS
    assert for_plan(model, plan, ["gpu", "gpu"], policy="off") is None
    assert for_plan(model, plan, ["cpu", "cpu"], policy="on").regions == REGIONS


def test_fit_with_fusion_regions_matches_single_device():
    from autodist_keras import AutoStrategy

    x, y = _data()
    reference = _cnn()
    initial = reference.get_weights()
    _compile(reference)
    reference.fit(x, y, batch_size=24, shuffle=False, verbose=0)

    cluster, plan = _fused_plan(_cnn(), ["node0/cpu0", "node0/cpu1"], 24)
    strategy = AutoStrategy("data_parallel", cluster=cluster, plan=plan, op_fusion="on")
    with strategy.scope():
        model = _cnn()
        _compile(model)
    model.set_weights(initial)
    model.fit(x, y, batch_size=24, shuffle=False, verbose=0)

    assert strategy.adapter.runtime_info["op_fusion_regions"] == 2
    for want, got in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    # The traced training step carries one XLA scope per (region, replica).
    runtime = model._autodist_runtime
    train_fn = runtime.fns[("train", (12, 12))]
    (concrete,) = train_fn._list_all_concrete_functions()
    graph = concrete.graph
    scopes = {_xla_scope(op) for op in graph.get_operations()} - {None}
    assert scopes == {f"autodist_fusion_r{r}_p{p}" for r in (0, 1) for p in (0, 1)}


def test_auto_policy_leaves_cpu_plans_unfused():
    from autodist_keras import AutoStrategy

    cluster, plan = _fused_plan(_cnn(), ["node0/cpu0", "node0/cpu1"], 24)
    strategy = AutoStrategy("data_parallel", cluster=cluster, plan=plan)
    with strategy.scope():
        model = _cnn()
        _compile(model)
    x, y = _data()
    model.fit(x[:48], y[:48], batch_size=24, shuffle=False, verbose=0)
    assert strategy.adapter.runtime_info["op_fusion_regions"] == 0


def test_bad_op_fusion_option_is_rejected_at_construction():
    from autodist_keras import AutoStrategy
    from autodist_keras.errors import StrategyError

    with pytest.raises(StrategyError, match="Received: op_fusion='yes'"):
        AutoStrategy("data_parallel", cluster="2xV100", op_fusion="yes")


def test_one_replica_plan_with_regions_keeps_the_adapter_step():
    """Keras's own train step (used for plain one-replica plans) would drop the regions."""
    from autodist_keras import AutoStrategy

    cluster, plan = _fused_plan(_cnn(), ["node0/cpu0"], 24)
    strategy = AutoStrategy("data_parallel", cluster=cluster, plan=plan, op_fusion="on")
    with strategy.scope():
        model = _cnn()
        _compile(model)
    x, y = _data()
    model.fit(x[:72], y[:72], batch_size=24, shuffle=False, verbose=0)
    runtime = model._autodist_runtime
    assert strategy.adapter.runtime_info["op_fusion_regions"] == 2
    assert not runtime.keras_step_suffices()
    assert model.train_function.__qualname__.endswith("make_function.<locals>.function")


# ------------------------------------------------ regions with random layers
class _DropBlock(keras.layers.Layer):
    """A custom layer whose Dropout sublayer draws the random numbers."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.drop = keras.layers.Dropout(0.5, seed=7)

    def call(self, x, training=None):
        return self.drop(x, training=training)


def _random_mlp(kind="dropout"):
    """d0 -> Dropout, GaussianNoise or a block holding a Dropout -> act -> d1 -> act1 -> out."""
    inputs = keras.Input((8,), name="f_x")
    h = keras.layers.Dense(16, name="f_d0")(inputs)
    h = {"dropout": lambda: keras.layers.Dropout(0.5, seed=5, name="f_rand"),
         "gnoise": lambda: keras.layers.GaussianNoise(0.3, seed=3, name="f_rand"),
         "block": lambda: _DropBlock(name="f_rand")}[kind]()(h)
    h = keras.layers.Activation("relu", name="f_act")(h)
    h = keras.layers.Dense(16, name="f_d1")(h)
    h = keras.layers.Activation("tanh", name="f_act1")(h)
    return keras.Model(inputs, keras.layers.Dense(3, name="f_out")(h), name="f_mlp")


RANDOM_REGIONS = [["f_d0", "f_rand", "f_act"], ["f_d1", "f_act1"]]


def _mlp_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(240, 8)).astype("float32")
    y = rng.integers(0, 3, size=(240,)).astype("int32")
    return x, y


def _random_fit(kind, devices, op_fusion, regions, initial):
    from autodist_keras import AutoStrategy
    from autodist_keras.devices import Cluster
    from autodist_keras.graph import ModelGraph
    from autodist_keras.strategies import baselines

    cluster = Cluster.cpu_testbed()
    plan = baselines.data_parallel_even(ModelGraph.from_keras(_random_mlp(kind)), cluster, 24,
                                        devices=devices)
    plan.op_fusion = [list(r) for r in regions]
    strategy = AutoStrategy("data_parallel", cluster=cluster, plan=plan, op_fusion=op_fusion)
    with strategy.scope():
        model = _random_mlp(kind)
        _compile(model)
    model.set_weights(initial)
    x, y = _mlp_data()
    history = model.fit(x, y, batch_size=24, shuffle=False, verbose=0)
    return strategy, model, history


def test_regions_with_random_layers_fall_back_with_a_reason():
    import tensorflow as tf

    from autodist_keras.backends.tf_fusion import FusionRegions

    for kind, inner in (("dropout", None), ("gnoise", None), ("block", "dropout")):
        model = _random_mlp(kind)
        regions = FusionRegions(model, RANDOM_REGIONS)
        assert regions.regions == RANDOM_REGIONS
        assert regions.realised == [1] and list(regions.fallbacks) == [0]
        reason = regions.fallbacks[0]
        assert "'f_rand'" in reason and "draws random numbers" in reason, reason
        if inner:
            assert f"its layer '{inner}" in reason, reason
        assert regions.summary()["fallbacks"] == {"0": reason}
        ops = _traced_ops(regions, model, tf.zeros((4, 8)))
        scopes = {_xla_scope(op) for op in ops.values()} - {None}
        assert scopes == {"autodist_fusion_r1_p0"}, (kind, scopes)  # region 0 uncompiled
        for name, op in ops.items():
            if "f_d0" in name or "f_rand" in name:
                assert _xla_scope(op) is None, name


@pytest.mark.parametrize("kind", ["dropout", "gnoise"])
def test_one_replica_region_with_random_layer_matches_plain_keras(kind):
    """Compiled, the region drew other masks (weights 0.06 off); uncompiled it is Keras's own."""
    keras.utils.set_random_seed(3)
    reference = _random_mlp(kind)
    initial = reference.get_weights()
    _compile(reference)
    x, y = _mlp_data()
    ref_history = reference.fit(x, y, batch_size=24, shuffle=False, verbose=0)

    strategy, model, history = _random_fit(kind, ["node0/cpu0"], "on", RANDOM_REGIONS[:1],
                                           initial)
    for w, want, got in zip(model.weights, reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=w.path)
    np.testing.assert_allclose(history.history["loss"], ref_history.history["loss"], rtol=1e-5)
    info = strategy.adapter.runtime_info
    assert info["op_fusion_regions"] == 0
    assert "draws random numbers" in info["op_fusion"]["fallbacks"]["0"]
    assert model._autodist_runtime.keras_step_suffices()  # nothing left to compile
    seeds = [v.numpy().tolist() for v in model.variables if "seed" in v.path]
    assert seeds == [v.numpy().tolist() for v in reference.variables if "seed" in v.path]


def test_replicated_region_with_dropout_runs_uncompiled_and_others_compile():
    """Two replicas: the Dropout region draws as with op_fusion='off'; the other compiles."""
    keras.utils.set_random_seed(3)
    initial = _random_mlp().get_weights()
    devices = ["node0/cpu0", "node0/cpu1"]
    _, plain, plain_history = _random_fit("dropout", devices, "off", RANDOM_REGIONS, initial)
    strategy, model, history = _random_fit("dropout", devices, "on", RANDOM_REGIONS, initial)
    for w, want, got in zip(model.weights, plain.get_weights(), model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=w.path)
    np.testing.assert_allclose(history.history["loss"], plain_history.history["loss"],
                               rtol=1e-4)
    info = strategy.adapter.runtime_info
    assert info["op_fusion_regions"] == 1
    assert info["op_fusion"]["realised"] == [1]
    assert list(info["op_fusion"]["fallbacks"]) == ["0"]
    train_fn = model._autodist_runtime.fns[("train", (12, 12))]
    (concrete,) = train_fn._list_all_concrete_functions()
    scopes = {_xla_scope(op) for op in concrete.graph.get_operations()} - {None}
    assert scopes == {"autodist_fusion_r1_p0", "autodist_fusion_r1_p1"}
