"""benchmarks/tf_process_layout.py: both TensorFlow worker layouts, timed for real."""

import json
import os
import subprocess
import sys

import keras
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "tf_process_layout.py")

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow",
    reason="TensorFlow worker layouts are checked in the TensorFlow run",
)


def _run(*args, timeout=400):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run([sys.executable, SCRIPT, *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_times_both_layouts_and_both_plans():
    # Four launches of fresh workers (2 layouts x 2 plans) are the benchmark's method;
    # their cost is mostly each worker's start. The MLP traces faster than the CNN, and
    # one timed step (no warm-up) is enough to check the report.
    out = _run("--models", "mlp", "--rounds", "1", "--steps", "1", "--warmup", "0")
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    row = report["results"]["mlp"]
    assert set(row["round_median_step_ms"]) == {
        "per_core/data_parallel", "per_core/proportional",
        "per_device/data_parallel", "per_device/proportional"}
    for key, values in row["round_median_step_ms"].items():
        assert len(values) == 1 and values[0] > 0
        assert row["median_step_ms"][key] == values[0]
    medians = row["median_step_ms"]
    assert row["even_over_proportional"]["per_core"] == round(
        medians["per_core/data_parallel"] / medians["per_core/proportional"], 3)
    assert row["proportional_per_device_over_per_core"] == round(
        medians["per_device/proportional"] / medians["per_core/proportional"], 3)


def test_bad_arguments_fail_with_a_message():
    out = _run("--models", "resnet9000", timeout=60)
    assert out.returncode == 2 and "Received: ['resnet9000']" in out.stderr
    out = _run("--rounds", "0", timeout=60)
    assert out.returncode == 2 and "Received: rounds=0" in out.stderr
