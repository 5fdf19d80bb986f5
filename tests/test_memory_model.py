"""The memory model: one definition for the simulator and the planners' capacity,
a reserve on GPUs, and the compiled optimizer's slots.

Real Keras models, real clusters (spec dicts and YAML files), the real simulator.
"""

import keras
import numpy as np
import pytest

from autodist_keras import AutoStrategy
from autodist_keras.devices import Cluster
from autodist_keras.errors import PlanError
from autodist_keras.estimator import simulate
from autodist_keras.estimator import simulator
from autodist_keras.graph import ModelGraph
from autodist_keras.strategies import baselines
from autodist_keras.strategies import disco
from autodist_keras.strategies.explain import explanation
from autodist_keras.strategies.explain import render_text
from autodist_keras.strategies.selection import cache_key

MiB = 2**20
GiB = 2**30


def _conv_net():
    inputs = keras.Input((32, 32, 3), name="mm_in")
    x = keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="mm_c1")(inputs)
    x = keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="mm_c2")(x)
    x = keras.layers.GlobalAveragePooling2D(name="mm_gap")(x)
    return keras.Model(inputs, keras.layers.Dense(10, name="mm_head")(x), name="mm_conv")


def _tiny(optimizer=None):
    inputs = keras.Input((32,), name="inp")
    x = keras.layers.Dense(64, activation="relu", name="d1")(inputs)
    x = keras.layers.Dense(64, activation="relu", name="d2")(x)
    model = keras.Model(inputs, keras.layers.Dense(1, name="head")(x), name="tiny")
    if optimizer is not None:
        model.compile(optimizer=optimizer, loss="mse")
    return model


def _gpus(memory_gb, count):
    return Cluster.from_dict({"nodes": [{"name": "node0", "intra_link": "pcie", "gpus": [
        {"name": "Small", "memory_gb": memory_gb, "fp32_tflops": 8, "bandwidth_gbps": 300,
         "count": count}]}]})


# 0.0001 GB (107,374 bytes) per CPU device: the tiny model with Adam does not fit a
# 16-sample replica, with plain SGD it does.
TINY_MEMORY_YAML = """\
description: CPU testbed with tiny memory per device
nodes:
  - name: node0
    cpus:
      - {cores: [0], threads: 1, memory_gb: 0.0001}
      - {cores: [1], threads: 1, count: 2, memory_gb: 0.0001}
    intra_link: shm
"""


@pytest.fixture(scope="module")
def conv():
    return ModelGraph.from_keras(_conv_net())


@pytest.fixture
def tinymem(tmp_path):
    path = tmp_path / "tinymem.yaml"
    path.write_text(TINY_MEMORY_YAML)
    return path


# ----------------------------------------------------------------- A: one model
def test_data_parallel_and_proportional_agree_at_the_capacity_boundary(conv):
    # Four identical GPUs: the even data-parallel plan at `cap` samples per device is
    # predicted feasible and proportional builds it; one sample more per device and
    # neither is (proportional and disco used to refuse shares the simulator accepted).
    cluster = _gpus(1, 4)
    names = cluster.names
    cap = baselines.memory_capacity_samples(conv, cluster, names[0])
    assert cap > 1
    fits = simulate(conv, cluster, baselines.data_parallel_even(conv, cluster, 4 * cap))
    assert fits.feasible, fits.infeasible_reason
    plan = baselines.proportional(conv, cluster, 4 * cap)
    assert plan.groups[0].shares == [cap] * 4
    assert simulate(conv, cluster, plan).feasible
    over = simulate(conv, cluster, baselines.data_parallel_even(conv, cluster, 4 * cap + 4))
    assert not over.feasible
    with pytest.raises(PlanError, match="does not fit"):
        baselines.proportional(conv, cluster, 4 * cap + 4)
    # Disco's plans (its shares use the same capacity) fit at the boundary too.
    fused = disco.plan(conv, cluster, 4 * cap, time_budget_s=2.0)
    assert fused.prediction.feasible, fused.prediction.infeasible_reason


def test_simulated_peak_of_a_replica_is_static_plus_samples_times_per_sample(conv):
    # The backward gradient buffer (largest layer output, per sample) is counted by
    # the simulator as memory_capacity_samples counts it.
    cluster = _gpus(16, 2)
    share = 100
    result = simulate(conv, cluster, baselines.data_parallel_even(conv, cluster, 2 * share))
    nodes = list(conv.nodes.values())
    static = 4 * conv.param_bytes + sum(n.non_trainable_bytes for n in nodes)
    per_sample = sum(n.activation_bytes for n in nodes) + max(n.output_bytes for n in nodes)
    for name in cluster.names:
        stats = result.per_device[name]
        assert stats.peak_memory_bytes == static + share * per_sample
        assert stats.memory_breakdown["gradient_buffer"] == share * max(
            n.output_bytes for n in nodes)
        assert sum(stats.memory_breakdown.values()) == stats.peak_memory_bytes


