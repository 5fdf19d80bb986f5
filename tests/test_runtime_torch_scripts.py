"""User scripts run with `python train.py` on the PyTorch backend (real subprocesses).

The PyTorch runtime starts worker processes that import the user's script, so
a script needs the usual main guard; without one it must fail at once with a
message that says what to change. A `keras.Sequential` model, whose layers get
other variable paths when a worker rebuilds it from its config, must train
and match single-device training.
"""

import json
import os
import re
import subprocess
import sys
import textwrap

import keras
import pytest

from autodist_keras.errors import BackendError

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "torch",
    reason="PyTorch runtime: spawned workers import the user's script",
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TRAIN = """
import json, sys
import numpy as np
import keras
from autodist_keras import AutoStrategy, Cluster


def build():
    # (Seeded initializers, not keras.utils.set_random_seed, which imports TensorFlow.)
    glorot = keras.initializers.GlorotUniform
    return keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(16, activation="relu", kernel_initializer=glorot(seed=3)),
        keras.layers.Dense(4, kernel_initializer=glorot(seed=4))])


def train(strategy):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 8)).astype("float32")
    y = rng.normal(size=(96, 4)).astype("float32")
    # (a schedule: the settings watch serializes the optimizer's config every fit)
    schedule = keras.optimizers.schedules.ExponentialDecay(0.05, 10, 0.9)
    if strategy is None:
        model = build()
        model.compile(optimizer=keras.optimizers.SGD(schedule), loss="mse")
    else:
        with strategy.scope():
            model = build()
            model.compile(optimizer=keras.optimizers.SGD(schedule), loss="mse")
    model.fit(x, y, batch_size=24, shuffle=False, verbose=0)
    return model
"""

GUARDED_MAIN = """
if __name__ == "__main__":
    reference = train(None)
    strategy = AutoStrategy("proportional", cluster=Cluster.cpu_testbed())
    model = train(strategy)
    diffs = [float(np.max(np.abs(a - b)) / (np.max(np.abs(a)) + 1e-12))
             for a, b in zip(reference.get_weights(), model.get_weights())]
    print(json.dumps({"replicas": len(strategy.plan.replicas), "max_rel_diff": max(diffs),
                      "paths": [v.path for v in model.trainable_weights]}))
"""

UNGUARDED_MAIN = """
strategy = AutoStrategy("data_parallel", cluster=Cluster.cpu_testbed())
train(strategy)
print("trained")
"""


def _run(tmp_path, source):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(source))
    env = dict(os.environ, KERAS_BACKEND="torch", PYTHONPATH=ROOT,
               AUTODIST_KERAS_CACHE=str(tmp_path / "cache"))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)


def test_script_without_main_guard_fails_at_once_with_the_fix(tmp_path):
    result = _run(tmp_path, TRAIN + UNGUARDED_MAIN)
    assert result.returncode != 0
    assert "BackendError" in result.stderr
    assert 'Put the code that builds and fits the model under `if __name__ == "__main__":`' in (
        result.stderr.replace("\n", " "))
    assert "trained" not in result.stdout
    assert "bootstrapping phase" not in result.stderr  # no worker was started


