"""AutoStrategy("auto") scoring with the packaged learned estimator (real graphs, real estimator)."""

import json
import math
import os

import keras
import pytest

from autodist_keras import AutoStrategy
from autodist_keras import Cluster
from autodist_keras.errors import StrategyError
from autodist_keras.estimator import learned
from autodist_keras.estimator import machine_speed
from autodist_keras.graph import ModelGraph
from autodist_keras.graph import zoo
from autodist_keras.strategies import baselines
from autodist_keras.strategies import selection
from autodist_keras.strategies.explain import explanation
from autodist_keras.strategies.explain import render_text

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASES = ("single_device", "data_parallel_even", "proportional")


@pytest.fixture(scope="module")
def testbed():
    return Cluster.cpu_testbed()


@pytest.fixture(scope="module")
def wide():
    # mlp_wide of benchmarks/estimator_accuracy.py: inside the estimator's training range.
    return ModelGraph.from_keras(zoo.mlp(input_dim=256, hidden=(1024, 1024)))


@pytest.fixture(scope="module")
def torch_estimator():
    estimator = learned.load_default("torch")
    assert estimator is not None, "the packaged torch estimator is missing"
    return estimator


def test_packaged_estimators_are_json_package_data():
    for backend in ("tensorflow", "torch"):
        path = learned.default_path(backend)
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        assert data["schema"] == learned.SCHEMA and data["backends"] == [backend]
        assert data["variant"] == "ensemble" and data["domain"]["structures"] == ["data_parallel"]
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        assert '"estimator/data/*.json"' in f.read()


def test_learned_times_scale_with_the_machine_speed_probe(testbed, wide, tmp_path):
    # The same estimator, as if its training measurements had run on a machine
    # far faster than this one (its reference probe 0.25 ms; this VM's reads
    # about 1.1 ms idle, more under load).
    fast_day = learned.load_default("torch")
    fast_day.machine_probe_s["torch"] = 0.25e-3
    path = tmp_path / "measured_on_a_fast_day.json"
    fast_day.save(path)
    reference = selection.resolve_scorer(learned.default_path("torch"), backend="torch")
    drifted = selection.resolve_scorer(str(path), backend="torch")
    plain = {c.name: c for c in selection.build_candidates(wide, testbed, 96, families=[],
                                                           scorer=reference)}
    scaled = {c.name: c for c in selection.build_candidates(wide, testbed, 96, families=[],
                                                            scorer=drifted)}
    assert drifted.machine_probe_s > 0.25e-3 * (1 + machine_speed.NOISE_BAND)
    assert drifted.speed_factor == pytest.approx(drifted.machine_probe_s / 0.25e-3)
    for name in BASES:
        assert scaled[name].step_time_s == pytest.approx(
            plain[name].step_time_s * drifted.speed_factor / reference.speed_factor, rel=1e-9)
    assert f"scaled x{drifted.speed_factor:.2f}" in drifted.summary(list(scaled.values()))


def test_explain_warns_when_the_runner_up_is_inside_the_estimators_error(testbed):
    # The auto_real_check cnn: data_parallel_unshared and proportional are predicted a
    # few percent apart, and real runs have ranked them both ways.
    cnn = ModelGraph.from_keras(zoo.small_cnn(input_shape=(32, 32, 3), filters=(32, 64)))
    estimator = learned.LearnedEstimator.load(learned.default_path("torch"))
    assert estimator.report["held_out"]["mape"] > 0  # the packaged file's own report
    scorer = selection.Scorer(estimator, "torch", label="learned")
    candidates = selection.build_candidates(cnn, testbed, 96, families=[], scorer=scorer)
    best = selection.pick(candidates)
    runner_up = min((c for c in candidates if c is not best and c.feasible),
                    key=lambda c: c.step_time_s)
    gap = 100 * (runner_up.step_time_s / best.step_time_s - 1)
    assert best.scorer.startswith("learned") and gap > 0

    estimator.report["held_out"] = dict(estimator.report["held_out"], mape=gap + 1.0)
    lines = selection._explain_choice(best, candidates, scorer)
    close = [line for line in lines if line.startswith("close call")]
    assert len(close) == 1
    assert runner_up.name in close[0] and f"{gap:.1f}% slower" in close[0]
    assert f"({gap + 1.0:.1f}% MAPE)" in close[0]
    # A runner-up further away than the estimator's error: no warning.
    estimator.report["held_out"]["mape"] = gap - 0.5
    assert not any(line.startswith("close call")
                   for line in selection._explain_choice(best, candidates, scorer))
    # The simulator scorer has no measured error to compare with: no warning either.
    plain = selection.Scorer(backend="torch")
    sim_candidates = selection.build_candidates(cnn, testbed, 96, families=[], scorer=plain)
    assert not any(line.startswith("close call") for line in selection._explain_choice(
        selection.pick(sim_candidates), sim_candidates, plain))


