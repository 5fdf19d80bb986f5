"""Layer profiler: real timing of real Keras layers on this machine's CPU devices."""

import json
import math
import os

import keras
import pytest

from autodist_keras.devices import Cluster
from autodist_keras.errors import EstimatorError
from autodist_keras.estimator import profiler
from autodist_keras.estimator.profiler import LayerProfile
from autodist_keras.estimator.profiler import ProfileCache
from autodist_keras.estimator.profiler import profile_layers
from autodist_keras.graph import ModelGraph

FAST = dict(warmup=1, repeats=3, min_run_s=2e-4, progress=False)
BATCHES = (4, 8)


def _mlp():
    inputs = keras.Input((16,), name="x")
    x = keras.layers.Dense(32, activation="relu", name="d1")(inputs)
    x = keras.layers.Dropout(0.1, name="drop")(x)
    shared = keras.layers.Dense(32, name="shared")
    x = shared(x)
    x = shared(x)  # a second call: node "shared#1", same signature as "shared"
    outputs = keras.layers.Dense(4, name="head")(x)
    return keras.Model(inputs, outputs, name="tiny_mlp")


@pytest.fixture(scope="module")
def testbed():
    return Cluster.cpu_testbed()


# One test drives the expensive profile and checks it from every side, so that
# pytest-xdist does not profile it again in a second worker.
def test_testbed_profile_cache_budget_and_json(testbed, tmp_path):
    model = _mlp()
    graph = ModelGraph.from_keras(model)
    cache = tmp_path / "cache"
    before = os.sched_getaffinity(0)
    threads_before = profiler._threads_in_use(keras.backend.backend())
    profile = profile_layers(model, testbed, batch_sizes=BATCHES, graph=graph,
                             cache_dir=cache, **FAST)
    assert os.sched_getaffinity(0) == before
    assert profiler._threads_in_use(keras.backend.backend()) == threads_before
    _check_every_layer_device_and_batch(profile, graph, testbed)
    _check_identical_signatures_measured_once(profile)
    _check_sharing(profile)
    _check_second_run_measures_nothing(model, graph, testbed, cache, profile)
    _check_budget(model, graph, testbed, cache, tmp_path / "empty-cache")
    _check_json_round_trip(profile, tmp_path / "profile.json")


def _check_every_layer_device_and_batch(profile, graph, testbed):
    layer_nodes = [n for n in graph.nodes.values() if n.kind != "input"]
    assert len(layer_nodes) == 5
    assert profile.skipped == []
    assert len(profile.timings) == len(layer_nodes) * len(testbed.names) * len(BATCHES)
    assert profile.backend == keras.backend.backend()
    for t in profile.timings:
        assert math.isfinite(t.forward_s) and t.forward_s >= 0
        assert math.isfinite(t.backward_s) and t.backward_s >= 0
        assert len(t.forward_runs_s) == 3 and min(t.forward_runs_s) >= 0
        assert len(t.forward_backward_runs_s) == 3
        # Measured while pinned to the device's cores.
        assert t.details["affinity_used"] == list(testbed.device(t.device).cpu_affinity)
    dense = profile.get("d1", "node0/cpu0", 8)
    assert dense.details["has_backward"] is True
    assert dense.layer_type == "Dense" and dense.source == "from_config"
    assert profile.get("drop", "node0/cpu0", 8).details["has_backward"] is True


def _check_identical_signatures_measured_once(profile):
    # 4 distinct layer signatures (d1, drop, shared == shared#1, head) x 2 device
    # signatures (core 0; core 1 shared by cpu1 and cpu2) x 2 batch sizes.
    assert profile.measured == 4 * 2 * 2
    a = profile.get("shared", "node0/cpu1", 8)
    b = profile.get("shared#1", "node0/cpu2", 8)
    assert a.key == b.key and a.forward_s == b.forward_s
    assert profile.get("shared", "node0/cpu0", 8).key != a.key


def _check_sharing(profile):
    assert profile.devices["node0/cpu0"]["sharing"] == 1.0
    assert profile.devices["node0/cpu1"]["sharing"] == 2.0
    t = profile.get("d1", "node0/cpu1", 4)
    assert t.sharing == 2.0
    assert t.forward_contended_s == pytest.approx(2 * t.forward_s)
    assert t.time("backward") == pytest.approx(2 * t.backward_s)
    assert t.time("forward", contended=False) == t.forward_s
    assert profile.get("d1", "node0/cpu0", 4).time("forward") == profile.get(
        "d1", "node0/cpu0", 4).forward_s


