"""Shares that balance measured step costs: fitting, the linear program, the plan and the option."""

import json

import keras
import pytest

from autodist_keras import AutoStrategy
from autodist_keras.devices import Cluster
from autodist_keras.errors import PlanError
from autodist_keras.errors import StrategyError
from autodist_keras.graph import ModelGraph
from autodist_keras.strategies import baselines
from autodist_keras.strategies.plan import Plan
from autodist_keras.strategies.share_balance import StepCost
from autodist_keras.strategies.share_balance import balanced_shares
from autodist_keras.strategies.share_balance import busiest_load_s
from autodist_keras.strategies.share_balance import fit_step_costs
from autodist_keras.strategies.share_balance import resources

TESTBED = ["node0/cpu0", "node0/cpu1", "node0/cpu2"]


@pytest.fixture(scope="module")
def graph(tiny_graph):
    return tiny_graph


def test_fit_recovers_exact_lines():
    truth = {"a": StepCost(0.03, 0.002), "b": StepCost(0.0125, 0.0005)}
    observations = [(d, n, c.cost_s(n)) for d, c in truth.items() for n in (24, 32, 48)]
    fitted = fit_step_costs(observations)
    assert list(fitted) == ["a", "b"]
    for device, cost in truth.items():
        assert fitted[device].fixed_s == pytest.approx(cost.fixed_s, abs=1e-12)
        assert fitted[device].per_sample_s == pytest.approx(cost.per_sample_s, abs=1e-12)
    as_dicts = [{"device": d, "samples": n, "cost_s": c} for d, n, c in observations]
    assert fit_step_costs(as_dicts) == fitted
    assert StepCost.from_dict(fitted["a"].to_dict()) == fitted["a"]


def test_fit_clips_negative_slope_and_intercept():
    # Cost falls with the share (noise): the slope says nothing, so the cost is
    # taken as proportional to the share (the line through the origin), never
    # a zero per-sample cost that would hand the device every sample.
    with pytest.warns(UserWarning, match="does not grow with its share.*proportional"):
        falling = fit_step_costs([("a", 10, 0.05), ("a", 20, 0.03)])["a"]
    assert falling.fixed_s == 0.0
    assert falling.per_sample_s == pytest.approx((10 * 0.05 + 20 * 0.03) / (10**2 + 20**2))
    # A line through the points would cross zero below 0 samples: through the origin.
    steep = fit_step_costs([("a", 10, 0.01), ("a", 20, 0.05)])["a"]
    assert steep.fixed_s == 0.0
    assert steep.per_sample_s == pytest.approx((10 * 0.01 + 20 * 0.05) / (10**2 + 20**2))


def test_noisy_fit_keeps_shares_sensible(testbed):
    # The per-rank CPU costs of one TensorFlow MLP run (batch 384): cpu0's cost
    # fell from 27.4 to 24.7 ms when its share grew from 128 to 192 (noise).
    # A zero per-sample cost there once gave shares 382/1/1; the proportional
    # fallback keeps cpu0 near its measured speed.
    observations = [("node0/cpu0", 128, 0.0274), ("node0/cpu0", 192, 0.0247),
                    ("node0/cpu1", 128, 0.0300), ("node0/cpu1", 96, 0.0207),
                    ("node0/cpu2", 128, 0.0299), ("node0/cpu2", 96, 0.0206)]
    with pytest.warns(UserWarning, match="node0/cpu0"):
        costs = fit_step_costs(observations, tied=[["node0/cpu1", "node0/cpu2"]])
    assert costs["node0/cpu0"].per_sample_s > 0
    shares = balanced_shares(testbed, TESTBED, costs, 384)
    assert sum(shares) == 384
    assert 150 <= shares[0] <= 300, shares
    assert min(shares[1:]) >= 40, shares


def test_fit_errors():
    with pytest.raises(PlanError, match="at least two different shares.*Received"):
        fit_step_costs([("a", 32, 0.1), ("a", 32, 0.11), ("b", 16, 0.1), ("b", 8, 0.05)])
    with pytest.raises(PlanError, match="cost_s.*Received: -0.1"):
        fit_step_costs([("a", 32, -0.1), ("a", 16, 0.1)])
    with pytest.raises(PlanError, match="observation.*Received"):
        fit_step_costs([("a", 32)])
    with pytest.raises(PlanError, match="Received: \\[\\]"):
        fit_step_costs([])


@pytest.mark.parametrize("fixed_ms,per_sample_ms,batch", [(30, 2, 96), (10, 0.2, 3072),
                                                          (0, 1, 384)])
