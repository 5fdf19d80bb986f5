"""The `autodist-keras` command line.

```
autodist-keras devices [--cluster SPEC] [--json]
autodist-keras graph --model MODEL [--import MODULE] [--json]
autodist-keras plan --model MODEL --cluster SPEC [--strategy NAME] [--batch-size N] [--backend B] [--json] [--out plan.json] [--import MODULE]
autodist-keras simulate --model MODEL --cluster SPEC --plan PLAN.json [--backend B] [--trace out.json] [--json] [--import MODULE]
autodist-keras profile --model MODEL [--cluster cpu_testbed] [--batch-sizes 8,32] [--budget-s 60]
autodist-keras launch --nprocs N script.py [args...]
```

Every step time these commands print is predicted (by the learned estimator or
the simulator, as each output names), not measured.

MODEL is a keras.applications name (e.g. `ResNet50`, built without weights),
a built-in zoo name (`mlp`, `small_cnn`, `transformer_encoder`, `bert_large`),
a `.keras` file (`--import MODULE` first imports a module that registers its
custom layers), or `module:function` returning a model. SPEC is a YAML
resource spec, a string such as `2xV100,4x1080Ti`, or `cpu_testbed`.
"""

import argparse
import os
import sys

from autodist_keras import strict_json
from autodist_keras.errors import AutodistError


def _cluster(spec):
    from autodist_keras.devices import Cluster

    if spec == "cpu_testbed":
        return Cluster.cpu_testbed()
    return Cluster.resolve(spec)


def _load_graph(spec, imports=()):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from autodist_keras.graph import ModelGraph
    from autodist_keras.graph import load_model
    from autodist_keras.graph.loading import import_user_module

    for module in imports or ():
        import_user_module(module)
    return ModelGraph.from_keras(load_model(spec))


def _print_json(data, what):
    """Prints `data` as standard JSON (`strict_json`: NaN and Infinity refused)."""
    print(strict_json.dumps(data, what, AutodistError, indent=2, sort_keys=False))


def _show(obj, as_json, **extra):
    """Prints `obj.summary()`, or with `--json` its dict, fingerprint and `extra`."""
    if as_json:
        data = obj.to_dict()
        data["fingerprint"] = obj.fingerprint()
        data.update(extra)
        _print_json(data, f"the {type(obj).__name__}")
    else:
        print(obj.summary())
    return 0


def _cmd_devices(args):
    cluster = _cluster(args.cluster)
    return _show(cluster, args.json, notes=list(getattr(cluster, "notes", [])))


def _cmd_graph(args):
    return _show(_load_graph(args.model, args.imports), args.json)


