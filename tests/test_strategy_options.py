"""AutoStrategy's options: refused when made if contradictory, unused or malformed, and a
forced plan shaped by options scored on the candidates' scale (session 26)."""

import keras
import pytest

from autodist_keras import AutoStrategy
from autodist_keras import Cluster
from autodist_keras.errors import StrategyError

TESTBED = ["node0/cpu0", "node0/cpu1", "node0/cpu2"]
COSTS = {"node0/cpu0": [0.01, 0.001], "node0/cpu1": [0.01, 0.002], "node0/cpu2": [0.01, 0.002]}


def _model(strategy):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(3)])
        model.compile(optimizer="sgd", loss="mse")
    return model


def _row(data, name):
    return next(c for c in data["candidates"] if c["name"] == name)


def test_forced_plan_with_a_redundant_option_is_scored_as_the_candidate_it_equals():
    # sync="allreduce" is the default: the plan IS even data parallelism, so it gets the
    # data_parallel_even candidate's figure (until session 26: the raw simulator's, and
    # explain() claimed a 1.6x to 2.4x speedup over itself).
    strategy = AutoStrategy("data_parallel", cluster=Cluster.cpu_testbed(), sync="allreduce")
    plan = strategy.plan_for(_model(strategy), 24)
    data = strategy.explain(format="json")
    even = _row(data, "data_parallel_even")
    assert [r.batch_share for r in plan.replicas] == [8, 8, 8]
    assert plan.prediction.step_time_s == pytest.approx(even["predicted_step_time_s"])
    assert data["predicted"]["source"] == even["scorer"]
    assert data["speedup_vs_even_predicted"] == 1.0
    # The chosen plan is named with its options, and the row it equals is named.
    assert data["chosen_options"] == {"sync": "allreduce"}
    assert "is the data_parallel_even row" in data["candidates_note"]
    text = strategy.explain()
    assert "chose data_parallel_even with sync='allreduce'" in text
    assert ("Candidates: the baselines as a search builds them; this plan, data_parallel_even "
            "with sync='allreduce', is the data_parallel_even row") in text


def test_forced_ps_plan_is_on_the_scale_of_the_candidates():
    strategy = AutoStrategy("data_parallel", cluster=Cluster.cpu_testbed(), sync="ps")
    plan = strategy.plan_for(_model(strategy), 24)
    data = strategy.explain(format="json")
    # data_parallel_even_ps is the same plan (server: the first device), scored in the search.
    ps_row = _row(data, "data_parallel_even_ps")
    assert {s.server for s in plan.sync.values()} == {"node0/cpu0"}
    assert plan.prediction.step_time_s == pytest.approx(ps_row["predicted_step_time_s"])
    assert data["predicted"]["source"] == ps_row["scorer"]
    even = _row(data, "data_parallel_even")
    assert data["speedup_vs_even_predicted"] == pytest.approx(
        even["predicted_step_time_s"] / plan.prediction.step_time_s, abs=1e-3)
    assert data["chosen_options"] == {"sync": "ps"}
    # (the review found the note saying the rows were built "without sync='ps'")
    assert "is the data_parallel_even_ps row" in data["candidates_note"]
    assert "without" not in data["candidates_note"]
    assert "(scored differently" not in strategy.explain()


def test_a_forced_plan_unlike_every_candidate_says_the_rows_lack_its_options():
    speeds = {d: s for d, s in zip(TESTBED, (1.0, 3.0, 2.0))}
    strategy = AutoStrategy("proportional", cluster=Cluster.cpu_testbed(), speeds=speeds)
    plan = strategy.plan_for(_model(strategy), 24)
    assert [r.batch_share for r in plan.replicas] == [4, 12, 8]
    note = strategy.explain(format="json")["candidates_note"]
    assert note.startswith("the baselines as a search builds them, without speeds=")


def test_speeds_and_step_costs_are_alternatives():
    speeds = {d: 1.0 for d in TESTBED}
    with pytest.raises(StrategyError, match="speeds and step_costs are alternatives") as info:
        AutoStrategy("proportional", cluster=Cluster.cpu_testbed(), speeds=speeds,
                     step_costs=COSTS)
    assert "Received: speeds=" in str(info.value)
    AutoStrategy("proportional", cluster=Cluster.cpu_testbed(), step_costs=COSTS)  # alone: fine


@pytest.mark.parametrize("strategy", ["data_parallel", "proportional"])
def test_an_allreduce_algorithm_with_ps_sync_is_refused(strategy):
    with pytest.raises(StrategyError, match="sync='ps'.*no all-reduce") as info:
        AutoStrategy(strategy, cluster=Cluster.cpu_testbed(), sync="ps", algorithm="tree")
    assert str(info.value).endswith("Received: algorithm='tree', sync='ps'")
    AutoStrategy(strategy, cluster=Cluster.cpu_testbed(), sync="allreduce", algorithm="tree")