def _check_second_run_measures_nothing(model, graph, testbed, cache, profile):
    again = profile_layers(model, testbed, batch_sizes=BATCHES, graph=graph, cache_dir=cache,
                           **FAST)
    assert again.measured == 0
    assert again.reused == len(again.timings) == len(profile.timings)
    assert all(t.cached for t in again.timings)
    first = {(t.node, t.device, t.batch_size): t.forward_s for t in profile.timings}
    assert {(t.node, t.device, t.batch_size): t.forward_s for t in again.timings} == first
    # One JSON file per measurement, each naming its own key.
    assert len(ProfileCache(cache)) == profile.measured
    folder = next(p for p, _, files in os.walk(cache) if files)
    with open(os.path.join(folder, os.listdir(folder)[0]), encoding="utf-8") as f:
        entry = json.load(f)
    assert json.loads(entry["key"])["backend"] == keras.backend.backend()
    assert entry["record"]["forward_s"] >= 0


def _check_budget(model, graph, testbed, cache, empty_cache):
    empty = profile_layers(model, testbed, batch_sizes=(4,), graph=graph,
                           cache_dir=empty_cache, budget_s=0, **FAST)
    assert empty.measured == 0 and empty.timings == []
    assert len(empty.skipped) == 5 * 3
    assert all("time budget of 0 s spent" in s["reason"] for s in empty.skipped)
    # Cached figures cost no budget; only the new batch size is skipped.
    mixed = profile_layers(model, testbed, batch_sizes=(4, 16), graph=graph, cache_dir=cache,
                           budget_s=0, **FAST)
    assert mixed.measured == 0
    assert {t.batch_size for t in mixed.timings} == {4}
    assert {s["batch_size"] for s in mixed.skipped} == {16}
    assert "skipped" in mixed.summary()


def _check_json_round_trip(profile, path):
    profile.to_json(path)
    loaded = LayerProfile.from_json(path)
    assert loaded.to_dict() == json.loads(json.dumps(profile.to_dict()))
    t4 = loaded.time("head", "node0/cpu0", 4, "forward")
    t8 = loaded.time("head", "node0/cpu0", 8, "forward")
    assert loaded.time("head", "node0/cpu0", 6, "forward") == pytest.approx((t4 + t8) / 2)
    assert loaded.time("head", "node0/cpu0", 8, "forward") == t8
    with pytest.raises(EstimatorError, match="No profile of node"):
        loaded.time("head", "node0/gpu7", 8)


def test_sharing_factors_formula(testbed):
    two_cores = Cluster.cpu_testbed([{"cores": [0, 1], "threads": 2}, {"cores": [1], "threads": 1}])
    factors = profiler.sharing_factors(two_cores)
    # Device 0 keeps core 0 and half of core 1: 1.5 cores' worth of its 2.
    assert factors["node0/cpu0"] == pytest.approx(2 / 1.5)
    assert factors["node0/cpu1"] == pytest.approx(2.0)
    assert profiler.sharing_factors(testbed, ["node0/cpu0", "node0/cpu1"]) == {
        "node0/cpu0": 1.0, "node0/cpu1": 1.0,
    }


def test_pinning_applies_and_restores_affinity_and_threads(testbed):
    before = os.sched_getaffinity(0)
    threads_before = profiler._threads_in_use(keras.backend.backend())
    with profiler.pinned_to(testbed.device("node0/cpu1")) as info:
        assert os.sched_getaffinity(0) == {1}
        assert info["affinity_used"] == [1]
        if keras.backend.backend() == "torch":
            import torch

            assert torch.get_num_threads() == 1
    assert os.sched_getaffinity(0) == before
    assert profiler._threads_in_use(keras.backend.backend()) == threads_before
    with profiler.pinned_to(Cluster.detect().devices[0]) as info:
        assert info["affinity_used"] is None
        assert os.sched_getaffinity(0) == before


def test_cache_directory_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(profiler.CACHE_ENV, str(tmp_path / "env-cache"))
    assert profiler.default_cache_dir() == str(tmp_path / "env-cache")
    assert ProfileCache().directory == str(tmp_path / "env-cache")
    monkeypatch.delenv(profiler.CACHE_ENV)
    assert profiler.default_cache_dir().endswith(os.path.join(".cache", "autodist_keras"))


