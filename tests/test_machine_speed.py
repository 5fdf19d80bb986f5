"""The machine-speed probe: real timings on this machine's cores."""

import os
import subprocess
import sys

import pytest

from autodist_keras.devices import Cluster
from autodist_keras.errors import EstimatorError
from autodist_keras.estimator import machine_speed

ALLOWED = sorted(os.sched_getaffinity(0))


def test_probe_times_every_core_and_restores_affinity():
    speed = machine_speed.probe(repeats=5)
    assert sorted(speed.per_core_s) == ALLOWED
    assert all(0 < t < 1.0 for t in speed.per_core_s.values())
    assert min(speed.per_core_s.values()) <= speed.seconds <= max(speed.per_core_s.values())
    assert sorted(os.sched_getaffinity(0)) == ALLOWED
    assert speed.to_dict()["repeats"] == 5


def _spinners(core, count):
    """Starts `count` processes that spin on `core`; returns them once all spin."""
    spinners = []
    try:
        for _ in range(count):
            spinners.append(subprocess.Popen(
                [sys.executable, "-c",
                 f"import os; os.sched_setaffinity(0, {{{core}}}); print('spinning', flush=True)\n"
                 "while True: pass"],
                stdout=subprocess.PIPE, text=True))
            assert spinners[-1].stdout.readline().strip() == "spinning"
    except BaseException:
        _stop(spinners)
        raise
    return spinners


def _stop(spinners):
    for spinner in spinners:
        spinner.kill()
        spinner.wait(timeout=10)


def test_a_busy_core_probes_slower():
    # Two processes spinning on the probed core leave the probe about a third
    # of it. The suite runs on two pytest workers, so the other worker's test
    # may load the same core during any one probe: quiet and busy probes
    # alternate three times and the fastest of each kind is compared. Even
    # with that worker on the core throughout, busy is about 2x quiet; one make-test
    # run in session 14 saw 1.45x, so the bar is 1.25x (still far from noise).
    core = ALLOWED[0]
    quiet, busy = [], []
    for _ in range(3):
        quiet.append(machine_speed.probe([core], repeats=10).seconds)
        spinners = _spinners(core, 2)
        try:
            busy.append(machine_speed.probe([core], repeats=10).seconds)
        finally:
            _stop(spinners)
    assert min(busy) > 1.25 * min(quiet), (busy, quiet)


def test_speed_ratio_ignores_differences_within_the_probes_noise():
    band = machine_speed.NOISE_BAND
    assert machine_speed.speed_ratio(2e-3, 1e-3) == pytest.approx(2.0)
    assert machine_speed.speed_ratio(0.5e-3, 1e-3) == pytest.approx(0.5)
    assert machine_speed.speed_ratio((1 + band / 2) * 1e-3, 1e-3) == 1.0
    assert machine_speed.speed_ratio((1 - band / 2) * 1e-3, 1e-3) == 1.0
    assert machine_speed.speed_ratio(None, 1e-3) == 1.0
    assert machine_speed.speed_ratio(1e-3, None) == 1.0


def test_cluster_cores():
    assert machine_speed.cluster_cores(Cluster.cpu_testbed()) == ALLOWED[:2]
    assert machine_speed.cluster_cores(Cluster.cpu_testbed(), ["node0/cpu0"]) == [0]
    assert machine_speed.cluster_cores(Cluster.resolve("2xV100")) is None


@pytest.mark.parametrize("kwargs, message", [
    ({"cores": []}, "at least one core"),
    ({"cores": [max(ALLOWED) + 64]}, "cores this process may use"),
    ({"repeats": 0}, "repeats must be an integer"),
])
def test_probe_errors(kwargs, message):
    with pytest.raises(EstimatorError, match=message):
        machine_speed.probe(**kwargs)
