"""Metric state a replica updates in its own step (custom loss trackers).

A model may hold its own metrics and update them inside `compute_loss` (the
Keras guides' `self.penalty_tracker.update_state(penalty)`), or a layer may
update one in `call`. Each replica runs that code on its shard, so without
care the tracker sees one update per replica (TensorFlow, one process) or
rank 0's shard only (PyTorch). The runtimes make these variables end each
step as one update of the whole batch: the batch-share-weighted mean of the
replicas' new values, `old + sum_r (share_r / batch) * (new_r - old)`. For a
Mean-like tracker fed the shard's per-sample mean this is exactly one
device's update (the total grows by the batch mean, the count by one), the
same rule the runtimes use for float layer state (BatchNormalization's moving
statistics). A tracker fed a batch *sum* (a `Sum` of `ops.sum(...)`) or a
row count comes out as the weighted mean of the shards' sums, not the sum;
on TensorFlow a maximum comes out as the weighted mean of the shards' maxima
(every replica starts from the same old value there). On PyTorch a worker's
trackers keep their starting values, so only additive trackers (`Mean`,
`Sum` and metrics built on them, `is_additive`) are combined; the others (a
running maximum, a moving average) log rank 0's rows only, and the runtime
warns once naming them.

The variables the runtimes already make global are left out: the compiled
loss tracker (`loss`), the compiled metrics (updated once on the whole
batch's predictions) and the compiled per-output loss metrics (each replica
adds its shard's loss weighted by its row count, which sums exactly on
TensorFlow; rank 0 recomputes them on the whole batch on PyTorch). Integer
tracker variables are not combined: they take one replica's value. Integer
state of a layer or model declared `aggregation="sum"` (a count of rows) is
the exception: the replicas' changes are added up (`sums_replica_changes`).
"""


def _variables_of(metrics):
    ids = set()
    for metric in metrics:
        if metric is not None:
            ids.update(id(v) for v in metric.variables)
    return ids


def compiled_metric_variable_ids(model):
    """`id()`s of the variables of the compiled loss tracker, the compiled
    metrics and the compiled per-output loss metrics: the metric state the
    runtimes make global by themselves.

    Args:
        model: A Keras model (compiled or not).

    Returns:
        A set of `id(variable)`; empty for a model that is not compiled.
    """
    compile_loss = getattr(model, "_compile_loss", None)
    return _variables_of(
        [getattr(model, "_loss_tracker", None), getattr(model, "_compile_metrics", None)]
        + (list(compile_loss.metrics) if compile_loss is not None else [])
    )


def tracker_metrics(model):
    """`(metric, variables)` of the metrics in `model.metrics` that no runtime
    makes global by itself, each with its variables not listed before.

    Returns:
        A list, in `model.metrics` order, leaving out the compiled loss
        tracker, the compiled metrics and the compiled per-output loss
        metrics. Empty for a model with only compiled metrics.
    """
    special = compiled_metric_variable_ids(model)
    out, seen = [], set()
    for metric in model.metrics:
        own = []
        for variable in metric.variables:
            if id(variable) in special or id(variable) in seen:
                continue
            seen.add(id(variable))
            own.append(variable)
        if own:
            out.append((metric, own))
    return out


def tracker_variables(model):
    """Variables of `model.metrics` that no runtime makes global by itself.

    Returns:
        A list of the model's metric variables (floating point and integer)
        other than those of the compiled loss tracker, the compiled metrics
        and the compiled per-output loss metrics, without duplicates, in
        `model.metrics` order. Empty for a model with only compiled metrics.
    """
    return [v for _, variables in tracker_metrics(model) for v in variables]


def is_additive(metric):
    """Whether each update of `metric` adds to its state what it was fed,
    whatever the state holds (`keras.metrics.Mean`, `Sum` and the metrics
    built on them): then a replica's change does not depend on the value it
    started from."""
    import keras

    return isinstance(metric, (keras.metrics.Mean, keras.metrics.Sum))


def rank0_only_trackers(model):
    """Names of the tracker metrics the PyTorch runtime logs from rank 0's rows
    only (those not `is_additive`: a running maximum, a moving average)."""
    return [metric.name for metric, _ in tracker_metrics(model) if not is_additive(metric)]


