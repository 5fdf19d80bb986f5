"""Does auto's choice hold on real hardware? Measured on the CPU testbed, in one run.

For each model, `AutoStrategy("auto")` plans for `Cluster.cpu_testbed()`
(node0/cpu0 owns core 0; node0/cpu1 and node0/cpu2 share core 1) on the
active backend's runtime, scoring its candidates with the chosen estimator
(`--estimator learned`, the default, or `simulator`). Then the plan auto
chose and every baseline it beat on paper (single device, even and
proportional data parallelism whose predicted step time is above auto's)
are trained for real, interleaved in rounds (round 1 of every plan, then
round 2, ... with the plan order rotated each round), and the median step
time of every plan over all its timed steps is compared: the ratio measured
baseline / measured auto is at least 1 where auto's choice holds.

Each plan's each round runs in a fresh process (what a user who runs one
program with one plan sees); `--in-process` runs them all in this process
one after another instead, PyTorch workers kept between fits (the method
until 4 December 2026: there the order of a close pair of plans depended on
which other plans ran in the same process, docs/planners.md).
PyTorch (default): `AutoStrategy(plan=...)` + `model.fit`, one process per
replica pinned to its testbed device's core. TensorFlow (`--backend
tensorflow`, slower to start): `tensorflow_adapter.run_steps`, one pinned
worker process per plan device.

Every predicted time is a prediction (its scorer named); every measured time
is a median of real steps on this machine, whatever else it was running (the
1-minute load average is printed).

Usage:
    python benchmarks/auto_real_check.py                       # cnn, mlp, transformer; torch
    python benchmarks/auto_real_check.py --models cnn --rounds 3 --steps 10
    python benchmarks/auto_real_check.py --estimator simulator

The last line printed is one JSON object: `cases` (per case: auto's family
and planner, predicted and measured step time per plan, ratio measured
baseline / auto, `auto_at_least_as_fast`) and `overall`.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from _common import error_text  # noqa: E402
from _common import name_list  # noqa: E402
from _common import non_negative_int  # noqa: E402
from _common import positive_float  # noqa: E402
from _common import positive_int  # noqa: E402
from _common import versions  # noqa: E402

ZOO = "autodist_keras.graph.zoo"
# name: (builder, kwargs, global batch size). cnn and mlp are the models of
# _testbed_models.py / hetero_testbed.py; none of the three is a training model
# of the packaged learned estimator (benchmarks/estimator_accuracy.py MODELS).
MODELS = {
    "cnn": (f"{ZOO}:small_cnn", {"input_shape": [32, 32, 3], "filters": [32, 64]}, 96),
    "mlp": (f"{ZOO}:mlp", {"input_dim": 512, "hidden": [1024, 1024], "num_classes": 10}, 192),
    "transformer": (f"{ZOO}:transformer_encoder",
                    {"num_layers": 2, "d_model": 96, "heads": 4, "seq_len": 32, "vocab": 1000},
                    96),
    # A small, fast case for the tests.
    "tiny": (f"{ZOO}:mlp", {"input_dim": 64, "hidden": [128, 128]}, 48),
}
DEFAULT_MODELS = ("cnn", "mlp", "transformer")
BASELINES = ("single_device", "data_parallel_even", "proportional")
TIE_RTOL = 1e-6  # predicted times this close count as a tie, not as beaten


def plan_with_auto(case, cluster, estimator="learned", devices=None):
    """Runs `AutoStrategy("auto")`'s planning for a case (no training).

    Returns:
        `(strategy, plan)`: the strategy (its `candidates` scored) and its plan.
    """
    import keras

    from autodist_keras import AutoStrategy
    from autodist_keras.estimator.measurements import build_model

    strategy = AutoStrategy("auto", cluster=cluster, devices=devices, estimator=estimator)
    keras.utils.set_random_seed(0)
    model = build_model(case)
    # Plan afresh (a plan from the cache comes without its scored candidates).
    previous = os.environ.get("AUTODIST_KERAS_CACHE")
    with tempfile.TemporaryDirectory() as cache:
        os.environ["AUTODIST_KERAS_CACHE"] = cache
        try:
            plan = strategy.plan_for(model, case.batch_size)
        finally:
            if previous is None:
                os.environ.pop("AUTODIST_KERAS_CACHE", None)
            else:
                os.environ["AUTODIST_KERAS_CACHE"] = previous
    return strategy, plan


def beaten_baselines(strategy, plan):
    """The baseline candidates auto beat on paper: feasible, predicted slower than its choice."""
    chosen = next((c.name for c in strategy.candidates if c.plan is plan), None)
    out = []
    for c in strategy.candidates:
        if c.name in BASELINES and c.name != chosen and c.plan is not None and c.feasible \
                and c.step_time_s is not None \
                and c.step_time_s > plan.prediction.step_time_s * (1.0 + TIE_RTOL):
            out.append(c)
    return out


def _case(name):
    """The measurements `Case` of a `MODELS` entry (its plan kind is unused here)."""
    from autodist_keras.estimator.measurements import Case

    builder, kwargs, batch = MODELS[name]
    return Case(name, builder, kwargs, "single_device", batch)


def _measure_in_this_process(case, plan, steps, warmup, timeout_s, data=None):
    """Times `plan` on `case`'s model in this process (the adapter's workers as
    it keeps them); `data` is `(x, y)` for `steps + warmup` batches, made here
    when not given. Returns the `steps` step times after `warmup`."""
    import keras

    from autodist_keras.devices import Cluster
    from autodist_keras.estimator.measurements import _measure_with_adapter

    x, y = data if data is not None else _case_data(case, steps, warmup)
    times, _ = _measure_with_adapter(case, Cluster.cpu_testbed(), plan, x, y, steps, warmup,
                                     0, keras.backend.backend(), timeout_s)
    return [float(t) for t in times[:steps]]


def _case_data(case, steps, warmup):
    """Synthetic `(x, y)` for `steps + warmup` batches of `case` (seed 0)."""
    import keras

    from autodist_keras.estimator.measurements import build_model
    from autodist_keras.estimator.measurements import synthetic_data

    keras.utils.set_random_seed(0)
    probe = build_model(case)
    return synthetic_data(probe, case.batch_size * (steps + warmup), seed=0)


def _measure_isolated(name, plan, steps, warmup, timeout_s):
    """Times `plan` on model `name` in a fresh process, as a user's run of one
    program with one plan would (nothing else loaded, no other plan's workers);
    returns its `steps` step times after `warmup`."""
    with tempfile.TemporaryDirectory(prefix="auto_real_check_") as tmp:
        plan_path = os.path.join(tmp, "plan.json")
        out_path = os.path.join(tmp, "times.json")
        plan.to_json(plan_path)
        cmd = [sys.executable, os.path.abspath(__file__), "--run-plan", plan_path,
               "--models", name, "--steps", str(steps), "--warmup", str(warmup),
               "--timeout", str(timeout_s), "--out", out_path,
               "--backend", os.environ.get("KERAS_BACKEND", "torch")]
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=timeout_s + 120)
        if proc.returncode != 0 or not os.path.exists(out_path):
            raise RuntimeError(f"measuring {plan.provenance.planner} for {name} failed "
                               f"(exit code {proc.returncode}): {proc.stderr[-2000:]}")
        with open(out_path, encoding="utf-8") as f:
            return json.load(f)["step_times_s"]


def run_plan(args):
    """Child of `_measure_isolated`: one plan's steps, times written as JSON."""
    from autodist_keras.strategies.plan import Plan

    [name] = args.models
    times = _measure_in_this_process(_case(name), Plan.from_json(args.run_plan), args.steps,
                                     args.warmup, args.timeout)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"step_times_s": times}, f)


