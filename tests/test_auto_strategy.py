"""AutoStrategy's user API without training: options, planning per model, explain, plot, trace."""

import json
import re
import warnings

import keras
import numpy as np
import pytest

from autodist_keras import AutoStrategy
from autodist_keras import Cluster
from autodist_keras.errors import StrategyError
from autodist_keras.graph import zoo


def test_unknown_names_and_options_list_the_valid_ones():
    with pytest.raises(StrategyError, match="Valid names: auto") as info:
        AutoStrategy("magic")
    assert "Received: strategy='magic'" in str(info.value)
    with pytest.raises(StrategyError, match="Did you mean 'buckets' or 'bucket_bytes'.*Valid "
                                            "options: sync"):
        AutoStrategy("proportional", cluster=Cluster.cpu_testbed(), bucket_size=3)
    # Typos get the closest names; a cluster passed first is named as one.
    with pytest.raises(StrategyError, match="Unknown strategy 'proportionl'. Did you mean "
                                            "'proportional'"):
        AutoStrategy("proportionl")
    with pytest.raises(StrategyError, match="Unknown strategy 'magic'. Valid names"):
        AutoStrategy("magic")  # (nothing close: no guess)
    for cluster in ("cpu_testbed", "2xV100,1xT4", "node0:2xV100;node1:4xT4@25", "my.yaml"):
        with pytest.raises(StrategyError, match=(
                r"It looks like a cluster: the first argument is the strategy, so pass the "
                rf"cluster as a keyword, AutoStrategy\(cluster='{re.escape(cluster)}'\)")):
            AutoStrategy(cluster)
    with pytest.raises(StrategyError, match=r"AutoStrategy\(cluster=\.\.\.\)"):
        AutoStrategy(Cluster.cpu_testbed())
    for cluster in ("2XV100", "V100,1080Ti", "node-0:2xV100"):
        with pytest.raises(StrategyError, match="It looks like a cluster"):
            AutoStrategy(cluster)
    import pathlib

    with pytest.raises(StrategyError, match=r"AutoStrategy\(cluster='my.yaml'\)"):
        AutoStrategy(pathlib.Path("my.yaml"))
    with pytest.raises(StrategyError, match=r"It looks like a plan: .*AutoStrategy\(plan="
                                            r"'plan.json'\)"):
        AutoStrategy("plan.json")
    with pytest.raises(StrategyError, match="Did you mean 'auto'"):
        AutoStrategy("AUTO")
    # (a one-name array passed "in STRATEGY_NAMES" elementwise and was accepted)
    with pytest.raises(StrategyError, match="Unknown strategy array"):
        AutoStrategy(np.array(["auto"]))
    with pytest.raises(StrategyError, match="Unknown device"):
        AutoStrategy(cluster=Cluster.cpu_testbed(), devices=["node7/gpu0"])


@pytest.mark.parametrize("strategy,options,message", [
    ("fastt", {"sync": "ps"}, "would be ignored by strategy='fastt'.*'data_parallel' or "
                              "'proportional'"),
    ("heterog", {"sync": "ps", "ps_server": "node0/cpu2"}, "would be ignored"),
    ("disco", {"bucket_bytes": 1024, "algorithm": "tree"}, "chooses gradient buckets"),
    ("auto", {"sync": "ps"}, "auto compares plans"),
    ("auto", {"speeds": {"node0/cpu0": 2.0}}, "would be ignored by strategy='auto'"),
    ("data_parallel", {"speeds": {"node0/cpu0": 2.0}}, "used by strategy 'proportional'"),
    ("single_device", {"bucket_bytes": 1024}, "no gradient synchronisation"),
    ("proportional", {"sync": "foo"}, "sync must be 'allreduce' or 'ps'"),
    ("proportional", {"ps_server": "node0/cpu1"}, "needs sync='ps'"),
    ("proportional", {"sync": "ps", "ps_server": "node0/cpu9"}, "ps_server must be a device"),
    ("data_parallel", {"algorithm": "butterfly"}, "algorithm must be one of"),
    ("auto", {"bucket_bytes": -5}, "bucket_bytes must be a number of bytes >= 0"),
    ("data_parallel", {"bucket_bytes": "big"}, "bucket_bytes must be"),
    ("data_parallel", {"buckets": "x"}, "buckets must be a list of lists"),
    ("proportional", {"speeds": {"node0/cpu0": -1}}, "positive relative speed"),
    ("proportional", {"speeds": {"node0/gpu7": 1.0}}, "not in the cluster"),
    ("proportional", {"timeout_s": -1}, "timeout_s must be a number of seconds, at least 1"),
])
def test_option_values_and_unused_options_are_errors_when_the_strategy_is_made(
        strategy, options, message):
    with pytest.raises(StrategyError, match=message) as info:
        AutoStrategy(strategy, cluster=Cluster.cpu_testbed(), **options)
    assert "Received:" in str(info.value)


def test_plan_shaping_options_next_to_a_fixed_plan_are_errors(tmp_path):
    strategy = AutoStrategy("data_parallel", cluster=Cluster.cpu_testbed())
    model = zoo.mlp(input_dim=8, hidden=(16,), name="fixed_opts")
    plan = strategy.plan_for(model, 48)
    with pytest.raises(StrategyError, match="plan= gives the plan to run as it is"):
        AutoStrategy(cluster=Cluster.cpu_testbed(), plan=plan, sync="ps")
    # A plan as a dict (Plan.to_dict()) is accepted; other types are a clear error.
    again = AutoStrategy(cluster=Cluster.cpu_testbed(), plan=plan.to_dict())
    assert again.plan_for(model, 48).to_dict() == plan.to_dict()
    with pytest.raises(StrategyError, match="plan must be a Plan, a dict"):
        AutoStrategy(cluster=Cluster.cpu_testbed(), plan=42)
    with pytest.raises(StrategyError, match="timeout_s must be a number of seconds, at least 1"):
        AutoStrategy(cluster=Cluster.cpu_testbed(), plan=plan, timeout_s=0)