def test_testbed_closed_form(testbed, fixed_ms, per_sample_ms, batch):
    # Core 0 carries f + p n0, core 1 carries 2 f + p (B - n0): equal at
    # n0 = B (1 + x) / 2 with x = f / (p B); cpu1 and cpu2 split the rest.
    f, p = fixed_ms / 1e3, per_sample_ms / 1e3
    shares = balanced_shares(testbed, TESTBED, {d: (f, p) for d in TESTBED}, batch)
    x = f / (p * batch)
    exact = [batch * (1 + x) / 2, batch * (1 - x) / 4, batch * (1 - x) / 4]
    assert sum(shares) == batch
    assert all(abs(s - e) < 1 for s, e in zip(shares, exact)), (shares, exact)
    assert abs(shares[1] - shares[2]) <= 1
    # Predicted busiest core: 1.5 f + p B / 2, so even / balanced = 4/3 for any f.
    balanced_load = max(f + p * shares[0], 2 * f + p * (shares[1] + shares[2]))
    assert balanced_load == pytest.approx(1.5 * f + p * batch / 2, abs=p)


def test_resources_group_shared_cores(testbed):
    assert resources(testbed, TESTBED) == [[0], [1, 2]]
    chained = Cluster.cpu_testbed([{"cores": [0], "threads": 1}, {"cores": [0, 1], "threads": 1},
                                   {"cores": [1], "threads": 1}])
    assert resources(chained, chained.names) == [[0, 1, 2]]


def test_gpus_balance_each_device_alone():
    cluster = Cluster.resolve("2xV100,1xT4")
    costs = {cluster.names[0]: (0.010, 0.001), cluster.names[1]: (0.010, 0.001),
             cluster.names[2]: (0.020, 0.003)}
    assert resources(cluster, cluster.names) == [[0], [1], [2]]
    shares = balanced_shares(cluster, cluster.names, costs, 100)
    assert sum(shares) == 100
    finish = [costs[d][0] + costs[d][1] * s for d, s in zip(cluster.names, shares)]
    # Equal finish times up to one sample of the slowest per-sample cost.
    assert max(finish) - min(finish) <= 0.003 + 1e-12, (shares, finish)
    assert shares == [44, 44, 12]


def test_caps_are_respected_and_infeasible_caps_fail(testbed):
    costs = {d: (0.03, 0.002) for d in TESTBED}
    shares = balanced_shares(testbed, TESTBED, costs, 96, caps=[40, 100, 100])
    assert shares == [40, 28, 28]
    assert balanced_shares(testbed, TESTBED, costs, 96, caps={"node0/cpu0": 90,
                                                             "node0/cpu1": 3,
                                                             "node0/cpu2": 90})[1] <= 3
    with pytest.raises(PlanError, match="within its cap.*Received: caps="):
        balanced_shares(testbed, TESTBED, costs, 96, caps=[30, 30, 30])
    with pytest.raises(PlanError, match="no entry for devices \\['node0/cpu2'\\].*Received"):
        balanced_shares(testbed, TESTBED, {d: (0.03, 0.002) for d in TESTBED[:2]}, 96)


def test_proportional_plan_records_costs(graph, testbed, tmp_path):
    costs = {d: {"fixed_s": 0.03, "per_sample_s": 0.002} for d in TESTBED}
    plan = baselines.proportional(graph, testbed, 96, step_costs=costs)
    assert [r.batch_share for r in plan.replicas] == [56, 20, 20]
    assert plan.provenance.options["step_costs"] == costs
    assert any(n.startswith("shares balance measured step costs") for n in plan.notes)
    path = tmp_path / "plan.json"
    plan.to_json(path)
    again = Plan.from_json(path)
    assert again.provenance.options["step_costs"] == costs
    assert [r.batch_share for r in again.replicas] == [56, 20, 20]
    # Tuples and StepCost values work as well; without costs nothing changes.
    tuples = baselines.proportional(graph, testbed, 96, step_costs={
        d: (0.03, 0.002) if i else StepCost(0.03, 0.002) for i, d in enumerate(TESTBED)})
    assert [r.batch_share for r in tuples.replicas] == [56, 20, 20]
    assert [r.batch_share for r in baselines.proportional(graph, testbed, 96).replicas] == [
        48, 24, 24]


def test_proportional_step_cost_errors(graph, testbed):
    with pytest.raises(PlanError, match="no entry for devices \\['node0/cpu2'\\].*Received"):
        baselines.proportional(graph, testbed, 96,
                               step_costs={d: (0.03, 0.002) for d in TESTBED[:2]})
    with pytest.raises(PlanError, match="fixed_s must be.*non-negative.*Received: -0.03"):
        baselines.proportional(graph, testbed, 96,
                               step_costs={d: (-0.03, 0.002) for d in TESTBED})
    with pytest.raises(PlanError, match="Received"):
        baselines.proportional(graph, testbed, 96, step_costs={d: "fast" for d in TESTBED})


