"""Op-fusion regions compiled with torch.compile in the PyTorch runtime.

Real Keras models, real `torch.compile` (the `aot_eager` backend, which traces
the same graphs TorchInductor compiles, for speed; one test compiles with
TorchInductor itself), real spawned workers. A fused fit must train exactly
as the unfused one, run the compiled regions, and leave the user's model
as it was.
"""

import keras
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "torch", reason="PyTorch runtime tests run under KERAS_BACKEND=torch"
)

BATCH = 24
SAMPLES = 96
# conv -> BN (training mode) -> ReLU, conv -> BN -> ReLU -> pool, pool -> logits.
REGIONS = [["small_cnn_conv0", "small_cnn_bn0", "small_cnn_relu0"],
           ["small_cnn_conv1", "small_cnn_bn1", "small_cnn_relu1", "small_cnn_pool1"],
           ["small_cnn_gap", "small_cnn_logits"]]


def _build():
    from autodist_keras.graph import zoo

    keras.utils.set_random_seed(1)
    return zoo.small_cnn(input_shape=(8, 8, 3), filters=(4, 8), num_classes=4)


def _compile(model):
    model.compile(optimizer=keras.optimizers.SGD(0.05),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, 8, 8, 3)).astype("float32")
    y = rng.integers(0, 4, size=(SAMPLES,)).astype("int32")
    return x, y


def _plan(ndev, regions=REGIONS):
    from autodist_keras.devices import Cluster
    from autodist_keras.graph import ModelGraph
    from autodist_keras.strategies import baselines

    cluster = Cluster.cpu_testbed()
    graph = ModelGraph.from_keras(_build())
    if ndev == 1:
        plan = baselines.single_device(graph, cluster, BATCH, device=cluster.names[0])
    else:
        plan = baselines.proportional(graph, cluster, BATCH, devices=cluster.names[:ndev])
    plan.op_fusion = [list(r) for r in regions]
    plan.validate(graph, cluster)
    return plan, cluster


def _fit(ndev, regions=REGIONS, **options):
    from autodist_keras import AutoStrategy

    plan, cluster = _plan(ndev, regions)
    strategy = AutoStrategy(cluster=cluster, plan=plan, **options)
    with strategy.scope():
        model = _build()
        _compile(model)
    x, y = _data()
    history = model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    return model, history, strategy


def _plain():
    model = _build()
    _compile(model)
    x, y = _data()
    history = model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    return model, history


def _assert_same_weights(actual, expected, rtol=1e-5, atol=1e-6):
    for a, b in zip(actual.weights, expected.weights):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=rtol, atol=atol, err_msg=a.path)


def test_regions_are_analysed_as_chains():
    from autodist_keras.backends.torch_fusion import TorchFusionRegions

    model = _build()
    fusion = TorchFusionRegions(model, REGIONS + [["small_cnn_relu0", "small_cnn_conv1"]],
                                compiler="aot_eager")
    assert fusion.realised == [0, 1, 2]
    # relu0 feeds pool0, not conv1: not a chain, run layer by layer, and said why.
    assert "small_cnn_conv1" in fusion.fallbacks[3] and "chain" in fusion.fallbacks[3]
    summary = fusion.summary()
    assert summary["compiler"] == "aot_eager" and summary["realised"] == [0, 1, 2]


def test_a_branch_output_used_outside_the_region_falls_back():
    from autodist_keras.backends.torch_fusion import TorchFusionRegions

    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(6, name="a")(inputs)
    inner = keras.layers.Dense(6, name="b")(hidden)
    outputs = keras.layers.Add(name="add")([hidden, inner])
    model = keras.Model(inputs, outputs)
    fusion = TorchFusionRegions(model, [["a", "b"]], compiler="aot_eager")
    assert fusion.realised == []
    assert "outside the region uses an inner layer's output" in fusion.fallbacks[0]


def test_a_region_with_dropout_falls_back():
    from autodist_keras.backends.torch_fusion import TorchFusionRegions

    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(6, name="a")(inputs)
    outputs = keras.layers.Dropout(0.5, name="drop")(hidden)
    fusion = TorchFusionRegions(keras.Model(inputs, outputs), [["a", "drop"]])
    assert fusion.realised == [] and "random numbers" in fusion.fallbacks[0]