def check_case(name, steps=6, warmup=3, rounds=4, estimator="learned", timeout_s=600,
               devices=None, log=print, isolate=True):
    """Plans one model with auto and measures its choice against the baselines it beat.

    Args:
        name: A key of `MODELS`.
        steps: Timed steps per plan per round (after `warmup` steps).
        warmup: Warm-up steps per plan per round (not timed).
        rounds: Interleaved rounds; each plan's median is over `steps x rounds` steps.
        estimator: The `estimator=` option of `AutoStrategy`.
        timeout_s: Limit for one plan's run.
        devices: Testbed device names auto may use (default: all three).
        log: Where progress lines go.
        isolate: Time every plan's every round in a fresh process (what a
            user running one program sees); False times them all in this
            process, one after another, the PyTorch workers kept between
            fits (the method before 4 December 2026; see docs/planners.md).

    Returns:
        A JSON-ready dict (see the module docstring).
    """
    import keras

    from autodist_keras.devices import Cluster
    from autodist_keras.estimator.measurements import load_average

    backend = keras.backend.backend()
    case = _case(name)
    batch = case.batch_size
    cluster = Cluster.cpu_testbed()
    started = time.perf_counter()
    strategy, plan = plan_with_auto(case, cluster, estimator, devices)
    planning_s = time.perf_counter() - started
    winner = next((c for c in strategy.candidates if c.plan is plan), None)
    chosen = winner.name if winner is not None else plan.provenance.planner
    family = winner.family if winner is not None else chosen
    plans = {f"auto={chosen}": plan}
    beaten = beaten_baselines(strategy, plan)
    for c in beaten:
        plans[c.name] = c.plan
    predicted = {f"auto={chosen}": plan.prediction.step_time_s}
    scorer = {f"auto={chosen}": plan.prediction.source}
    simulated = {f"auto={chosen}": plan.prediction.simulated_step_time_s
                 or plan.prediction.step_time_s}
    for c in beaten:
        predicted[c.name] = c.step_time_s
        scorer[c.name] = c.scorer
        simulated[c.name] = c.simulated_step_time_s
    log(f"{name}: auto chose {chosen} (family {family}) in {planning_s:.2f} s, predicted "
        f"{plan.prediction.step_time_s * 1e3:.1f} ms ({plan.prediction.source}); beat on paper: "
        + (", ".join(f"{c.name} {c.step_time_s * 1e3:.1f} ms" for c in beaten) or "none"))
    # Isolated runs make their own data in their own process.
    data = None if isolate else _case_data(case, steps, warmup)
    times = {label: [] for label in plans}
    labels = list(plans)
    loads = [load_average()]
    for r in range(rounds if len(plans) > 1 else 1):
        order = labels[r % len(labels):] + labels[:r % len(labels)]
        for label in order:
            if isolate:
                got = _measure_isolated(name, plans[label], steps, warmup, timeout_s)
            else:
                got = _measure_in_this_process(case, plans[label], steps, warmup, timeout_s,
                                               data)
            times[label].extend(float(t) for t in got[:steps])
        loads.append(load_average())
        log(f"  median after round {r + 1}: " + ", ".join(
            f"{label} {statistics.median(times[label]) * 1e3:.1f} ms" for label in labels)
            + f" (1-minute load average {_load_text(loads[-1])})")
    measured = {label: statistics.median(t) for label, t in times.items()}
    auto_label = f"auto={chosen}"
    ratios = {label: measured[label] / measured[auto_label] for label in labels
              if label != auto_label}
    holds = all(v >= 1.0 for v in ratios.values())
    for label, ratio in ratios.items():
        log(f"  {label}: measured {measured[label] * 1e3:.1f} ms vs auto "
            f"{measured[auto_label] * 1e3:.1f} ms -> {ratio:.3f}x "
            f"({'auto at least as fast' if ratio >= 1.0 else 'AUTO SLOWER'})")
    return {
        "model": name,
        "backend": backend,
        "batch_size": batch,
        "estimator": estimator,
        "auto_planner": chosen,
        "auto_family": family,
        "planning_time_s": round(planning_s, 3),
        "plans": {
            label: {"predicted_step_time_s": predicted[label], "scorer": scorer[label],
                    "simulated_step_time_s": simulated[label],
                    "measured_step_time_s": measured[label],
                    "measured_steps": len(times[label])}
            for label in labels
        },
        "ratio_measured_baseline_over_auto": ratios,
        "auto_at_least_as_fast": holds,
        "min_ratio": min(ratios.values()) if ratios else None,
        "load_average": loads,
        "steps_per_round": steps,
        "warmup_per_round": warmup,
        "rounds": rounds,
        "isolated": isolate,
    }


