"""The learned iteration estimator: the simulator corrected by measured step times.

The discrete-event simulator (`simulator.simulate`) predicts a plan's step
time from an analytic cost model; on real machines it misses framework
overheads, thread contention and runtime costs it does not model.
`LearnedEstimator` learns the correction from measured steps
(`measurements.Record`):

```
predicted = simulated x exp(f(graph, cluster, plan, backend)) x probe_now / probe_ref
```

`f` predicts `log(measured / simulated)`, with each measurement brought to
the machine speed of the training data's median probe (`probe_ref`, see
`estimator/machine_speed.py`) when the measurements recorded probes; the
last factor applies only when the caller passes the probe now. Both
scalings apply only outside the probe's own noise (`machine_speed.NOISE_BAND`). Six variants:

- `"constant"`: one median log ratio per backend (a calibrated simulator;
  the floor every other variant must beat).
- `"additive"`: a step-time model of non-negative terms fitted to the
  measurements (`ADDITIVE_TERMS`): the analytic compute time of the most
  loaded replica (matmul-like layers and the rest, each with its own factor;
  devices that share a core in the cluster but not in the plan get their
  whole core), a per-step and a per-layer overhead, extra per-layer
  overheads of attention and normalisation layers (each one Keras layer
  but many framework ops: projections, softmax, moments), per-layer and
  per-variable overheads of distributed steps, the same per-layer overhead
  and gradient bytes again for every further replica on the busiest shared
  core (two processes on one core each pay their step's fixed costs there),
  the attention score elements of the most loaded replica (the
  sequence-squared intermediates, softmax and its gradient, that the
  roofline's layer bytes leave out), gradient bytes exchanged, input bytes
  scattered to other replicas, and a cost per extra device. The
  weights are non-negative least squares on the relative error
  (`scipy.optimize.nnls`), one set per backend.
- `"ridge"`: ridge regression on standardised plan features (`FEATURES`),
  its penalty chosen by leave-one-out on the training cases:
  the simulator's own breakdown, per-device work on the critical device,
  gradient bytes, device count, share imbalance, core sharing, layer-type
  mix, layer and variable counts, backend.
- `"gbr"`: gradient-boosted trees on the same features.
- `"ensemble"`: the mean of several variants' log corrections (default
  `additive` and `gnn`: a geometric mean of their predicted times).
- `"gnn"`: a small graph neural network over the plan-annotated layer graph
  (in the spirit of Disco's GNN estimator): each layer node carries its
  FLOPs, bytes, work on its group's critical replica and gradient traffic;
  two rounds of message passing along and against the data flow, mean and
  max pooling, then an MLP with the plan features. Trained in PyTorch,
  predicted in NumPy.

Every variant persists as JSON (the numbers of its fitted parameters: ridge
coefficients, every tree's nodes, the GNN's weight matrices) and predicts with
NumPy only, so a TensorFlow-only installation runs a saved estimator; only
training the GNN needs PyTorch. Nothing is pickled.

`evaluate(records, variant)` is the honest test: leave one model out, fit on
the others, predict the held-out model's plans, and report the mean absolute
percentage error and the Kendall tau of each held-out model's plan ranking.
`variant="auto"` fits the variant with the lowest held-out error.

Example:

```python
records, _ = load_measurements("benchmarks/data/measurements_torch.json")
estimator = LearnedEstimator().fit(records)          # variant="auto"
print(estimator.report["held_out"]["mape"])
estimator.save("estimator.json")
estimator = LearnedEstimator.load("estimator.json")
seconds = estimator.predict(graph, cluster, plan, backend="torch")
```
"""

import math
import os
import statistics

from autodist_keras.errors import EstimatorError
from autodist_keras.errors import received_repr

SCHEMA = "autodist_keras.learned_estimator/1"
VARIANTS = ("constant", "additive", "ridge", "gbr", "gnn", "ensemble")
# variant="auto" compares these by default ("ensemble" trains the GNN again, so it is
# left out of the nested choice to keep it affordable; name it to use it).
AUTO_VARIANTS = ("constant", "additive", "ridge", "gbr", "gnn")
BACKENDS = ("tensorflow", "torch")
CATEGORIES = ("matmul", "depthwise", "other", "free")
FEATURES = (
    "log_sim_s",
    "log_sim_compute_s",
    "sim_exposed_comm_frac",
    "sim_idle_frac",
    "log_devices",
    "max_share_frac",
    "load_imbalance",
    "log_critical_flops",
    "log_total_flops",
    "log_critical_activation_bytes",
    "log_gradient_traffic_bytes",
    "log_scattered_input_bytes",
    "log_param_bytes",
    "log_layers",
    "log_variables",
    "log_buckets",
    "matmul_flop_frac",
    "depthwise_flop_frac",
    "other_flop_frac",
    "max_core_sharing",
    "mean_core_sharing",
    "backend_torch",
)
ADDITIVE_TERMS = (
    "compute_matmul_s",
    "compute_other_s",
    "step",
    "layers",
    "attention_layers",
    "norm_layers",
    "distributed_layers",
    "distributed_variables",
    "shared_core_layers",
    "shared_core_gradient_bytes",
    "attention_score_elements",
    "gradient_traffic_bytes",
    "scattered_input_bytes",
    "extra_devices",
)
# Layer types that are one Keras layer but many framework ops per step (each a
# dispatch on PyTorch, a graph op on TensorFlow): their own per-layer terms.
ATTENTION_TYPES = frozenset(
    {"MultiHeadAttention", "GroupedQueryAttention", "Attention", "AdditiveAttention"})
NORM_TYPES = frozenset({"LayerNormalization", "BatchNormalization", "GroupNormalization",
                        "UnitNormalization", "RMSNormalization"})
NODE_FEATURES = (
    "log_forward_flops",
    "log_backward_flops",
    "log_param_bytes",
    "log_output_bytes",
    "log_critical_work",
    "log_gradient_traffic",
    "log_replicas",
    "has_variables",
) + tuple(f"is_{c}" for c in CATEGORIES)
# variant="auto" compares the variants by holding out groups of models, at most
# this many folds (leave-one-model-out when there are this many models or fewer).
AUTO_FOLDS = 4
# Predicted log-corrections are clipped to the training range widened by this
# much: a plan far from the training data gets a bounded correction.
CLIP_MARGIN = math.log(1.5)
DEFAULT_HYPERPARAMETERS = {
    "constant": {},
    "additive": {},
    "ridge": {"alphas": [0.3, 1.0, 3.0, 10.0, 30.0, 100.0]},
    "gbr": {"n_estimators": 200, "max_depth": 2, "learning_rate": 0.05,
            "min_samples_leaf": 3, "subsample": 1.0, "random_state": 0},
    "gnn": {"hidden": 16, "rounds": 2, "epochs": 200, "learning_rate": 0.01,
            "weight_decay": 1e-3, "seeds": 2},
    "ensemble": {"members": ["additive", "gnn"]},
}


# ----------------------------------------------------------------- features
def _log(x):
    return math.log(max(float(x), 1e-30))


def _device_speed(cluster, name):
    return float(cluster.device(name).peak_flops_fp32)


def _replica_loads(graph, cluster, plan):
    """Per device: FLOPs it computes and its speed-normalised work."""
    flops = {}
    for group in plan.groups:
        per_sample = sum(
            graph.nodes[name].forward_flops + graph.nodes[name].backward_flops
            for name in group.layers
        )
        for replica in group.replicas:
            flops[replica.device] = flops.get(replica.device, 0.0) + per_sample * replica.batch_share
    return flops


def _gradient_traffic(graph, plan):
    """Bytes each device sends and receives to synchronise gradients (ring estimate)."""
    owner = {}
    for group in plan.groups:
        for name in group.layers:
            owner[name] = group
    traffic = 0.0
    for node in graph.nodes.values():
        group = owner.get(node.name)
        if group is None:
            continue
        n = len(group.replicas)
        if n > 1:
            traffic += 2.0 * (n - 1) / n * node.param_bytes
    return traffic


def _scattered_input_bytes(graph, plan):
    """Input bytes per step that leave the first device (batch shards of other replicas)."""
    per_sample = sum(graph.nodes[name].output_bytes for name in graph.inputs
                     if name in graph.nodes)
    first = plan.devices[0]
    elsewhere = sum(
        r.batch_share for g in plan.groups for r in g.replicas
        if r.device != first and any(layer in graph.inputs for layer in g.layers)
    )
    return per_sample * elsewhere


def _attention_positions(node):
    """Query positions x key positions of one attention call, per sample."""
    shapes = [tuple(shape) for shape in node.input_shapes if shape]
    if not shapes:
        return 0.0
    query = shapes[0]
    value = shapes[1] if len(shapes) > 1 else query
    return float(math.prod(d or 1 for d in query[:-1]) * math.prod(d or 1 for d in value[:-1]))


