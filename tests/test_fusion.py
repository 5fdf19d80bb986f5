"""Op fusion and tensor fusion: the fusion cost model, bucket layouts and the overlapped bound.

Real Keras graphs, real clusters, the real simulator; closed forms where the
model has one.
"""

import itertools
import random
import re
import subprocess
import sys

import pytest

from autodist_keras.devices import Cluster
from autodist_keras.errors import PlanError
from autodist_keras.estimator import AnalyticCostModel
from autodist_keras.estimator import simulate
from autodist_keras.estimator.cost_model import LAUNCH_OVERHEAD_S
from autodist_keras.estimator.cost_model import MEMORY_EFFICIENCY
from autodist_keras.fusion import op_fusion
from autodist_keras.fusion import tensor_fusion
from autodist_keras.graph import ModelGraph
from autodist_keras.graph import zoo
from autodist_keras.strategies import baselines


@pytest.fixture(scope="module")
def res(residual_model):
    return ModelGraph.from_keras(residual_model(filters=8))


@pytest.fixture(scope="module")
def cnn():
    return ModelGraph.from_keras(zoo.small_cnn(filters=(16, 32)))


@pytest.fixture(scope="module")
def encoder():
    return ModelGraph.from_keras(
        zoo.transformer_encoder(num_layers=2, d_model=32, heads=2, seq_len=16, vocab=100)
    )


V100x4 = "4xV100"


# ------------------------------------------------------------------ op fusion
def test_unfused_roofline_equals_the_analytic_cost_model(cnn, res):
    for spec in ("2xV100", None):
        cluster = Cluster.from_string(spec) if spec else Cluster.cpu_testbed()
        cost = AnalyticCostModel(cluster)
        device = cluster.devices[0]
        for graph in (cnn, res):
            for node in graph.nodes.values():
                for phase in ("forward", "backward"):
                    assert op_fusion.roofline_time(cost, node, device, 8, phase) == (
                        cost.layer_time(node, device, 8, phase)
                    )
                    assert op_fusion.roofline_time(
                        cost, node, device, 8, phase, op_fusion.FusionContext()
                    ) == cost.layer_time(node, device, 8, phase)


def test_region_contexts_of_conv_bn_relu(res):
    region = ["res_b0_conv1", "res_b0_bn1", "res_b0_relu1"]
    ctx = op_fusion.region_contexts(res, [region])
    assert set(ctx) == set(region)
    assert not ctx["res_b0_conv1"].absorbed  # a matmul-like head keeps its kernel
    bn, relu = ctx["res_b0_bn1"], ctx["res_b0_relu1"]
    assert bn.absorbed and relu.absorbed
    assert bn.input_read_internal == 1.0 and relu.input_read_internal == 1.0
    assert bn.input_grad_internal == 0.0  # conv's backward reads dY from memory
    assert relu.input_grad_internal == 1.0  # bn's backward is fused with it
    assert bn.output_grad_internal  # its only consumer, relu, is absorbed
    assert not relu.output_grad_internal  # conv2 is outside the region
    assert op_fusion.region_contexts(res, [["res_b0_conv1"]]) == {}


def test_two_input_add_reads_half_its_input_from_the_region(res):
    ctx = op_fusion.region_contexts(res, [["res_b0_conv2", "res_b0_bn2", "res_b0_add"]])
    add = ctx["res_b0_add"]
    assert add.absorbed
    assert add.input_read_internal == pytest.approx(0.5)  # the shortcut comes from outside


