"""Benchmark: time of `ModelGraph.from_keras` and its FLOP counts vs published figures.

Measures, on this machine and the active Keras backend, the wall time of
extracting the graph of five keras.applications models (weights=None, default
input sizes) and a 12-layer Transformer encoder built from Keras layers
(d_model 512, 8 heads, sequence 128, vocabulary 30000): one warm-up
extraction, then the median (and min, max) of `--repeats` timed extractions.
Model building is timed once and reported separately; it is not part of the
extraction time. Also prints the counted multiply-adds next to the published
figures (`autodist_keras.graph.published`).

Run: `KERAS_BACKEND=tensorflow python benchmarks/graph_extraction.py`
The last line of the output is one JSON object with every figure.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

MODELS = ("ResNet50", "VGG16", "MobileNetV2", "InceptionV3", "DenseNet121", "transformer_encoder_12")
TRANSFORMER = dict(num_layers=12, d_model=512, heads=8, seq_len=128, vocab=30000)


def build(name):
    from autodist_keras.graph import load_model

    if name == "transformer_encoder_12":
        return load_model("transformer_encoder", **TRANSFORMER, name=name)
    return load_model(name)


def measure(name, repeats):
    import keras

    from autodist_keras.graph import ModelGraph
    from autodist_keras.graph.published import PUBLISHED_MULTIPLY_ADDS

    keras.utils.set_random_seed(0)
    started = time.perf_counter()
    model = build(name)
    build_s = time.perf_counter() - started
    ModelGraph.from_keras(model)  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        graph = ModelGraph.from_keras(model)
        times.append(time.perf_counter() - started)
    reference = PUBLISHED_MULTIPLY_ADDS.get(name)
    result = {
        "build_s": round(build_s, 4),
        "extract_median_s": round(statistics.median(times), 5),
        "extract_min_s": round(min(times), 5),
        "extract_max_s": round(max(times), 5),
        "nodes": len(graph.nodes),
        "edges": len(graph.edges),
        "params": graph.params,
        "count_params": model.count_params(),
        "multiply_adds": graph.multiply_adds,
        "forward_flops": graph.forward_flops,
        "backward_flops": graph.backward_flops,
        "activation_bytes": graph.activation_bytes,
        "estimated_nodes": sum(n.estimated for n in graph.nodes.values()),
        "warnings": len(graph.warnings),
        "published_multiply_adds": reference["value"] if reference else None,
        "published_source": reference["source"] if reference else None,
        "deviation_pct": (
            round(100 * (graph.multiply_adds / reference["value"] - 1), 2) if reference else None
        ),
    }
    del model
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    from _common import error_text
    from _common import exit_code
    from _common import positive_int
    from _common import versions

    parser.add_argument("--repeats", type=positive_int, default=5,
                        help="timed extractions per model (at least 1)")
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=MODELS)
    args = parser.parse_args(argv)

    import keras
    from rich.console import Console
    from rich.table import Table

    results = {}
    for name in args.models:
        try:
            results[name] = measure(name, args.repeats)
        except Exception as e:  # reported in the JSON line; the exit code says it failed
            results[name] = {"error": error_text(e)}
            print(f"{name}: error: {results[name]['error']}")
    measured = {name: r for name, r in results.items() if "error" not in r}

    console = Console(width=140)
    console.print(
        f"Graph extraction on {platform.processor() or platform.machine()} "
        f"({os.cpu_count()} CPUs), Keras {keras.__version__}, backend "
        f"{keras.backend.backend()}: median of {args.repeats} timed runs after 1 warm-up"
    )
    timing = Table(title="Extraction time (measured)")
    for column in ("model", "nodes", "edges", "build s", "extract median s", "min s", "max s"):
        timing.add_column(column, justify="left" if column == "model" else "right")
    for name, r in measured.items():
        timing.add_row(name, str(r["nodes"]), str(r["edges"]), f"{r['build_s']:.2f}",
                       f"{r['extract_median_s']:.4f}", f"{r['extract_min_s']:.4f}",
                       f"{r['extract_max_s']:.4f}")
    console.print(timing)
    flops = Table(title="Forward multiply-adds per sample vs published figures (batch 1)")
    for column in ("model", "counted G", "published G", "deviation", "fwd GFLOP", "params",
                   "= count_params", "source"):
        flops.add_column(column, justify="left" if column in ("model", "source") else "right")
    for name, r in measured.items():
        published = r["published_multiply_adds"]
        flops.add_row(
            name, f"{r['multiply_adds'] / 1e9:.3f}",
            f"{published / 1e9:.3f}" if published else "-",
            f"{r['deviation_pct']:+.1f}%" if published else "-",
            f"{r['forward_flops'] / 1e9:.3f}", f"{r['params']:,}",
            str(r["params"] == r["count_params"]), r["published_source"] or "-",
        )
    console.print(flops)
    print(json.dumps({
        "benchmark": "graph_extraction",
        "backend": keras.backend.backend(),
        "keras": keras.__version__,
        "python": platform.python_version(),
        "versions": versions(),
        "machine": {"processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "system": platform.system()},
        "repeats": args.repeats,
        "warmup": 1,
        "transformer_config": TRANSFORMER,
        "models": results,
    }))
    return exit_code(results)


if __name__ == "__main__":
    sys.exit(main())
