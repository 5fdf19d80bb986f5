"""User scripts on the TensorFlow backend, each in a fresh process (real subprocesses).

TensorFlow's logical CPU devices can only be created before its first
operation, so these cases need a process of their own: the test session's
TensorFlow is already running (tests/conftest.py).
"""

import json
import os
import subprocess
import sys
import textwrap

import keras
import pytest

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow",
    reason="TensorFlow logical devices, set up when the AutoStrategy is created",
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The strategy is created first, then the model is built and TensorFlow starts
# outside `strategy.scope()`; only compile runs inside it.
STRATEGY_FIRST = """
import json
import numpy as np
import keras
import tensorflow as tf
from autodist_keras import AutoStrategy, Cluster

strategy = AutoStrategy("proportional", cluster=Cluster.cpu_testbed())
keras.utils.set_random_seed(3)
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(4)])
with strategy.scope():
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
rng = np.random.default_rng(0)
x = rng.normal(size=(96, 8)).astype("float32")
y = rng.normal(size=(96, 4)).astype("float32")
history = model.fit(x, y, batch_size=24, shuffle=False, verbose=0)
print(json.dumps({"logical_cpus": len(tf.config.list_logical_devices("CPU")),
                  "shares": [r.batch_share for r in strategy.plan.replicas],
                  "losses": history.history["loss"]}))
"""

# TensorFlow starts before the strategy exists: the error must say what to do.
TF_FIRST = """
import keras
from autodist_keras import AutoStrategy, Cluster

model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
strategy = AutoStrategy("proportional", cluster=Cluster.cpu_testbed())
with strategy.scope():
    model.compile(optimizer="sgd", loss="mse")
"""


def _run(tmp_path, source):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(source))
    env = dict(os.environ, KERAS_BACKEND="tensorflow", PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3",
               AUTODIST_KERAS_CACHE=str(tmp_path / "cache"))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)


def test_strategy_created_first_gives_the_devices_to_a_model_built_outside_scope(tmp_path):
    result = _run(tmp_path, STRATEGY_FIRST)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["logical_cpus"] == 3
    assert report["shares"] == [12, 6, 6]
    assert len(report["losses"]) == 1 and report["losses"][0] > 0


def test_tensorflow_started_before_the_strategy_fails_with_the_fix(tmp_path):
    result = _run(tmp_path, TF_FIRST)
    assert result.returncode != 0
    assert "BackendError" in result.stderr
    message = result.stderr.replace("\n", " ")
    assert "Create the AutoStrategy" in message
    assert "Received: 1 logical CPU device(s)" in message


# An earlier strategy fixed TensorFlow's devices at 2: the advice to create the
# strategy first cannot help (it was), so the message says what can.
SECOND_STRATEGY = """
import numpy as np
import keras
from autodist_keras import AutoStrategy, Cluster

two = Cluster.cpu_testbed([{"cores": [0], "threads": 1}, {"cores": [1], "threads": 1}])
first = AutoStrategy("data_parallel", cluster=two)
with first.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    model.compile(optimizer="sgd", loss="mse")
model.fit(np.ones((8, 8)), np.ones((8, 4)), batch_size=4, verbose=0)
second = AutoStrategy("data_parallel", cluster=Cluster.cpu_testbed())
with second.scope():
    pass
"""


def test_a_second_strategy_needing_more_devices_says_an_earlier_one_fixed_them(tmp_path):
    result = _run(tmp_path, SECOND_STRATEGY)
    assert result.returncode != 0
    message = result.stderr.replace("\n", " ")
    assert "BackendError: The cluster has 3 CPU devices" in message
    assert "an earlier AutoStrategy in this process gave TensorFlow 2 logical CPU" in message
    assert "or run this strategy in a new process" in message
    assert "Create the AutoStrategy" not in message  # (it was created first)


def test_torchrun_style_ranks_are_refused_on_tensorflow(tmp_path):
    """`autodist-keras launch` (as torchrun) sets RANK / WORLD_SIZE, which the TensorFlow
    backend does not use: each rank would train the whole plan alone, so the strategy
    refuses at scope() and the launch fails instead of exiting 0 with N separate runs."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(STRATEGY_FIRST))
    env = dict(os.environ, KERAS_BACKEND="tensorflow", PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3",
               AUTODIST_KERAS_CACHE=str(tmp_path / "cache"))
    result = subprocess.run(
        [sys.executable, "-m", "autodist_keras.cli", "launch", "--nprocs", "2",
         "--timeout-s", "240", str(script)],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    text = (result.stdout + result.stderr).replace("\n", " ")
    assert result.returncode != 0, text[-3000:]
    assert "BackendError" in text and "torchrun-style" in text
    assert "Received: WORLD_SIZE='2' with KERAS_BACKEND=tensorflow" in text
    assert '"shares"' not in text  # no rank trained
