"""Which of rank 0's variables changed between training steps (PyTorch runtime).

Keras callbacks may write rank 0's weights or optimizer variables between
steps: `set_weights` in `on_epoch_end` (weight averaging, a max-norm
constraint), `EarlyStopping(restore_best_weights=True)` at the end of fit,
`ReduceLROnPlateau` and `LearningRateScheduler` on the learning rate. The
workers hold their own copies, so rank 0 sends them what changed before the
next step (and before the end of fit), and every replica goes on from the
same weights.

PyTorch counts the in-place writes to every tensor (`tensor._version`; a
Keras variable's `assign` is an in-place `copy_`), so the check costs one
integer comparison per variable and step, and a variable whose tensor was
replaced counts as changed too.

Example:

```python
watch = StateWatch(model.weights + model.optimizer.variables)
...                       # the training step; then
watch.mark()
...                       # callbacks run
watch.changed()           # indices of the variables written since `mark()`
```
"""

import contextlib
import weakref

from autodist_keras.errors import BackendError
from autodist_keras.lazy_tensorflow import tensorflow_left_unimported

# The settings each of rank 0's optimizers had when built, or when the runtime
# first saw it built (`note_built_settings`): some decide which variables it makes.
_BUILT_WITH = weakref.WeakKeyDictionary()


class StateWatch:
    """Notices writes to Keras variables (PyTorch backend) made since `mark()`.

    Args:
        variables: The Keras variables to watch, in the order the indices of
            `changed()` refer to.
    """

    def __init__(self, variables):
        self.variables = list(variables)
        self._stamps = []
        self.mark()

    @staticmethod
    def _stamp(variable):
        tensor = variable._value  # the torch tensor (`value` may autocast)
        return id(tensor), tensor._version

    def mark(self):
        """Records the variables' state as the one the workers hold."""
        self._stamps = [self._stamp(v) for v in self.variables]

    def changed(self):
        """Indices of the variables written (or replaced) since the last `mark()`."""
        return [i for i, (v, stamp) in enumerate(zip(self.variables, self._stamps))
                if self._stamp(v) != stamp]


# Settings that never change how an update is computed (the learning rate
# travels with every TRAIN command instead).
_NOT_SETTINGS = ("name", "learning_rate")
SCALAR_TYPES = (bool, int, float, str, type(None))


class OptimizerSettingsWatch:
    """Notices changes to an optimizer's scalar settings made since `mark()`.

    The spawned workers rebuild the optimizer from its config, once, at
    setup; a callback on rank 0 that sets `optimizer.momentum`,
    `optimizer.weight_decay` or `optimizer.clipnorm` between steps changes
    rank 0's updates only. The settings watched are the optimizer config's
    keys whose values are plain Python scalars and that the optimizer holds
    as attributes of the same name (those `get_config()` reads back). The
    check reads each one per step (microseconds).

    Args:
        optimizer: The Keras optimizer on rank 0.

    Example:

    ```python
    watch = OptimizerSettingsWatch(model.optimizer)
    model.optimizer.momentum = 0.0      # a callback, between steps
    watch.changed()                     # {"momentum": 0.0}
    watch.mark()
    ```
    """

    def __init__(self, optimizer):
        self.optimizer = optimizer
        # (A LossScaleOptimizer's own config holds only its scale settings;
        # those of the optimizer it wraps are watched as "inner_optimizer.<key>".)
        self.keys = tuple(
            prefix + key
            for prefix, target in _optimizers(optimizer)
            for key in _setting_keys(target))
        self._values = ()
        self.mark()

    def _read(self):
        return tuple(getattr(*_target(self.optimizer, key), None) for key in self.keys)

    def mark(self):
        """Records the settings as the ones the workers hold."""
        self._values = self._read()

    def _moved(self):
        """`(name, new value)` of each setting that differs from the last
        `mark()` (`_same`: a NaN setting set to NaN again has not moved)."""
        return [(key, new) for key, old, new in zip(self.keys, self._values, self._read())
                if not _same(old, new)]

    def moved_keys(self):
        """The names of the settings that differ from the last `mark()`.

        Unlike `changed()`, any new value is accepted (the TensorFlow runtime,
        which sends nothing, only traces its step again).

        Returns:
            A list of setting names, empty when nothing changed.

        Example:

        ```python
        watch = OptimizerSettingsWatch(optimizer)
        optimizer.momentum = 0.5
        watch.moved_keys()                  # ["momentum"]
        ```
        """
        return [key for key, _ in self._moved()]

    def changed(self):
        """The settings changed since the last `mark()`, as `{name: value}`.

        Returns:
            A dict, empty when nothing changed.

        Raises:
            BackendError: When a setting was given a value that cannot be sent
                (anything but a Python or NumPy scalar).

        Example:

        ```python
        watch = OptimizerSettingsWatch(optimizer)
        optimizer.momentum = 0.5
        watch.changed()                     # {"momentum": 0.5}
        ```
        """
        return {key: _scalar(key, new) for key, new in self._moved()}


