"""Even vs proportional data parallelism on the heterogeneous CPU testbed (measured).

Three devices on this machine: node0/cpu0 owns core 0; node0/cpu1 and
node0/cpu2 share core 1. For a convolutional model and an MLP, under each
Keras backend, it trains with three plans and reports the measured median
step time over `--steps` steps after `--warmup` steps, and the ratios
even / proportional measured in the same run. The ideal ratio on this
testbed is 1.33x (the even split waits for the half-speed devices).

The three plans: even shares (`data_parallel`), speed-proportional shares
(`proportional`), and `proportional` with measured step costs
(`step_costs=`): after the even and proportional cases, a cost line
`fixed + per_sample * share` per device is fitted (`share_balance.
fit_step_costs`, cpu1 and cpu2 as one line) to each rank's median CPU time
per step, and the third case balances those costs per core. The fixed
per-replica cost is paid twice on core 1, so speed shares leave core 1 the
bottleneck; balanced shares give cpu0 more (docs/planners.md, "Baselines,
and shares from measured step costs"). `--rounds` (default 4) repeats the
three cases, every second round in reverse order, and each case reports
the median of its rounds' median steps; the step costs are fitted from the
first round. Each row also lists every round's own even/proportional ratio
(`round_ratios_even_over_proportional`): on this VM one round's CPU time
per step can rise 30% while its neighbour's does not (e.g. torch cnn,
proportional: 57.4 then 72.2 ms CPU per step on core 0), which two rounds
cannot outvote. `min_ratio` is over the speed-proportional plan (the issue's
baseline), `min_ratio_measured_costs` over the measured-cost one. Two rounds
(36 cases) took 25 min in one timed run and 12 min in another, on a faster
day of the same VM.

Measured-cost shares did not pay off in that run (load average 1.4-1.7):
they were slower than speed-proportional shares in all 6 (backend, model)
cases, although they balanced the per-core CPU time as fitted. A rank's CPU
time per step is a poor proxy for what it costs the core's wall time when
two processes share the core (docs/planners.md has the figures), so the
option stays available but is not what the target is measured on.

Models: `cnn` (small CNN, batch 96), `cnn_large` (the same CNN at batch
384), `mlp` (512-1024-1024-10, 1.59 M parameters, batch 384) and `mlp_large`
(the same MLP at batch 3072). At
batch 384 most of a replica's step cost scales with the parameters, not with
its share (weights streamed through forward and backward, the 6.3 MB
gradient all-reduce, the optimizer update), and the two replicas on core 1
pay it twice whatever the shares, so proportional cannot win there (measured
on an idle machine: torch 0.904x, TensorFlow 1.07x). In one run a torch rank
on core 1 used 21.9 ms CPU per step at 128 samples and 23.4 ms at 96, and
TensorFlow's step took 48.9 ms even with shares 382/1/1. `mlp` is kept so
this stays visible; `mlp_large` is the compute-dominated case the 1.33x
ideal assumes (docs/runtime_torch.md, "Where a step's time goes", has the
per-rank CPU figures). `min_ratio` covers every model; `min_ratio_share_bound`
covers the models of `SHARE_BOUND` only (`cnn`, `cnn_large` and `mlp_large`,
whose per-replica cost grows with the share; the JSON lists them as
`share_bound_models`).

Bad arguments (an unknown `--models` or `--backends` name, `--steps 0`) are
argparse errors (exit code 2) before anything runs; a case that fails is
reported in the JSON line and makes the exit code 1.

PyTorch cases also record the runtime's step profile
(`AUTODIST_KERAS_TORCH_PROFILE`): per rank its cores, intra-op threads and
median phase times (wall and CPU), and `core_cpu_ms`, the CPU time per step
summed over the ranks pinned to each core. On a machine shared with other
jobs, wall times are inflated unevenly; the busiest core's CPU time still
shows which plan is cheaper.

Each (backend, model) runs in its own process, because the Keras backend is
fixed per process and TensorFlow's logical devices must be set up before it
initialises. TensorFlow runs the testbed as pinned worker processes
(`launch_local_workers`) that build one model per plan and alternate them
every `--steps` steps; PyTorch alternates the cases of every round in one
process, whose adapter keeps its worker processes between fits. So the two
sides of a ratio run seconds apart instead of minutes (`--no-interleave`:
one process per case, as before).

TensorFlow's workers are one per core set by default (`--tf-processes
per_core`): node0/cpu1 and node0/cpu2, which share core 1, run as two
replicas of one process that sums their gradients before its one
cross-process all-reduce, so core 1 pays the gRPC collective, the optimizer
update and the Keras loop once, not twice. `--tf-processes per_device` gives
every device its own process, as before session 10 (docs/runtime_tensorflow.md,
"One process per core", has both layouts' figures). The measured-cost case is
not run per core: its cost lines charge each device a fixed cost per step,
and core 1's one process pays that once for both of its devices.

Usage:
    python benchmarks/hetero_testbed.py [--backends tensorflow,torch] [--models cnn,mlp,mlp_large] [--steps 30] [--rounds 4] [--tf-processes per_core|per_device] [--no-interleave]

The last line of output is one JSON object.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import error_text  # noqa: E402
from _common import exit_code  # noqa: E402
from _common import name_list  # noqa: E402
from _common import non_negative_int  # noqa: E402
from _common import positive_int  # noqa: E402
from _common import versions  # noqa: E402

BACKENDS = ("tensorflow", "torch")
MLP = {"input_dim": 512, "hidden": (1024, 1024), "num_classes": 10}  # 1.59M parameters
MODELS = {
    # name: (zoo builder, builder kwargs, input shape, classes, global batch size)
    "cnn": ("small_cnn", {"input_shape": (32, 32, 3), "filters": (32, 64)}, (32, 32, 3), 10, 96),
    # The MLP at batch 384 is dominated by per-step costs that do not shrink with
    # a replica's share (see the module docstring); kept so that is visible.
    "mlp": ("mlp", MLP, (512,), 10, 384),
    # The same MLP where compute dominates, as the ideal 1.33x assumes.
    "mlp_large": ("mlp", MLP, (512,), 10, 3072),
    # The same CNN at four times the batch (session 11): the per-step costs that
    # do not shrink with a share weigh less, as for mlp_large.
    "cnn_large": ("small_cnn", {"input_shape": (32, 32, 3), "filters": (32, 64)}, (32, 32, 3),
                  10, 384),
}


def run_case(model_name, strategy_name, steps, warmup, step_costs=None,
             tf_processes="per_core"):
    """Trains one case and returns its measured step times.

    PyTorch: `AutoStrategy` in this process (the adapter starts one pinned
    process per testbed device). TensorFlow: one process drives logical
    devices that share the process's threads, so the testbed's cores cannot
    be given to them; the case runs through the TensorFlow adapter's
    multi-worker path instead (`run_steps`: pinned workers, one per core set
    or one per device, see `tf_processes`).

    Every case reports, per rank, its device, share and median CPU time per
    step (`ranks`, `cpu_ms`), the figures the step costs are fitted from.
    `step_costs` (a dict or a JSON path) is passed to `AutoStrategy`.
    """
    import keras

    if keras.backend.backend() == "tensorflow":
        return _run_case_tensorflow(model_name, strategy_name, steps, warmup, step_costs,
                                    tf_processes)
    strategy, model = _build_torch(model_name, strategy_name, step_costs)
    try:
        return _fit_torch(strategy, model, model_name, steps, warmup)
    finally:
        strategy.adapter.close()


def _build_torch(model_name, strategy_name, step_costs=None):
    """`(strategy, model)`: an `AutoStrategy` on the testbed and the compiled model."""
    import keras

    from autodist_keras import AutoStrategy
    from autodist_keras import Cluster
    from autodist_keras.graph import zoo

    options = {"step_costs": step_costs} if step_costs is not None else {}
    strategy = AutoStrategy(strategy_name, cluster=Cluster.cpu_testbed(), **options)
    builder, kwargs, _, _, _ = MODELS[model_name]
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = getattr(zoo, builder)(**kwargs)
        model.compile(
            optimizer="sgd",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    return strategy, model


def _fit_torch(strategy, model, model_name, steps, warmup):
    """One measured `fit` (PyTorch); the adapter's worker processes stay up."""
    import tempfile

    import numpy as np

    from autodist_keras.backends.torch_step import PROFILE_ENV
    from autodist_keras.timing import StepTimer

    _, _, shape, classes, batch = MODELS[model_name]
    n = batch * (steps + warmup)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, *shape)).astype("float32")
    y = rng.integers(0, classes, size=(n,)).astype("int32")
    timer = StepTimer(warmup=warmup)
    with tempfile.TemporaryDirectory() as profile_dir:
        os.environ[PROFILE_ENV] = profile_dir
        try:
            model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0,
                      callbacks=[timer])
        finally:
            del os.environ[PROFILE_ENV]
        ranks = _profile_summary(profile_dir, len(strategy.plan.replicas), warmup)
    replicas = strategy.plan.replicas
    for row, replica in zip(ranks, replicas):
        if row:
            row["device"], row["share"] = replica.device, replica.batch_share
    shares = [r.batch_share for r in replicas]
    return {
        "median_step_s": timer.median_s,
        "steps": len(timer.times_s),
        "shares": shares,
        "predicted_step_s": strategy.plan.prediction.step_time_s
        if strategy.plan.prediction is not None else None,
        "ranks": ranks,
        # CPU time per step summed over the ranks pinned to each core: the
        # busiest core bounds the step, whatever other jobs do to wall time.
        "core_cpu_ms": _core_cpu(ranks),
    }


