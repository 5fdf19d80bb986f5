"""Checks, before the first step, that a compiled model can be split by batch share.

Both backends run them (`check_model_for_plan`) once the plan is made, and only
for a plan that splits the batch: one replica runs each batch whole, exactly
as plain Keras. A later fit of the same compiled model under the same plan
skips them (they cost several forward passes). A model that cannot be split is refused with what to change;
one that splits inexactly gets a warning.

Both runtimes weight each replica's total loss by its share of the global
batch (`s_r / B`), which gives single-device gradients when the loss is a
mean over the batch. A loss that sums over the batch instead (a Keras loss
with `reduction="sum"`, a custom loss function or `add_loss` term that
returns `ops.sum(...)`) would be scaled down by the shares: training would
go on, silently wrong. These checks refuse such models before the first
step, with what to change.

Masked outputs (Keras masks, e.g. from `Embedding(mask_zero=True)`) are a
mean over each replica's valid entries, which differs slightly from the
global batch's when the shards hold different amounts of padding; they get a
warning, not a refusal. So do other losses that are not a mean of per-sample
losses (`ignore_class`, whose mean is over the entries not ignored; Dice over
the whole batch; in-batch negatives; a term added only in training over the
batch), found by comparing the loss of a few rows with the mean of the rows'
own losses. The probes run in inference mode, and in training mode too
unless a layer draws random numbers (`_probe_modes`), since `add_loss` terms
under `if training:` exist only there. Stateful layers (`stateful=True` RNNs) carry each
sample's state from one batch to the next and are refused. Trainable
BatchNormalization layers whose moving statistics cannot be combined exactly
(called more than once per step, or fed a Keras mask) get a warning.
"""

import functools
import logging
import math
import warnings
import weakref

from autodist_keras.errors import BackendError
from autodist_keras.stacklevel import user_stacklevel

logger = logging.getLogger(__name__)

SUPPORTED_REDUCTIONS = ("sum_over_batch_size", "mean")

# The probe's relative tolerance: a mean over duplicated rows equals the mean
# over the rows up to float32 rounding (about 1e-6 relative).
_PROBE_RTOL = 1e-3


def check_loss_reductions(model):
    """Raises `BackendError` if a compiled `keras.losses.Loss` is not a batch mean.

    Losses that divide by the number of elements (Keras's default
    `"sum_over_batch_size"`, and `"mean"`) split exactly by batch share;
    `"sum"`, `"mean_with_sample_weight"` and `None` would need another
    weighting. Nested loss structures (dicts per output) are walked.

    Args:
        model: A compiled Keras model.
    """
    import keras

    for loss in keras.tree.flatten(model.loss):
        if not isinstance(loss, keras.losses.Loss):
            continue
        reduction = loss.reduction
        if reduction not in SUPPORTED_REDUCTIONS:
            raise BackendError(
                f"Loss {loss.name!r} ({type(loss).__name__}) uses reduction={reduction!r}. "
                "autodist_keras weights each replica's loss by its share of the global batch, "
                "which reproduces single-device gradients only for losses averaged over the "
                "batch. Use reduction='sum_over_batch_size' (the Keras default); to keep a "
                "sum's step size, multiply the learning rate by the batch size. "
                f"Received: reduction={reduction!r}"
            )


def check_stateful_layers(model):
    """Raises `BackendError` if a layer carries per-sample state across batches.

    A `stateful=True` RNN keeps row `i`'s final state as row `i`'s initial
    state in the next batch, with a state tensor of the full batch size;
    data parallelism gives each replica a slice of every batch.

    Args:
        model: A Keras model.
    """
    stateful = [layer.name for layer in model._flatten_layers(include_self=False)
                if getattr(layer, "stateful", False)]
    if stateful:
        raise BackendError(
            f"Layer(s) {stateful} are stateful (stateful=True): they carry each sample's state "
            "from one batch to the next, with a state as large as the whole batch, while data "
            "parallelism gives each replica a slice of every batch. Use stateful=False (the "
            "state then starts afresh in each batch), or train this model without "
            f"AutoStrategy. Received: stateful layers {stateful}"
        )


