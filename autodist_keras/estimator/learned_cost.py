"""Learned correction of the analytic cost model, trained on profiled layers.

`LearnedCostModel` is an `AnalyticCostModel` whose `layer_time` is the
roofline time times a learned correction factor:

```
layer_time = analytic_time x exp(f(features))
```

`f` is a scikit-learn regressor fitted on profiled samples to
`log(measured / analytic)`. Its features describe the layer (type one-hot,
roofline category, FLOPs, bytes moved, weight bytes, batch, phase) and the
device (peak FLOP/s, memory bandwidth, CPU or GPU), never a device id, so it
predicts devices it has never run on; because the target is a ratio in log
space and predictions are clipped to the range seen in training, a device
far from the training data falls back to the roofline's shape scaled by a
bounded factor. A device of a kind absent from the training samples (a GPU,
when trained on CPUs) gets the analytic time: on an H200 a CPU-trained
correction predicted about a thousandth of the measured layer times.

Two regressors are available: `"ridge"` (ridge regression on standardised
log features) and `"gbr"` (gradient-boosted trees); `"auto"` picks the one
with the lower held-out error. Persistence is JSON only: the training
samples, the hyper-parameters and the analytic constants; loading refits the
(deterministic) regressor, so a loaded model predicts exactly what the saved
one did. Nothing is pickled.

Example:

```python
profile = profile_layers(model, cluster, batch_sizes=(8, 32))
samples = samples_from_profile(profile, ModelGraph.from_keras(model), cluster)
cost = LearnedCostModel.train(samples, cluster, regressor="auto")
print(cost.report["learned_mape"], cost.report["analytic_mape"])
cost.to_json("cost.json")
cost = LearnedCostModel.from_json("cost.json", cluster)
t = cost.layer_time(graph.nodes["dense"], cluster.device("node0/cpu0"), 32, "forward")
```
"""

import math
import os

from autodist_keras.errors import EstimatorError
from autodist_keras.errors import received_repr
from autodist_keras.estimator.cost_model import PHASES
from autodist_keras.estimator.cost_model import AnalyticCostModel
from autodist_keras.estimator.cost_model import input_bytes_per_sample
from autodist_keras.estimator.cost_model import op_category

SCHEMA = "autodist_keras.learned_cost/1"
REGRESSORS = ("ridge", "gbr")
OBJECTIVES = ("mape", "log")
DEFAULT_HYPERPARAMETERS = {
    "ridge": {"alpha": 10.0},
    "gbr": {
        "n_estimators": 150,
        "max_depth": 3,
        "learning_rate": 0.05,
        "min_samples_leaf": 5,
        "subsample": 1.0,
        "random_state": 0,
    },
}
CATEGORIES = ("matmul", "depthwise", "other")
NUMERIC_FEATURES = (
    "backward",
    "log_batch",
    "log_flops",
    "log_bytes",
    "log_weight_bytes",
    "log_intensity",
    "log_peak_flops",
    "log_memory_bandwidth",
    "is_gpu",
    "log_analytic_s",
    "log_compute_roof_s",
    "log_memory_roof_s",
)
# Clip predicted log-corrections to the training range widened by this much
# (log units): a device or layer far from the training data gets a bounded
# correction of the roofline, not an extrapolated one.
CLIP_MARGIN = math.log(2.0)
SAMPLE_KEYS = (
    "model", "node", "layer_type", "phase", "batch", "flops", "bytes", "weight_bytes",
    "device", "device_kind", "peak_flops", "memory_bandwidth", "analytic_s", "measured_s",
)


