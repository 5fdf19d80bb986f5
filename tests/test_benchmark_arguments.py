"""The benchmarks check their arguments first: a bad value is a one-line argparse
error (exit code 2) naming what was wrong, before any model, framework or
measurement starts; a run that fails prints its traceback, then a JSON last line
with an "error" entry, and exits 1. Also: simulator_speed times real simulations (cache off),
plan_quality reports a target it did not run as not run, and the shared helpers."""

import json
import os
import subprocess
import sys

import keras
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "benchmarks")
sys.path.insert(0, BENCHMARKS)

INTEGER = "expected an integer of at least 1"

BAD = [
    ("simulator_speed.py", ["--quick", "--repeats", "0"], INTEGER, "Received: '0'"),
    ("simulator_speed.py", ["--quick", "--repeats", "-3"], INTEGER, "Received: '-3'"),
    ("graph_extraction.py", ["--repeats", "0", "--models", "VGG16"], INTEGER, "'0'"),
    ("op_fusion_torch.py", ["--models", "foo"], "unknown name(s) ['foo']", "cnn, mlp"),
    ("op_fusion_torch.py", ["--models", "mlp", "--steps", "0"], INTEGER, "'0'"),
    ("op_fusion_xla.py", ["--models", "foo"], "unknown name(s) ['foo']", "cnn, mlp"),
    ("op_fusion_xla.py", ["--steps", "0"], INTEGER, "'0'"),
    ("auto_real_check.py", ["--models", "tiny", "--steps", "-1"], INTEGER, "'-1'"),
    ("auto_real_check.py", ["--models", "tiny", "--timeout", "0"], "above 0", "'0'"),
    ("hetero_testbed.py", ["--models", "foo", "--backends", "torch"],
     "unknown name(s) ['foo']", "mlp_large"),
    ("hetero_testbed.py", ["--backends", "foo", "--models", "cnn"],
     "unknown name(s) ['foo']", "tensorflow, torch"),
    ("hetero_testbed.py", ["--steps", "0"], INTEGER, "'0'"),
    ("runtime_overhead.py", ["--backends", "foo"], "unknown name(s) ['foo']",
     "tensorflow, torch"),
    ("runtime_overhead.py", ["--backends", "torch", "--steps", "-1"], INTEGER, "'-1'"),
    ("runtime_overhead.py", ["--rounds", "0"], INTEGER, "'0'"),
    ("estimator_accuracy.py", ["--models", "foo", "mlp_small"],
     "unknown model(s) ['foo']", "mlp_wide"),
    ("estimator_accuracy.py", ["--steps", "0"], INTEGER, "'0'"),
    ("estimator_accuracy.py", ["--models", "mlp_small", "mlp_wide", "mlp_deep", "--variants",
                               "nosuch"], "unknown variant(s) ['nosuch']", "ensemble"),
    ("estimator_accuracy.py", ["--models", "mlp_small", "mlp_wide"], "at least three models",
     "['mlp_small', 'mlp_wide']"),
    ("plan_quality.py", ["--batch-per-device", "0"], INTEGER, "'0'"),
    ("plan_quality.py", ["--models", "ResNet50", "--clusters", ","],
     "unknown model or cluster", "hetero_testbed"),
    ("collective_cost.py", ["--sizes", "lots"], "at least 4", "'lots'"),
    ("gpu_check.py", ["--small", "--budget-s", "0"], "above 0", "'0'"),
    ("gpu_check.py", ["--small", "--sections", "fit,bogus"], "unknown sections ['bogus']",
     "multi_gpu"),
]


# The argument checks run before any framework is imported: the same whatever the
# backend, so one run (torch) checks them.
ARGPARSE_ONLY = "an argument check before any framework is imported; run under torch only"