def run_interleaved_torch(model_name, steps, warmup, rounds, workdir):
    """Every round of the three cases in this one process (PyTorch).

    The adapter keeps its worker processes between `fit` calls of one process
    (same world size), so the cases can alternate every `steps` steps
    without starting processes: each side's rounds then lie seconds apart
    instead of minutes, and a slow minute of the VM hits both sides alike.
    Each case keeps its strategy and model across its rounds.

    Returns:
        `(rounds, costs)`, as `_collect_rounds`.
    """
    built = {}

    def run(strategy_name, costs_path):
        key = (strategy_name, costs_path)
        try:
            if key not in built:
                built[key] = _build_torch(model_name, strategy_name, costs_path)
            strategy, model = built[key]
            return _fit_torch(strategy, model, model_name, steps, warmup)
        except Exception as e:  # noqa: BLE001  (report it; the other cases stand)
            return {"error": [f"{type(e).__name__}: {e}"]}

    try:
        return _collect_rounds(rounds, run, os.path.join(workdir, f"torch_{model_name}_costs.json"))
    finally:
        from autodist_keras.backends.torch_pool import shutdown_pools

        shutdown_pools()


def _core_cpu(ranks):
    """CPU ms per step summed over the ranks pinned to each single core."""
    core_cpu = {}
    for row in ranks:
        if row and row.get("cpu_ms") is not None and len(row["affinity"]) == 1:
            core = str(row["affinity"][0])
            core_cpu[core] = round(core_cpu.get(core, 0.0) + row["cpu_ms"], 1)
    return core_cpu


