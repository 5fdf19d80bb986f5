"""Benchmark: predicted step time of every planner family vs the baselines, and planning time.

For each model and cluster it plans with the baselines (even and
speed-proportional data parallelism, ring all-reduce, 25 MiB buckets; and,
for context, even data parallelism with one parameter server on the first
device, `data_parallel_even_ps`), every
planner family present (`strategies.fastt`, `strategies.heterog`,
`strategies.disco`: each module's `plan()`, with its default time budget),
and the auto search when one is exposed (`strategies.auto.choose_plan`, else
`strategies.selection.choose_plan`; plan cache off). It reports each plan's
predicted step time, which is the simulator's prediction on the analytic
cost model (catalog GPU figures: predictions, not measurements), and each
planner's planning time, measured on this machine as wall time and as CPU
(process) time, one run per planner and case. Planners stop at their wall
time budgets, so a loaded machine gets less search; the load average at
start is printed.

Models (built from Keras layers, no downloads): VGG19, ResNet50, ResNet152,
InceptionV3, MobileNetV2, DenseNet121 (`keras.applications`, weights=None,
224x224 or 299x299 inputs), a Transformer encoder (12 blocks, d_model 512,
8 heads, sequence 128, vocabulary 30000) and a BERT-large sized encoder (24
blocks, d_model 1024, 16 heads, sequence 512).

Clusters: `examples/clusters/hetero_testbed.yaml` (HeteroG's 2xV100 +
4x1080Ti + 2xP100), `v100x8_nvlink.yaml`, `a100x4_t4x4.yaml`, and `mixed16`,
a 16-GPU mixed string cluster (`node0:4xV100;node1:4x1080Ti;node2:4xP100;
node3:4xT4`) for the planning-time figure.

Global batch: 32 samples per device (`--batch-per-device`), except
BERT-large at sequence 512: 2 per device. Counting what attention keeps for
backward (its H x T x T probabilities, since session 15), an 11 GB GTX 1080 Ti
holds 3 samples of it after the weights and Adam's slots (predicted; Google's
BERT README fits none at sequence 512 on a 12 GB card in TensorFlow 1).

Summary: on the HeteroG testbed, the geometric-mean speedup of the best
family (and of auto) over even and over proportional data parallelism, and
whether it is never slower than either; on 8xV100, whether it is never slower
than data parallelism; on mixed16, each planner's planning time. Each
geometric mean has a `<name>_models` entry beside it: how many models it is
over (the JSON and the printed line say so). `targets`: each of `TARGETS`
with its value and `met`; a target whose figure this run did not produce (its
cluster not in `--clusters`, or `--no-auto`) has `met: null` and a `note`
saying it was not run, which is not a failure.

Usage: `python benchmarks/plan_quality.py [--models ResNet50,VGG19]
[--clusters hetero_testbed,mixed16] [--batch-per-device 32] [--no-auto]
[--no-budget]` (`--no-budget`: families stop only at their deterministic
work limits, so a loaded machine gives the same plans as an idle one).
The last line of output is one JSON object.
"""

import argparse
import importlib
import json
import math
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = ("VGG19", "ResNet50", "ResNet152", "InceptionV3", "MobileNetV2", "DenseNet121",
          "Transformer", "BERT-large")
CLUSTERS = {
    "hetero_testbed": os.path.join(ROOT, "examples", "clusters", "hetero_testbed.yaml"),
    "v100x8_nvlink": os.path.join(ROOT, "examples", "clusters", "v100x8_nvlink.yaml"),
    "a100x4_t4x4": os.path.join(ROOT, "examples", "clusters", "a100x4_t4x4.yaml"),
    "mixed16": "node0:4xV100;node1:4x1080Ti;node2:4xP100;node3:4xT4",
}
FAMILIES = ("fastt", "heterog", "disco")
BASELINES = ("data_parallel_even", "proportional", "data_parallel_even_ps")
# The targets are against the first two (ring all-reduce, DDP-style buckets).
# `data_parallel_even_ps` (even shares, one parameter server on the first device) is
# context: how much the speedup depends on which data parallelism it is measured against.
PER_DEVICE = {"BERT-large": 2}
TRANSFORMER = dict(num_layers=12, d_model=512, heads=8, seq_len=128, vocab=30000)