def core_sharing(cluster, devices):
    """Contention factor of each device when all of `devices` run at once.

    A device on cores `C` where core `c` is used by `n_c` of the devices runs
    `len(C) / sum(1 / n_c)` times slower than alone (1 for devices without
    a CPU affinity).

    Args:
        cluster: The `Cluster`.
        devices: Device names.

    Returns:
        Dict from device name to a float >= 1.
    """
    users = {}
    for name in devices:
        for core in cluster.device(name).cpu_affinity or ():
            users[core] = users.get(core, 0) + 1
    factors = {}
    for name in devices:
        cores = set(cluster.device(name).cpu_affinity or ())
        if not cores:
            factors[name] = 1.0
            continue
        factors[name] = len(cores) / sum(1.0 / users[c] for c in cores)
    return factors


def plan_features(graph, cluster, plan, sim, backend):
    """The features of one (graph, cluster, plan, backend) case, by name.

    Args:
        graph: The `ModelGraph`.
        cluster: The `Cluster`.
        plan: The `Plan`.
        sim: Its `SimResult` from the analytic simulator.
        backend: `"tensorflow"` or `"torch"`.

    Returns:
        A dict with the keys of `FEATURES`, in that order.
    """
    devices = plan.devices
    step = max(sim.step_time_s, 1e-12)
    critical = sim.per_device.get(sim.critical_device)
    flops = _replica_loads(graph, cluster, plan)
    speeds = {d: _device_speed(cluster, d) for d in devices}
    normalised = {d: flops.get(d, 0.0) / speeds[d] for d in devices}
    mean_work = sum(flops.values()) / max(sum(speeds.values()), 1e-30)
    imbalance = max(normalised.values()) / mean_work if mean_work > 0 else 1.0
    critical_device = max(devices, key=lambda d: normalised[d])
    shares = {}
    for group in plan.groups:
        for replica in group.replicas:
            shares[replica.device] = max(shares.get(replica.device, 0), replica.batch_share)
    activation = sum(n.output_bytes for n in graph.nodes.values())
    by_category = {c: 0.0 for c in CATEGORIES}
    from autodist_keras.estimator.cost_model import op_category

    for node in graph.nodes.values():
        by_category[op_category(node.layer_type)] += node.forward_flops + node.backward_flops
    total_per_sample = sum(by_category.values()) or 1.0
    sharing = core_sharing(cluster, devices)
    values = {
        "log_sim_s": _log(step),
        "log_sim_compute_s": _log(critical.busy_s if critical else step),
        "sim_exposed_comm_frac": (critical.exposed_comm_s if critical else 0.0) / step,
        "sim_idle_frac": (critical.idle_s if critical else 0.0) / step,
        "log_devices": math.log(len(devices)),
        "max_share_frac": max(shares.values()) / plan.global_batch_size,
        "load_imbalance": imbalance,
        "log_critical_flops": math.log1p(flops.get(critical_device, 0.0)),
        "log_total_flops": math.log1p(sum(flops.values())),
        "log_critical_activation_bytes": math.log1p(activation * shares.get(critical_device, 0)),
        "log_gradient_traffic_bytes": math.log1p(_gradient_traffic(graph, plan)),
        "log_scattered_input_bytes": math.log1p(_scattered_input_bytes(graph, plan)),
        "log_param_bytes": math.log1p(graph.param_bytes),
        "log_layers": math.log(max(len(graph.nodes), 1)),
        "log_variables": math.log1p(len(graph.variables)),
        "log_buckets": math.log1p(len(plan.buckets)),
        "matmul_flop_frac": by_category["matmul"] / total_per_sample,
        "depthwise_flop_frac": by_category["depthwise"] / total_per_sample,
        "other_flop_frac": by_category["other"] / total_per_sample,
        "max_core_sharing": max(sharing.values()),
        "mean_core_sharing": sum(sharing.values()) / len(sharing),
        "backend_torch": 1.0 if backend == "torch" else 0.0,
    }
    return {name: float(values[name]) for name in FEATURES}


def additive_terms(graph, cluster, plan):
    """The terms of the `"additive"` step-time model, by name (`ADDITIVE_TERMS`).

    Args:
        graph: The `ModelGraph`.
        cluster: The `Cluster`.
        plan: The `Plan`.

    Returns:
        A dict of floats (seconds, counts or bytes).
    """
    from autodist_keras.estimator.cost_model import AnalyticCostModel
    from autodist_keras.estimator.cost_model import op_category

    cost = AnalyticCostModel(cluster)
    devices = plan.devices
    in_cluster = core_sharing(cluster, cluster.names)
    in_plan = core_sharing(cluster, devices)
    work = {}
    scores = {}
    for group in plan.groups:
        layers = [graph.nodes[name] for name in group.layers]
        positions = sum(_attention_positions(node) for node in layers
                        if node.layer_type in ATTENTION_TYPES)
        for replica in group.replicas:
            device = cluster.device(replica.device)
            # The analytic peak assumes every cluster device shares its cores; in this
            # plan the device shares them only with the plan's devices.
            factor = in_plan[replica.device] / in_cluster[replica.device]
            scores[replica.device] = (scores.get(replica.device, 0.0)
                                      + factor * positions * replica.batch_share)
            parts = work.setdefault(replica.device, {"matmul": 0.0, "other": 0.0})
            for node in layers:
                key = "matmul" if op_category(node.layer_type) == "matmul" else "other"
                for phase in ("forward", "backward"):
                    parts[key] += factor * cost.layer_time(node, device, replica.batch_share,
                                                           phase)
    for name in devices:
        parts = work[name]
        factor = in_plan[name] / in_cluster[name]
        parts["other"] += factor * cost.update_time(
            graph.param_bytes, cluster.device(name), max(len(graph.variables), 1))
    critical = max(devices, key=lambda d: work[d]["matmul"] + work[d]["other"])
    distributed = 1.0 if len(devices) > 1 else 0.0
    # Replicas beyond the first on the most shared core of the plan (0 when no two
    # plan devices share a core, and for devices without a CPU affinity).
    further_on_core = max(in_plan[d] for d in devices) - 1.0
    traffic = _gradient_traffic(graph, plan)
    values = {
        "compute_matmul_s": work[critical]["matmul"],
        "compute_other_s": work[critical]["other"],
        "step": 1.0,
        "layers": float(len(graph.nodes)),
        "attention_layers": float(sum(n.layer_type in ATTENTION_TYPES
                                      for n in graph.nodes.values())),
        "norm_layers": float(sum(n.layer_type in NORM_TYPES for n in graph.nodes.values())),
        "distributed_layers": distributed * len(graph.nodes),
        "distributed_variables": distributed * len(graph.variables),
        "shared_core_layers": further_on_core * distributed * len(graph.nodes),
        "shared_core_gradient_bytes": further_on_core * traffic,
        "attention_score_elements": max(scores.values(), default=0.0),
        "gradient_traffic_bytes": traffic,
        "scattered_input_bytes": float(_scattered_input_bytes(graph, plan)),
        "extra_devices": float(len(devices) - 1),
    }
    return {name: float(values[name]) for name in ADDITIVE_TERMS}


def node_arrays(graph, cluster, plan):
    """The plan-annotated layer graph as arrays (the GNN's input).

    Args:
        graph: The `ModelGraph`.
        cluster: The `Cluster`.
        plan: The `Plan`.

    Returns:
        `(x, edges)`: a NumPy array `(nodes, len(NODE_FEATURES))` and an
        int array `(edges, 2)` of `(src, dst)` node indices along the data
        flow.
    """
    import numpy as np

    from autodist_keras.estimator.cost_model import op_category

    owner = {}
    for group in plan.groups:
        for name in group.layers:
            owner[name] = group
    fastest = max(_device_speed(cluster, d) for d in plan.devices)
    index = {name: i for i, name in enumerate(graph.nodes)}
    rows = []
    for node in graph.nodes.values():
        group = owner[node.name]
        work_share = max(
            r.batch_share * fastest / _device_speed(cluster, r.device) for r in group.replicas
        )
        n = len(group.replicas)
        category = op_category(node.layer_type)
        per_sample = node.forward_flops + node.backward_flops
        row = [
            math.log1p(node.forward_flops),
            math.log1p(node.backward_flops),
            math.log1p(node.param_bytes),
            math.log1p(node.output_bytes),
            math.log1p(per_sample * work_share),
            math.log1p(2.0 * (n - 1) / n * node.param_bytes),
            math.log(n),
            1.0 if node.variables else 0.0,
        ] + [1.0 if category == c else 0.0 for c in CATEGORIES]
        rows.append(row)
    edges = [(index[a], index[b]) for a, b, _ in graph.edges if a in index and b in index]
    x = np.asarray(rows, dtype=float).reshape(len(rows), len(NODE_FEATURES))
    e = np.asarray(edges, dtype=int).reshape(len(edges), 2)
    return x, e