# ------------------------------------------------------------------ samples
def raw_features(node, device, batch, phase, dtype_bytes=4):
    """The layer and device quantities the regressor's features are made of.

    Args:
        node: A `graph.LayerNode`.
        device: A `devices.Device`.
        batch: Samples in the batch.
        phase: `"forward"` or `"backward"`.
        dtype_bytes: Bytes per activation element.

    Returns:
        A JSON-ready dict: `layer_type, phase, batch, flops, bytes,
        weight_bytes, device_kind, peak_flops, memory_bandwidth`. FLOPs and
        bytes are for the whole batch; bytes moved count as in the analytic
        model (weights, input and output activations; twice the weights and
        inputs in backward).
    """
    if phase not in PHASES:
        raise EstimatorError(f"phase must be one of {PHASES}. Received: phase={phase!r}")
    weight_bytes = sum(v.bytes for v in node.variables) + int(node.non_trainable_bytes or 0)
    in_bytes = input_bytes_per_sample(node, dtype_bytes)
    out_bytes = int(node.output_bytes or 0)
    if phase == "forward":
        flops = float(node.forward_flops) * batch
        moved = weight_bytes + (in_bytes + out_bytes) * batch
    else:
        flops = float(node.backward_flops) * batch
        moved = 2 * weight_bytes + (2 * in_bytes + out_bytes) * batch
    return {
        "layer_type": node.layer_type,
        "phase": phase,
        "batch": int(batch),
        "flops": float(flops),
        "bytes": float(moved),
        "weight_bytes": float(weight_bytes),
        "device_kind": device.kind,
        "peak_flops": float(device.peak_flops_fp32),
        "memory_bandwidth": float(device.memory_bandwidth),
    }


def samples_from_profile(profile, graph, cluster, base=None, model_name=None, contended=True,
                         min_time_s=0.0):
    """Training samples from a `LayerProfile`: features, analytic and measured times.

    Args:
        profile: A `profiler.LayerProfile`.
        graph: The profiled model's `ModelGraph`.
        cluster: The `Cluster` the profile was taken on.
        base: The `AnalyticCostModel` whose times are corrected (default:
            `AnalyticCostModel(cluster)`); use the same constants as the
            learned model that will be trained on these samples.
        model_name: Group label for held-out evaluation (default: the
            profile's model name).
        contended: Use the contended time (`measured x sharing`): the time
            of a CPU testbed device when every device sharing its cores runs
            at once, which is what the testbed's per-device peak FLOP/s
            describe. False uses the time measured alone.
        min_time_s: Leave out phases measured below this (e.g. a backward
            that rounds to 0 for a layer without gradients).

    Returns:
        A list of dicts with the keys `SAMPLE_KEYS`.
    """
    base = base or AnalyticCostModel(cluster)
    model_name = model_name or profile.model_name or "model"
    samples = []
    for t in profile.timings:
        node = graph.nodes.get(t.node)
        if node is None:
            raise EstimatorError(
                f"Profiled node {t.node!r} is not in the graph; pass the ModelGraph of the "
                f"profiled model. Received: {t.node!r}"
            )
        device = cluster.device(t.device)
        for phase in PHASES:
            measured = t.time(phase, contended=contended)
            if measured <= min_time_s or measured <= 0:
                continue
            analytic = AnalyticCostModel.layer_time(base, node, device, t.batch_size, phase)
            if analytic <= 0:
                continue
            sample = raw_features(node, device, t.batch_size, phase, base.dtype_bytes)
            sample.update(
                model=model_name, node=t.node, device=t.device,
                analytic_s=float(analytic), measured_s=float(measured),
            )
            samples.append(sample)
    return samples


def _log(x):
    return math.log(max(float(x), 1e-30))


def _feature_rows(samples, vocabulary):
    """Feature matrix (NumPy) of `samples`; `vocabulary` lists the layer types one-hot."""
    import numpy as np

    rows = []
    for s in samples:
        flops = float(s["flops"])
        moved = float(s["bytes"])
        peak = float(s["peak_flops"])
        bw = float(s["memory_bandwidth"])
        values = [
            1.0 if s["phase"] == "backward" else 0.0,
            _log(s["batch"]),
            math.log1p(flops),
            math.log1p(moved),
            math.log1p(float(s["weight_bytes"])),
            math.log1p(flops) - math.log1p(moved),
            _log(peak),
            _log(bw),
            1.0 if s.get("device_kind") == "gpu" else 0.0,
            _log(s["analytic_s"]),
            _log(flops / peak + 1e-12),
            _log(moved / bw + 1e-12),
        ]
        category = op_category(s["layer_type"])
        values += [1.0 if category == c else 0.0 for c in CATEGORIES]
        values += [1.0 if s["layer_type"] == v else 0.0 for v in vocabulary]
        rows.append(values)
    return np.asarray(rows, dtype=float).reshape(len(samples), -1)