def is_float(variable):
    """Whether a Keras variable holds floating-point values (bfloat16 included);
    the runtimes combine such state as a share-weighted mean."""
    import keras

    return keras.backend.standardize_dtype(variable.dtype).startswith(("float", "bfloat"))


def metric_variable_ids(model):
    """`id()`s of the variables of every metric in `model.metrics` (compiled
    or not): the state `sums_replica_changes` leaves alone."""
    return _variables_of(list(getattr(model, "metrics", None) or ()))


def sums_replica_changes(variable, metric_ids=()):
    """Whether the runtimes add up the replicas' changes of `variable`
    instead of keeping the first replica's value.

    True for an integer variable a layer or model declared with Keras's
    multi-replica annotation `aggregation="sum"` (`add_weight(...,
    dtype="int32", aggregation="sum")`): a count of rows that each replica
    advances by its own share (`n.assign_add(ops.shape(x)[0])`) then ends
    the step advanced by the whole batch, `old + sum_r (new_r - old)`, as on
    one device. `add_weight` defaults to `aggregation="none"`, so the sum is
    always the model author's choice. Metric variables (`metric_ids`) are
    left out: `Metric.add_variable` annotates every variable `"sum"` by
    default, and an integer metric variable keeps the first replica's value
    as before.

    Args:
        variable: A Keras variable.
        metric_ids: `id()`s of the model's metric variables
            (`metric_variable_ids`).

    Returns:
        A bool.

    Example:

    ```python
    rows = model.add_weight(shape=(), dtype="int32", initializer="zeros",
                            trainable=False, aggregation="sum")
    assert sums_replica_changes(rows)
    ```
    """
    import keras

    if id(variable) in metric_ids or getattr(variable, "aggregation", "none") != "sum":
        return False
    return keras.backend.standardize_dtype(variable.dtype).startswith(("int", "uint"))


class TorchTrackerDeltas:
    """What one PyTorch replica's step changed in its float tracker variables.

    `begin()` before the forward pass remembers the variables' values;
    `end()` after `compute_loss` takes the change as one float64 vector
    (`delta`, on the variables' device, no host sync) and puts the old
    values back, so a worker's trackers never drift from their starting
    values (their change is sent to rank 0) and rank 0's hold `old` until
    `combine` assigns `old + sum_r w_r * delta_r`. With no float tracker
    variables every method does nothing.

    Args:
        model: The replica's model.
    """

    def __init__(self, model):
        # Only additive trackers: a worker's trackers stay at their starting
        # values, so a change that depends on the value it starts from (a
        # running maximum, a moving average) would be measured from the wrong
        # one; those trackers keep rank 0's own updates (`rank0_only_trackers`).
        self.variables = [v for metric, variables in tracker_metrics(model)
                          if is_additive(metric) for v in variables if is_float(v)]
        self.size = sum(v.value.numel() for v in self.variables)
        self._old = None
        self.delta = None

    def begin(self):
        if not self.variables:
            return
        self._old = [v.value.detach().clone() for v in self.variables]
        self.delta = None

    def end(self):
        """Takes this step's change (`self.delta`) and restores the old values."""
        import torch

        if not self.variables or self._old is None:
            return
        with torch.no_grad():
            self.delta = torch.cat([
                (v.value.detach().double() - old.double()).reshape(-1)
                for v, old in zip(self.variables, self._old)
            ])
            for v, old in zip(self.variables, self._old):
                v.assign(old)

    def combine(self, weighted_deltas):
        """Assigns `old + sum(weighted_deltas)` (float64 vectors of `size`)
        to the variables, split back in order; `self.delta` of this step
        (weighted by the caller) is one of them when this replica had rows."""
        import torch

        if not self.variables or not weighted_deltas:
            return
        with torch.no_grad():
            device = self.variables[0].value.device
            total = weighted_deltas[0].to(device)
            for d in weighted_deltas[1:]:
                total = total + d.to(device)
            offset = 0
            for v in self.variables:
                n = v.value.numel()
                part = total[offset:offset + n].reshape(tuple(v.shape))
                v.assign((v.value.detach().double() + part).to(v.value.dtype))
                offset += n