def test_absorbed_bn_forward_closed_form(res):
    cluster = Cluster.from_string("1xV100")
    cost = AnalyticCostModel(cluster, framework="tensorflow")  # no host floor
    device = cluster.devices[0]
    region = ["res_b0_conv1", "res_b0_bn1", "res_b0_relu1"]
    fused = op_fusion.FusionAwareCostModel(cost, res, [region])
    bn = res.nodes["res_b0_bn1"]
    batch = 64
    weights = sum(v.bytes for v in bn.variables) + bn.non_trainable_bytes
    # Memory-bound: the input comes from conv1's epilogue, the output is written, no launch.
    expected_fwd = (weights + bn.output_bytes * batch) / (
        device.memory_bandwidth * MEMORY_EFFICIENCY["gpu"]
    )
    assert fused.layer_time(bn, device, batch, "forward") == pytest.approx(expected_fwd, rel=1e-12)
    in_bytes = 4 * 16 * 16 * 8
    expected_bwd = (2 * weights + in_bytes * batch + in_bytes * batch) / (
        device.memory_bandwidth * MEMORY_EFFICIENCY["gpu"]
    )
    assert fused.layer_time(bn, device, batch, "backward") == pytest.approx(expected_bwd, rel=1e-12)
    unfused = cost.layer_time(bn, device, batch, "forward")
    assert unfused - fused.layer_time(bn, device, batch, "forward") > LAUNCH_OVERHEAD_S["gpu"]
    conv = res.nodes["res_b0_conv1"]
    for phase in ("forward", "backward"):
        assert fused.layer_time(conv, device, batch, phase) == cost.layer_time(
            conv, device, batch, phase
        )


def test_absorbed_layers_keep_the_torch_host_floor(res):
    """On PyTorch on a GPU an absorbed layer still costs the host's dispatch time.

    torch.compile regions measured no faster than eager layers (docs/disco.md);
    without the floor, Disco under op_fusion="on" predicted a fused BN 300x
    faster (967 us -> 3 us) and whole plans 35% faster.
    """
    cluster = Cluster.from_string("1xV100")
    cost = AnalyticCostModel(cluster, framework="torch")
    device = cluster.devices[0]
    region = ["res_b0_conv1", "res_b0_bn1", "res_b0_relu1"]
    fused = op_fusion.FusionAwareCostModel(cost, res, [region])
    for layer in region[1:]:
        node = res.nodes[layer]
        host = cost.host_time(node.layer_type, device, "forward")
        assert host > 0
        fused_fwd = fused.layer_time(node, device, 64, "forward")
        assert fused_fwd >= host
        assert fused_fwd <= cost.layer_time(node, device, 64, "forward")
    # the plan as a whole: no saving where the host bounds every absorbed layer
    plan = baselines.single_device(res, cluster, 64)
    plain = simulate(res, cluster, plan, cost_model=cost).step_time_s
    plan.op_fusion = [region]
    with_regions = simulate(res, cluster, plan, cost_model=cost).step_time_s
    assert with_regions >= 0.95 * plain


def test_fusion_wraps_a_corrected_cost_model_by_ratio(res):
    class Doubled(AnalyticCostModel):
        def layer_time(self, node, device, batch, phase):
            return 2.0 * super().layer_time(node, device, batch, phase)

    cluster = Cluster.from_string("1xV100")
    base = Doubled(cluster)
    region = ["res_b0_conv1", "res_b0_bn1", "res_b0_relu1"]
    fused = op_fusion.FusionAwareCostModel(base, res, [region])
    analytic = op_fusion.FusionAwareCostModel(AnalyticCostModel(cluster), res, [region])
    device = cluster.devices[0]
    for layer in region:
        node = res.nodes[layer]
        for phase in ("forward", "backward"):
            assert fused.layer_time(node, device, 16, phase) == pytest.approx(
                2.0 * analytic.layer_time(node, device, 16, phase), rel=1e-12
            )
    other = Cluster.from_string("1xA100")
    moved = fused.with_cluster(other)
    assert moved.cluster is other and moved.base.cluster is other
    assert moved.regions == [region]
    assert fused.config()["op_fusion"] == {"regions": 1, "absorbed_layers": 2}


def test_candidate_joins_and_regions(res, cnn):
    names = list(res.nodes)
    joins = op_fusion.candidate_joins(res)
    for j in joins:
        follower = res.nodes[names[j + 1]]
        assert op_fusion.is_fusible_follower(follower)
        assert (names[j], names[j + 1]) in {(s, d) for s, d, _ in res.edges}
        assert res.nodes[names[j]].kind != "input"
    assert names.index("res_b0_conv1") in joins  # conv1 -> bn1
    regions = op_fusion.regions_from_joins(names, joins)
    flat = [layer for r in regions for layer in r]
    assert len(flat) == len(set(flat))
    assert all(len(r) >= 2 for r in regions)
    assert ["res_b0_conv1", "res_b0_bn1", "res_b0_relu1"] in regions
    assert op_fusion.regions_from_joins(names, []) == []
    assert op_fusion.regions_from_joins(names, [3, 4, 7]) == [names[3:6], names[7:9]]


