"""HeteroG: layer groups, LP batch shares, sync choice, memory-aware replication.

Real Keras graphs, real clusters, the real simulator. Planning is
backend-agnostic and cheap, so these tests run under both Keras backends.
The `cnn`, `wide`, `hetero` and `plan_json` fixtures are in conftest.py.
"""

import keras
import pytest

from autodist_keras.devices import Cluster
from autodist_keras.errors import PlanError
from autodist_keras.errors import StrategyError
from autodist_keras.estimator import AnalyticCostModel
from autodist_keras.estimator import simulate
from autodist_keras.estimator import simulator
from autodist_keras.graph import ModelGraph
from autodist_keras.strategies import baselines
from autodist_keras.strategies import heterog
from autodist_keras.strategies._coarse import CoarseCostModel
from autodist_keras.strategies._coarse import CoarseGraph
from autodist_keras.strategies._coarse import contiguous_partition

BIG = 10**9  # no budget stop in tests: results depend only on the work caps


def _nominal_gb(usable_gb):
    """`memory_gb` of a GPU whose usable memory is `usable_gb` GiB.

    A GPU keeps `GPU_MEMORY_RESERVE_BYTES` plus `GPU_MEMORY_RESERVE_FRACTION`
    of its memory for the CUDA context and allocator; plans use the rest.
    """
    return ((usable_gb * 2**30 + simulator.GPU_MEMORY_RESERVE_BYTES)
            / (1 - simulator.GPU_MEMORY_RESERVE_FRACTION) / 2**30)


def _seed_times(graph, cluster, batch):
    """Every baseline HeteroG is seeded with, simulated here independently."""
    speeds = baselines.device_speeds(cluster)
    fastest = max(cluster.names, key=lambda d: (speeds[d], -cluster.names.index(d)))
    plans = [
        baselines.data_parallel_even(graph, cluster, batch),
        baselines.proportional(graph, cluster, batch),
        baselines.proportional(graph, cluster, batch, algorithm="hierarchical"),
        baselines.proportional(graph, cluster, batch, sync="ps", ps_server=fastest),
    ]
    return [simulate(graph, cluster, p) for p in plans]


def test_plan_is_valid_and_carries_the_simulators_prediction(cnn, hetero):
    # The roofline alone (no PyTorch host time): under the PyTorch backend this
    # small CNN is host-bound on every GPU, every plan ties, and HeteroG keeps a
    # seed (which has no execution order).
    cost = AnalyticCostModel(hetero, framework="tensorflow")
    plan = heterog.plan(cnn, hetero, 256, time_budget_s=BIG, cost_model=cost)
    assert plan.validate(cnn, hetero) == []
    assert plan.provenance.planner == "heterog"
    assert plan.provenance.graph_fingerprint == cnn.fingerprint()
    assert plan.provenance.cluster_fingerprint == hetero.fingerprint()
    assert plan.provenance.planning_time_s > 0
    again = simulate(cnn, hetero, plan, cost_model=cost)
    assert plan.prediction.step_time_s == pytest.approx(again.step_time_s, rel=1e-12)
    assert plan.prediction.feasible
    assert {"data_parallel_even", "proportional"} <= set(plan.prediction.baselines)
    assert plan.order and all(plan.order.values())


def test_never_predicted_slower_than_its_seeds(cnn, wide, hetero):
    for graph, batch in ((cnn, 256), (wide, 128)):
        plan = heterog.plan(graph, hetero, batch, time_budget_s=BIG)
        seeds = _seed_times(graph, hetero, batch)
        best = min(r.step_time_s for r in seeds if r.feasible)
        assert plan.prediction.step_time_s <= best * (1 + 1e-9)


def test_shares_are_uneven_on_mixed_gpus(cnn, hetero):
    # The roofline without eager PyTorch's host time: under it this small CNN is
    # host-bound on GPUs, and node0's two V100s alone are predicted fastest.
    cost = AnalyticCostModel(hetero, framework="tensorflow")
    plan = heterog.plan(cnn, hetero, 256, time_budget_s=BIG, cost_model=cost)
    everywhere = [g for g in plan.groups if len(g.replicas) == len(hetero)]
    assert everywhere
    shares = dict(zip(everywhere[0].devices, everywhere[0].shares))
    # The V100s (node0) get more samples than the P100s (node3).
    assert shares["node0/gpu0"] > shares["node3/gpu0"]
    assert sum(shares.values()) == 256