PHASES = ("forward", "backward", "reduce_wait", "total", "cpu_forward", "cpu_backward",
          "cpu_reduce_wait", "cpu_apply", "cpu")


def _profile_summary(directory, world, warmup):
    """Per rank: cores, threads, and median per-step phase ends and CPU time (ms)."""
    import statistics

    out = []
    for r in range(world):
        path = os.path.join(directory, f"rank{r}.json")
        if not os.path.exists(path):
            out.append(None)
            continue
        with open(path) as f:
            rec = json.load(f)
        steps = rec["steps"][warmup:] or rec["steps"]
        row = {"affinity": rec["affinity"], "torch_threads": rec["torch_threads"]}
        for key in PHASES:
            values = [s[key] for s in steps if key in s]
            if values:
                row[f"{key}_ms"] = round(statistics.median(values) * 1e3, 1)
        out.append(row)
    return out


def tensorflow_worker_inputs(model_name, steps, warmup):
    """What TensorFlow worker processes need to train one testbed model.

    Makes `_testbed_models` (next to this file) importable here, and so in
    the workers, which get this process's `sys.path` in their job file; and
    draws the synthetic data: at most 4 global batches, which the workers
    repeat (`fit_repeating`).

    Returns:
        `(model_fn, x, y, batch)`: the model's `"module:function"` spec, the
        inputs and targets, and the global batch size.
    """
    import numpy as np

    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    builder, _, shape, classes, batch = MODELS[model_name]
    n = batch * min(steps + warmup, 4)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, *shape)).astype("float32")
    y = rng.integers(0, classes, size=(n,)).astype("int32")
    return f"_testbed_models:build_{builder}", x, y, batch