def _cmd_plan(args):
    import time

    from autodist_keras.strategies import selection
    from autodist_keras.strategies.auto import BASELINE_FOR_NAME
    from autodist_keras.strategies.auto import FAMILY_NAMES
    from autodist_keras.strategies.auto import STRATEGY_NAMES
    from autodist_keras.strategies.auto import not_made_error
    from autodist_keras.errors import StrategyError
    from autodist_keras.strategies.explain import explanation
    from autodist_keras.strategies.explain import planner_internal
    from autodist_keras.devices.detect import active_keras_backend
    from autodist_keras.strategies.plan import output_target

    if args.strategy not in STRATEGY_NAMES:
        from autodist_keras.strategies.auto import _close_names

        # Names are lower case with underscores: `Proportional`, `data-parallel` are typos.
        hint = _close_names([args.strategy.lower().replace("-", "_")], STRATEGY_NAMES, n=1)
        raise StrategyError(
            f"Unknown strategy.{hint} Valid names: "
            f"{', '.join(STRATEGY_NAMES)}. Received: {args.strategy!r}"
        )
    if args.out is not None:  # a bad output path ("" included) fails before the planning
        output_target(args.out, "plan.json")
    cluster = _cluster(args.cluster)
    graph = _load_graph(args.model, args.imports)
    batch_size = args.batch_size or 32 * len(cluster)
    started = time.perf_counter()
    if args.strategy == "auto":
        plan, candidates = selection.choose_plan(
            graph, cluster, batch_size, use_cache=False, show_progress=not args.json
        )
    else:
        families = [args.strategy] if args.strategy in FAMILY_NAMES else []
        # Scored as `auto` scores them, so a plan shows the same prediction either way.
        scorer = selection.resolve_scorer("learned")
        candidates = selection.build_candidates(graph, cluster, batch_size, families=families,
                                                scorer=scorer,
                                                options={"backend": active_keras_backend()})
        wanted = BASELINE_FOR_NAME.get(args.strategy, args.strategy)
        chosen = [c for c in candidates if c.name == wanted and c.plan is not None]
        if not chosen:
            raise not_made_error(args.strategy, candidates, cluster.names)
        plan = chosen[0].plan
        plan.provenance.backend = active_keras_backend()
        selection.note_scoring(plan, scorer, candidates)
        selection.record_candidates(plan, candidates)
    planning_time = time.perf_counter() - started
    runnable, why = selection.runnable_anywhere(plan, cluster, plan.provenance.backend)
    by_name = {c.name: c for c in candidates}
    even = by_name.get("data_parallel_even") or by_name.get("single_device")
    result = {
        "strategy": plan.provenance.candidate,
        "requested": args.strategy,
        "model": args.model,
        "cluster": args.cluster,
        "devices": len(cluster),
        "batch_size": batch_size,
        "predicted_step_time_s": plan.prediction.step_time_s,
        "scorer": plan.prediction.source,
        "backend": plan.provenance.backend,
        "baselines": {
            c.name: {"predicted_step_time_s": c.step_time_s, "feasible": c.feasible,
                     # False: built, but no runtime can run it (auto never chooses it);
                     # None: not built (`reason` says why)
                     "runnable": None if c.plan is None else c.executable is not False,
                     "reason": c.reason, "scorer": c.scorer}
            for c in candidates
        },
        # Figures the chosen planner recorded inside its own search (HeteroG's
        # seeds, e.g. proportional_hierarchical): not candidates, not in `baselines`.
        "planner_internal": planner_internal(plan),
        "speedup_vs_even": (
            even.step_time_s / plan.prediction.step_time_s
            if even is not None and even.step_time_s and even.feasible else None
        ),
        "planning_time_s": planning_time,
        "feasible": plan.prediction.feasible,
        "memory_per_device": dict(plan.prediction.peak_memory_bytes),
        "runnable": runnable,
        "not_runnable_reason": why or None,
        # Per device: batch share (data-parallel plans), layers, predicted busy time,
        # utilisation and memory, as explain() shows them.
        "per_device": explanation(plan, cluster, strategy_name=args.strategy)["devices"],
        "notes": list(plan.notes),
        "predicted": "all step times are predictions (the simulator's, or the learned "
                     "estimator's where `scorer` says so), not measurements; so are "
                     "`feasible`, `memory_per_device` (peak bytes) and `speedup_vs_even`. "
                     "Only `planning_time_s` is measured",
    }
    if args.out is not None:
        plan.to_json(args.out)
        result["plan_file"] = args.out
    if args.json:
        _print_json(result, "the plan summary")
    else:
        from autodist_keras.strategies.explain import render_text

        print(render_text(explanation(plan, cluster, strategy_name=args.strategy)))
        print(f"planning time: {planning_time:.2f} s (measured)")
        if args.out:
            print(f"plan written to {args.out}")
    return 0