def test_lp_shares_balance_device_times_in_closed_form(wide):
    # Big Dense layers at these batch sizes are compute-bound, so each
    # device's step time is affine in its share: t_d(s) = c_d * s + u_d (u_d
    # includes the optimizer update, slow on the T4's memory). Equal finish
    # times give s_d = (T - u_d) / c_d with T = (B + sum u_d / c_d) / sum 1 / c_d.
    # The roofline alone: PyTorch's host time floors small layers, which makes
    # t_d(s) flat at small shares.
    cluster = Cluster.from_string("2xV100,2xT4")
    cost = AnalyticCostModel(cluster, framework="tensorflow")
    batch = 512
    space = heterog._Space(
        wide, cluster, cost, cluster.names, batch, 4, baselines.DDP_BUCKET_BYTES,
    )
    state = tuple((0, ("ring", None)) for _ in space.units)
    shares = dict(space.solve_shares(state)[0])

    def step(device, s):
        compute = sum(
            cost.layer_time(n, device, s, phase)
            for n in wide.nodes.values() for phase in ("forward", "backward")
        )
        return compute + cost.update_time(wide.param_bytes, device, len(wide.variables))

    devices = [cluster.device(d) for d in cluster.names]
    slope = [(step(d, 300) - step(d, 100)) / 200 for d in devices]
    offset = [step(d, 100) - 100 * c for d, c in zip(devices, slope)]
    finish = (batch + sum(u / c for u, c in zip(offset, slope))) / sum(1 / c for c in slope)
    for i, name in enumerate(cluster.names):
        expected = (finish - offset[i]) / slope[i]
        assert shares[i] == pytest.approx(expected, abs=0.01 * batch), name
    assert sum(shares.values()) == batch
    assert shares[0] > shares[2]  # V100 over T4


def test_memory_aware_when_the_model_does_not_fit_on_the_smallest_gpu(wide):
    # 64 MiB of kernels need 256 MiB with gradients and Adam slots: more than
    # the two 0.2 GiB cards hold, so full replication does not fit.
    cluster = Cluster.from_dict({
        "nodes": [{
            "name": "node0",
            "gpus": [
                {"name": "Big", "memory_gb": 2, "fp32_tflops": 10, "bandwidth_gbps": 500,
                 "count": 2},
                {"name": "Small", "memory_gb": _nominal_gb(0.2), "fp32_tflops": 10,
                 "bandwidth_gbps": 500,
                 "count": 2},
            ],
            "intra_link": 20,
        }]
    })
    with pytest.raises(PlanError):
        baselines.proportional(wide, cluster, 64)
    even = simulate(wide, cluster, baselines.data_parallel_even(wide, cluster, 64))
    assert not even.feasible
    plan = heterog.plan(wide, cluster, 64, time_budget_s=BIG)
    assert plan.prediction.feasible, plan.prediction.infeasible_reason
    for device, peak in plan.prediction.peak_memory_bytes.items():
        assert peak <= cluster.device(device).memory_bytes
    small = {"node0/gpu2", "node0/gpu3"}
    assert any(not small <= set(g.devices) for g in plan.groups)


def test_places_groups_on_single_devices_when_no_device_holds_a_replica():
    # Four 1024x1024 layers with Adam need about 51 MB; each device holds 32 MB,
    # so neither replication nor one device fits: only placement does.
    inputs = keras.Input((64,))
    hidden = inputs
    for _ in range(4):
        hidden = keras.layers.Dense(1024, activation="relu")(hidden)
    model = keras.Model(inputs, keras.layers.Dense(4)(hidden))
    model.compile(optimizer="adam", loss="mse")
    graph = ModelGraph.from_keras(model)
    cluster = Cluster.from_dict({"nodes": [{"name": "node0", "gpus": [
        {"name": "Tiny", "memory_gb": _nominal_gb(0.03), "fp32_tflops": 10, "bandwidth_gbps": 500,
         "count": 3}], "intra_link": 20}]})
    assert not simulate(graph, cluster, baselines.data_parallel_even(graph, cluster, 16)).feasible
    plan = heterog.plan(graph, cluster, 16, time_budget_s=BIG)
    assert plan.prediction.feasible, plan.prediction.infeasible_reason
    assert plan.validate(graph, cluster) == []
    assert len({d for g in plan.groups for d in g.devices}) >= 2
    for device, peak in plan.prediction.peak_memory_bytes.items():
        assert peak <= cluster.device(device).memory_bytes