def run_interleaved_tensorflow(model_name, steps, warmup, rounds, workdir,
                               processes="per_core"):
    """Every round of the cases in one set of TensorFlow worker processes.

    The workers (pinned processes, one per core set or one per testbed
    device, see `processes`) build one model per plan and alternate them
    every `steps` steps (`launch_local_workers(..., alternate_plans=...)`).
    With `processes="per_device"` the step costs for the third plan come
    from a short calibration run first (one round of even and proportional,
    its own worker processes); with `"per_core"` the third plan is not run,
    because its cost model charges each device a fixed cost per step, which
    one process per core pays once for both of core 1's devices.

    Returns:
        `(rounds, costs)`, as `_collect_rounds`.
    """
    from autodist_keras import AutoStrategy
    from autodist_keras import Cluster
    from autodist_keras.backends.tf_multiworker import launch_local_workers
    from autodist_keras.strategies.share_balance import step_costs_to_dict

    model_fn, x, y, batch = tensorflow_worker_inputs(model_name, steps, warmup)
    import _testbed_models

    builder = MODELS[model_name][0]
    cluster = Cluster.cpu_testbed()

    def plan(strategy_name, **options):
        strategy = AutoStrategy(strategy_name, cluster=cluster, **options)
        with strategy.scope():
            model = getattr(_testbed_models, f"build_{builder}")()
        return strategy.plan_for(model, batch)

    def alternate(plans, keys, n_rounds):
        results = launch_local_workers(model_fn, cluster, x, y, batch, steps + warmup,
                                       drop_remainder=True, timeout_s=600 + 300 * n_rounds,
                                       alternate_plans=plans, rounds=n_rounds,
                                       processes=processes)
        out = {key: [] for key in keys}
        for fit, *others in zip(*(r["phases"] for r in results)):
            per_rank = [fit] + others
            out[keys[fit["plan"]]].append(_tensorflow_case_result(
                cluster, [dict(f, device=r["device"], devices=r["devices"])
                          for f, r in zip(per_rank, results)],
                warmup, processes))
        return out

    even, proportional = plan("data_parallel"), plan("proportional")
    if processes == "per_core":
        out = alternate([even, proportional], ["even", "proportional"], rounds)
        # Not run by design (not an error: the exit code stays 0).
        out["proportional_measured"] = [{"not_run": [PER_CORE_NO_MEASURED_COSTS]}]
        return out, None
    calibration = alternate([even, proportional], ["even", "proportional"], 1)
    costs = step_costs_to_dict(fit_costs([calibration["even"][0],
                                          calibration["proportional"][0]]))
    costs_path = os.path.join(workdir, f"tensorflow_{model_name}_costs.json")
    with open(costs_path, "w", encoding="utf-8") as f:
        json.dump({"step_costs": costs}, f)
    measured = plan("proportional", step_costs=costs_path)
    keys = [key for key, _, _ in CASES]
    return alternate([even, proportional, measured], keys, rounds), costs


def _tensorflow_case_result(cluster, ranks_raw, warmup, processes="per_device"):
    """One case's result dict from the per-rank step and CPU times of one fit."""
    import statistics

    ranks = []
    for rank in ranks_raw:
        times = rank["step_times_s"][warmup:]
        cpu = (rank.get("cpu_times_s") or [])[warmup:]
        ranks.append({
            "device": rank["device"],
            "devices": rank.get("devices") or [rank["device"]],
            "share": rank["share"],
            "affinity": list(cluster.device(rank["device"]).cpu_affinity),
            "total_ms": round(statistics.median(times) * 1e3, 1),
            # The worker process's CPU time per step (all threads), median.
            "cpu_ms": round(statistics.median(cpu) * 1e3, 1) if cpu else None,
        })
    times = ranks_raw[0]["step_times_s"][warmup:]
    return {"median_step_s": statistics.median(times), "steps": len(times),
            "shares": [r["share"] for r in ranks], "predicted_step_s": None,
            "ranks": ranks, "core_cpu_ms": _core_cpu(ranks),
            "how": "TensorFlow multi-worker, one pinned process per "
                   + ("core set (core 1's two devices in one process)"
                      if processes == "per_core" else "testbed device")}


