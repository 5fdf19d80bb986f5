"""Batch shares that balance measured per-replica step costs.

A replica's step costs its device `fixed_s + per_sample_s * samples`: a part
that does not shrink with its share (Keras's per-layer dispatch, the
optimizer update on every parameter, copying and all-reducing the gradients)
and a part that grows with it. Devices that share CPU cores (the CPU
testbed's node0/cpu1 and node0/cpu2 on core 1) pay the fixed part once per
replica on the same core, so shares proportional to speed leave that core the
bottleneck. `balanced_shares` instead chooses shares that minimise the
busiest *resource* (a set of devices sharing cores, or one device alone):

    minimise   max over resources r of  sum_{i in r} (fixed_i + per_sample_i * n_i)
    subject to sum_i n_i = batch_size,  1 <= n_i <= cap_i

a linear program (`scipy.optimize.linprog`), rounded to whole samples.
`fit_step_costs` fits the two numbers per device from measured runs (e.g. the
per-rank CPU time per step of an even and a proportional run).

On the testbed with every replica costing `f + p * n` of CPU time and a
global batch `B` (`x = f / (p * B)`), the balanced shares are
`B * (1 + x) / 2` on cpu0 and `B * (1 - x) / 4` on cpu1 and cpu2: both cores
then carry `1.5 f + p B / 2`, against `2 f + 2 p B / 3` on core 1 for even
shares (a ratio of exactly 4/3 for any `f`) and `2 f + p B / 2` for shares
proportional to speed.

Example:

```python
costs = fit_step_costs([
    ("node0/cpu0", 32, 0.095), ("node0/cpu0", 48, 0.128),
    ("node0/cpu1", 32, 0.094), ("node0/cpu1", 24, 0.078),
    ("node0/cpu2", 32, 0.095), ("node0/cpu2", 24, 0.077),
])
shares = balanced_shares(Cluster.cpu_testbed(), ["node0/cpu0", "node0/cpu1",
                         "node0/cpu2"], costs, batch_size=96)
```
"""

import dataclasses
import json
import math
import os
import warnings

from autodist_keras.errors import PlanError


@dataclasses.dataclass(frozen=True)
class StepCost:
    """What one replica's training step costs its device (measured or fitted).

    Args:
        fixed_s: Seconds per step that do not depend on the replica's share.
        per_sample_s: Seconds per sample of the replica's share.
    """

    fixed_s: float
    per_sample_s: float

    def cost_s(self, samples):
        """The step cost of a replica with `samples` samples, in seconds."""
        return self.fixed_s + self.per_sample_s * samples

    def to_dict(self):
        """Returns `{"fixed_s": ..., "per_sample_s": ...}` (JSON-serialisable)."""
        return {"fixed_s": float(self.fixed_s), "per_sample_s": float(self.per_sample_s)}

    @classmethod
    def from_dict(cls, d):
        """Builds a `StepCost` from `to_dict()` output.

        Raises:
            PlanError: If a key is missing or a value is not a finite,
                non-negative number.
        """
        if not isinstance(d, dict) or set(d) != {"fixed_s", "per_sample_s"}:
            raise PlanError(
                "A step cost is a dict with exactly the keys 'fixed_s' and 'per_sample_s' "
                f"(seconds). Received: {d!r}"
            )
        return cls(_seconds(d["fixed_s"], "fixed_s"), _seconds(d["per_sample_s"], "per_sample_s"))


def _seconds(value, what):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value < 0:
        raise PlanError(
            f"{what} must be a finite, non-negative number of seconds. Received: {value!r}"
        )
    return float(value)


def as_step_cost(value, device="?"):
    """Turns a `StepCost`, a `(fixed_s, per_sample_s)` pair or a dict into a `StepCost`.

    Raises:
        PlanError: For anything else, or negative or non-finite values.
    """
    if isinstance(value, StepCost):
        return StepCost(_seconds(value.fixed_s, "fixed_s"),
                        _seconds(value.per_sample_s, "per_sample_s"))
    if isinstance(value, dict):
        return StepCost.from_dict(value)
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return StepCost(_seconds(value[0], "fixed_s"), _seconds(value[1], "per_sample_s"))
    raise PlanError(
        f"The step cost of {device!r} must be a StepCost, a (fixed_s, per_sample_s) pair or "
        f"a dict with 'fixed_s' and 'per_sample_s'. Received: {value!r}"
    )