def _cmd_simulate(args):
    from autodist_keras.estimator import simulate
    from autodist_keras.strategies.plan import Plan

    plan = Plan.from_json(args.plan)  # first: a bad plan file fails before the model loads
    if args.trace is not None:  # and a bad trace path ("" included) before the simulation
        from autodist_keras.strategies.plan import output_target

        output_target(args.trace, "trace.json")
    cluster = _cluster(args.cluster)
    graph = _load_graph(args.model, args.imports)
    for what, made_for, here in (
            ("model", plan.provenance.graph_fingerprint, graph.fingerprint()),
            ("cluster", plan.provenance.cluster_fingerprint, cluster.fingerprint())):
        if made_for and made_for != here:
            print(f"note: {args.plan} was made for another {what} (fingerprint {made_for[:12]}, "
                  f"this one {here[:12]}); simulating it here anyway", file=sys.stderr)
    from autodist_keras.devices.detect import active_keras_backend

    backend = active_keras_backend()
    if plan.provenance.backend and plan.provenance.backend != backend:
        print(f"note: {args.plan} was planned and predicted for the {plan.provenance.backend} "
              f"backend; this simulation is for {backend} (PyTorch pays eager host time per "
              "layer on GPUs, and plans no op fusion by default), so the figures differ. "
              f"Pass --backend {plan.provenance.backend} to compare like with like",
              file=sys.stderr)
    renamed, renames = plan.renamed_for(graph)
    if renamed is not None:
        # Numbered differently by Keras here (the same model's layers and model names;
        # for another model, the model names in its variable paths only).
        plan = renamed
        print(f"note: matched {len(renames)} layer or model name(s) of {args.plan} by Keras's "
              "per-process numbering (e.g. " + ", ".join(
                  f"{a} -> {b}" for a, b in list(renames.items())[:3]) + ")", file=sys.stderr)
    result = simulate(graph, cluster, plan)
    if args.trace is not None:
        result.export_trace(args.trace)
    if args.json:
        prediction = result.to_prediction()
        _print_json({
            "predicted_step_time_s": result.step_time_s,
            "feasible": result.feasible,
            "infeasible_reason": result.infeasible_reason,
            "critical_device": result.critical_device,
            "per_device": prediction.per_device,
            "peak_memory_bytes": prediction.peak_memory_bytes,
            "trace": args.trace,
            "source": prediction.source,
            "backend": backend,
            "plan_file_backend": plan.provenance.backend,
            # The plan file's own headline figure (e.g. the learned estimator's), when
            # it was written for this very plan.
            "plan_file_prediction": (
                {"step_time_s": plan.prediction.step_time_s, "source": plan.prediction.source}
                if plan.prediction is not None and plan.prediction_matches() else None),
        }, "the simulation")
    else:
        print(result.summary())
        print("(the discrete-event simulator's prediction", end="")
        if (plan.prediction is not None and plan.prediction_matches()
                and not plan.prediction.source.startswith("simulator (")):
            print(f"; the plan file's own, from the {plan.prediction.source}: "
                  f"{plan.prediction.step_time_s * 1e3:.3f} ms", end="")
        print(")")
        if args.trace:
            print(f"Chrome trace written to {args.trace} (open in Perfetto)")
    return 0


def _cmd_profile(args):
    from autodist_keras.estimator.profiler import profile_main

    return profile_main(args)


def _cmd_launch(args):
    import signal

    from autodist_keras.launch import launch

    def stop(signum, frame):
        # `launch` stops every rank on its way out (a job scheduler's SIGTERM
        # would otherwise leave the ranks running without their launcher).
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        result = launch(args.script, args.nprocs, args=args.args, timeout_s=args.timeout_s)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if result.ok:
        return 0
    codes = ", ".join(f"rank {r}: {c}" for r, c in enumerate(result.returncodes))
    why = (f"the job ran past --timeout-s {args.timeout_s:g} and was stopped"
           if result.timed_out else f"rank {result.failed_rank} failed first")
    print(f"autodist-keras launch: {why} (exit codes: {codes}); its output is above.",
          file=sys.stderr)
    return 1


def _positive_int(text):
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer. Received: {text!r}")
    return value


