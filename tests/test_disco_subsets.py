"""Disco's device subsets: a node behind a slow link, a batch smaller than the device
count, and clusters where every device pays its way (real graphs, the real simulator).

Every figure is a prediction of the simulator with the analytic cost model for the
TensorFlow backend (given explicitly, so the figures are the same under either
Keras backend).
"""

import pytest

from autodist_keras.devices import Cluster
from autodist_keras.estimator import AnalyticCostModel
from autodist_keras.estimator import simulate
from autodist_keras.graph import ModelGraph
from autodist_keras.graph import zoo
from autodist_keras.strategies import baselines
from autodist_keras.strategies import disco


@pytest.fixture(scope="module")
def graphs(residual_model):
    return {
        "encoder": ModelGraph.from_keras(zoo.transformer_encoder()),
        "small_cnn": ModelGraph.from_keras(zoo.small_cnn()),
        # A wider encoder (35 MiB of parameters, mostly the embedding): its
        # all-reduce across a 2 Gbit/s link costs about 150 ms.
        "wide_encoder": ModelGraph.from_keras(zoo.transformer_encoder(
            num_layers=2, d_model=256, heads=4, seq_len=128, vocab=30000, name="wide_enc")),
        "res": ModelGraph.from_keras(residual_model(filters=16)),
    }


def _plan(graph, spec, batch):
    cluster = Cluster.from_yaml(spec) if spec.endswith(".yaml") else Cluster.from_string(spec)
    cost = AnalyticCostModel(cluster, framework="tensorflow")
    plan = disco.plan(graph, cluster, batch, cost_model=cost, backend="tensorflow")
    assert plan.validate(graph, cluster) == []
    assert plan.is_data_parallel
    assert plan.prediction.step_time_s == simulate(graph, cluster, plan,
                                                   cost_model=cost).step_time_s
    return plan, cluster, cost


# Before the fix (session 21, predicted): 0.564 -> 1.602 ms, 0.554 -> 0.802 ms,
# 0.282 -> 0.330 ms and 1.466 -> 149.9 ms: Disco used every device it was given.
# "link": the added node's link is the slowest; "weak node": the links are equal and
# the added node has the least peak FLOP/s.
@pytest.mark.parametrize("model, original, added, batch, reason", [
    ("encoder", "node0:2xA100@100", "node1:2xA100@5", 64, "link"),
    ("encoder", "node0:4xV100@25", "node1:1xV100@25", 64, "weak node"),
    ("small_cnn", "node0:4xV100@25", "node1:1xV100@25", 256, "weak node"),
    ("wide_encoder", "node0:4xA100@100", "node1:1xA100@2", 16, "link"),
])
def test_adding_a_node_behind_a_slow_link_never_slows_disco(graphs, model, original, added,
                                                             batch, reason):
    graph = graphs[model]
    alone, _, _ = _plan(graph, original, batch)
    plan, cluster, cost = _plan(graph, f"{original};{added}", batch)
    assert plan.prediction.step_time_s <= alone.prediction.step_time_s * (1 + 1e-9)
    # The added node is left out, and the plan says which devices and why.
    node = added.split(":")[0]
    dropped = [d for d in cluster.names if cluster.device(d).node == node]
    assert not set(dropped) & set(plan.devices)
    note = [n for n in plan.notes if n.startswith("Left out ")]
    assert len(note) == 1 and all(d in note[0] for d in dropped), plan.notes
    if reason == "link":
        assert f"behind the slowest network link ({node}, " in note[0]
    else:
        assert f"{node} has the least peak FLOP/s of the nodes behind the slowest links" in note[0]
    assert plan.provenance.options["left_out"] == {d: reason for d in dropped}
    # Never slower than the proportional baseline on every device.
    everything = baselines.proportional(graph, cluster, batch)
    assert plan.prediction.step_time_s < simulate(graph, cluster, everything,
                                                  cost_model=cost).step_time_s


def test_batch_smaller_than_the_device_count_uses_fewer_devices(graphs):
    graph = graphs["encoder"]
    # Before the fix: PlanError "batch_size 4 is smaller than the number of devices (6)".
    plan, cluster, _ = _plan(graph, "node0:2xA100@100;node1:4xT4@25", 4)
    assert 1 <= len(plan.devices) <= 4
    assert sum(r.batch_share for r in plan.replicas) == 4
    assert all(r.batch_share >= 1 for r in plan.replicas)
    assert all(cluster.device(d).model.startswith("A100") for d in plan.devices)
    alone, _, _ = _plan(graph, "node0:2xA100@100", 4)
    assert plan.prediction.step_time_s <= alone.prediction.step_time_s * (1 + 1e-9)
    note = [n for n in plan.notes if n.startswith("Left out ")]
    assert note and all(d in note[0] for d in cluster.names if d not in plan.devices)
    # The cut names the batch for the T4s it never priced.
    assert "the batch (4) is smaller than the device count (6)" in note[0] or len(
        plan.devices) == 1
    # One sample: one device, the fastest.
    one, _, _ = _plan(graph, "node0:2xA100@100;node1:4xT4@25", 1)
    assert one.devices == ["node0/gpu0"]
    # Eight identical devices and a batch of 3: at most 3 replicas.
    three, cluster, _ = _plan(graph, "examples/clusters/v100x8_nvlink.yaml", 3)
    assert 1 <= len(three.devices) <= 3
    assert sum(r.batch_share for r in three.replicas) == 3


# Predicted before the fix (and after: every device pays its way here).
@pytest.mark.parametrize("model, spec, batch, step_s", [
    ("small_cnn", "examples/clusters/v100x8_nvlink.yaml", 256, 0.00022112644449763023),
    ("encoder", "examples/clusters/v100x8_nvlink.yaml", 256, 0.0006135635034746616),
    ("res", "examples/clusters/hetero_testbed.yaml", 1024, 0.0009463575662408616),
    ("encoder", "examples/clusters/hetero_testbed.yaml", 1024, 0.0013777550491685083),
    ("small_cnn", "examples/clusters/hetero_testbed.yaml", 1024, 0.0007319945719094507),
])
def test_clusters_where_every_device_pays_its_way_are_unchanged(graphs, model, spec, batch,
                                                                step_s):
    plan, cluster, _ = _plan(graphs[model], spec, batch)
    assert plan.devices == cluster.names
    assert plan.prediction.step_time_s == pytest.approx(step_s, rel=1e-9)
    assert not [n for n in plan.notes if n.startswith("Left out ")]
    assert plan.provenance.options["left_out"] == {}