def _targets(samples):
    import numpy as np

    return np.asarray([_log(s["measured_s"]) - _log(s["analytic_s"]) for s in samples])


def _check_samples(samples):
    if not isinstance(samples, (list, tuple)) or not samples:
        raise EstimatorError(
            "Training needs a non-empty list of profiled samples (see "
            f"samples_from_profile). Received: {type(samples).__name__} of "
            f"{len(samples) if hasattr(samples, '__len__') else '?'} items"
        )
    for i, s in enumerate(samples):
        missing = [k for k in SAMPLE_KEYS if k not in s]
        if missing:
            raise EstimatorError(
                f"Sample {i} lacks {missing}; make samples with samples_from_profile. "
                f"Received: keys {sorted(s)}"
            )
        if not (s["measured_s"] > 0 and s["analytic_s"] > 0):
            raise EstimatorError(
                f"Sample {i} ({s['node']} on {s['device']}) needs positive measured and "
                f"analytic times. Received: measured_s={s['measured_s']!r}, "
                f"analytic_s={s['analytic_s']!r}"
            )


def mape(predicted, measured):
    """Mean absolute percentage error, in percent."""
    import numpy as np

    predicted = np.asarray(predicted, dtype=float)
    measured = np.asarray(measured, dtype=float)
    return float(np.mean(np.abs(predicted - measured) / measured) * 100.0)


def _weighted_median(values, weights):
    import numpy as np

    order = np.argsort(values)
    values, weights = values[order], weights[order]
    cumulative = np.cumsum(weights)
    return float(values[np.searchsorted(cumulative, cumulative[-1] / 2.0)])


class _Regressor:
    """A fitted correction regressor: vocabulary, scaler, estimator, clip range.

    Both regressors fit `y = log(measured / analytic)`. With the `"mape"`
    objective the fit aims at the mean absolute percentage error, which
    punishes over-prediction of short layers far more than a log-space least
    squares fit does: ridge adds a constant shift `b` (the weighted median
    that minimises the training MAPE of `analytic x exp(f + b)`), gradient
    boosting uses the absolute-error loss with sample weights
    `measured / analytic` inverted (`exp(-y)`), the MAPE's own weights. The
    `"log"` objective is plain least squares in log space (better median
    error, worse mean).
    """

    def __init__(self, kind, hyperparameters, samples, objective="mape"):
        import numpy as np

        if kind not in REGRESSORS:
            raise EstimatorError(f"regressor must be one of {REGRESSORS}. Received: {kind!r}")
        if objective not in OBJECTIVES:
            raise EstimatorError(f"objective must be one of {OBJECTIVES}. Received: {objective!r}")
        self.kind = kind
        self.objective = objective
        self.hyperparameters = dict(DEFAULT_HYPERPARAMETERS[kind], **(hyperparameters or {}))
        self.vocabulary = sorted({s["layer_type"] for s in samples})
        x = _feature_rows(samples, self.vocabulary)
        y = _targets(samples)
        self.mean = x.mean(axis=0)
        self.scale = x.std(axis=0)
        self.scale[self.scale == 0] = 1.0
        z = (x - self.mean) / self.scale
        weights = None
        if kind == "ridge":
            from sklearn.linear_model import Ridge

            self.estimator = Ridge(**self.hyperparameters)
        else:
            from sklearn.ensemble import GradientBoostingRegressor

            params = dict(self.hyperparameters)
            if objective == "mape":
                params.setdefault("loss", "absolute_error")
                weights = np.exp(-(y - y.max()))
                weights = weights / weights.mean()
            else:
                params.setdefault("loss", "squared_error")
            self.hyperparameters = params
            self.estimator = GradientBoostingRegressor(**params)
        try:
            self.estimator.fit(z, y, sample_weight=weights)
        except (TypeError, ValueError) as e:
            raise EstimatorError(
                f"Cannot fit the {kind} regressor with hyper-parameters "
                f"{self.hyperparameters}: {e}. Received: {len(samples)} samples"
            ) from None
        self.shift = 0.0
        if kind == "ridge" and objective == "mape":
            fitted = self.estimator.predict(z)
            self.shift = math.log(_weighted_median(np.exp(y - fitted), np.exp(fitted - y)))
        self.low = float(np.min(y)) - CLIP_MARGIN
        self.high = float(np.max(y)) + CLIP_MARGIN
        self.device_kinds = sorted({s.get("device_kind", "gpu") for s in samples})

    def predict_log_ratio(self, samples):
        """log(learned / analytic) per sample; 0 (the analytic time) on a device
        kind the regressor never saw (a CPU-trained correction says nothing
        about a GPU: applied there, it predicted a thousandth of the H200's
        layer times)."""
        import numpy as np

        if not samples:
            return np.zeros(0)
        x = _feature_rows(samples, self.vocabulary)
        z = (x - self.mean) / self.scale
        ratio = np.clip(self.estimator.predict(z) + self.shift, self.low, self.high)
        seen = np.array([s.get("device_kind", "gpu") in self.device_kinds for s in samples])
        return np.where(seen, ratio, 0.0)