def test_a_batch_smaller_than_the_devices_keeps_a_device_that_holds_the_model():
    """At batch 1 HeteroG plans over one device. Of two equally fast GPUs it
    kept the first listed, which could not hold the model although the other
    could: not predicted to fit, or fitting, by the order of the GPUs."""
    from autodist_keras.graph import zoo

    graph = ModelGraph.from_keras(zoo.mlp(input_dim=64, hidden=(128, 128)))
    static, per_sample = simulator.replica_memory_terms(graph)
    need_gb = (static + per_sample) / 2**30

    def gpu(name, fraction):
        return {"name": name, "memory_gb": _nominal_gb(need_gb * fraction),
                "fp32_tflops": 10.0, "bandwidth_gbps": 500.0}

    for gpus in ([gpu("Big", 1.5), gpu("Small", 0.9)], [gpu("Small", 0.9), gpu("Big", 1.5)]):
        cluster = Cluster.from_dict({"nodes": [{"name": "node0", "intra_link": 20.0,
                                                "gpus": gpus}]})
        plan = heterog.plan(graph, cluster, 1, time_budget_s=BIG)
        assert plan.prediction.feasible, (gpus[0]["name"], plan.prediction.infeasible_reason)
        assert [cluster.device(d).model for d in plan.devices] == ["Big"]
        assert plan.validate(graph, cluster) == []
    # Small first: both sets are planned, which halved the budget before it was
    # checked: a TypeError for "4", and -1 was reported as "Received: -0.5".
    for bad in ("4", -1):
        with pytest.raises(StrategyError, match=rf"time_budget_s .*Received: {bad!r}$"):
            heterog.plan(graph, cluster, 1, time_budget_s=bad)


def test_a_batch_smaller_than_the_devices_keeps_the_best_connected_of_equal_devices():
    """At batch 4 on six V100s, two behind a 1 Gbit/s NIC, HeteroG kept the
    first four listed: with that node first, a plan on its two V100s,
    0.335 ms against 0.314 ms on node1's four with node1 listed first (small
    CNN on 64x64 inputs, predicted)."""
    from autodist_keras.graph import zoo

    graph = ModelGraph.from_keras(zoo.small_cnn(input_shape=(64, 64, 3), filters=(32, 64)))
    times = []
    for spec in ("node0:2xV100@1;node1:4xV100@100", "node1:4xV100@100;node0:2xV100@1"):
        cluster = Cluster.from_string(spec)
        plan = heterog.plan(graph, cluster, 4, time_budget_s=BIG)
        assert {cluster.device(d).node for d in plan.devices} == {"node1"}, (spec, plan.devices)
        times.append(plan.prediction.step_time_s)
    assert times[0] == pytest.approx(times[1], rel=1e-9)


def test_never_predicted_slower_than_the_whole_batch_on_one_device():
    """Every group on one device is in HeteroG's space, but moves of one group
    at a time from a start on both devices never reached it: two V100s on
    nodes joined by 1 Gbit/s got 4.76 ms against 0.257 ms on one (predicted)."""
    from autodist_keras.graph import zoo

    graph = ModelGraph.from_keras(zoo.mlp(input_dim=512, hidden=(1024, 1024)))
    cluster = Cluster.from_string("node0:1xV100@1;node1:1xV100@1")
    single = simulate(graph, cluster, baselines.single_device(graph, cluster, 64))
    plan = heterog.plan(graph, cluster, 64, time_budget_s=BIG)
    assert plan.prediction.feasible
    assert plan.prediction.step_time_s <= single.step_time_s * (1 + 1e-6)
    assert "single_device" in plan.prediction.baselines