def check_summed_losses(model, x, y):
    """Raises `BackendError` if the model's total loss grows with the batch size.

    Runs the model on the first rows of a real batch, once, twice and three
    times over, in inference mode and (unless a layer draws random numbers,
    `_probe_modes`) in training mode, where terms added only in training
    exist, and computes its total loss
    (`model.compute_loss`: compiled losses, regularisers and `add_loss`
    terms). A batch mean gives the same value each time; a term that sums
    over the batch grows by the same amount each time. Only the latter is
    refused: other changes (losses that compare samples within the batch)
    are left alone. Each call starts from the model's variables and metric
    states as they were, and they are restored afterwards (`_probe`). A model the probe cannot run (no loss, sparse or ragged
    inputs, stateful layers) is not checked.

    Args:
        model: A compiled, built Keras model.
        x: The inputs of one batch (any Keras input structure).
        y: Its targets (may be `None`).
    """
    for training in _probe_modes(model):
        totals = _probe(model, [
            functools.partial(_total_loss, model, x, y, copies, training=training)
            for copies in (1, 2, 3)])
        if _grows_with_batch(totals):
            _refuse_summed(totals, training)


def _grows_with_batch(totals):
    """Whether the totals of rows taken once, twice and three times grow by equal steps."""
    if totals is None or not all(math.isfinite(t) for t in totals):
        return False  # (a NaN or infinite loss says nothing about sums; Keras reports it)
    first, second, third = totals
    step = second - first
    scale = max(abs(first), abs(second), abs(third), 1e-12)
    return abs(step) > _PROBE_RTOL * scale and abs((third - second) - step) <= (
        _PROBE_RTOL * abs(step))


def _refuse_summed(totals, training):
    first, second, third = totals
    mode = "training" if training else "inference"
    raise BackendError(
        f"The model's loss grows with the batch size: in {mode} mode, on the same rows taken "
        f"once, twice and three times its total loss was {first:.6g}, {second:.6g} and "
        f"{third:.6g}, so some "
        "term sums over the batch (a custom loss function or `add_loss` returning "
        "`ops.sum(...)`, say" + (", added only when training=True" if training else "")
        + "). autodist_keras weights each replica's loss by its share of the "
        "global batch, which reproduces single-device gradients only for losses averaged over "
        "the batch: a summed term would train silently wrong. Return per-sample losses (shape "
        "`(batch,)`, which Keras averages) or divide the sum by the batch size, and to keep "
        "the sum's step size multiply the learning rate by the batch size. "
        f"Received: total losses {first:.6g}, {second:.6g}, {third:.6g} ({mode} mode)"
    )


def _probe(model, computes):
    """Runs each of `computes` from the model's state as it was, and restores it afterwards.

    The probes call the model in inference and in training mode
    (`_probe_modes`), and a layer may assign its own variables in `call` (a
    step counter, a moving average, a seed generator's state, and trainable
    ones too: SpectralNormalization rescales its kernel in training). Every
    variable of the model and its metrics is restored before each call after
    the first, so the calls compare the same model (a kernel renormalised
    by the previous call would change the loss), and afterwards, so the
    first training step starts from the state plain Keras would. State a
    layer keeps outside Keras variables (a Python attribute it counts calls
    with) is not restored.

    Args:
        model: A compiled, built Keras model.
        computes: Callables without arguments, each calling the model.

    Returns:
        The list of what `computes` returned, or `None` when one raised or
        the model has stateful layers, whose state the probe's batches would
        disturb (the probes are safeguards: a model they cannot run is not
        checked).
    """
    import keras

    if any(getattr(layer, "stateful", False) for layer in model._flatten_layers()):
        return None
    kept, seen = [], set()
    for variable in list(model.variables) + list(model.metrics_variables):
        if id(variable) not in seen:
            seen.add(id(variable))
            kept.append(variable)
    saved = [keras.ops.convert_to_numpy(v) for v in kept]

    def restore():
        for variable, value in zip(kept, saved):
            variable.assign(value)

    results = []
    try:
        for i, compute in enumerate(computes):
            if i:
                restore()
            results.append(compute())
        return results
    except Exception as e:  # noqa: BLE001
        logger.debug("loss probe skipped: %s", e)
        return None
    finally:
        restore()


def _total_loss(model, x, y, copies, rows=2, start=0, training=False):
    import keras

    def repeat(value):
        if value is None:
            return None
        head = value[start:start + rows]
        return keras.ops.concatenate([head] * copies, axis=0) if copies > 1 else head

    xs = keras.tree.map_structure(repeat, x)
    ys = keras.tree.map_structure(repeat, y) if y is not None else None
    y_pred = model(xs, training=training)
    total = model._compute_loss(x=xs, y=ys, y_pred=y_pred, sample_weight=None,
                                training=training)
    return float(keras.ops.convert_to_numpy(total))