def test_check_regions_rejects_unknown_and_repeated_layers(res):
    with pytest.raises(PlanError, match="unknown layer 'nope'.*Received"):
        op_fusion.check_regions(res, [["res_b0_conv1", "nope"]])
    with pytest.raises(PlanError, match="already in region 0.*Received"):
        op_fusion.check_regions(res, [["res_b0_conv1"], ["res_b0_conv1", "res_b0_bn1"]])
    with pytest.raises(PlanError, match="must be a list"):
        op_fusion.check_regions(res, ["res_b0_conv1"])


def test_a_region_naming_a_shared_layers_extra_call_is_refused_by_plan_validation():
    """Regions compile layers with all their calls; 'sh#1' passed validation and the
    runtimes then said the model had no such layer ("make the plan for this model")."""
    import keras

    a, b = keras.Input((8,), name="xa"), keras.Input((8,), name="xb")
    shared = keras.layers.Dense(16, name="sh")
    ha = keras.layers.Activation("tanh", name="ta")(shared(a))
    hb = keras.layers.Activation("tanh", name="tb")(shared(b))
    model = keras.Model([a, b], keras.layers.Concatenate(name="cat")([ha, hb]))
    graph = ModelGraph.from_keras(model)
    cluster = Cluster.cpu_testbed()
    plan = baselines.data_parallel_even(graph, cluster, 24)
    plan.op_fusion = [["sh#1", "tb"]]
    with pytest.raises(PlanError, match=r"'sh#1' is call 2 of the shared layer 'sh'.*first "
                                        r"call, 'sh'.*Received: 'sh#1'"):
        plan.validate(graph, cluster)
    plan.op_fusion = [["sh", "ta"]]
    plan.validate(graph, cluster)


def test_simulate_honours_op_fusion(res):
    cluster = Cluster.from_string(V100x4)
    plan = baselines.data_parallel_even(res, cluster, 32, bucket_bytes=0)
    plain = simulate(res, cluster, plan)
    region = ["res_b0_conv1", "res_b0_bn1", "res_b0_relu1"]
    plan.op_fusion = [region]
    fused = simulate(res, cluster, plan)
    cost = op_fusion.FusionAwareCostModel(AnalyticCostModel(cluster), res, [region])
    device = cluster.devices[0]
    saved = sum(
        AnalyticCostModel(cluster).layer_time(res.nodes[l], device, 8, p)
        - cost.layer_time(res.nodes[l], device, 8, p)
        for l in region for p in ("forward", "backward")
    )
    busy = fused.per_device[device.name].busy_s
    assert plain.per_device[device.name].busy_s - busy == pytest.approx(saved, rel=1e-9)
    # bn1's gradients are ready only when the region's first layer (conv1) ends its backward.
    events = [e for e in fused.timeline if e.device == device.name]
    conv1_end = next(e.end for e in events if e.name == "res_b0_conv1:backward")
    bn1_end = next(e.end for e in events if e.name == "res_b0_bn1:backward")
    assert bn1_end < conv1_end
    bn_bucket = next(
        i for i, b in enumerate(plan.buckets) if "res_b0_bn1/gamma" in b
    )
    start = next(e.start for e in events if e.name.startswith(f"allreduce b{bn_bucket} "))
    assert start >= conv1_end


def test_regions_for_returns_the_plan_regions(res):
    cluster = Cluster.from_string(V100x4)
    plan = baselines.data_parallel_even(res, cluster, 32)
    assert op_fusion.regions_for(plan) == []
    plan.op_fusion = [["res_b0_conv1", "res_b0_bn1"], ["res_head"]]
    assert op_fusion.regions_for(plan) == [["res_b0_conv1", "res_b0_bn1"]]


