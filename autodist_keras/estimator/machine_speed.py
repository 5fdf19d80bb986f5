"""How fast this machine runs right now: a short fixed CPU workload, timed.

Measured step times on a shared machine drift from day to day (on the
project's 2-core VM the same cases ran 2.3-3.4x faster on 3 December 2026
than on 2 December), and a learned estimator trained on one day's
measurements then mispredicts every step on another day by that factor.
`probe()` times a fixed single-threaded workload (float32 matmuls and tanh,
NumPy with one BLAS thread) on each of the given cores. Measurements record
it beside their step times, the learned estimator keeps the probe time of
its training data, and predictions for devices of this machine are scaled
by `probe now / probe then` (`LearnedEstimator.speed_factor`) when that
ratio lies outside the probe's own noise (`NOISE_BAND`).

The probe times blocks of 5 workload units (about 5.5 ms each) and reports
the median of the blocks' mean unit time: a process sharing the core for
the whole probe shows (each block spans several time slices), a stall that
hits one block does not. It takes about 40 ms per core.

Example:

```python
speed = probe(cores=[0, 1])
print(speed.seconds, speed.per_core_s)
```
"""

import dataclasses
import os
import statistics
import time

from autodist_keras.errors import EstimatorError

# One workload unit: 8 chained (192 x 192) @ (192 x 192) float32 matmuls with a
# tanh each, about 1.1 ms on one core of the project's VM.
_SIZE = 192
_CHAIN = 8
DEFAULT_REPEATS = 35
# Units are timed in blocks of this many; a core's figure is the median block mean.
BLOCK = 5
# Relative band within which two probes count as the same machine speed. On
# the project's VM one probe varies by 2% (coefficient of variation, 8 probes
# of an idle machine) to 7% (probes before each measurement pass, 108 per
# backend); the median probes of the 36 records of one sitting span
# 0.96-1.12x their median. A ratio inside 1 +/- NOISE_BAND is noise.
NOISE_BAND = 0.15


@dataclasses.dataclass(frozen=True)
class MachineSpeed:
    """The probe's result.

    Args:
        seconds: Median over the probed cores of the time of one workload
            unit (smaller is faster).
        per_core_s: That time for each probed core: the median over blocks
            of `BLOCK` units of the block's mean.
        repeats: Workload units timed per core.
    """

    seconds: float
    per_core_s: dict
    repeats: int

    def to_dict(self):
        return {"seconds": self.seconds,
                "per_core_s": {str(k): v for k, v in self.per_core_s.items()},
                "repeats": self.repeats}


def _unit(a):
    import numpy as np

    b = a
    for _ in range(_CHAIN):
        b = np.tanh((b @ a) * 0.01)
    return b


def probe(cores=None, repeats=DEFAULT_REPEATS):
    """Times the fixed workload on each core.

    Args:
        cores: Core ids to probe, one after another (the calling thread is
            pinned to each in turn and its affinity restored). Default: the
            cores this process may run on.
        repeats: Workload units timed per core (after one untimed unit).

    Returns:
        A `MachineSpeed`.

    Raises:
        EstimatorError: For an empty core list, a core this process may not
            use, or `repeats` < 1.
    """
    import numpy as np
    from threadpoolctl import threadpool_limits

    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise EstimatorError(f"repeats must be an integer >= 1. Received: repeats={repeats!r}")
    can_pin = hasattr(os, "sched_getaffinity")
    allowed = sorted(os.sched_getaffinity(0)) if can_pin else [None]
    cores = allowed if cores is None else [int(c) for c in cores]
    if not cores:
        raise EstimatorError("probe needs at least one core. Received: cores=[]")
    if can_pin:
        outside = [c for c in cores if c not in allowed]
        if outside:
            raise EstimatorError(
                f"probe can only pin to cores this process may use ({allowed}). "
                f"Received: cores={cores}"
            )
    a = np.random.default_rng(0).standard_normal((_SIZE, _SIZE)).astype(np.float32)
    per_core = {}
    with threadpool_limits(1):
        for core in cores:
            if core is not None:
                os.sched_setaffinity(0, {core})
            try:
                _unit(a)
                block_means = []
                for block in range(0, repeats, BLOCK):
                    units = min(BLOCK, repeats - block)
                    start = time.perf_counter()
                    for _ in range(units):
                        _unit(a)
                    block_means.append((time.perf_counter() - start) / units)
                per_core[core if core is not None else 0] = float(statistics.median(block_means))
            finally:
                if core is not None:
                    os.sched_setaffinity(0, set(allowed))
    return MachineSpeed(seconds=float(statistics.median(per_core.values())),
                        per_core_s=per_core, repeats=repeats)


def speed_ratio(probe_s, reference_s):
    """How much slower the machine ran at `probe_s` than at `reference_s`.

    Args:
        probe_s: A probe's `seconds` (now, or one measurement's).
        reference_s: The reference probe's `seconds`.

    Returns:
        `probe_s / reference_s`, or 1.0 when either is unknown or the ratio
        lies within `1 +/- NOISE_BAND` (the probe's own noise: scaling by it
        would add error, not remove it).
    """
    if not probe_s or not reference_s:
        return 1.0
    ratio = float(probe_s) / float(reference_s)
    return 1.0 if abs(ratio - 1.0) <= NOISE_BAND else ratio


def cluster_cores(cluster, devices=None):
    """The cores of this machine that a cluster's CPU devices own, or None.

    A cluster whose devices (or the named ones) are CPU testbed devices
    with CPU affinities runs on this machine's cores, so this machine's
    speed applies to it; any GPU or unpinned device makes it None.
    """
    names = devices or cluster.names
    cores = set()
    for name in names:
        device = cluster.device(name)
        if device.kind == "gpu" or not device.cpu_affinity:
            return None
        cores.update(int(c) for c in device.cpu_affinity)
    if hasattr(os, "sched_getaffinity") and not cores <= os.sched_getaffinity(0):
        return None
    return sorted(cores)