_INNER = "inner_optimizer."


def _optimizers(optimizer):
    """`(prefix, optimizer)` of `optimizer` and of the one it wraps, if any."""
    inner = getattr(optimizer, "inner_optimizer", None)
    return [("", optimizer)] + ([(_INNER, inner)] if inner is not None else [])


def _target(optimizer, key):
    """`(object, attribute)` a watched key names."""
    if key.startswith(_INNER):
        return optimizer.inner_optimizer, key[len(_INNER):]
    return optimizer, key


def learning_rate_holder(optimizer):
    """The optimizer whose learning rate applies: a `LossScaleOptimizer`'s inner one."""
    while getattr(optimizer, "inner_optimizer", None) is not None:
        optimizer = optimizer.inner_optimizer
    return optimizer


def has_callable_learning_rate(optimizer):
    """Whether the learning rate is a function of no arguments (`opt.learning_rate =
    lambda: ...`, which Keras allows), rather than a number or a schedule."""
    from keras.optimizers.schedules import LearningRateSchedule

    lr = getattr(learning_rate_holder(optimizer), "_learning_rate", None)
    return callable(lr) and not isinstance(lr, LearningRateSchedule) and not hasattr(lr, "assign")


@contextlib.contextmanager
def callable_learning_rate_as_value(optimizer):
    """Within the block, a callable learning rate is its current value to `get_config()`.

    Keras serialises a callable learning rate with its code and closure; one
    that reads the optimizer (`lambda: 0.1 * 0.9 ** opt.iterations`) recurses
    without end (`RecursionError`, in plain Keras's `model.save` too), and any
    other object in its closure would be a copy in the workers. The workers
    need no function: rank 0 evaluates it before every step and sends the
    value (`torch_session.Driver._learning_rate`), as it does for a learning rate
    a callback sets. Outside the block the optimizer is as it was.

    Args:
        optimizer: Rank 0's optimizer (or None).
    """
    if optimizer is None or not has_callable_learning_rate(optimizer):
        yield
        return
    import keras

    holder = learning_rate_holder(optimizer)
    function = holder._learning_rate
    holder._learning_rate = keras.ops.convert_to_tensor(float(holder.learning_rate), "float32")
    try:
        yield
    finally:
        holder._learning_rate = function


class SentLearningRate:
    """A worker's stand-in for rank 0's callable learning rate: the value rank 0 sent.

    Rank 0 evaluates its function before every step and sends the value; the
    worker's optimizer calls this, as Keras calls a callable learning rate,
    and has no learning-rate variable, as rank 0's has none.

    Args:
        value: The learning rate rank 0 sent with its setup.
    """

    def __init__(self, value):
        self.value = float(value)

    def __call__(self):
        return self.value


def use_sent_learning_rate(optimizer, value):
    """Makes a worker's `optimizer` take its learning rate from rank 0 (`SentLearningRate`)."""
    learning_rate_holder(optimizer).learning_rate = SentLearningRate(value)


def _setting_keys(optimizer):
    """The config keys of `optimizer` with plain scalar values that it holds
    as attributes of the same name."""
    try:
        with callable_learning_rate_as_value(optimizer), tensorflow_left_unimported():
            config = optimizer.get_config()
    except (NotImplementedError, TypeError, ValueError):
        return []
    return [key for key, value in config.items()
            if key not in _NOT_SETTINGS and isinstance(value, SCALAR_TYPES)
            and hasattr(optimizer, key) and _same(getattr(optimizer, key), value)]