def test_in_domain_candidates_get_learned_times(testbed, wide, torch_estimator):
    scorer = selection.resolve_scorer("learned", backend="torch")
    candidates = selection.build_candidates(wide, testbed, 96, families=[], scorer=scorer)
    by_name = {c.name: c for c in candidates}
    # The packaged estimator knows how fast this machine ran when it was measured;
    # the search probed the testbed's cores once and scales by the ratio.
    assert torch_estimator.machine_probe_s["torch"] > 0
    assert scorer.machine_probe_s > 0
    assert scorer.speed_factor == torch_estimator.speed_factor("torch", scorer.machine_probe_s)
    assert "machine-speed probe" in scorer.summary(candidates)
    for name in BASES:
        c = by_name[name]
        assert c.scorer == "learned estimator (ensemble, torch); predicted"
        assert c.plan.prediction.source == c.scorer
        expected = torch_estimator.predict(wide, testbed, c.plan, backend="torch",
                                           machine_probe_s=scorer.machine_probe_s)
        assert c.step_time_s == pytest.approx(expected, rel=1e-9)
        assert c.plan.prediction.simulated_step_time_s == c.simulated_step_time_s
        assert c.step_time_s != pytest.approx(c.simulated_step_time_s, rel=1e-3)
    # PS sync was not in the training data: the simulator, rescaled by the learned /
    # simulated ratio of the in-domain candidate on the same devices closest to it.
    inside = [by_name[n] for n in BASES if set(by_name[n].plan.devices) == set(testbed.names)]
    for name in ("data_parallel_even_ps", "proportional_ps"):
        c = by_name[name]
        assert c.scorer.startswith("simulator x ") and "in this search" in c.scorer
        ref = min(inside, key=lambda r: abs(math.log(r.simulated_step_time_s
                                                     / c.simulated_step_time_s)))
        assert ref.name in c.scorer
        ratio = ref.step_time_s / ref.simulated_step_time_s
        assert c.step_time_s == pytest.approx(c.simulated_step_time_s * ratio, rel=1e-9)


def test_out_of_domain_cluster_is_scored_by_the_simulator(wide):
    gpus = Cluster.from_string("2xV100,2x1080Ti")
    scorer = selection.resolve_scorer("learned", backend="torch")
    candidates = selection.build_candidates(wide, gpus, 64, families=[], scorer=scorer)
    assert candidates and all(c.scorer == "simulator (predicted)" for c in candidates)
    assert all(c.step_time_s == c.simulated_step_time_s for c in candidates)
    assert "not in its training measurements" in scorer.summary(candidates)