def test_bad_region_compiler_and_policy_are_clear_errors():
    from autodist_keras import AutoStrategy
    from autodist_keras.backends.torch_fusion import TorchFusionRegions
    from autodist_keras.errors import BackendError
    from autodist_keras.errors import StrategyError

    with pytest.raises(BackendError, match="does not have. .*Received: 'nope'"):
        TorchFusionRegions(_build(), [["nope", "small_cnn_bn0"]])
    with pytest.raises(BackendError, match="Received: ''"):
        TorchFusionRegions(_build(), REGIONS, compiler="")
    with pytest.raises(StrategyError, match="Received: op_fusion='always'"):
        AutoStrategy("data_parallel", op_fusion="always")
    with pytest.raises(StrategyError, match="Received: op_fusion_compiler=3"):
        AutoStrategy("data_parallel", op_fusion_compiler=3)


def test_one_device_fused_fit_matches_plain_keras_and_restores_call(capfd):
    model, history, strategy = _fit(1, op_fusion="on", op_fusion_compiler="aot_eager")
    # The first step's compilation pause is announced (TorchInductor takes 20-45 s here).
    assert ("3 op-fusion region(s) run compiled with torch.compile (backend 'aot_eager')"
            in capfd.readouterr().err)
    reference, ref_history = _plain()
    run = strategy.adapter.last_run
    assert run["mode"] == "local"
    assert run["op_fusion_regions"] == 3
    fusion = strategy.adapter._run.fusion
    # Every training step ran each region compiled (Keras's own train function
    # from step 2 on calls the model's replaced `call` too).
    assert min(fusion.calls) >= SAMPLES // BATCH
    assert run["op_fusion"]["calls"] == fusion.calls  # last_run reports the counts after fit
    assert "call" not in model.__dict__  # Keras's own call again after fit
    _assert_same_weights(model, reference)
    np.testing.assert_allclose(history.history["loss"], ref_history.history["loss"], rtol=1e-5)


def test_three_devices_fused_fit_matches_unfused():
    fused, fused_history, strategy = _fit(3, op_fusion="on", op_fusion_compiler="aot_eager")
    run = strategy.adapter.last_run
    assert run["op_fusion_regions"] == 3
    assert min(strategy.adapter._run.driver.trainer.fusion.calls) >= SAMPLES // BATCH
    assert min(run["op_fusion"]["calls"]) >= SAMPLES // BATCH
    assert run["in_sync"] is True  # the workers' fused replicas stayed identical to rank 0
    plain, plain_history, off = _fit(3, op_fusion="off")
    assert off.adapter.last_run["op_fusion_regions"] == 0
    _assert_same_weights(fused, plain)
    np.testing.assert_allclose(fused_history.history["loss"], plain_history.history["loss"],
                               rtol=1e-5)
    assert "call" not in fused.__dict__


def test_auto_policy_compiles_nothing_on_cpus(capfd):
    _, _, strategy = _fit(1)
    assert "torch.compile" not in capfd.readouterr().err
    assert strategy.adapter.last_run["op_fusion_regions"] == 0
    assert strategy.adapter.last_run["op_fusion"] is None


def test_inductor_compiles_the_regions_of_one_replica():
    # TorchInductor generates C++ kernels with the machine's compiler; the
    # fused kernels round differently, so weights agree at rtol 1e-4, as XLA's
    # clusters do on TensorFlow (tests/test_runtime_tensorflow_fusion.py). One
    # region, GAP -> logits, whose forward and backward need the fewest kernels
    # (each a C++ compile, 9 CPU-s here against 18 for conv -> BN -> ReLU -> pool
    # with a cold cache). The regions with BatchNormalization in training mode
    # (its statistics updated in the region) go through the same AOTAutograd
    # graphs with aot_eager in the tests above; inductor only generates kernels.
    model, _, strategy = _fit(1, regions=REGIONS[2:3], op_fusion="on")
    reference, _ = _plain()
    fusion = strategy.adapter._run.fusion
    assert fusion.compiler == "inductor" and fusion.realised == [0]
    assert min(fusion.calls) >= SAMPLES // BATCH
    _assert_same_weights(model, reference, rtol=1e-4, atol=1e-5)


def test_fit_that_raises_still_restores_call():
    from autodist_keras import AutoStrategy

    class Stop(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                raise RuntimeError("stop here")

    plan, cluster = _plan(2)
    strategy = AutoStrategy(cluster=cluster, plan=plan, op_fusion="on",
                            op_fusion_compiler="aot_eager")
    with strategy.scope():
        model = _build()
        _compile(model)
    x, y = _data()
    with pytest.raises(RuntimeError, match="stop here"):
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[Stop()])
    assert strategy.adapter.last_run["op_fusion_regions"] == 3
    assert "call" not in model.__dict__