def _probe_modes(model, skip_training_if=()):
    """The modes to probe `model` in: inference, and training when that is deterministic.

    A loss term a layer adds only in training (`add_loss` under `if training:`)
    exists only in training mode. Training mode is probed unless a layer
    draws random numbers (Dropout: each probe would drop other units), wraps
    a PyTorch module (`TorchModuleWrapper`: its buffers, such as a
    `torch.nn.BatchNorm1d`'s running statistics, are no Keras variables the
    probe could restore) or is an instance of a class in `skip_training_if`.
    """
    import keras

    from autodist_keras.graph.model_graph import random_layer

    wrapper = getattr(keras.layers, "TorchModuleWrapper", None)
    skip = tuple(skip_training_if) + ((wrapper,) if wrapper is not None else ())
    layers = list(model._flatten_layers(include_self=False))
    if random_layer(model) is not None or any(isinstance(layer, skip) for layer in layers):
        return (False,)
    return (False, True)


def warn_masked_outputs(model):
    """Warns when a model output carries a Keras mask (its loss is a masked mean).

    Args:
        model: A built Keras model; models without symbolic outputs
            (subclassed) are not checked.

    Returns:
        Whether it warned.
    """
    from keras.src.backend import get_keras_mask

    try:
        outputs = list(model.outputs or [])
    except (AttributeError, ValueError):
        return False
    masked = [getattr(t, "name", str(i)) for i, t in enumerate(outputs)
              if get_keras_mask(t) is not None]
    if masked:
        warnings.warn(
            f"Output(s) {masked} of model {model.name!r} carry a Keras mask, so their loss "
            "is a mean over the valid (unmasked) entries. Each replica averages over its own "
            "shard's valid entries and is weighted by its share of the batch, so when the "
            "shards hold different amounts of padding the gradients differ from single-device "
            "training (in a test with lengths 1 to 7, weights moved 0.11 to 0.16 in 12 steps "
            "and differed by up to 0.08). For exact equality, drop the mask from the output "
            "and pass per-timestep sample weights (0 on padding): Keras then divides by the "
            "number of entries, which splits exactly by share.",
            stacklevel=user_stacklevel(),
        )
    return bool(masked)


def _batchnorm_calls(model, times=1, calls=None):
    """`{layer: [node, ...]}`: the calls per step of each trainable BatchNormalization
    layer of `model`'s graph (a Sequential's, and nested models' too, each node
    listed once per call of the model holding it)."""
    import keras

    calls = {} if calls is None else calls
    functional = getattr(model, "_functional", None) or model  # a Sequential's graph
    keys = getattr(functional, "_nodes", None)
    if not keys:
        return calls  # a subclassed model: no graph to read
    for operation in getattr(functional, "_operations", ()):
        nodes = [node for k, node in enumerate(getattr(operation, "_inbound_nodes", ()))
                 if f"{id(operation)}_ib-{k}" in keys]
        if isinstance(operation, keras.layers.BatchNormalization):
            if operation.trainable:
                calls.setdefault(operation, []).extend(nodes * times)
        elif isinstance(operation, keras.Model):
            _batchnorm_calls(operation, times * len(nodes), calls)
    return calls


def warn_inexact_batchnorm(model):
    """Warns about BatchNormalization layers whose moving statistics the runtimes
    cannot combine exactly (`batchnorm_stats`): layers called more than once per
    step, and layers that get a Keras mask.

    Args:
        model: A built Keras model; subclassed models are not checked.

    Returns:
        The names of the layers it warned about.
    """
    from keras.src.backend import get_keras_mask

    shared, masked = [], []
    for layer, nodes in _batchnorm_calls(model).items():
        if len(nodes) > 1:
            shared.append(layer.name)
        if any(node.arguments.kwargs.get("mask") is not None
               or any(get_keras_mask(t) is not None for t in node.input_tensors)
               for node in nodes):
            masked.append(layer.name)
    if shared:
        warnings.warn(
            f"BatchNormalization layer(s) {shared} of model {model.name!r} run more than "
            "once per training step (shared layers). The runtimes combine the replicas' "
            "moving statistics as if each ran once: the moving mean is exact, the moving "
            "variance is not (51% off single-device training after one step in a test). "
            "For exact statistics use one BatchNormalization per call, or freeze it "
            "(trainable=False).",
            stacklevel=user_stacklevel(),
        )
    if masked:
        warnings.warn(
            f"BatchNormalization layer(s) {masked} of model {model.name!r} get a Keras "
            "mask, so each replica's batch statistics are over its shard's valid entries, "
            "while the runtimes combine them by the replicas' shares of rows: with padding "
            "spread unevenly over the shards the moving statistics differ from "
            "single-device training (mean 5%, variance 28% in a test). Training itself "
            "normalises each shard with its own statistics, as data parallelism does.",
            stacklevel=user_stacklevel(),
        )
    return sorted(set(shared + masked))