def test_groups_hold_about_equal_compute(cnn):
    def flops(node):
        return node.forward_flops + node.backward_flops

    cost = {name: flops(node) for name, node in cnn.nodes.items()}
    total = sum(cost.values())
    for k in (2, 3, 4):
        runs = contiguous_partition(cnn, k, flops)
        assert [layer for run in runs for layer in run] == list(cnn.nodes)
        assert 1 <= len(runs) <= k
        # A run is closed at the first layer that brings it to its share of the
        # compute still to place, and no share exceeds total / k: without its last
        # layer, no run holds more than total / k. (Runs of equal layer counts,
        # ignoring the FLOPs, fail this at k=3: 7.26 of 10.28 MFLOPs before a
        # run's last layer.)
        for run in runs:
            assert sum(cost[n] for n in run[:-1]) <= total / k, (k, runs)
    equal = contiguous_partition(cnn, 3, lambda n: 1.0)
    sizes = [len(r) for r in equal]
    assert max(sizes) - min(sizes) <= 1


def test_coarse_simulation_matches_the_real_graph_on_one_device(cnn):
    # The group-level graph HeteroG searches on prices compute exactly: on one
    # device (no communication) its simulated step equals the real graph's.
    cluster = Cluster.from_string("1xV100")
    cost = AnalyticCostModel(cluster)
    coarse = CoarseGraph(cnn, contiguous_partition(cnn, 4, lambda n: n.forward_flops))
    fused = CoarseCostModel(cost, coarse)
    fine_plan = baselines.single_device(cnn, cluster, 64)
    coarse_plan = baselines.single_device(coarse.graph, cluster, 64)
    fine = simulate(cnn, cluster, fine_plan, cost_model=cost)
    approx = simulate(coarse.graph, cluster, coarse_plan, cost_model=fused)
    assert approx.step_time_s == pytest.approx(fine.step_time_s, rel=1e-9)


def test_deterministic(cnn, hetero, plan_json):
    a = heterog.plan(cnn, hetero, 128, time_budget_s=BIG)
    b = heterog.plan(cnn, hetero, 128, time_budget_s=BIG)
    assert plan_json(a) == plan_json(b)


def test_errors_name_the_problem(cnn, hetero):
    with pytest.raises(StrategyError, match="Received"):
        heterog.plan(cnn, hetero, 64, nonsense=True)
    with pytest.raises(StrategyError, match="groups"):
        heterog.plan(cnn, hetero, 64, groups=0)
    with pytest.raises(PlanError, match="Received"):
        heterog.plan(cnn, hetero, -4)
    with pytest.raises(PlanError, match="twice"):
        heterog.plan(cnn, hetero, 64, devices=["node0/gpu0", "node0/gpu0"])


def _embedding_model(vocab=50000, dim=256, name="embed"):
    inputs = keras.Input((16,), dtype="int32", name=f"{name}_ids")
    x = keras.layers.Embedding(vocab, dim, name=f"{name}_table")(inputs)
    x = keras.layers.GlobalAveragePooling1D(name=f"{name}_pool")(x)
    x = keras.layers.Dense(256, activation="relu", name=f"{name}_d0")(x)
    return keras.Model(inputs, keras.layers.Dense(10, name=f"{name}_head")(x), name=name)


@pytest.fixture(scope="module")
def embed():
    return ModelGraph.from_keras(_embedding_model())