def _models_with_unrealisable_joins():
    """Models where TensorFlow's region rules would join layers PyTorch cannot compile."""
    from autodist_keras.graph import zoo

    keras.utils.set_random_seed(2)
    tokens = keras.Input((12,), dtype="int32")
    embedded = keras.layers.Embedding(50, 16, mask_zero=True, name="embed")(tokens)
    hidden = keras.layers.LayerNormalization(name="norm")(embedded)
    hidden = keras.layers.Dense(16, name="proj")(hidden)
    hidden = keras.layers.Activation("relu", name="relu")(hidden)
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(hidden)
    masked = keras.Model(tokens, keras.layers.Dense(3, name="out")(pooled), name="masked")

    inner_in = keras.Input((16,))
    inner_hidden = keras.layers.Dense(16, name="inner_dense")(inner_in)
    inner_out = keras.layers.Activation("relu", name="inner_relu")(inner_hidden)
    inner = keras.Model(inner_in, inner_out, name="block")
    outer_in = keras.Input((16,))
    hidden = keras.layers.Dense(16, name="outer_dense")(outer_in)
    hidden = keras.layers.Activation("relu", name="outer_relu")(hidden)
    hidden = inner(hidden)
    nested = keras.Model(outer_in, keras.layers.Dense(3, name="head")(hidden), name="nested")

    mixed_in = keras.Input((16,))
    hidden = keras.layers.Dense(16, dtype="mixed_bfloat16", name="mixed_dense")(mixed_in)
    hidden = keras.layers.Activation("relu", dtype="mixed_bfloat16", name="mixed_relu")(hidden)
    hidden = keras.layers.Dense(16, name="plain_dense")(hidden)
    hidden = keras.layers.Activation("relu", name="plain_relu")(hidden)
    mixed = keras.Model(mixed_in, keras.layers.Dense(3, name="logits")(hidden), name="mixed")

    encoder = zoo.transformer_encoder(num_layers=1, d_model=16, heads=2, seq_len=8, vocab=40,
                                      num_classes=3)

    frozen_in = keras.Input((16,))
    hidden = keras.layers.Dense(16, name="frozen_dense")(frozen_in)
    hidden = keras.layers.BatchNormalization(name="frozen_bn")(hidden, training=False)
    hidden = keras.layers.Activation("relu", name="frozen_relu")(hidden)
    hidden = keras.layers.LayerNormalization(name="frozen_norm")(hidden)
    frozen_bn = keras.Model(frozen_in, keras.layers.Dense(3, name="frozen_out")(hidden),
                            name="frozen_bn")
    return [masked, nested, mixed, encoder, frozen_bn]


def test_disco_plans_only_regions_the_torch_runtime_compiles():
    """Disco, planning for PyTorch with op fusion on, names only regions the runtime
    compiles: its prediction counts no fused region that would run layer by layer.
    Planned by TensorFlow's rules, the same models get regions PyTorch falls back on."""
    from autodist_keras.backends.torch_fusion import TorchFusionRegions
    from autodist_keras.devices import Cluster
    from autodist_keras.graph import ModelGraph
    from autodist_keras.strategies import disco

    cluster = Cluster.cpu_testbed()
    fallbacks_by_tf_rules = 0
    for model in _models_with_unrealisable_joins():
        graph = ModelGraph.from_keras(model)
        regions = {}
        for backend in ("torch", "tensorflow"):
            plan = disco.plan(graph, cluster, 24, devices=cluster.names[:2], op_fusion=True,
                              backend=backend, time_budget_s=5.0)
            regions[backend] = [r for r in plan.op_fusion if len(r) > 1]
        fusion = TorchFusionRegions(model, regions["torch"], compiler="aot_eager")
        assert fusion.fallbacks == {}, (model.name, fusion.fallbacks)
        assert len(fusion.realised) == len(regions["torch"])
        fallbacks_by_tf_rules += len(
            TorchFusionRegions(model, regions["tensorflow"], compiler="aot_eager").fallbacks)
        if model.name == "nested":
            assert regions["torch"] == [["outer_dense", "outer_relu"]]
        if model.name == "mixed":
            assert regions["torch"] == [["plain_dense", "plain_relu"]]
        if model.name == "frozen_bn":  # BatchNormalization called with training=False
            assert regions["torch"] == [["frozen_relu", "frozen_norm"]]
    assert fallbacks_by_tf_rules >= 5