# How many rows of the first batch the per-sample probe compares, and its
# relative tolerance: a mean of per-sample losses over 4 rows matches the mean
# of the rows' own losses to about 1e-6 in float32, while Dice over the whole
# batch differed by 1e-3 to 1e-2 in tests.
_PER_SAMPLE_ROWS = 4
_PER_SAMPLE_RTOL = 1e-4


def warn_loss_not_per_sample(model, x, y):
    """Warns when the model's loss is not a mean of per-sample losses.

    Each replica computes the loss over its own share of the batch and is
    weighted by that share, which reproduces one device's loss exactly when
    the loss is a mean of per-sample losses. Others train differently from
    one device, silently: `SparseCategoricalCrossentropy(ignore_class=...)`
    (a mean over the entries not ignored, so a shard with more ignored
    entries weighs too much), Dice or Tversky over the whole batch, losses
    with in-batch negatives. Losses with `ignore_class` are named from the
    compiled losses; the others are found by a probe: the total loss of the
    batch's first rows against the mean of each row's own total loss, in
    inference mode and, unless a layer draws random numbers or is a
    BatchNormalization (which mixes samples in training by design), in
    training mode. Each call starts from the model's variables and metric
    states as they were, and they are restored afterwards (`_probe`).

    Call it after `check_summed_losses` (a summed term is refused there, and
    would also differ here), and skip it when `warn_masked_outputs` warned.

    Args:
        model: A compiled, built Keras model.
        x: The inputs of one batch (any Keras input structure).
        y: Its targets (may be `None`).

    Returns:
        Whether it warned.
    """
    import keras

    ignoring = [
        f"{loss.name!r} (ignore_class={loss.ignore_class!r})"
        for loss in keras.tree.flatten(model.loss)
        if getattr(loss, "ignore_class", None) is not None
    ]
    if ignoring:
        warnings.warn(
            f"Loss {', '.join(ignoring)} of model {model.name!r} is a mean over the entries "
            "not ignored. Each replica averages over its own shard's entries and is weighted "
            "by its share of the batch, so when the shards hold different numbers of ignored "
            "entries the loss and gradients differ from single-device training (in a test "
            "with shares 8/4/4, one step moved the weights 0.4 relative away from one "
            "device's). For exact equality, drop ignore_class and pass sample weights of 0 "
            "for the ignored entries (and any valid class in their place): Keras then divides "
            "by the number of entries, which splits exactly by share.",
            stacklevel=user_stacklevel(),
        )
        return True
    leaves = [v for v in keras.tree.flatten(x) if v is not None]
    if not leaves:
        return False
    rows = min(_PER_SAMPLE_ROWS, int(leaves[0].shape[0]))
    if rows < 2:
        return False

    def losses(training):
        # Each call from the same state: one that renormalises a kernel in training
        # (SpectralNormalization) would otherwise change the model for the next.
        found = _probe(model, [
            functools.partial(_total_loss, model, x, y, copies=1, rows=rows, training=training)
        ] + [functools.partial(_total_loss, model, x, y, copies=1, rows=1, start=i,
                               training=training) for i in range(rows)])
        return None if found is None else (found[0], sum(found[1:]) / rows)

    # Training mode too (a term added only in training), except where layers mix
    # samples there by design: BatchNormalization normalises each replica's shard
    # with its own statistics, as data parallelism does (warn_inexact_batchnorm).
    for training in _probe_modes(model, skip_training_if=(keras.layers.BatchNormalization,)):
        found = losses(training)
        if found is None or not all(math.isfinite(v) for v in found):
            continue
        together, mean_alone = found
        if abs(together - mean_alone) > _PER_SAMPLE_RTOL * max(abs(together),
                                                               abs(mean_alone), 1e-12):
            _warn_not_per_sample(model, rows, together, mean_alone, training)
            return True
    return False


