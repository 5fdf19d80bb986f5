"""Entry point of one TensorFlow worker process started by `launch_local_workers`.

Run as `python -m autodist_keras.backends.tf_worker job.json` with `TF_CONFIG`
set. The job file (JSON) names the model function, the strategy or plan, the
cluster, the data (`.npy` files) and where to write results. The worker
creates the `AutoStrategy` first (which pins it to its devices' cores and
starts the collectives, both of which must precede any TensorFlow op), then
builds and trains the model, and writes `result<rank>.json` (step wall and
CPU times, its batch share, losses) and, when asked, `weights<rank>.npz`.

With `"alternate"` in the job (`{"plans": [plan paths], "rounds": R}`), the
worker builds one model per plan and trains them in turn, `steps` steps
each, for `R` rounds (every second round in reverse order), so that plans
are timed by the same processes seconds apart; `result<rank>.json` then
also holds `"phases"`, one entry per fit: the plan's index, this rank's
share, and its step wall and CPU times.
"""

import json
import os
import signal
import sys
import time

PARENT_PID_ENV = "AUTODIST_KERAS_PARENT_PID"


def die_with_parent(environ=None):
    """Ends this worker when the process that started it dies (Linux).

    `launch_local_workers` kills its workers when it fails or is interrupted,
    but a parent killed outright (SIGKILL, or SIGTERM without a handler) runs
    no cleanup: its workers would go on training, or wait for each other,
    with nobody to read their results. The kernel sends this process SIGKILL
    when its parent exits (`PR_SET_PDEATHSIG`); a parent already gone before
    the request is caught by comparing `getppid()` with the pid it passed in
    `PARENT_PID_ENV`. Elsewhere this does nothing.

    Args:
        environ: Environment to read (default `os.environ`).
    """
    environ = os.environ if environ is None else environ
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    expected = environ.get(PARENT_PID_ENV)
    if expected and os.getppid() != int(expected):
        os._exit(1)


def main(argv=None):
    """Runs the job described by the JSON file `argv[0]`."""
    die_with_parent()
    argv = sys.argv[1:] if argv is None else argv
    started = time.perf_counter()
    phases = {}
    with open(argv[0], encoding="utf-8") as f:
        job = json.load(f)
    for path in reversed(job.get("sys_path", [])):
        if path not in sys.path:
            sys.path.insert(0, path)
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")

    import numpy as np

    from autodist_keras.backends import tf_multiworker
    from autodist_keras.devices import Cluster
    from autodist_keras.strategies.auto import AutoStrategy
    from autodist_keras.strategies.plan import Plan

    # Import the model function first (fail fast); it must not run TensorFlow ops at import.
    model_fn = tf_multiworker.resolve_callable(job["model_fn"])
    cluster = Cluster.from_dict(job["cluster"])
    devices = list(job.get("devices") or cluster.names)
    worker = tf_multiworker.parse_tf_config()
    mine = tf_multiworker.local_device_names(worker, devices)
    cores, threads = tf_multiworker.pinning_for([cluster.device(n) for n in mine])
    if cores is not None:
        # Before TensorFlow starts its thread pools (the adapter pins again, harmlessly).
        tf_multiworker.pin_process(cores, threads)
    plan = Plan.from_json(job["plan"]) if job.get("plan") else None
    kwargs = dict(job.get("options") or {})
    kwargs["devices"] = devices
    if plan is not None:
        strategy = AutoStrategy(cluster=cluster, plan=plan, **kwargs)
    else:
        strategy = AutoStrategy(strategy=job.get("strategy") or "auto", cluster=cluster, **kwargs)
    phases["import_s"] = time.perf_counter() - started
    adapter = strategy.adapter  # pins this process and starts collectives: before any TF op
    phases["collectives_s"] = time.perf_counter() - started - phases["import_s"]
    rank = adapter.rank

    from autodist_keras.backends.tensorflow_adapter import StepTimes
    from autodist_keras.backends.tensorflow_adapter import fit_repeating

    with strategy.scope():
        model = model_fn()
    if job.get("initial_weights"):
        with np.load(job["initial_weights"], allow_pickle=False) as data:
            model.set_weights([data[f"w{i}"] for i in range(len(data.files))])
    x = np.load(job["x"], allow_pickle=False)
    y = np.load(job["y"], allow_pickle=False)
    phases["model_s"] = time.perf_counter() - started - sum(phases.values())
    timer = StepTimes()
    metrics = {}
    alternated = None
    if job.get("alternate"):
        alternated = _alternate_plans(strategy, model, model_fn, job, x, y, mine)
    else:
        for _ in range(int(job.get("epochs", 1))):
            history = fit_repeating(model, x, y, job["batch_size"], job["steps"], [timer],
                                    drop_remainder=job.get("drop_remainder", False))
            for name, values in history.history.items():
                metrics.setdefault(name, []).extend(float(v) for v in values)
    phases["fit_s"] = time.perf_counter() - started - sum(phases.values())
    out_dir = job["out_dir"]
    if job.get("return_weights"):
        np.savez(os.path.join(out_dir, f"weights{rank}.npz"),
                 **{f"w{i}": w for i, w in enumerate(model.get_weights())})
    result = {
        "rank": rank,
        "step_times_s": timer.times_s,
        # CPU time of this process (all threads) per step: the work a step cost
        # this rank even when other jobs stretch its wall time.
        "cpu_times_s": timer.cpu_times_s,
        "share": _share(strategy, mine),
        "loss": metrics.get("loss", []),
        "history": metrics,
        "device": mine[0],
        "devices": mine,
        "affinity": sorted(os.sched_getaffinity(0)),
        "runtime": adapter.runtime_info,
        "phases_s": phases,
    }
    if alternated is not None:
        result["phases"] = alternated
    tmp = os.path.join(out_dir, f".result{rank}.json")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(result, f)
    os.replace(tmp, os.path.join(out_dir, f"result{rank}.json"))


