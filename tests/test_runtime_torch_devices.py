"""Where the PyTorch runtime puts a replica's tensors.

Keras's PyTorch backend puts every new tensor on the GPU whenever CUDA is
available. The runtime must put a CPU testbed device's replica on the CPU
anyway, and a GPU device's on its own GPU. This machine has no GPU, so the
tests stand Keras's "meta" device in for a default that is not the plan's
device: whatever the surrounding default, `pin` and `strategy.scope()` must
send tensors where the plan's device computes. `benchmarks/gpu_check.py`
checks the same on a real GPU.
"""

import json
import os
import subprocess
import sys

import keras
import pytest

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "torch", reason="PyTorch runtime tests run under KERAS_BACKEND=torch"
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU1 = {"name": "node0/cpu1", "node": "node0", "kind": "cpu", "index": 1,
        "cpu_affinity": None, "threads": None}


def _device_type():
    return keras.ops.zeros((2,)).device.type


def test_pin_sends_new_tensors_to_the_cpu_device_and_unpin_restores():
    from autodist_keras.backends.torch_device import pin
    from autodist_keras.backends.torch_device import unpin

    with keras.device("meta"):
        assert _device_type() == "meta"
        token = pin(CPU1)
        try:
            assert _device_type() == "cpu"
        finally:
            unpin(token)
        assert _device_type() == "meta"


@pytest.mark.parametrize("order", ["nested", "overlapping", "threads_only_between"])
def test_pins_that_end_out_of_order_restore_the_cores_and_threads_from_before(order):
    """Two fits in two threads: A pins, B pins (saving A's cores), A ends, B ends. The
    process stayed on A's one core, and a new Cluster.cpu_testbed() refused core 1."""
    import torch

    from autodist_keras.backends.torch_device import pin
    from autodist_keras.backends.torch_device import unpin
    from autodist_keras.devices import detect

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    before, threads = set(cores), torch.get_num_threads()
    first = dict(CPU1, cpu_affinity=[cores[0]], threads=1)
    second = dict(CPU1, cpu_affinity=[cores[1]], threads=1)
    if order == "threads_only_between":  # the later fit's device sets threads only
        a, b = pin(first), pin(dict(CPU1, threads=1))
        unpin(a)
        unpin(b)
        assert os.sched_getaffinity(0) == before and torch.get_num_threads() == threads
        return
    a = pin(first)
    b = pin(second)
    try:
        assert os.sched_getaffinity(0) == {cores[1]} and torch.get_num_threads() == 1
        assert set(detect.available_cores()) == before  # what a new testbed may use
    finally:
        if order == "nested":
            unpin(b)
            assert os.sched_getaffinity(0) == {cores[0]}  # back to the outer fit's pin
            unpin(a)
        else:
            unpin(a)
            assert os.sched_getaffinity(0) == {cores[1]}  # B goes on where it was pinned
            unpin(b)
    assert os.sched_getaffinity(0) == before
    assert torch.get_num_threads() == threads
    assert set(detect.available_cores()) == before


def test_a_pin_that_keeps_the_thread_count_keeps_it_after_an_earlier_pin_ends():
    """Fits in two threads: A sets one thread, B's device wants one too (no change, so
    set_num_threads is not called). When A ended first, B was put back on the
    process's threads while it still ran."""
    import torch

    from autodist_keras.backends.torch_device import pin
    from autodist_keras.backends.torch_device import unpin

    threads = torch.get_num_threads()
    if threads < 2:
        pytest.skip("needs a process with two or more threads")
    a = pin(dict(CPU1, threads=1))
    b = pin(dict(CPU1, threads=1))
    try:
        unpin(a)
        assert torch.get_num_threads() == 1  # B still runs
    finally:
        unpin(b)
    assert torch.get_num_threads() == threads


def test_keras_device_name_per_kind():
    import torch

    from autodist_keras.backends.torch_device import keras_device_name

    assert keras_device_name(CPU1) == "cpu"
    gpu = dict(CPU1, name="node0/gpu1", kind="gpu")
    assert keras_device_name(gpu) == ("cuda:1" if torch.cuda.is_available() else None)
    assert keras_device_name(None) is None


def test_check_model_device_names_both_devices():
    from autodist_keras.backends.torch_device import check_model_device
    from autodist_keras.backends.torch_device import variables_device
    from autodist_keras.errors import BackendError

    with keras.device("meta"):
        model = keras.Sequential([keras.Input((3,)),
                                  keras.layers.Dense(2, kernel_initializer="zeros")])
    assert variables_device(model) == "meta"
    with pytest.raises(BackendError, match=r"Rank 2 runs on 'node0/cpu1' \(cpu\) but its "
                                           r"model's variables are on meta.*Received"):
        check_model_device(model, CPU1, 2)
    cpu_model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    check_model_device(cpu_model, CPU1, 0)  # same device: no error