def build_graph(name):
    """The model's `ModelGraph` (the Keras model itself is dropped)."""
    import keras

    from autodist_keras.graph import ModelGraph
    from autodist_keras.graph import load_model
    from autodist_keras.graph import zoo

    if name == "Transformer":
        model = zoo.transformer_encoder(**TRANSFORMER, name="transformer")
    elif name == "BERT-large":
        model = zoo.bert_large()
    else:
        model = load_model(name)
    graph = ModelGraph.from_keras(model)
    del model
    keras.backend.clear_session()
    return graph


def families():
    """Planner modules exposing `plan()`, and the auto search if exposed."""
    found, missing = {}, []
    for name in FAMILIES:
        try:
            module = importlib.import_module(f"autodist_keras.strategies.{name}")
        except ImportError:
            module = None
        if module is not None and hasattr(module, "plan"):
            found[name] = module.plan
        else:
            missing.append(name)
    auto = None
    for where in ("auto", "selection"):
        module = importlib.import_module(f"autodist_keras.strategies.{where}")
        if hasattr(module, "choose_plan"):
            auto = (f"strategies.{where}.choose_plan", module.choose_plan)
            break
    return found, missing, auto


TARGETS = {
    "hetero_testbed_auto_geomean_speedup_over_data_parallel_even": 1.5,
    "hetero_testbed_auto_geomean_speedup_over_proportional": 1.15,
    "mixed16_max_auto_planning_wall_s": 10.0,
}


def headroom(graph, cluster, batch, proportional_result):
    """Why a plan cannot beat data parallelism by much: the balanced-compute bound.

    The bound is the step time of data parallelism with perfectly balanced
    whole-sample shares and free communication: the smallest `T` such that the
    devices together process `batch` samples, each device's share being the
    most samples whose forward + backward (analytic cost model) fit in `T`.
    No plan without op fusion or a cheaper cost per sample can be faster than
    about this (placement plans run layers at a larger batch, so it is not a
    strict bound for them). Also returns the critical device's exposed
    communication and idle time in proportional data parallelism. Every
    figure is a prediction.
    """
    from autodist_keras.estimator.cost_model import AnalyticCostModel

    cost = AnalyticCostModel(cluster)
    classes = {}
    for name in cluster.names:
        classes.setdefault(cluster.device(name).model, []).append(name)
    nodes = list(graph.nodes.values())
    memo = {}

    def step(model, samples):
        key = (model, samples)
        if key not in memo:
            device = cluster.device(classes[model][0])
            memo[key] = sum(cost.layer_time(n, device, samples, phase)
                            for n in nodes for phase in ("forward", "backward"))
        return memo[key]

    def fits(model, limit):  # most whole samples whose step fits in `limit`
        lo, hi = 0, batch
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if step(model, mid) <= limit:
                lo = mid
            else:
                hi = mid - 1
        return lo

    lo, hi = 0.0, max(step(m, batch) for m in classes)
    for _ in range(40):
        mid = (lo + hi) / 2
        if sum(fits(m, mid) * len(d) for m, d in classes.items()) >= batch:
            hi = mid
        else:
            lo = mid
    crit = proportional_result.per_device[proportional_result.critical_device]
    return {
        "balanced_compute_bound_s": hi,
        "proportional_critical_device": proportional_result.critical_device,
        "proportional_critical_busy_s": crit.busy_s,
        "proportional_critical_exposed_comm_s": crit.exposed_comm_s,
        "proportional_critical_idle_s": crit.idle_s,
    }