def test_domain_rule(testbed, wide, torch_estimator):
    even = baselines.data_parallel_even(wide, testbed, 96)
    assert torch_estimator.in_domain(wide, testbed, even, "torch") == (True, "")
    ok, why = torch_estimator.in_domain(wide, testbed, even, "tensorflow")
    assert not ok and "'tensorflow'" in why
    ps = baselines.data_parallel_even(wide, testbed, 96, sync="ps")
    ok, why = torch_estimator.in_domain(wide, testbed, ps, "torch")
    assert not ok and "gradient sync" in why
    fused = baselines.data_parallel_even(wide, testbed, 96)
    fused.op_fusion = [list(wide.nodes)[1:3]]
    ok, why = torch_estimator.in_domain(wide, testbed, fused, "torch")
    assert not ok and "op fusion" in why
    big_batch = baselines.data_parallel_even(wide, testbed, 96 * 5)
    ok, why = torch_estimator.in_domain(wide, testbed, big_batch, "torch")
    assert not ok and "global batch size" in why
    tiny = ModelGraph.from_keras(zoo.mlp(input_dim=4, hidden=(4,), num_classes=2))
    plan = baselines.data_parallel_even(tiny, testbed, 96)
    ok, why = torch_estimator.in_domain(tiny, testbed, plan, "torch")
    assert not ok and "parameter bytes" in why
    gpus = Cluster.from_string("2xV100")
    ok, why = torch_estimator.cluster_in_domain(gpus, backend="torch")
    assert not ok and "V100" in why
    # In words: which devices, what kind, and what it knows.
    assert "node0/gpu0, node0/gpu1: GPU V100" in why and "TFLOP/s" in why
    assert "trained on: CPU testbed device on core(s)" in why
    assert "cores=" not in why
    # Every kind is accounted for: three in words, the rest counted.
    mixed = Cluster.from_string("node0:1xV100;node1:1xT4;node2:1xP100;node3:1x1080Ti")
    ok, why = torch_estimator.cluster_in_domain(mixed, backend="torch")
    assert not ok and "and 1 more kind(s)" in why
    # Layer types its training models lacked: out when they carry the model's FLOPs
    # (a BiLSTM was predicted 9.4x too fast), in when they are cheap (Dropout, Flatten).
    import keras

    inputs = keras.Input((32,), dtype="int32")
    hidden = keras.layers.Embedding(2000, 64)(inputs)
    hidden = keras.layers.Bidirectional(keras.layers.LSTM(64))(hidden)
    recurrent = ModelGraph.from_keras(keras.Model(inputs, keras.layers.Dense(2)(hidden)))
    plan = baselines.data_parallel_even(recurrent, testbed, 96)
    ok, why = torch_estimator.in_domain(recurrent, testbed, plan, "torch")
    assert not ok and "layers of types ['Bidirectional'] were not in its training" in why
    inputs = keras.Input((256,))
    hidden = keras.layers.Dropout(0.1)(keras.layers.Dense(1024, activation="relu")(inputs))
    dropout = ModelGraph.from_keras(keras.Model(inputs, keras.layers.Dense(10)(
        keras.layers.Dense(1024, activation="relu")(hidden))))
    plan = baselines.data_parallel_even(dropout, testbed, 96)
    assert torch_estimator.in_domain(dropout, testbed, plan, "torch") == (True, "")
    # A saved estimator keeps its domain.
    again = learned.LearnedEstimator.from_dict(json.loads(json.dumps(torch_estimator.to_dict())))
    assert again.domain == torch_estimator.domain
    assert again.in_domain(wide, testbed, ps, "torch")[0] is False


def test_estimator_option_validation(tmp_path):
    with pytest.raises(StrategyError, match="'learned', 'simulator'.*Received: estimator='gnn'"):
        AutoStrategy(cluster=Cluster.cpu_testbed(), estimator="gnn")
    with pytest.raises(StrategyError, match="Received: estimator="):
        AutoStrategy(cluster=Cluster.cpu_testbed(), estimator=str(tmp_path / "missing.json"))
    with pytest.raises(StrategyError, match="Received: estimator=3"):
        AutoStrategy(cluster=Cluster.cpu_testbed(), estimator=3)
    bogus = tmp_path / "bogus.json"
    bogus.write_text(json.dumps({"schema": "something else"}))
    with pytest.raises(StrategyError, match="not a learned estimator"):
        selection.resolve_scorer(str(bogus), backend="torch")
    with pytest.raises(StrategyError, match="untrained"):
        selection.check_estimator(learned.LearnedEstimator())
    saved = learned.load_default("torch").save(str(tmp_path / "mine.json"))
    strategy = AutoStrategy(cluster=Cluster.cpu_testbed(), estimator=saved)
    assert strategy.options["estimator"] == saved
    scorer = selection.resolve_scorer(saved, backend="torch")
    assert scorer.estimator is not None and scorer.identity.startswith("learned:")
    assert selection.resolve_scorer("simulator", backend="torch").estimator is None