# ---------------------------------------------------------------- examples
class _Example:
    """One training or query case: features, node arrays and (maybe) the target."""

    def __init__(self, graph, cluster, plan, backend, model, name, measured_s=None,
                 sim=None, plan_kind=None, probe_s=None):
        from autodist_keras.estimator.simulator import simulate

        if backend not in BACKENDS:
            raise EstimatorError(f"backend must be one of {BACKENDS}. Received: {backend!r}")
        self.sim = sim if sim is not None else simulate(graph, cluster, plan)
        self.sim_s = float(self.sim.step_time_s)
        if not self.sim_s > 0:
            raise EstimatorError(
                f"The simulator predicts a non-positive step time for {name}; the learned "
                f"estimator corrects positive times only. Received: {self.sim_s!r}"
            )
        self.features = plan_features(graph, cluster, plan, self.sim, backend)
        self.terms = additive_terms(graph, cluster, plan)
        self.nodes, self.edges = node_arrays(graph, cluster, plan)
        self.backend = backend
        self.model = model
        self.plan_kind = plan_kind or plan.provenance.planner
        self.name = name
        self.measured_s = measured_s
        self.domain = plan_domain(graph, cluster, plan)
        # The machine-speed probe of the measurement (machine_speed.probe), and
        # its ratio to the training data's reference (set by `_set_speeds`).
        self.probe_s = probe_s
        self.speed = 1.0

    @property
    def target(self):
        """`log(measured / simulated)`, with the measurement brought to the
        reference machine speed (`speed` is 1 without probes)."""
        return _log(self.measured_s) - _log(self.sim_s) - _log(self.speed)


def speed_references(examples):
    """Median machine-speed probe per backend, for backends whose every example has one."""
    by_backend = {}
    for e in examples:
        by_backend.setdefault(e.backend, []).append(e.probe_s)
    return {b: float(statistics.median(v)) for b, v in by_backend.items()
            if all(p is not None and p > 0 for p in v)}


def _set_speeds(examples, references):
    from autodist_keras.estimator.machine_speed import speed_ratio

    for e in examples:
        e.speed = speed_ratio(e.probe_s, references.get(e.backend))


def examples_from_records(records):
    """Turns measurement records into training examples (re-simulating each plan)."""
    examples = []
    for i, record in enumerate(records):
        if isinstance(record, dict):
            from autodist_keras.estimator.measurements import Record

            record = Record.from_dict(record, source=f"records[{i}]")
        if not hasattr(record, "measured_s") or not hasattr(record, "plan"):
            raise EstimatorError(
                "Training needs measurement records (measurements.Record or their dicts). "
                f"Received: records[{i}] of type {type(record).__name__}"
            )
        if not record.measured_s > 0:
            raise EstimatorError(
                f"Record {record.name} has a non-positive measured time. "
                f"Received: measured_s={record.measured_s!r}"
            )
        examples.append(_Example(
            record.graph, record.cluster, record.plan, record.backend, record.model,
            record.name, measured_s=record.measured_s, plan_kind=record.case.plan,
            probe_s=getattr(record, "machine_probe_s", None),
        ))
    return examples


# ------------------------------------------------------------------ metrics
def mape(predicted, measured):
    """Mean absolute percentage error in percent: `mean(|p - m| / m) x 100`."""
    import numpy as np

    predicted = np.asarray(predicted, dtype=float)
    measured = np.asarray(measured, dtype=float)
    if predicted.shape != measured.shape or predicted.size == 0:
        raise EstimatorError(
            "mape needs two non-empty sequences of the same length. "
            f"Received: {predicted.size} predictions and {measured.size} measurements"
        )
    return float(np.mean(np.abs(predicted - measured) / measured) * 100.0)


def kendall_tau(a, b):
    """Kendall's tau-b rank correlation of two sequences (ties counted as tau-b does).

    `(concordant - discordant) / sqrt((n0 - ties_a) (n0 - ties_b))` over all
    pairs, `n0 = n (n - 1) / 2`; NaN when either sequence is constant.

    Args:
        a, b: Sequences of numbers of the same length (at least 2).

    Returns:
        A float in [-1, 1], or NaN.
    """
    import numpy as np

    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    if a.shape != b.shape or a.ndim != 1 or a.size < 2:
        raise EstimatorError(
            "kendall_tau needs two 1-D sequences of the same length, at least 2. "
            f"Received: shapes {a.shape} and {b.shape}"
        )
    i, j = np.triu_indices(a.size, k=1)
    da = np.sign(a[i] - a[j])
    db = np.sign(b[i] - b[j])
    n0 = float(i.size)
    ties_a = float(np.sum(da == 0))
    ties_b = float(np.sum(db == 0))
    denominator = math.sqrt((n0 - ties_a) * (n0 - ties_b))
    if denominator == 0:
        return float("nan")
    return float(np.sum(da * db) / denominator)


def ranking_tau(models, predicted, measured):
    """Mean over models of the Kendall tau of that model's plan ranking.

    For each model with at least two cases, the tau between the predicted and
    the measured step times of its plans; models whose tau is undefined
    (a constant sequence) are left out.

    Args:
        models: The model label of each case.
        predicted: Predicted step times.
        measured: Measured step times.

    Returns:
        `(mean tau, {model: tau})`; the mean is NaN when no model qualifies.
    """
    by_model = {}
    for m, p, t in zip(models, predicted, measured):
        by_model.setdefault(m, ([], []))
        by_model[m][0].append(p)
        by_model[m][1].append(t)
    taus = {}
    for m, (p, t) in by_model.items():
        if len(p) >= 2:
            tau = kendall_tau(p, t)
            if not math.isnan(tau):
                taus[m] = tau
    mean = sum(taus.values()) / len(taus) if taus else float("nan")
    return mean, taus


def metrics(models, predicted, measured):
    """MAPE, median APE, per-model ranking tau and pooled tau of predictions."""
    import numpy as np

    predicted = np.asarray(predicted, dtype=float)
    measured = np.asarray(measured, dtype=float)
    tau, per_model = ranking_tau(models, predicted, measured)
    ape = np.abs(predicted - measured) / measured * 100.0
    return {
        "mape": mape(predicted, measured),
        "median_ape": float(np.median(ape)),
        "max_ape": float(np.max(ape)),
        "kendall_tau": tau,
        "kendall_tau_per_model": per_model,
        "kendall_tau_pooled": kendall_tau(predicted, measured) if len(predicted) > 1 else float("nan"),
        "cases": int(len(predicted)),
    }


# ------------------------------------------------------------------ scalers
def _standardiser(x):
    import numpy as np

    mean = x.mean(axis=0)
    scale = x.std(axis=0)
    scale[scale < 1e-12] = 1.0
    return mean, scale


def _matrix(examples):
    import numpy as np

    return np.asarray([[e.features[name] for name in FEATURES] for e in examples], dtype=float)


# ------------------------------------------------------------ the variants
def _fit_constant(examples, hp):
    by_backend = {}
    for e in examples:
        by_backend.setdefault(e.backend, []).append(e.target)
    return {"log_ratio": {b: float(statistics.median(v)) for b, v in by_backend.items()}}


def _predict_constant(params, examples):
    import numpy as np

    return np.asarray([params["log_ratio"][e.backend] for e in examples], dtype=float)


def _terms_matrix(examples):
    import numpy as np

    return np.asarray([[e.terms[name] for name in ADDITIVE_TERMS] for e in examples], dtype=float)


def _fit_additive(examples, hp):
    import numpy as np
    from scipy.optimize import nnls

    weights = {}
    for backend in sorted({e.backend for e in examples}):
        chosen = [e for e in examples if e.backend == backend]
        x = _terms_matrix(chosen)
        # Measurements brought to the reference machine speed.
        y = np.asarray([e.measured_s / e.speed for e in chosen])
        scale = np.abs(x).max(axis=0)
        scale[scale == 0] = 1.0
        # Relative error: each row divided by its measurement.
        w, _ = nnls((x / scale) / y[:, None], np.ones(len(chosen)))
        weights[backend] = (w / scale).tolist()
    return {"weights": weights}


def _predict_additive(params, examples):
    import numpy as np

    x = _terms_matrix(examples)
    out = []
    for row, e in zip(x, examples):
        seconds = float(row @ np.asarray(params["weights"][e.backend]))
        out.append(_log(max(seconds, 1e-9)) - _log(e.sim_s))
    return np.asarray(out)


