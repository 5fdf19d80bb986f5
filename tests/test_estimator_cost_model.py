"""The analytic roofline cost model on real Keras layers and real device specs."""

import keras
import pytest

from autodist_keras.devices import Cluster
from autodist_keras.errors import EstimatorError
from autodist_keras.estimator import AnalyticCostModel
from autodist_keras.estimator import cost_model as cm
from autodist_keras.graph import ModelGraph

# The roofline alone: the PyTorch backend adds host time on GPUs (tested below).
ROOFLINE = "tensorflow"


@pytest.fixture(scope="module")
def graph():
    inputs = keras.Input((2048,), name="x")
    big = keras.layers.Dense(4096, name="big")(inputs)
    act = keras.layers.ReLU(name="relu")(big)
    outputs = keras.layers.Dense(8, name="small")(act)
    return ModelGraph.from_keras(keras.Model(inputs, outputs))


@pytest.fixture(scope="module")
def cluster():
    return Cluster.from_string("1xV100,1xT4")


def test_compute_bound_layer_follows_peak_flops(graph, cluster):
    cost = AnalyticCostModel(cluster, framework=ROOFLINE)
    node = graph.nodes["big"]
    v100 = cluster.devices[0]
    batch = 512
    flops_time = node.forward_flops * batch / (v100.peak_flops_fp32 * 0.55)
    memory_time = (
        sum(v.bytes for v in node.variables) + (2048 * 4 + node.output_bytes) * batch
    ) / (v100.memory_bandwidth * 0.75)
    assert flops_time > memory_time  # this layer is compute-bound on a V100
    t = cost.layer_time(node, v100, batch, "forward")
    assert t == pytest.approx(flops_time + cm.LAUNCH_OVERHEAD_S["gpu"], rel=1e-12)
    # Backward has twice the FLOPs and two kernels (input and weight gradients).
    tb = cost.layer_time(node, v100, batch, "backward")
    assert tb == pytest.approx(
        node.backward_flops * batch / (v100.peak_flops_fp32 * 0.55) + 2 * 8e-6, rel=1e-12
    )
    # Mixed precision uses the FP16 (tensor core) peak for matmul-like layers.
    mixed = AnalyticCostModel(cluster, framework=ROOFLINE, precision="mixed")
    assert mixed.layer_time(node, v100, batch, "forward") < t / 4
    # A slower device takes longer; more samples take longer.
    t4 = cluster.devices[1]
    assert cost.layer_time(node, t4, batch, "forward") > t
    assert cost.layer_time(node, v100, 2 * batch, "forward") > t


@pytest.mark.parametrize("policy, gpu, tensor_cores", [
    ("mixed_float16", "V100", True), ("float16", "T4", True),
    ("mixed_bfloat16", "A100", True), ("bfloat16", "H100", True),
    ("mixed_bfloat16", "V100", False),  # Volta has no bfloat16 tensor cores
])
def test_a_layer_computing_in_half_precision_uses_the_fp16_peak(policy, gpu, tensor_cores):
    """A model under a mixed-precision policy was priced at the FP32 peak (V100: 15.7
    instead of 125 TFLOP/s) unless the cost model was made with precision='mixed',
    which AutoStrategy never did: the graph's output dtypes say it."""
    inputs = keras.Input((2048,))
    half = keras.layers.Dense(4096, dtype=policy, name="big")(inputs)
    graph = ModelGraph.from_keras(keras.Model(inputs, half))
    node = graph.nodes["big"]
    assert node.output_dtypes[0] in ("float16", "bfloat16")
    cluster = Cluster.from_string(f"1x{gpu}")
    device, batch = cluster.devices[0], 512
    cost = AnalyticCostModel(cluster, framework=ROOFLINE)
    t = cost.layer_time(node, device, batch, "forward")
    peak = device.peak_flops_fp16 if tensor_cores else device.peak_flops_fp32
    assert t == pytest.approx(node.forward_flops * batch / (peak * 0.55)
                              + cm.LAUNCH_OVERHEAD_S["gpu"], rel=1e-12)