def test_a_forced_strategy_says_how_its_learned_times_were_scaled(testbed, tmp_path):
    """explain() of a forced strategy named the learned estimator but not the
    machine-speed scaling of its figures, which only auto's "why" mentioned."""
    import keras

    backend = keras.backend.backend()
    fast_day = learned.load_default(backend)
    fast_day.machine_probe_s[backend] = 0.25e-3  # as if trained on a far faster machine
    path = tmp_path / "measured_on_a_fast_day.json"
    fast_day.save(path)
    strategy = AutoStrategy("proportional", cluster=testbed, estimator=str(path))
    strategy.plan_for(zoo.mlp(input_dim=256, hidden=(1024, 1024)), 96)
    data = explanation(strategy.plan, testbed, strategy_name="proportional")
    why = " | ".join(data["why"])
    assert "proportional plan requested" in why
    assert "scaled x" in why and "machine-speed probe" in why
    assert not any(n.startswith("scored: ") for n in data["notes"])


def test_explain_names_the_scorer(testbed, wide, tmp_path):
    plan, candidates = selection.choose_plan(wide, testbed, 96, backend="torch",
                                             cache_dir=str(tmp_path), use_cache=False)
    data = explanation(plan, testbed)
    why = " | ".join(data["why"])
    assert "scored by the learned estimator (ensemble, torch)" in why
    assert data["predicted"]["source"].endswith("predicted")
    assert data["predicted"]["simulated_step_time_ms"] is not None
    assert {c["name"]: c["scorer"] for c in data["candidates"] if c["name"] in BASES} == {
        n: "learned estimator (ensemble, torch); predicted" for n in BASES}
    assert data["predicted"]["backend"] == "torch"  # the backend the figures are for
    text = render_text(data, use_rich=False)
    assert "scored by" in text and "learned (ensemble)" in text
    assert "for the torch backend)" in text
    assert "simulator's breakdown" in text
    plan, _ = selection.choose_plan(wide, testbed, 96, backend="torch", estimator="simulator",
                                    use_cache=False)
    data = explanation(plan, testbed)
    assert any("scored by the simulator (estimator='simulator' was requested)" in w
               for w in data["why"])
    assert data["predicted"]["source"] == "simulator (predicted)"


def test_cache_key_includes_the_scorer(testbed, wide, tmp_path):
    cache = str(tmp_path)
    first, cands = selection.choose_plan(wide, testbed, 96, backend="torch", cache_dir=cache,
                                         families=[])
    assert cands and len(os.listdir(cache)) == 1
    again, cands = selection.choose_plan(wide, testbed, 96, backend="torch", cache_dir=cache,
                                         families=[])
    assert cands == [] and again.prediction.source == first.prediction.source
    other, cands = selection.choose_plan(wide, testbed, 96, backend="torch", cache_dir=cache,
                                         families=[], estimator="simulator")
    assert cands and len(os.listdir(cache)) == 2
    assert other.prediction.source == "simulator (predicted)"
    keys = {selection.cache_key(wide, testbed, 96, testbed.names, [], {}, scorer=s)
            for s in ("simulator", "learned:aaaa", "learned:bbbb")}
    assert len(keys) == 3


def test_a_damaged_cache_entry_is_planned_again_and_overwritten(testbed, wide, tmp_path):
    """A cache file that is not UTF-8 (a disk error, another program's file)
    made choose_plan raise UnicodeDecodeError; now it is a cache miss."""
    cache = str(tmp_path)
    first, _ = selection.choose_plan(wide, testbed, 96, backend="torch", cache_dir=cache,
                                     families=[])
    (entry,) = os.listdir(cache)
    with open(os.path.join(cache, entry), "wb") as f:
        f.write(b"\xff\xfe\x00 not a plan")
    again, cands = selection.choose_plan(wide, testbed, 96, backend="torch", cache_dir=cache,
                                         families=[])
    assert cands, "the damaged entry was planned again"
    assert again.to_dict()["groups"] == first.to_dict()["groups"]
    with open(os.path.join(cache, entry), encoding="utf-8") as f:
        assert json.load(f)["schema_version"] == 2