def test_plan_per_model_and_explain(tmp_path):
    strategy = AutoStrategy("proportional", cluster=Cluster.cpu_testbed())
    assert "No plan yet" in strategy.explain()
    small = zoo.mlp(input_dim=8, hidden=(16,), name="small")
    big = zoo.mlp(input_dim=8, hidden=(32, 32), name="big")
    plan_small = strategy.plan_for(small, 64)
    plan_big = strategy.plan_for(big, 64)
    assert plan_small is not plan_big
    assert strategy.plan_for(small, 64) is plan_small and strategy.plan is plan_small
    assert [r.batch_share for r in plan_small.replicas] == [32, 16, 16]
    assert strategy.num_replicas_in_sync == 3
    data = strategy.explain(format="json")
    json.dumps(data)
    assert data["chosen"] == "proportional"
    # Planned, not compiled in the scope: a what-if plan its fit does not run (explain()
    # looked as if it applied to the fit, which ran plain Keras).
    assert data["unattached_model"] == "small"
    assert ("note: model 'small' was planned with plan_for but not compiled inside this "
            "strategy's scope, so its fit runs plain Keras") in strategy.explain()
    # A model far smaller than the learned estimator's training models: the simulator,
    # scaled by the estimator's calibration, scores it (and says so).
    assert data["predicted"]["source"].startswith("simulator x ")
    assert data["predicted"]["source"].endswith("predicted")
    assert {"data_parallel_even", "proportional"} <= {c["name"] for c in data["candidates"]}
    text = strategy.explain()
    assert "predicted step time" in text
    assert "the learned estimator did not score it: " in text  # and says why
    png = strategy.plot(tmp_path / "timeline.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    trace = json.loads(strategy.export_trace(tmp_path / "trace.json").read_text())
    assert any(e["ph"] == "X" for e in trace["traceEvents"])
    # The timeline is the simulator's; the trace also names the step explain() shows.
    other = trace["otherData"]
    assert other["step_time_s"] != plan_small.prediction.step_time_s
    assert other["plan_predicted_step_time_s"] == plan_small.prediction.step_time_s
    assert other["plan_prediction_source"] == data["predicted"]["source"]


def test_plot_titles_the_plan_with_the_name_explain_gives_it(tmp_path):
    """A candidate built by another planner (`data_parallel_even_ps`, whose planner is
    `data_parallel_even`) chosen by auto: the chart's title named the planner, a
    different row of explain()'s candidates table."""
    from autodist_keras.graph.model_graph import ModelGraph
    from autodist_keras.strategies import selection

    cluster = Cluster.cpu_testbed()
    model = zoo.mlp(input_dim=8, hidden=(16,), name="small")
    _, candidates = selection.choose_plan(ModelGraph.from_keras(model), cluster, 48,
                                          cache_dir=tmp_path, estimator="simulator")
    ps = next(c for c in candidates if c.name == "data_parallel_even_ps")
    assert ps.plan.provenance.planner == "data_parallel_even"
    # As auto records the candidate it chose.
    ps.plan.provenance.options = dict(ps.plan.provenance.options or {},
                                      auto_chosen="data_parallel_even_ps")
    strategy = AutoStrategy(cluster=cluster, plan=ps.plan)
    strategy.plan_for(model, 48)
    assert strategy.explain(format="json")["chosen"] == "data_parallel_even_ps"
    svg = open(strategy.plot(str(tmp_path / "timeline.svg"))).read()
    # (matplotlib writes each text as a comment beside its glyphs)
    assert "<!-- data_parallel_even_ps plan" in svg
    assert "<!-- data_parallel_even plan" not in svg


def test_fixed_plan_from_file(tmp_path):
    strategy = AutoStrategy("data_parallel", cluster=Cluster.cpu_testbed())
    model = zoo.mlp(input_dim=8, hidden=(16,), name="fixed")
    path = tmp_path / "plan.json"
    strategy.plan_for(model, 48).to_json(path)
    again = AutoStrategy(cluster=Cluster.cpu_testbed(), plan=str(path))
    assert again.plan_for(model, 48).to_dict() == strategy.plan.to_dict()
    other = zoo.mlp(input_dim=8, hidden=(20,), name="other")
    with pytest.raises(Exception, match="unknown layer|unknown variable"):
        AutoStrategy(cluster=Cluster.cpu_testbed(), plan=str(path)).plan_for(other, 48)


def test_scope_restores_compile():
    original = keras.Model.compile
    strategy = AutoStrategy("single_device", cluster=Cluster.cpu_testbed())
    with strategy.scope():
        assert keras.Model.compile is not original
    assert keras.Model.compile is original


def test_a_model_built_in_scope_and_compiled_after_it_attaches_to_that_strategy():
    """As with tf.distribute: the strategy a model was built in is the one its
    later `compile` attaches it to, unless another strategy's scope is open."""
    import numpy as np

    class OwnCompile(keras.Model):
        def compile(self, **kwargs):
            self.compiled_by_user = True
            return super().compile(**kwargs)

    original_new = vars(keras.Model)["__new__"]
    first = AutoStrategy("single_device", cluster=Cluster.cpu_testbed())
    second = AutoStrategy("single_device", cluster=Cluster.cpu_testbed())
    with first.scope():
        later = zoo.mlp(input_dim=8, hidden=(16,), num_classes=3, name="later")
        elsewhere = zoo.mlp(input_dim=8, hidden=(16,), num_classes=3, name="elsewhere")
        inputs = keras.Input((8,))
        custom = OwnCompile(inputs, keras.layers.Dense(3)(inputs))
    assert vars(keras.Model)["__new__"] is original_new
    outside = zoo.mlp(input_dim=8, hidden=(16,), num_classes=3, name="outside")

    later.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    custom.compile(optimizer="sgd", loss="mse")
    with second.scope():
        elsewhere.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    outside.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    assert first._models == [later, custom] and custom.compiled_by_user
    assert second._models == [elsewhere]
    assert "compile" not in vars(outside)

    x = np.random.default_rng(0).normal(size=(32, 8)).astype("float32")
    y = np.arange(32) % 3
    later.fit(x, y, batch_size=8, verbose=0)
    assert first.plan is not None and first.measured["steps"] >= 1


def test_load_model_inside_scope_compiles_and_attaches(tmp_path):
    """A saved, compiled model loaded in scope() comes back compiled and attached."""
    import numpy as np

    keras.utils.set_random_seed(0)
    model = zoo.mlp(input_dim=8, hidden=(16,), num_classes=3, name="saved")
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    x = np.random.default_rng(0).normal(size=(48, 8)).astype("float32")
    y = np.arange(48) % 3
    model.fit(x, y, batch_size=16, verbose=0)
    path = tmp_path / "saved.keras"
    model.save(path)

    strategy = AutoStrategy("single_device", cluster=Cluster.cpu_testbed())
    with strategy.scope():
        loaded = keras.models.load_model(path)
    assert loaded.compiled and loaded in strategy._models
    assert int(loaded.optimizer.iterations) == 3  # the optimizer's state came back
    history = loaded.fit(x, y, batch_size=16, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    assert strategy.plan is not None


def test_plan_file_serves_a_sequential_loaded_with_load_model(tmp_path):
    """A Sequential loaded with `load_model` builds its layers outside its own name
    scope (`sequential/dense/kernel` there is `dense/kernel` here): a plan file made
    for the model built in code serves the loaded one, and the other way round."""

    def build():
        return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                 keras.layers.Dense(3)])

    cluster = Cluster.cpu_testbed()
    built = build()
    built.compile(optimizer="sgd", loss="mse")
    built.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    built_paths = {v.path for v in built.trainable_variables}
    loaded_paths = {v.path for v in loaded.trainable_variables}
    assert not built_paths & loaded_paths  # Keras names them differently
    for source, target in ((built, loaded), (loaded, built)):
        plan = AutoStrategy("proportional", cluster=cluster).plan_for(source, 48)
        path = tmp_path / "plan.json"
        plan.to_json(path)
        again = AutoStrategy(cluster=cluster, plan=str(path)).plan_for(target, 48)
        assert set(again.sync) == {v.path for v in target.trainable_variables}
        assert [r.batch_share for g in again.groups for r in g.replicas] == \
            [r.batch_share for g in plan.groups for r in g.replicas]