def _run_case_tensorflow(model_name, strategy_name, steps, warmup, step_costs=None,
                         processes="per_core"):
    from autodist_keras import Cluster
    from autodist_keras.backends.tensorflow_adapter import run_steps

    model_fn, x, y, batch = tensorflow_worker_inputs(model_name, steps, warmup)
    cluster = Cluster.cpu_testbed()
    options = {"step_costs": step_costs} if step_costs is not None else {}
    out = run_steps(model_fn, strategy_name, cluster, x, y,
                    batch_size=batch, steps=steps, warmup=warmup, processes=processes,
                    timeout_s=1500, options=options, details=True)
    # (run_steps dropped the warm-up steps already)
    return _tensorflow_case_result(cluster, out["ranks"], warmup=0, processes=processes)


PER_CORE_NO_MEASURED_COSTS = (
    "not run with one TensorFlow process per core: its step costs charge every device a "
    "fixed cost per step, which core 1's one process pays once for both of its devices")

# Models whose per-replica step cost grows with the replica's share on this CPU.
SHARE_BOUND = ("cnn", "mlp_large", "cnn_large")

CASES = (
    # key, strategy name, with the fitted step costs
    ("even", "data_parallel", False),
    ("proportional", "proportional", False),
    ("proportional_measured", "proportional", True),
)


def _run_subprocess(backend, model_name, strategy_name, args, costs_path=None):
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2")
    command = [sys.executable, __file__, "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--tf-processes", args.tf_processes]
    if strategy_name is None:  # every case, in alternating rounds, in that one process
        command += ["--interleaved-case", model_name, "--rounds", str(args.rounds)]
    else:
        command += ["--case", f"{model_name}:{strategy_name}"]
    if costs_path:
        command += ["--step-costs", costs_path]
    started = time.perf_counter()
    out = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=1800 * (args.rounds if strategy_name is None else 1))
    if out.returncode != 0:
        print(out.stderr[-3000:], file=sys.stderr)
        return {"error": out.stderr.strip().splitlines()[-1:]}
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["wall_s"] = round(time.perf_counter() - started, 1)
    return result


def fit_costs(runs):
    """Step costs per device from the per-rank CPU per step of the even and proportional runs."""
    from autodist_keras import Cluster
    from autodist_keras.strategies.share_balance import fit_step_costs
    from autodist_keras.strategies.share_balance import interchangeable_devices

    observations = []
    for run in runs:
        for rank in run.get("ranks") or []:
            if rank and rank.get("cpu_ms") is not None and rank.get("share"):
                observations.append((rank["device"], rank["share"], rank["cpu_ms"] / 1e3))
    cluster = Cluster.cpu_testbed()
    # cpu1 and cpu2 (one thread each on core 1) get one line from both ranks' figures.
    return fit_step_costs(observations, tied=interchangeable_devices(cluster, cluster.names))


def predicted_busiest_core_ms(costs, shares):
    """The busiest core's CPU per step the fitted costs predict for some shares (predicted)."""
    from autodist_keras import Cluster
    from autodist_keras.strategies.share_balance import busiest_load_s

    return round(busiest_load_s(Cluster.cpu_testbed(), list(costs), costs, shares) * 1e3, 1)


def _collect_rounds(n_rounds, run, costs_path, skip_measured=None):
    """Runs the three cases in `n_rounds` rounds, every second one in reverse order.

    Args:
        n_rounds: Number of rounds.
        run: Callable `(strategy_name, step_costs_path or None)` returning one
            case's result dict.
        costs_path: Where to write the step costs fitted after the first
            even and proportional cases (the measured-cost case reads them).
        skip_measured: A reason not to run the measured-cost case, or None.

    Returns:
        `(rounds, costs)`: each case's results, one per round, and the fitted
        step costs as a dict (None if they could not be fitted).
    """
    from autodist_keras.strategies.share_balance import step_costs_to_dict

    rounds = {key: [] for key, _, _ in CASES}
    costs = None
    for r in range(n_rounds):
        order = CASES if r % 2 == 0 else tuple(reversed(CASES))
        for key, strategy_name, measured in order:
            if measured and skip_measured:
                rounds[key] = [{"not_run": [skip_measured]}]  # by design, not an error
                continue
            if measured and costs is None:
                try:
                    costs = step_costs_to_dict(
                        fit_costs([rounds["even"][-1], rounds["proportional"][-1]]))
                except Exception as e:  # noqa: BLE001  (report it; the other cases stand)
                    rounds[key].append({"error": [f"fitting step costs failed: {e}"]})
                    continue
                with open(costs_path, "w", encoding="utf-8") as f:
                    json.dump({"step_costs": costs}, f)
            if measured and costs is None:
                continue
            rounds[key].append(run(strategy_name, costs_path if measured else None))
    return rounds, costs


