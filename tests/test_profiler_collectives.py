"""Collective profiler: real torch.distributed (gloo) processes on loopback.

The measurement runs in spawned PyTorch processes whatever the Keras backend,
so the multi-process tests run once, under KERAS_BACKEND=torch. The refusal
of a script without a main guard runs under both: the script the children
would import loads the Keras backend it was started with.
"""

import dataclasses
import json
import math
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import keras
import pytest

from autodist_keras.devices import Cluster
from autodist_keras.errors import EstimatorError
from autodist_keras.estimator.comm import CommModel
from autodist_keras.estimator.learned_cost import LearnedCostModel
from autodist_keras.estimator.profiler import CollectiveProfile
from autodist_keras.estimator.profiler import ProfileCache
from autodist_keras.estimator.profiler import fit_alpha_beta
from autodist_keras.estimator.profiler import profile_collectives
from autodist_keras.estimator.profiler import write_json_atomic

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


def _strict_json(text):
    """Parses `text` as standard JSON (RFC 8259): NaN and Infinity are errors."""
    def refuse(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


def test_unbounded_bandwidth_is_null_in_json_and_reads_back_unbounded(tmp_path):
    """A link whose time did not grow with size got bandwidth inf, which Python's
    json wrote as `Infinity` (JavaScript's JSON.parse rejects it) into the
    collective cache, the learned cost model and `profile --out`."""
    pair = ["node0/cpu0", "node0/cpu1"]
    sizes = [1 << 10, 1 << 20]
    flat = fit_alpha_beta(sizes, [5e-5, 5e-5])
    assert flat["bandwidth"] == math.inf
    ring = dict(flat, op="allreduce", devices=pair, ring_link_latency_s=2.5e-5,
                ring_link_bandwidth=math.inf)
    samples = {str(s): 5e-5 for s in sizes}
    links = CollectiveProfile(devices=pair, backend="gloo", sizes=sizes,
                              samples={"allreduce": {"all": samples},
                                       "p2p": {"|".join(pair): samples}},
                              fits=[dict(flat, op="p2p", devices=pair), ring])
    data = _strict_json(json.dumps(links.to_dict(), allow_nan=False))
    assert data["fits"][0]["bandwidth"] is None and data["fits"][1]["ring_link_bandwidth"] is None
    assert CollectiveProfile.from_dict(data).fits == links.fits  # null reads back as inf
    # Files written before (Python's `Infinity`) read the same.
    legacy = json.loads(json.dumps(dict(dataclasses.asdict(links),
                                        schema="autodist_keras.collective_profile/1")))
    assert CollectiveProfile.from_dict(legacy).fits == links.fits

    cache = ProfileCache(tmp_path / "cache")
    fields = {"kind": "collective", "devices": pair}
    cache.put(fields, links.to_dict())
    _strict_json(open(cache.path(fields)).read())
    assert CollectiveProfile.from_dict(cache.get(fields)).fits == links.fits

    cluster = Cluster.cpu_testbed()
    path = tmp_path / "cost.json"
    text = LearnedCostModel(cluster, links=links).to_json(path)
    _strict_json(text)
    _strict_json(path.read_text())
    again = LearnedCostModel.from_json(path, cluster)
    assert again.links.fits == links.fits
    assert again.transfer_time(1 << 20, *pair) == pytest.approx(5e-5)  # latency only

    # The writers refuse NaN and Infinity instead of writing them, naming the field.
    with pytest.raises(EstimatorError, match=(
            r"Cannot write .*bad\.json: field `fits\[0\]\.bandwidth` is inf, which standard "
            r"JSON cannot hold.*Received: fits\[0\]\.bandwidth=inf$")):
        write_json_atomic(tmp_path / "bad.json", dataclasses.asdict(links))
    assert not (tmp_path / "bad.json").exists()


PARENT = """
from autodist_keras.devices import Cluster
from autodist_keras.estimator.profiler import profile_collectives

if __name__ == "__main__":
    profile_collectives(Cluster.cpu_testbed(), devices=["node0/cpu0", "node0/cpu1"],
                        sizes=(1 << 10, 1 << 20), warmup=1, repeats=100000, timeout_s=600,
                        use_cache=False)
"""


def _spawned_children(live_processes, pid):
    children = []
    for child in live_processes("ppid", pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    children.append(child)
        except OSError:
            pass
    return children


@torch_only
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads processes from /proc")
def test_workers_exit_when_the_profiling_process_is_killed(tmp_path, live_processes):
    """Daemon children are cleaned up only when the parent exits normally: after a
    SIGKILL (or SIGTERM) of `autodist-keras profile --collectives` its workers
    and the resource tracker went on for about ten minutes."""
    script = tmp_path / "links.py"
    script.write_text(PARENT)
    env = dict(os.environ, PYTHONPATH=ROOT, TMPDIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while len(_spawned_children(live_processes, proc.pid)) < 2:
            assert proc.poll() is None, "the profiling process ended early"
            assert time.monotonic() < deadline, "the workers did not start"
            time.sleep(0.2)
        time.sleep(3)  # into the measurement
        workers = _spawned_children(live_processes, proc.pid)
        assert len(workers) == 2 and proc.poll() is None
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        deadline = time.monotonic() + 10
        while live_processes("session", proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = live_processes("session", proc.pid)  # the session's id is the parent's pid
        assert left == [], f"processes left behind 10 s after the parent died: {left}"
    finally:
        for pid in live_processes("session", proc.pid):
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@torch_only
def test_cli_trains_the_cost_model_with_the_links_it_measured(tmp_path):
    """`profile --collectives --train-cost-model` wrote "links": null."""
    from autodist_keras.estimator import profiler

    cost, out = tmp_path / "cost.json", tmp_path / "profile.json"
    assert profiler.profile_main([
        "--model", "mlp", "--cluster", "cpu_testbed", "--batch-sizes", "4,8",
        "--warmup", "1", "--repeats", "2", "--collectives",
        "--collective-sizes", "1024,32768", "--train-cost-model", str(cost),
        "--out", str(out), "--cache-dir", str(tmp_path / "cache"), "--quiet",
    ]) == 0
    measured = _strict_json(out.read_text())["collectives"]
    model = _strict_json(cost.read_text())
    assert measured is not None and model["links"] == measured
    links = LearnedCostModel.from_json(cost, Cluster.cpu_testbed()).links
    assert links.fits == CollectiveProfile.from_dict(measured).fits