def _run(script, args, timeout=60):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run([sys.executable, os.path.join(BENCHMARKS, script), *args], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(keras.backend.backend() != "torch", reason=ARGPARSE_ONLY)
@pytest.mark.parametrize("script, args, message, detail", BAD,
                         ids=[f"{s}:{' '.join(a)}" for s, a, _, _ in BAD])
def test_bad_argument_is_an_argparse_error_before_any_work(script, args, message, detail):
    out = _run(script, args)
    assert out.returncode == 2, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{script}: error:"), out.stderr[-2000:]
    assert message in last and detail in last, last
    assert out.stdout == ""  # nothing ran


@pytest.mark.skipif(keras.backend.backend() != "torch",
                    reason="gpu_check runs PyTorch whatever the backend; run under torch only")
def test_gpu_check_without_small_refuses_on_a_machine_without_a_gpu():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: gpu_check runs its full sizes here")
    out = _run("gpu_check.py", ["--sections", "fit"])
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert "no CUDA GPU" in last and "--small" in last, last
    assert out.stdout == ""


def test_simulator_speed_times_real_simulations_not_the_cache():
    """Every repeat used to be a hit of the simulator's result cache (1.2 ms where a
    simulation took 4 to 12 ms): the cache is left alone now, with a real model."""
    import keras
    import simulator_speed

    from autodist_keras.devices import Cluster
    from autodist_keras.estimator import simulator
    from autodist_keras.graph import ModelGraph
    from autodist_keras.strategies import baselines

    inputs = keras.Input((8,))
    model = keras.Model(inputs, keras.layers.Dense(4)(keras.layers.Dense(16)(inputs)))
    graph = ModelGraph.from_keras(model)
    cluster = Cluster.from_string("2xV100")
    plan = baselines.data_parallel_even(graph, cluster, 8)
    simulator.clear_cache()
    record = simulator_speed._case("tiny", graph, cluster, plan, repeats=3, budget_s=1.0)
    assert simulator.cache_stats == {"hits": 0, "misses": 0}  # never looked up
    assert record["repeats"] == 3 and record["within_budget"] is True
    assert record["dedupe"]["tasks"] > 0 and record["every_device"]["tasks"] > 0
    simulator.simulate(graph, cluster, plan)
    simulator.simulate(graph, cluster, plan)
    assert simulator.cache_stats == {"hits": 1, "misses": 1}  # (what the repeats were)


def test_plan_quality_target_not_measured_reads_as_not_run():
    import plan_quality

    summary = {
        "hetero_testbed_auto_geomean_speedup_over_data_parallel_even": 1.6,
        "hetero_testbed_auto_geomean_speedup_over_data_parallel_even_models": 2,
        "hetero_testbed_auto_geomean_speedup_over_proportional": 1.1,
        "hetero_testbed_auto_geomean_speedup_over_proportional_models": 2,
    }
    got = plan_quality.targets(summary, ["hetero_testbed"], have_auto=True)
    mixed = got["mixed16_max_auto_planning_wall_s"]
    assert mixed["met"] is None and mixed["value"] is None
    assert "not run" in mixed["note"] and "mixed16" in mixed["note"]
    even = got["hetero_testbed_auto_geomean_speedup_over_data_parallel_even"]
    assert even["met"] is True and even["models"] == 2 and "note" not in even
    assert got["hetero_testbed_auto_geomean_speedup_over_proportional"]["met"] is False
    no_auto = plan_quality.targets({}, ["hetero_testbed", "mixed16"], have_auto=False)
    assert all(t["met"] is None and "--no-auto" in t["note"] for t in no_auto.values())


def test_plan_quality_geomeans_say_how_many_models():
    import plan_quality

    def rec(even, prop, auto):
        plans = {"data_parallel_even": {"step_time_s": even, "feasible": True},
                 "proportional": {"step_time_s": prop, "feasible": True},
                 "data_parallel_even_ps": {"step_time_s": even, "feasible": True},
                 "auto": {"step_time_s": auto, "feasible": True}}
        return {"plans": plans, "best_family_step_time_s": auto}

    records = {("A", "hetero_testbed"): rec(2.0, 1.5, 1.0),
               ("B", "hetero_testbed"): rec(4.0, 3.0, 2.0)}
    summary = plan_quality.summarise(records, True)
    key = "hetero_testbed_auto_geomean_speedup_over_data_parallel_even"
    assert summary[key] == pytest.approx(2.0) and summary[f"{key}_models"] == 2


def test_versions_and_exit_code_helpers():
    import _common

    info = _common.versions(["torch"])
    assert info["python"] and info["keras"] and "torch" in info
    assert json.loads(json.dumps(info)) == info
    assert _common.exit_code({"a": {"x": 1}, "b": {"even": {"median_step_s": 1}}}) == 0
    assert _common.exit_code({"a": {"even": {"error": ["boom"]}}}) == 1
    assert _common.exit_code({"a": {"error": "boom"}}) == 1
    assert _common.exit_code({"a": {"proportional_measured": {"not_run": ["why"]}}}) == 0


# ------------------------------------------------ a failed run still ends in one JSON line
# Each case makes a run fail cheaply, before any long measurement: an environment the
# benchmark cannot run in (one core where the CPU testbed needs two), an output path
# that cannot be written, a broken data file, or, run through `runpy` as the script
# itself, a model that fails to build or a worker process that runs past its limit.
# The benchmark must print the traceback to stderr, then a JSON last line holding
# what it gathered and an "error" entry, and exit 1.
BUILD_FAILS = ("import autodist_keras.graph as g\n"
               "def load_model(*a, **k):\n"
               "    raise RuntimeError('provoked: the model fails to build')\n"
               "g.load_model = load_model\n")
WORKER_TIMES_OUT = ("import subprocess\n"
                    "def run(command, *a, **k):\n"
                    "    raise subprocess.TimeoutExpired(command, k.get('timeout'))\n"
                    "subprocess.run = run\n")
RESNET_FAILS = ("import keras\n"
                "def resnet(*a, **k):\n"
                "    raise RuntimeError('provoked: the model fails to build')\n"
                "keras.applications.ResNet50 = resnet\n")


def _one_core():
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def _run_as_script(script, args, prelude="", one_core=False, backend=None, timeout=120):
    """Runs `script` as `__main__` (runpy) after `prelude`, in a fresh process."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    if backend:
        env["KERAS_BACKEND"] = backend
    path = os.path.join(BENCHMARKS, script)
    code = (prelude + "import runpy, sys\n"
            f"sys.argv = [{path!r}] + {list(args)!r}\n"
            f"sys.path.insert(0, {BENCHMARKS!r})\n"
            f"runpy.run_path({path!r}, run_name='__main__')\n")
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout,
                          preexec_fn=_one_core if one_core else None)


def _broken_data_dir(tmp_path):
    (tmp_path / "measurements_torch.json").write_text("{not json", encoding="utf-8")
    return str(tmp_path)


FAILING = [
    # (id, script, args, how it fails, the name of the benchmark in the JSON line)
    ("gpu_check-unwritable-out", "gpu_check.py",
     ["--small", "--sections", "detect", "--out", "/dev/null/gpu_check"], {}, "gpu_check"),
    ("op_fusion_torch-one-core", "op_fusion_torch.py", ["--models", "mlp", "--steps", "1"],
     {"one_core": True}, "op_fusion_torch"),
    ("op_fusion_xla-one-core", "op_fusion_xla.py", ["--models", "mlp", "--steps", "1"],
     {"one_core": True, "backend": "tensorflow"}, "op_fusion_xla"),
    ("estimator_accuracy-broken-data", "estimator_accuracy.py",
     ["--backend", "torch", "--models", "mlp_small", "mlp_wide", "mlp_deep", "--data-dir",
      "BROKEN"], {},
     "estimator_accuracy"),
    ("hetero_testbed-worker-timeout", "hetero_testbed.py",
     ["--backends", "torch", "--models", "mlp", "--rounds", "1", "--steps", "1"],
     {"prelude": WORKER_TIMES_OUT}, "hetero_testbed"),
    ("runtime_overhead-worker-timeout", "runtime_overhead.py",
     ["--backends", "torch", "--rounds", "1", "--steps", "1"],
     {"prelude": WORKER_TIMES_OUT}, "runtime_overhead"),
]


@pytest.mark.skipif(keras.backend.backend() != "torch",
                    reason="each benchmark process picks its own backend; run under torch only")
@pytest.mark.parametrize("script, args, how, benchmark", [f[1:] for f in FAILING],
                         ids=[f[0] for f in FAILING])
def test_failed_run_ends_in_a_json_line_with_the_error(script, args, how, benchmark, tmp_path):
    if "one_core" in how and len(os.sched_getaffinity(0)) < 2:
        pytest.skip("this process has one core already")
    args = [_broken_data_dir(tmp_path) if a == "BROKEN" else a for a in args]
    out = _run_as_script(script, args, **how)
    _assert_failed_run(script, out.returncode, out.stdout, out.stderr, benchmark)


def _assert_failed_run(case, code, stdout, stderr, benchmark):
    """A traceback on stderr, then a JSON last line with an "error" entry, and exit code 1."""
    lines = stdout.strip().splitlines()
    assert lines, (case, code, stderr[-3000:])
    try:
        line = json.loads(lines[-1])
    except ValueError:
        pytest.fail(f"{case}: no JSON last line (exit code {code}): {lines[-1][:300]!r}\n"
                    + stderr[-3000:])
    assert code == 1, (case, code, stderr[-3000:])
    assert line.get("benchmark") == benchmark, (case, line)
    text = json.dumps(line)
    assert '"error"' in text, (case, line)
    assert "Traceback (most recent call last)" in stderr, (case, stderr[-3000:])


# Benchmarks whose model fails to build, after Keras and the library are imported: run
# one after another as `__main__` in one fresh process (each after its prelude, with its
# own argv, stdout and stderr; `sys.exit(main())` ends each with SystemExit), so that
# Keras is imported once. (simulator_speed builds its graphs with whatever backend.)
BUILD_FAILING = [
    # (id, script, args, prelude, the name of the benchmark in the JSON line)
    ("graph_extraction-build-fails", "graph_extraction.py",
     ["--models", "VGG16", "--repeats", "1"], BUILD_FAILS, "graph_extraction"),
    ("plan_quality-build-fails", "plan_quality.py",
     ["--models", "MobileNetV2", "--clusters", "hetero_testbed", "--no-auto"], BUILD_FAILS,
     "plan_quality"),
    ("simulator_speed-build-fails", "simulator_speed.py", ["--quick", "--repeats", "1"],
     RESNET_FAILS, "simulator_speed"),
]

RUN_EACH_AS_MAIN = """
import contextlib, io, json, runpy, sys, traceback
results = {}
for case, path, args, prelude in json.loads(sys.argv[1]):
    out, err, code = io.StringIO(), io.StringIO(), None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        exec(prelude, {})
        sys.argv = [path] + args
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as e:
            code = e.code
        except BaseException:  # as a process would: a traceback, exit code 1, no JSON line
            traceback.print_exc()
            code = "uncaught exception"
    results[case] = {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}
print(json.dumps(results))
"""


@pytest.mark.skipif(keras.backend.backend() != "torch",
                    reason="each benchmark process picks its own backend; run under torch only")
def test_failed_runs_whose_model_fails_to_build_end_in_a_json_line_with_the_error():
    cases = [(case, os.path.join(BENCHMARKS, script), args, prelude)
             for case, script, args, prelude, _ in BUILD_FAILING]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="torch")
    out = subprocess.run([sys.executable, "-c", RUN_EACH_AS_MAIN, json.dumps(cases)], env=env,
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert list(results) == [case for case, *_ in BUILD_FAILING]
    for case, _, _, _, benchmark in BUILD_FAILING:
        got = results[case]
        _assert_failed_run(case, got["code"], got["stdout"], got["stderr"], benchmark)


@pytest.mark.skipif(keras.backend.backend() != "torch", reason=ARGPARSE_ONLY)
def test_auto_real_check_bad_devices_is_an_argparse_error_naming_the_devices():
    for devices, wrong in ((["node0/gpu9"], "node0/gpu9"), ([""], "''"),
                           (["node0/cpu0", "node0/cpu0"], "more than once"),
                           (["node0/cpu0,node0/cpu0"], "more than once")):
        out = _run("auto_real_check.py", ["--models", "tiny", "--devices", *devices])
        assert out.returncode == 2, (devices, out.returncode, out.stdout[-2000:],
                                     out.stderr[-2000:])
        last = out.stderr.strip().splitlines()[-1]
        assert last.startswith("auto_real_check.py: error: argument --devices"), last
        assert wrong in last, last
        assert "node0/cpu0, node0/cpu1, node0/cpu2" in last, last
        assert out.stdout == ""  # nothing ran
    out = _run("auto_real_check.py", ["--models", "tiny", "--devices"])
    assert out.returncode == 2 and "--devices" in out.stderr.strip().splitlines()[-1], out.stderr