def test_named_strategy_is_scored_too(testbed):
    strategy = AutoStrategy("proportional", cluster=testbed, estimator="simulator")
    plan = strategy.plan_for(zoo.mlp(input_dim=256, hidden=(1024, 1024)), 96)
    assert plan.prediction.source == "simulator (predicted)"
    assert any("simulator" in w for w in strategy.explain(format="json")["why"])


@pytest.mark.skipif(keras.backend.backend() != "torch",
                    reason="the benchmark runs PyTorch (its default backend), here in this "
                           "process; run under torch only")
@pytest.mark.parametrize("in_process", [False, True], ids=["fresh_process", "in_process"])
def test_real_check_runs_a_tiny_case(in_process, capsys, monkeypatch):
    """The real-run check end to end on one testbed device (short; torch runtime).

    Its `main()` runs in this process (the benchmark's own process is not the point);
    without `--in-process` it times the plan in a fresh process, as users' runs do."""
    import importlib

    monkeypatch.setenv("KERAS_BACKEND", "torch")  # (else main() runs itself again under it)
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    auto_real_check = importlib.import_module("auto_real_check")
    capsys.readouterr()
    code = auto_real_check.main(
        ["--models", "tiny", "--devices", "node0/cpu0", "--steps", "3", "--warmup", "1",
         "--rounds", "2"] + (["--in-process"] if in_process else []))
    out = capsys.readouterr()
    assert code == 0, out.err[-3000:] + out.out[-3000:]
    line = json.loads(out.out.strip().splitlines()[-1])
    case = line["cases"][0]
    assert line["benchmark"] == "auto_real_check" and case["model"] == "tiny"
    (label, row), = case["plans"].items()
    assert label == f"auto={case['auto_planner']}" and row["measured_steps"] == 3
    assert row["measured_step_time_s"] > 0 and row["predicted_step_time_s"] > 0
    assert row["scorer"].endswith("predicted")
    assert case["ratio_measured_baseline_over_auto"] == {} and case["auto_at_least_as_fast"]
    assert case["isolated"] is (not in_process)
    assert line["overall"]["cases"] == 1


def test_unshared_devices_candidate(testbed, wide):
    assert selection.unshared_devices(testbed, testbed.names) == ["node0/cpu0", "node0/cpu1"]
    scorer = selection.resolve_scorer("learned", backend="torch")
    by_name = {c.name: c for c in selection.build_candidates(wide, testbed, 96, families=[],
                                                              scorer=scorer)}
    c = by_name["data_parallel_unshared"]
    assert c.plan.devices == ["node0/cpu0", "node0/cpu1"]
    assert [r.batch_share for r in c.plan.replicas] == [48, 48]
    assert c.scorer == "learned estimator (ensemble, torch); predicted"
    gpus = Cluster.from_string("2xV100,2x1080Ti")
    assert selection.unshared_devices(gpus, gpus.names) == gpus.names
    names = [n for n, _ in selection.baseline_candidates(wide, gpus, 64, gpus.names, {})]
    assert "data_parallel_unshared" not in names


def test_describe_signature_reads_back_device_signature():
    testbed = Cluster.cpu_testbed([{"cores": [0], "threads": 1}, {"cores": [1], "threads": 2}])
    words = [learned.describe_signature(learned.device_signature(testbed.device(d)))
             for d in testbed.names]
    assert words[0].startswith("CPU testbed device on core(s) 0, 1 thread (")
    assert words[1].startswith("CPU testbed device on core(s) 1, 2 threads (")
    gpu = Cluster.from_string("1xA100")
    text = learned.describe_signature(learned.device_signature(gpu.device(gpu.names[0])))
    assert text.startswith("GPU A100") and "TFLOP/s" in text
    # Anything else is shown as it is.
    assert learned.describe_signature("not a signature") == "not a signature"