def test_every_candidate_stays_on_the_devices_given():
    cluster = Cluster.cpu_testbed()
    allowed = ["node0/cpu1", "node0/cpu2"]
    model = zoo.mlp(input_dim=8, hidden=(16,), name="subset")
    strategy = AutoStrategy("auto", cluster=cluster, devices=allowed, estimator="simulator")
    plan = strategy.plan_for(model, 48)
    assert set(plan.devices) <= set(allowed)
    for candidate in strategy.candidates:
        if candidate.plan is not None:
            assert set(candidate.plan.devices) <= set(allowed), candidate.name
    single = AutoStrategy("single_device", cluster=cluster, devices=["node0/cpu2"])
    assert single.plan_for(model, 48).devices == ["node0/cpu2"]


def test_explain_says_why_candidates_were_left_out():
    # cpu0, the fastest device, has 1 MB of memory: the single-device plan cannot fit there.
    cluster = Cluster.cpu_testbed([{"cores": [0], "threads": 1, "memory_gb": 0.001},
                                   {"cores": [1], "threads": 1}])
    strategy = AutoStrategy("auto", cluster=cluster, estimator="simulator")
    model = zoo.mlp(input_dim=512, hidden=(1024,), name="too_big_for_cpu0")
    strategy.plan_for(model, 64)
    data = strategy.explain(format="json")
    single = next(c for c in data["candidates"] if c["name"] == "single_device")
    assert single["feasible"] is False and single["reason"]
    text = strategy.explain()
    assert "Candidates left out, and why:" in text
    assert f"single_device: {single['reason']}" in text
    # Even data parallelism puts a replica on cpu0 too: no speedup over a plan that cannot run.
    even = next(c for c in data["candidates"] if c["name"] == "data_parallel_even")
    assert even["feasible"] is False and data["speedup_vs_even_predicted"] is None
    assert "no speedup over data_parallel_even is given: it does not fit in memory (predicted)" in text


def test_planning_for_a_gpu_cluster_that_is_not_here():
    """plan_for, explain and the timeline for a catalog cluster on this CPU-only machine."""
    import keras as k

    if k.backend.backend() == "torch":
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count() >= 4:
            pytest.skip("this machine has the cluster's GPUs")
    strategy = AutoStrategy("auto", cluster="2xV100,2xT4")
    model = zoo.mlp(input_dim=64, hidden=(128,), name="what_if")
    plan = strategy.plan_for(model, 256)
    assert any("not on this machine" in note for note in plan.notes)
    text = strategy.explain()
    assert "predicted step time" in text
    # Outside the learned estimator's domain: the reason (a long list of device kinds)
    # is given once, in the line saying which scorer ran.
    why = strategy.explain(format="json")["why"]
    assert any(line.startswith("scored by the simulator (") for line in why), why
    assert text.count("these devices are of kinds not in its training measurements") == 1, text


def test_plan_for_plans_again_for_another_batch_size_and_checks_it():
    strategy = AutoStrategy("proportional", cluster=Cluster.cpu_testbed())
    model = zoo.mlp(input_dim=8, hidden=(16,), name="what_if")
    assert strategy.plan_for(model, 48).global_batch_size == 48
    assert strategy.plan_for(model, 96).global_batch_size == 96
    assert strategy.explain(format="json")["global_batch_size"] == 96
    for bad in (0, -3, 2.5, "64", True, None):
        with pytest.raises(StrategyError, match="batch_size must be a positive integer"):
            strategy.plan_for(model, bad)
    # A fixed plan is the plan, whatever the batch (its shares are scaled to each batch).
    fixed = AutoStrategy(cluster=Cluster.cpu_testbed(), plan=strategy.plan)
    assert fixed.plan_for(model, 24).global_batch_size == 96


def test_plot_and_trace_before_any_plan_say_so(tmp_path):
    strategy = AutoStrategy("proportional", cluster=Cluster.cpu_testbed())
    for call in (strategy.plot, strategy.export_trace):
        with pytest.raises(StrategyError, match="No plan yet"):
            call(str(tmp_path / "out"))
    assert list(tmp_path.iterdir()) == []


def test_explain_describes_the_model_fitted_last():
    """Two models under one strategy: explain() shows the plan and the measured
    step of the model that was fitted last, never one's plan beside the other's step."""
    import numpy as np

    strategy = AutoStrategy("single_device", cluster=Cluster.cpu_testbed())
    with strategy.scope():
        first = zoo.mlp(input_dim=8, hidden=(16,), num_classes=3, name="first")
        first.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        second = zoo.mlp(input_dim=8, hidden=(24,), num_classes=3, name="second")
        second.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    x = np.random.default_rng(0).normal(size=(72, 8)).astype("float32")
    y = np.arange(72) % 3
    first.fit(x, y, batch_size=9, verbose=0)
    second.fit(x, y, batch_size=6, verbose=0)
    first.fit(x, y, batch_size=9, verbose=0)
    assert strategy.plan.global_batch_size == 9
    assert strategy.plan.provenance.graph_fingerprint == strategy._plans[id(first)][2].provenance.graph_fingerprint
    assert strategy.measured["steps"] >= 1
    second.fit(x[:12], y[:12], batch_size=6, verbose=0)  # 2 steps: too few to measure
    assert strategy.plan.global_batch_size == 6 and strategy.measured == {}