def _load_text(load):
    """The 1-minute figure of a `load_average()` result, or "n/a"."""
    if isinstance(load, (list, tuple)) and load:
        load = load[0]
    return "n/a" if load is None else f"{load:.1f}"


def run(args):
    results, errors = [], []
    started = time.perf_counter()
    for name in args.models:
        try:
            results.append(check_case(name, steps=args.steps, warmup=args.warmup,
                                      rounds=args.rounds, estimator=args.estimator,
                                      timeout_s=args.timeout, devices=args.devices,
                                      isolate=not args.in_process))
        except Exception as e:  # reported in the JSON line; the exit code says it failed
            errors.append({"model": name, "error": error_text(e)})
            print(f"{name}: error: {errors[-1]['error']}")
    try:
        from autodist_keras.backends.torch_pool import shutdown_pools

        shutdown_pools()
    except ImportError:
        pass
    compared = [r for r in results if r["ratio_measured_baseline_over_auto"]]
    ratios = [v for r in compared for v in r["ratio_measured_baseline_over_auto"].values()]
    overall = {
        # None (not known) where a case failed before it was measured.
        "auto_at_least_as_fast": (None if errors else
                                  all(r["auto_at_least_as_fast"] for r in results)),
        "cases_holding": sum(r["auto_at_least_as_fast"] for r in results),
        "cases": len(results),
        "cases_failed": len(errors),
        "cases_with_beaten_baselines": len(compared),
        "min_ratio": min(ratios) if ratios else None,
        "geomean_ratio": (statistics.geometric_mean(ratios) if ratios else None),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print(f"overall: auto at least as fast as every baseline it beat on paper in "
          f"{overall['cases_holding']} of {overall['cases']} case(s); min ratio "
          f"{overall['min_ratio'] if overall['min_ratio'] is None else round(overall['min_ratio'], 3)}"
          f" (measured, this machine, {overall['wall_s']} s)"
          + (f"; {len(errors)} case(s) failed: {[e['model'] for e in errors]}" if errors else ""))
    line = {"benchmark": "auto_real_check", "cluster": "cpu_testbed",
            "estimator": args.estimator, "versions": versions(), "cases": results,
            "errors": errors, "overall": overall}
    print(json.dumps(line))
    return line


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(DEFAULT_MODELS),
                        choices=sorted(MODELS))
    parser.add_argument("--backend", choices=["torch", "tensorflow"], default="torch")
    parser.add_argument("--estimator", default="learned",
                        help="AutoStrategy estimator= option: learned, simulator or a JSON path")
    parser.add_argument("--steps", type=positive_int, default=6,
                        help="timed steps per plan per round (at least 1)")
    parser.add_argument("--warmup", type=non_negative_int, default=3,
                        help="warm-up steps per plan per round")
    parser.add_argument("--rounds", type=positive_int, default=4)
    parser.add_argument("--timeout", type=positive_float, default=600.0,
                        help="seconds per plan run")
    parser.add_argument("--devices", nargs="+", type=_testbed_devices, default=None,
                        help="testbed devices auto may use, each once (default: all): names "
                             "of Cluster.cpu_testbed(), space- or comma-separated")
    parser.add_argument("--in-process", action="store_true",
                        help="time every plan in this process, PyTorch workers kept between "
                             "fits, instead of a fresh process per plan and round")
    parser.add_argument("--run-plan", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.devices is not None:
        args.devices = [name for names in args.devices for name in names]
        repeated = sorted({name for name in args.devices if args.devices.count(name) > 1})
        if repeated:
            parser.error(f"argument --devices: {repeated} named more than once; name each "
                         f"device once, from {', '.join(_testbed_names())}. "
                         f"Received: {args.devices}")
    if os.environ.get("KERAS_BACKEND") != args.backend:
        # The Keras backend is fixed per process: run again under the requested one.
        env = dict(os.environ, KERAS_BACKEND=args.backend, TF_CPP_MIN_LOG_LEVEL="2")
        argv = sys.argv[1:] if argv is None else list(argv)
        return subprocess.call([sys.executable, os.path.abspath(__file__)] + argv, env=env)
    if args.run_plan:
        return run_plan(args)
    from autodist_keras.estimator.measurements import load_average

    print(f"auto_real_check: {args.backend} ({_versions_line()}), models {args.models}, "
          f"estimator "
          f"{args.estimator!r}, {args.rounds} interleaved round(s) of {args.steps} timed steps "
          f"after {args.warmup} warm-up steps per plan, "
          + ("all in this process" if args.in_process else "each in a fresh process")
          + f"; 1-minute load average {_load_text(load_average())} at start",
          flush=True)
    line = run(args)
    return 1 if line["errors"] else 0


def _testbed_names():
    """The device names of `Cluster.cpu_testbed()` (imports no framework)."""
    from autodist_keras.devices import Cluster

    return list(Cluster.cpu_testbed().names)


def _testbed_devices(text):
    """argparse type of `--devices`: names of the CPU testbed's devices (a list)."""
    from autodist_keras.errors import ClusterSpecError

    try:
        valid = _testbed_names()
    except ClusterSpecError as e:
        raise argparse.ArgumentTypeError(f"the CPU testbed cannot be made here: {e}") from None
    return name_list(valid)(text)


def _versions_line():
    from _common import versions_text

    return versions_text(versions())


if __name__ == "__main__":
    sys.exit(main())
