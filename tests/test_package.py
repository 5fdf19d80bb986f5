"""Package-level behaviour: imports stay light, the CLI entry point exists."""

import os
import subprocess
import sys

import keras
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(keras.backend.backend() != "torch",
                    reason="backend-independent (each case sets its process's backend); "
                           "run under torch only")
@pytest.mark.parametrize("backend", ["tensorflow", "torch"])
def test_import_loads_neither_framework(backend):
    code = (
        "import sys, autodist_keras, autodist_keras.devices, autodist_keras.graph, "
        "autodist_keras.strategies, autodist_keras.estimator, autodist_keras.cli;"
        "from autodist_keras import AutoStrategy, Cluster, ModelGraph, Plan;"
        "print(sorted(m for m in ('tensorflow', 'torch', 'keras') if m in sys.modules))"
    )
    env = dict(os.environ, KERAS_BACKEND=backend)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_console_script_help():
    out = subprocess.run(
        [sys.executable, "-m", "autodist_keras.cli", "--help"], cwd=ROOT,
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    for command in ("devices", "graph"):
        assert command in out.stdout


@pytest.mark.skipif(keras.backend.backend() != "tensorflow",
                    reason="backend-independent (each case sets its process's backend); "
                           "run under tensorflow only")
def test_backend_defaults_follow_keras_json(tmp_path):
    """Without KERAS_BACKEND, the helpers answer what Keras would use: keras.json. So
    does the tests' conftest, which gives TensorFlow its 4 logical CPU devices: it read
    KERAS_BACKEND only, so a run without it (TensorFlow from keras.json or by default)
    got one device, and each test of a 3-device testbed strategy failed."""
    import json

    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    env["KERAS_HOME"] = str(tmp_path)
    env["TESTS"] = os.path.join(ROOT, "tests")
    code = (
        "import os, sys\n"
        "from autodist_keras.devices.detect import active_keras_backend\n"
        "from autodist_keras.estimator.measurements import _resolve_backend\n"
        "from autodist_keras.estimator.cost_model import AnalyticCostModel\n"
        "print(active_keras_backend(), _resolve_backend(None), AnalyticCostModel().framework)\n"
        "sys.path.insert(0, os.environ['TESTS'])\n"
        "import conftest\n"
        "tf = sys.modules.get('tensorflow')\n"
        "print(len(tf.config.get_logical_device_configuration(\n"
        "    tf.config.list_physical_devices('CPU')[0]) or []) if tf else 'no TensorFlow')\n"
    )
    for backend, devices in (("torch", "TensorFlow"), ("tensorflow", "4")):
        (tmp_path / "keras.json").write_text(json.dumps({"backend": backend}))
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split()[:3] == [backend] * 3
        assert out.stdout.split()[-1] == devices, out.stdout


def test_host_cpu_name_is_shared_by_provenance_and_profile_cache():
    from autodist_keras import Cluster
    from autodist_keras.devices.detect import host_cpu_name
    from autodist_keras.estimator import measurements
    from autodist_keras.estimator import profiler

    name = host_cpu_name()
    assert isinstance(name, str) and name
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            assert any(line.split(":", 1)[-1].strip() == name for line in f
                       if line.lower().startswith("model name"))
    assert measurements.machine_info()["cpu"] == name
    device = Cluster.cpu_testbed().device("node0/cpu0")
    assert profiler.device_signature(device)["host_cpu"] == name


def test_wheel_carries_every_data_file_and_the_shipped_clusters(tmp_path):
    """A wheel built from the source holds every non-Python file of the package (the
    shipped cluster specs, the packaged estimators, py.typed), and an install of it
    resolves `cluster="hetero_testbed"` from any working directory."""
    import shutil
    import zipfile

    import keras

    if keras.backend.backend() != "tensorflow":
        pytest.skip("packaging does not depend on the backend: checked in the TensorFlow run")
    pytest.importorskip("setuptools")
    source = tmp_path / "source"  # a copy, so the build leaves no build/ in the checkout
    shutil.copytree(os.path.join(ROOT, "autodist_keras"), source / "autodist_keras",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), source / name)
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path / "wheel"), str(source)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    data_files = {
        os.path.relpath(os.path.join(folder, f), source).replace(os.sep, "/")
        for folder, _, files in os.walk(source / "autodist_keras")
        for f in files if not f.endswith(".py")
    }
    assert {"autodist_keras/devices/clusters/hetero_testbed.yaml",
            "autodist_keras/py.typed"} <= data_files
    assert data_files <= names, sorted(data_files - names)

    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    code = ("import autodist_keras, os; from autodist_keras import Cluster;"
            "assert autodist_keras.__file__.startswith(os.environ['SITE']), autodist_keras.__file__;"
            "print(len(Cluster.resolve('hetero_testbed')))")
    env = dict(os.environ, PYTHONPATH=str(site), SITE=str(site))
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "8"