def test_memory_bound_layer_follows_bandwidth(graph, cluster):
    cost = AnalyticCostModel(cluster, framework=ROOFLINE)
    node = graph.nodes["relu"]
    v100 = cluster.devices[0]
    batch = 512
    moved = (4096 * 4 + node.output_bytes) * batch
    assert cost.layer_time(node, v100, batch, "forward") == pytest.approx(
        moved / (v100.memory_bandwidth * 0.75) + 8e-6, rel=1e-12
    )
    back = (2 * 4096 * 4 + node.output_bytes) * batch
    assert cost.layer_time(node, v100, batch, "backward") == pytest.approx(
        back / (v100.memory_bandwidth * 0.75) + 8e-6, rel=1e-12
    )


def test_free_cases_update_and_cpu_constants(graph, cluster):
    cost = AnalyticCostModel(cluster, framework=ROOFLINE)
    v100 = cluster.devices[0]
    assert cost.layer_time(graph.nodes["x"], v100, 512, "forward") == 0.0
    assert cost.layer_time(graph.nodes["big"], v100, 0, "backward") == 0.0
    # Adam: 7 x parameter bytes through memory, one launch per tensor.
    assert cost.update_time(10**8, v100, 3) == pytest.approx(
        7e8 / (v100.memory_bandwidth * 0.75) + 3 * 8e-6, rel=1e-12
    )
    cpu_cluster = Cluster.from_dict(
        {"nodes": [{"name": "node0", "cpus": [{"cores": [0], "threads": 1}]}]}
    )
    cpu = cpu_cluster.devices[0]
    small = graph.nodes["small"]
    cpu_cost = AnalyticCostModel(cpu_cluster)
    expected = max(
        small.forward_flops * 4 / (cpu.peak_flops_fp32 * 0.40),
        (sum(v.bytes for v in small.variables) + (4096 * 4 + small.output_bytes) * 4)
        / (cpu.memory_bandwidth * 0.50),
    ) + 25e-6
    assert cpu_cost.layer_time(small, cpu, 4, "forward") == pytest.approx(expected, rel=1e-12)
    # Device names resolve through the bound cluster.
    assert cost.layer_time(small, v100.name, 4, "forward") == cost.layer_time(
        small, v100, 4, "forward"
    )


def test_constants_can_be_overridden_and_are_checked(graph, cluster):
    node = graph.nodes["big"]
    v100 = cluster.devices[0]
    slow = AnalyticCostModel(cluster, framework=ROOFLINE,
                             compute_efficiency={"gpu": {"matmul": 0.275}})
    base = AnalyticCostModel(cluster, framework=ROOFLINE)
    overhead = cm.LAUNCH_OVERHEAD_S["gpu"]
    assert slow.layer_time(node, v100, 512, "forward") - overhead == pytest.approx(
        2 * (base.layer_time(node, v100, 512, "forward") - overhead), rel=1e-12
    )
    assert slow.config()["compute_efficiency"]["gpu"]["matmul"] == 0.275
    with pytest.raises(EstimatorError, match=r"Received: 1\.5"):
        AnalyticCostModel(cluster, memory_efficiency={"gpu": 1.5})
    with pytest.raises(EstimatorError, match="Received: precision='int8'"):
        AnalyticCostModel(cluster, precision="int8")
    with pytest.raises(EstimatorError, match="Received: phase='sideways'"):
        base.layer_time(node, v100, 1, "sideways")
    with pytest.raises(EstimatorError, match="with_cluster"):
        AnalyticCostModel().transfer_time(1024, "node0/gpu0", "node0/gpu1")
    bound = AnalyticCostModel().with_cluster(cluster)
    assert bound.transfer_time(1024, *cluster.names) > 0