def _alternate_plans(strategy, model, model_fn, job, x, y, device_names):
    """Trains one model per plan of `job["alternate"]`, alternating (see the module docstring).

    `model` (built under the job's first plan) serves the first plan. Returns
    the list of fits, in the order they ran.
    """
    from autodist_keras.backends.tensorflow_adapter import StepTimes
    from autodist_keras.backends.tensorflow_adapter import fit_repeating
    from autodist_keras.strategies.plan import Plan

    plans = [Plan.from_json(path) for path in job["alternate"]["plans"]]
    models = [model]
    for plan in plans[1:]:
        with strategy.scope():
            models.append(model_fn())
    order = list(range(len(plans)))
    fits = []
    for r in range(int(job["alternate"]["rounds"])):
        for i in (order if r % 2 == 0 else order[::-1]):
            # A model takes its plan at its first step (`AutoStrategy._plan_for_training`,
            # cached per model), so the fixed plan only matters for new models.
            strategy._fixed_plan = plans[i]
            timer = StepTimes()
            fit_repeating(models[i], x, y, job["batch_size"], job["steps"], [timer],
                          drop_remainder=job.get("drop_remainder", False))
            # The plan this model's runtime took at its first step (cached per model).
            ran = strategy._plan_for_training(models[i], job["batch_size"])
            fits.append({"plan": i, "share": _share_in(ran, device_names),
                         "step_times_s": timer.times_s, "cpu_times_s": timer.cpu_times_s})
    return fits


def _share_in(plan, device_names):
    """Samples per step of the replicas on `device_names` (None if the plan has none)."""
    shares = [int(r.batch_share) for r in plan.replicas if r.device in device_names]
    return sum(shares) if shares else None


def _share(strategy, device_names):
    """This rank's samples per step under the plan in force (None before planning)."""
    plan = strategy.plan
    if plan is None or not plan.is_data_parallel:
        return None
    return _share_in(plan, device_names)


if __name__ == "__main__":
    main()