def test_a_strategy_reused_across_trials_does_not_keep_their_models_alive():
    """A hyper-parameter search reuses one strategy; each trial's model must be
    freed once the user drops it (the strategy held every model it compiled)."""
    import gc
    import weakref

    import numpy as np

    strategy = AutoStrategy("single_device", cluster=Cluster.cpu_testbed())
    x = np.random.default_rng(0).normal(size=(36, 8)).astype("float32")
    y = np.arange(36) % 3
    refs = []
    for trial in range(3):
        with strategy.scope():
            model = zoo.mlp(input_dim=8, hidden=(16 + trial,), num_classes=3, name=f"t{trial}")
            model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=6, verbose=0)
        refs.append(weakref.ref(model))
        assert model in strategy._models
        del model
        gc.collect()
    # The adapter may keep the last fit's run (PyTorch: for `last_run`); no earlier one.
    assert [r() is None for r in refs[:-1]] == [True, True]
    assert len(strategy._models) <= 1


def test_a_model_compiled_again_in_another_scope_is_timed_for_that_strategy():
    """Moving a model to another strategy by compiling it in its scope: the
    new strategy records the measured step time, and the old one keeps its
    own (the timer stayed with the first strategy, or was lost on PyTorch)."""
    import numpy as np

    first = AutoStrategy("single_device", cluster=Cluster.cpu_testbed())
    second = AutoStrategy("single_device", cluster=Cluster.cpu_testbed())
    x = np.random.default_rng(0).normal(size=(72, 8)).astype("float32")
    y = np.arange(72) % 3
    with first.scope():
        model = zoo.mlp(input_dim=8, hidden=(16,), num_classes=3, name="moved")
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=9, verbose=0)
    assert first.measured["steps"] >= 1 and first.measured["batch_size"] == 9
    measured_before = dict(first.measured)
    with second.scope():
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=6, verbose=0)
    assert second.measured["steps"] >= 1 and second.plan.global_batch_size == 6
    assert first.measured == measured_before
    # A later fit at another batch size is measured as such, and not compared.
    model.fit(x, y, batch_size=12, verbose=0)
    assert second.measured["batch_size"] == 12
    data = second.explain(format="json")
    assert data["measured"]["batch_size"] == 12 and data["measured_vs_predicted"] is None
    assert data["unattached_model"] is None and "note: model" not in second.explain()
    # Fitted inside the first strategy's scope, it still trains under the second (the
    # scope decides where models are compiled): said, not silently ignored.
    with pytest.warns(UserWarning, match=(
            r"Model 'moved' is fitted inside the scope of another AutoStrategy than the one "
            r"it was compiled in; it trains under the strategy it was compiled in.*call "
            r"model.compile\(...\) inside it first")):
        with first.scope():
            model.fit(x, y, batch_size=12, verbose=0)
    assert first.measured == measured_before
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        with second.scope():  # its own strategy's scope: nothing to say
            model.fit(x, y, batch_size=12, verbose=0)


def test_explain_shows_a_measured_step_only_beside_the_plan_it_was_measured_with():
    """After fit(A), plan_for(B) made explain() describe B's plan next to A's
    measured step ("the prediction was 663% high"); and plan_for(A) at another
    batch size, A's new plan next to the old plan's step."""
    import numpy as np

    strategy = AutoStrategy("single_device", cluster=Cluster.cpu_testbed())
    with strategy.scope():
        first = zoo.mlp(input_dim=8, hidden=(16,), num_classes=3, name="measured_model")
        first.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        second = zoo.mlp(input_dim=8, hidden=(64, 64), num_classes=3, name="planned_model")
        second.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    x = np.random.default_rng(0).normal(size=(72, 8)).astype("float32")
    first.fit(x, np.arange(72) % 3, batch_size=9, verbose=0)
    assert strategy.explain(format="json")["measured"]["batch_size"] == 9
    assert "measured step time" in strategy.explain()
    strategy.plan_for(second, 9)
    data = strategy.explain(format="json")
    assert data["measured"] == {} and data["measured_vs_predicted"] is None
    assert "measured step time" not in strategy.explain()
    strategy.plan_for(first, 9)  # the plan it was measured with, again
    assert strategy.explain(format="json")["measured"]["batch_size"] == 9
    strategy.plan_for(first, 18)  # a new plan for another batch size
    assert strategy.explain(format="json")["measured"] == {}


def test_nested_scopes_of_two_strategies_are_refused():
    first = AutoStrategy("single_device", cluster=Cluster.cpu_testbed())
    second = AutoStrategy("data_parallel", cluster=Cluster.cpu_testbed())
    with first.scope():
        with first.scope():  # the same strategy again is fine
            pass
        with pytest.raises(StrategyError, match="cannot be nested.*Received: scope of "
                                                "'data_parallel' inside the scope of "
                                                "'single_device'"):
            with second.scope():
                pass
        model = zoo.mlp(input_dim=8, hidden=(16,), num_classes=3, name="in_first")
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    assert first._models == [model] and second._models == []


def test_data_parallel_on_one_device_says_why_and_what_to_use():
    strategy = AutoStrategy("data_parallel", cluster=Cluster.cpu_testbed(
        [{"cores": [0], "threads": 1}]))
    with pytest.raises(StrategyError, match="the cluster has one device .*needs two or more.*"
                                            "Cluster.cpu_testbed"):
        strategy.plan_for(zoo.mlp(input_dim=8, hidden=(16,), name="lonely"), 32)


