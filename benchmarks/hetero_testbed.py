"""Even vs proportional data parallelism on the heterogeneous CPU testbed (measured).

Three devices on this machine: node0/cpu0 owns core 0; node0/cpu1 and
node0/cpu2 share core 1. For a convolutional model and an MLP, under each
Keras backend, it trains with the even and the proportional plan and reports
the measured median step time over `--steps` steps after `--warmup` steps,
and the ratio even / proportional measured in the same run. The ideal ratio on
this testbed is 1.33x (the even split waits for the half-speed devices).

Models: `cnn` (small CNN, batch 96), `mlp` (512-1024-1024-10, 1.59 M
parameters, batch 384) and `mlp_large` (the same MLP at batch 3072). At
batch 384 most of a replica's step cost scales with the parameters, not with
its share (weights streamed through forward and backward, the 6.3 MB
gradient all-reduce, the optimizer update), and the two replicas on core 1
pay it twice whatever the shares, so proportional cannot win there (measured
on an idle machine: torch 0.904x, TensorFlow 1.07x). `mlp` is kept so this
stays visible; `mlp_large` is the compute-dominated case the 1.33x ideal
assumes (docs/runtime_torch.md, "Where a step's time goes", has the
per-rank CPU figures).

PyTorch cases also record the runtime's step profile
(`AUTODIST_KERAS_TORCH_PROFILE`): per rank its cores, intra-op threads and
median phase times (wall and CPU), and `core_cpu_ms`, the CPU time per step
summed over the ranks pinned to each core. On a machine shared with other
jobs, wall times are inflated unevenly; the busiest core's CPU time still
shows which plan is cheaper.

Each (backend, model, plan) case runs in its own process, because the Keras
backend is fixed per process and TensorFlow's logical devices must be set up
before it initialises.

Usage:
    python benchmarks/hetero_testbed.py [--backends tensorflow,torch] [--models cnn,mlp,mlp_large] [--steps 30]

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
MLP = {"input_dim": 512, "hidden": (1024, 1024), "num_classes": 10}  # 1.59M parameters
MODELS = {
    # name: (zoo builder, builder kwargs, input shape, classes, global batch size)
    "cnn": ("small_cnn", {"input_shape": (32, 32, 3), "filters": (32, 64)}, (32, 32, 3), 10, 96),
    # The MLP at batch 384 is dominated by per-step costs that do not shrink with
    # a replica's share (see the module docstring); kept so that is visible.
    "mlp": ("mlp", MLP, (512,), 10, 384),
    # The same MLP where compute dominates, as the ideal 1.33x assumes.
    "mlp_large": ("mlp", MLP, (512,), 10, 3072),
}


def run_case(model_name, strategy_name, steps, warmup):
    """Trains one case and returns its measured step times.

    PyTorch: `AutoStrategy` in this process (the adapter starts one pinned
    process per testbed device). TensorFlow: one process drives logical
    devices that share the process's threads, so the testbed's cores cannot
    be given to them; the case runs through the TensorFlow adapter's
    multi-worker path instead (`run_steps`: one pinned worker per device).
    """
    import keras

    if keras.backend.backend() == "tensorflow":
        return _run_case_tensorflow(model_name, strategy_name, steps, warmup)
    import numpy as np

    from autodist_keras import AutoStrategy
    from autodist_keras import Cluster

    strategy = AutoStrategy(strategy_name, cluster=Cluster.cpu_testbed())
    import keras

    from autodist_keras.graph import zoo
    from autodist_keras.timing import StepTimer

    builder, kwargs, shape, classes, batch = MODELS[model_name]
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = getattr(zoo, builder)(**kwargs)
        model.compile(
            optimizer="sgd",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    n = batch * (steps + warmup)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, *shape)).astype("float32")
    y = rng.integers(0, classes, size=(n,)).astype("int32")
    timer = StepTimer(warmup=warmup)
    import tempfile

    from autodist_keras.backends.torch_step import PROFILE_ENV

    with tempfile.TemporaryDirectory() as profile_dir:
        os.environ[PROFILE_ENV] = profile_dir
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[timer])
        strategy.adapter.close()
        ranks = _profile_summary(profile_dir, len(strategy.plan.replicas), warmup)
    core_cpu = {}
    for row in ranks:
        if row and row.get("cpu_ms") is not None and len(row["affinity"]) == 1:
            core = str(row["affinity"][0])
            core_cpu[core] = round(core_cpu.get(core, 0.0) + row["cpu_ms"], 1)
    shares = [r.batch_share for r in strategy.plan.replicas]
    return {
        "median_step_s": timer.median_s,
        "steps": len(timer.times_s),
        "shares": shares,
        "predicted_step_s": strategy.plan.prediction.step_time_s
        if strategy.plan.prediction is not None else None,
        "ranks": ranks,
        # CPU time per step summed over the ranks pinned to each core: the
        # busiest core bounds the step, whatever other jobs do to wall time.
        "core_cpu_ms": core_cpu,
    }


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


def _run_case_tensorflow(model_name, strategy_name, steps, warmup):
    import statistics

    import numpy as np

    from autodist_keras import Cluster
    from autodist_keras.backends.tensorflow_adapter import run_steps

    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (here, ROOT, os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, here)
    builder, _, shape, classes, batch = MODELS[model_name]
    n = batch * min(steps + warmup, 4)  # the workers repeat the data (fit_repeating)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, *shape)).astype("float32")
    y = rng.integers(0, classes, size=(n,)).astype("int32")
    times = run_steps(f"_testbed_models:build_{builder}", strategy_name,
                      Cluster.cpu_testbed(), x, y, batch_size=batch, steps=steps,
                      warmup=warmup, processes=True, timeout_s=1500)
    return {"median_step_s": statistics.median(times), "steps": len(times),
            "shares": None, "predicted_step_s": None,
            "how": "TensorFlow multi-worker, one pinned process per testbed device"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="tensorflow,torch")
    parser.add_argument("--models", default="cnn,mlp,mlp_large")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        model_name, strategy_name = args.case.split(":")
        print(json.dumps(run_case(model_name, strategy_name, args.steps, args.warmup)))
        return
    results = {}
    print(f"hetero_testbed: {platform.node()}, {os.cpu_count()} cores, "
          f"{args.steps} measured steps after {args.warmup} warm-up steps per case")
    for backend in args.backends.split(","):
        for model_name in args.models.split(","):
            row = {}
            for strategy_name in ("data_parallel", "proportional"):
                env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2")
                started = time.perf_counter()
                out = subprocess.run(
                    [sys.executable, __file__, "--case", f"{model_name}:{strategy_name}",
                     "--steps", str(args.steps), "--warmup", str(args.warmup)],
                    env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800,
                )
                if out.returncode != 0:
                    print(out.stderr[-3000:], file=sys.stderr)
                    row[strategy_name] = {"error": out.stderr.strip().splitlines()[-1:]}
                    continue
                row[strategy_name] = json.loads(out.stdout.strip().splitlines()[-1])
                row[strategy_name]["wall_s"] = round(time.perf_counter() - started, 1)
            even = row.get("data_parallel", {}).get("median_step_s")
            prop = row.get("proportional", {}).get("median_step_s")
            row["even_over_proportional"] = round(even / prop, 3) if even and prop else None
            results[f"{backend}/{model_name}"] = row
            print(
                f"{backend:<10} {model_name:<4} even {_ms(even)} ms "
                f"{row.get('data_parallel', {}).get('shares')}  proportional {_ms(prop)} ms "
                f"{row.get('proportional', {}).get('shares')}  ratio "
                f"{row['even_over_proportional']}x (measured, target >= 1.25x, ideal 1.33x)"
            )
            cores = [row.get(k, {}).get("core_cpu_ms") for k in ("data_parallel", "proportional")]
            if all(cores):
                print(f"{'':<15} CPU ms per step on each core: even {cores[0]}, "
                      f"proportional {cores[1]}")
    ratios = [r["even_over_proportional"] for r in results.values() if r["even_over_proportional"]]
    print(json.dumps({
        "benchmark": "hetero_testbed",
        "load_average_at_end": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "steps": args.steps,
        "warmup": args.warmup,
        "results": results,
        "min_ratio": min(ratios) if ratios else None,
        "target_ratio": 1.25,
    }))


def _ms(seconds):
    return "n/a" if seconds is None else f"{seconds * 1e3:.1f}"


if __name__ == "__main__":
    main()