def _fit_ridge(examples, hp):
    import numpy as np
    from sklearn.linear_model import Ridge
    from sklearn.linear_model import RidgeCV

    x = _matrix(examples)
    y = np.asarray([e.target for e in examples])
    mean, scale = _standardiser(x)
    z = (x - mean) / scale
    if "alpha" in hp:
        ridge = Ridge(alpha=float(hp["alpha"])).fit(z, y)
        alpha = float(hp["alpha"])
    else:
        # The penalty is chosen on the training cases alone (efficient leave-one-out).
        ridge = RidgeCV(alphas=[float(a) for a in hp["alphas"]]).fit(z, y)
        alpha = float(ridge.alpha_)
    return {
        "mean": mean.tolist(), "scale": scale.tolist(), "alpha": alpha,
        "coef": ridge.coef_.tolist(), "intercept": float(ridge.intercept_),
    }


def _predict_ridge(params, examples):
    import numpy as np

    z = (_matrix(examples) - np.asarray(params["mean"])) / np.asarray(params["scale"])
    return z @ np.asarray(params["coef"]) + params["intercept"]


def _fit_gbr(examples, hp):
    import numpy as np
    from sklearn.ensemble import GradientBoostingRegressor

    x = _matrix(examples)
    y = np.asarray([e.target for e in examples])
    gbr = GradientBoostingRegressor(loss="squared_error", **hp).fit(x, y)
    trees = []
    for estimator in gbr.estimators_[:, 0]:
        t = estimator.tree_
        trees.append({
            "left": t.children_left.tolist(),
            "right": t.children_right.tolist(),
            "feature": t.feature.tolist(),
            "threshold": t.threshold.tolist(),
            "value": t.value[:, 0, 0].tolist(),
        })
    init = float(np.ravel(gbr.init_.predict(x[:1]))[0])
    return {"init": init, "learning_rate": float(gbr.learning_rate), "trees": trees}


def _predict_gbr(params, examples):
    import numpy as np

    x = _matrix(examples)
    out = np.full(len(examples), params["init"], dtype=float)
    for tree in params["trees"]:
        left, right = tree["left"], tree["right"]
        feature, threshold, value = tree["feature"], tree["threshold"], tree["value"]
        for row in range(len(examples)):
            node = 0
            while left[node] != -1:
                node = left[node] if x[row, feature[node]] <= threshold[node] else right[node]
            out[row] += params["learning_rate"] * value[node]
    return out


class _Batch:
    """Graphs of several examples as one disjoint graph (edge lists, pooling segments)."""

    def __init__(self, examples, node_mean, node_scale, feat_mean, feat_scale):
        import numpy as np

        xs, src, dst, offsets = [], [], [], [0]
        for e in examples:
            xs.append((e.nodes - node_mean) / node_scale)
            base = offsets[-1]
            src.append(e.edges[:, 0] + base)
            dst.append(e.edges[:, 1] + base)
            offsets.append(base + len(e.nodes))
        self.total = offsets[-1]
        self.count = len(examples)
        self.x = np.concatenate(xs, axis=0)
        self.src = np.concatenate(src).astype(int)
        self.dst = np.concatenate(dst).astype(int)
        # Mean over a node's producers (in) and over its consumers (out).
        self.in_degree = np.maximum(np.bincount(self.dst, minlength=self.total), 1)[:, None]
        self.out_degree = np.maximum(np.bincount(self.src, minlength=self.total), 1)[:, None]
        self.offsets = offsets
        self.segment = np.repeat(np.arange(self.count), np.diff(offsets))
        self.sizes = np.diff(offsets)[:, None].astype(float)
        self.g = (_matrix(examples) - feat_mean) / feat_scale


def _gnn_forward_numpy(weights, batch):
    """The GNN's forward pass in NumPy: message passing, mean and max pooling, MLP head."""
    import numpy as np

    h = batch.x
    for layer in weights["rounds"]:
        from_producers = np.zeros_like(h)
        np.add.at(from_producers, batch.dst, h[batch.src])
        from_consumers = np.zeros_like(h)
        np.add.at(from_consumers, batch.src, h[batch.dst])
        h = (h @ np.asarray(layer["self"])
             + (from_producers / batch.in_degree) @ np.asarray(layer["in"])
             + (from_consumers / batch.out_degree) @ np.asarray(layer["out"])
             + np.asarray(layer["bias"]))
        h = np.maximum(h, 0.0)
    mean = np.zeros((batch.count, h.shape[1]))
    np.add.at(mean, batch.segment, h)
    mean /= batch.sizes
    peak = np.full((batch.count, h.shape[1]), -np.inf)
    np.maximum.at(peak, batch.segment, h)
    z = np.concatenate([mean, peak, batch.g], axis=1)
    z = np.maximum(z @ np.asarray(weights["head1"]) + np.asarray(weights["head1_bias"]), 0.0)
    return (z @ np.asarray(weights["head2"]) + np.asarray(weights["head2_bias"]))[:, 0]


def _fit_gnn(examples, hp):
    try:
        import torch
    except ImportError:
        raise EstimatorError(
            "Training the 'gnn' variant needs PyTorch (prediction does not). Install torch, "
            "or use variant='ridge' or 'gbr'. Received: variant='gnn'"
        ) from None
    import numpy as np

    nodes = np.concatenate([e.nodes for e in examples], axis=0)
    node_mean, node_scale = _standardiser(nodes)
    feat_mean, feat_scale = _standardiser(_matrix(examples))
    batch = _Batch(examples, node_mean, node_scale, feat_mean, feat_scale)
    y = np.asarray([e.target for e in examples])
    y_mean = float(y.mean())
    # Tiny matrices: one thread is fastest, and spinning thread pools crawl on a busy machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ensemble = [_train_gnn_member(torch, seed, hp, batch, y - y_mean, y_mean)
                    for seed in range(int(hp["seeds"]))]
    finally:
        torch.set_num_threads(threads)
    return {
        "node_mean": node_mean.tolist(), "node_scale": node_scale.tolist(),
        "feature_mean": feat_mean.tolist(), "feature_scale": feat_scale.tolist(),
        "ensemble": ensemble,
    }


def _train_gnn_member(torch, seed, hp, batch, target, y_mean):
    """Trains one network of the ensemble (full-batch Adam on the squared error).

    The forward pass is `_gnn_forward_numpy`'s, written with torch ops.
    """
    f64 = torch.float64
    hidden, rounds = int(hp["hidden"]), int(hp["rounds"])
    generator = torch.Generator().manual_seed(seed)

    def param(*shape, scale=None):
        s = scale if scale is not None else 1.0 / math.sqrt(shape[0])
        return (torch.randn(*shape, generator=generator, dtype=f64) * s).requires_grad_()

    def zeros(n):
        return torch.zeros(n, dtype=f64, requires_grad=True)

    layers = []
    width = batch.x.shape[1]
    for _ in range(rounds):
        layers.append({"self": param(width, hidden), "in": param(width, hidden),
                       "out": param(width, hidden), "bias": zeros(hidden)})
        width = hidden
    head1, head1_bias = param(2 * hidden + batch.g.shape[1], hidden), zeros(hidden)
    head2, head2_bias = param(hidden, 1, scale=0.01), zeros(1)
    params = [p for layer in layers for p in layer.values()] + [head1, head1_bias, head2, head2_bias]
    optimizer = torch.optim.Adam(params, lr=float(hp["learning_rate"]),
                                 weight_decay=float(hp["weight_decay"]))
    x = torch.tensor(batch.x, dtype=f64)
    g = torch.tensor(batch.g, dtype=f64)
    y = torch.tensor(target, dtype=f64)
    src = torch.tensor(batch.src, dtype=torch.long)
    dst = torch.tensor(batch.dst, dtype=torch.long)
    in_degree = torch.tensor(batch.in_degree, dtype=f64)
    out_degree = torch.tensor(batch.out_degree, dtype=f64)
    segment = torch.tensor(batch.segment, dtype=torch.long)
    sizes = torch.tensor(batch.sizes, dtype=f64)
    for _ in range(int(hp["epochs"])):
        h = x
        for layer in layers:
            from_producers = torch.zeros_like(h).index_add_(0, dst, h[src]) / in_degree
            from_consumers = torch.zeros_like(h).index_add_(0, src, h[dst]) / out_degree
            h = torch.relu(h @ layer["self"] + from_producers @ layer["in"]
                           + from_consumers @ layer["out"] + layer["bias"])
        index = segment[:, None].expand(-1, h.shape[1])
        mean = torch.zeros(batch.count, h.shape[1], dtype=f64).index_add_(0, segment, h) / sizes
        peak = torch.zeros(batch.count, h.shape[1], dtype=f64).scatter_reduce(
            0, index, h, reduce="amax", include_self=False)
        z = torch.cat([mean, peak, g], dim=1)
        out = (torch.relu(z @ head1 + head1_bias) @ head2 + head2_bias)[:, 0]
        loss = torch.mean((out - y) ** 2)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return {
        "rounds": [{k: v.detach().numpy().tolist() for k, v in layer.items()}
                   for layer in layers],
        "head1": head1.detach().numpy().tolist(),
        "head1_bias": head1_bias.detach().numpy().tolist(),
        "head2": head2.detach().numpy().tolist(),
        "head2_bias": (head2_bias.detach().numpy() + y_mean).tolist(),
    }


