"""Estimator accuracy: measured step times vs the analytic simulator and the learned estimators.

Cases: 30 models (11 MLPs, 10 CNNs, 9 Transformer encoders from graph/zoo.py) x
4 data-parallel plans on the CPU testbed (node0/cpu0 owns core 0, node0/cpu1
and node0/cpu2 share core 1): single device, even over all three devices,
speed-proportional over all three, even over the two fastest. Global batch 96.

For every case the benchmark compares the measured median step time with:
- the simulator with the analytic cost model (`estimator.simulate`);
- the simulator with the learned cost model (`estimator.learned_cost`), when
  profiled layer samples are available (`--profile`, or the stored file);
- the learned iteration estimator (`estimator.learned`), every variant.

Every learned figure is held out: leave one model out, train on the other
models' cases, predict the held-out model's plans. The headline figures are
those of the `ensemble` variant (`DEFAULT_VARIANT`), the one the packaged
estimators that `AutoStrategy("auto")` scores with are trained as; it was
made the default (2 December 2026) on earlier measurements than the ones it
is now judged on. The `auto` variant also chooses its variant inside each
fold, on the training models only; its figures are reported beside.

Measurements come from `benchmarks/data/measurements_<backend>.json` (made by
an earlier `--measure` run; its provenance is printed) unless `--measure` is
given, which re-measures every case on this machine and rewrites the file.

Usage:
    python benchmarks/estimator_accuracy.py                      # stored measurements
    python benchmarks/estimator_accuracy.py --measure --backend torch --passes 2
    python benchmarks/estimator_accuracy.py --measure --add --models mlp_medium  # add cases
    python benchmarks/estimator_accuracy.py --profile            # learned cost model column
    python benchmarks/estimator_accuracy.py --prospective benchmarks/data/prospective2

The last line printed is one JSON object with `mape`, `kendall_tau` and
`cases` (held-out, the packaged `ensemble` variant) and the same for every
other predictor.
"""

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from _common import error_text  # noqa: E402
from _common import non_negative_int  # noqa: E402
from _common import positive_float  # noqa: E402
from _common import positive_int  # noqa: E402
from _common import versions  # noqa: E402