def _same(a, b):
    """Whether two values of a setting are the same: one object, or of one type
    and equal, NaN counting as equal to NaN (else a NaN setting would count as
    changed at every step: the TensorFlow runtime would trace its step again,
    the PyTorch runtime send it again)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b) or (bool(a != a) and bool(b != b))
    except (TypeError, ValueError):  # (an array's comparison has no single truth value)
        return False


def _scalar(key, value):
    if isinstance(value, SCALAR_TYPES):
        return value
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "ndim", None) == 0:
        return item()
    raise BackendError(
        f"The optimizer's setting {key!r} was changed during fit to a value the "
        "PyTorch runtime cannot send to its worker processes, which hold their "
        "own optimizers. Set it to a Python number. "
        f"Received: {type(value).__name__}"
    )


def apply_settings(optimizer, settings):
    """Sets the optimizer settings rank 0 sent (`OptimizerSettingsWatch.changed`)."""
    for key, value in settings.items():
        setattr(*_target(optimizer, key), value)


def _settings_of(optimizer):
    watch = OptimizerSettingsWatch(optimizer)
    return dict(zip(watch.keys, watch._read()))


def note_settings_before_build(optimizer):
    """Notes an unbuilt `optimizer`'s settings: Keras is about to build it with them.

    Called as `fit` is called. Keras builds the optimizer at the start of
    `fit`, before callbacks run; one that sets `momentum = 0.0` in
    `on_train_begin` changes it after the build, and rank 0's setup (at the
    first step) would take the new value for the one it was built with.
    """
    if optimizer is not None and not optimizer.built and optimizer not in _BUILT_WITH:
        _BUILT_WITH[optimizer] = _settings_of(optimizer)


def note_built_settings(optimizer, variables):
    """Builds rank 0's `optimizer` on `variables` if needed, and notes its settings then.

    Some settings decide which variables an optimizer makes when it is built:
    SGD makes momentum slots only when `momentum` is not 0, Adam makes more
    with `amsgrad=True`, any optimizer with `use_ema=True`. Workers build
    their optimizers from rank 0's config at every fit, so after such a
    setting changed they would make other variables (`built_settings_changed`).
    The settings are noted as `fit` is called if the optimizer is not built
    yet (`note_settings_before_build`), else the first time the runtime
    sees it built.
    """
    if not optimizer.built:
        optimizer.build(variables)
    if optimizer not in _BUILT_WITH:
        _BUILT_WITH[optimizer] = _settings_of(optimizer)


def built_settings_changed(optimizer):
    """The settings changed since the runtime built `optimizer`, as `{name: [built, now]}`.

    A worker builds its optimizer with the `built` values, so that it makes
    the variables rank 0's has, and then sets the `now` values (`build_as`).
    Empty when nothing changed.
    """
    built = _BUILT_WITH.get(optimizer)
    if not built:
        return {}
    now = _settings_of(optimizer)
    return {key: [value, _scalar(key, now[key])] for key, value in built.items()
            if key in now and not _same(value, now[key])}


def build_as(optimizer, variables, changed):
    """Builds a worker's `optimizer` as rank 0's was built (`built_settings_changed`)."""
    apply_settings(optimizer, {key: pair[0] for key, pair in changed.items()})
    optimizer.build(variables)
    apply_settings(optimizer, {key: pair[1] for key, pair in changed.items()})


def _decaying(optimizer):
    """The optimizer that applies weight decay: the one a LossScaleOptimizer wraps."""
    return getattr(optimizer, "inner_optimizer", None) or optimizer


def decay_excluded(optimizer, variables):
    """Indices of `variables` the optimizer leaves out of its weight decay.

    `optimizer.exclude_from_weight_decay(...)` is state outside the config, so
    spawned workers, which rebuild the optimizer from the config, would not
    have it; rank 0 sends these indices at setup.
    """
    optimizer = _decaying(optimizer)
    use = getattr(optimizer, "_use_weight_decay", None)
    if use is None:
        return []
    return [i for i, v in enumerate(variables) if not use(v)]


def exclude_from_decay(optimizer, variables):
    """Makes the optimizer leave exactly `variables` out of its weight decay.

    Works on a built optimizer too (Keras's public method refuses one), by
    setting what that method sets.
    """
    optimizer = _decaying(optimizer)
    if not hasattr(optimizer, "_use_weight_decay"):
        return
    optimizer._exclude_from_weight_decay = {optimizer._var_key(v) for v in variables}
    optimizer._exclude_from_weight_decay_pattern = None
    optimizer._exclude_from_weight_decay_cache = {}