def _warn_not_per_sample(model, rows, together, mean_alone, training):
    if training:
        warnings.warn(
            f"In training mode the loss of model {model.name!r} is not a mean of per-sample "
            f"losses (in inference mode it is): on the first {rows} rows of the batch it was "
            f"{together:.6g}, while the mean of those rows' own losses was {mean_alone:.6g}. "
            "Typical causes: a loss term added only when training=True that is not a mean of "
            "per-sample values (`add_loss` of a batch statistic), or a layer that normalises "
            "over the batch in training (a hand-written batch normalisation). Each replica "
            "computes it over its own share of the batch and is weighted by that share, so "
            "training differs from single-device training. "
            f"Received: loss of {rows} rows {together:.6g}, mean per-row loss "
            f"{mean_alone:.6g} (training mode)",
            stacklevel=user_stacklevel(),
        )
        return
    warnings.warn(
        f"The loss of model {model.name!r} is not a mean of per-sample losses: on the first "
        f"{rows} rows of the batch it was {together:.6g}, while the mean of those rows' own "
        f"losses was {mean_alone:.6g}. Each replica computes the loss over its own share of "
        "the batch and is weighted by that share, so training differs from single-device "
        "training (and evaluate's loss, which splits batches the same way). Typical causes: "
        "a loss over the whole batch (Dice or Tversky with axis=None), in-batch negatives "
        "(contrastive losses), a layer that mixes samples (which also changes predict's "
        "outputs after fit). "
        "Make the loss per-sample (Dice with an axis that keeps the batch, say) for exact "
        "equality, or accept per-replica losses, as data parallelism elsewhere computes "
        f"them. Received: loss of {rows} rows {together:.6g}, mean per-row loss "
        f"{mean_alone:.6g}",
        stacklevel=user_stacklevel(),
    )


def splits_batch(plan):
    """Whether `plan` splits batches over replicas (some group has two or more)."""
    return any(len(group.replicas) > 1 for group in plan.groups)


def check_model_for_plan(model, x, y, plan):
    """Runs every check above before the first step of a plan that splits the batch.

    A plan with one replica per group runs each batch whole, as plain Keras
    does, so it is neither refused nor warned about.

    Args:
        model: A compiled, built Keras model.
        x: The inputs of one batch.
        y: Its targets (may be `None`).
        plan: The `Plan` about to run.
    """
    if not splits_batch(plan):
        return
    # The probes cost several forward passes (seconds for a ResNet50 on a CPU):
    # a later fit of the same compiled model under the same plan skips them.
    key = _checked_key(model, plan)
    if _CHECKED.get(model) == key:
        return
    check_loss_reductions(model)  # the specific message first
    check_stateful_layers(model)
    check_summed_losses(model, x, y)
    if not warn_masked_outputs(model):
        warn_loss_not_per_sample(model, x, y)
    warn_inexact_batchnorm(model)
    _CHECKED[model] = key


# Each model's last checked (plan, compiled loss, trainable variables), held
# weakly: compiling again, freezing a layer or a new plan checks it again.
_CHECKED = weakref.WeakKeyDictionary()


def _checked_key(model, plan):
    """What `check_model_for_plan`'s verdict on `model` depends on."""
    try:
        plan_key = plan.to_json()
    except Exception:  # noqa: BLE001 - e.g. a non-finite prediction: check again
        plan_key = object()
    return (
        plan_key,
        id(getattr(model, "_compile_loss", None)),
        tuple(id(v) for v in model.trainable_variables),
    )


def trainable_changed_during_fit(before, now):
    """The error for a model whose trainable variables changed in the middle of a fit.

    Both runtimes set up a fit's gradient buckets (and the PyTorch workers'
    replicas) for the variables trainable when it begins; a callback that
    freezes or unfreezes a layer mid-fit would pair gradients with the wrong
    variables. Between fits the strategy plans the model again.

    Args:
        before: Number of variables trainable when the fit began.
        now: Number trainable now.

    Returns:
        A `BackendError` to raise.
    """
    return BackendError(
        "The model's trainable variables changed during fit (a callback froze or unfroze a "
        f"layer), but this fit's gradient exchange was set up for the {before} variables "
        "trainable when it began. Change `trainable` between fits: the strategy plans the "
        "model again at the next fit (Keras, too, advises compiling again after changing "
        "`trainable`); e.g. fit for the first epochs, freeze, then fit with initial_epoch. "
        f"Received: {now} trainable variables now, {before} at the start of this fit"
    )