# ------------------------------------------------------------------ B: reserve
def test_gpus_keep_a_reserve_and_cpus_none(conv):
    gpu = _gpus(4, 1).devices[0]
    reserve = 512 * MiB + int(0.05 * 4 * GiB)
    assert simulator.memory_reserve_bytes(gpu) == reserve
    assert simulator.usable_memory_bytes(gpu) == 4 * GiB - reserve
    testbed = Cluster.cpu_testbed()
    for device in testbed.devices:
        assert simulator.usable_memory_bytes(device) == device.memory_bytes
    # The CPU testbed's capacity uses all of a device's memory.
    name = testbed.names[0]
    nodes = list(conv.nodes.values())
    static = 4 * conv.param_bytes + sum(n.non_trainable_bytes for n in nodes)
    per_sample = sum(n.activation_bytes for n in nodes) + max(n.output_bytes for n in nodes)
    assert baselines.memory_capacity_samples(conv, testbed, name) == (
        (testbed.device(name).memory_bytes - static) // per_sample)


def test_a_plan_filling_a_gpu_past_its_reserve_is_infeasible_and_says_why(conv):
    cluster = _gpus(1, 1)
    device = cluster.names[0]
    nodes = list(conv.nodes.values())
    static = 4 * conv.param_bytes + sum(n.non_trainable_bytes for n in nodes)
    per_sample = sum(n.activation_bytes for n in nodes) + max(n.output_bytes for n in nodes)
    batch = (GiB - static) // per_sample  # fits the card's nominal memory
    usable = GiB - 512 * MiB - int(0.05 * GiB)
    assert static + batch * per_sample > usable
    plan = baselines.single_device(conv, cluster, batch)
    result = simulate(conv, cluster, plan)
    assert not result.feasible
    peak = result.peak_memory_bytes[device]
    assert peak <= GiB
    assert (f"{device} needs {peak} bytes, counting 2 optimizer slots per parameter "
            f"(optimizer unknown, as Adam), but can use {usable} of its {GiB} "
            f"({GiB - usable} reserved for the CUDA context and allocator)"
            ) in result.infeasible_reason
    assert f"short by {peak - usable} bytes" in result.infeasible_reason
    assert baselines.memory_capacity_samples(conv, cluster, device) < batch
    plan.prediction = result.to_prediction()
    text = render_text(explanation(plan, cluster, strategy_name="single_device"),
                       use_rich=False)
    assert "reserved for the CUDA context and allocator" in text


def test_a_small_shortfall_is_shown_in_kib_not_as_zero_mib(tinymem):
    cluster = Cluster.from_yaml(tinymem)
    graph = ModelGraph.from_keras(_tiny("adam"))
    result = simulate(graph, cluster, baselines.data_parallel_even(graph, cluster, 48))
    assert not result.feasible
    name = cluster.names[0]
    short = result.peak_memory_bytes[name] - cluster.device(name).memory_bytes
    assert 0 < short < 0.1 * MiB
    assert f"short by {short} bytes, {short / 1024:.1f} KiB)" in result.infeasible_reason
    assert "0.0 MiB" not in result.infeasible_reason


# ------------------------------------------------------------ C: optimizer slots
@pytest.mark.parametrize("make, slots, name", [
    (lambda: keras.optimizers.SGD(0.01), 0, "SGD"),
    (lambda: keras.optimizers.SGD(0.01, momentum=0.9), 1, "SGD"),
    (lambda: keras.optimizers.RMSprop(), 1, "RMSprop"),
    (lambda: keras.optimizers.RMSprop(centered=True), 2, "RMSprop"),
    (lambda: keras.optimizers.Adagrad(), 1, "Adagrad"),
    (lambda: keras.optimizers.Adam(), 2, "Adam"),
    (lambda: keras.optimizers.Adam(amsgrad=True), 3, "Adam"),
    (lambda: keras.optimizers.AdamW(), 2, "AdamW"),
    (lambda: keras.optimizers.Nadam(), 2, "Nadam"),
    (lambda: keras.optimizers.Adamax(), 2, "Adamax"),
    (lambda: keras.optimizers.Lamb(), 2, "Lamb"),
    (lambda: keras.optimizers.Adadelta(), 2, "Adadelta"),
    (lambda: keras.optimizers.Ftrl(), 2, "Ftrl"),
    (lambda: keras.optimizers.Lion(), 1, "Lion"),
    (lambda: keras.optimizers.Adafactor(), 1, "Adafactor"),
    (lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()), 0, "SGD"),
    (lambda: "sgd", 0, "SGD"),
])
def test_the_graph_records_the_compiled_optimizers_slots(make, slots, name):
    graph = ModelGraph.from_keras(_tiny(make()))
    assert graph.optimizer_slots == slots
    assert graph.optimizer == name


