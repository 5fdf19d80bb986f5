"""The `autodist-keras` command line.

```
autodist-keras devices [--cluster SPEC] [--json]
autodist-keras graph --model MODEL [--json]
```

MODEL is a keras.applications name (e.g. `ResNet50`, built without weights),
a built-in zoo name (`mlp`, `small_cnn`, `transformer_encoder`, `bert_large`),
a `.keras` file, or `module:function` returning a model. SPEC is a YAML
resource spec, a string such as `2xV100,4x1080Ti`, or `cpu_testbed`.
"""

import argparse
import json
import os
import sys

from autodist_keras.errors import AutodistError


def _cluster(spec):
    from autodist_keras.devices import Cluster

    if spec == "cpu_testbed":
        return Cluster.cpu_testbed()
    return Cluster.resolve(spec)


def _cmd_devices(args):
    cluster = _cluster(args.cluster)
    if args.json:
        data = cluster.to_dict()
        data["fingerprint"] = cluster.fingerprint()
        data["notes"] = list(getattr(cluster, "notes", []))
        print(json.dumps(data, indent=2))
    else:
        print(cluster.summary())
    return 0


def _cmd_graph(args):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from autodist_keras.graph import ModelGraph
    from autodist_keras.graph import load_model

    model = load_model(args.model)
    graph = ModelGraph.from_keras(model)
    if args.json:
        data = graph.to_dict()
        data["fingerprint"] = graph.fingerprint()
        print(json.dumps(data, indent=2))
    else:
        print(graph.summary())
    return 0


def build_parser():
    """Returns the argparse parser of the `autodist-keras` command."""
    parser = argparse.ArgumentParser(
        prog="autodist-keras",
        description="Plan and run distributed training of Keras 3 models on mixed GPUs.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("devices", help="show the devices of a cluster (default: this machine)")
    p.add_argument("--cluster", default=None, help="YAML spec, '2xV100,4x1080Ti' or 'cpu_testbed'")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_devices)

    p = sub.add_parser("graph", help="show the layer graph of a model")
    p.add_argument("--model", required=True, help="ResNet50, mlp, a .keras file or module:function")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_graph)
    return parser


def main(argv=None):
    """Runs the command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except AutodistError as e:
        print(f"autodist-keras {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