DATA_DIR = os.path.join(HERE, "data")
ZOO = "autodist_keras.graph.zoo"
MODELS = [
    ("mlp_small", f"{ZOO}:mlp", {"input_dim": 64, "hidden": [128, 128]}),
    ("mlp_wide", f"{ZOO}:mlp", {"input_dim": 256, "hidden": [1024, 1024]}),
    ("mlp_deep", f"{ZOO}:mlp", {"input_dim": 128, "hidden": [256] * 6}),
    # Added 4 December 2026 (measured with --add): 3.2 MB of gradients, between
    # mlp_deep (1.5 MB) and mlp_wide (5.3 MB), a range no other model covered.
    ("mlp_medium", f"{ZOO}:mlp", {"input_dim": 256, "hidden": [768, 768]}),
    ("cnn_tiny", f"{ZOO}:small_cnn", {"input_shape": [16, 16, 3], "filters": [8, 16]}),
    ("cnn_small", f"{ZOO}:small_cnn", {"input_shape": [32, 32, 3], "filters": [16, 32]}),
    ("cnn_wide", f"{ZOO}:small_cnn", {"input_shape": [32, 32, 3], "filters": [32, 64, 96]}),
    ("transformer_tiny", f"{ZOO}:transformer_encoder",
     {"num_layers": 1, "d_model": 32, "heads": 2, "seq_len": 16, "vocab": 500}),
    ("transformer_small", f"{ZOO}:transformer_encoder",
     {"num_layers": 2, "d_model": 64, "heads": 4, "seq_len": 32, "vocab": 1000}),
    ("transformer_wide", f"{ZOO}:transformer_encoder",
     {"num_layers": 2, "d_model": 128, "heads": 4, "seq_len": 32, "vocab": 2000}),
    # Added 4 December 2026 (session 7), chosen before any result, so that every
    # held-out model has neighbours in its family: many small layers, a wide
    # input with a bottleneck, a deeper CNN, a larger image, a deeper and a
    # longer-sequence encoder.
    ("mlp_narrow_deep", f"{ZOO}:mlp", {"input_dim": 64, "hidden": [96] * 10}),
    ("mlp_bottleneck", f"{ZOO}:mlp", {"input_dim": 1024, "hidden": [512, 64]}),
    ("cnn_deep", f"{ZOO}:small_cnn", {"input_shape": [32, 32, 3], "filters": [16, 16, 32, 32]}),
    ("cnn_large_input", f"{ZOO}:small_cnn", {"input_shape": [48, 48, 3], "filters": [8, 16]}),
    ("transformer_deep", f"{ZOO}:transformer_encoder",
     {"num_layers": 4, "d_model": 64, "heads": 4, "seq_len": 32, "vocab": 1000}),
    ("transformer_long", f"{ZOO}:transformer_encoder",
     {"num_layers": 2, "d_model": 64, "heads": 4, "seq_len": 96, "vocab": 1000}),
    # Added 4 December 2026 (session 8) as a prospective check of the shared-core
    # and attention-score terms: chosen before they were measured, measured after
    # the terms were fixed, first predicted by estimators trained on the sixteen
    # models above only (docs/estimator_accuracy.md, "Prospective check").
    ("mlp_one_wide", f"{ZOO}:mlp", {"input_dim": 512, "hidden": [2048]}),
    ("mlp_four", f"{ZOO}:mlp", {"input_dim": 128, "hidden": [384] * 4}),
    ("cnn_mid", f"{ZOO}:small_cnn", {"input_shape": [40, 40, 3], "filters": [12, 24, 48]}),
    ("transformer_mid", f"{ZOO}:transformer_encoder",
     {"num_layers": 3, "d_model": 96, "heads": 4, "seq_len": 48, "vocab": 1500}),
    # A second prospective batch (same session, chosen before it was measured;
    # predicted by estimators trained on the twenty models above only).
    ("mlp_tall", f"{ZOO}:mlp", {"input_dim": 256, "hidden": [512, 512, 512]}),
    ("cnn_narrow", f"{ZOO}:small_cnn", {"input_shape": [32, 32, 3], "filters": [8, 8, 16]}),
    ("cnn_big_filters", f"{ZOO}:small_cnn", {"input_shape": [24, 24, 3], "filters": [48, 96]}),
    ("transformer_wide_short", f"{ZOO}:transformer_encoder",
     {"num_layers": 1, "d_model": 128, "heads": 8, "seq_len": 24, "vocab": 3000}),
    # A third prospective batch (session 9, chosen before it was measured;
    # predicted by estimators trained on the twenty-four models above only). It
    # fills the edges of the range, where leave-one-model-out erred most: an MLP
    # smaller than mlp_small and one near it, a CNN near cnn_tiny and one with a
    # larger image than any other, an encoder smaller than transformer_tiny and a
    # long-sequence one wider than transformer_long.
    ("mlp_mini", f"{ZOO}:mlp", {"input_dim": 32, "hidden": [64]}),
    ("mlp_small_three", f"{ZOO}:mlp", {"input_dim": 64, "hidden": [192] * 3}),
    ("cnn_tiny_three", f"{ZOO}:small_cnn", {"input_shape": [16, 16, 3], "filters": [8, 8, 16]}),
    ("cnn_large_image", f"{ZOO}:small_cnn", {"input_shape": [56, 56, 3], "filters": [16, 32]}),
    ("transformer_micro", f"{ZOO}:transformer_encoder",
     {"num_layers": 1, "d_model": 48, "heads": 2, "seq_len": 20, "vocab": 800}),
    ("transformer_long_wide", f"{ZOO}:transformer_encoder",
     {"num_layers": 2, "d_model": 96, "heads": 4, "seq_len": 64, "vocab": 1500}),
    # A fourth prospective batch (session 11, chosen before it was measured and
    # after every stored model had been measured on one host; predicted by
    # estimators trained on the thirty models above only): two models of each
    # family, between stored neighbours.
    ("mlp_two_mid", f"{ZOO}:mlp", {"input_dim": 128, "hidden": [640, 640]}),
    ("mlp_five_narrow", f"{ZOO}:mlp", {"input_dim": 96, "hidden": [160] * 5}),
    ("cnn_mid_small", f"{ZOO}:small_cnn", {"input_shape": [28, 28, 3], "filters": [12, 24]}),
    ("cnn_four", f"{ZOO}:small_cnn", {"input_shape": [36, 36, 3], "filters": [8, 16, 24, 32]}),
    ("transformer_three_small", f"{ZOO}:transformer_encoder",
     {"num_layers": 3, "d_model": 64, "heads": 4, "seq_len": 40, "vocab": 1200}),
    ("transformer_wide_mid", f"{ZOO}:transformer_encoder",
     {"num_layers": 2, "d_model": 112, "heads": 4, "seq_len": 40, "vocab": 2500}),
]
PLANS = ["single_device", "data_parallel", "proportional", "data_parallel_2"]
BATCH_SIZE = 96
# The variant of the packaged estimators AutoStrategy scores with (best held-out
# plan ranking on both backends in docs/estimator_accuracy.md).
DEFAULT_VARIANT = "ensemble"
PROFILE_BATCH_SIZES = (24, 32, 48, 96)