def test_a_fixed_plan_must_suit_the_cluster_devices_and_model(tmp_path):
    from autodist_keras.errors import PlanError

    testbed = Cluster.cpu_testbed()
    model = zoo.mlp(input_dim=8, hidden=(16,), name="made_for")
    plan = AutoStrategy("proportional", cluster=testbed).plan_for(model, 48)
    with pytest.raises(StrategyError, match=r"runs on devices \[.*\] that this cluster lacks "
                                            r"\(it was made for cluster .*Pass the cluster"):
        AutoStrategy(cluster="2xV100", plan=plan)
    with pytest.raises(StrategyError, match=r"outside devices=\['node0/cpu0'\]"):
        AutoStrategy(cluster=testbed, plan=plan, devices=["node0/cpu0"])
    with pytest.warns(UserWarning, match="strategy='fastt' is not used: .*proportional plan"):
        labelled = AutoStrategy("fastt", cluster=testbed, plan=plan)
    assert labelled.plan_for(model, 48) is plan
    text = labelled.explain()
    assert "runs as it is; no planning ran and strategy='fastt' was not used" in text
    assert text.startswith("AutoStrategy(plan=...): runs the given proportional plan")
    assert "chose" not in text.splitlines()[0]
    # Another model: layer names that do not match say why and what to do.
    other = zoo.mlp(input_dim=8, hidden=(16, 16), name="another")
    with pytest.raises(PlanError, match="made for another model .*name the layers"):
        AutoStrategy(cluster=testbed, plan=plan).plan_for(other, 48)
    # Same layer names, other sizes: it runs, with a warning that its predictions are stale.
    wider = zoo.mlp(input_dim=8, hidden=(32,), name="made_for")
    with pytest.warns(UserWarning, match="different model graph"):
        AutoStrategy(cluster=testbed, plan=plan).plan_for(wider, 48)


def test_a_plan_file_of_another_sequential_with_named_layers_runs(tmp_path):
    """README: naming the layers is safer; a plan made for another model still runs,
    with a warning. A Sequential's own name is in its variable paths
    (`sequential/hidden/kernel`) and Keras numbers it per process, so a plan file of
    a Sequential with named layers, taken by a wider one built after another model,
    failed with "unknown variable 'sequential/hidden/kernel'" and advised naming the
    layers, which were named (session 31)."""
    from autodist_keras.errors import PlanError

    testbed = Cluster.cpu_testbed()

    def sequential(width, hidden="hidden"):
        return keras.Sequential([keras.Input((8,), name="features"),
                                 keras.layers.Dense(width, activation="relu", name=hidden),
                                 keras.layers.Dense(3, name="head")])

    first = sequential(16)
    path = tmp_path / "plan.json"
    AutoStrategy("proportional", cluster=testbed).plan_for(first, 48).to_json(str(path))
    sequential(16)  # another model first: the next Sequential's name is numbered further
    wider = sequential(32)
    assert wider.name != first.name
    with pytest.warns(UserWarning, match="different model graph"):
        given = AutoStrategy(cluster=testbed, plan=str(path)).plan_for(wider, 48)
    assert sorted(given.sync) == sorted(v.path for v in wider.trainable_weights)
    assert sorted(given.groups[0].layers) == ["features", "head", "hidden"]
    assert any("per-process numbering" in n for n in given.notes)
    # A layer named otherwise is still refused, with the reason.
    with pytest.raises(PlanError, match="made for another model .*unknown layer 'hidden'"):
        AutoStrategy(cluster=testbed, plan=str(path)).plan_for(sequential(32, "inner"), 48)


def test_a_forced_plan_predicted_not_to_fit_in_memory_is_refused():
    tiny = Cluster.from_dict({"nodes": [{"name": "node0", "cpus": [
        {"cores": [0], "threads": 1, "memory_gb": 0.001, "count": 2}]}]})
    model = zoo.mlp(input_dim=64, hidden=(512, 512), name="too_big")
    for name in ("data_parallel", "heterog"):
        with pytest.raises(StrategyError, match=f"The '{name}' plan (is predicted not to fit in "
                                                "memory|could not be made)"):
            AutoStrategy(name, cluster=tiny).plan_for(model, 16)


def test_plot_and_trace_refuse_paths_they_cannot_write_and_leave_nothing(tmp_path):
    from autodist_keras.errors import OutputError

    strategy = AutoStrategy("proportional", cluster=Cluster.cpu_testbed())
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    model.compile(optimizer="sgd", loss="mse")
    strategy.plan_for(model, 24)
    folder = tmp_path / "charts"
    folder.mkdir()
    for call in (strategy.plot, strategy.export_trace):
        with pytest.raises(OutputError, match="it is a directory"):
            call(folder)
    with pytest.raises(OutputError, match="'json' is not a format matplotlib writes"):
        strategy.plot(tmp_path / "timeline.json")
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for call in (strategy.plot, strategy.export_trace):
        with pytest.raises(OutputError, match="Cannot write"):
            call(blocker / "inside" / "out.png")  # its directory cannot be made
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "charts"]
    assert list(folder.iterdir()) == []
    # Missing directories are made; without an extension the chart is a PNG.
    png = strategy.plot(tmp_path / "new" / "timeline")
    assert png == tmp_path / "new" / "timeline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = strategy.plot(str(tmp_path / "timeline.svg"))
    assert isinstance(svg, str) and open(svg).read().lstrip().startswith("<?xml")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "charts", "new",
                                                          "timeline.svg"]