def _groups(samples, by):
    if by == "model":
        return [s["model"] for s in samples]
    if by == "layer":
        return [f"{s['model']}/{s['node']}" for s in samples]
    if by == "layer_type":
        return [s["layer_type"] for s in samples]
    if by == "device":
        return [s["device"] for s in samples]
    raise EstimatorError(
        "held-out groups must be 'model', 'layer', 'layer_type' or 'device'. "
        f"Received: {by!r}"
    )


def evaluate_regressor(samples, regressor="ridge", hyperparameters=None, by="auto", folds=5,
                       objective="mape"):
    """Held-out error of a correction regressor against the analytic model.

    Samples are split into groups (by model, or by layer when the samples
    come from a single model) and each group is predicted by a regressor
    fitted on the others (`GroupKFold`), so every prediction is for layers
    the regressor has not seen.

    Args:
        samples: Samples from `samples_from_profile`.
        regressor: `"ridge"` or `"gbr"`.
        hyperparameters: Overrides of `DEFAULT_HYPERPARAMETERS[regressor]`.
        by: `"model"`, `"layer"`, `"layer_type"`, `"device"` or `"auto"`.
        folds: Maximum number of folds.
        objective: `"mape"` or `"log"` (see `LearnedCostModel`).

    Returns:
        A dict: `regressor, held_out_by, folds, samples, learned_mape,
        analytic_mape` (percent, on the same held-out samples),
        `learned_median_ape, analytic_median_ape`.

    Raises:
        EstimatorError: With fewer than two groups.
    """
    import numpy as np
    from sklearn.model_selection import GroupKFold

    _check_samples(samples)
    if by == "auto":
        by = "model" if len({s["model"] for s in samples}) >= 2 else "layer"
    groups = _groups(samples, by)
    n_groups = len(set(groups))
    if n_groups < 2:
        raise EstimatorError(
            f"Held-out evaluation by {by!r} needs samples from at least two groups. "
            f"Received: {n_groups} group"
        )
    k = min(int(folds), n_groups)
    measured = np.asarray([s["measured_s"] for s in samples])
    analytic = np.asarray([s["analytic_s"] for s in samples])
    predicted = np.empty_like(measured)
    for train_idx, test_idx in GroupKFold(n_splits=k).split(samples, groups=groups):
        fitted = _Regressor(regressor, hyperparameters, [samples[i] for i in train_idx],
                            objective)
        test = [samples[i] for i in test_idx]
        predicted[test_idx] = analytic[test_idx] * np.exp(fitted.predict_log_ratio(test))
    ape_learned = np.abs(predicted - measured) / measured * 100
    ape_analytic = np.abs(analytic - measured) / measured * 100
    return {
        "regressor": regressor,
        "objective": objective,
        "held_out_by": by,
        "folds": k,
        "samples": len(samples),
        "learned_mape": mape(predicted, measured),
        "analytic_mape": mape(analytic, measured),
        "learned_median_ape": float(np.median(ape_learned)),
        "analytic_median_ape": float(np.median(ape_analytic)),
    }


