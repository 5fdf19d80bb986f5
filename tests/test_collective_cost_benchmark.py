"""benchmarks/collective_cost.py: real cross-process all-reduces on the testbed's cores."""

import json
import os
import subprocess
import sys

import keras

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "collective_cost.py")


def _run(*args, timeout=240):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run([sys.executable, SCRIPT, *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_measures_the_active_backends_all_reduce_on_every_testbed_device():
    # Each backend's pytest run checks its own framework's collectives.
    framework = keras.backend.backend()
    out = _run("--frameworks", framework, "--sizes", "1024,65536", "--calls", "3")
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    result = report["frameworks"][framework]
    assert [d["cores"] for d in result["devices"]] == [[0], [1], [1]]
    assert len(result["per_rank"]) == 3
    for rows in result["per_rank"]:
        assert [r["size_bytes"] for r in rows] == [1024, 65536]
        assert all(r["median_call_ms"] > 0 and r["cpu_per_call_ms"] > 0 for r in rows)
    for row, ranks in zip(result["by_size"], zip(*result["per_rank"])):
        # Core 1 carries two processes: its CPU figure is their sum.
        assert row["core_cpu_ms"]["1"] == round(
            ranks[1]["cpu_per_call_ms"] + ranks[2]["cpu_per_call_ms"], 3)
        assert row["median_call_ms"] == max(r["median_call_ms"] for r in ranks)


def test_bad_arguments_fail_with_a_message():
    out = _run("--frameworks", "mxnet", timeout=60)
    assert out.returncode == 2 and "Received: ['mxnet']" in out.stderr
    out = _run("--sizes", "2", timeout=60)
    assert out.returncode == 2 and "at least 4" in out.stderr