# --------------------------------------------------------------- tensor fusion
def test_baseline_layouts_cover_every_variable_once(cnn, encoder):
    for graph in (cnn, encoder):
        names = [v.name for v in tensor_fusion.launch_order(graph)]
        assert sorted(names) == sorted(v.name for v in graph.variables)
        for name, layout in tensor_fusion.BASELINE_LAYOUTS.items():
            buckets = layout(graph)
            assert tensor_fusion.check_layout(graph, buckets) == buckets
            assert [n for b in buckets for n in b] == names, name
            assert tensor_fusion.bounds_of(names, buckets) is not None
        assert len(tensor_fusion.no_fusion(graph)) == len(graph.variables)


def test_threshold_layouts_respect_their_caps(encoder):
    size = {v.name: v.bytes for v in encoder.variables}
    cap = 64 * 1024
    small = tensor_fusion.ddp_buckets(encoder, bucket_bytes=cap)
    assert len(small) > 1
    for bucket in small:
        assert len(bucket) == 1 or sum(size[n] for n in bucket) <= cap
    large = tensor_fusion.horovod_buckets(encoder, threshold_bytes=4 * cap)
    assert len(large) < len(small)
    assert tensor_fusion.ddp_buckets(encoder) == baselines.gradient_buckets(encoder)


def test_check_layout_errors(cnn):
    names = [v.name for v in cnn.variables]
    with pytest.raises(PlanError, match="leaves out 1 variable.*Received"):
        tensor_fusion.check_layout(cnn, [names[:-1]])
    with pytest.raises(PlanError, match="already in bucket 0.*Received"):
        tensor_fusion.check_layout(cnn, [names, names[:1]])
    with pytest.raises(PlanError, match="unknown variable 'ghost'.*Received"):
        tensor_fusion.check_layout(cnn, [names + ["ghost"]])
    with pytest.raises(PlanError, match="empty"):
        tensor_fusion.check_layout(cnn, [names, []])


def test_bounds_round_trip():
    names = list("abcdefg")
    bounds = [2, 3, 7]
    buckets = tensor_fusion.buckets_from_bounds(names, bounds)
    assert buckets == [["a", "b"], ["c"], ["d", "e", "f", "g"]]
    assert tensor_fusion.bounds_of(names, buckets) == bounds
    assert tensor_fusion.bounds_of(names, [["b", "a"], ["c", "d", "e", "f", "g"]]) == [2, 7]
    assert tensor_fusion.bounds_of(names, [["a", "c"], ["b", "d", "e", "f", "g"]]) is None


def _chain_end(sizes, ready, costs, bounds):
    end, start = 0.0, 0
    for stop in bounds:
        nbytes = sum(sizes[start:stop])
        cost = min(a + b * nbytes for a, b in costs)
        end = max(end, ready[stop - 1]) + cost
        start = stop
    return end


def test_chain_optimal_bounds_match_brute_force():
    rng = random.Random(0)
    for _ in range(40):
        n = rng.randint(1, 8)
        sizes = [rng.randint(1, 50) * 1000 for _ in range(n)]
        ready = sorted(rng.uniform(0, 1e-3) for _ in range(n))
        costs = [(rng.uniform(0, 1e-4), rng.uniform(1e-10, 1e-8)) for _ in range(rng.randint(1, 2))]
        bounds, end = tensor_fusion.chain_optimal_bounds(sizes, ready, costs)
        assert bounds[-1] == n and bounds == sorted(set(bounds))
        assert end == pytest.approx(_chain_end(sizes, ready, costs, bounds), rel=1e-12)
        best = min(
            _chain_end(sizes, ready, costs, list(cuts) + [n])
            for k in range(n)
            for cuts in itertools.combinations(range(1, n), k)
        )
        assert end == pytest.approx(best, rel=1e-12)


def test_chain_optimal_bounds_keep_ties_together_at_no_cost():
    rng = random.Random(1)
    for _ in range(30):
        n = rng.randint(2, 8)
        sizes = [rng.randint(1, 50) * 1000 for _ in range(n)]
        ready = sorted(rng.choice([0.0, 2e-4, 5e-4, 9e-4]) for _ in range(n))
        costs = [(rng.uniform(0, 1e-4), rng.uniform(1e-10, 1e-8))]
        bounds, end = tensor_fusion.chain_optimal_bounds(sizes, ready, costs)
        cuts = set(bounds[:-1])
        assert all(ready[c - 1] != ready[c] for c in cuts)
        _, free = tensor_fusion.chain_optimal_bounds(sizes, ready, costs, split_ties=True)
        assert end == pytest.approx(free, rel=1e-12)


