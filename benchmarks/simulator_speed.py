"""How long one simulated training step takes to compute (wall time, measured).

Cases:
- ResNet50 (keras.applications, weights=None), even data parallelism on
  8 x V100 in one node, global batch 256, DDP buckets of 25 MiB.
- A BERT-large sized encoder (autodist_keras.graph.zoo.bert_large: 24 blocks,
  d_model 1024, seq_len 512), even data parallelism on 64 x V100 (8 nodes of
  8, 25 Gbit/s Ethernet), global batch 512.
- The same BERT-large on HeteroG's testbed (2 x V100, 4 x 1080Ti, 2 x P100 on
  three nodes), proportional shares, parameter server on node0/gpu0.

Each case is simulated `--repeats` times with the default compute
de-duplication of identical replicas and `--repeats` times without it
(every device simulated), each after one untimed warm-up call; the minimum
and median wall times are reported. Every call passes `cache=False`, so each
timed call really simulates (with the default `cache=True` an identical
repeat returns the cached result, and only the first call would be timed).
Graph extraction and model building are not timed. The predicted step
times are printed for reference; they are predictions of the analytic cost
model, not measurements. The machine is whatever runs this script (printed).

Usage: `python benchmarks/simulator_speed.py [--repeats 10] [--quick]`.
The last line of output is one JSON object.
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

from _common import error_text  # noqa: E402
from _common import positive_int  # noqa: E402
from _common import versions  # noqa: E402


def _time(fn, repeats):
    """One untimed warm-up call of `fn`, then `repeats` timed calls."""
    fn()
    times = []
    result = None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return result, times


def _case(name, graph, cluster, plan, repeats, budget_s):
    from autodist_keras.estimator import simulate

    record = {
        "case": name,
        "layers": len(graph.nodes),
        "edges": len(graph.edges),
        "devices": len(plan.devices),
        "global_batch": plan.global_batch_size,
        "buckets": len(plan.buckets),
        "repeats": repeats,
        "budget_s": budget_s,
    }
    for dedupe in (True, False):
        # cache=False: a repeat of the same simulation must simulate again, not
        # return the simulator's cached result.
        result, times = _time(
            lambda: simulate(graph, cluster, plan, dedupe=dedupe, cache=False), repeats)
        key = "dedupe" if dedupe else "every_device"
        record[key] = {
            "min_s": min(times),
            "median_s": statistics.median(times),
            "tasks": result.num_tasks,
            "predicted_step_time_s": result.step_time_s,
            "feasible": result.feasible,
        }
    record["within_budget"] = record["dedupe"]["median_s"] < budget_s
    print(
        f"{name}: {record['layers']} layers, {record['devices']} devices; simulate() wall "
        f"time over {repeats} runs (after 1 warm-up, cache off): median "
        f"{record['dedupe']['median_s'] * 1e3:.1f} ms "
        f"(min {record['dedupe']['min_s'] * 1e3:.1f} ms, {record['dedupe']['tasks']} tasks) "
        f"with de-duplication, median {record['every_device']['median_s'] * 1e3:.1f} ms "
        f"({record['every_device']['tasks']} tasks) simulating every device; budget "
        f"{budget_s} s ({'within' if record['within_budget'] else 'OVER'} budget). "
        f"Predicted step time {record['dedupe']['predicted_step_time_s'] * 1e3:.1f} ms "
        "(a prediction)."
    )
    return record


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=positive_int, default=10,
                        help="timed simulate() calls per case and mode (at least 1)")
    parser.add_argument("--quick", action="store_true", help="ResNet50 case only")
    args = parser.parse_args(argv)

    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras

    from autodist_keras.devices import Cluster
    from autodist_keras.graph import ModelGraph
    from autodist_keras.graph import zoo
    from autodist_keras.strategies import baselines

    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(
        f"Machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} CPU(s), "
        f"Python {platform.python_version()}, Keras {keras.__version__} "
        f"({keras.backend.backend()} backend, used only to build the graphs)"
        + (f", load average {load[0]:.1f} at start" if load else "") + "."
    )
    records = []
    error = None
    try:
        started = time.perf_counter()
        resnet = ModelGraph.from_keras(keras.applications.ResNet50(weights=None))
        print(f"ResNet50 graph built in {time.perf_counter() - started:.1f} s (not timed below).")
        cluster = Cluster.from_string("8xV100")
        plan = baselines.data_parallel_even(resnet, cluster, 256)
        records.append(_case("resnet50_dp_8xV100", resnet, cluster, plan, args.repeats, 0.1))

        if not args.quick:
            started = time.perf_counter()
            bert = ModelGraph.from_keras(zoo.bert_large())
            print(f"BERT-large graph built in {time.perf_counter() - started:.1f} s "
                  "(not timed below).")
            cluster = Cluster.from_string(";".join(f"node{i}:8xV100" for i in range(8)))
            plan = baselines.data_parallel_even(bert, cluster, 512)
            records.append(_case("bert_large_dp_64xV100", bert, cluster, plan, args.repeats, 2.0))
            cluster = Cluster.from_string("node0:2xV100;node1:4x1080Ti;node2:2xP100")
            plan = baselines.proportional(bert, cluster, 64, sync="ps", ps_server="node0/gpu0")
            records.append(
                _case("bert_large_ps_heterog_testbed", bert, cluster, plan, args.repeats, 2.0)
            )
    except Exception as e:  # reported in the JSON line; the exit code says it failed
        error = error_text(e)
        print(f"error: {error}")

    summary = {
        "benchmark": "simulator_speed",
        "measured": "wall time of estimator.simulate() per call, seconds",
        "machine": {"cpus": os.cpu_count(), "processor": platform.machine(),
                    "load_average_at_start": load[0] if load else None,
                    **versions()},
        "warmup_calls": 1,
        "simulator_cache": False,
        "cases": records,
        **({"error": error} if error else {}),
    }
    print(json.dumps(summary))
    return 1 if error else 0


if __name__ == "__main__":
    sys.exit(main())
