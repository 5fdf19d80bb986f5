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
        [--cluster cpu_testbed|detect]

`--cluster detect` plans and trains on this machine's first detected device
(a GPU where there is one) instead of the CPU testbed's first device.

The last line of output is one JSON object.
"""

import argparse
import json
import os
import platform
import sys

os.environ["KERAS_BACKEND"] = "torch"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import error_text  # noqa: E402
from _common import exit_code  # noqa: E402
from _common import versions  # noqa: E402
from op_fusion_xla import add_arguments  # noqa: E402  (the same arguments)
from op_fusion_xla import compare  # noqa: E402  (the same models, plans and rounds)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--compiler", default="inductor", help="torch.compile backend")
    parser.add_argument("--cluster", choices=("cpu_testbed", "detect"), default="cpu_testbed")
    args = parser.parse_args()

    from autodist_keras import Cluster

    line = {"benchmark": "op_fusion_torch", "compiler": args.compiler, "device": None,
            "versions": versions(["torch"]), "steps": args.steps, "warmup": args.warmup,
            "rounds": args.rounds, "results": {}}
    try:
        cluster = Cluster.detect() if args.cluster == "detect" else Cluster.cpu_testbed()
    except Exception as e:  # reported in the JSON line; the exit code says it failed
        line["error"] = error_text(e)
        print(f"error: {line['error']}")
        print(json.dumps(line))
        return 1
    device = cluster.names[0]
    print(f"op_fusion_torch: {platform.node() or 'machine'}, {os.cpu_count()} cores, device "
          f"{device}, compiler {args.compiler}; {args.steps} measured steps after "
          f"{args.warmup} warm-up, {args.rounds} alternating rounds per side; load "
          f"{os.getloadavg()[0]:.1f}")
    results = line["results"]
    for name in args.models:
        try:
            row, info = compare(name, cluster, device, args, lambda s: s.adapter.last_run,
                                op_fusion_compiler=args.compiler)
        except Exception as e:  # reported in the JSON line; the exit code says it failed
            results[name] = {"error": error_text(e)}
            print(f"{name:4s} error: {results[name]['error']}")
            continue
        row["fallbacks"] = (info.get("op_fusion") or {}).get("fallbacks")
        results[name] = row
        off, on = row["median_step_s_off"], row["median_step_s_on"]
        print(f"{name:4s} {row['regions']} regions ({row['regions_realised'].get('on', 0)} "
              f"compiled)  off {off * 1e3:.1f} ms  on ({args.compiler}) {on * 1e3:.1f} ms  "
              f"off/on {row['off_over_on']:.3f}x (measured)")
    line.update(device=cluster.device(device).model, load_after=os.getloadavg()[0])
    print(json.dumps(line))
    return exit_code(results)


if __name__ == "__main__":
    sys.exit(main())
