"""Plan files read back: their JSON shape is checked field by field, a plan remembers
the file it came from, and errors and explanations of a plan given with `plan=` say
where it came from (and not that a cache was read)."""

import json
import re
import warnings

import keras
import numpy as np
import pytest

from autodist_keras import AutoStrategy
from autodist_keras import Cluster
from autodist_keras.errors import PlanError
from autodist_keras.errors import StrategyError
from autodist_keras.estimator import simulate
from autodist_keras.graph import ModelGraph
from autodist_keras.strategies import baselines
from autodist_keras.strategies import selection
from autodist_keras.strategies.explain import explanation
from autodist_keras.strategies.plan import Plan


def _model():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((8,), name="inp")
    hidden = keras.layers.Dense(16, activation="relu", name="d1")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(4, name="d2")(hidden), name="m")
    model.compile(optimizer="sgd", loss="mse")
    return model


def _data():
    x = np.random.default_rng(0).normal(size=(48, 8)).astype("float32")
    return x, x[:, :4]


@pytest.fixture(scope="module")
def cluster():
    return Cluster.cpu_testbed()


@pytest.fixture(scope="module")
def graph():
    return ModelGraph.from_keras(_model())


@pytest.fixture(scope="module")
def predicted(graph, cluster):
    """A proportional plan with the simulator's prediction, as `to_dict()` writes it."""
    plan = baselines.proportional(graph, cluster, 24)
    plan.prediction = simulate(graph, cluster, plan).to_prediction()
    plan.prediction.baselines = {"single_device": {
        "name": "single_device", "family": "baseline", "predicted_step_time_s": 0.01,
        "feasible": True}}
    return plan.to_dict()


def _set(*keys, value):
    """An edit setting `data[k0][k1]...` to `value`."""
    def edit(data):
        for key in keys[:-1]:
            data = data[key]
        data[keys[-1]] = value
    return edit


@pytest.mark.parametrize("edit, message", [
    # prediction fields explain() computes with (it crashed with a TypeError or an
    # AttributeError after fit; -1 and NaN were printed)
    (_set("prediction", "step_time_s", value=None),
     r"prediction\.step_time_s: must be a number of seconds, not null.*Received: None"),
    (_set("prediction", "step_time_s", value="fast"),
     r"prediction\.step_time_s: must be a number of seconds, not a string.*Received: 'fast'"),
    (_set("prediction", "step_time_s", value=-1.0),
     r"prediction\.step_time_s: must be a finite number of seconds, not negative.*Received: -1"),
    (_set("prediction", "step_time_s", value=float("nan")),
     r"prediction\.step_time_s: must be a finite number.*Received: nan"),
    (_set("prediction", "baselines", value=None),
     r"prediction\.baselines: must be an object.*not null.*Received: None"),
    (_set("prediction", "per_device", value={"node0/cpu0": "x"}),
     r"prediction\.per_device\['node0/cpu0'\]: must be an object.*not a string.*Received: 'x'"),
    # a string where a list of names belongs (it was read letter by letter)
    (_set("buckets", value="d1/kernel"),
     r"buckets: must be a list of buckets.*not a string.*Received: 'd1/kernel'"),
    (_set("op_fusion", value="d1"), r"op_fusion: must be a list .*not a string.*Received: 'd1'"),
    (_set("order", value={"node0/cpu0": ["d1"]}),
     r"order\['node0/cpu0'\]\[0\]: must be a \[layer, phase\] pair.*Received: 'd1'"),
    (_set("notes", value="hello"), r"notes: must be a list of notes.*Received: 'hello'"),
    # integers written as strings (refused only at the first fit before)
    (_set("global_batch_size", value="96"),
     r"global_batch_size: must be an integer, not a string.*Received: '96'"),
    (_set("groups", 0, "replicas", 1, "batch_share", value="48"),
     r"groups\[0\]\.replicas\[1\]\.batch_share: must be an integer, not a string.*"
     r"Received: '48'"),
    (lambda d: d.update(groups={"all": d["groups"][0]}),
     r"groups: must be a list of layer groups.*not an object.*Received: \{'all'"),
    # unknown fields, at every level (a typo next to the real field was ignored)
    (_set("groups", 0, "replicas", 1, "batch_shares", value=9),
     r"groups\[0\]\.replicas\[1\]: unknown field 'batch_shares'; known fields: device, "
     r"batch_share\..*Received: an object with keys \['batch_share', 'batch_shares', 'device'\]"),
    (_set("groups", 0, "colour", value="red"), r"groups\[0\]: unknown field 'colour'.*Received"),
    (_set("bukets", value=[]), r"top level: unknown field 'bukets'; known fields: .*buckets.*Rece"),
    (_set("provenance", "author", value="me"),
     r"provenance: unknown field 'author'; known fields: planner, .*Received"),
    (_set("prediction", "step_ms", value=1.0), r"prediction: unknown field 'step_ms'.*Received"),
    (_set("sync", "d1/kernel", "server", value=["node0/cpu0"]),
     r"sync\['d1/kernel'\]\.server: must be a string, or null, not a list.*Received"),
])
def test_plan_file_fields_of_the_wrong_json_type_or_unknown_are_refused_by_path(
        predicted, cluster, tmp_path, edit, message):
    data = json.loads(json.dumps(predicted))
    edit(data)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))  # (NaN written as the JSON extension Python reads)
    with pytest.raises(PlanError, match=re.escape(str(path)) + ": " + message):
        Plan.from_json(path)
    # Refused when the strategy is made, not after fit (explain() crashed there).
    with pytest.raises(PlanError, match=message):
        AutoStrategy(cluster=cluster, plan=str(path))