def test_multi_input_int_op_and_nested_model(testbed, tmp_path):
    tokens = keras.Input((6,), dtype="int32", name="tokens")
    dense_in = keras.Input((8,), name="dense_in")
    e = keras.layers.Embedding(50, 4, name="emb")(tokens)
    e = keras.layers.Flatten(name="flat")(e)
    both = keras.layers.Concatenate(name="cat")([e, dense_in])
    both = keras.ops.relu(both)
    inner = keras.Sequential([keras.Input((32,)), keras.layers.Dense(3, name="inner_dense"),
                              keras.layers.BatchNormalization(name="inner_bn")], name="inner")
    model = keras.Model([tokens, dense_in], inner(both), name="mixed")
    graph = ModelGraph.from_keras(model)
    profile = profile_layers(model, testbed, batch_sizes=(4,), devices=["node0/cpu0"],
                             graph=graph, cache_dir=tmp_path, **FAST)
    assert profile.skipped == []
    profiled = {t.node for t in profile.timings}
    assert profiled == {n.name for n in graph.nodes.values() if n.kind != "input"}
    assert {"emb", "cat", "inner_dense", "inner_bn"} <= profiled
    assert profile.get("emb", "node0/cpu0", 4).details["has_backward"] is True
    assert profile.get("flat", "node0/cpu0", 4).details["input_bytes"] == 4 * 6 * 4 * 4
    # A graph read back from JSON keeps no Keras calls: the same calls are
    # found again, so every figure comes from the cache.
    reread = ModelGraph.from_dict(graph.to_dict())
    assert reread.calls == {}
    again = profile_layers(model, testbed, batch_sizes=(4,), devices=["node0/cpu0"],
                           graph=reread, cache_dir=tmp_path, **FAST)
    assert again.measured == 0 and again.reused == len(profile.timings)


def test_subclassed_model_is_one_node(tmp_path):
    class Tiny(keras.Model):
        def __init__(self):
            super().__init__(name="tiny_sub")
            self.dense = keras.layers.Dense(3)

        def call(self, x):
            return self.dense(x)

    model = Tiny()
    model(keras.ops.ones((2, 5)))
    # The detected CPU: no pinning, the process's own threads.
    profile = profile_layers(model, Cluster.detect(), batch_sizes=(4,), cache_dir=tmp_path,
                             **FAST)
    assert [t.node for t in profile.timings] == ["tiny_sub"]
    assert profile.timings[0].forward_s >= 0
    assert profile.timings[0].details["affinity_used"] is None
    assert profile.devices[profile.timings[0].device]["sharing"] == 1.0


def test_invalid_arguments_raise_estimator_errors(testbed, tmp_path):
    model = _mlp()
    graph = ModelGraph.from_keras(model)
    with pytest.raises(EstimatorError, match=r"batch_sizes must be positive.*Received: \[0\]"):
        profile_layers(model, testbed, batch_sizes=[0], graph=graph, cache_dir=tmp_path)
    with pytest.raises(EstimatorError, match="repeats must be an integer >= 1"):
        profile_layers(model, testbed, graph=graph, repeats=0, cache_dir=tmp_path)
    with pytest.raises(EstimatorError, match="budget_s must be a non-negative"):
        profile_layers(model, testbed, graph=graph, budget_s=-1, cache_dir=tmp_path)
    with pytest.raises(EstimatorError, match="Unknown device 'node0/cpu9'"):
        profile_layers(model, testbed, devices=["node0/cpu9"], graph=graph, cache_dir=tmp_path)
    with pytest.raises(EstimatorError, match="not a local device"):
        profile_layers(model, Cluster.from_string("1xV100"), graph=graph, cache_dir=tmp_path)
    unbuilt = keras.Sequential([keras.layers.Dense(2)])
    with pytest.raises(EstimatorError, match="is not built"):
        profile_layers(unbuilt, testbed, cache_dir=tmp_path)


def test_profile_main_writes_json(tmp_path, capsys):
    out = tmp_path / "profile.json"
    status = profiler.profile_main([
        "--model", "mlp", "--batch-sizes", "4",
        "--out", str(out), "--cache-dir", str(tmp_path / "cache"), "--quiet",
        "--warmup", "1", "--repeats", "2",
    ])
    assert status == 0
    data = json.loads(out.read_text())
    assert data["layers"]["backend"] == keras.backend.backend()
    assert data["layers"]["measured"] > 0 and data["layers"]["timings"]
    assert len(data["layers"]["timings"]) == 3  # mlp: three Dense layers, one device
    assert "measured" in capsys.readouterr().out
    with pytest.raises(EstimatorError, match="--batch-sizes must be comma-separated"):
        profiler.profile_main(["--model", "mlp", "--batch-sizes", "eight"])
    # An output directory is refused by its own name, before anything is measured.
    from autodist_keras.errors import OutputError

    with pytest.raises(OutputError, match=r"it is a directory.*profile\.json'\. Received: "):
        profiler.profile_main(["--model", "mlp", "--batch-sizes", "4", "--out", str(tmp_path),
                               "--cache-dir", str(tmp_path / "cache2"), "--quiet"])
    assert not (tmp_path / "cache2").exists()  # nothing was measured