def test_scope_builds_the_model_on_rank_zeros_device_whatever_the_default():
    import numpy as np

    from autodist_keras import AutoStrategy
    from autodist_keras.backends.torch_device import variables_device

    strategy = AutoStrategy(strategy="proportional", cluster="cpu_testbed")
    with keras.device("meta"):
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
            model.compile(optimizer="sgd", loss="mse")
    assert variables_device(model) == "cpu"
    x = np.ones((12, 4), "float32")
    history = model.fit(x, np.zeros((12, 3), "float32"), batch_size=6, verbose=0)
    assert len(history.history["loss"]) == 1
    assert strategy.adapter.last_run["world_size"] == 3


@pytest.mark.slow
def test_gpu_check_benchmark_runs_small(tmp_path):
    """`benchmarks/gpu_check.py --small` on this CPU machine: every section runs
    (one after another in one fresh process, as `--small` does)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--small",
         "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    with open(tmp_path / "gpu_check.json", encoding="utf-8") as f:
        sections = json.load(f)["sections"]
    for name in ("detect", "fit", "testbed", "steps", "layers", "multi_gpu"):
        assert summary[name] == "ok", sections[name]
    assert sections["detect"]["devices"][0]["kind"] == "cpu"
    probe = sections["detect"]["host_dispatch_probe"]
    # A Keras layer call costs more host time than one bare PyTorch op.
    assert 0 < probe["torch_add_s"] < probe["keras_dense_call_s"] < 0.05
    assert sections["fit"]["max_relative_weight_difference"] < 1e-5
    assert sections["fit"]["auto_variables_on"] == "cpu"
    assert sections["testbed"]["rank0_variables_on"] == "cpu"
    assert sections["testbed"]["plan_devices"] == ["node0/cpu0", "node0/cpu1", "node0/cpu2"]
    assert sections["testbed"]["max_relative_weight_difference_vs_cpu"] < 1e-4
    assert len(sections["steps"]["cases"]) == 2
    assert all(r["measured_s"] > 0 for r in sections["steps"]["cases"])
    assert sections["steps"]["analytic_mape_pct"] is not None
    assert sections["layers"]["layer_phases"] > 0
    assert summary["steps_analytic_mape_pct"] == sections["steps"]["analytic_mape_pct"]
    # multi_gpu without 2 GPUs: the same code on two CPU testbed devices.
    multi = sections["multi_gpu"]
    assert summary["multi_gpu"] == "ok", multi
    assert multi["devices"] == ["node0/cpu0", "node0/cpu1"]
    assert multi["plans"]["uneven_allreduce"]["shares"] == [16, 8]
    for plan in multi["plans"].values():
        assert plan["gradient_transport"] == "shared_memory"
        assert plan["max_relative_weight_difference"] < 1e-5
    assert multi["ddp_backend"] == "gloo" and multi["ddp_median_step_s"] > 0
    assert multi["failure"]["raised"] == "WorkerError"
    assert "injected failure in rank 1" in multi["failure"]["message"]
    assert multi["failure"]["seconds_to_raise"] < 30


def _cuda_gpus():
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(_cuda_gpus() >= 2, reason="this machine has the cluster's GPUs")
@pytest.mark.parametrize("name", ["data_parallel", "auto"])
def test_a_gpu_cluster_that_is_not_here_is_an_error_not_a_silent_cpu_run(name):
    import numpy as np

    from autodist_keras import AutoStrategy
    from autodist_keras.errors import BackendError

    strategy = AutoStrategy(name, cluster="2xV100")
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
        model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(BackendError, match=r"this machine has \d CUDA GPU\(s\).*plan_for"):
        model.fit(np.ones((32, 8), "float32"), np.ones((32, 4), "float32"), batch_size=16,
                  verbose=0)
    assert "worker_pids" not in strategy.adapter.last_run
    # Planning for that cluster (without training) works, as with the CLI.
    plan = AutoStrategy(name, cluster="2xV100").plan_for(model, 256)
    assert any("not on this machine" in note for note in plan.notes)


def test_under_torchrun_auto_plans_one_replica_per_process(monkeypatch):
    from autodist_keras import AutoStrategy
    from autodist_keras import Cluster
    from autodist_keras.graph import zoo

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.delenv("AUTODIST_KERAS_WORKER_RANK", raising=False)
    strategy = AutoStrategy("auto", cluster=Cluster.cpu_testbed(), estimator="simulator")
    plan = strategy.plan_for(zoo.mlp(input_dim=8, hidden=(16,), name="torchrun_auto"), 48)
    assert len(plan.replicas) == 3
    reasons = [c.reason for c in strategy.candidates if c.executable is False]
    assert any("WORLD_SIZE=3" in r for r in reasons)
