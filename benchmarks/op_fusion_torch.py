"""Disco's op-fusion regions compiled by torch.compile on PyTorch: measured step time, on vs off.

The PyTorch counterpart of `benchmarks/op_fusion_xla.py`, with its models and
plans: Disco plans op fusion for one CPU testbed device (`disco.plan(...,
op_fusion=True)`, forced, since Disco plans no regions on CPUs by default);
the model then trains with `AutoStrategy(plan=..., op_fusion="on")` (each
region that is a chain of layers runs as one `torch.compile`d function,
`backends/torch_fusion.py`; TorchInductor by default, `--compiler` to
change) and `op_fusion="off"` (Keras's own layer-by-layer call). The sides
alternate `--rounds` times in one run; each side's figure is the median over
all its measured steps after `--warmup` warm-up steps per round (the
compilation happens in the first warm-up step of every "on" round).

Usage:
    python benchmarks/op_fusion_torch.py [--steps 30] [--rounds 3] [--compiler inductor]

The last line of output is one JSON object.
"""

import argparse
import json
import os
import platform
import statistics
import sys

os.environ["KERAS_BACKEND"] = "torch"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from op_fusion_xla import MODELS  # noqa: E402  (the same models, plans and timing)
from op_fusion_xla import _plan  # noqa: E402
from op_fusion_xla import _times  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", default="cnn", help="cnn, mlp (the MLP has no regions)")
    parser.add_argument("--compiler", default="inductor", help="torch.compile backend")
    args = parser.parse_args()

    from autodist_keras import Cluster

    cluster = Cluster.cpu_testbed()
    device = cluster.names[0]
    print(f"op_fusion_torch: {platform.node() or 'machine'}, {os.cpu_count()} cores, device "
          f"{device}, compiler {args.compiler}; {args.steps} measured steps after "
          f"{args.warmup} warm-up, {args.rounds} alternating rounds per side; load "
          f"{os.getloadavg()[0]:.1f}")
    results = {}
    for name in args.models.split(","):
        plan = _plan(name, cluster, device)
        regions = [r for r in plan.op_fusion if len(r) > 1]
        times = {"off": [], "on": []}
        realised, detail = {}, None
        for _ in range(args.rounds):
            for side in ("off", "on"):
                t, strategy = _times(name, cluster, plan, side, args.steps, args.warmup,
                                     op_fusion_compiler=args.compiler)
                times[side] += t
                realised[side] = strategy.adapter.last_run.get("op_fusion_regions", 0)
                detail = strategy.adapter.last_run.get("op_fusion") or detail
        off, on = statistics.median(times["off"]), statistics.median(times["on"])
        results[name] = {
            "regions": len(regions),
            "regions_realised": realised,
            "fallbacks": (detail or {}).get("fallbacks"),
            "median_step_s_off": off,
            "median_step_s_on": on,
            "steps_each": len(times["off"]),
            "off_over_on": round(off / on, 3),
        }
        print(f"{name:4s} {len(regions)} regions ({realised.get('on', 0)} compiled)  off "
              f"{off * 1e3:.1f} ms  on ({args.compiler}) {on * 1e3:.1f} ms  off/on "
              f"{off / on:.3f}x (measured)")
    print(json.dumps({"benchmark": "op_fusion_torch", "compiler": args.compiler,
                      "load_after": os.getloadavg()[0], "results": results}))


if __name__ == "__main__":
    main()