def cases(models=None, plans=None):
    """The benchmark's `Case` list (optionally restricted to some models / plans)."""
    from autodist_keras.estimator.measurements import Case

    out = []
    for name, builder, kwargs in MODELS:
        if models and name not in models:
            continue
        for plan in plans or PLANS:
            out.append(Case(name, builder, kwargs, plan, BATCH_SIZE))
    return out


def data_path(backend, data_dir=DATA_DIR):
    return os.path.join(data_dir, f"measurements_{backend}.json")


def profile_path(backend, data_dir=DATA_DIR):
    return os.path.join(data_dir, f"profile_samples_{backend}.json")


# --------------------------------------------------------------- measuring
def measure(backend, args):
    from autodist_keras.estimator.measurements import add_measurements
    from autodist_keras.estimator.measurements import load_average
    from autodist_keras.estimator.measurements import measure_cases
    from autodist_keras.estimator.measurements import save_measurements

    todo = cases(args.models, args.plans)
    print(f"Measuring {len(todo)} cases on {backend}, {args.passes} pass(es), {args.steps} "
          f"steps after {args.warmup} warm-up steps each; load average now {load_average()}",
          flush=True)
    started = time.time()
    records, failures = measure_cases(
        todo, "cpu_testbed", backend=backend, steps=args.steps, warmup=args.warmup,
        passes=args.passes, timeout_s=args.timeout,
    )
    for name, error in failures:
        print(f"FAILED {name}: {error[-1500:]}", flush=True)
    path = data_path(backend, args.data_dir)
    provenance = {
        "command": " ".join(["python"] + sys.argv),
        "cluster": "Cluster.cpu_testbed() (node0/cpu0: core 0; node0/cpu1, node0/cpu2: core 1)",
        "steps": args.steps, "warmup": args.warmup, "passes": args.passes,
        "batch_size": BATCH_SIZE,
        "failures": [[n, e[-600:]] for n, e in failures],
        "measuring_wall_s": round(time.time() - started, 1),
    }
    if args.add:
        added = len(records)
        records = add_measurements(records, path, provenance=provenance)
        print(f"Added {added} records to {os.path.relpath(path)} (same case: replaced)",
              flush=True)
    else:
        save_measurements(records, path, provenance=provenance)
    print(f"Wrote {len(records)} records to {os.path.relpath(path)}", flush=True)
    return records


def profile(backend, records, args):
    """Profiles every model's layers on the testbed (in a fresh process per backend)."""
    import subprocess

    path = profile_path(backend, args.data_dir)
    env = dict(os.environ, KERAS_BACKEND=backend)
    code = subprocess.call(
        [sys.executable, os.path.abspath(__file__), "--profile-worker", "--backend", backend,
         "--data-dir", args.data_dir] + (["--models"] + args.models if args.models else []),
        env=env,
    )
    if code != 0:
        print(f"Profiling on {backend} failed (exit code {code}); no learned cost column.")
    return path