def test_overlapped_bound_is_below_every_layout_and_exact_on_one_device(encoder, res):
    for graph in (encoder, res):
        cluster = Cluster.from_string("node0:2xV100;node1:2xT4@10")
        names = [v.name for v in tensor_fusion.launch_order(graph)]
        layouts = {name: fn(graph) for name, fn in tensor_fusion.BASELINE_LAYOUTS.items()}
        layouts["one_bucket"] = [names]
        bound = None
        for name, buckets in layouts.items():
            plan = baselines.proportional(graph, cluster, 32, buckets=buckets)
            result = simulate(graph, cluster, plan)
            b = tensor_fusion.overlapped_bound_of(graph, cluster, plan, result=result)
            bound = b if bound is None else bound
            assert b.step_time_s == pytest.approx(bound.step_time_s, rel=1e-12)  # layout-free
            assert b.step_time_s <= result.step_time_s * (1 + 1e-12), name
            assert b.comm_end_s >= b.tail_s and b.comm_s > 0
        single = Cluster.from_string("1xV100")
        plan = baselines.single_device(graph, single, 8)
        result = simulate(graph, single, plan)
        b = tensor_fusion.overlapped_bound_of(graph, single, plan, result=result)
        assert b.step_time_s == pytest.approx(result.step_time_s, rel=1e-12)
        assert b.binding == "compute"


def test_overlapped_bound_closed_form():
    # Two devices, gradients ready at 1 and 3 (seconds), A(S) = 1 + S.
    bound = tensor_fusion.overlapped_bound(
        {"a": 4.0, "b": 3.5}, {"a": 0.5, "b": 0.5}, [(1.0, 2), (3.0, 1)], lambda s: 1.0 + s
    )
    # E = max(1 + A(3), 3 + A(1)) = max(5, 5) = 5; bound = max(max(4, 5), max(3.5, 5)) + 0.5
    assert bound.comm_end_s == 5.0 and bound.step_time_s == 5.5
    assert bound.comm_s == 4.0 and bound.tail_s == 2.0
    # E = last ready (3) + its all-reduce (2), but 1 s of 5.5 is exposed: communication binds.
    assert bound.binding == "communication"
    small_tail = tensor_fusion.overlapped_bound(
        {"a": 4.9}, {"a": 0.5}, [(1.0, 2), (3.0, 1)], lambda s: 1.0 + s)
    assert small_tail.binding == "last all-reduce"  # 0.1 s of 5.5 exposed
    # Gradients queue up: the first all-reduce (1 + 11 bytes) ends after the last's.
    queued = tensor_fusion.overlapped_bound(
        {"a": 4.0}, {"a": 0.5}, [(1.0, 10), (3.0, 1)], lambda s: 1.0 + s)
    assert queued.comm_end_s == 13.0 and queued.binding == "communication"
    hidden = tensor_fusion.overlapped_bound(
        {"a": 9.0}, {"a": 0.5}, [(1.0, 2), (3.0, 1)], lambda s: 1.0 + s)
    assert hidden.binding == "compute"


def test_overlapped_bound_rejects_ps_plans(cnn):
    cluster = Cluster.from_string(V100x4)
    plan = baselines.data_parallel_even(cnn, cluster, 16, sync="ps")
    with pytest.raises(PlanError, match="all-reduce.*Received"):
        tensor_fusion.overlapped_bound_of(cnn, cluster, plan)