def test_unknown_or_missing_optimizer_counts_two_slots():
    class Plain(keras.optimizers.Optimizer):
        def update_step(self, gradient, variable, learning_rate):
            variable.assign(variable - learning_rate * gradient)

    graph = ModelGraph.from_keras(_tiny(Plain(0.01)))
    assert graph.optimizer_slots == 2 and graph.optimizer.startswith("Plain (unknown")
    uncompiled = ModelGraph.from_keras(_tiny())
    assert uncompiled.optimizer_slots == 2 and uncompiled.optimizer is None


def test_optimizer_slots_round_trip_but_stay_out_of_the_fingerprint(tinymem):
    sgd = ModelGraph.from_keras(_tiny("sgd"))
    adam = ModelGraph.from_keras(_tiny("adam"))
    again = ModelGraph.from_dict(sgd.to_dict())
    assert (again.optimizer_slots, again.optimizer) == (0, "SGD")
    old = sgd.to_dict()
    old.pop("optimizer_slots")
    old.pop("optimizer")
    assert ModelGraph.from_dict(old).optimizer_slots == 2  # JSON written before the field
    assert sgd.fingerprint() == adam.fingerprint()
    cluster = Cluster.from_yaml(tinymem)
    keys = {cache_key(g, cluster, 48, cluster.names, ["data_parallel"], {})
            for g in (sgd, adam)}
    assert len(keys) == 2


def test_sgd_fits_where_adam_does_not(tinymem):
    cluster = Cluster.from_yaml(tinymem)
    sgd = ModelGraph.from_keras(_tiny(keras.optimizers.SGD(0.01)))
    adam = ModelGraph.from_keras(_tiny(keras.optimizers.Adam()))
    result = simulate(sgd, cluster, baselines.data_parallel_even(sgd, cluster, 48))
    assert result.feasible, result.infeasible_reason
    name = cluster.names[0]
    assert result.per_device[name].memory_breakdown["optimizer_slots"] == 0
    assert result.peak_memory_bytes[name] == 2 * sgd.param_bytes + 16 * (
        sgd.activation_bytes + max(n.output_bytes for n in sgd.nodes.values()))
    refused = simulate(adam, cluster, baselines.data_parallel_even(adam, cluster, 48))
    assert not refused.feasible
    assert "2 optimizer slots per parameter (Adam)" in refused.infeasible_reason
    plan = baselines.proportional(sgd, cluster, 48)  # the faster core gets more samples
    assert sum(plan.groups[0].shares) == 48
    assert simulate(sgd, cluster, plan).feasible
    with pytest.raises(PlanError, match=r"optimizer slots per parameter \(Adam\)"):
        baselines.proportional(adam, cluster, 48)
    assert (baselines.memory_capacity_samples(sgd, cluster, name)
            > baselines.memory_capacity_samples(adam, cluster, name) >= 0)


def test_auto_strategy_plans_an_sgd_model_by_its_optimizer(tinymem):
    strategy = AutoStrategy(strategy="data_parallel", cluster=str(tinymem))
    with strategy.scope():
        model = _tiny(keras.optimizers.SGD(0.01))
    plan = strategy.plan_for(model, 48)
    assert plan.prediction.feasible, plan.prediction.infeasible_reason
    assert strategy.graph.optimizer_slots == 0


@pytest.mark.parametrize("make", [
    lambda: keras.optimizers.SGD(0.01, momentum=0.9, gradient_accumulation_steps=4),
    lambda: keras.optimizers.Adam(gradient_accumulation_steps=4),
    lambda: keras.optimizers.Adam(amsgrad=True, use_ema=True),
    lambda: keras.optimizers.RMSprop(centered=True, momentum=0.5),
    lambda: keras.optimizers.SGD(0.01),
    lambda: keras.optimizers.Nadam(),
])
def test_slot_counts_match_the_variables_keras_builds(make):
    """Counted per parameter as Keras builds them (gradient accumulation keeps one
    accumulator per variable: it was not counted until the session-26 review)."""
    model = _tiny(make())
    optimizer = model.optimizer
    optimizer.build(model.trainable_variables)
    shapes = [tuple(v.shape) for v in model.trainable_variables]
    full = sum(int(np.prod(v.shape)) for v in optimizer.variables
               if tuple(v.shape) in shapes and tuple(v.shape) != ())
    params = sum(int(np.prod(s)) for s in shapes)
    assert full % params == 0
    assert ModelGraph.from_keras(model).optimizer_slots == full // params