def profile_worker(args):
    """Runs in a fresh process: profile_layers for each model, samples saved as JSON."""
    import keras

    from autodist_keras.devices import Cluster
    from autodist_keras.estimator.learned_cost import samples_from_profile
    from autodist_keras.estimator.measurements import build_model
    from autodist_keras.estimator.measurements import machine_info
    from autodist_keras.estimator.profiler import profile_layers
    from autodist_keras.graph import ModelGraph

    backend = keras.backend.backend()
    cluster = Cluster.cpu_testbed()
    samples, seen = [], set()
    started = time.time()
    for case in cases(args.models, ["single_device"]):
        if case.model in seen:
            continue
        seen.add(case.model)
        keras.utils.set_random_seed(0)
        model = build_model(case)
        graph = ModelGraph.from_keras(model)
        # node0/cpu2 is node0/cpu1's twin (same core, same threads): profile two devices.
        prof = profile_layers(model, cluster, batch_sizes=PROFILE_BATCH_SIZES,
                              devices=["node0/cpu0", "node0/cpu1"], graph=graph,
                              progress=False)
        got = samples_from_profile(prof, graph, cluster, model_name=case.model)
        samples.extend(got)
        print(f"profiled {case.model}: {len(got)} samples", flush=True)
    _write_compact(profile_path(backend, args.data_dir), {
        "schema": "autodist_keras.profile_samples/1",
        "provenance": {"machine": machine_info(), "backend": backend,
                       "batch_sizes": list(PROFILE_BATCH_SIZES),
                       "devices": ["node0/cpu0", "node0/cpu1"],
                       "wall_s": round(time.time() - started, 1),
                       "written": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
        "samples": samples,
    })


def _write_compact(path, data):
    """Writes JSON without indentation (the samples file is large), atomically."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, separators=(",", ":"), sort_keys=True)
    os.replace(tmp, path)


def load_profile_samples(backend, data_dir):
    path = profile_path(backend, data_dir)
    if not os.path.exists(path):
        return None, None
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data.get("samples") or None, data.get("provenance") or {}


# ---------------------------------------------------------------- evaluating
def learned_cost_predictions(records, samples):
    """Held-out (leave one model out) simulator times with the learned cost model."""
    from autodist_keras.estimator.learned_cost import LearnedCostModel
    from autodist_keras.estimator.simulator import simulate

    out = {}
    models = sorted({r.model for r in records})
    for held in models:
        train = [s for s in samples if s["model"] != held]
        if not train:
            continue
        cost = LearnedCostModel(samples=train, regressor="auto", evaluate=False)
        for r in records:
            if r.model == held:
                out[r.name] = simulate(r.graph, r.cluster, r.plan, cost_model=cost).step_time_s
    return out


def evaluate_backend(records, samples, variants):
    from autodist_keras.estimator import learned

    examples = learned.examples_from_records(records)
    results = {}
    timings = {}
    for variant in variants:
        started = time.perf_counter()
        results[variant] = learned.evaluate_examples(examples, variant)
        timings[variant] = time.perf_counter() - started
    started = time.perf_counter()
    results["auto"] = learned.evaluate_examples(examples, "auto")
    timings["auto"] = time.perf_counter() - started
    if any(e.probe_s for e in examples) and DEFAULT_VARIANT in variants:
        # The same variant ignoring the machine-speed probes: what they are worth.
        key = f"{DEFAULT_VARIANT} without machine-speed probe"
        started = time.perf_counter()
        results[key] = learned.evaluate_examples(examples, DEFAULT_VARIANT, machine_speed=False)
        timings[key] = time.perf_counter() - started
    by_plan = {v: learned.evaluate_examples(examples, v, by="plan") for v in variants}
    learned_cost = learned_cost_predictions(records, samples) if samples else {}
    return examples, results, by_plan, learned_cost, timings


def _fmt(value, digits=2):
    if value is None:
        return "-"
    if isinstance(value, float) and value != value:
        return "nan"
    return f"{value:.{digits}f}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=["tensorflow", "torch", "both"], default="both")
    parser.add_argument("--measure", action="store_true", help="re-measure every case now")
    parser.add_argument("--add", action="store_true",
                        help="with --measure: add the measured cases to the stored file (same "
                             "case: replaced) instead of rewriting it")
    parser.add_argument("--measure-only", action="store_true",
                        help="with --measure and/or --profile: write the data files, skip the evaluation")
    parser.add_argument("--profile", action="store_true",
                        help="profile every model's layers now (learned cost model column)")
    parser.add_argument("--passes", type=positive_int, default=2)
    parser.add_argument("--steps", type=positive_int, default=20)
    parser.add_argument("--warmup", type=non_negative_int, default=5)
    parser.add_argument("--timeout", type=positive_float, default=900.0, help="seconds per case")
    parser.add_argument("--models", nargs="*", default=None,
                        help="names of MODELS (default: all); an unknown name is an error")
    parser.add_argument("--plans", nargs="*", default=None, choices=PLANS,
                        help="plans (default: all)")
    parser.add_argument("--variants", nargs="*", default=None,
                        help="learned estimator variants to evaluate (default: all)")
    parser.add_argument("--data-dir", default=DATA_DIR)
    parser.add_argument("--write-default", action="store_true",
                        help="train the packaged estimators (autodist_keras/estimator/data/"
                             "learned_<backend>.json) from the stored measurements and exit")
    parser.add_argument("--default-variant", default=DEFAULT_VARIANT,
                        help="variant of the packaged estimators (default %(default)s)")
    parser.add_argument("--prospective", metavar="DIR", default=None,
                        help="train on the stored cases of the models added before those in "
                             "DIR/measurements_<backend>.json, predict those later cases and "
                             "report the errors")
    parser.add_argument("--profile-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    known = [name for name, _, _ in MODELS]
    unknown = [m for m in args.models or [] if m not in known]
    if unknown:
        parser.error(f"unknown model(s) {unknown} in --models; the models are: "
                     f"{', '.join(known)}")
    from autodist_keras.estimator.learned import VARIANTS

    unknown = [v for v in args.variants or [] if v not in VARIANTS + ("auto",)]
    if unknown:
        parser.error(f"unknown variant(s) {unknown} in --variants; the variants are: "
                     f"{', '.join(VARIANTS + ('auto',))}")
    # (with --measure the measuring is the point: `--measure --add --models X` adds one
    # model's cases)
    evaluation_only = not (args.profile_worker or args.prospective or args.write_default
                           or args.measure_only or args.measure or args.profile)
    if evaluation_only and args.models is not None and len(set(args.models)) < 3:
        parser.error("the held-out evaluation leaves one model out at a time, and its auto "
                     "variant holds out models again inside each fold, so --models needs at "
                     f"least three models. Received: {args.models}; add a model, or pass "
                     "--measure-only to only measure")
    if args.profile_worker:
        profile_worker(args)
        return None
    progress = {"benchmark": "estimator_accuracy"}  # what a failed run reports
    try:
        if args.prospective:
            return prospective(args)
        if args.write_default:
            return write_defaults(args, progress)
        return run(args, progress)
    except Exception as e:  # reported in the JSON line; the exit code says it failed
        progress["error"] = error_text(e)
        print(f"error: {progress['error']}")
        print(json.dumps(_clean(progress), default=str))
        sys.exit(1)


# The accuracy targets on held-out cases.
MAPE_TARGET_PERCENT = 10.0
KENDALL_TAU_TARGET = 0.8


def _targets(head):
    """The JSON `targets` entry for the headline predictor's metrics `head`."""
    return {"mape_max": MAPE_TARGET_PERCENT, "kendall_tau_min": KENDALL_TAU_TARGET,
            "met": bool(head["mape"] <= MAPE_TARGET_PERCENT
                        and head["kendall_tau"] >= KENDALL_TAU_TARGET)}


def _backends(args):
    return ["tensorflow", "torch"] if args.backend == "both" else [args.backend]


def _variants(args):
    """The learned variants to evaluate: `--variants`, else every one that can
    train here (the GNN needs PyTorch)."""
    from autodist_keras.estimator import learned

    return args.variants or [v for v in learned.VARIANTS
                             if v != "gnn" or learned._torch_available()]


def write_defaults(args, progress=None):
    """Trains the estimators AutoStrategy scores with, one per backend, on every stored
    case (each one written is added to `progress["write_default"]` as it is)."""
    from autodist_keras.estimator import learned
    from autodist_keras.estimator.measurements import load_measurements

    backends = _backends(args)
    written = (progress if progress is not None else {}).setdefault("write_default", {})
    for backend in backends:
        records, provenance = load_measurements(data_path(backend, args.data_dir))
        started = time.perf_counter()
        estimator = learned.LearnedEstimator(variant=args.default_variant).fit(
            records, evaluate=True)
        estimator.report["trained_from"] = {
            "file": os.path.relpath(data_path(backend, args.data_dir), os.path.dirname(HERE)),
            "written": provenance.get("written"),
            "command": "python benchmarks/estimator_accuracy.py --write-default",
        }
        path = learned.default_path(backend)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        estimator.save(path)
        held = estimator.report.get("held_out", {})
        print(f"{backend}: {estimator.variant} on {len(records)} cases "
              f"({time.perf_counter() - started:.1f} s); held out ({learned.AUTO_FOLDS} groups "
              f"of models) MAPE {_fmt(held.get('mape'), 1)}%, tau/model "
              f"{_fmt(held.get('kendall_tau'), 3)}; wrote {os.path.relpath(path)}")
        written[backend] = {"path": os.path.relpath(path), "variant": estimator.variant,
                            "held_out": _short(held) if held else None}
    print(json.dumps({"benchmark": "estimator_accuracy", "write_default": written}))
    return written


def prospective(args):
    """Trains on the stored cases, predicts cases measured afterwards (a forward test).

    The held-out evaluation of `run` reuses measurements that also guided the
    estimator's design (its terms were chosen looking at held-out errors); this
    check predicts models that played no part in it: every variant is fitted on
    the stored cases of the models added to `MODELS` before `DIR`'s, then
    predicts the records in `DIR` (`benchmarks/data/prospective/` and
    `prospective2/`: four models each, measured after the terms were fixed;
    `prospective3/`: six models at the edges of the range; all since added to
    the stored files as well).
    """
    from autodist_keras.estimator import learned
    from autodist_keras.estimator.measurements import load_measurements

    backends = _backends(args)
    variants = _variants(args)
    rows = {v: [] for v in variants}
    analytic = []
    # MODELS grows in the order models were added.
    order = [name for name, _, _ in MODELS]
    for backend in backends:
        train, _ = load_measurements(data_path(backend, args.data_dir))
        path = data_path(backend, args.prospective)
        if not os.path.exists(path):
            print(f"No later measurements for {backend} at {path}; skipping it.")
            continue
        test, provenance = load_measurements(path)
        # Train only on the models added to MODELS before the later ones, so the
        # check still holds once the later cases, and any added after them, are
        # stored too.
        later = {r.model for r in test}
        cut = min((order.index(m) for m in later if m in order), default=len(order))
        earlier = set(order[:cut])
        train = [r for r in train if r.model not in later
                 and (r.model in earlier or r.model not in order)]
        print(f"\n=== {backend}: trained on {len(train)} stored cases "
              f"({len({r.model for r in train})} models), predicting {len(test)} later cases "
              f"of {sorted({r.model for r in test})} (measured {provenance.get('written')})")
        print(f"{'case':<40}{'measured ms':>12}{'analytic ms':>12}"
              + "".join(f"{v + ' err %':>16}" for v in variants))
        predictions = {}
        for variant in variants:
            estimator = learned.LearnedEstimator(variant=variant).fit(train, evaluate=False)
            predictions[variant] = estimator.predict_records(test)
        for i, r in enumerate(test):
            print(f"{r.name:<40}{r.measured_s * 1e3:>12.2f}{r.predicted_analytic_s * 1e3:>12.2f}"
                  + "".join(f"{(predictions[v][i] / r.measured_s - 1) * 100:>+16.1f}"
                            for v in variants))
            analytic.append((f"{backend}/{r.model}", r.predicted_analytic_s, r.measured_s))
            for v in variants:
                rows[v].append((f"{backend}/{r.model}", predictions[v][i], r.measured_s))
    if not analytic:
        print(json.dumps({"mape": None, "kendall_tau": None, "cases": 0,
                          "error": "no later measurements"}))
        return None

    def summary(cases):
        return _short(learned.metrics([c[0] for c in cases], [c[1] for c in cases],
                                      [c[2] for c in cases]))

    predictors = {"analytic": analytic, **rows}
    table = {name: summary(cases) for name, cases in predictors.items()}
    per_backend = {
        b: {name: summary([c for c in cases if c[0].startswith(b + "/")])
            for name, cases in predictors.items()}
        for b in backends if any(c[0].startswith(b + "/") for c in analytic)
    }
    print(f"\n{'predictor':<38}{'MAPE %':>9}{'median APE %':>14}{'tau/model':>11}{'cases':>7}"
          + "".join(f"{b + ' MAPE / tau':>24}" for b in per_backend))
    for name, m in table.items():
        print(f"{name:<38}{_fmt(m['mape'], 1):>9}{_fmt(m['median_ape'], 1):>14}"
              f"{_fmt(m['kendall_tau'], 3):>11}{m['cases']:>7}"
              + "".join(f"{_fmt(per_backend[b][name]['mape'], 1) + ' / ' + _fmt(per_backend[b][name]['kendall_tau'], 3):>24}"
                        for b in per_backend))
    headline = DEFAULT_VARIANT if DEFAULT_VARIANT in table else variants[0]
    head = table[headline]
    line = {"benchmark": "estimator_accuracy", "held_out": "prospective (models measured later)",
            "mape": head["mape"], "kendall_tau": head["kendall_tau"], "cases": head["cases"],
            "predictor": f"learned estimator ({headline} variant) trained on the stored "
                         "measurements",
            "targets": _targets(head),
            "variants": table, "backends": per_backend}
    print(json.dumps(_clean(line)))
    return line


def run(args, progress=None):
    """The held-out evaluation; `progress` (a dict) gets each backend's figures as they
    are made (what a failed run reports)."""
    from autodist_keras.estimator import learned
    from autodist_keras.estimator import machine_speed
    from autodist_keras.estimator.measurements import load_measurements

    backends = _backends(args)
    variants = _variants(args)
    summary = progress if progress is not None else {}
    summary.update({"benchmark": "estimator_accuracy", "held_out": "leave one model out",
                    "versions": versions(_backends(args)), "backends": {}, "source": {}})
    pooled = {}
    for backend in backends:
        path = data_path(backend, args.data_dir)
        if args.measure:
            measure(backend, args)
            source = f"measured now on this machine, written to {os.path.relpath(path)}"
        elif os.path.exists(path):
            source = f"stored measurements {os.path.relpath(path)} (not re-measured; --measure to redo)"
        else:
            print(f"No measurements for {backend} at {os.path.relpath(path)}; skipping it "
                  "(run with --measure).")
            continue
        records, provenance = load_measurements(path)
        if args.models:
            records = [r for r in records if r.model in args.models]
        if args.plans:
            records = [r for r in records if r.case.plan in args.plans]
        if args.profile:
            profile(backend, records, args)
        if args.measure_only:
            continue
        samples, sprov = load_profile_samples(backend, args.data_dir)
        print(f"\n=== {backend}: {len(records)} cases; source: {source}")
        print(f"    provenance: written {provenance.get('written')}, machine "
              f"{provenance.get('machine', {}).get('cpu')} "
              f"({provenance.get('machine', {}).get('cores')} cores), steps "
              f"{provenance.get('steps')} after {provenance.get('warmup')} warm-up, passes "
              f"{provenance.get('passes')}, versions {provenance.get('versions')}")
        loads = [l for r in records for p in r.passes for l in p.get("load_average") or []
                 if l is not None]
        if loads:
            print(f"    1-min load average during measurement: median {statistics.median(loads):.1f}, "
                  f"max {max(loads):.1f} (2-core machine; measured times include that contention)")
        spreads = [r.spread for r in records if len(r.passes) > 1]
        if spreads:
            print(f"    pass-to-pass spread of the measured medians: median "
                  f"{statistics.median(spreads) * 100:.1f}%, max {max(spreads) * 100:.1f}% "
                  f"({len(spreads)} cases with several passes): the noise floor of any MAPE")
        probes = [r.machine_probe_s for r in records if r.machine_probe_s]
        if probes:
            print(f"    machine-speed probe (estimator/machine_speed.py) per record: median "
                  f"{statistics.median(probes) * 1e3:.3f} ms, range {min(probes) * 1e3:.3f}-"
                  f"{max(probes) * 1e3:.3f} ms ({len(probes)} of {len(records)} records); "
                  "records whose probe lies outside the probe's noise band "
                  f"(+/-{machine_speed.NOISE_BAND:.0%} of the median) are brought to the median speed")
        else:
            print("    machine-speed probe: not recorded (measurements older than 3 December "
                  "2026); no speed normalisation")
        if samples:
            print(f"    learned cost model: {len(samples)} profiled layer samples "
                  f"({sprov.get('written')}), trained leave-one-model-out")
        else:
            print("    learned cost model: no profiled samples (run with --profile); column omitted")
        examples, results, by_plan, lc, timings = evaluate_backend(records, samples, variants)
        _print_cases(examples, results, lc)
        entry = _print_metrics(examples, results, lc, variants, timings)
        print("Held out by plan kind instead (train on the other plan kinds of every model):")
        print(f"{'predictor':<38}{'MAPE %':>9}{'median APE %':>14}{'tau/model':>11}")
        for v, r in by_plan.items():
            m = r["learned"]
            print(f"{'learned estimator: ' + v:<38}{_fmt(m['mape'], 1):>9}"
                  f"{_fmt(m['median_ape'], 1):>14}{_fmt(m['kendall_tau'], 3):>11}")
        entry["held_out_by_plan_kind"] = {v: _short(r["learned"]) for v, r in by_plan.items()}
        entry["source"] = source
        summary["backends"][backend] = entry
        summary["source"][backend] = source
        for key, result in results.items():
            pooled.setdefault(key, []).extend(result["cases"])
        if lc:
            pooled.setdefault("learned_cost", []).extend(
                dict(c, learned_s=lc[c["case"]]) for c in results["auto"]["cases"]
                if c["case"] in lc
            )
    if not summary["backends"]:
        print(json.dumps({"mape": None, "kendall_tau": None, "cases": 0,
                          "error": "no evaluation (--measure-only, or no measurements)"}))
        return summary
    final = {}
    for key, rows in pooled.items():
        names = [f"{r['backend']}/{r['model']}" for r in rows]
        final[key] = learned.metrics(names, [r["learned_s"] for r in rows],
                                     [r["measured_s"] for r in rows])
    rows = pooled["auto"]
    names = [f"{r['backend']}/{r['model']}" for r in rows]
    analytic = learned.metrics(names, [r["analytic_s"] for r in rows],
                               [r["measured_s"] for r in rows])
    headline = DEFAULT_VARIANT if DEFAULT_VARIANT in final else "auto"
    head = final[headline]
    line = {
        "mape": round(head["mape"], 2),
        "kendall_tau": _round(head["kendall_tau"]),
        "cases": head["cases"],
        "predictor": (f"learned estimator ({headline} variant, the packaged one), held out"
                      if headline == DEFAULT_VARIANT else
                      "learned estimator (auto variant, chosen inside each fold), held out"),
        "targets": _targets(head),
        "analytic": _short(analytic),
        "learned_cost": _short(final["learned_cost"]) if "learned_cost" in final else None,
        "variants": {v: _short(final[v]) for v in variants if v in final},
        "without_machine_speed_probe": {k: _short(m) for k, m in final.items()
                                        if k.endswith("machine-speed probe")},
        "backends": {b: {k: v for k, v in e.items() if k != "cases_table"}
                     for b, e in summary["backends"].items()},
        "source": summary["source"],
        "versions": summary["versions"],
    }
    print(json.dumps(_clean(line)))
    return line


def _round(value, digits=3):
    if value is None or value != value:
        return None
    return round(value, digits)


def _short(m):
    return {"mape": round(m["mape"], 2), "median_ape": round(m["median_ape"], 2),
            "kendall_tau": _round(m["kendall_tau"]),
            "kendall_tau_pooled": _round(m["kendall_tau_pooled"]), "cases": m["cases"]}


def _clean(value):
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    if isinstance(value, float) and value != value:
        return None
    return value


def _print_cases(examples, results, lc):
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover
        Console = None
    by_case = {v: {c["case"]: c for c in r["cases"]} for v, r in results.items()}
    headers = ["case", "measured ms", "analytic ms"]
    if lc:
        headers.append("learned-cost ms")
    headers += ["learned-est. ms (auto)", "err %"]
    rows = []
    for e in examples:
        auto = by_case["auto"].get(e.name)
        row = [e.name, _fmt(e.measured_s * 1e3), _fmt(e.sim_s * 1e3)]
        if lc:
            row.append(_fmt(lc[e.name] * 1e3) if e.name in lc else "-")
        if auto:
            row += [_fmt(auto["learned_s"] * 1e3),
                    _fmt((auto["learned_s"] - e.measured_s) / e.measured_s * 100, 1)]
        else:
            row += ["-", "-"]
        rows.append(row)
    if Console is not None:
        table = Table(title="Step time per case (measured vs predicted; learned figures held out)")
        for h in headers:
            table.add_column(h, justify="left" if h == "case" else "right")
        for row in rows:
            table.add_row(*row)
        Console(width=140).print(table)
    else:
        print(" | ".join(headers))
        for row in rows:
            print(" | ".join(row))


def _print_metrics(examples, results, lc, variants, timings):
    from autodist_keras.estimator import learned

    names = [e.model for e in examples]
    measured = [e.measured_s for e in examples]
    table = {"analytic simulator": learned.metrics(names, [e.sim_s for e in examples], measured)}
    if lc:
        keep = [i for i, e in enumerate(examples) if e.name in lc]
        table["learned cost model (simulator)"] = learned.metrics(
            [names[i] for i in keep], [lc[examples[i].name] for i in keep],
            [measured[i] for i in keep])
    for v in variants + ["auto"] + [k for k in results if k.endswith("machine-speed probe")]:
        table[f"learned estimator: {v}"] = results[v]["learned"]
    print(f"{'predictor (held out)':<38}{'MAPE %':>9}{'median APE %':>14}"
          f"{'tau/model':>11}{'tau pooled':>12}{'cases':>7}{'eval s':>8}")
    for name, m in table.items():
        key = name.split(": ")[-1]
        print(f"{name:<38}{_fmt(m['mape'], 1):>9}{_fmt(m['median_ape'], 1):>14}"
              f"{_fmt(m['kendall_tau'], 3):>11}{_fmt(m['kendall_tau_pooled'], 3):>12}"
              f"{m['cases']:>7}{_fmt(timings.get(key), 1):>8}")
    chosen = {}
    for row in results["auto"].get("chosen", []):
        chosen[row["variant"]] = chosen.get(row["variant"], 0) + 1
    if chosen:
        print(f"auto chose, per fold: {chosen}")
    return {"metrics": {k: _short(m) for k, m in table.items()},
            "auto_choices": chosen}


if __name__ == "__main__":
    main()