def test_fusion_imports_no_framework():
    code = (
        "import sys; import autodist_keras.fusion.op_fusion, autodist_keras.fusion.tensor_fusion, "
        "autodist_keras.strategies.disco; "
        "bad = [m for m in ('tensorflow', 'torch', 'jax') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_layers_that_draw_random_numbers_are_never_in_a_planned_region():
    """The runtimes run Dropout and GaussianNoise uncompiled (compiled code draws
    other numbers), so Disco must not plan, and predict gains from, such regions."""
    import keras

    from autodist_keras.strategies import disco

    inputs = keras.Input((64,))
    x = keras.layers.Dense(256, name="d0")(inputs)
    x = keras.layers.Dropout(0.5, name="drop")(x)
    x = keras.layers.Activation("relu", name="act")(x)
    x = keras.layers.Dense(256, name="d1")(x)
    x = keras.layers.GaussianNoise(0.1, name="noise")(x)
    x = keras.layers.Activation("relu", name="act1")(x)
    x = keras.layers.Dense(256, name="d2")(x)
    x = keras.layers.Activation("relu", name="act2")(x)
    graph = ModelGraph.from_keras(keras.Model(inputs, keras.layers.Dense(3, name="out")(x)))
    assert [n for n, node in graph.nodes.items() if node.draws_random] == ["drop", "noise"]
    assert ModelGraph.from_dict(graph.to_dict()).nodes["drop"].draws_random
    regions = op_fusion.regions_from_joins(list(graph.nodes), op_fusion.candidate_joins(graph))
    assert regions == [["d2", "act2"]]
    plan = disco.plan(graph, Cluster.from_string(V100x4), 256, op_fusion=True)
    assert plan.op_fusion and all("drop" not in r and "noise" not in r for r in plan.op_fusion)


def test_keras_ops_nodes_are_never_in_a_planned_region():
    """`keras.ops` calls of a functional model, and the masks Keras computes with
    them (`not_equal`, `logical_or`), are graph nodes but no layers: Disco put them
    in regions and both runtimes failed at the first step ('names a layer the
    model does not have')."""
    import keras

    from autodist_keras.strategies import disco

    tokens = keras.Input((16,), dtype="int32", name="tok")
    x = keras.layers.Embedding(100, 64, mask_zero=True, name="emb")(tokens)
    attended = keras.layers.MultiHeadAttention(2, 32, name="mha")(x, x)
    x = keras.layers.LayerNormalization(name="ln")(keras.layers.Add(name="add")([x, attended]))
    x = keras.layers.Dense(64, name="d")(keras.layers.GlobalAveragePooling1D(name="gap")(x))
    x = keras.layers.LayerNormalization(name="ln2")(keras.ops.tanh(x))
    graph = ModelGraph.from_keras(keras.Model(tokens, keras.layers.Dense(4, name="out")(x)))
    ops = {n for n, node in graph.nodes.items() if node.kind == "op"}
    # Keras numbers op names per process ("not_equal_1" after another model's mask).
    named = {re.sub(r"_\d+$", "", n): n for n in ops}
    assert {"not_equal", "tanh"} <= set(named)
    regions = op_fusion.regions_from_joins(list(graph.nodes), op_fusion.candidate_joins(graph))
    assert not ops & {n for r in regions for n in r}, regions
    plan = disco.plan(graph, Cluster.from_string(V100x4), 256, op_fusion=True)
    assert not ops & {n for r in plan.op_fusion for n in r}, plan.op_fusion
    assert plan.validate(graph, Cluster.from_string(V100x4)) == []
    with pytest.raises(PlanError, match=f"'{named['tanh']}' is a keras.ops call .*leave it out"):
        op_fusion.check_regions(graph, [["d", named["tanh"], "ln2"]])


def test_disco_plans_no_region_with_a_shared_layer_and_its_plan_validates():
    """Validation refuses a region naming 'sh#1'; Disco planned such regions (a
    shared layer's second call feeding a LayerNormalization) and failed on them."""
    import keras

    from autodist_keras.strategies import disco

    inputs = keras.Input((256,))
    shared = keras.layers.Dense(256, name="sh")
    x = keras.layers.Activation("gelu", name="act1")(
        keras.layers.LayerNormalization(name="ln1")(shared(inputs)))
    x = keras.layers.Activation("gelu", name="act2")(
        keras.layers.LayerNormalization(name="ln2")(shared(x)))
    graph = ModelGraph.from_keras(keras.Model(inputs, keras.layers.Dense(10, name="out")(x)))
    cluster = Cluster.from_string("node0:2xA100@100")
    plan = disco.plan(graph, cluster, 256, cost_model=AnalyticCostModel(cluster),
                      op_fusion=True)
    assert plan.op_fusion and not any(
        name in ("sh", "sh#1") for region in plan.op_fusion for name in region)
    assert plan.validate(graph, cluster) == []