@pytest.mark.parametrize("strategy", ["auto", "proportional"])
def test_step_costs_naming_a_device_outside_the_cluster_are_refused_when_made(strategy):
    with pytest.raises(StrategyError, match="step_costs names devices that are not in the "
                                            r"cluster.*Received: \['node0/gpu0'\]"):
        AutoStrategy(strategy, cluster=Cluster.cpu_testbed(),
                     step_costs=dict(COSTS, **{"node0/gpu0": [0.01, 0.001]}))


@pytest.mark.parametrize("devices,message", [
    ("node0/cpu0", "devices must be a non-empty list of device names"),
    (5, "devices must be a non-empty list"),
    ([], "devices must be a non-empty list"),
    ([0, 1], "devices must be a non-empty list"),
])
def test_devices_must_be_a_list_of_distinct_device_names(devices, message):
    with pytest.raises(StrategyError, match=message) as info:
        AutoStrategy("data_parallel", cluster=Cluster.cpu_testbed(), devices=devices)
    assert "Received: devices=" in str(info.value)


def test_devices_named_twice_are_refused_and_a_tuple_or_a_list_of_one_accepted():
    with pytest.raises(StrategyError, match=r"devices names \['node0/cpu0'\] more than "
                                            "once") as info:
        AutoStrategy("data_parallel", cluster=Cluster.cpu_testbed(),
                     devices=["node0/cpu0", "node0/cpu1", "node0/cpu0"])
    assert "Received: devices=" in str(info.value)
    assert AutoStrategy("data_parallel", cluster=Cluster.cpu_testbed(),
                        devices=("node0/cpu0", "node0/cpu1")).devices == TESTBED[:2]
    assert AutoStrategy("single_device", cluster=Cluster.cpu_testbed(),
                        devices=["node0/cpu1"]).devices == ["node0/cpu1"]


def test_ps_server_outside_devices_is_refused_on_torch_only():
    options = dict(cluster=Cluster.cpu_testbed(), devices=TESTBED[:2], sync="ps",
                   ps_server="node0/cpu2")
    if keras.backend.backend() == "torch":
        # The PyTorch runtime hosts the server in a replica: refused when made, not at fit.
        with pytest.raises(StrategyError, match="ps_server 'node0/cpu2' is not one of "
                                                "devices=.*PyTorch") as info:
            AutoStrategy("data_parallel", **options)
        assert "Received: ps_server='node0/cpu2'" in str(info.value)
        return
    # TensorFlow keeps the variables on the server device: such a plan runs.
    strategy = AutoStrategy("data_parallel", **options)
    plan = strategy.plan_for(_model(strategy), 24)
    assert plan.devices == TESTBED[:2]
    assert {s.server for s in plan.sync.values()} == {"node0/cpu2"}


@pytest.mark.parametrize("strategy,option", [
    ("data_parallel", {"op_fusion": "on"}),
    ("proportional", {"op_fusion": "auto"}),
    ("single_device", {"op_fusion": "on"}),
    ("data_parallel", {"op_fusion_compiler": "inductor"}),
])
def test_op_fusion_with_a_strategy_whose_plans_have_no_regions_is_refused(strategy, option):
    name, value = next(iter(option.items()))
    with pytest.raises(StrategyError, match=f"would be ignored by strategy='{strategy}'.*"
                                            "'auto' or 'disco'") as info:
        AutoStrategy(strategy, cluster=Cluster.cpu_testbed(), **option)
    assert str(info.value).endswith(f"Received: strategy='{strategy}', {name}={value!r}")
    # "off" asks for what the strategy does anyway (scripts set it for every strategy)
    AutoStrategy(strategy, cluster=Cluster.cpu_testbed(), op_fusion="off")


def test_estimator_with_plan_is_refused_and_op_fusion_with_plan_is_kept():
    maker = AutoStrategy("data_parallel", cluster=Cluster.cpu_testbed())
    plan = maker.plan_for(_model(maker), 24)
    with pytest.raises(StrategyError, match="estimator scores the candidate plans.*plan=") as info:
        AutoStrategy(cluster=Cluster.cpu_testbed(), plan=plan, estimator="simulator")
    assert str(info.value).endswith("Received: estimator='simulator'")
    # A given plan may have op-fusion regions (a Disco plan): op_fusion decides whether
    # the runtime compiles them, so it stays allowed with plan=.
    AutoStrategy(cluster=Cluster.cpu_testbed(), plan=plan, op_fusion="off")
    # single_device's figure (and its candidates') come from the estimator: kept too.
    AutoStrategy("single_device", cluster=Cluster.cpu_testbed(), estimator="simulator")


@pytest.mark.parametrize("value", [0.01, 0.5])
def test_a_timeout_too_short_for_any_step_is_refused(value):
    """timeout_s=0.01 on PyTorch failed the first collective with gloo's 'Connection
    closed by peer ... typically caused by a remote worker crashing', naming no option."""
    with pytest.raises(StrategyError, match=r"timeout_s must be a number of seconds, at "
                                            r"least 1: .*Received: timeout_s=") as info:
        AutoStrategy("data_parallel", cluster=Cluster.cpu_testbed(), timeout_s=value)
    assert str(info.value).endswith(f"Received: timeout_s={value!r}")
    AutoStrategy("data_parallel", cluster=Cluster.cpu_testbed(), timeout_s=1)