def _positive_seconds(text):
    """argparse type: a number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds. "
                                         f"Received: {text!r}")
    return value


_MODEL_HELP = "ResNet50, mlp, a .keras file or module:function"
_CLUSTER_HELP = ("YAML spec, '2xV100,4x1080Ti', 'cpu_testbed' or a shipped cluster "
                 "(hetero_testbed, v100x8_nvlink, a100x4_t4x4)")
_IMPORT_HELP = ("import this module first (repeatable), e.g. one that registers the custom "
                "layers of a .keras file")


def _add_import(parser):
    parser.add_argument("--import", dest="imports", action="append", default=[],
                        metavar="MODULE", help=_IMPORT_HELP)


def build_parser():
    """Returns the argparse parser of the `autodist-keras` command."""
    parser = argparse.ArgumentParser(
        prog="autodist-keras",
        description="Plan and run distributed training of Keras 3 models on mixed GPUs.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("devices", help="show the devices of a cluster (default: this machine)")
    p.add_argument("--cluster", default=None, help=_CLUSTER_HELP)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_devices)

    p = sub.add_parser("graph", help="show the layer graph of a model")
    p.add_argument("--model", required=True, help=_MODEL_HELP)
    _add_import(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_graph)

    p = sub.add_parser("plan", help="plan for a cluster without owning it (predicted figures)")
    p.add_argument("--model", required=True, help=_MODEL_HELP)
    p.add_argument("--cluster", required=True, help=_CLUSTER_HELP)
    p.add_argument("--strategy", default="auto", help="auto, fastt, heterog, disco, "
                   "data_parallel, proportional or single_device")
    p.add_argument("--batch-size", type=_positive_int, default=None,
                   help="global batch (default 32 x devices)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--out", default=None, help="write the plan as JSON to this file")
    _add_backend(p)
    _add_import(p)
    p.set_defaults(func=_cmd_plan)

    p = sub.add_parser("simulate", help="predict one training step of a plan")
    p.add_argument("--model", required=True, help=_MODEL_HELP)
    p.add_argument("--cluster", required=True, help=_CLUSTER_HELP)
    p.add_argument("--plan", required=True, help="plan JSON file (from `plan --out`)")
    p.add_argument("--trace", default=None, help="write a Chrome trace JSON here")
    p.add_argument("--json", action="store_true", help="print JSON")
    _add_backend(p)
    _add_import(p)
    p.set_defaults(func=_cmd_simulate)

    from autodist_keras.estimator.profiler import add_profile_arguments

    p = sub.add_parser("profile", help="measure layer (and link) times on this machine")
    add_profile_arguments(p)
    p.set_defaults(func=_cmd_profile)

    p = sub.add_parser("launch", help="run a script as N ranks on this machine (torchrun-style)")
    p.add_argument("--nprocs", type=int, required=True, help="number of ranks (one per device)")
    p.add_argument("--timeout-s", type=_positive_seconds, default=None,
                   help="stop every rank after this many seconds of the whole job (default: no "
                   "limit; AutoStrategy's own timeout_s, 300 s, bounds each wait inside the job)")
    p.add_argument("script", help="the training script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=_cmd_launch)
    return parser


def _add_backend(p):
    p.add_argument("--backend", choices=("tensorflow", "torch"), default=None,
                   help="the Keras backend the plan is for: its predictions differ (PyTorch "
                        "pays eager host time per layer on GPUs and compiles no op fusion by "
                        "default). Default: KERAS_BACKEND, else keras.json, else tensorflow")


def _use_backend(backend):
    """Makes `backend` the Keras backend of this process, before Keras is imported."""
    if backend is None:
        return
    keras = sys.modules.get("keras")
    if keras is not None and keras.backend.backend() != backend:
        raise AutodistError(
            f"--backend {backend} needs a process where Keras is not imported yet; this one "
            f"runs Keras on {keras.backend.backend()}. Run the command on its own, or set "
            f"KERAS_BACKEND={backend}. Received: --backend {backend}")
    os.environ["KERAS_BACKEND"] = backend


def main(argv=None):
    """Runs the command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _use_backend(getattr(args, "backend", None))
        return args.func(args)
    except AutodistError as e:
        print(f"autodist-keras {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`... | head`): stop quietly, as Python's docs advise.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except OSError as e:
        where = f" {e.filename!r}" if e.filename else ""
        print(f"autodist-keras {args.command}: error: cannot use the file{where}: "
              f"{e.strerror or e}. Check the path and its permissions. Received: {e.filename!r}",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