def test_script_read_from_stdin_fails_at_once_with_the_fix(tmp_path):
    env = dict(os.environ, KERAS_BACKEND="torch", PYTHONPATH=ROOT,
               AUTODIST_KERAS_CACHE=str(tmp_path / "cache"))
    result = subprocess.run([sys.executable, "-"], input=textwrap.dedent(TRAIN + GUARDED_MAIN),
                            capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert result.returncode != 0
    assert "BackendError" in result.stderr
    assert "Save it as a .py file" in result.stderr.replace("\n", " ")
    assert "trained" not in result.stdout


INTERACTIVE_CUSTOM_LAYER = """
import numpy as np, keras
from autodist_keras import AutoStrategy, Cluster
class Scale(keras.layers.Layer):
    def call(self, x):
        return x * 2.0
strategy = AutoStrategy("data_parallel", cluster=Cluster.cpu_testbed())
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), Scale(), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
model.fit(np.ones((48, 4)), np.ones((48, 1)), batch_size=24, verbose=0)
print("trained")
"""


def test_custom_layer_of_an_interactive_session_gets_the_advice_that_works_there(tmp_path):
    """In a notebook (here `python -c`) registering the layer would not help,
    so the first error already says to move it into a module (it said to
    register it, and only the next try said to move it)."""
    env = dict(os.environ, KERAS_BACKEND="torch", PYTHONPATH=ROOT,
               AUTODIST_KERAS_CACHE=str(tmp_path / "cache"))
    result = subprocess.run([sys.executable, "-c", INTERACTIVE_CUSTOM_LAYER],
                            capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    message = result.stderr.replace("\n", " ")
    assert result.returncode != 0 and "trained" not in result.stdout
    assert "BackendError" in message
    assert "defined in an interactive session" in message
    assert "Move it into a module (a .py file)" in message
    assert "Received: __main__.Scale" in message


def _env(tmp_path):
    return dict(os.environ, KERAS_BACKEND="torch", PYTHONPATH=ROOT,
                AUTODIST_KERAS_CACHE=str(tmp_path / "cache"))


def test_script_read_from_a_pipe_fails_at_once_with_the_fix(tmp_path):
    """`python <(cat train.py)`: the script's path is /dev/fd/63, a pipe the workers
    cannot read again; each failed in a multiprocessing traceback, and fit raised
    only "Worker rank 1 failed: process exited with code 1"."""
    import shutil

    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("needs bash for process substitution")
    (tmp_path / "train.py").write_text(textwrap.dedent(TRAIN + GUARDED_MAIN))
    result = subprocess.run([bash, "-c", f'exec "{sys.executable}" <(cat train.py)'],
                            capture_output=True, text=True, timeout=300, env=_env(tmp_path),
                            cwd=tmp_path)
    message = result.stderr.replace("\n", " ")
    assert result.returncode != 0
    assert "BackendError: The PyTorch runtime starts one worker process per extra device" in message
    assert re.search(r"your main script; yours, /dev/fd/\d+, is a pipe", message), message[-2000:]
    assert "Save the script as a .py file and run `python train.py`" in message
    assert "bootstrapping phase" not in message and "WorkerError" not in message


def test_script_without_py_extension_or_main_guard_fails_at_once_with_the_fix(tmp_path):
    """An executable script named without `.py` was not read, so its missing guard
    surfaced as a worker's multiprocessing traceback and a bare exit code."""
    script = tmp_path / "train"
    script.write_text(textwrap.dedent(TRAIN + UNGUARDED_MAIN))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=300, env=_env(tmp_path), cwd=tmp_path)
    message = result.stderr.replace("\n", " ")
    assert result.returncode != 0 and "trained" not in result.stdout
    assert "BackendError" in message
    assert 'Put the code that builds and fits the model under `if __name__ == "__main__":`' in (
        message)
    assert f"Received: no `if __name__ == \"__main__\":` block in {script}" in message
    assert "bootstrapping phase" not in message  # no worker was started


def test_script_deleted_before_fit_fails_at_once_with_the_fix(tmp_path):
    """A guarded script that is gone by the time of fit (deleted, moved): the workers
    cannot import it, and each died with a FileNotFoundError traceback."""
    source = TRAIN + GUARDED_MAIN.replace('if __name__ == "__main__":\n',
                                          'if __name__ == "__main__":\n    os.remove(__file__)\n')
    result = _run(tmp_path, "import os\n" + source)
    message = result.stderr.replace("\n", " ")
    assert result.returncode != 0
    assert (f"your main script; yours, {tmp_path / 'train.py'}, no longer exists (it was "
            "deleted or moved after Python started)") in message, message[-2000:]
    assert "Keep the script in place until the fit ends" in message
    assert "WorkerError" not in message


def test_fit_above_the_main_guard_says_the_workers_failed_importing_the_script(tmp_path):
    """A script with a main guard that still fits at module level, above it: the check
    cannot tell, and each worker fails while importing the script. The WorkerError said
    only "process exited with code 1"; it now says where and why to look."""
    source = TRAIN + UNGUARDED_MAIN + '\nif __name__ == "__main__":\n    print("done")\n'
    result = _run(tmp_path, source)
    message = result.stderr.replace("\n", " ")
    assert result.returncode != 0 and "trained" not in result.stdout
    assert re.search(r"WorkerError: Worker rank \d failed: process exited with code 1 while "
                     r"starting \(importing your main script, "
                     rf"{re.escape(str(tmp_path / 'train.py'))}, or the worker's own modules\), "
                     "before it reached the worker's main function", message), message[-3000:]
    assert "re-imports `__main__`, as torch.multiprocessing does" in message
    assert "The traceback above on stderr says why" in message
    assert 'outside `if __name__ == "__main__":`' in message


# A package's unguarded __main__.py: trains a Sequential model on the testbed's three
# devices, says whether its fit, evaluate and predict imported TensorFlow, checks that
# Keras's serializer sees TensorFlow again after the block that hides it, and last (plain
# Keras imports TensorFlow for an optimizer with a schedule) trains it on one device.
PACKAGE_MAIN = """
import importlib.util, sys
from mytrain import AutoStrategy, Cluster, json, np, train

strategy = AutoStrategy("proportional", cluster=Cluster.cpu_testbed())
model = train(strategy)
x = np.ones((48, 8), "float32")
model.evaluate(x, x[:, :4], batch_size=24, verbose=0)
model.predict(x, batch_size=24, verbose=0)
report = {"tensorflow_imported": "tensorflow" in sys.modules, "lazy": None}
if importlib.util.find_spec("tensorflow") is not None:
    from keras.src.utils import module_utils
    from autodist_keras.lazy_tensorflow import tensorflow_left_unimported

    with tensorflow_left_unimported():
        inside = module_utils.tensorflow.available
    report["lazy"] = {"inside": inside, "imported": "tensorflow" in sys.modules}
    with tensorflow_left_unimported():
        import tensorflow  # e.g. a custom layer's module, imported while serializing
    report["lazy"]["after an import inside"] = module_utils.tensorflow.available
reference = train(None)
diffs = [float(np.max(np.abs(a - b)) / (np.max(np.abs(a)) + 1e-12))
         for a, b in zip(reference.get_weights(), model.get_weights())]
report.update(replicas=len(strategy.plan.replicas), max_rel_diff=max(diffs),
              paths=[v.path for v in model.trainable_weights])
print(json.dumps(report))
"""


def test_a_package_run_with_python_m_needs_no_guard_and_trains_like_one_device(tmp_path):
    """One `python -m mytrain` run checks four things.

    - `python -m pkg` runs pkg/__main__.py, which multiprocessing does not import
      again in the workers: such a module (often `main()` at module level,
      unguarded) was refused as if the workers would run it again.
    - A `keras.Sequential` model, whose layers get other variable paths when a
      worker rebuilds it from its config, trains on three processes like on one
      device.
    - A fit (its optimizer has a schedule: the settings watch serializes the
      optimizer's config every fit), evaluate and predict under the strategy import
      no TensorFlow: Keras's serializer asks whether TensorFlow is available, which
      imported it wherever it is installed (seconds and TensorFlow's start-up log
      lines in every PyTorch job). (The one-device reference trains last: plain
      Keras imports TensorFlow itself for an optimizer with a schedule.)
    - Serializing answers "TensorFlow not available" only while it is not
      imported; after the block Keras asks again, so its TensorFlow-backed layers
      (Hashing, StringLookup) can be built, also when TensorFlow was imported
      inside it.
    """
    import importlib.util

    package = tmp_path / "mytrain"
    package.mkdir()
    (package / "__init__.py").write_text(textwrap.dedent(TRAIN))
    (package / "__main__.py").write_text(PACKAGE_MAIN)
    result = subprocess.run([sys.executable, "-m", "mytrain"], capture_output=True, text=True,
                            timeout=400, env=_env(tmp_path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["replicas"] == 3
    assert report["paths"][0].startswith("sequential"), report["paths"]
    assert report["max_rel_diff"] < 1e-5, report
    if importlib.util.find_spec("tensorflow") is None:
        return  # (where it is not installed nothing imports it)
    assert report["tensorflow_imported"] is False, "a fit, evaluate or predict imported it"
    assert report["lazy"] == {"inside": False, "imported": False,
                              "after an import inside": True}, report["lazy"]


LAYER_REGISTERED_IN_MAIN = """
import numpy as np, keras
from autodist_keras import AutoStrategy, Cluster


def main():
    @keras.saving.register_keras_serializable(package="local")
    class Scale(keras.layers.Layer):
        def call(self, x):
            return x * 2.0

    strategy = AutoStrategy("data_parallel", cluster=Cluster.cpu_testbed())
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), Scale(), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    model.fit(np.ones((48, 4)), np.ones((48, 1)), batch_size=24, verbose=0)
    print("trained")


if __name__ == "__main__":
    main()
"""


def _make_layer_class():
    @keras.saving.register_keras_serializable(package="test_factory")
    class Doubled(keras.layers.Layer):
        def call(self, x):
            return x * 2.0

    return Doubled


# Made at import time (so a worker importing this module has it too), kept in a dict.
_MADE_AT_IMPORT = {"doubled": _make_layer_class()}


def test_custom_layer_registered_inside_main_is_refused_before_workers_start(tmp_path):
    """Registered in rank 0 only (the workers import the script without running
    main()), so the check passed, the workers started, and about 18 s later a worker
    said it could not deserialize 'Sequential', naming neither the layer nor the fix.
    A class a factory makes at import time is accepted, wherever it is kept."""
    from autodist_keras.backends.torch_session import check_serializable

    result = _run(tmp_path, LAYER_REGISTERED_IN_MAIN)
    message = result.stderr.replace("\n", " ")
    assert result.returncode != 0 and "trained" not in result.stdout
    assert "BackendError" in message and "WorkerError" not in message, message[-2000:]
    assert "defined inside the function main() of module '__main__'" in message
    assert "Define the class (or function) at the top level of the module" in message
    assert "Received: __main__.main.<locals>.Scale" in message
    assert "bootstrapping phase" not in message  # no worker was started
    check_serializable(keras.Sequential([keras.Input((4,)), _MADE_AT_IMPORT["doubled"](),
                                         keras.layers.Dense(1)]))

    @keras.saving.register_keras_serializable(package="test_local")
    class Halved(keras.layers.Layer):  # made by this test, which is still running
        def call(self, x):
            return x * 0.5

    with pytest.raises(BackendError, match="defined inside the function test_custom_layer_"):
        check_serializable(keras.Sequential([keras.Input((4,)), Halved()]))