def test_auto_strategy_option(tiny_mlp, testbed, tmp_path):
    costs = {d: [0.03, 0.002] for d in TESTBED}
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"step_costs": {d: {"fixed_s": 0.03, "per_sample_s": 0.002}
                                               for d in TESTBED}}))
    for given in (costs, str(path)):
        strategy = AutoStrategy("proportional", cluster=testbed, step_costs=given)
        model = tiny_mlp()
        plan = strategy.plan_for(model, 96)
        assert [r.batch_share for r in plan.replicas] == [56, 20, 20]
        assert plan.provenance.options["step_costs"]["node0/cpu0"] == {
            "fixed_s": 0.03, "per_sample_s": 0.002}
        text = strategy.explain()
        assert "shares balance measured step costs" in text
        round_trip = Plan.from_dict(json.loads(json.dumps(strategy.explain("json")["plan"])))
        assert round_trip.provenance.options["step_costs"] == plan.provenance.options[
            "step_costs"]
    plain = AutoStrategy("proportional", cluster=testbed).plan_for(tiny_mlp(), 96)
    assert [r.batch_share for r in plain.replicas] == [48, 24, 24]
    # Even shares cannot use measured costs: the option would be ignored, so it is an error.
    with pytest.raises(StrategyError, match="would be ignored by strategy='data_parallel'"):
        AutoStrategy("data_parallel", cluster=testbed, step_costs=costs)
    with pytest.raises(StrategyError, match="step_costs.*Received"):
        AutoStrategy("proportional", cluster=testbed, step_costs=str(tmp_path / "none.json"))
    with pytest.raises(StrategyError, match="Valid options:.*step_costs"):
        AutoStrategy("proportional", cluster=testbed, step_cost=costs)


def test_plan_cache_key_depends_on_costs(graph, testbed):
    from autodist_keras.strategies.selection import cache_key

    keys = {
        cache_key(graph, testbed, 96, TESTBED, [], {"step_costs": {
            d: {"fixed_s": fixed, "per_sample_s": 0.002} for d in TESTBED}})
        for fixed in (0.01, 0.03)
    }
    assert len(keys) == 2


def test_auto_search_proportional_candidates_use_costs(graph, testbed):
    from autodist_keras.strategies.selection import build_candidates

    costs = {d: {"fixed_s": 0.03, "per_sample_s": 0.002} for d in TESTBED}
    candidates = build_candidates(graph, testbed, 96, families=[],
                                  options={"step_costs": costs})
    by_name = {c.name: c for c in candidates}
    for name in ("proportional", "proportional_ps"):
        assert [r.batch_share for r in by_name[name].plan.replicas] == [56, 20, 20]
    assert [r.batch_share for r in by_name["data_parallel_even"].plan.replicas] == [32, 32, 32]


def test_tied_devices_share_one_line(testbed):
    from autodist_keras.strategies.share_balance import interchangeable_devices

    tied = interchangeable_devices(testbed, TESTBED)
    assert tied == [["node0/cpu1", "node0/cpu2"]]
    assert interchangeable_devices(Cluster.resolve("2xV100"), ["node0/gpu0", "node0/gpu1"]) == []
    # Each of cpu1 and cpu2 alone would fit a noisy line; tied, both get the line through all
    # four points, and only one share each is enough.
    observations = [("node0/cpu0", 32, 0.079), ("node0/cpu0", 48, 0.115),
                    ("node0/cpu1", 32, 0.086), ("node0/cpu2", 24, 0.074)]
    fitted = fit_step_costs(observations, tied=tied)
    assert fitted["node0/cpu1"] == fitted["node0/cpu2"]
    assert fitted["node0/cpu1"].per_sample_s == pytest.approx(0.0015)
    assert fitted["node0/cpu1"].fixed_s == pytest.approx(0.038)


def test_busiest_load_sums_the_devices_sharing_a_core(testbed):
    costs = {d: (0.03, 0.002) for d in TESTBED}
    # Even: core 1 carries cpu1 and cpu2, 2 x (30 ms + 32 x 2 ms).
    assert busiest_load_s(testbed, TESTBED, costs, [32, 32, 32]) == pytest.approx(0.188)
    # Balanced: core 0 30 + 56 x 2 = 142 ms, core 1 2 x 30 + 40 x 2 = 140 ms.
    assert busiest_load_s(testbed, TESTBED, costs, [56, 20, 20]) == pytest.approx(0.142)