def test_host_time_on_a_gpu_under_the_torch_backend(graph, cluster):
    # Eager Keras on PyTorch spends a fixed host time per layer call; a GPU
    # cannot run a layer faster than the host dispatches it (measured on
    # H200s: docs/estimator.md, "On a GPU").
    torch_cost = AnalyticCostModel(cluster, framework="torch")
    traced = AnalyticCostModel(cluster, framework="tensorflow")
    v100 = cluster.devices[0]
    small, relu = graph.nodes["small"], graph.nodes["relu"]
    assert traced.layer_time(small, v100, 8, "forward") < 20e-6  # roofline + one launch
    assert torch_cost.layer_time(small, v100, 8, "forward") == cm.TORCH_GPU_HOST_S["Dense"]
    assert torch_cost.layer_time(relu, v100, 8, "forward") == cm.TORCH_GPU_HOST_S["ReLU"]
    # Backward runs in PyTorch's C++ autograd engine: no host time is added.
    assert torch_cost.layer_time(small, v100, 8, "backward") == traced.layer_time(
        small, v100, 8, "backward")
    # A layer whose kernels outlast the host's dispatch keeps its device time.
    big = graph.nodes["big"]
    assert torch_cost.layer_time(big, v100, 4096, "forward") == traced.layer_time(
        big, v100, 4096, "forward") > cm.TORCH_GPU_HOST_S["Dense"]
    # A type not in the table takes its category's figure.
    assert torch_cost.host_time("SeparableConv2D", v100, "forward") == (
        cm.TORCH_GPU_HOST_BY_CATEGORY_S["depthwise"])
    assert torch_cost.host_time("Dropout", v100, "forward") == (
        cm.TORCH_GPU_HOST_BY_CATEGORY_S["other"])
    assert torch_cost.step_overhead_time(v100) == cm.TORCH_GPU_STEP_HOST_S
    assert traced.step_overhead_time(v100) == 0.0
    # CPU devices are unchanged (their overheads are in the learned estimator).
    cpu = Cluster.cpu_testbed()
    cpu0 = cpu.device("node0/cpu0")
    assert AnalyticCostModel(cpu, framework="torch").layer_time(small, cpu0, 8, "forward") == (
        AnalyticCostModel(cpu, framework="tensorflow").layer_time(small, cpu0, 8, "forward"))
    assert AnalyticCostModel(cpu, framework="torch").step_overhead_time(cpu0) == 0.0
    assert torch_cost.config()["framework"] == "torch"


def test_framework_defaults_to_the_active_backend_and_enters_the_step(graph, cluster):
    from autodist_keras.estimator.simulator import simulate
    from autodist_keras.strategies import baselines

    assert AnalyticCostModel(cluster).framework == keras.backend.backend()
    plan = baselines.single_device(graph, cluster, 64, device=cluster.devices[0].name)
    with_host = simulate(graph, cluster, plan, cost_model=AnalyticCostModel(cluster,
                                                                           framework="torch"))
    without = simulate(graph, cluster, plan, cost_model=AnalyticCostModel(
        cluster, framework="tensorflow"))
    assert with_host.step_time_s >= without.step_time_s + cm.TORCH_GPU_STEP_HOST_S
    assert with_host.cost_model["framework"] == "torch"


@pytest.mark.parametrize("sync", ["allreduce", "ps"])
def test_every_replica_pays_the_step_host_time_also_under_a_parameter_server(
        graph, cluster, sync):
    """A PS plan's replicas apply no update of their own, yet still step (and pay the
    torch-on-GPU host time); PS plans were once predicted 4x faster for that reason."""
    from autodist_keras.estimator.simulator import simulate
    from autodist_keras.strategies import baselines

    names = [d.name for d in cluster.devices[:2]]
    plan = baselines.data_parallel_even(graph, cluster, 64, devices=names, sync=sync)
    with_host = simulate(graph, cluster, plan, cost_model=AnalyticCostModel(cluster,
                                                                           framework="torch"))
    without = simulate(graph, cluster, plan, cost_model=AnalyticCostModel(
        cluster, framework="tensorflow"))
    assert with_host.step_time_s >= without.step_time_s + cm.TORCH_GPU_STEP_HOST_S