def run_model(backend, model_name, args, workdir):
    """Even, proportional and proportional with fitted step costs, in alternating rounds.

    TensorFlow: every case in its own process. PyTorch: every case of every
    round in one process (`run_interleaved_torch`), unless `--no-interleave`.
    """
    import statistics

    from autodist_keras.strategies.share_balance import load_step_costs

    if args.interleave:
        result = _run_subprocess(backend, model_name, None, args)
        if "error" in result:
            result = {"rounds": {key: [result] for key, _, _ in CASES}, "costs": None}
        rounds, costs = result["rounds"], result["costs"]
    else:
        rounds, costs = _collect_rounds(
            args.rounds,
            lambda name, path: _run_subprocess(backend, model_name, name, args, path),
            os.path.join(workdir, f"{backend}_{model_name}_costs.json"),
            skip_measured=(PER_CORE_NO_MEASURED_COSTS if backend == "tensorflow"
                           and args.tf_processes == "per_core" else None))
    row = {}
    for key, _, _ in CASES:
        good = [run for run in rounds[key] if run.get("median_step_s")]
        if not good:
            row[key] = rounds[key][-1] if rounds[key] else {"error": ["not run"]}
            continue
        row[key] = dict(good[0])
        row[key]["round_median_step_s"] = [run["median_step_s"] for run in good]
        row[key]["median_step_s"] = statistics.median(row[key]["round_median_step_s"])
        if len(good) > 1:
            row[key]["round_core_cpu_ms"] = [run.get("core_cpu_ms") for run in good]
    if costs is not None:
        row["step_costs"] = costs
        row["predicted_busiest_core_ms_from_costs"] = {
            key: predicted_busiest_core_ms(load_step_costs(costs), row[key]["shares"])
            for key, _, _ in CASES if row[key].get("shares")
        }
    even = row["even"].get("median_step_s")
    for key in ("proportional", "proportional_measured"):
        other = row[key].get("median_step_s")
        row[f"even_over_{key}"] = round(even / other, 3) if even and other else None
    # Each round's own ratio (even and proportional of one round ran minutes
    # apart at most, seconds when interleaved): a round hit by the VM's neighbours shows up here as an
    # outlier instead of only moving the medians.
    pairs = zip(row["even"].get("round_median_step_s") or [],
                row["proportional"].get("round_median_step_s") or [])
    row["round_ratios_even_over_proportional"] = [round(e / p, 3) for e, p in pairs]
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", type=name_list(BACKENDS), default=list(BACKENDS),
                        help="comma-separated, from tensorflow, torch")
    parser.add_argument("--models", type=name_list(MODELS), default=["cnn", "mlp", "mlp_large"],
                        help=f"comma-separated, from {', '.join(MODELS)}")
    parser.add_argument("--steps", type=positive_int, default=30,
                        help="measured steps per case (at least 1)")
    parser.add_argument("--warmup", type=non_negative_int, default=3)
    parser.add_argument("--rounds", type=positive_int, default=4,
                        help="rounds of the three cases, every second one in reverse order")
    parser.add_argument("--no-interleave", dest="interleave", action="store_false",
                        help="PyTorch: run every case in its own process (as TensorFlow does) "
                             "instead of alternating the cases in one process")
    parser.add_argument("--tf-processes", choices=("per_core", "per_device"), default="per_core",
                        help="TensorFlow: one worker process per core set (core 1's two devices "
                             "share one, default) or one per testbed device")
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--interleaved-case", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--step-costs", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        model_name, strategy_name = args.case.split(":")
        print(json.dumps(run_case(model_name, strategy_name, args.steps, args.warmup,
                                  step_costs=args.step_costs, tf_processes=args.tf_processes)))
        return
    import tempfile

    if args.interleaved_case:
        import keras

        with tempfile.TemporaryDirectory() as workdir:
            if keras.backend.backend() == "tensorflow":
                rounds, costs = run_interleaved_tensorflow(
                    args.interleaved_case, args.steps, args.warmup, args.rounds, workdir,
                    args.tf_processes)
            else:
                rounds, costs = run_interleaved_torch(
                    args.interleaved_case, args.steps, args.warmup, args.rounds, workdir)
        print(json.dumps({"rounds": rounds, "costs": costs}))
        return
    results = {}
    started = time.perf_counter()
    print(f"hetero_testbed: {platform.node()}, {os.cpu_count()} cores, "
          f"{args.steps} measured steps after {args.warmup} warm-up steps per case, "
          f"{args.rounds} round(s) (every second one in reverse order; median step of the "
          "rounds)")
    with tempfile.TemporaryDirectory() as workdir:
        for backend in args.backends:
            for model_name in args.models:
                try:
                    row = run_model(backend, model_name, args, workdir)
                except Exception as e:  # reported in the JSON line; the exit code says it failed
                    error = error_text(e)
                    results[f"{backend}/{model_name}"] = {"error": error}
                    print(f"{backend:<10} {model_name:<9} error: {error}")
                    continue
                results[f"{backend}/{model_name}"] = row
                _print_row(backend, model_name, row)
    ratios = [r["even_over_proportional_measured"] for r in results.values()
              if r.get("even_over_proportional_measured")]
    plain = [r["even_over_proportional"] for r in results.values()
             if r.get("even_over_proportional")]
    print(json.dumps({
        "benchmark": "hetero_testbed",
        "load_average_at_end": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "tf_processes": args.tf_processes,
        "versions": versions(args.backends),
        "wall_s": round(time.perf_counter() - started, 1),
        "results": results,
        "min_ratio": min(plain) if plain else None,
        # Over the models whose per-replica cost grows with the share (SHARE_BOUND:
        # cnn, mlp_large, cnn_large), the situation the 1.33x ideal describes; `mlp`
        # at batch 384 is fixed-cost bound on this CPU (see the module docstring).
        "share_bound_models": list(SHARE_BOUND),
        "min_ratio_share_bound": min(
            (r["even_over_proportional"] for k, r in results.items()
             if k.split("/")[1] in SHARE_BOUND and r.get("even_over_proportional")),
            default=None),
        "min_ratio_measured_costs": min(ratios) if ratios else None,
        "target_ratio": 1.25,
    }))
    return exit_code(results)