def _predict_gnn(params, examples):
    import numpy as np

    batch = _Batch(examples, np.asarray(params["node_mean"]), np.asarray(params["node_scale"]),
                   np.asarray(params["feature_mean"]), np.asarray(params["feature_scale"]))
    return np.mean([_gnn_forward_numpy(w, batch) for w in params["ensemble"]], axis=0)


def _fit_ensemble(examples, hp):
    members = list(hp.get("members") or [])
    bad = [m for m in members if m not in _FIT or m == "ensemble"]
    if len(members) < 2 or bad:
        raise EstimatorError(
            "The 'ensemble' variant needs at least two member variants among "
            f"{[v for v in VARIANTS if v != 'ensemble']}. Received: members={members!r}"
        )
    return {"members": {m: _FIT[m](examples, dict(DEFAULT_HYPERPARAMETERS[m],
                                                  **(hp.get(m) or {})))
                        for m in members}}


def _predict_ensemble(params, examples):
    """The mean of the members' log corrections (a geometric mean of their times)."""
    import numpy as np

    return np.mean([_PREDICT[m](p, examples) for m, p in params["members"].items()], axis=0)


_FIT = {"constant": _fit_constant, "additive": _fit_additive, "ridge": _fit_ridge,
        "gbr": _fit_gbr, "gnn": _fit_gnn, "ensemble": _fit_ensemble}
_PREDICT = {"constant": _predict_constant, "additive": _predict_additive,
            "ridge": _predict_ridge, "gbr": _predict_gbr, "gnn": _predict_gnn,
            "ensemble": _predict_ensemble}


def _check_variant(variant, allow_auto=True):
    allowed = VARIANTS + (("auto",) if allow_auto else ())
    if variant not in allowed:
        raise EstimatorError(f"variant must be one of {allowed}. Received: variant={variant!r}")


# ------------------------------------------------- checking loaded files
_MISSING = object()


class _BadParams(Exception):
    """A field of a loaded estimator that prediction cannot use."""

    def __init__(self, field, expected, value):
        super().__init__(field)
        self.field, self.expected, self.value = field, expected, value


def _shape(value):
    """`()` for a number, `(n,)` for a non-empty list of numbers, `(n, m)` for a
    rectangular list of such lists; None for anything else."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return ()
    if isinstance(value, list) and value:
        inner = {_shape(v) for v in value}
        if len(inner) == 1:
            (item,) = inner
            if item is not None and len(item) < 2:
                return (len(value),) + item
    return None


def _expect(parent, key, shape, field):
    """`parent[key]`'s shape, which must be `shape` (None: any length)."""
    value = parent.get(key, _MISSING) if isinstance(parent, dict) else _MISSING
    actual = _shape(value)
    if actual is None or len(actual) != len(shape) or any(
            want is not None and want != got for want, got in zip(shape, actual)):
        if not shape:
            expected = "a number"
        elif len(shape) == 1:
            expected = f"a list of {shape[0] or 'some'} numbers"
        else:
            sizes = " x ".join("n" if n is None else str(n) for n in shape)
            expected = f"a {sizes} matrix (a list of lists) of numbers"
        raise _BadParams(field, expected, value)
    return actual


def _member(parent, key, kind, field, empty=False):
    """`parent[key]`, which must be a `kind` (dict or list), non-empty unless `empty`."""
    value = parent.get(key, _MISSING) if isinstance(parent, dict) else _MISSING
    if not (isinstance(value, kind) and (value or empty)):
        what = "JSON object" if kind is dict else "list"
        raise _BadParams(field, f"a {what}" if empty else f"a non-empty {what}", value)
    return value


def _check_params(variant, params, backends, field="params"):
    """Raises `_BadParams` unless `params` has what `_PREDICT[variant]` reads."""
    if not isinstance(params, dict):
        raise _BadParams(field, "a JSON object", params)
    features, node_features = len(FEATURES), len(NODE_FEATURES)
    if variant in ("constant", "additive"):
        key, shape = (("log_ratio", ()) if variant == "constant"
                      else ("weights", (len(ADDITIVE_TERMS),)))
        by_backend = _member(params, key, dict, f"{field}.{key}")
        for backend in backends:
            _expect(by_backend, backend, shape, f"{field}.{key}.{backend}")
    elif variant == "ridge":
        for key in ("mean", "scale", "coef"):
            _expect(params, key, (features,), f"{field}.{key}")
        _expect(params, "intercept", (), f"{field}.intercept")
    elif variant == "gbr":
        _expect(params, "init", (), f"{field}.init")
        _expect(params, "learning_rate", (), f"{field}.learning_rate")
        for i, tree in enumerate(_member(params, "trees", list, f"{field}.trees")):
            where = f"{field}.trees[{i}]"
            (nodes,) = _expect(tree, "left", (None,), f"{where}.left")
            for key in ("right", "feature", "threshold", "value"):
                _expect(tree, key, (nodes,), f"{where}.{key}")
            for key, low, high in (("left", -1, nodes), ("right", -1, nodes),
                                   ("feature", -2, features)):
                if not all(isinstance(v, int) and low <= v < high for v in tree[key]):
                    raise _BadParams(f"{where}.{key}",
                                     f"a list of integers in [{low}, {high})", tree[key])
    elif variant == "gnn":
        for key, n in (("node_mean", node_features), ("node_scale", node_features),
                       ("feature_mean", features), ("feature_scale", features)):
            _expect(params, key, (n,), f"{field}.{key}")
        for i, net in enumerate(_member(params, "ensemble", list, f"{field}.ensemble")):
            where = f"{field}.ensemble[{i}]"
            width = node_features
            for r, layer in enumerate(_member(net, "rounds", list, f"{where}.rounds", True)):
                hidden = _expect(layer, "self", (width, None), f"{where}.rounds[{r}].self")[1]
                for key in ("in", "out"):
                    _expect(layer, key, (width, hidden), f"{where}.rounds[{r}].{key}")
                _expect(layer, "bias", (hidden,), f"{where}.rounds[{r}].bias")
                width = hidden
            head = _expect(net, "head1", (2 * width + features, None), f"{where}.head1")[1]
            _expect(net, "head1_bias", (head,), f"{where}.head1_bias")
            _expect(net, "head2", (head, 1), f"{where}.head2")
            _expect(net, "head2_bias", (1,), f"{where}.head2_bias")
    elif variant == "ensemble":
        members = _member(params, "members", dict, f"{field}.members")
        for name, member in members.items():
            if name not in VARIANTS or name == "ensemble":
                raise _BadParams(f"{field}.members",
                                 f"keyed by variants among {VARIANTS[:-1]}", members)
            _check_params(name, member, backends, f"{field}.members.{name}")


def _check_domain(domain):
    """Raises `_BadParams` unless `domain` has what `in_domain` reads."""
    if not isinstance(domain, dict):
        raise _BadParams("domain", "null or a JSON object", domain)
    for key in ("devices", "structures", "sync"):
        _member(domain, key, list, f"domain.{key}", empty=True)
    calibration = _member(domain, "calibration", dict, "domain.calibration")
    for backend in calibration:
        _expect(calibration, backend, (), f"domain.calibration.{backend}")
    for key in ("param_bytes", "flops_per_sample", "batch_size"):
        if key in domain:
            _expect(domain, key, (2,), f"domain.{key}")
    if not isinstance(domain.get("op_fusion", _MISSING), bool):
        raise _BadParams("domain.op_fusion", "true or false", domain.get("op_fusion", _MISSING))
    if "margin" in domain:
        _expect(domain, "margin", (), "domain.margin")
    if "layer_types" in domain:
        types = _member(domain, "layer_types", list, "domain.layer_types", empty=True)
        if not all(isinstance(t, str) for t in types):
            raise _BadParams("domain.layer_types", "a list of layer type names", types)


def _torch_available():
    import importlib.util

    return importlib.util.find_spec("torch") is not None


# ------------------------------------------------------------------ domain
# A graph counts as in the training domain when its parameter bytes and its
# FLOPs per sample lie within the training models' range widened by this factor.
DOMAIN_MARGIN = 4.0
# A model whose layer types absent from the training models carry more than this
# share of its FLOPs is outside the domain (recurrent layers, say: a BiLSTM model
# was predicted 9.4x too fast). Cheap unseen layers (Dropout, Flatten) pass.
UNSEEN_LAYER_SHARE = 0.10


