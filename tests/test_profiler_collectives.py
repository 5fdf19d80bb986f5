"""Collective profiler: real torch.distributed (gloo) processes on loopback.

The measurement runs in spawned PyTorch processes whatever the Keras backend,
so the multi-process tests run once, under KERAS_BACKEND=torch. The refusal
of a script without a main guard runs under both: the script the children
would import loads the Keras backend it was started with.
"""

import math
import multiprocessing
import os
import signal
import subprocess
import sys

import keras
import pytest

from autodist_keras.devices import Cluster
from autodist_keras.errors import EstimatorError
from autodist_keras.estimator.comm import CommModel
from autodist_keras.estimator.profiler import CollectiveProfile
from autodist_keras.estimator.profiler import fit_alpha_beta
from autodist_keras.estimator.profiler import profile_collectives

pytest.importorskip("torch.distributed")
torch_only = pytest.mark.skipif(
    keras.backend.backend() != "torch",
    reason="backend-independent (spawned torch.distributed processes); run under torch only",
)

SIZES = (1 << 10, 1 << 15, 1 << 19)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_alpha_beta_fit_recovers_latency_and_bandwidth():
    sizes = [1e3, 1e4, 1e5, 1e6, 1e7]
    times = [20e-6 + s / 2e9 for s in sizes]
    fit = fit_alpha_beta(sizes, times)
    assert fit["latency_s"] == pytest.approx(20e-6, rel=1e-6)
    assert fit["bandwidth"] == pytest.approx(2e9, rel=1e-6)
    assert fit["max_rel_error"] < 1e-9
    flat = fit_alpha_beta([1e3, 1e6], [5e-5, 5e-5])
    assert flat["bandwidth"] == math.inf and flat["latency_s"] == pytest.approx(5e-5)
    with pytest.raises(EstimatorError, match="at least two distinct message sizes"):
        fit_alpha_beta([1e3], [1e-5])
    with pytest.raises(EstimatorError, match="positive and finite"):
        fit_alpha_beta([1e3, 1e4], [1e-5, 0.0])


@torch_only
def test_gloo_collectives_between_testbed_devices(tmp_path):
    cluster = Cluster.cpu_testbed()
    devices = ["node0/cpu0", "node0/cpu1"]
    before = set(multiprocessing.active_children())  # e.g. runtime workers kept by other tests
    links = profile_collectives(cluster, devices=devices, sizes=SIZES, warmup=1, repeats=3,
                                timeout_s=120, cache_dir=tmp_path)
    assert links.backend == "gloo" and links.devices == devices and not links.cached
    assert set(multiprocessing.active_children()) <= before
    assert set(links.samples) == {"allreduce", "broadcast", "p2p"}
    for op, by_label in links.samples.items():
        for per_size in by_label.values():
            assert sorted(int(s) for s in per_size) == list(SIZES)
            assert all(t > 0 and math.isfinite(t) for t in per_size.values())
    assert {f["op"] for f in links.fits} == {"allreduce", "broadcast", "p2p"}
    for fit in links.fits:
        assert fit["latency_s"] >= 0 and fit["bandwidth"] > 0
        assert math.isfinite(fit["max_rel_error"])
    p2p = links.fit("p2p", "node0/cpu1", "node0/cpu0")
    assert p2p["devices"] == devices
    ring = links.fit("allreduce")
    assert ring["ring_link_latency_s"] == pytest.approx(ring["latency_s"] / 2)
    # Measured links price transfers in the communication model.
    comm = CommModel(links.topology(cluster.topology))
    expected = p2p["latency_s"] + (1 << 20) / p2p["bandwidth"]
    assert comm.transfer_time(1 << 20, *devices) == pytest.approx(expected)
    # Pairs not measured fall back to the cluster's topology.
    assert comm.link("node0/cpu0", "node0/cpu2") == (
        cluster.topology.latency("node0/cpu0", "node0/cpu2"),
        cluster.topology.bandwidth("node0/cpu0", "node0/cpu2"),
    )
    again = profile_collectives(cluster, devices=devices, sizes=SIZES, warmup=1, repeats=3,
                                timeout_s=120, cache_dir=tmp_path)
    assert again.cached and again.fits == links.fits
    assert CollectiveProfile.from_dict(links.to_dict()).fits == links.fits
    assert "p2p" in links.summary()


@torch_only
def test_overrun_kills_the_workers_and_says_so(tmp_path):
    before = set(multiprocessing.active_children())  # e.g. runtime workers kept by other tests
    with pytest.raises(EstimatorError, match="did not finish within 0.2 s"):
        profile_collectives(Cluster.cpu_testbed(), devices=["node0/cpu0", "node0/cpu1"],
                            sizes=SIZES, timeout_s=0.2, use_cache=False)
    assert set(multiprocessing.active_children()) <= before


def test_invalid_collective_requests():
    cluster = Cluster.cpu_testbed()
    with pytest.raises(EstimatorError, match="at least two distinct message sizes"):
        profile_collectives(cluster, sizes=(1024,), use_cache=False)
    with pytest.raises(EstimatorError, match="ops must be a non-empty subset"):
        profile_collectives(cluster, ops=("gather",), use_cache=False)
    with pytest.raises(EstimatorError, match="Unknown device 'node0/cpu9'"):
        profile_collectives(cluster, devices=["node0/cpu9"], use_cache=False)


UNGUARDED_PROFILE = """
from autodist_keras.devices import Cluster
from autodist_keras.estimator.profiler import profile_collectives

links = profile_collectives(Cluster.cpu_testbed(), devices=["node0/cpu0", "node0/cpu1"],
                            sizes=(1 << 10, 1 << 15), warmup=1, repeats=1, timeout_s=60,
                            use_cache=False)
print("profiled")
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads child processes from /proc")
def test_script_without_main_guard_is_refused_before_anything_is_spawned(tmp_path,
                                                                        live_processes):
    """Spawned ranks import the main script: without the guard each would run it
    again and die in multiprocessing's bootstrapping, and the user saw
    `can only join a started process`, then an error that did not say why."""
    script = tmp_path / "links.py"
    script.write_text(UNGUARDED_PROFILE)
    env = dict(os.environ, PYTHONPATH=ROOT, AUTODIST_KERAS_CACHE=str(tmp_path / "cache"))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    finally:
        left = live_processes("session", proc.pid)  # the session's id is the script's pid
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    message = " ".join(stderr.split())
    assert proc.returncode != 0 and "profiled" not in stdout
    assert "EstimatorError: profile_collectives() starts child processes" in message, stderr[-3000:]
    assert ('Put the code that calls profile_collectives() under `if __name__ == "__main__":`'
            in message)
    assert f'Received: no `if __name__ == "__main__":` block in {script}' in message
    assert "bootstrapping phase" not in stderr  # no child was started
    assert "can only join a started process" not in stderr
    assert left == [], f"processes left behind: {left}"
