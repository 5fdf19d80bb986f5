"""The PyTorch runtime across several GPUs: gradients through NCCL (needs 2+ GPUs).

Runs `benchmarks/gpu_check.py --sections multi_gpu` on the local GPUs (up to
4) and checks what issue #3 asks of NCCL: even, uneven and parameter-server
plans give the weights of plain Keras on one GPU after the same global
batches, with every gradient summed by NCCL; a worker that raises makes `fit`
raise `WorkerError` within 30 s, and rank 0's GPU still runs afterwards (a
collective left hanging by the dead worker would block it). On a machine
with fewer than 2 GPUs this test is skipped; the same code runs on two CPU
testbed devices in `test_gpu_check_benchmark_runs_small`.

GPU kernels for different batch sizes may sum in different orders, so the
weights are compared at rtol 1e-4 (the CPU tests use 1e-5).
"""

import json
import os
import subprocess
import sys

import keras
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _gpus():
    if keras.backend.backend() != "torch":
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


pytestmark = pytest.mark.skipif(
    _gpus() < 2, reason="needs KERAS_BACKEND=torch and at least 2 CUDA GPUs (NCCL)"
)


def test_nccl_plans_match_one_gpu_and_a_failing_worker_frees_the_gpu(tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"),
         "--sections", "multi_gpu", "--out", str(tmp_path)],
        cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"), capture_output=True,
        text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "gpu_check.json", encoding="utf-8") as f:
        multi = json.load(f)["sections"]["multi_gpu"]
    assert "error" not in multi, multi
    assert len(multi["devices"]) >= 2
    for label, plan in multi["plans"].items():
        assert plan["gradient_transport"] == "nccl", (label, plan)
        assert plan["world_size"] == len(multi["devices"])
        assert plan["max_relative_weight_difference"] < 1e-4, (label, plan)
    shares = multi["plans"]["uneven_allreduce"]["shares"]
    assert shares[0] > shares[1]
    failure = multi["failure"]
    assert failure["raised"] == "WorkerError", failure
    assert failure["seconds_to_raise"] < 30
    assert failure["rank0_gpu_usable_after"] is True
