"""The simulator against closed forms, on real Keras graphs and real clusters."""

import json

import keras
import pytest

from autodist_keras.devices import Cluster
from autodist_keras.errors import ClusterSpecError
from autodist_keras.errors import EstimatorError
from autodist_keras.errors import PlanError
from autodist_keras.estimator import AnalyticCostModel
from autodist_keras.estimator import CostModel
from autodist_keras.estimator import simulate
from autodist_keras.estimator import comm
from autodist_keras.graph import ModelGraph
from autodist_keras.strategies import baselines
from autodist_keras.strategies.plan import LayerGroup
from autodist_keras.strategies.plan import Plan
from autodist_keras.strategies.plan import Prediction
from autodist_keras.strategies.plan import Replica
from autodist_keras.strategies.plan import SyncSpec


def _chain(width=256, depth=4, d_in=64, name="chain"):
    inputs = keras.Input((d_in,), name="x")
    x = inputs
    for i in range(depth):
        x = keras.layers.Dense(width, activation="relu", name=f"d{i}")(x)
    outputs = keras.layers.Dense(10, name="head")(x)
    return keras.Model(inputs, outputs, name=name)


def _branches():
    inputs = keras.Input((32,), name="x")
    a = keras.layers.Dense(64, name="left")(inputs)
    b = keras.layers.Dense(64, name="right")(inputs)
    outputs = keras.layers.Add(name="join")([a, b])
    return keras.Model(inputs, outputs, name="branches")


@pytest.fixture(scope="module")
def chain():
    return ModelGraph.from_keras(_chain())


@pytest.fixture(scope="module")
def wide():
    # 8 x (1024 x 1024) Dense: 32 MiB of gradients, enough to make communication matter.
    return ModelGraph.from_keras(_chain(width=1024, depth=8, d_in=1024, name="wide"))


def _compute(graph, cost, device, share):
    return sum(
        cost.layer_time(node, device, share, phase)
        for node in graph.nodes.values()
        for phase in ("forward", "backward")
    )


def _update(graph, cost, device, names=None):
    """A device's optimizer update task: the update and the step's fixed host time."""
    variables = [v for v in graph.variables if names is None or v.name in names]
    return (cost.update_time(sum(v.bytes for v in variables), device, len(variables))
            + cost.step_overhead_time(device))


def _manual_plan(graph, batch, groups, sync=None):
    """A plan with explicit groups: [(name, layers, [(device, share), ...]), ...]."""
    return Plan(
        global_batch_size=batch,
        groups=[
            LayerGroup(name, list(layers), [Replica(d, s) for d, s in replicas])
            for name, layers, replicas in groups
        ],
        sync={v.name: (sync or SyncSpec()) for v in graph.variables},
        buckets=baselines.gradient_buckets(graph, 0),
    )


def test_single_device_chain_sums_its_layers(chain):
    cluster = Cluster.from_string("1xV100")
    cost = AnalyticCostModel(cluster)
    plan = baselines.single_device(chain, cluster, 64)
    result = simulate(chain, cluster, plan)
    device = cluster.devices[0]
    expected = _compute(chain, cost, device, 64) + _update(chain, cost, device)
    assert result.step_time_s == pytest.approx(expected, rel=1e-12)
    stats = result.per_device[device.name]
    assert stats.busy_s == pytest.approx(expected, rel=1e-12)
    assert stats.exposed_comm_s == 0.0 and stats.idle_s == pytest.approx(0.0, abs=1e-15)
    # Forward runs in topological order, then backward in reverse, then the update.
    names = [e.name for e in result.timeline if e.stream == "compute"]
    layers = [n for n in chain.nodes if chain.nodes[n].layer_type != "InputLayer"]
    assert names[: len(layers)] == [f"{n}:forward" for n in layers]
    assert names[len(layers): 2 * len(layers)] == [f"{n}:backward" for n in reversed(layers)]
    assert names[-1].startswith("optimizer update")