def test_a_model_built_in_the_scope_of_a_cluster_that_is_not_here_plans_and_fit_says_why():
    """Planning for GPUs this machine lacks works inside scope() (it raised at compile, naming
    a replica before any plan existed); fit then says it cannot run the plan here."""
    import numpy as np

    from autodist_keras.errors import BackendError

    strategy = AutoStrategy("data_parallel", cluster="2xV100")
    with strategy.scope():
        model = zoo.mlp(input_dim=8, hidden=(16,), num_classes=3, name="elsewhere")
        model.compile(optimizer="sgd",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    plan = strategy.plan_for(model, 64)
    assert sorted(plan.devices) == ["node0/gpu0", "node0/gpu1"]
    x = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
    with pytest.raises(BackendError, match="GPU"):
        model.fit(x, np.arange(64) % 3, batch_size=64, verbose=0)


def test_a_plan_file_edited_after_its_prediction_is_simulated_again(tmp_path):
    """The recorded prediction describes the plan as it was written; an edited file
    (shares moved by hand) gets the simulator's figures for the plan as given."""
    testbed = Cluster.cpu_testbed()
    model = zoo.mlp(input_dim=8, hidden=(16,), name="edited")
    plan = AutoStrategy("data_parallel", cluster=testbed).plan_for(model, 48)
    path = tmp_path / "plan.json"
    plan.to_json(str(path))
    untouched = AutoStrategy(cluster=testbed, plan=str(path)).plan_for(model, 48)
    assert untouched.prediction_matches()
    assert untouched.prediction.step_time_s == plan.prediction.step_time_s

    data = json.loads(path.read_text())
    data["groups"][0]["replicas"][0]["batch_share"] = 46
    for replica in data["groups"][0]["replicas"][1:]:
        replica["batch_share"] = 1
    path.write_text(json.dumps(data))
    edited = AutoStrategy(cluster=testbed, plan=str(path))
    given = edited.plan_for(model, 48)
    assert given.prediction.plan_digest is None  # simulated here, for this plan
    assert given.prediction.source.startswith("simulator")
    assert given.prediction.step_time_s != plan.prediction.step_time_s
    assert any("changed after its prediction was written" in n for n in given.notes)
    assert "changed after its prediction was written" in edited.explain()

    # The same edit made through the Python API on a loaded plan, then saved.
    from autodist_keras.strategies.plan import Plan

    plan.to_json(str(path))
    loaded = Plan.from_json(str(path))
    for replica, share in zip(loaded.groups[0].replicas, (46, 1, 1)):
        replica.batch_share = share
    assert not loaded.prediction_matches()
    loaded.to_json(str(path))
    assert not Plan.from_json(str(path)).prediction_matches()
    given = AutoStrategy(cluster=testbed, plan=loaded).plan_for(model, 48)
    assert any("changed after its prediction was written" in n for n in given.notes)
    assert loaded.prediction.step_time_s == plan.prediction.step_time_s  # caller's untouched


def test_scopes_are_per_thread():
    """A scope applied to the whole process: a model compiled in another thread,
    outside every scope, was attached to the strategy (and trained distributed), and
    two threads entering their own strategies' scopes got 'cannot be nested'."""
    import threading

    owner = next(c for c in keras.Model.__mro__ if "compile" in vars(c))
    keras_compile, keras_new = vars(owner)["compile"], vars(keras.Model)["__new__"]
    inside, done = threading.Event(), threading.Event()
    first = AutoStrategy("single_device", cluster=Cluster.cpu_testbed())
    second = AutoStrategy("data_parallel", cluster=Cluster.cpu_testbed())
    results, errors = {}, []

    def in_scope(strategy, key):
        try:
            with strategy.scope():
                inside.set()
                model = zoo.mlp(input_dim=8, hidden=(16,), num_classes=3, name=f"thread_{key}")
                model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
                results[key] = model
                done.wait(30)
        except Exception as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    thread = threading.Thread(target=in_scope, args=(first, "first"))
    thread.start()
    assert inside.wait(30)
    plain = zoo.mlp(input_dim=8, hidden=(16,), num_classes=3, name="plain_here")
    plain.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    with second.scope():  # not nested: the other scope is another thread's
        mine = zoo.mlp(input_dim=8, hidden=(16,), num_classes=3, name="second_here")
        mine.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    done.set()
    thread.join(30)
    assert not errors, errors
    assert plain not in first._models and plain not in second._models
    assert first._models == [results["first"]] and second._models == [mine]
    # Keras's own functions are back once the last scope ended.
    assert vars(owner)["compile"] is keras_compile
    assert vars(keras.Model)["__new__"] is keras_new


def _unnamed_mlp(names=None):
    """Hidden (16), then the output layer (3) made before the middle one (8), so Keras's
    numbering differs from the graph's order; `names` (hidden, output, middle) names them."""
    names = names or (None, None, None)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu", name=names[0])(inputs)
    output = keras.layers.Dense(3, name=names[1])
    return keras.Model(inputs, output(keras.layers.Dense(8, name=names[2])(hidden)))


def test_a_plan_file_matches_keras_per_process_layer_numbering(tmp_path):
    """The same model built in another process gets other layer numbers (a fresh
    process has dense, dense_1, ...; one that built a layer first has dense_1,
    dense_2, ...): a plan file of it failed with 'unknown layer'. Layers are matched by
    their index in the graph when the structure is the same, also where a name exists
    in both but belongs to another layer."""
    import numpy as np

    from autodist_keras.errors import PlanError

    testbed = Cluster.cpu_testbed()
    keras.layers.Dense(1), keras.layers.Dense(1)  # (so that n >= 2 below)
    again = _unnamed_mlp()  # this process's numbering: dense_n, dense_n+1, dense_n+2
    n = int(again.layers[1].name.rsplit("_", 1)[1])
    # As another process would have numbered it: one lower, names overlapping.
    first = _unnamed_mlp((f"dense_{n - 1}", f"dense_{n}", f"dense_{n + 1}"))
    plan = AutoStrategy("proportional", cluster=testbed).plan_for(first, 48)
    path = tmp_path / "plan.json"
    plan.to_json(str(path))
    strategy = AutoStrategy(cluster=testbed, plan=str(path))
    with strategy.scope():
        again.compile(optimizer="sgd",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    old_names = [layer.name for layer in first.layers]
    new_names = [layer.name for layer in again.layers]
    assert set(new_names) & set(old_names) - {again.layers[0].name}  # overlap
    given = strategy.plan_for(again, 48)
    assert set(given.groups[0].layers) == set(new_names)
    # Each variable keeps its layer: the shapes under the new names are the old ones.
    renames = dict(zip(old_names, new_names))
    new_shapes = {v.path: tuple(v.shape) for v in again.weights}
    for v in first.weights:
        layer, _, rest = v.path.partition("/")
        assert new_shapes[f"{renames[layer]}/{rest}"] == tuple(v.shape)
    assert sorted(given.sync) == sorted(new_shapes)
    assert any("matched by Keras's per-process numbering" in n for n in given.notes)
    assert given.prediction.step_time_s == plan.prediction.step_time_s  # still its own
    assert given.prediction_matches()
    x = np.random.default_rng(0).normal(size=(48, 8)).astype("float32")
    again.fit(x, np.arange(48) % 3, batch_size=48, epochs=1, verbose=0)
    # Another structure is still refused, with the reason.
    wider = keras.Model(*(lambda i: (i, keras.layers.Dense(3)(keras.layers.Dense(32)(i))))(
        keras.Input((8,))))
    with pytest.raises(PlanError, match="made for another model"):
        AutoStrategy(cluster=testbed, plan=str(path)).plan_for(wider, 48)


def _masked_embedding_model():
    inputs = keras.Input((5,), dtype="int32", name="me_in")
    x = keras.layers.Embedding(10, 4, mask_zero=True, name="me_emb")(inputs)
    x = keras.layers.GRU(4, name="me_gru")(x)  # reads the mask: a not_equal_N op node
    return keras.Model(inputs, keras.layers.Dense(3, name="me_out")(x))


def test_a_plan_written_in_code_for_another_build_says_how_to_match_its_names():
    """Every layer named, yet a plan written in code from one build of a masked model
    did not fit the next: Embedding(mask_zero=True) adds a keras.ops node Keras numbers
    per build ('not_equal_5', then 'not_equal_6'), which cannot be named. The refusal said
    only 'unknown layer'; it now says how to match the names, and doing so runs."""
    from autodist_keras.errors import PlanError
    from autodist_keras.graph import ModelGraph
    from autodist_keras.strategies import baselines
    from autodist_keras.strategies.plan import LayerGroup
    from autodist_keras.strategies.plan import Plan
    from autodist_keras.strategies.plan import Replica
    from autodist_keras.strategies.plan import SyncSpec

    testbed = Cluster.cpu_testbed()
    graph = ModelGraph.from_keras(_masked_embedding_model())
    names = list(graph.nodes)
    assert any(n.startswith("not_equal") for n in names), names
    plan = Plan(global_batch_size=24,
                groups=[LayerGroup("a", names[:3], [Replica("node0/cpu0", 24)]),
                        LayerGroup("b", names[3:], [Replica("node0/cpu1", 24)])],
                sync={v.name: SyncSpec("allreduce", "ring") for v in graph.variables},
                buckets=baselines.gradient_buckets(graph, 1 << 30))
    model = _masked_embedding_model()
    with pytest.raises(PlanError, match=r"unknown layer 'not_equal.*layer_order = list"):
        AutoStrategy(cluster=testbed, plan=plan).plan_for(model, 24)
    plan.provenance.graph_fingerprint = graph.fingerprint()
    plan.provenance.layer_order = names
    given = AutoStrategy(cluster=testbed, plan=plan).plan_for(model, 24)
    assert [g.layers for g in given.groups] == [list(ModelGraph.from_keras(model).nodes)[:3],
                                                list(ModelGraph.from_keras(model).nodes)[3:]]


def test_a_plan_file_of_a_sequential_or_nested_model_matches_its_numbering(tmp_path):
    """Variable paths start with the names of the models they sit in, which Keras
    numbers too (`sequential/dense/kernel`, then `sequential_1/dense_2/kernel`): plan
    files of a Sequential model, or of a model with a nested one, failed with
    "unknown variable" once another model was built first, named layers or not."""
    import numpy as np

    testbed = Cluster.cpu_testbed()

    def sequential(names=(None, None)):
        return keras.Sequential([keras.Input((8,)),
                                 keras.layers.Dense(16, activation="relu", name=names[0]),
                                 keras.layers.Dense(3, name=names[1])])

    def nested(names=(None, None)):
        inputs = keras.Input((8,))
        body = keras.Sequential([keras.layers.Dense(16, activation="relu", name=names[0]),
                                 keras.layers.Dense(16)])
        return keras.Model(inputs, keras.layers.Dense(3, name=names[1])(body(inputs)))

    for build, names in ((sequential, (None, None)), (sequential, ("hidden", "head")),
                         (nested, (None, None))):
        first = build(names)
        plan = AutoStrategy("proportional", cluster=testbed).plan_for(first, 48)
        path = tmp_path / f"plan_{build.__name__}_{names[0]}.json"
        plan.to_json(str(path))
        build(names)  # another model first: this process numbers the next one further
        again = build(names)
        old_roots = {v.path.split("/")[0] for v in first.trainable_weights}
        new_roots = {v.path.split("/")[0] for v in again.trainable_weights}
        assert old_roots != new_roots  # the model names in the paths moved
        strategy = AutoStrategy(cluster=testbed, plan=str(path))
        with strategy.scope():
            again.compile(optimizer="sgd",
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        given = strategy.plan_for(again, 48)
        assert sorted(given.sync) == sorted(v.path for v in again.trainable_weights)
        # each variable keeps its shape under its new path
        shapes = {v.path: tuple(v.shape) for v in again.trainable_weights}
        old_shapes = sorted(tuple(v.shape) for v in first.trainable_weights)
        assert sorted(shapes[v] for v in given.sync) == old_shapes
        assert any("per-process numbering" in n for n in given.notes)
        x = np.random.default_rng(0).normal(size=(48, 8)).astype("float32")
        again.fit(x, np.arange(48) % 3, batch_size=48, epochs=1, verbose=0)


def test_the_scope_object_can_be_entered_again():
    """`sc = strategy.scope()` entered twice (to compile again for fine-tuning) raised
    contextlib's AttributeError: the generator behind it was single-use."""
    strategy = AutoStrategy("single_device", cluster=Cluster.cpu_testbed())
    scope = strategy.scope()
    with scope as entered:
        assert entered is strategy
        model = zoo.mlp(input_dim=8, hidden=(16,), num_classes=3, name="scope_twice")
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    with scope:
        with scope:  # nested re-entry of the same strategy is fine too
            model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    assert strategy._models == [model]
    from autodist_keras.strategies import auto

    assert auto._hooks["count"] == 0  # every entry was left


def test_a_baseline_shaped_by_options_that_cannot_be_made_is_a_strategy_error():
    """sync="ps" builds the baseline directly: its PlanError reached the user bare, where
    the other strategies say the plan could not be made and name auto."""
    strategy = AutoStrategy("data_parallel", cluster=Cluster.cpu_testbed(), sync="ps")
    with pytest.raises(StrategyError, match="'data_parallel' plan could not be made.*smaller "
                                            "than the number of devices.*Received: "
                                            "batch_size=1.*Try strategy='auto'"):
        strategy.plan_for(zoo.mlp(input_dim=8, hidden=(16,), name="one_row"), 1)


def _sequence_model(length):
    keras.utils.set_random_seed(0)
    tokens = keras.Input((length,), dtype="int32")
    h = keras.layers.LSTM(16)(keras.layers.Embedding(100, 8)(tokens))
    model = keras.Model(tokens, keras.layers.Dense(3)(h))
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    return model


def test_a_model_with_an_unknown_sequence_length_is_planned_for_the_first_batch(recwarn):
    """keras.Input((None,)) left the sequence length unknown, counted as 1: a 200-token
    LSTM model was predicted 53x too fast, and auto chose another family on those
    figures. fit plans it for its first batch's shapes (the plan says so); plan_for
    without shapes warns, and takes them."""
    import warnings

    import numpy as np

    cluster = Cluster.cpu_testbed()
    strategy = AutoStrategy("proportional", cluster=cluster)
    with strategy.scope():
        model = _sequence_model(None)
    x = np.random.default_rng(0).integers(1, 100, size=(48, 30))
    model.fit(x, np.arange(48) % 3, batch_size=24, verbose=0)
    assert not [w for w in recwarn if "leaves some shapes unknown" in str(w.message)]
    fixed = AutoStrategy("proportional", cluster=cluster)
    fixed.plan_for(_sequence_model(30), 24)
    assert strategy.graph.unknown_dims == []
    assert strategy.graph.fingerprint() == fixed.graph.fingerprint()
    # The simulator's figures (the learned estimator's scale with this machine's
    # current speed, probed for each plan: they differ under load).
    ours, theirs = strategy.plan.prediction, fixed.plan.prediction
    assert (ours.simulated_step_time_s or ours.step_time_s) == pytest.approx(
        theirs.simulated_step_time_s or theirs.step_time_s, rel=1e-9)
    assert "Planned for per-sample input shapes [(30,)] (the first batch's)" in " ".join(
        strategy.plan.notes)

    with pytest.warns(UserWarning, match=(
            r"leaves some shapes unknown \(None: a sequence length\?\) in 3 layer\(s\).*far "
            r"too low.*input_shapes=\[\.\.\.\].*Received: input_shapes=None")):
        AutoStrategy("proportional", cluster=cluster).plan_for(_sequence_model(None), 24)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        given = AutoStrategy("proportional", cluster=cluster)
        given.plan_for(_sequence_model(None), 24, input_shapes=[(30,)])
    assert given.graph.fingerprint() == fixed.graph.fingerprint()
    # The note names where the shapes came from (it said "the first batch's").
    assert "Planned for per-sample input shapes [(30,)] (given with input_shapes=)" in " ".join(
        given.plan.notes)


def test_explain_compares_a_measured_step_only_with_inputs_of_the_planned_shapes():
    """A model with an unknown sequence length is planned for the first batch's length;
    a later fit at another length measured a step of other work, which explain() set
    against the old prediction ("the prediction was 99% low")."""
    import numpy as np

    strategy = AutoStrategy("data_parallel", cluster=Cluster.cpu_testbed())
    with strategy.scope():
        inputs = keras.Input((None,), dtype="int32")
        hidden = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(50, 4)(inputs))
        model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
        model.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(0)
    for length in (6, 12):
        x = rng.integers(0, 50, size=(96, length)).astype("int32")
        model.fit(x, np.zeros((96, 1), "float32"), batch_size=24, verbose=0)
        data = strategy.explain(format="json")
        assert data["measured"]["input_shapes"] == [[length]]
        assert data["measured"]["planned_input_shapes"] == [[6]]
        text = strategy.explain()
        if length == 6:
            assert data["measured_vs_predicted"] is not None
            assert "measured / predicted" in text
        else:
            assert data["measured_vs_predicted"] is None
            assert "measured / predicted" not in text
            assert ("not compared with the prediction: the fit's inputs had per-sample shapes "
                    "[(12,)], the plan and its prediction are for [(6,)]") in text


def test_a_subclassed_model_with_an_unknown_length_is_warned_about_with_what_to_do():
    """A subclassed model's graph comes from its build shapes, which the first batch
    cannot fill: the warning says so and how to fix it, instead of asking for shapes."""
    import numpy as np

    class Tagger(keras.Model):
        def __init__(self):
            super().__init__()
            self.embed = keras.layers.Embedding(100, 8)
            self.head = keras.layers.Dense(3)

        def call(self, x):
            return self.head(keras.ops.mean(self.embed(x), axis=1))

    strategy = AutoStrategy("single_device", cluster=Cluster.cpu_testbed())
    with strategy.scope():
        model = Tagger()
        model.build((None, None))
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    with pytest.warns(UserWarning, match=(
            r"could not be filled from the input shapes given: a subclassed model's graph "
            r"comes from its build shapes. Build it with fixed shapes.*"
            r"Received: input_shapes=\[\(30,\)\]")):
        strategy.plan_for(model, 24, input_shapes=[(30,)])
    model.fit(np.ones((24, 30), "int32"), np.zeros(24), batch_size=24, verbose=0)


def test_shapes_a_layer_leaves_unknown_are_named_and_a_saved_plan_for_the_shapes_serves(
        tmp_path):
    """A layer that makes its own unknown length (a custom tokenizer-like layer) is named
    in the warning, not blamed on the inputs; a plan file made for the first batch's
    shapes is taken back with plan= for the same shapes without a 'different model'
    note; dict data for a list-input model fills the inputs by name."""
    import warnings

    class Pad(keras.layers.Layer):
        """Pads its sequence by a data-dependent length: (None, None) whatever comes in."""

        def call(self, x):
            return keras.ops.pad(x, [[0, 0], [0, keras.ops.shape(x)[1]]])

        def compute_output_shape(self, shape):
            return (shape[0], None)

    def padded():
        tokens = keras.Input((None,), dtype="int32", name="tokens")
        h = keras.layers.Embedding(100, 8)(Pad()(tokens))
        model = keras.Model(tokens, keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(h)))
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        return model

    cluster = Cluster.cpu_testbed()
    with pytest.warns(UserWarning, match=(
            r"Layers pad.* produce dimensions the input shapes do not fix.*give them a fixed "
            r"output length. Received: input_shapes=\[\(30,\)\]")):
        AutoStrategy("proportional", cluster=cluster).plan_for(padded(), 24, input_shapes=[(30,)])

    planner = AutoStrategy("proportional", cluster=cluster)
    planner.plan_for(_sequence_model(None), 24, input_shapes=[(30,)])
    planner.plan.to_json(tmp_path / "plan.json")
    given = AutoStrategy(cluster=cluster, plan=str(tmp_path / "plan.json"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        plan = given.plan_for(_sequence_model(None), 24, input_shapes=[(30,)])
    assert not [n for n in plan.notes if "different model" in n], plan.notes
    assert given.graph.fingerprint() == planner.graph.fingerprint()

    query = keras.Input((None,), name="query")
    doc = keras.Input((None, 3), name="doc")
    pair = keras.Model([query, doc], keras.layers.Dense(2)(doc))
    x = {"doc": np.zeros((4, 500, 3)), "query": np.zeros((4, 20))}
    assert AutoStrategy.sample_shapes(x, pair) == [(20,), (500, 3)]