def device_signature(device):
    """What identifies a kind of device for the learned estimator's domain.

    Kind, catalog model, peak FP32 FLOP/s, memory bandwidth and, on the CPU
    testbed, the cores and thread count (not the memory size, which the CPU
    testbed takes from the machine).

    Args:
        device: A `Device`.

    Returns:
        A string.
    """
    affinity = ",".join(str(c) for c in (device.cpu_affinity or ()))
    return (f"{device.kind}:{device.model}:{float(device.peak_flops_fp32):.6g}:"
            f"{float(device.memory_bandwidth):.6g}:cores={affinity}:threads={device.threads}")


def describe_signature(signature):
    """A device signature (`device_signature`) in words, for messages.

    Args:
        signature: A string made by `device_signature`.

    Returns:
        A string such as `"GPU V100-SXM2-16GB (15.7 TFLOP/s, 900 GB/s)"` or
        `"CPU testbed device on core(s) 0, 1 thread (40 GFLOP/s, 5 GB/s)"`.

    Example:

    ```python
    >>> describe_signature("cpu:cpu:4e+10:5e+09:cores=1:threads=1")
    'CPU testbed device on core(s) 1, 1 thread (40 GFLOP/s, 5 GB/s)'
    ```
    """
    parts = str(signature).split(":")
    if len(parts) < 6 or not parts[4].startswith("cores=") or not parts[5].startswith("threads="):
        return str(signature)
    kind, model = parts[0], parts[1]
    try:
        flops, bandwidth = float(parts[2]), float(parts[3])
    except ValueError:
        return str(signature)
    cores, threads = parts[4][len("cores="):], parts[5][len("threads="):]
    speed = f"{_si(flops)}FLOP/s, {_si(bandwidth)}B/s"
    if kind != "cpu":
        return f"{kind.upper()} {model} ({speed})"
    if not cores:
        return f"CPU device on every core ({speed})"
    thread_text = "" if threads in ("None", "") else (
        f", {threads} thread" + ("" if threads == "1" else "s"))
    return f"CPU testbed device on core(s) {cores.replace(',', ', ')}{thread_text} ({speed})"


def _si(value):
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}"
    return f"{value:.3g} "


def sync_kinds(plan):
    """The gradient synchronisation kinds of a plan, e.g. `["allreduce/ring"]`."""
    kinds = set()
    for spec in plan.sync.values():
        kinds.add(f"ps@{'replica' if spec.server in plan.devices else 'server'}"
                  if spec.method == "ps" else f"allreduce/{spec.algorithm}")
    return sorted(kinds)


def plan_domain(graph, cluster, plan):
    """The properties of one (graph, cluster, plan) the domain rule looks at."""
    return {
        "devices": sorted({device_signature(cluster.device(d)) for d in plan.devices}),
        "structure": "data_parallel" if plan.is_data_parallel else "placement_or_hybrid",
        "sync": sync_kinds(plan),
        "op_fusion": bool(plan.op_fusion),
        "batch_size": float(plan.global_batch_size),
        "param_bytes": float(graph.param_bytes),
        "flops_per_sample": float(sum(n.forward_flops + n.backward_flops
                                      for n in graph.nodes.values())),
        "layer_types": sorted({n.layer_type for n in graph.nodes.values()}),
    }


def _domain_of(examples):
    """The training domain of fitted examples (see `LearnedEstimator.in_domain`)."""
    by_backend = {}
    for e in examples:
        by_backend.setdefault(e.backend, []).append(e.target)
    return {
        "devices": sorted({d for e in examples for d in e.domain["devices"]}),
        "structures": sorted({e.domain["structure"] for e in examples}),
        "sync": sorted({k for e in examples for k in e.domain["sync"]}),
        "op_fusion": any(e.domain["op_fusion"] for e in examples),
        "batch_size": [min(e.domain["batch_size"] for e in examples),
                       max(e.domain["batch_size"] for e in examples)],
        "param_bytes": [min(e.domain["param_bytes"] for e in examples),
                        max(e.domain["param_bytes"] for e in examples)],
        "flops_per_sample": [min(e.domain["flops_per_sample"] for e in examples),
                             max(e.domain["flops_per_sample"] for e in examples)],
        "layer_types": sorted({t for e in examples for t in e.domain.get("layer_types", ())}),
        "margin": DOMAIN_MARGIN,
        # Median log(measured / simulated) per backend: the simulator's calibration.
        "calibration": {b: float(statistics.median(v)) for b, v in by_backend.items()},
    }


def unseen_layer_share(graph, trained_types):
    """`(types, share)`: the graph's layer types absent from `trained_types`, and the
    share of its forward and backward FLOPs they carry."""
    trained = set(trained_types)
    total = unseen = 0.0
    types = set()
    for node in graph.nodes.values():
        flops = node.forward_flops + node.backward_flops
        total += flops
        if node.layer_type not in trained:
            types.add(node.layer_type)
            unseen += flops
    return sorted(types), (unseen / total if total else 0.0)


def _within(value, bounds, margin):
    low, high = bounds
    return low / margin <= value <= high * margin