def run_case(graph, cluster, batch, planners, auto, budget=None, bound=False):
    """Plans one model on one cluster with everything; returns a record."""
    from autodist_keras.errors import AutodistError
    from autodist_keras.estimator import simulate
    from autodist_keras.strategies import baselines
    from autodist_keras.strategies.selection import runnable_anywhere

    record = {"global_batch": batch, "devices": len(cluster), "plans": {}}
    builders = {
        "data_parallel_even": baselines.data_parallel_even,
        "proportional": baselines.proportional,
        "data_parallel_even_ps": lambda g, c, b: baselines.data_parallel_even(g, c, b, sync="ps"),
    }
    for name in BASELINES:
        started = time.perf_counter()
        try:
            plan = builders[name](graph, cluster, batch)
            result = simulate(graph, cluster, plan)
            entry = {"step_time_s": result.step_time_s, "feasible": result.feasible}
            if bound and name == "proportional":
                record["headroom"] = headroom(graph, cluster, batch, result)
        except AutodistError as e:
            entry = {"step_time_s": None, "feasible": False, "error": str(e)[:200]}
        entry["planning_time_s"] = time.perf_counter() - started
        record["plans"][name] = entry
    for name, plan_fn in planners.items():
        started = time.perf_counter()
        cpu = time.process_time()
        try:
            kwargs = {} if budget is None else {"time_budget_s": budget}
            plan = plan_fn(graph, cluster, batch, **kwargs)
            elapsed = time.perf_counter() - started
            entry = {
                "step_time_s": plan.prediction.step_time_s,
                "feasible": plan.prediction.feasible,
                "groups": len(plan.groups),
                # A placement/hybrid plan across nodes: no runtime runs it yet, and auto
                # does not choose it (selection.runnable_anywhere).
                "runnable": runnable_anywhere(plan, cluster)[0],
                "notes": list(plan.notes),
            }
        except AutodistError as e:
            elapsed = time.perf_counter() - started
            entry = {"step_time_s": None, "feasible": False, "error": str(e)[:200]}
        entry["planning_time_s"] = elapsed
        entry["planning_cpu_s"] = time.process_time() - cpu
        entry["budget_hit"] = any("budget" in n for n in entry.get("notes", []))
        record["plans"][name] = entry
    if auto is not None:
        started = time.perf_counter()
        cpu = time.process_time()
        try:
            plan, _ = auto[1](graph, cluster, batch, use_cache=False)
            entry = {
                "step_time_s": plan.prediction.step_time_s,
                "feasible": plan.prediction.feasible,
                "chosen": plan.provenance.planner,
            }
        except AutodistError as e:
            entry = {"step_time_s": None, "feasible": False, "error": str(e)[:200]}
        entry["planning_time_s"] = time.perf_counter() - started
        entry["planning_cpu_s"] = time.process_time() - cpu
        record["plans"]["auto"] = entry
    usable = {
        k: v["step_time_s"] for k, v in record["plans"].items()
        if k in planners and v.get("feasible") and v.get("step_time_s")
    }
    if usable:
        best = min(usable, key=usable.get)
        record["best_family"] = best
        record["best_family_step_time_s"] = usable[best]
    return record


def _speedups(records, cluster, column, against):
    ratios = []
    for (model, name), rec in records.items():
        if name != cluster:
            continue
        mine = rec.get("best_family_step_time_s") if column == "best_family" else (
            rec["plans"].get(column, {}).get("step_time_s")
        )
        other = rec["plans"].get(against, {})
        if mine and other.get("step_time_s") and other.get("feasible"):
            ratios.append((model, other["step_time_s"] / mine))
    return ratios


def _geomean(values):
    values = [v for v in values if v and v > 0]
    if not values:
        return None
    return math.exp(sum(math.log(v) for v in values) / len(values))


def summarise(records, have_auto):
    summary = {}
    columns = ["best_family"] + (["auto"] if have_auto else [])
    for column in columns:
        for against in BASELINES:
            ratios = _speedups(records, "hetero_testbed", column, against)
            if ratios:
                key = f"hetero_testbed_{column}_geomean_speedup_over_{against}"
                summary[key] = _geomean([r for _, r in ratios])
                summary[f"{key}_models"] = len(ratios)  # how many models it is over
                summary[f"hetero_testbed_{column}_never_slower_than_{against}"] = all(
                    r >= 1 - 1e-9 for _, r in ratios
                )
        ratios = _speedups(records, "v100x8_nvlink", column, "data_parallel_even")
        if ratios:
            summary[f"v100x8_{column}_never_slower_than_data_parallel"] = all(
                r >= 1 - 1e-9 for _, r in ratios
            )
    for key, field in (("time", "planning_time_s"), ("cpu", "planning_cpu_s")):
        times = {}
        for (model, name), rec in records.items():
            if name != "mixed16":
                continue
            for planner, entry in rec["plans"].items():
                if planner not in BASELINES:
                    times.setdefault(planner, {})[model] = entry[field]
        if times:
            summary[f"mixed16_planning_{key}_s"] = times
            summary[f"mixed16_max_planning_{key}_s"] = {
                p: max(v.values()) for p, v in times.items()
            }
    return summary