def test_plans_the_package_writes_still_load_and_remember_their_file(graph, cluster, predicted,
                                                                    tmp_path):
    """Every baseline plan (with a prediction), the chosen plan of a search with its
    candidates' figures, and a schema version 1 file load; the path a plan was read
    from is kept (`read_from`), never written."""
    plans = [Plan.from_dict(predicted)]
    for build in (baselines.single_device, baselines.data_parallel_even, baselines.proportional):
        plan = build(graph, cluster, 24)
        plan.prediction = simulate(graph, cluster, plan).to_prediction()
        plans.append(plan)
    chosen, candidates = selection.choose_plan(graph, cluster, 24, cache_dir=tmp_path,
                                               estimator="simulator")
    plans += [chosen] + [c.plan for c in candidates if c.plan is not None]
    for i, plan in enumerate(plans):
        path = tmp_path / f"plan{i}.json"
        plan.to_json(path)
        loaded = Plan.from_json(path)
        assert loaded.to_dict() == json.loads(path.read_text())
        assert loaded.read_from == str(path)
        assert "read_from" not in loaded.to_json()
    old = json.loads(json.dumps(predicted))
    old["schema_version"] = 1  # (version 2 added these two)
    del old["prediction"]["plan_digest"], old["provenance"]["layer_order"]
    assert Plan.from_dict(old).validate(graph, cluster) == []
    assert Plan.from_dict(predicted).read_from is None
    assert Plan.from_json(json.dumps(predicted)).read_from is None  # text, not a file


def test_plan_errors_found_at_fit_name_the_plan_file(graph, cluster, tmp_path):
    """Shares that do not add up are found when the plan meets the model (in fit): the
    error says the plan came from plan= and names its file, as errors raised when the
    strategy is made do."""
    plan = baselines.proportional(graph, cluster, 24)
    plan.groups[0].replicas[0].batch_share -= 4
    path = tmp_path / "plan.json"
    plan.to_json(path)
    strategy = AutoStrategy(cluster=cluster, plan=str(path))
    with strategy.scope():
        model = _model()
    with pytest.raises(PlanError, match=re.escape(f"The plan given with plan= ({path}): ")
                       + r"groups\[0\] \('all'\): batch shares add up to 20, not to the global "
                         r"batch size 24\..*Received: \[8, 6, 6\]"):
        model.fit(*_data(), batch_size=24, verbose=0)


def test_a_plan_saved_from_a_cached_run_is_not_explained_as_reused_from_the_cache(
        graph, cluster, tmp_path):
    """The note 'cache: reused plan ... from <cache file>' travels in a plan file saved
    from a run whose plan came from the cache; loaded with plan=, no cache was read."""
    selection.choose_plan(graph, cluster, 24, cache_dir=tmp_path / "cache", estimator="simulator")
    cached, again = selection.choose_plan(graph, cluster, 24, cache_dir=tmp_path / "cache",
                                          estimator="simulator")
    assert again == [] and any(n.startswith("cache: reused") for n in cached.notes)
    assert explanation(cached, cluster)["from_cache"] is True  # the cached run's own
    path = tmp_path / "saved.json"
    cached.to_json(path)

    strategy = AutoStrategy(cluster=cluster, plan=str(path))
    assert "cache" not in strategy.explain()  # (before fit too)
    with strategy.scope():
        model = _model()
    model.fit(*_data(), batch_size=24, verbose=0)
    assert not any(n.startswith("cache:") for n in strategy.plan.notes)
    assert "cache" not in strategy.explain()
    data = strategy.explain(format="json")
    assert data["from_cache"] is False and data["fixed_plan"] is True
    assert not any("cache" in n for n in data["notes"] + data["plan"]["notes"])
    assert any(n.startswith("cache: reused") for n in Plan.from_json(path).notes)  # file as is