# ----------------------------------------------------------- the estimator
class LearnedEstimator:
    """Predicts a plan's measured step time: the simulator times a learned correction.

    Args:
        variant: `"constant"`, `"additive"`, `"ridge"`, `"gbr"`, `"gnn"`,
            `"ensemble"`, or `"auto"`
            (the default: at `fit`, evaluate every variant that can train
            here by holding out models (`AUTO_FOLDS` groups of them, or one
            at a time when there are that few), and keep the lowest held-out
            MAPE).
        hyperparameters: Overrides of `DEFAULT_HYPERPARAMETERS[variant]`;
            with `"auto"`, a dict of such overrides per variant (e.g.
            `{"gnn": {"epochs": 200}}`).
        candidates: The variants `"auto"` compares (default: all of
            `VARIANTS`, `"gnn"` only where PyTorch is installed).
        machine_speed: When every training measurement of a backend recorded
            the machine-speed probe (`estimator/machine_speed.py`), learn
            from step times brought to the median probe's speed, and scale
            predictions by `speed_factor` (default True).

    Attributes:
        report: What `fit` found: the chosen variant, the held-out metrics
            of every evaluated variant and of the analytic simulator, and
            the training cases.

    Example:

    ```python
    estimator = LearnedEstimator(variant="ridge").fit(records)
    t = estimator.predict(graph, Cluster.cpu_testbed(), plan, backend="torch")
    ```
    """

    def __init__(self, variant="auto", hyperparameters=None, candidates=None,
                 machine_speed=True):
        _check_variant(variant)
        if candidates is not None:
            candidates = list(candidates)
            for c in candidates:
                _check_variant(c, allow_auto=False)
            if not candidates:
                raise EstimatorError("candidates must name at least one variant. Received: []")
        self.variant = variant
        self.candidates = candidates
        self.hyperparameters = dict(hyperparameters or {})
        self.params = None
        self.report = {}
        self.clip = None
        self.backends = []
        self.domain = None
        self.machine_speed = bool(machine_speed)
        # Reference machine-speed probe per backend (median over the training
        # measurements); empty when they recorded none.
        self.machine_probe_s = {}

    @property
    def trained(self):
        """True once fitted (or loaded)."""
        return self.params is not None

    # ------------------------------------------------------------ training
    def fit(self, records, evaluate=None):
        """Fits the correction on measurement records; returns `self`.

        Args:
            records: `measurements.Record` objects (or their dicts), at
                least two, from one or both backends.
            evaluate: Run the leave-one-model-out evaluation and store it in
                `report` (default: only when `variant="auto"`, which needs
                it to choose; needs records of at least two models).

        Raises:
            EstimatorError: With fewer than two records, or records of only
                one model when the variant is `"auto"`.
        """
        examples = records if _all_examples(records) else examples_from_records(records)
        if len(examples) < 2:
            raise EstimatorError(
                "The learned estimator needs at least two measured cases to fit. "
                f"Received: {len(examples)} record(s)"
            )
        variant = self.variant
        evaluate = (variant == "auto") if evaluate is None else bool(evaluate)
        report = {"training_cases": len(examples),
                  "training_models": sorted({e.model for e in examples}),
                  "backends": sorted({e.backend for e in examples})}
        if evaluate:
            candidates = self.candidates or [v for v in AUTO_VARIANTS
                                             if v != "gnn" or _torch_available()]
            if variant != "auto":
                candidates = [variant]
            results = {v: evaluate_examples(examples, v, self._hp(v), folds=AUTO_FOLDS,
                                            machine_speed=self.machine_speed)
                       for v in candidates}
            report["held_out_by_variant"] = {v: r["learned"] for v, r in results.items()}
            report["held_out_analytic"] = next(iter(results.values()))["analytic"]
            if variant == "auto":
                variant = min(candidates, key=lambda v: (results[v]["learned"]["mape"],
                                                         -_nan_to(results[v]["learned"]["kendall_tau"])))
            report["held_out"] = results[variant]["learned"]
        report["variant"] = variant
        if self.variant == "auto":
            self.hyperparameters = dict(self.hyperparameters.get(variant) or {})
        self.variant = variant
        self._fit_examples(examples)
        self.report = report
        return self

    def _hp(self, variant):
        hp = dict(DEFAULT_HYPERPARAMETERS[variant])
        if variant == self.variant:
            hp.update(self.hyperparameters)
        elif self.variant == "auto":
            hp.update(self.hyperparameters.get(variant) or {})
        return hp

    def _fit_examples(self, examples):
        import numpy as np

        _check_variant(self.variant, allow_auto=False)
        hp = self._hp(self.variant)
        self.machine_probe_s = speed_references(examples) if self.machine_speed else {}
        _set_speeds(examples, self.machine_probe_s)
        self.params = _FIT[self.variant](examples, hp)
        self.hyperparameters = hp
        targets = np.asarray([e.target for e in examples])
        self.clip = [float(targets.min() - CLIP_MARGIN), float(targets.max() + CLIP_MARGIN)]
        self.backends = sorted({e.backend for e in examples})
        self.domain = _domain_of(examples)
        return self

    # ---------------------------------------------------------- prediction
    def _require_trained(self):
        if self.params is None:
            raise EstimatorError(
                "This LearnedEstimator is not trained; call fit(records) or "
                "LearnedEstimator.load(path) first. Received: an untrained estimator"
            )

    def _log_ratios(self, examples):
        import numpy as np

        self._require_trained()
        for e in examples:
            if e.backend not in self.backends:
                raise EstimatorError(
                    f"This estimator was trained on {self.backends} measurements and cannot "
                    f"correct {e.backend!r} plans; train it on measurements of that backend "
                    f"(see estimator/measurements.py). Received: backend={e.backend!r}"
                )
        raw = _PREDICT[self.variant](self.params, examples)
        return np.clip(np.asarray(raw, dtype=float), self.clip[0], self.clip[1])

    def speed_factor(self, backend, machine_probe_s):
        """`machine_probe_s / reference probe` of `backend`: how much slower this
        machine runs now than during the training measurements (1.0 when either
        is unknown or the ratio is within the probe's noise,
        `machine_speed.speed_ratio`)."""
        from autodist_keras.estimator.machine_speed import speed_ratio

        return speed_ratio(machine_probe_s, self.machine_probe_s.get(backend))

    def predict(self, graph, cluster, plan, backend=None, sim=None, machine_probe_s=None):
        """Predicted step time of `plan` in seconds (simulated, then corrected).

        Args:
            graph: The `ModelGraph`.
            cluster: The `Cluster`.
            plan: The `Plan`.
            backend: `"tensorflow"` or `"torch"`; default the active Keras
                backend (or `$KERAS_BACKEND`).
            sim: The plan's `SimResult` from the analytic simulator, if
                already computed.
            machine_probe_s: `machine_speed.probe(cores).seconds` now, on
                the cluster's cores (as the training measurements probed
                them), for CPU devices of this machine: the prediction is
                scaled by `speed_factor`. None: no scaling.

        Returns:
            Seconds (a prediction).
        """
        from autodist_keras.estimator.measurements import _resolve_backend

        backend = _resolve_backend(backend)
        example = _Example(graph, cluster, plan, backend, model="?", name="query", sim=sim)
        return float(example.sim_s * math.exp(self._log_ratios([example])[0])
                     * self.speed_factor(backend, machine_probe_s))

    def predict_records(self, records):
        """Predicted step times (seconds) for measurement records' plans."""
        examples = records if _all_examples(records) else examples_from_records(records)
        ratios = self._log_ratios(examples)
        return [float(e.sim_s * math.exp(r) * self.speed_factor(e.backend, e.probe_s))
                for e, r in zip(examples, ratios)]

    # -------------------------------------------------------------- domain
    def cluster_in_domain(self, cluster, devices=None, backend=None):
        """Whether a search over `devices` of `cluster` can use this estimator at all.

        True when the backend is one it was trained on and every device's
        signature (`device_signature`) was seen in training.

        Args:
            cluster: The `Cluster`.
            devices: Device names (default: every device of the cluster).
            backend: `"tensorflow"` or `"torch"` (default: the active one).

        Returns:
            `(bool, reason)`; the reason says what lies outside (empty when inside).
        """
        from autodist_keras.estimator.measurements import _resolve_backend

        self._require_trained()
        backend = _resolve_backend(backend)
        if backend not in self.backends:
            return False, (f"the learned estimator was trained on {self.backends} "
                           f"measurements, not {backend!r}")
        if self.domain is None:
            return True, ""
        known = set(self.domain["devices"])
        unknown = {}
        for d in (devices or cluster.names):
            signature = device_signature(cluster.device(d))
            if signature not in known:
                unknown.setdefault(signature, []).append(d)
        if unknown:
            kinds = sorted(unknown.items())
            listed = "; ".join(f"{', '.join(names[:3])}{' ...' if len(names) > 3 else ''}: "
                               f"{describe_signature(sig)}"
                               for sig, names in kinds[:3])
            if len(kinds) > 3:
                listed += f"; and {len(kinds) - 3} more kind(s)"
            trained = "; ".join(describe_signature(sig) for sig in sorted(known))
            return False, (f"these devices are of kinds not in its training measurements "
                           f"({listed}); it was trained on: {trained}")
        return True, ""

    def in_domain(self, graph, cluster, plan, backend=None):
        """Whether `plan` lies in the domain the estimator was trained on.

        The rule: the backend and every plan device's signature were in the
        training data (`cluster_in_domain`); the plan's structure
        (data-parallel, or placement/hybrid), every gradient sync kind
        (`sync_kinds`) and op fusion (none, unless trained with it) were
        seen in training; and the model's parameter bytes, its FLOPs per
        sample and the global batch size lie within the training range
        widened by `DOMAIN_MARGIN` either way. An estimator saved without a domain
        (older files) checks the backend only.

        Args:
            graph: The `ModelGraph`.
            cluster: The `Cluster`.
            plan: The `Plan`.
            backend: `"tensorflow"` or `"torch"` (default: the active one).

        Returns:
            `(bool, reason)`; the reason names what lies outside (empty when inside).
        """
        ok, why = self.cluster_in_domain(cluster, plan.devices, backend)
        if not ok or self.domain is None:
            return ok, why
        d = self.domain
        mine = plan_domain(graph, cluster, plan)
        if mine["structure"] not in d["structures"]:
            return False, f"{mine['structure']} plans were not in its training data"
        other = sorted(set(mine["sync"]) - set(d["sync"]))
        if other:
            return False, f"gradient sync {other} was not in its training data (trained: {d['sync']})"
        if mine["op_fusion"] and not d["op_fusion"]:
            return False, "op fusion was not in its training data"
        if d.get("layer_types"):
            unseen = unseen_layer_share(graph, d["layer_types"])
            if unseen[1] > UNSEEN_LAYER_SHARE:
                return False, (
                    f"layers of types {unseen[0]} were not in its training models, and they "
                    f"carry {unseen[1]:.0%} of the model's FLOPs")
        margin = float(d.get("margin", DOMAIN_MARGIN))
        for key, label in (("param_bytes", "parameter bytes"),
                           ("flops_per_sample", "FLOPs per sample"),
                           ("batch_size", "global batch size")):
            if key in d and not _within(mine[key], d[key], margin):
                return False, (f"the {label} ({mine[key]:.3g}) lies outside the "
                               f"training range [{d[key][0]:.3g}, {d[key][1]:.3g}] widened "
                               f"{margin:g}x")
        return True, ""

    def calibration(self, backend):
        """`exp(median log(measured / simulated))` of the training cases of `backend`.

        The factor that turns the analytic simulator's step time into the
        scale of measured steps; 1.0 when unknown.
        """
        if self.domain is None:
            if self.variant == "constant":
                return math.exp(self.params["log_ratio"].get(backend, 0.0))
            return 1.0
        return math.exp(self.domain["calibration"].get(backend, 0.0))

    def describe(self, backend=None):
        """A short label, e.g. `"learned estimator (gnn, torch)"`."""
        return f"learned estimator ({self.variant}, {backend or '/'.join(self.backends)})"

    # --------------------------------------------------------- persistence
    def to_dict(self):
        """JSON-ready dict of the fitted parameters (no samples, no pickle)."""
        self._require_trained()
        return {
            "schema": SCHEMA,
            "variant": self.variant,
            "hyperparameters": self.hyperparameters,
            "features": list(FEATURES),
            "node_features": list(NODE_FEATURES),
            "additive_terms": list(ADDITIVE_TERMS),
            "backends": list(self.backends),
            "clip": list(self.clip),
            "params": self.params,
            "report": _jsonable(self.report),
            "base": "simulator with AnalyticCostModel (default constants)",
            "domain": self.domain,
            "machine_probe_s": dict(self.machine_probe_s),
        }

    def save(self, path):
        """Writes the estimator as JSON (atomically); returns the path."""
        from autodist_keras.estimator.profiler import write_json_atomic

        write_json_atomic(path, self.to_dict())
        return path

    @classmethod
    def from_dict(cls, data, source="<dict>"):
        """Rebuilds an estimator from `to_dict()` output.

        Every field prediction reads is checked here, the parameters against
        the shapes their variant needs, so a damaged file fails when loaded,
        not when a plan is scored.

        Args:
            data: The dict.
            source: Where it came from (a file path), for messages.

        Raises:
            EstimatorError: Naming `source` and the field, if the data is not
                a learned estimator of this version or a field is malformed.
        """
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise EstimatorError(
                f"{source}: not a learned estimator (expected schema {SCHEMA!r}). Write it "
                "with LearnedEstimator.save(). Received: "
                f"{data.get('schema') if isinstance(data, dict) else type(data).__name__!r}"
            )
        if (data.get("features") != list(FEATURES)
                or data.get("node_features") != list(NODE_FEATURES)
                or data.get("additive_terms") != list(ADDITIVE_TERMS)):
            raise EstimatorError(
                f"{source}: the estimator was trained on other features than this version "
                "of autodist_keras computes; retrain it on the measurements. Received: "
                f"features={data.get('features')!r}"
            )

        def bad(field, expected, value):
            shown = "missing" if value is _MISSING else received_repr(value)
            return EstimatorError(
                f"{source}: malformed learned estimator, field `{field}` must be {expected}. "
                f"Write it with LearnedEstimator.save(). Received: {field}={shown}"
            )

        variant = data.get("variant", _MISSING)
        if variant not in VARIANTS:
            raise bad("variant", f"one of {VARIANTS}", variant)
        backends = data.get("backends", _MISSING)
        if not (isinstance(backends, list) and backends
                and all(isinstance(b, str) for b in backends)):
            raise bad("backends", "a non-empty list of backend names", backends)
        clip = data.get("clip", _MISSING)
        if _shape(clip) != (2,):
            raise bad("clip", "a list of two numbers", clip)
        domain = data.get("domain")
        try:
            _check_params(variant, data.get("params", _MISSING), backends)
            if domain is not None:
                _check_domain(domain)
        except _BadParams as e:
            raise bad(e.field, e.expected, e.value) from None
        probes = data.get("machine_probe_s") or {}
        if not (isinstance(probes, dict) and all(_shape(v) == () for v in probes.values())):
            raise bad("machine_probe_s", "a JSON object of seconds by backend", probes)
        report = data.get("report") or {}
        if not isinstance(report, dict):
            raise bad("report", "a JSON object", report)
        hyperparameters = data.get("hyperparameters")
        if hyperparameters is not None and not isinstance(hyperparameters, dict):
            raise bad("hyperparameters", "a JSON object", hyperparameters)
        estimator = cls(variant=variant, hyperparameters=hyperparameters)
        estimator.params = data["params"]
        estimator.clip = [float(c) for c in clip]
        estimator.backends = list(backends)
        estimator.report = dict(report)
        estimator.machine_probe_s = {str(b): float(v) for b, v in probes.items()}
        if domain is not None:
            estimator.domain = dict(domain)
            estimator.domain["calibration"] = {
                b: float(v) for b, v in domain["calibration"].items()}
        return estimator

    @classmethod
    def load(cls, path):
        """Reads an estimator written by `save` (JSON; no pickle)."""
        from autodist_keras.estimator.profiler import read_json

        path = os.fspath(path)
        return cls.from_dict(read_json(path, "learned estimator"), source=path)