def targets(summary, clusters, have_auto):
    """Each target of `TARGETS` with its value and whether it was met in this run.

    A target whose figure this run did not produce (its cluster not in
    `--clusters`, or the auto search not run) has `met: None` and a `note`
    saying why: not run, which is not the same as failed.
    """
    out = {}
    for key, target in TARGETS.items():
        cluster = "mixed16" if key.startswith("mixed16") else "hetero_testbed"
        if cluster == "mixed16":
            value = summary.get("mixed16_max_planning_time_s", {}).get("auto")
            met = None if value is None else value < target
        else:
            value = summary.get(key)
            met = None if value is None else value >= target
        entry = {"target": target, "value": value, "met": met}
        if cluster == "hetero_testbed":
            entry["models"] = summary.get(f"{key}_models", 0)
        if value is None:
            if cluster not in clusters:
                entry["note"] = f"not run: {cluster} was not in --clusters"
            elif not have_auto:
                entry["note"] = "not run: the auto search was not run (--no-auto or not exposed)"
            else:
                entry["note"] = (f"not measured: no figure for auto on {cluster} in this run "
                                 "(no feasible plan to compare)")
        out[key] = entry
    return out


def _print_summary(summary):
    """The summary's figures, one per line; a geometric mean says over how many models."""
    for key, value in summary.items():
        if key.endswith("_models") or isinstance(value, dict):
            continue
        if isinstance(value, float):
            models = summary.get(f"{key}_models")
            print(f"{key}: {value:.3f}" + (f" (over {models} model(s))" if models else ""))
        else:
            print(f"{key}: {value}")


