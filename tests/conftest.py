"""Shared pytest set-up (keep minimal: every engineer's tests load it).

Under the TensorFlow backend, TensorFlow gets 4 logical CPU devices before
any test imports it: logical devices can only be configured before
TensorFlow runs its first op, and the TensorFlow runtime tests place
replicas on them. The backend is the one Keras will use: KERAS_BACKEND, else
keras.json's (a run without KERAS_BACKEND, on Keras's default TensorFlow, got
no devices, and every test of a 3-device testbed strategy failed).
"""

import os

import pytest

from autodist_keras.devices.detect import active_keras_backend

if active_keras_backend() == "tensorflow":
    try:
        import tensorflow as tf
    except ImportError:  # the PyTorch-only install
        tf = None
    if tf is not None:
        _cpu = tf.config.list_physical_devices("CPU")[0]
        try:
            if len(tf.config.get_logical_device_configuration(_cpu) or []) < 4:
                tf.config.set_logical_device_configuration(
                    _cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(4)]
                )
        except RuntimeError:
            pass  # already initialised by a plugin: tests needing 4 devices will say so


def _live_processes(field, value):
    """Pids of the live (not zombie) processes whose /proc stat `field` ("ppid" or
    "session") equals `value` (Linux)."""
    column = {"ppid": 1, "session": 3}[field]  # after the name: state, ppid, pgrp, session
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[column]) == value and fields[0] != "Z":
            pids.append(int(entry))
    return pids


@pytest.fixture(scope="session")
def live_processes():
    """`live_processes(field, value)`: pids of live processes by parent ("ppid") or
    session ("session") id, read from /proc."""
    return _live_processes


@pytest.fixture(autouse=True)
def _private_plan_cache(tmp_path, monkeypatch):
    """Each test plans with an empty plan cache of its own, never the user's."""
    monkeypatch.setenv("AUTODIST_KERAS_CACHE", str(tmp_path / "autodist_keras_cache"))


# ---------------------------------------------------------------------------
# Models, graphs and clusters shared by the planner and fusion tests
# (test_fastt, test_heterog, test_disco, test_fusion). Module-scoped like the
# fixtures they replace; a test module that defines a fixture of the same
# name (e.g. its own `cnn` or `wide`) uses its own. Keras and the package are
# imported inside the fixtures so that loading this file stays cheap.


def _mlp_model(width=2048, depth=4, name="wide"):
    import keras

    inputs = keras.Input((width,), name=f"{name}_x")
    x = inputs
    for i in range(depth):
        x = keras.layers.Dense(width, activation="relu", name=f"{name}_d{i}")(x)
    return keras.Model(inputs, keras.layers.Dense(10, name=f"{name}_head")(x), name=name)


def _residual_model(blocks=2, filters=16, size=16, name="res"):
    """conv-bn-relu-conv-bn-add-relu blocks: fusible chains and a two-input Add."""
    import keras

    inputs = keras.Input((size, size, 3), name=f"{name}_x")
    x = keras.layers.Conv2D(filters, 3, padding="same", name=f"{name}_stem")(inputs)
    for b in range(blocks):
        p = f"{name}_b{b}"
        h = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False, name=f"{p}_conv1")(x)
        h = keras.layers.BatchNormalization(name=f"{p}_bn1")(h)
        h = keras.layers.ReLU(name=f"{p}_relu1")(h)
        h = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False, name=f"{p}_conv2")(h)
        h = keras.layers.BatchNormalization(name=f"{p}_bn2")(h)
        x = keras.layers.Add(name=f"{p}_add")([x, h])
        x = keras.layers.ReLU(name=f"{p}_relu2")(x)
    x = keras.layers.GlobalAveragePooling2D(name=f"{name}_gap")(x)
    outputs = keras.layers.Dense(10, name=f"{name}_head")(x)
    return keras.Model(inputs, outputs, name=name)


def _tiny_mlp():
    """16 -> Dense 32 (relu, "hidden") -> Dense 4 ("head"): a model for plan tests."""
    import keras

    inputs = keras.Input((16,))
    x = keras.layers.Dense(32, activation="relu", name="hidden")(inputs)
    outputs = keras.layers.Dense(4, name="head")(x)
    return keras.Model(inputs, outputs, name="mlp")


def _plan_json(plan):
    """A plan as sorted JSON with the (run-dependent) planning time zeroed."""
    import json

    data = plan.to_dict()
    data["provenance"]["planning_time_s"] = 0.0
    return json.dumps(data, sort_keys=True)


@pytest.fixture(scope="session")
def residual_model():
    """The residual-block Keras model builder: `residual_model(filters=8)`."""
    return _residual_model


@pytest.fixture(scope="session")
def plan_json():
    """`plan_json(plan)`: compares plans for determinism (planning time zeroed)."""
    return _plan_json


@pytest.fixture(scope="session")
def tiny_mlp():
    """The builder of a 16-32-4 MLP (a fresh Keras model per call)."""
    return _tiny_mlp


@pytest.fixture(scope="module")
def tiny_graph():
    """The 16-32-4 MLP of `tiny_mlp` as a `ModelGraph`."""
    from autodist_keras.graph import ModelGraph

    return ModelGraph.from_keras(_tiny_mlp())


@pytest.fixture(scope="module")
def testbed():
    """The default CPU testbed: cpu0 owns core 0, cpu1 and cpu2 share core 1."""
    from autodist_keras.devices import Cluster

    return Cluster.cpu_testbed()


@pytest.fixture(scope="module")
def cnn():
    """`zoo.small_cnn` on 32x32x3 inputs, filters (16, 32), as a `ModelGraph`."""
    from autodist_keras.graph import ModelGraph
    from autodist_keras.graph import zoo

    return ModelGraph.from_keras(zoo.small_cnn(input_shape=(32, 32, 3), filters=(16, 32)))


@pytest.fixture(scope="module")
def wide():
    """Four 2048-wide Dense layers and a head, as a `ModelGraph`."""
    from autodist_keras.graph import ModelGraph

    return ModelGraph.from_keras(_mlp_model())


@pytest.fixture(scope="module")
def hetero():
    """The HeteroG testbed cluster (examples/clusters/hetero_testbed.yaml)."""
    from autodist_keras.devices import Cluster

    return Cluster.from_yaml("examples/clusters/hetero_testbed.yaml")


@pytest.fixture(scope="module")
def fan_out():
    """`a`'s 16 KiB-per-sample output read by two layers, `b1` and `b2` (the shape of a
    residual block's input), joined and classified, as a `ModelGraph`."""
    import keras

    from autodist_keras.graph import ModelGraph

    inputs = keras.Input((1024,), name="x")
    a = keras.layers.Dense(4096, name="a")(inputs)
    b1 = keras.layers.Dense(64, name="b1")(a)
    b2 = keras.layers.Dense(64, name="b2")(a)
    joined = keras.layers.Add(name="join")([b1, b2])
    outputs = keras.layers.Dense(10, name="out")(joined)
    return ModelGraph.from_keras(keras.Model(inputs, outputs, name="fan_out"))