def _print_row(backend, model_name, row):
    def case(key):
        data = row.get(key, {})
        return f"{_ms(data.get('median_step_s'))} ms {data.get('shares')}"

    print(f"{backend:<10} {model_name:<9} even {case('even')}  proportional "
          f"{case('proportional')}  measured costs {case('proportional_measured')}")
    print(f"{'':<20} even/proportional {row['even_over_proportional']}x, "
          f"even/proportional with measured costs {row['even_over_proportional_measured']}x "
          "(measured, target >= 1.25x, ideal 1.33x)")
    print(f"{'':<20} each round's even/proportional: "
          f"{row.get('round_ratios_even_over_proportional')}")
    if row.get("step_costs"):
        fitted = ", ".join(f"{d} {c['fixed_s'] * 1e3:.1f} ms + {c['per_sample_s'] * 1e3:.3f} "
                           "ms/sample" for d, c in row["step_costs"].items())
        print(f"{'':<20} fitted CPU cost per step: {fitted}")
        print(f"{'':<20} busiest core from those costs (predicted): "
              f"{row['predicted_busiest_core_ms_from_costs']} ms")
    cores = {k: row.get(k, {}).get("core_cpu_ms") for k, _, _ in CASES}
    if all(cores.values()):
        print(f"{'':<20} CPU ms per step on each core (measured, first round): {cores}")


def _ms(seconds):
    return "n/a" if seconds is None else f"{seconds * 1e3:.1f}"


if __name__ == "__main__":
    sys.exit(main())