# -------------------------------------------------------------- cost model
class LearnedCostModel(AnalyticCostModel):
    """The analytic cost model with a learned per-layer correction factor.

    A drop-in replacement for `AnalyticCostModel` in the simulator: same
    methods and signatures; only `layer_time` differs (transfers,
    collectives and updates are the analytic ones, or measured links when a
    `MeasuredTopology` cluster topology is used).

    Args:
        cluster: The `Cluster` to price (as `AnalyticCostModel`).
        samples: Training samples (`samples_from_profile`); None gives an
            untrained model that returns the analytic times.
        regressor: `"ridge"`, `"gbr"` or `"auto"` (fit both, evaluate them
            held out, keep the better).
        hyperparameters: Overrides of the regressor's defaults.
        objective: `"mape"` (default: aim at the mean absolute percentage
            error) or `"log"` (least squares on the log ratio: better median
            error, worse mean).
        evaluate: Compute the held-out report when training (needs samples
            from at least two models or layers).
        folds: Number of held-out folds of the evaluation.
        links: A `profiler.CollectiveProfile` (or its dict): transfers
            between the device pairs it measured are priced with the
            measured latency and bandwidth; other pairs use the cluster's
            topology.
        **analytic_kwargs: Constants of the analytic model
            (`compute_efficiency`, `memory_efficiency`, `launch_overhead_s`,
            `precision`, `dtype_bytes`). The samples' `analytic_s` must have
            been computed with the same constants.

    Example:

    ```python
    cost = LearnedCostModel(cluster, samples=samples, regressor="auto")
    simulator_cost_model = cost.with_cluster(other_cluster)
    ```
    """

    def __init__(self, cluster=None, samples=None, regressor="auto", hyperparameters=None,
                 evaluate=True, objective="mape", links=None, folds=5, **analytic_kwargs):
        super().__init__(cluster, **analytic_kwargs)
        if links is not None and not hasattr(links, "fits"):
            from autodist_keras.estimator.profiler import CollectiveProfile

            links = CollectiveProfile.from_dict(links)
        self.links = links
        self.analytic_kwargs = dict(analytic_kwargs)
        self.samples = []
        self.regressor = None
        self.hyperparameters = dict(hyperparameters or {})
        self.report = {}
        self.objective = objective
        self._fitted = None
        if objective not in OBJECTIVES:
            raise EstimatorError(f"objective must be one of {OBJECTIVES}. Received: {objective!r}")
        if regressor not in REGRESSORS + ("auto",):
            raise EstimatorError(
                f"regressor must be one of {REGRESSORS + ('auto',)}. Received: {regressor!r}"
            )
        if samples is not None:
            self.fit(samples, regressor=regressor, hyperparameters=hyperparameters,
                     evaluate=evaluate, objective=objective, folds=folds)

    @classmethod
    def train(cls, samples, cluster=None, regressor="auto", hyperparameters=None, **kwargs):
        """Returns a model trained on `samples` (see the class arguments)."""
        return cls(cluster, samples=samples, regressor=regressor,
                   hyperparameters=hyperparameters, **kwargs)

    def fit(self, samples, regressor="auto", hyperparameters=None, evaluate=True,
            objective=None, folds=5):
        """Fits the correction regressor on `samples`; returns `self`.

        With `regressor="auto"` both regressors are evaluated held out and the
        lower learned MAPE wins; `report` then holds both evaluations.
        """
        samples = [dict(s) for s in samples]
        _check_samples(samples)
        objective = objective or self.objective
        if regressor not in REGRESSORS + ("auto",):
            raise EstimatorError(
                f"regressor must be one of {REGRESSORS + ('auto',)}. Received: {regressor!r}"
            )
        report = {}
        if regressor == "auto":
            hyperparameters = None
            try:
                evaluations = {
                    kind: evaluate_regressor(samples, kind, objective=objective, folds=folds)
                    for kind in REGRESSORS
                }
            except EstimatorError as e:
                # Too few models or layers to hold any out: ridge, unevaluated.
                regressor = "ridge"
                report = {"regressor": regressor, "note": str(e)}
            else:
                regressor = min(REGRESSORS, key=lambda kind: evaluations[kind]["learned_mape"])
                report = dict(evaluations[regressor], candidates=evaluations)
        elif evaluate:
            try:
                report = evaluate_regressor(samples, regressor, hyperparameters,
                                            objective=objective, folds=folds)
            except EstimatorError as e:
                report = {"regressor": regressor, "note": str(e)}
        self._fitted = _Regressor(regressor, hyperparameters, samples, objective)
        self.objective = objective
        self.samples = samples
        self.regressor = regressor
        self.hyperparameters = dict(self._fitted.hyperparameters)
        self.report = report
        return self

    @property
    def comm(self):
        """The `CommModel`: measured links where `links` has them, else the topology."""
        if self._comm is None and self.links is not None and self.cluster is not None:
            from autodist_keras.estimator.comm import CommModel
            from autodist_keras.estimator.profiler import MeasuredTopology

            self._comm = CommModel(
                MeasuredTopology(self.links, self.cluster.topology),
                {d.name: d.node for d in self.cluster.devices},
            )
        return AnalyticCostModel.comm.fget(self)

    @property
    def trained(self):
        """True once a regressor is fitted."""
        return self._fitted is not None

    def analytic_time(self, node, device, batch, phase):
        """The uncorrected roofline time (`AnalyticCostModel.layer_time`)."""
        return super().layer_time(node, device, batch, phase)

    def correction(self, node, device, batch, phase):
        """The factor `learned / analytic` for one layer call (1.0 untrained)."""
        base = self.analytic_time(node, device, batch, phase)
        if base <= 0 or self._fitted is None:
            return 1.0
        device = self._device(device)
        sample = raw_features(node, device, batch, phase, self.dtype_bytes)
        sample["analytic_s"] = base
        return float(math.exp(self._fitted.predict_log_ratio([sample])[0]))

    def layer_time(self, node, device, batch, phase):
        base = super().layer_time(node, device, batch, phase)
        if base <= 0 or self._fitted is None:
            return base
        device = self._device(device)
        sample = raw_features(node, device, batch, phase, self.dtype_bytes)
        sample["analytic_s"] = base
        return float(base * math.exp(self._fitted.predict_log_ratio([sample])[0]))

    def predict_samples(self, samples):
        """Learned times (seconds) for samples in the `samples_from_profile` format."""
        import numpy as np

        if self._fitted is None:
            return [float(s["analytic_s"]) for s in samples]
        ratio = np.exp(self._fitted.predict_log_ratio(samples))
        return [float(s["analytic_s"] * r) for s, r in zip(samples, ratio)]

    # ---------------------------------------------------------- persistence
    def config(self):
        data = super().config()
        data.update(regressor=self.regressor, hyperparameters=self.hyperparameters,
                    objective=self.objective)
        return data

    def to_dict(self):
        """JSON-ready dict: samples, regressor, hyper-parameters, analytic constants."""
        return {
            "schema": SCHEMA,
            "regressor": self.regressor,
            "objective": self.objective,
            "hyperparameters": self.hyperparameters,
            "analytic": {
                "compute_efficiency": self.compute_efficiency,
                "memory_efficiency": self.memory_efficiency,
                "launch_overhead_s": self.launch_overhead_s,
                "precision": self.precision,
                "dtype_bytes": self.dtype_bytes,
            },
            "report": self.report,
            "links": self.links.to_dict() if self.links is not None else None,
            "samples": self.samples,
        }

    def to_json(self, path=None):
        """Returns the JSON text; writes it atomically to `path` if given."""
        from autodist_keras.estimator.profiler import json_text
        from autodist_keras.estimator.profiler import write_json_atomic

        data = self.to_dict()
        if path is not None:
            write_json_atomic(path, data)
        return json_text(data, "the learned cost model")

    @classmethod
    def from_dict(cls, data, cluster=None, source="<dict>"):
        """Rebuilds a model from `to_dict()` output, refitting the regressor.

        The regressor is refitted on the stored samples, so a file of a
        trained model (`regressor` set) without them is refused: loading it
        as the analytic model would keep a report that describes a
        correction it no longer applies. An untrained model's file
        (`regressor` null, `samples` empty) loads as the analytic model.

        Raises:
            EstimatorError: Naming the file and the field, if the data is
                not a learned cost model or a field is missing or malformed.
        """
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise EstimatorError(
                f"{source}: not a learned cost model (expected schema {SCHEMA!r}). "
                "Write it with LearnedCostModel.to_json(). Received: "
                f"{data.get('schema') if isinstance(data, dict) else type(data).__name__!r}"
            )
        samples = data.get("samples")
        if not isinstance(samples, list) or (data.get("regressor") is not None and not samples):
            raise EstimatorError(
                f"{source}: field `samples` must list the profiled samples the model is "
                "refitted on (an empty list only in an untrained model's file, whose "
                "`regressor` is null): without them neither the learned correction nor the "
                "accuracy `report` stored beside it applies. Write the file with "
                "LearnedCostModel.to_json(). Received: "
                f"samples={'missing' if 'samples' not in data else received_repr(samples)}, "
                f"regressor={data.get('regressor')!r}"
            )
        from autodist_keras.estimator.profiler import CollectiveProfile

        def malformed(field, error):
            reason = (str(error).split(" Received:")[0] if isinstance(error, EstimatorError)
                      else f"{type(error).__name__}: {error}")
            return EstimatorError(
                f"{source}: malformed learned cost model, field `{field}` ({reason}). Write "
                f"it with LearnedCostModel.to_json(). "
                f"Received: {field}={received_repr(data.get(field))}"
            )

        errors = (EstimatorError, TypeError, KeyError, ValueError, AttributeError)
        links = data.get("links")
        try:
            links = CollectiveProfile.from_dict(links) if links is not None else None
        except errors as e:
            raise malformed("links", e) from None
        objective = data.get("objective", "mape")
        if objective not in OBJECTIVES:
            raise malformed("objective", EstimatorError(f"must be one of {OBJECTIVES}"))
        try:
            model = cls(cluster, objective=objective, links=links,
                        **dict(data.get("analytic") or {}))
        except errors as e:
            raise malformed("analytic", e) from None
        if samples:
            field = "regressor" if data.get("regressor") not in REGRESSORS else "samples"
            try:
                model.fit(samples, regressor=data["regressor"],
                          hyperparameters=data.get("hyperparameters"), evaluate=False)
            except errors as e:
                raise malformed(field, e) from None
        model.report = data.get("report") or {}
        return model

    @classmethod
    def from_json(cls, path, cluster=None):
        """Reads a model written by `to_json(path)` (JSON; no pickle)."""
        from autodist_keras.estimator.profiler import read_json

        path = os.fspath(path)
        return cls.from_dict(read_json(path, "learned cost model"), cluster, source=path)