def test_ring_allreduce_in_the_step_matches_the_closed_form(wide):
    cluster = Cluster.from_string("4xV100")
    plan = baselines.data_parallel_even(wide, cluster, 256, bucket_bytes=float("inf"))
    assert len(plan.buckets) == 1
    result = simulate(wide, cluster, plan)
    topo = cluster.topology
    bw, lat = topo.bandwidth(*cluster.names[:2]), topo.latency(*cluster.names[:2])
    size = wide.param_bytes
    expected = 2 * 3 / 4 * size / bw + 2 * 3 * lat
    collectives = [e for e in result.timeline if e.kind == "allreduce"]
    assert {e.device for e in collectives} == set(cluster.names)
    for event in collectives:
        assert event.end - event.start == pytest.approx(expected, rel=1e-12)


def test_overlap_bounds_and_no_overlap_exact(wide):
    # Two nodes over 25 Gbit/s Ethernet: communication is comparable to compute.
    cluster = Cluster.from_string("node0:1xV100;node1:1xV100@25")
    cost = AnalyticCostModel(cluster)
    device = cluster.devices[0]
    batch = 2048
    compute = _compute(wide, cost, device, batch // 2) + _update(wide, cost, device)
    per_variable = baselines.data_parallel_even(wide, cluster, batch, bucket_bytes=0)
    comm_total = sum(
        cost.allreduce_time(sum(wide_bytes(wide, b)), cluster.names, "ring")
        for b in per_variable.buckets
    )
    overlapped = simulate(wide, cluster, per_variable).step_time_s
    assert max(compute, comm_total) <= overlapped <= compute + comm_total
    # Strictly inside: some communication hides behind backward, some does not.
    assert max(compute, comm_total) * 1.001 < overlapped < (compute + comm_total) * 0.999
    # One bucket for everything waits for the last gradient: no overlap at all.
    one = baselines.data_parallel_even(wide, cluster, batch, bucket_bytes=float("inf"))
    serial = simulate(wide, cluster, one)
    one_comm = cost.allreduce_time(wide.param_bytes, cluster.names, "ring")
    assert serial.step_time_s == pytest.approx(compute + one_comm, rel=1e-9)
    stats = serial.per_device[device.name]
    assert stats.exposed_comm_s == pytest.approx(one_comm, rel=1e-9)
    assert stats.busy_s + stats.exposed_comm_s + stats.idle_s == pytest.approx(
        serial.step_time_s, rel=1e-9
    )


def wide_bytes(graph, names):
    sizes = {v.name: v.bytes for v in graph.variables}
    return [sizes[n] for n in names]


@pytest.mark.parametrize("per_device", [8, 64, 512])
def test_a_slower_device_never_speeds_up_an_even_split(chain, per_device):
    fast = Cluster.from_string("3xV100")
    mixed = Cluster.from_string("2xV100,1x1080Ti")
    # Replacing a device by a slower one, same batch.
    t_fast = simulate(chain, fast, baselines.data_parallel_even(chain, fast, 3 * per_device))
    t_mixed = simulate(chain, mixed, baselines.data_parallel_even(chain, mixed, 3 * per_device))
    assert t_mixed.step_time_s >= t_fast.step_time_s
    # Adding a slower device with the same per-device share.
    two = baselines.data_parallel_even(chain, mixed, 2 * per_device, devices=mixed.names[:2])
    three = baselines.data_parallel_even(chain, mixed, 3 * per_device)
    assert simulate(chain, mixed, three).step_time_s >= simulate(chain, mixed, two).step_time_s


def test_proportional_not_slower_than_even_on_mixed_clusters(wide, chain):
    for spec in ("2xV100,2x1080Ti", "node0:2xV100;node1:2xT4@25", "1xA100,1xK80"):
        cluster = Cluster.from_string(spec)
        for graph, batch in ((wide, 512), (chain, 256)):
            even = simulate(graph, cluster, baselines.data_parallel_even(graph, cluster, batch))
            prop = simulate(graph, cluster, baselines.proportional(graph, cluster, batch))
            assert prop.step_time_s <= even.step_time_s * (1 + 1e-9), spec
    try:
        testbed = Cluster.cpu_testbed()
    except ClusterSpecError:
        pytest.skip("the CPU testbed needs cores 0 and 1")
    even = simulate(chain, testbed, baselines.data_parallel_even(chain, testbed, 96))
    prop = simulate(chain, testbed, baselines.proportional(chain, testbed, 96))
    assert prop.step_time_s < even.step_time_s


def test_ps_server_link_is_shared_by_its_clients(wide):
    cluster = Cluster.from_string("5xV100")
    server = cluster.names[0]
    times, pushes_per_n = [], {}
    for n in (2, 3, 4, 5):
        devices = cluster.names[:n]
        plan = baselines.data_parallel_even(
            wide, cluster, 16 * n, devices=devices, sync="ps", ps_server=server,
            bucket_bytes=float("inf"),
        )
        result = simulate(wide, cluster, plan)
        times.append(result.step_time_s)
        pushes = sorted(
            (e for e in result.timeline if e.kind == "ps_push" and e.device == server),
            key=lambda e: e.start,
        )
        assert len(pushes) == n - 1
        for before, after in zip(pushes, pushes[1:]):  # serialised on the server's link
            assert after.start >= before.end - 1e-15
        pushes_per_n[n] = pushes
        # Push and pull of n-1 clients through one link: at least the closed form.
        lat, bw = cluster.topology.latency(server, devices[1]), cluster.topology.bandwidth(
            server, devices[1]
        )
        assert result.per_device[server].comm_s >= comm.ps_time(
            wide.param_bytes, n - 1, bw, lat
        ) * (1 - 1e-9)
    assert times == sorted(times) and len(set(times)) == len(times)


def test_a_ps_servers_host_time_follows_its_applies(chain):
    # Under PyTorch on GPUs every replica pays a fixed host time per step. Until
    # session 30 the server's could start once its own compute was done and hold
    # its compute stream between two applies, delaying every later pull: 10.20 ms
    # predicted here instead of 6.24 ms.
    from autodist_keras.estimator.cost_model import TORCH_GPU_STEP_HOST_S

    cluster = Cluster.from_string("2xV100,2x1080Ti")
    plan = baselines.data_parallel_even(chain, cluster, 64, sync="ps", bucket_bytes=0)
    result = simulate(chain, cluster, plan,
                      cost_model=AnalyticCostModel(cluster, framework="torch"))
    server = [e for e in result.timeline if e.device == "node0/gpu0"]
    applies = [e.end for e in server if e.kind == "ps_update"]
    (host,) = [e for e in server if e.kind == "update"]
    assert len(applies) == len(chain.variables) and host.start >= max(applies)
    last_pull = max(e.end for e in result.timeline if e.kind == "ps_pull")
    assert result.step_time_s == pytest.approx(last_pull + TORCH_GPU_STEP_HOST_S, rel=1e-12)


def test_model_parallel_chain_matches_its_critical_path(chain):
    cluster = Cluster.from_string("2xV100")
    cost = AnalyticCostModel(cluster)
    d0, d1 = cluster.devices
    layers = list(chain.nodes)
    first, second = layers[:3], layers[3:]
    batch = 128
    plan = _manual_plan(
        chain, batch, [("a", first, [(d0.name, batch)]), ("b", second, [(d1.name, batch)])]
    )
    result = simulate(chain, cluster, plan)

    def phase(names, device, which):
        return sum(cost.layer_time(chain.nodes[n], device, batch, which) for n in names)

    edge = [b for s, d, b in chain.edges if s == first[-1] and d == second[0]][0]
    x_fwd = cost.transfer_time(edge * batch, d0.name, d1.name)
    x_bwd = cost.transfer_time(edge * batch, d1.name, d0.name)
    vars_a = {v.name for n in first for v in chain.nodes[n].variables}
    upd_a = _update(chain, cost, d0, vars_a)
    upd_b = _update(chain, cost, d1, {v.name for v in chain.variables} - vars_a)
    head = phase(first, d0, "forward") + x_fwd + phase(second, d1, "forward") + phase(
        second, d1, "backward"
    )
    expected = max(head + upd_b, head + x_bwd + phase(first, d0, "backward") + upd_a)
    assert result.step_time_s == pytest.approx(expected, rel=1e-12)
    transfers = [e for e in result.timeline if e.kind == "transfer" and e.device == d0.name]
    assert sorted(e.name for e in transfers) == sorted(
        [f"{first[-1]}->{second[0]} activations", f"{second[0]}->{first[-1]} gradients"]
    )
    # Each device holds only its group's parameters (+ gradients + 2 Adam slots).
    bytes_a = sum(v.bytes for v in chain.variables if v.name in vars_a)
    assert result.per_device[d0.name].memory_breakdown["parameters"] == bytes_a
    assert result.per_device[d1.name].memory_breakdown["optimizer_slots"] == 2 * (
        chain.param_bytes - bytes_a
    )


def test_an_output_read_twice_on_another_device_crosses_once(fan_out):
    # TensorFlow sends one copy of a tensor per device, and sums the readers'
    # gradients there before sending them back: one transfer each way, and the
    # received activation is held once.
    graph = fan_out
    cluster = Cluster.from_string("2xV100")
    cost = AnalyticCostModel(cluster)
    d0, d1 = cluster.names
    batch = 256
    plan = _manual_plan(graph, batch, [("g0", ["x", "a"], [(d0, batch)]),
                                       ("g1", ["b1", "b2", "join", "out"], [(d1, batch)])])
    result = simulate(graph, cluster, plan)
    sent = [e for e in result.timeline if e.kind == "transfer" and e.device == d0]
    assert sorted(e.name for e in sent) == ["a->b1 (+1 more) activations",
                                            "b1 (+1 more)->a gradients"]
    one = cost.transfer_time(4096 * 4 * batch, d0, d1)
    for e in sent:
        assert e.end - e.start == pytest.approx(one, rel=1e-12)
    # d1's activations: its own layers' outputs plus one received copy of a's.
    own = sum(graph.nodes[n].activation_bytes for n in ("b1", "b2", "join", "out")) * batch
    assert result.per_device[d1].memory_breakdown["activations_peak"] == own + 4096 * 4 * batch


def test_split_op_and_hybrid_groups(chain):
    cluster = Cluster.from_string("3xV100")
    cost = AnalyticCostModel(cluster)
    d0, d1, d2 = cluster.names
    layers = list(chain.nodes)
    batch = 64
    # FastT split: layer d2 runs on two devices, half the batch each.
    rest = [n for n in layers if n != "d2"]
    split = _manual_plan(
        chain, batch, [("rest", rest, [(d0, batch)]), ("split", ["d2"], [(d0, 32), (d1, 32)])]
    )
    result = simulate(chain, cluster, split)
    moved = {e.name: e for e in result.timeline if e.kind == "transfer" and e.device == d1}
    assert set(moved) == {
        "d1->d2 activations", "d2->d1 gradients", "d2->d3 activations", "d3->d2 gradients"
    }
    edge = [b for s, d, b in chain.edges if (s, d) == ("d1", "d2")][0]
    event = moved["d1->d2 activations"]
    assert event.end - event.start == pytest.approx(cost.transfer_time(edge * 32, d0, d1))
    reduces = [e for e in result.timeline if e.kind == "allreduce"]
    assert {e.device for e in reduces} == {d0, d1}
    assert result.step_time_s > 0 and result.feasible
    # HeteroG hybrid: the body data-parallel on two devices (uneven), the head on a third.
    hybrid = _manual_plan(
        chain, batch,
        [("body", layers[:-1], [(d0, 40), (d1, 24)]), ("head", layers[-1:], [(d2, batch)])],
    )
    result = simulate(chain, cluster, hybrid)
    into_head = [
        e for e in result.timeline if e.kind == "transfer" and e.device == d2
        and e.name.endswith("activations")
    ]
    assert sorted(round((e.end - e.start) * 1e12) for e in into_head) == sorted(
        round(cost.transfer_time(b * s, src, d2) * 1e12)
        for b in [[b for s_, d, b in chain.edges if d == "head"][0]]
        for src, s in ((d0, 40), (d1, 24))
    )
    head_bytes = sum(v.bytes for v in chain.nodes["head"].variables)
    assert result.per_device[d2].memory_breakdown["parameters"] == head_bytes
    assert not [e for e in result.timeline if e.kind == "allreduce" and e.device == d2]


def test_peak_memory_closed_form_and_infeasible_plan(chain):
    cluster = Cluster.from_string("1xV100")
    batch = 96
    result = simulate(chain, cluster, baselines.single_device(chain, cluster, batch))
    device = cluster.names[0]
    activations = sum(n.output_bytes for n in chain.nodes.values()) * batch
    # ... plus the backward gradient buffer: the largest output, per sample.
    buffer = max(n.output_bytes for n in chain.nodes.values()) * batch
    assert result.peak_memory_bytes[device] == 4 * chain.param_bytes + activations + buffer
    assert result.per_device[device].memory_breakdown["gradient_buffer"] == buffer
    assert result.feasible and result.infeasible_reason is None
    tiny = Cluster.from_dict(
        {"nodes": [{"name": "node0", "gpus": [
            {"name": "Tiny", "memory_gb": 0.0005, "fp32_tflops": 10, "bandwidth_gbps": 500}
        ]}]}
    )
    result = simulate(chain, tiny, baselines.single_device(chain, tiny, 4096))
    need = result.peak_memory_bytes["node0/gpu0"]
    have = tiny.devices[0].memory_bytes
    # A GPU keeps 512 MiB + 5% for the CUDA context and allocator: all of this one.
    usable = result.per_device["node0/gpu0"].usable_memory_bytes
    assert usable == 0
    assert not result.feasible and need > have
    assert "node0/gpu0" in result.infeasible_reason
    assert f"short by {need - usable} bytes" in result.infeasible_reason
    assert result.to_prediction().feasible is False


def test_trace_prediction_and_plan_round_trip(chain, tmp_path):
    cluster = Cluster.from_string("node0:2xV100;node1:2x1080Ti@25")
    plan = baselines.proportional(chain, cluster, 128, algorithm="hierarchical", bucket_bytes=0)
    result = simulate(chain, cluster, plan)
    path = result.export_trace(tmp_path / "trace.json")
    trace = json.loads(open(path).read())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(result.timeline) > 0
    names = {e["args"]["name"]: e["pid"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert set(names) == set(cluster.names) and len(set(names.values())) == 4
    assert {e["tid"] for e in spans} == {1, 2}  # compute and comm streams
    assert max(e["ts"] + e["dur"] for e in spans) == pytest.approx(result.step_time_s * 1e6)
    # Trace viewers parse strict JSON: a NaN is refused, and nothing is written.
    with pytest.raises(EstimatorError, match="field `otherData.note` is nan"):
        result.export_trace(tmp_path / "bad.json", other_data={"note": float("nan")})
    assert not (tmp_path / "bad.json").exists()
    with pytest.raises(EstimatorError, match="has no JSON form .*Received: TypeError"):
        result.export_trace(tmp_path / "bad.json", other_data={"note": object()})
    assert not (tmp_path / "bad.json").exists()
    prediction = result.to_prediction()
    assert isinstance(prediction, Prediction) and "predicted" in prediction.source
    assert prediction.step_time_s == result.step_time_s
    assert set(prediction.per_device) == set(cluster.names)
    plan.prediction = prediction
    loaded = Plan.from_json(plan.to_json())
    assert loaded.prediction.plan_digest == plan.structure_digest()  # written with the plan
    loaded.prediction.plan_digest = None
    assert loaded.prediction == prediction


def test_dedupe_gives_the_same_result(wide, chain):
    cluster = Cluster.from_string("node0:3xV100;node1:3x1080Ti@25")
    # The last case: per-variable PS buckets, whose pushes become ready together
    # (a layer's kernel and bias); until session 30 a representative's backward
    # released its copies' pushes in another order than simulating every device
    # (2.529 against 2.553 ms).
    for graph, kwargs in ((wide, {}), (wide, {"sync": "ps", "ps_server": "node1/gpu2"}),
                          (wide, {"algorithm": "tree"}),
                          (chain, {"sync": "ps", "ps_server": "node1/gpu2", "bucket_bytes": 0})):
        plan = baselines.proportional(graph, cluster, 600, **kwargs)
        fast = simulate(graph, cluster, plan)
        full = simulate(graph, cluster, plan, dedupe=False)
        assert fast.num_tasks < full.num_tasks
        assert fast.step_time_s == full.step_time_s
        assert fast.peak_memory_bytes == full.peak_memory_bytes
        for name in cluster.names:
            a, b = fast.per_device[name], full.per_device[name]
            assert a.busy_s == pytest.approx(b.busy_s, rel=1e-12)
            assert a.exposed_comm_s == pytest.approx(b.exposed_comm_s, rel=1e-9, abs=1e-15)


def test_devices_differing_only_in_fp16_peak_keep_their_own_layer_times(wide):
    # Until session 30 the simulator shared layer times between devices of one
    # model, FP32 peak and bandwidth: a faster FP16 peak on gpu0 made gpu1 as fast.
    spec = Cluster.from_string("2xV100").to_dict()
    base = Cluster.from_dict(spec)
    spec["devices"][0]["peak_flops_fp16"] *= 4
    faster = Cluster.from_dict(spec)
    plan = baselines.data_parallel_even(wide, base, 2048)
    before, after = (
        simulate(wide, c, plan, cost_model=AnalyticCostModel(c, precision="mixed"))
        for c in (base, faster)
    )
    slow = before.per_device["node0/gpu1"].busy_s
    assert after.per_device["node0/gpu1"].busy_s == slow
    assert after.per_device["node0/gpu0"].busy_s < slow
    assert after.step_time_s == before.step_time_s
    # Disco's balanced shares priced both GPUs by one curve (the same key): even shares.
    from autodist_keras.strategies import disco

    balanced = disco._balanced_base(plan, wide, faster,
                                    AnalyticCostModel(faster, precision="mixed"), 2048)
    assert balanced is not None and balanced.groups[0].shares[0] > balanced.groups[0].shares[1]


def test_plan_order_sets_the_priority():
    graph = ModelGraph.from_keras(_branches())
    cluster = Cluster.from_string("1xV100")
    device = cluster.names[0]
    plan = baselines.single_device(graph, cluster, 32)
    for first, second in (("left", "right"), ("right", "left")):
        plan.order = {device: [[first, "forward"], [second, "forward"], ["join", "forward"],
                               ["join", "backward"], [second, "backward"], [first, "backward"]]}
        result = simulate(graph, cluster, plan)
        names = [e.name for e in result.timeline if e.stream == "compute"]
        assert names.index(f"{first}:forward") < names.index(f"{second}:forward")
        assert names.index(f"{second}:backward") < names.index(f"{first}:backward")


def test_a_replacement_cost_model_is_used(chain):
    class TwiceAsSlow(AnalyticCostModel):
        def layer_time(self, node, device, batch, phase):
            return 2 * super().layer_time(node, device, batch, phase)

    cluster = Cluster.from_string("1xV100")
    plan = baselines.single_device(chain, cluster, 64)
    base = AnalyticCostModel(cluster)
    device = cluster.devices[0]
    slow = simulate(chain, cluster, plan, cost_model=TwiceAsSlow())
    assert slow.step_time_s == pytest.approx(
        2 * _compute(chain, base, device, 64) + _update(chain, base, device), rel=1e-12
    )
    assert slow.cost_model["type"] == "TwiceAsSlow"

    class Constant(CostModel):
        """Not an AnalyticCostModel: 1 ms a layer call, 1 ms an update, 2 ms a reduce."""

        def layer_time(self, node, device, batch, phase):
            return 1e-3

        def transfer_time(self, nbytes, src, dst):
            return 0.0

        def allreduce_time(self, nbytes, devices, algorithm="ring"):
            return 2e-3

        def update_time(self, nbytes, device, num_tensors=1):
            return 1e-3

        def aggregate_time(self, nbytes, num_inputs, device):
            return 0.0

    two = Cluster.from_string("2xV100")
    plan = baselines.data_parallel_even(chain, two, 64, bucket_bytes=float("inf"))
    result = simulate(chain, two, plan, cost_model=Constant())
    # The reduce starts after the first layer's backward (the last gradient)
    # and overlaps the input layer's backward; then the update.
    assert result.step_time_s == pytest.approx((2 * len(chain.nodes) - 1) * 1e-3 + 2e-3 + 1e-3)


def test_invalid_plan_is_rejected(chain):
    cluster = Cluster.from_string("2xV100")
    plan = baselines.data_parallel_even(chain, cluster, 64)
    plan.groups[0].replicas[0] = Replica("node3/gpu9", 32)
    with pytest.raises(PlanError, match="node3/gpu9"):
        simulate(chain, cluster, plan)


def test_buckets_launch_in_plan_order_one_at_a_time(wide):
    cluster = Cluster.from_string("node0:1xV100;node1:1xV100@25")
    plan = baselines.data_parallel_even(wide, cluster, 512, bucket_bytes=0)
    # Reverse the launch order: the first bucket now holds the first layer's
    # gradients, which backward produces last, so every bucket waits for it.
    plan.buckets = list(reversed(plan.buckets))
    result = simulate(wide, cluster, plan)
    device = cluster.names[0]
    reduces = [e for e in result.timeline if e.kind == "allreduce" and e.device == device]
    assert [int(e.name.split()[1][1:]) for e in reduces] == list(range(len(plan.buckets)))
    last_grad = max(
        e.end for e in result.timeline
        if e.device == device and e.kind == "backward" and e.name == "d0:backward"
    )
    assert reduces[0].start >= last_grad
    for before, after in zip(reduces, reduces[1:]):
        assert after.start >= before.end


def test_identical_simulations_are_cached_and_changes_are_not(chain):
    from autodist_keras.estimator import simulator

    cluster = Cluster.from_string("node0:2xV100;node1:2xT4")
    simulator.clear_cache()
    plan = baselines.proportional(chain, cluster, 64)
    first = simulate(chain, cluster, plan)
    assert simulator.cache_stats == {"hits": 0, "misses": 1}
    # Same content (a rebuilt plan, an equal analytic cost model): a hit, equal figures.
    again = simulate(chain, cluster, baselines.proportional(chain, cluster, 64),
                     cost_model=AnalyticCostModel(cluster), validate=False)
    assert simulator.cache_stats["hits"] == 1
    assert again.step_time_s == first.step_time_s
    assert again.per_device.keys() == first.per_device.keys()
    # What the simulation reads changes: a miss and a different answer.
    even = simulate(chain, cluster, baselines.data_parallel_even(chain, cluster, 64))
    assert simulator.cache_stats["misses"] == 2
    assert even.step_time_s != first.step_time_s
    slower = AnalyticCostModel(cluster, launch_overhead_s={"gpu": 1e-3})
    assert simulate(chain, cluster, plan, cost_model=slower).step_time_s > first.step_time_s
    # Notes and provenance are not part of the key.
    plan.notes.append("changed")
    simulate(chain, cluster, plan)
    assert simulator.cache_stats["hits"] == 2
    # A cost model that is not the plain analytic one is never cached; nor is cache=False.
    class Doubled(AnalyticCostModel):
        def layer_time(self, node, device, batch, phase):
            return 2 * super().layer_time(node, device, batch, phase)

    before = dict(simulator.cache_stats)
    simulate(chain, cluster, plan, cost_model=Doubled(cluster))
    simulate(chain, cluster, plan, cache=False)
    assert simulator.cache_stats == before
    simulator.clear_cache()


def _two_gpus(first_tflops, second_tflops):
    return Cluster.from_dict({"nodes": [{"name": "node0", "gpus": [
        {"name": "GPU", "memory_gb": 16, "fp32_tflops": first_tflops, "bandwidth_gbps": 900},
        {"name": "GPU", "memory_gb": 16, "fp32_tflops": second_tflops, "bandwidth_gbps": 900},
    ]}]})


def test_critical_device_is_not_decided_by_float_noise():
    """Two GPUs whose figures are equal up to rounding (one computed, 15.7 x
    (0.1 + 0.2) / 0.3) tie: the critical device is the first in device order,
    whichever of them carries the noise. A real difference still decides."""
    from autodist_keras.graph import zoo

    graph = ModelGraph.from_keras(zoo.small_cnn())
    noisy = 15.7 * (0.1 + 0.2) / 0.3
    assert noisy != 15.7 and abs(noisy / 15.7 - 1) < 1e-15
    figures = []
    for first, second in ((noisy, 15.7), (15.7, noisy)):
        cluster = _two_gpus(first, second)
        result = simulate(graph, cluster, baselines.data_parallel_even(graph, cluster, 64))
        assert result.critical_device == "node0/gpu0", (first, second)
        figures.append(result.to_prediction())
    assert figures[0].compute_s == pytest.approx(figures[1].compute_s, rel=1e-12)
    # The second GPU 1% slower: it finishes last and is the critical device.
    cluster = _two_gpus(15.7, 15.7 * 0.99)
    result = simulate(graph, cluster, baselines.data_parallel_even(graph, cluster, 64))
    assert result.critical_device == "node0/gpu1"