def load_step_costs(value):
    """Reads step costs from a dict or the path of a JSON file.

    The file holds `{device: {"fixed_s": ..., "per_sample_s": ...}}`, or an
    object with that dict under `"step_costs"` (as `benchmarks/
    hetero_testbed.py` writes it).

    Args:
        value: A dict `{device: StepCost | (fixed_s, per_sample_s) | dict}` or
            a path to a JSON file.

    Returns:
        A dict `{device: StepCost}`.

    Raises:
        PlanError: If the file cannot be read or a value is malformed.
    """
    if isinstance(value, (str, os.PathLike)):
        try:
            with open(value, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            raise PlanError(
                f"step_costs: could not read the JSON file {os.fspath(value)!r} ({e}). Pass a "
                "dict or the path of a JSON file {device: {fixed_s, per_sample_s}}. "
                f"Received: {os.fspath(value)!r}"
            ) from None
        if isinstance(data, dict) and isinstance(data.get("step_costs"), dict):
            data = data["step_costs"]
        value = data
    if not isinstance(value, dict) or not value:
        raise PlanError(
            "step_costs must be a non-empty dict {device: (fixed_s, per_sample_s)} or the "
            f"path of a JSON file holding one. Received: {value!r}"
        )
    return {str(device): as_step_cost(cost, device) for device, cost in value.items()}


def step_costs_to_dict(step_costs):
    """`{device: StepCost}` as plain JSON-serialisable dicts."""
    return {d: as_step_cost(c, d).to_dict() for d, c in step_costs.items()}


def _observation(obs):
    if isinstance(obs, dict):
        try:
            return obs["device"], obs["samples"], obs["cost_s"]
        except KeyError:
            pass
    elif isinstance(obs, (tuple, list)) and len(obs) == 3:
        return tuple(obs)
    raise PlanError(
        "An observation is a dict {'device', 'samples', 'cost_s'} or a tuple "
        f"(device, samples, cost_s). Received: {obs!r}"
    )


def fit_step_costs(observations, tied=None):
    """Fits `cost = fixed_s + per_sample_s * samples` per device by least squares.

    The fit is a non-negative least-squares line (`scipy.optimize.nnls`). An
    intercept that would come out negative is 0, with the line through the
    origin. A slope that would come out zero or negative (the cost does not
    grow with the share: noise, or shares too close together) cannot say how
    the device's cost scales, and a zero per-sample cost would let balanced
    shares pile every sample on that device; the device then gets the line
    through the origin instead (cost proportional to its share, i.e. its
    measured speed) and a warning says so.

    Args:
        observations: Measured steps, each a dict `{"device", "samples",
            "cost_s"}` or a tuple `(device, samples, cost_s)`: the device's
            share in samples and what one step cost it in seconds (e.g. the
            median CPU time per step of its replica).
        tied: Optional lists of devices known to cost the same (e.g. from
            `interchangeable_devices`: the testbed's cpu1 and cpu2, one
            thread each on core 1). Each list gets one line fitted to all
            its devices' observations, so noise cannot make one of them look
            cheaper per sample than the other.

    Returns:
        A dict `{device: StepCost}`, in order of first appearance.

    Raises:
        PlanError: If an observation is malformed, or a device (or tied
            list) has fewer than two distinct sample counts.

    Example:

    >>> fit_step_costs([("a", 10, 0.03), ("a", 20, 0.05)])["a"]
    StepCost(fixed_s=0.01, per_sample_s=0.002)
    """
    import numpy as np
    from scipy.optimize import nnls

    by_device = {}
    for obs in observations:
        device, samples, cost = _observation(obs)
        if (not isinstance(samples, (int, float)) or isinstance(samples, bool)
                or not math.isfinite(samples) or samples <= 0):
            raise PlanError(
                f"samples must be a positive number. Received: {samples!r} for {device!r}"
            )
        _seconds(cost, "cost_s")
        by_device.setdefault(str(device), []).append((float(samples), float(cost)))
    if not by_device:
        raise PlanError("fit_step_costs needs observations. Received: []")
    pooled = {d: list(points) for d, points in by_device.items()}
    for group in tied or ():
        members = [str(d) for d in group if str(d) in by_device]
        points = [p for d in members for p in by_device[d]]
        for d in members:
            pooled[d] = points
    fitted = {}
    for device, points in pooled.items():
        counts = sorted({n for n, _ in points})
        if len(counts) < 2:
            raise PlanError(
                f"A step-cost line for {device!r} needs runs with at least two different "
                "shares (e.g. an even and a proportional run). Received: sample counts "
                f"{counts}"
            )
        a = np.array([[1.0, n] for n, _ in points])
        b = np.array([c for _, c in points])
        (fixed, per_sample), _ = nnls(a, b)
        if per_sample <= 0:
            fixed = 0.0
            per_sample = float(a[:, 1] @ b) / float(a[:, 1] @ a[:, 1])
            warnings.warn(
                f"fit_step_costs: the measured cost of {device!r} does not grow with its share "
                f"(points {sorted(points)}), so its cost is taken as proportional to its share "
                f"({per_sample * 1e3:.4g} ms per sample, no fixed part): its measured speed. "
                "Measure more steps, or shares further apart, to fit a fixed part.",
                stacklevel=2,
            )
        fitted[device] = StepCost(round(float(fixed), 12), round(float(per_sample), 12))
    return fitted


def interchangeable_devices(cluster, devices):
    """Lists of CPU-testbed devices that are the same device in the same situation.

    Testbed devices of one node with the same cores and thread count (the
    default testbed's node0/cpu1 and node0/cpu2) cost a replica the same, so
    their step costs can be fitted as one line (`fit_step_costs(...,
    tied=...)`). Devices without a CPU affinity (GPUs) are never tied here:
    which of them drives the step, or which link it sits on, may differ; tie
    them explicitly when you know they match.

    Args:
        cluster: The `Cluster`.
        devices: Device names.

    Returns:
        A list of lists of device names with two or more members each.
    """
    groups = {}
    for name in devices:
        d = cluster.device(name)
        if d.cpu_affinity is None:
            continue
        key = (d.node, d.model, tuple(sorted(d.cpu_affinity)), d.threads)
        groups.setdefault(key, []).append(name)
    return [g for g in groups.values() if len(g) > 1]


def resources(cluster, devices):
    """Groups devices that share CPU cores (transitively); other devices stand alone.

    Args:
        cluster: The `Cluster`.
        devices: Device names.

    Returns:
        A list of lists of indices into `devices`, in order of first device.
    """
    parent = list(range(len(devices)))

    def root(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner = {}
    for i, name in enumerate(devices):
        for core in cluster.device(name).cpu_affinity or ():
            if core in owner:
                parent[root(i)] = root(owner[core])
            else:
                owner[core] = i
    groups = {}
    for i in range(len(devices)):
        groups.setdefault(root(i), []).append(i)
    return sorted(groups.values(), key=lambda g: g[0])


def busiest_load_s(cluster, devices, step_costs, shares):
    """The largest summed step cost of any resource under some shares (predicted).

    Args:
        cluster: The `Cluster`.
        devices: Device names, in `shares` order.
        step_costs: Dict `{device: StepCost | (fixed_s, per_sample_s) | dict}`.
        shares: Samples per device.

    Returns:
        Seconds: the busiest resource's `sum(fixed_s + per_sample_s * n)`.
    """
    devices = list(devices)
    costs = [as_step_cost(step_costs[d], d) for d in devices]
    return max(sum(costs[i].cost_s(shares[i]) for i in group)
               for group in resources(cluster, devices))


def balanced_shares(cluster, devices, step_costs, batch_size, caps=None):
    """Shares that minimise the busiest resource's summed step cost.

    A resource is a set of devices sharing CPU cores (overlapping
    `cpu_affinity`, transitively) or one device alone (GPUs, devices without
    an affinity). The continuous shares come from a linear program; among
    the optimal ones, a second program makes the devices of one resource
    finish together (minimises the largest single-device cost). They are
    then rounded to whole samples by largest remainder, keeping the sum and
    the bounds.

    Args:
        cluster: The `Cluster`.
        devices: Device names, in plan order.
        step_costs: Dict `{device: StepCost | (fixed_s, per_sample_s) | dict}`
            with an entry for every device.
        batch_size: Global batch size.
        caps: Optional list (in `devices` order) or dict of the most samples
            each device may take (e.g. its memory capacity); default none.

    Returns:
        A list of ints in `devices` order, each >= 1 and <= its cap, summing
        to `batch_size`.

    Raises:
        PlanError: If a device has no cost, or no shares fit the caps.

    Example:

    ```python
    shares = balanced_shares(Cluster.cpu_testbed(), cluster.names,
                             {d: (0.03, 0.002) for d in cluster.names}, 96)
    ```
    """
    import numpy as np
    from scipy.optimize import linprog

    devices = list(devices)
    missing = [d for d in devices if d not in step_costs]
    if missing:
        raise PlanError(
            f"step_costs has no entry for devices {missing}; give every device of the plan "
            f"a (fixed_s, per_sample_s) cost. Received: {sorted(step_costs)}"
        )
    costs = [as_step_cost(step_costs[d], d) for d in devices]
    n = len(devices)
    if isinstance(caps, dict):
        caps = [caps[d] for d in devices]
    upper = [float(batch_size)] * n if caps is None else [float(min(c, batch_size)) for c in caps]
    if any(u < 1 for u in upper) or sum(upper) < batch_size or batch_size < n:
        raise PlanError(
            f"No shares of a batch of {batch_size} give every device at least one sample "
            "within its cap. Use a batch size between the number of devices and the sum of "
            f"the caps, or fewer devices. Received: caps="
            f"{dict(zip(devices, caps)) if caps is not None else None}, batch_size={batch_size}"
        )
    groups = resources(cluster, devices)
    # Variables: n_0 .. n_{k-1}, T. Scale seconds so the solver sees numbers near 1.
    scale = max([c.cost_s(batch_size) for c in costs] + [1e-12])
    bounds = [(1.0, u) for u in upper] + [(0.0, None)]
    a_eq = [[1.0] * n + [0.0]]
    b_eq = [float(batch_size)]

    def load_rows(members_list):
        rows, rhs = [], []
        for members in members_list:
            row = [0.0] * (n + 1)
            for i in members:
                row[i] = costs[i].per_sample_s / scale
            row[n] = -1.0
            rows.append(row)
            rhs.append(-sum(costs[i].fixed_s for i in members) / scale)
        return rows, rhs

    a_ub, b_ub = load_rows(groups)
    objective = [0.0] * n + [1.0]
    first = linprog(objective, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=b_eq, bounds=bounds,
                    method="highs")
    if first.status != 0:
        raise PlanError(
            f"The share balancing linear program failed ({first.message}). Check the step "
            f"costs and caps. Received: step_costs={step_costs_to_dict(dict(zip(devices, costs)))}"
            f", caps={caps}"
        )
    best = float(first.x[n])
    shared = [g for g in groups if len(g) > 1]
    result = first
    if shared:
        # Second stage: keep every resource within the optimum and make the
        # devices of each shared resource finish together: variables n_i and
        # one t_r per shared resource (its largest device cost); minimise sum t_r.
        m = len(shared)
        a_ub2, b_ub2 = [], []
        for row, rhs in zip(a_ub, b_ub):
            a_ub2.append(row[:n] + [0.0] * m)
            b_ub2.append(rhs + best * (1 + 1e-9) + 1e-12)
        for r, members in enumerate(shared):
            for i in members:
                row = [0.0] * (n + m)
                row[i] = costs[i].per_sample_s / scale
                row[n + r] = -1.0
                a_ub2.append(row)
                b_ub2.append(-costs[i].fixed_s / scale)
        second = linprog([0.0] * n + [1.0] * m, A_ub=a_ub2, b_ub=b_ub2,
                         A_eq=[[1.0] * n + [0.0] * m], b_eq=b_eq,
                         bounds=bounds[:n] + [(None, None)] * m, method="highs")
        if second.status == 0:
            result = second
    exact = np.asarray(result.x[:n], dtype=float)
    return _round_shares(exact, upper, batch_size)


def _round_shares(exact, upper, batch_size):
    """Largest-remainder rounding within `[1, upper]` that keeps the sum."""
    parts = [max(1, min(int(math.floor(x + 1e-9)), int(u))) for x, u in zip(exact, upper)]
    remainder = batch_size - sum(parts)
    order = sorted(range(len(parts)), key=lambda i: (-(exact[i] - parts[i]), i))
    while remainder > 0:
        room = [i for i in order if parts[i] < upper[i]]
        for i in room[:remainder]:
            parts[i] += 1
        remainder = batch_size - sum(parts)
    while remainder < 0:
        spare = [i for i in reversed(order) if parts[i] > 1]
        for i in spare[:-remainder]:
            parts[i] -= 1
        remainder = batch_size - sum(parts)
    return parts