def print_table(records, columns):
    header = ["model", "cluster", "batch"] + [f"{c} ms" for c in columns] + ["best", "plan s"]
    rows = []
    for (model, cluster), rec in records.items():
        row = [model, cluster, str(rec["global_batch"])]
        for c in columns:
            e = rec["plans"].get(c)
            if e is None or e.get("step_time_s") is None:
                row.append("-")
            else:
                row.append(f"{e['step_time_s'] * 1e3:.1f}" + ("" if e["feasible"] else " (OOM)")
                           + (" (no runtime)" if e.get("runnable") is False else ""))
        row.append(rec.get("best_family", "-"))
        row.append(" ".join(
            f"{c[:1]}{rec['plans'][c]['planning_time_s']:.1f}" for c in columns
            if c in rec["plans"] and c not in BASELINES
        ))
        rows.append(row)
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="Predicted step time (simulator) and planning time (measured)")
        for h in header:
            table.add_column(h)
        for row in rows:
            table.add_row(*row)
        Console(width=160).print(table)
    except ImportError:
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
        for row in rows:
            print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--clusters", default=",".join(CLUSTERS))
    from _common import error_text
    from _common import positive_int
    from _common import versions

    parser.add_argument("--batch-per-device", type=positive_int, default=None,
                        help="samples per device for every model (default 32; BERT-large 2)")
    parser.add_argument("--no-auto", action="store_true", help="skip the auto search column")
    parser.add_argument(
        "--no-budget", action="store_true",
        help="run each family without its wall-time budget (time_budget_s=1e9): its search "
        "then stops only at its deterministic work limits, so the figures do not depend on "
        "the machine's load (the auto search keeps its own budgets)")
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    clusters = [c for c in args.clusters.split(",") if c]
    unknown += [c for c in clusters if c not in CLUSTERS]
    if unknown or not models or not clusters:
        parser.error(f"unknown model or cluster {unknown or [args.models, args.clusters]}; "
                     f"models: {MODELS}; clusters: {list(CLUSTERS)}")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras

    planners, missing, auto = families()
    if args.no_auto:
        auto = None
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU(s), load average "
        f"{load[0]:.1f} at start, Python {platform.python_version()}, Keras "
        f"{keras.__version__} ({keras.backend.backend()} backend, used only to build graphs)."
    )
    print(f"Planner families: {', '.join(planners) or 'none'}"
          + (f"; missing (skipped): {', '.join(missing)}" if missing else ""))
    print(f"Auto search: {auto[0] if auto else 'not run (skipped or not exposed)'}")
    if args.no_budget:
        print("Families run without wall-time budgets (--no-budget): only their work limits "
              "stop them.")
    print("Step times are predictions of the simulator (analytic cost model, catalog GPU "
          "figures); planning times are measured wall time, one run each.")
    records = {}
    error = None
    started = time.perf_counter()
    try:
        _run_cases(models, clusters, args, planners, auto, records)
    except Exception as e:  # reported in the JSON line; the exit code says it failed
        error = error_text(e)
        print(f"error: {error}  (the figures below are of the cases run before it)")
    columns = list(BASELINES) + list(planners) + (["auto"] if auto else [])
    print_table(records, columns)
    summary = summarise(records, auto is not None)
    _print_summary(summary)
    bounds = [
        (m, rec["plans"]["data_parallel_even"]["step_time_s"],
         rec["plans"]["proportional"]["step_time_s"], rec["headroom"])
        for (m, c), rec in records.items()
        if c == "hetero_testbed" and "headroom" in rec
        and rec["plans"]["data_parallel_even"].get("step_time_s")
        and rec["plans"]["proportional"].get("step_time_s")
    ]
    if bounds:
        print("Headroom on hetero_testbed (predicted): balanced-compute bound of data "
              "parallelism (free communication) and proportional DP's critical device")
        for m, even, prop, h in bounds:
            b = h["balanced_compute_bound_s"]
            print(f"  {m}: bound {b * 1e3:.1f} ms = {even / b:.3f}x over even, {prop / b:.3f}x "
                  f"over proportional; proportional critical {h['proportional_critical_device']}"
                  f" busy {h['proportional_critical_busy_s'] * 1e3:.1f} ms, exposed comm "
                  f"{h['proportional_critical_exposed_comm_s'] * 1e3:.1f} ms")
        summary["hetero_testbed_bound_geomean_speedup_over_data_parallel_even"] = _geomean(
            [e / h["balanced_compute_bound_s"] for _, e, _, h in bounds])
        summary["hetero_testbed_bound_geomean_speedup_over_proportional"] = _geomean(
            [p / h["balanced_compute_bound_s"] for _, _, p, h in bounds])
        for against in ("data_parallel_even", "proportional"):
            summary[f"hetero_testbed_bound_geomean_speedup_over_{against}_models"] = len(bounds)
    summary["targets"] = targets(summary, clusters, auto is not None)
    for key, entry in summary["targets"].items():
        state = {True: "met", False: "NOT met", None: "not run"}[entry["met"]]
        print(f"target {key}: {state}, value "
              + ("-" if entry["value"] is None else f"{entry['value']:.3f}")
              + f" vs {entry['target']}"
              + (f" over {entry['models']} model(s)" if entry.get("models") else "")
              + (f" ({entry['note']})" if entry.get("note") else ""))
    for planner, value in summary.get("mixed16_max_planning_time_s", {}).items():
        cpu = summary["mixed16_max_planning_cpu_s"][planner]
        print(f"max planning time on mixed16 ({planner}): {value:.2f} s wall, "
              f"{cpu:.2f} s CPU (process time; the wall time includes waiting on a loaded "
              "machine)")
    out = {
        "benchmark": "plan_quality",
        "measured": "planning wall and CPU time (s); step times are simulator predictions",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_average_at_start": load[0] if load else None},
        "versions": versions(),
        "families": list(planners),
        "missing_families": missing,
        "auto": auto[0] if auto else None,
        "batch_rule": "32 x devices (BERT-large: 2 x devices)" if not args.batch_per_device
        else f"{args.batch_per_device} x devices",
        "repetitions": 1,
        "family_budgets": "none (--no-budget)" if args.no_budget else "defaults",
        "total_time_s": time.perf_counter() - started,
        "cases": [
            dict(model=m, cluster=c, **{k: v for k, v in rec.items()})
            for (m, c), rec in records.items()
        ],
        "summary": summary,
        **({"error": error} if error else {}),
    }
    for case in out["cases"]:
        for entry in case["plans"].values():
            entry.pop("notes", None)
    print(json.dumps(out))
    return 1 if error else 0


def _run_cases(models, clusters, args, planners, auto, records):
    """Plans every model on every cluster into `records[(model, cluster)]`."""
    from autodist_keras.devices import Cluster

    cluster_objs = {name: Cluster.resolve(CLUSTERS[name]) for name in clusters}
    for model in models:
        t0 = time.perf_counter()
        graph = build_graph(model)
        print(f"{model}: {len(graph.nodes)} layers, {graph.param_bytes / 2**20:.0f} MiB of "
              f"parameters; graph built in {time.perf_counter() - t0:.1f} s (not timed below).",
              flush=True)
        for name in clusters:
            cluster = cluster_objs[name]
            per = args.batch_per_device or PER_DEVICE.get(model, 32)
            rec = run_case(graph, cluster, per * len(cluster), planners, auto,
                           budget=1e9 if args.no_budget else None,
                           bound=name == "hetero_testbed")
            records[(model, name)] = rec
            line = ", ".join(
                f"{k} {v['step_time_s'] * 1e3:.1f} ms" + ("" if v["feasible"] else " (OOM)")
                if v.get("step_time_s") else f"{k} -"
                for k, v in rec["plans"].items()
            )
            print(f"  {name} (batch {rec['global_batch']}): {line}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