def test_train_cost_model_with_nothing_measured_says_to_raise_the_budget(tmp_path):
    """`profile --budget-s 0 --train-cost-model` failed with "Training needs a
    non-empty list of profiled samples", which did not say what to change."""
    cost = tmp_path / "cost.json"
    with pytest.raises(EstimatorError, match=(
            r"--train-cost-model needs measured layer times, but the profile has none "
            r"\(3 measurement\(s\) skipped; the first because: time budget of 0 s spent\)\. "
            r"Raise --budget-s \(or leave it out\).*Received: --budget-s=0\.0$")):
        profiler.profile_main(["--model", "mlp", "--batch-sizes", "4", "--budget-s", "0",
                               "--train-cost-model", str(cost),
                               "--cache-dir", str(tmp_path / "cache"), "--quiet"])
    assert not cost.exists()


def test_profile_command_with_an_unwritable_cache_names_its_options(tmp_path):
    """`autodist-keras profile` with a cache it cannot write said "pass cache_dir=", an
    argument of the Python function, not an option of the command."""
    blocker = tmp_path / "cache_is_a_file"
    blocker.write_text("not a directory")
    with pytest.raises(EstimatorError) as info:
        profiler.profile_main(["--model", "mlp", "--batch-sizes", "4", "--quiet",
                               "--warmup", "1", "--repeats", "1", "--cache-dir", str(blocker)])
    message = str(info.value)
    assert message.startswith(f"Cannot write the profile cache in {blocker} (")
    assert ("Pass --cache-dir DIR with a writable directory (or set AUTODIST_KERAS_CACHE), "
            "or --no-cache to measure without one.") in message
    assert "cache_dir=" not in message and message.endswith(f"Received: {str(blocker)!r}")
    # The Python function keeps naming its own argument.
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    testbed = Cluster.cpu_testbed([{"cores": [0], "threads": 1}])
    with pytest.raises(EstimatorError, match="pass cache_dir= to a writable directory"):
        profile_layers(model, testbed, batch_sizes=(4,), warmup=1, repeats=1, cache_dir=blocker)


_HEAVY_LAYER = '''
import keras


class Heavy(keras.layers.Layer):
    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], shape[-1]), initializer="ones")

    def call(self, x):
{body}        return x
'''


def test_a_custom_layer_whose_code_changed_is_measured_again(testbed, tmp_path, monkeypatch):
    """The cache key held the class path and config but not the code, so a custom
    layer whose `call` was edited (same name, config and shapes) got its old
    timings back: 0.13 ms where it now took 2.7 ms. Keras's own layers keep their
    keys (the Keras version covers their code)."""
    import importlib
    import sys

    source = tmp_path / "heavy_layer_module.py"
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)

    def profile_with(body):
        source.write_text(_HEAVY_LAYER.format(body=body))
        importlib.invalidate_caches()
        module = importlib.reload(sys.modules["heavy_layer_module"]) \
            if "heavy_layer_module" in sys.modules else importlib.import_module("heavy_layer_module")
        inputs = keras.Input((8,), name="x")
        outputs = keras.layers.Dense(2, name="head")(module.Heavy(name="heavy")(inputs))
        model = keras.Model(inputs, outputs, name="edited")
        return profile_layers(model, testbed, batch_sizes=(4,), devices=["node0/cpu0"],
                              cache_dir=tmp_path / "cache", **FAST)

    try:
        one_matmul = "        x = keras.ops.matmul(x, self.w)\n"
        first = profile_with(one_matmul)
        assert first.measured == 2
        assert profile_with(one_matmul).measured == 0  # unchanged code: from the cache
        edited = profile_with(one_matmul * 3)  # Heavy measured again, the Dense reused
        assert (edited.measured, edited.reused) == (1, 1)
    finally:
        sys.modules.pop("heavy_layer_module", None)
    signature = profiler.layer_signature(keras.layers.Dense(2), [], {})
    assert "code_sha256" not in signature