_TINY_MEMORY = """
description: the CPU testbed with 1 kB of memory per device
nodes:
  - name: node0
    cpus:
      - {cores: [0], threads: 1, memory_gb: 0.000001}
      - {cores: [1], threads: 1, count: 2, memory_gb: 0.000001}
    intra_link: shm
"""


@pytest.mark.parametrize("made_for", ["roomy", "tiny"])
def test_a_plan_file_predicted_not_to_fit_here_is_refused_at_fit(graph, cluster, tmp_path,
                                                                 made_for):
    """A forced strategy refuses a plan predicted not to fit in memory; the same plan
    given with plan= trained without a word, whether its file recorded the prediction
    (made for this cluster) or said it fits (made for a roomier one: the recorded
    figures describe that cluster, and were not simulated again here)."""
    tiny = tmp_path / "tiny.yaml"
    tiny.write_text(_TINY_MEMORY)
    tiny_cluster = Cluster.from_yaml(str(tiny))
    made_on = tiny_cluster if made_for == "tiny" else cluster
    plan = baselines.data_parallel_even(graph, made_on, 24)
    plan.prediction = simulate(graph, made_on, plan).to_prediction()
    assert plan.prediction.feasible is (made_for == "roomy")
    path = tmp_path / "plan.json"
    plan.to_json(path)

    strategy = AutoStrategy(cluster=str(tiny), plan=str(path))
    with strategy.scope():
        model = _model()
    before = [w.copy() for w in model.get_weights()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ("made for a different cluster description")
        with pytest.raises(StrategyError, match=re.escape(
                f"The plan given with plan= ({path}) is predicted not to fit in memory here: ")
                + r"node0/cpu\d needs \d+ bytes.*Received: a plan for a global batch of 24 on "
                  r"3 device\(s\)"):
            model.fit(*_data(), batch_size=24, verbose=0)
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    assert int(model.optimizer.iterations) == 0


def test_plan_file_memory_is_checked_for_the_optimizer_compiled_here(graph, cluster, tmp_path):
    """The graph fingerprint leaves the optimizer out, so a plan recorded for the same
    model with Adam's two slots (or with none, SGD) kept its memory verdict when
    given with plan= for the model compiled with the other: a plan that fits was
    refused, and one that does not fit was run."""
    sgd_graph = graph  # (compiled with SGD: no slots)
    adam_model = _model()
    adam_model.compile(optimizer="adam", loss="mse")
    adam_graph = ModelGraph.from_keras(adam_model)
    plan = baselines.data_parallel_even(graph, cluster, 24)
    peaks = [max(simulate(g, cluster, plan).peak_memory_bytes.values())
             for g in (sgd_graph, adam_graph)]
    assert peaks[0] < peaks[1]
    middle = tmp_path / "middle.yaml"
    middle.write_text(_TINY_MEMORY.replace("0.000001", f"{sum(peaks) / 2 / 2**30:.12f}"))
    middle_cluster = Cluster.from_yaml(str(middle))
    for recorded_with, runs_with, fits in ((adam_graph, "sgd", True), (sgd_graph, "adam", False)):
        plan = baselines.data_parallel_even(recorded_with, middle_cluster, 24)
        plan.prediction = simulate(recorded_with, middle_cluster, plan).to_prediction()
        assert plan.prediction.feasible is not fits  # the verdict recorded in the file
        path = tmp_path / f"recorded_{recorded_with.optimizer}.json"
        plan.to_json(path)
        strategy = AutoStrategy(cluster=str(middle), plan=str(path))
        with strategy.scope():
            model = _model()
            model.compile(optimizer=runs_with, loss="mse")
        if fits:
            model.fit(*_data(), batch_size=24, verbose=0)
            assert strategy.plan.prediction.feasible is True
            assert any("memory figures were made for another optimizer" in n
                       for n in strategy.plan.notes)
        else:
            with pytest.raises(StrategyError, match="is predicted not to fit in memory here.*"
                               r"counting 2 optimizer slots per parameter \(Adam\)"):
                model.fit(*_data(), batch_size=24, verbose=0)