def _all_examples(items):
    return bool(items) and all(isinstance(i, _Example) for i in items)


def _nan_to(value, default=-1.0):
    return default if value is None or (isinstance(value, float) and math.isnan(value)) else value


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    return value


# --------------------------------------------------------------- held out
def evaluate_examples(examples, variant, hyperparameters=None, folds=None, by="model",
                      machine_speed=True):
    """Held-out predictions and metrics of one variant (see `evaluate`)."""
    _check_variant(variant)
    if by not in ("model", "plan"):
        raise EstimatorError(f"by must be 'model' or 'plan'. Received: by={by!r}")
    key = (lambda e: e.model) if by == "model" else (lambda e: e.plan_kind)
    values = sorted({key(e) for e in examples})
    if len(values) < 2:
        raise EstimatorError(
            f"Held-out evaluation leaves one {by} out at a time and needs measurements of "
            f"at least two {by}s. Received: {by}s {values}"
        )
    if variant == "auto" and len({e.model for e in examples}) < 3:
        raise EstimatorError(
            "Evaluating variant='auto' chooses the variant inside each fold by holding out "
            "models again, which needs measurements of at least three models. "
            f"Received: models {sorted({e.model for e in examples})}"
        )
    predicted = [None] * len(examples)
    chosen = []
    groups = [[v] for v in values]
    if folds is not None and 2 <= int(folds) < len(values):
        groups = [values[k::int(folds)] for k in range(int(folds))]
    for group in groups:
        held = "+".join(group)
        train = [e for e in examples if key(e) not in group]
        test_idx = [i for i, e in enumerate(examples) if key(e) in group]
        train_backends = {e.backend for e in train}
        estimator = LearnedEstimator(variant, hyperparameters, machine_speed=machine_speed)
        if variant == "auto":
            estimator.fit(train)
            chosen.append({"held_out": held, "variant": estimator.variant})
        else:
            estimator._fit_examples(train)
        usable = [i for i in test_idx if examples[i].backend in train_backends]
        if usable:
            for i, p in zip(usable, estimator.predict_records([examples[i] for i in usable])):
                predicted[i] = p
    keep = [i for i, p in enumerate(predicted) if p is not None]
    names = [examples[i].model for i in keep]
    measured = [examples[i].measured_s for i in keep]
    learned = [predicted[i] for i in keep]
    analytic = [examples[i].sim_s for i in keep]
    return {
        "variant": variant,
        "held_out_by": by if len(groups) == len(values) else f"{len(groups)} groups of {by}s",
        "cases": [
            {"case": examples[i].name, "model": examples[i].model,
             "backend": examples[i].backend, "measured_s": examples[i].measured_s,
             "analytic_s": examples[i].sim_s, "learned_s": predicted[i]}
            for i in keep
        ],
        "learned": metrics(names, learned, measured),
        "analytic": metrics(names, analytic, measured),
        "chosen": chosen,
    }


def evaluate(records, variant="ridge", hyperparameters=None, folds=None, by="model",
             machine_speed=True):
    """Leave-one-model-out (or leave-one-plan-kind-out) evaluation on measurement records.

    For every model, a fresh estimator is fitted on the other models' records
    and predicts the held-out model's plans; the metrics compare those
    predictions (and the analytic simulator's) with the measurements. With
    `by="plan"`, every plan kind is held out in turn instead (predicting, say,
    every model's proportional plan from the other plans' measurements).

    Args:
        records: `measurements.Record` objects of at least two models.
        variant: One of `VARIANTS`, or `"auto"`: each fold then chooses its
            variant by a leave-one-model-out evaluation of its own training
            models (nested, so the held-out models never influence the
            choice; needs at least three models). `chosen` lists the picks.
        hyperparameters: Overrides of the variant's defaults.
        folds: Hold out groups of models (or plan kinds) instead, this many
            folds (dealt round-robin in name order); None holds out one at
            a time.
        by: `"model"` (default) or `"plan"`.
        machine_speed: Use the measurements' machine-speed probes (see
            `LearnedEstimator`).

    Returns:
        A dict: `variant`, `held_out_by`, `cases` (per case: measured,
        analytic and learned seconds), `learned` and `analytic` metrics
        (`mape`, `median_ape`, `max_ape` in percent; `kendall_tau`, the mean
        per-model plan-ranking tau; `kendall_tau_pooled` over every case;
        `cases`).
    """
    return evaluate_examples(examples_from_records(records), variant, hyperparameters, folds,
                             by, machine_speed)


# --------------------------------------------------- packaged estimators
DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
_DEFAULTS = {}


def default_path(backend):
    """Path of the packaged estimator of `backend` (`estimator/data/learned_<backend>.json`).

    It is trained from `benchmarks/data/measurements_<backend>.json` by
    `benchmarks/estimator_accuracy.py --write-default`.
    """
    return os.path.join(DATA_DIR, f"learned_{backend}.json")


def load_default(backend):
    """The packaged estimator of `backend`, or None when the package has none.

    Loaded once per process.

    Args:
        backend: `"tensorflow"` or `"torch"`.

    Returns:
        A `LearnedEstimator` or None.
    """
    if backend not in _DEFAULTS:
        path = default_path(backend)
        _DEFAULTS[backend] = LearnedEstimator.load(path) if os.path.exists(path) else None
    return _DEFAULTS[backend]