def test_isolated_layers_get_runs_of_their_own(cnn):
    names = list(cnn.nodes)
    middle = names[len(names) // 2]
    runs = contiguous_partition(cnn, 3, lambda n: n.forward_flops + 1.0, isolate={middle})
    assert [layer for run in runs for layer in run] == names
    assert [middle] in runs
    # A zero-cost prefix (the input layer) joins the next run instead of being a group.
    first = names[1]
    runs = contiguous_partition(cnn, 3, lambda n: n.forward_flops, isolate={first})
    assert runs[0] == names[:2]


def test_comm_heavy_layer_is_replicated_on_fewer_devices(embed, hetero):
    # 49 MiB of embedding gradient, almost no compute: all-reducing it over
    # 50 GbE costs more than the whole step's compute. HeteroG isolates the
    # embedding, keeps it off the full replica set (no all-reduce across
    # nodes for it), and beats proportional data parallelism by a wide margin.
    prop = simulate(embed, hetero, baselines.proportional(embed, hetero, 256))
    plan = heterog.plan(embed, hetero, 256, time_budget_s=BIG)
    assert plan.provenance.options["isolated_layers"] == ["embed_table"]
    group = next(g for g in plan.groups if "embed_table" in g.layers)
    assert len(group.devices) < len(hetero.names)
    assert plan.prediction.feasible
    assert plan.prediction.step_time_s < prop.step_time_s / 2
    off = heterog.plan(embed, hetero, 256, time_budget_s=BIG, isolate=False)
    assert off.provenance.options["isolated_layers"] == []


def test_ps_spread_uses_one_server_per_node_and_balances_bytes(wide, hetero):
    from autodist_keras.strategies.heterog import SPREAD
    from autodist_keras.strategies.heterog import _Space

    cost = AnalyticCostModel(hetero)
    # One group holding all ten variables (5 kernels of 16 MiB and 5 biases).
    space = _Space(wide, hetero, cost, hetero.names, 128, 1, baselines.DDP_BUCKET_BYTES,
                   isolate=False)
    assert ("ps", SPREAD) in space.sync_options(0)
    i = max(range(len(space.units)), key=lambda j: space.grad_bytes[j])
    assign, load = space.spread(i, 0)
    servers = set(assign.values())
    nodes = [hetero.device(space.names[d]).node for d in servers]
    assert len(nodes) == len(set(nodes)) and len(servers) > 1
    variables = space.coarse.graph.nodes[space.units[i]].variables
    assert set(assign) == {v.name for v in variables}
    assert sum(load.values()) == sum(int(v.bytes) for v in variables)
    # Every server holds at most the largest variable more than an even split.
    assert max(load.values()) <= sum(load.values()) / len(load) + max(int(v.bytes) for v in variables)
    state = tuple((0, ("ps", SPREAD) if j == i else ("ring", None)) for j in range(len(space.units)))
    shares = space.solve_shares(state)
    _, sync = space.coarse_plan(state, shares)
    used = {sync[v.name].server for v in variables}
    assert used == {space.names[d] for d in servers}
    infeasible, seconds = space.evaluate(state)
    assert not infeasible and seconds > 0


def test_lp_optimum_is_a_lower_bound_of_the_coarse_step(cnn, hetero):
    from autodist_keras.strategies.heterog import _Space

    cost = AnalyticCostModel(hetero)
    space = _Space(cnn, hetero, cost, hetero.names, 128, 4, baselines.DDP_BUCKET_BYTES)
    n = len(space.units)
    states = [tuple((0, opt) for _ in range(n)) for opt in space.sync_options(0)]
    states += [tuple((s if j == 0 else 0, ("ring", None)) for j in range(n))
               for s in range(1, len(space.sets))]
    checked = 0
    for state in states:
        if space.solve_shares(state) is None:
            continue
        bound = space.lp_bound
        infeasible, seconds = space.evaluate(state)
        assert seconds >= bound * (1 - 1e-6), (state, seconds, bound)
        # Pruning against a bound below the LP optimum never skips the simulation.
        assert space.evaluate(state, bound=bound * 0.5) == (infeasible, seconds)
        checked += 1
    assert checked >= 3


def test_shares_of_devices_that_do_not_set_the_step_are_balanced():
    """A tiny model whose PS device is critical whatever the shares: the LP's
    other devices get even shares, not an arbitrary vertex (once 1 / 46 / 1)."""
    import keras

    from autodist_keras.devices import Cluster
    from autodist_keras.graph import ModelGraph
    from autodist_keras.strategies import heterog

    model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    # seeds=False: the search's own plan (the single-device seed is predicted faster).
    plan = heterog.plan(ModelGraph.from_keras(model), Cluster.cpu_testbed(), 48, seeds=False)
    shares = {r.device: r.batch_share for g in plan.groups for r in g.replicas}
    assert abs(shares["node0/cpu1"] - shares["node0/cpu2"]) <= 1, shares


def test_lp_shares_pay_for_a_devices_fixed_step_time(wide):
    """A device with a fixed host time per step (PyTorch on a GPU pays one)
    gets fewer samples, as many fewer as that time is worth on it."""
    from autodist_keras.estimator.cost_model import WrappedCostModel

    cluster = Cluster.from_string("2xV100")
    slow_host = cluster.names[0]
    base = AnalyticCostModel(cluster, framework="tensorflow")
    per_sample = sum(base.layer_time(n, cluster.device(slow_host), 256, phase)
                     for n in wide.nodes.values() for phase in ("forward", "backward")) / 256
    host_s = 100 * per_sample  # the time of 100 samples

    class SlowHost(WrappedCostModel):
        def step_overhead_time(self, device):
            return host_s if device.name == slow_host else 0.0

    shares = {}
    for name, cost in (("even host", base), ("slow host", SlowHost(base))):
        space = heterog._Space(wide, cluster, cost, cluster.names, 512, 4,
                               baselines.DDP_BUCKET_BYTES)
        state = tuple((0, ("ring", None)) for _ in space.units)
        shares[name] = dict(space.solve_shares(state)[0])
    assert abs(shares["even host"][0] - shares["even host"][1]) <= 1
    # Equal finish times: per_sample * s0 + host_s = per_sample * s1.
    assert shares["slow host"][1] - shares["slow host"][0] == pytest.approx(100, abs=10)


def test_drops_a_badly_connected_node():
    """Two nodes on 100 GbE and one on 5 GbE: every group belongs on the two fast
    nodes. The "best-connected nodes" set was never formed (every node's worst link
    is the slowest NIC, so all tied) and no search started from a smaller set, so
    HeteroG kept all six GPUs at 3.3x proportional-over-the-four's step."""
    from autodist_keras.graph import zoo

    cluster = Cluster.from_string("node0:2xV100@100;node1:2xV100@100;node2:2xV100@5")
    graph = ModelGraph.from_keras(zoo.transformer_encoder(
        num_layers=2, d_model=256, heads=4, seq_len=64, vocab=1000, name="wc_encoder"))
    fast = ["node0/gpu0", "node0/gpu1", "node1/gpu0", "node1/gpu1"]
    space = heterog._Space(graph, cluster, AnalyticCostModel(cluster), cluster.names, 192, 12,
                           baselines.DDP_BUCKET_BYTES)
    assert tuple(cluster.names.index(d) for d in fast) in space.sets
    plan = heterog.plan(graph, cluster, 192)
    assert {d for group in plan.groups for d in group.devices} <= set(fast)
    on_fast = simulate(graph, cluster, baselines.proportional(graph, cluster, 192, devices=fast))
    assert plan.prediction.step_time_s <= on_fast.step_time_s


def test_the_share_lp_charges_received_inputs_only_between_replica_sets():
    """The LP's memory row counted every group's inputs as received, also from
    groups on the same devices (nothing moves there): 1.87x the model's
    activations per sample here, so a fast, small card got 33 samples where 56
    fit, predicted 559.8 ms against 532.9 ms."""
    inputs = keras.Input((64, 64, 3), name="lp_in")
    x = inputs
    for i in range(8):
        x = keras.layers.Conv2D(64, 3, padding="same", activation="relu", name=f"lp_c{i}")(x)
    x = keras.layers.GlobalAveragePooling2D(name="lp_gap")(x)
    graph = ModelGraph.from_keras(keras.Model(inputs, keras.layers.Dense(10, name="lp_out")(x)))
    cluster = Cluster.from_dict({"nodes": [{"name": "node0", "nic_gbps": 100, "intra_link": 25,
                                            "gpus": [
        {"name": "Fast", "memory_gb": _nominal_gb(0.5), "fp32_tflops": 20, "bandwidth_gbps": 900},
        {"name": "Slow", "memory_gb": 8, "fp32_tflops": 10, "bandwidth_gbps": 900}]}]})
    cost = AnalyticCostModel(cluster, framework="tensorflow")
    batch = 512
    space = heterog._Space(graph, cluster, cost, cluster.names, batch, 8,
                           baselines.DDP_BUCKET_BYTES)
    everywhere = space.initial_states()[0]
    charged = space._class_act(0, list(range(len(space.units))), everywhere)
    # Every layer's activations and the backward gradient buffer (largest output).
    assert charged == sum(n.activation_bytes for n in graph.nodes.values()) + max(
        n.output_bytes for n in graph.nodes.values())
    fits = baselines.memory_capacity_samples(graph, cluster, "node0/gpu0")
    fast_share = dict(space.solve_shares(everywhere)[0])[0]
    assert fast_share >= fits  # the LP's memory row is no tighter than the baseline rule
    plan = heterog.plan(graph, cluster, batch, cost_model=cost)
    assert plan.prediction.feasible
    assert plan.groups[0].shares[0] >= fits


def test_a_straggler_type_can_leave_every_group():
    """Eight V100s and one 0.05 TFLOP/s card: HeteroG's sets had all devices, the
    fastest one, the fastest half and per-node sets, so it used four V100s; a set of
    all but the slowest type lets every group drop the straggler alone."""
    from autodist_keras.graph import zoo

    cluster = Cluster.from_dict({"nodes": [{"name": "n0", "gpus": [
        {"type": "V100-PCIE-16GB", "count": 8},
        {"name": "Crawl", "memory_gb": 16, "fp32_tflops": 0.05, "bandwidth_gbps": 20}]}]})
    graph = ModelGraph.from_keras(zoo.small_cnn(input_shape=(32, 32, 3), filters=(16, 32)))
    cost = AnalyticCostModel(cluster, framework="tensorflow")
    plan = heterog.plan(graph, cluster, 512, cost_model=cost)
    used = {d for group in plan.groups for d in group.devices}
    assert used == {f"n0/gpu{i}" for i in range(8)}


def test_says_so_when_no_group_arrangement_fits(wide):
    """When nothing HeteroG builds fits, the note said "no group strategy found by the
    search was predicted faster" over an infeasible seed; it now says nothing fits
    and points to FastT's layer placement."""
    cluster = Cluster.from_dict({"nodes": [{"name": "n0", "gpus": [
        {"name": "Tiny", "memory_gb": _nominal_gb(0.05), "fp32_tflops": 10, "bandwidth_gbps": 500,
         "count": 2}]}]})
    plan = heterog.plan(wide, cluster, 64, time_budget_s=BIG)
    assert not plan.prediction.feasible
    note = [n for n in plan.notes if n.startswith("No plan found fits in memory")]
    assert note and "strategy='fastt'" in note[0], plan.notes
    assert not any("was predicted faster" in n for n in plan.notes)


def test_a_batch_smaller_than_the_devices_ranks_devices_by_the_cost_model():
    """At batch 1 HeteroG planned over the device with the most peak FP32
    FLOP/s: the zoo MLP (512-1024-1024), memory-bound at one sample, got the
    L4 (30.3 TFLOP/s, 300 GB/s), 0.402 ms against 0.214 ms on the V100
    (15.7 TFLOP/s, 900 GB/s), predicted."""
    from autodist_keras.graph import zoo

    graph = ModelGraph.from_keras(zoo.mlp(input_dim=512, hidden=(1024, 1024)))
    cluster = Cluster.from_string("1xL4,1xV100")
    plan = heterog.plan(graph, cluster, 1, time_budget_s=BIG)
    assert [cluster.device(d).model for d in plan.devices] == ["V100-SXM2-16GB"]
    single = min(
        simulate(graph, cluster, baselines.single_device(graph, cluster, 1, device=d)).step_time_s
        for d in cluster.names)
    assert plan.prediction.feasible
    assert plan.prediction.step_time_s <= single * (1 + 1e-6)


def test_hybrid_plans_keep_batch_normalization_whole():
    """A group holding a trainable BatchNormalization may be split by rows
    only in a data-parallel plan: the TensorFlow placement runtime refuses a
    hybrid that splits it. Without seeds HeteroG returned one (8 groups, the
    BatchNormalization groups split over the two large GPUs)."""
    from autodist_keras.backends import tf_placement
    from autodist_keras.strategies import _common

    inputs = keras.Input((2048,))
    x = inputs
    for _ in range(4):
        x = keras.layers.Dense(2048, activation="relu")(x)
        x = keras.layers.BatchNormalization()(x)
    graph = ModelGraph.from_keras(keras.Model(inputs, keras.layers.Dense(10)(x)))
    blocked = _common.unsplittable_layers(graph)
    assert len(blocked) == 4
    cluster = Cluster.from_dict({"nodes": [{"name": "node0", "intra_link": 20, "gpus": [
        {"name": "Big", "memory_gb": 2, "fp32_tflops": 10, "bandwidth_gbps": 500, "count": 2},
        {"name": "Small", "memory_gb": _nominal_gb(0.2), "fp32_tflops": 10,
         "bandwidth_gbps": 500, "count": 2}]}]})
    for seeds in (False, True):
        plan = heterog.plan(graph, cluster, 64, time_budget_s=BIG, seeds=seeds)
        assert plan.prediction.feasible
        assert len(plan.groups) > 1  # a hybrid: groups on different devices
        for group in plan.groups:
            if set(group.layers) & blocked:
                assert sum(1 for s in group.shares if s > 0) == 1, (seeds, group)
        assert tf_placement.unsupported(plan, graph) is None
