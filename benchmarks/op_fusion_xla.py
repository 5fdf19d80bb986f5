"""Disco's op-fusion regions as XLA clusters on TensorFlow: measured step time, on vs off.

For a convolutional model and an MLP, Disco plans op fusion for one device of
this machine (`disco.plan`, data parallelism on one CPU device); the model
then trains with `AutoStrategy(plan=..., op_fusion="on")` (the regions compiled
as XLA clusters, see `backends/tf_fusion.py`) and `op_fusion="off"` (the same
plan, TensorFlow's own kernels). The two sides alternate `--rounds` times in
one run; each side's figure is the median over all its measured steps after
`--warmup` warm-up steps per round.

This is what `op_fusion="auto"` rests on: it realises the regions on GPUs
only, because on this CPU the XLA clusters were slower (idle machine: 0.55x,
see docs/disco.md, "Realising op fusion").

Usage:
    KERAS_BACKEND=tensorflow python benchmarks/op_fusion_xla.py [--steps 30] [--rounds 3]

The last line of output is one JSON object.
"""

import argparse
import json
import os
import platform
import statistics
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import error_text  # noqa: E402
from _common import exit_code  # noqa: E402
from _common import name_list  # noqa: E402
from _common import non_negative_int  # noqa: E402
from _common import positive_int  # noqa: E402
from _common import versions  # noqa: E402

MODELS = {
    # name: (builder, kwargs, input shape, classes, batch)
    "cnn": ("small_cnn", {"input_shape": (32, 32, 3), "filters": (32, 64)}, (32, 32, 3), 10, 96),
    "mlp": ("mlp", {"input_dim": 512, "hidden": (1024, 1024), "num_classes": 10}, (512,), 10, 256),
}


def _build(name):
    import keras

    from autodist_keras.graph import zoo

    builder, kwargs, _, _, _ = MODELS[name]
    keras.utils.set_random_seed(0)
    return getattr(zoo, builder)(**kwargs)


def _plan(name, cluster, device):
    from autodist_keras.graph import ModelGraph
    from autodist_keras.strategies import disco

    batch = MODELS[name][4]
    return disco.plan(ModelGraph.from_keras(_build(name)), cluster, batch, devices=[device],
                      op_fusion=True)  # CPU plans get no regions unless forced


def _times(name, cluster, plan, op_fusion, steps, warmup, **options):
    """Trains `name` under `plan` and returns `(step times, strategy)`."""
    import keras
    import numpy as np

    from autodist_keras import AutoStrategy
    from autodist_keras.timing import StepTimer

    _, _, shape, classes, batch = MODELS[name]
    strategy = AutoStrategy("disco", cluster=cluster, plan=plan, op_fusion=op_fusion, **options)
    with strategy.scope():
        model = _build(name)
        model.compile(optimizer="sgd",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    n = batch * (steps + warmup)
    x = rng.normal(size=(n, *shape)).astype("float32")
    y = rng.integers(0, classes, size=(n,)).astype("int32")
    timer = StepTimer(warmup=warmup)
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[timer])
    return timer.times_s, strategy


def compare(name, cluster, device, args, run_info, **options):
    """Alternates `args.rounds` rounds of regions off and on for one model (measured).

    Args:
        name: A key of `MODELS`.
        cluster, device: Where Disco plans and the model trains.
        args: The parsed `--steps`, `--warmup` and `--rounds`.
        run_info: Callable returning the adapter's run facts for a strategy
            (they hold `op_fusion_regions`).
        **options: More `AutoStrategy` options.

    Returns:
        `(row, info)`: the JSON-ready result row and the run facts of the
        last "on" run.
    """
    plan = _plan(name, cluster, device)
    times = {"off": [], "on": []}
    realised, info = {}, {}
    for _ in range(args.rounds):
        for side in ("off", "on"):
            t, strategy = _times(name, cluster, plan, side, args.steps, args.warmup, **options)
            times[side] += t
            info = run_info(strategy)
            realised[side] = info.get("op_fusion_regions", 0)
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    row = {
        "regions": len([r for r in plan.op_fusion if len(r) > 1]),
        "regions_realised": realised,
        "median_step_s_off": off,
        "median_step_s_on": on,
        "steps_each": len(times["off"]),
        "off_over_on": round(off / on, 3),
    }
    return row, info


def add_arguments(parser):
    """The arguments both op-fusion benchmarks take, checked by argparse."""
    parser.add_argument("--steps", type=positive_int, default=30,
                        help="measured steps per round and side (at least 1)")
    parser.add_argument("--warmup", type=non_negative_int, default=5)
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--models", type=name_list(MODELS), default=["cnn"],
                        help=f"comma-separated, from {', '.join(MODELS)} (the MLP has no "
                             "regions)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args()

    from autodist_keras import Cluster

    from autodist_keras import AutoStrategy

    line = {"benchmark": "op_fusion_xla", "versions": versions(["tensorflow"]),
            "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "results": {}}
    try:
        cluster = Cluster.cpu_testbed()
        AutoStrategy("data_parallel", cluster=cluster).adapter  # logical devices, before any TF op
    except Exception as e:  # reported in the JSON line; the exit code says it failed
        line["error"] = error_text(e)
        print(f"error: {line['error']}")
        print(json.dumps(line))
        return 1
    device = cluster.names[0]
    print(f"op_fusion_xla: {platform.node() or 'machine'}, {os.cpu_count()} cores, device "
          f"{device}; {args.steps} measured steps after {args.warmup} warm-up, "
          f"{args.rounds} alternating rounds per side; load {os.getloadavg()[0]:.1f}")
    results = line["results"]
    for name in args.models:
        try:
            row, _ = compare(name, cluster, device, args, lambda s: s.adapter.runtime_info)
        except Exception as e:  # reported in the JSON line; the exit code says it failed
            results[name] = {"error": error_text(e)}
            print(f"{name:4s} error: {results[name]['error']}")
            continue
        results[name] = row
        off, on = row["median_step_s_off"], row["median_step_s_on"]
        print(f"{name:4s} {row['regions']} regions  off {off * 1e3:.1f} ms  on (XLA) "
              f"{on * 1e3:.1f} ms  off/on {row['off_over_on']:.3f}x (measured)")
    line["load_after"] = os.getloadavg()[0]
    print(json.dumps(line))
    return exit_code(results)


if __name__ == "__main__":
    sys.exit(main())
