"""TensorFlow on the CPU testbed: one worker process per device vs per core (measured).

The TensorFlow adapter realises the testbed (node0/cpu0 owns core 0,
node0/cpu1 and node0/cpu2 share core 1) with pinned worker processes
(`tf_multiworker.launch_local_workers`). Two layouts:

- `per_device`: one process per device, so core 1 runs two processes, each
  paying its own gRPC all-reduce, optimizer update and Keras loop per step.
- `per_core`: one process per core set; cpu1 and cpu2 are two replicas of
  core 1's process, summed locally before the one cross-process all-reduce.

For each model of `benchmarks/hetero_testbed.py` (`--models`), each layout
and each plan (even and speed-proportional data parallelism), it times
`--steps` steps after `--warmup` with `run_steps` in freshly started
workers, and repeats this for `--rounds` rounds, alternating the order of
the layouts every round, so load from other jobs hits both alike. Reported
per (model, layout, plan): every round's median step, and the median over
rounds; per model, the proportional step per device ÷ per core and each
layout's even ÷ proportional, all from this one run.

Usage:
    python benchmarks/tf_process_layout.py [--models cnn,mlp] [--rounds 3] [--steps 30] [--warmup 3]

Runs under KERAS_BACKEND=tensorflow (set here). The last line of output is
one JSON object.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

os.environ["KERAS_BACKEND"] = "tensorflow"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # hetero_testbed, next to this file

from _common import error_text  # noqa: E402
from _common import versions  # noqa: E402

LAYOUTS = ("per_core", "per_device")
PLANS = ("data_parallel", "proportional")


def _ratio(a, b):
    return round(a / b, 3) if a and b else None


def measure(model_names, rounds, steps, warmup):
    """Times every (model, layout, plan) for `rounds` rounds; returns the results dict."""
    import hetero_testbed

    from autodist_keras import Cluster
    from autodist_keras.backends.tensorflow_adapter import run_steps

    cluster = Cluster.cpu_testbed()
    results = {}
    for model_name in model_names:
        model_fn, x, y, batch = hetero_testbed.tensorflow_worker_inputs(
            model_name, steps, warmup)
        rows = {f"{layout}/{plan}": [] for layout in LAYOUTS for plan in PLANS}
        for r in range(rounds):
            for layout in (LAYOUTS if r % 2 == 0 else LAYOUTS[::-1]):
                for plan in PLANS:
                    times = run_steps(model_fn, plan, cluster, x, y,
                                      batch_size=batch, steps=steps, warmup=warmup,
                                      processes=layout, timeout_s=900)
                    rows[f"{layout}/{plan}"].append(round(statistics.median(times) * 1e3, 2))
        medians = {key: statistics.median(values) for key, values in rows.items()}
        results[model_name] = {
            "batch_size": batch,
            "round_median_step_ms": rows,
            "median_step_ms": medians,
            "even_over_proportional": {
                layout: _ratio(medians[f"{layout}/data_parallel"],
                               medians[f"{layout}/proportional"]) for layout in LAYOUTS},
            "proportional_per_device_over_per_core": _ratio(
                medians["per_device/proportional"], medians["per_core/proportional"]),
        }
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="cnn,mlp")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    import hetero_testbed

    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in hetero_testbed.MODELS]
    if unknown or not models:
        parser.error(f"--models takes names from {sorted(hetero_testbed.MODELS)}. "
                     f"Received: {unknown or args.models!r}")
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0:
        parser.error("--rounds and --steps must be at least 1 and --warmup at least 0. "
                     f"Received: rounds={args.rounds}, steps={args.steps}, "
                     f"warmup={args.warmup}")
    print(f"tf_process_layout: {platform.node()}, {os.cpu_count()} cores; per model, layout "
          f"and plan: {args.steps} measured steps after {args.warmup} warm-up in fresh worker "
          f"processes, {args.rounds} round(s), layouts alternating (measured)")
    started = time.perf_counter()
    error = None
    try:
        results = measure(models, args.rounds, args.steps, args.warmup)
    except Exception as e:  # reported in the JSON line; the exit code says it failed
        results, error = {}, error_text(e)
        print(f"error: {error[:500]}")
    for model_name, row in results.items():
        for key, values in row["round_median_step_ms"].items():
            print(f"{model_name:<10} {key:<27} rounds {values} ms, median "
                  f"{row['median_step_ms'][key]:.1f} ms")
        print(f"{model_name:<10} even / proportional: {row['even_over_proportional']}; "
              "proportional step per device / per core: "
              f"{row['proportional_per_device_over_per_core']}")
    print(json.dumps({
        "benchmark": "tf_process_layout",
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "versions": versions(["tensorflow"]),
        "load_average_at_end": os.getloadavg(),
        "wall_s": round(time.perf_counter() - started, 1),
        "results": results,
        **({"error": error} if error else {}),
    }))
    return 1 if error else 0


if __name__ == "__main__":
    sys.exit(main())
