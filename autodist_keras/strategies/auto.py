"""AutoStrategy: the user-facing entry point.

```python
strategy = AutoStrategy(cluster=Cluster.cpu_testbed())
with strategy.scope():
    model = build_model()
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
model.fit(x, y, batch_size=256)
print(strategy.explain())
```

Models compiled inside `scope()` are attached to the strategy: the backend
adapter for the active Keras backend replaces their train, test and predict
functions, so a plain `model.fit(...)` runs the plan. The plan is made at the
first training step, when the global batch size is known.
"""

import contextlib
import numbers
import os
import threading
import time
import types
import warnings
import weakref

from autodist_keras.errors import StrategyError
from autodist_keras.stacklevel import user_stacklevel
from autodist_keras.strategies.plan import Plan
from autodist_keras.strategies.plan import short_repr

STRATEGY_NAMES = ("auto", "single_device", "data_parallel", "proportional", "fastt", "heterog", "disco")
FAMILY_NAMES = ("fastt", "heterog", "disco")
BASELINE_FOR_NAME = {
    "single_device": "single_device",
    "data_parallel": "data_parallel_even",
    "proportional": "proportional",
}
OPTION_NAMES = (
    "sync",  # "allreduce" or "ps"
    "ps_server",  # device name for PS sync
    "algorithm",  # all-reduce algorithm
    "bucket_bytes",  # gradient bucket threshold in bytes
    "buckets",  # explicit bucket layout
    "speeds",  # measured relative device speeds for the proportional plan
    "step_costs",  # measured per-replica step costs: the proportional plan balances them
    "timeout_s",  # how long the runtime waits for a worker before failing
    "estimator",  # "learned" (default), "simulator", or a saved LearnedEstimator JSON path
    "op_fusion",  # realise plan.op_fusion regions: "auto" (TensorFlow on GPUs), "on", "off"
    "op_fusion_compiler",  # PyTorch: the torch.compile backend of the regions ("inductor")
)
# Not passed to planners.
RUNTIME_ONLY_OPTIONS = ("timeout_s", "estimator", "op_fusion", "op_fusion_compiler")

_scope_lock = threading.Lock()
_COMPILE_AFTER_SCOPE = "_autodist_built_in_scope_of"


# Scopes are per thread, as `tf.distribute` scopes are: the strategies whose scope
# this thread is in (innermost last). While any thread is in a scope, Keras's
# `compile` and `keras.Model.__new__` are replaced by hooks that look up the
# calling thread's strategy (`_install_scope_hooks`); a thread outside every
# scope gets plain Keras.
_scopes = threading.local()
_hooks = {"count": 0}


def _thread_scopes():
    if not hasattr(_scopes, "stack"):
        _scopes.stack = []
    return _scopes.stack


def _active_strategy():
    """The strategy whose scope the calling thread is in, or None."""
    stack = _thread_scopes()
    return stack[-1] if stack else None


def _install_scope_hooks():
    """Replaces Keras's `compile` and `keras.Model.__new__` by the scope hooks
    (once, however many threads are in scopes). Call with `_scope_lock` held."""
    import keras

    _hooks["count"] += 1
    if _hooks["count"] > 1:
        return
    # `compile` is wrapped on the class that defines it (Keras's Trainer), not
    # shadowed on keras.Model: Keras's `compile_from_config`, which `load_model`
    # calls, skips models whose class overrides `compile`.
    owner = next(c for c in keras.Model.__mro__ if "compile" in vars(c))
    original_compile = vars(owner)["compile"]
    original_new = vars(keras.Model)["__new__"]

    def compile(model, *args, **kwargs):
        strategy = _active_strategy()
        if strategy is None:  # another thread's scope: plain Keras here
            return original_compile(model, *args, **kwargs)
        with strategy.adapter.variable_scope():
            result = original_compile(model, *args, **kwargs)
        strategy._attach(model)
        return result

    def new(cls, *args, **kwargs):
        model = original_new.__func__(cls, *args, **kwargs)
        strategy = _active_strategy()
        if (strategy is not None and isinstance(model, keras.Model)
                and _COMPILE_AFTER_SCOPE not in vars(model)):
            compile_later = types.MethodType(_compile_after_scope, model)
            object.__setattr__(model, "compile", compile_later)
            object.__setattr__(model, _COMPILE_AFTER_SCOPE, strategy)
        return model

    compile.__doc__ = original_compile.__doc__
    owner.compile = compile
    keras.Model.__new__ = staticmethod(new)
    _hooks.update(owner=owner, compile=original_compile, new=original_new)


def _remove_scope_hooks():
    """Puts Keras's own `compile` and `__new__` back when the last scope ends.
    Call with `_scope_lock` held."""
    import keras

    _hooks["count"] -= 1
    if _hooks["count"] == 0:
        _hooks["owner"].compile = _hooks.pop("compile")
        keras.Model.__new__ = _hooks.pop("new")
        _hooks.pop("owner")


class _Scope:
    """What `AutoStrategy.scope()` returns: a context manager that may be entered
    again (`sc = strategy.scope(); with sc: ...; with sc: ...`), as users do to
    compile again for fine-tuning."""

    def __init__(self, strategy):
        self.strategy = strategy
        self._active = []

    def __enter__(self):
        context = self.strategy._entered()
        result = context.__enter__()
        self._active.append(context)
        return result

    def __exit__(self, *exc_info):
        return self._active.pop().__exit__(*exc_info)


def _compile_after_scope(model, *args, **kwargs):
    """`compile` of a model built inside `AutoStrategy.scope()`.

    Inside a scope (this strategy's or another's) it is the class's
    `compile`, which the scope wraps; after the scope it compiles with the
    strategy's variable placement and attaches the model to the strategy the
    model was built in, so `fit` runs its plan rather than one device.
    """
    if _active_strategy() is not None:
        return type(model).compile(model, *args, **kwargs)
    strategy = vars(model)[_COMPILE_AFTER_SCOPE]
    with strategy.adapter.variable_scope():
        result = type(model).compile(model, *args, **kwargs)
    strategy._attach(model)
    return result


def _close_names(names, valid, n=2):
    """`" Did you mean 'x'?"` for the names close to a valid one (up to `n` each),
    else `""`."""
    import difflib

    close = [c for name in names if isinstance(name, str)
             for c in difflib.get_close_matches(name, list(valid), n=n, cutoff=0.6)]
    return f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def _strategy_hint(strategy):
    """What an unknown strategy name probably was: a plan or a cluster passed first,
    or a typo."""
    from autodist_keras.devices.cluster import Cluster
    from autodist_keras.devices.spec import builtin_cluster_names
    from autodist_keras.devices.spec import looks_like_cluster_string

    text = os.fspath(strategy) if isinstance(strategy, (str, os.PathLike)) else None
    text = text if isinstance(text, str) else None
    shown = repr(text) if text is not None else "..."
    if isinstance(strategy, Plan) or (text is not None and text.endswith(".json")):
        return (" It looks like a plan: the first argument is the strategy, so pass the "
                f"plan as a keyword, AutoStrategy(plan={shown}).")
    if isinstance(strategy, (Cluster, dict)) or (text is not None and (
            text in builtin_cluster_names() or text.endswith((".yaml", ".yml"))
            or looks_like_cluster_string(text))):
        return (" It looks like a cluster: the first argument is the strategy, so pass the "
                f"cluster as a keyword, AutoStrategy(cluster={shown}).")
    if isinstance(strategy, str):
        return _close_names([strategy.lower()], STRATEGY_NAMES, n=1)
    return ""


_PLANNED_FOR_FIRST_BATCH = "_autodist_planned_for_first_batch"
# The per-sample input shapes a plan's figures are for, where the model leaves
# dimensions unknown and planning filled them (a list of tuples).
_PLANNED_INPUT_SHAPES = "_autodist_planned_input_shapes"


def may_outgrow(plan):
    """Whether `warn_if_batch_outgrows_plan` may still warn for `plan`.

    Paths that hand every step to Keras's own train function (one replica)
    check each batch only while this holds.
    """
    return bool(getattr(plan, _PLANNED_FOR_FIRST_BATCH, False))


def warn_if_batch_outgrows_plan(plan, batch_size):
    """Warns once per plan when a training batch is larger than the plan's batch.

    A plan is made at the first training step for that batch's size. When the
    first batch is smaller than later ones (a generator warming up, batches
    bucketed by length), every later batch runs that plan's shares scaled up,
    which may be a poor plan for it: `auto` facing a 2-row first batch picks
    one device for the whole fit. Plans given with `plan=` or made by
    `strategy.plan_for` are not checked. (On TensorFlow a one-device plan runs
    Keras's own train function after each fit's first step, which this never
    sees: there only the first batch of each fit is checked.)

    Args:
        plan: The `Plan` in force.
        batch_size: Rows of the training batch about to run.
    """
    if not getattr(plan, _PLANNED_FOR_FIRST_BATCH, False) or batch_size <= plan.global_batch_size:
        return
    setattr(plan, _PLANNED_FOR_FIRST_BATCH, False)  # once
    warnings.warn(
        f"This training batch has {batch_size} rows, more than the first training batch "
        f"({plan.global_batch_size} rows) that the plan was made for; the plan's shares are "
        f"scaled to it, which may not be the plan the strategy would choose for {batch_size} "
        f"rows (on {len(plan.devices)} device(s)). To plan for the larger batches, call "
        f"strategy.plan_for(model, {batch_size}) before fit, or make the first batch full "
        f"size. Received: batch of {batch_size} rows, plan for {plan.global_batch_size}",
        stacklevel=user_stacklevel(),
    )


def _normalise_step_costs(value):
    """The `step_costs=` option as plain dicts (read from its JSON file if a path).

    Plain dicts keep the option JSON-serialisable (the TensorFlow workers get
    it in their job file) and make the plan cache key depend on the costs
    themselves, not on a file name.
    """
    from autodist_keras.errors import PlanError
    from autodist_keras.strategies import share_balance

    try:
        return share_balance.step_costs_to_dict(share_balance.load_step_costs(value))
    except PlanError as e:
        message = str(e)
        raise StrategyError(message if message.startswith("step_costs")
                            else f"step_costs: {message}") from None


class AutoStrategy:
    """Distributes `model.fit` of an unchanged Keras program according to a plan.

    Args:
        strategy: Plan family: `"auto"` (default), `"single_device"`,
            `"data_parallel"` (even shares), `"proportional"` (shares by
            device speed), or the planner families `"fastt"`, `"heterog"`,
            `"disco"`.
        cluster: The devices: `None` (detect the local ones), a `Cluster`,
            a path to a YAML resource spec, its content as a dict, a string
            such as `"2xV100,4x1080Ti"`, `"cpu_testbed"` (the same as
            `Cluster.cpu_testbed()`), or the name of a spec shipped with the
            package (`"hetero_testbed"`, `"v100x8_nvlink"`, `"a100x4_t4x4"`).
        devices: Optional subset of the cluster's devices to use: a
            non-empty list of distinct device names (default: all of them).
        plan: A ready `Plan` (or a path to its JSON) to run instead of planning.
        **options: Planner and runtime options: `sync` (`"allreduce"` or
            `"ps"`), `ps_server`, `algorithm`, `bucket_bytes`, `buckets`,
            `speeds`, `step_costs` (measured per-replica step costs
            `{device: (fixed_s, per_sample_s)}` or the path of a JSON file
            holding them: the proportional plans then balance these costs
            over the cores, see `share_balance`; not with `speeds`), `timeout_s`, and
            `estimator`: what scores the
            candidate plans, `"learned"` (default: the packaged learned
            estimator of the backend where the cluster and plan lie in its
            training domain, the simulator elsewhere), `"simulator"`, or the
            path of a JSON file written by `LearnedEstimator.save()` (not
            with `plan=`, which runs no search); and
            `op_fusion`: whether the runtime compiles the plan's op-fusion
            regions (Disco), as XLA clusters on TensorFlow and as
            `torch.compile`d functions on PyTorch, `"auto"` (default: on
            TensorFlow when every replica is a GPU, never on PyTorch),
            `"on"` or `"off"`; `op_fusion_compiler`: the
            `torch.compile` backend for them (default `"inductor"`). The
            two op-fusion options go with `"auto"`, `"disco"` or `plan=`
            only: the other strategies' plans have no op-fusion regions.
            An option the strategy would not use, or options that
            contradict each other (`algorithm` with `sync="ps"`), raise
            `StrategyError` here, as does a `ps_server` outside `devices`
            on PyTorch (its runtime hosts the server in a replica).

    Example:

    ```python
    import keras
    from autodist_keras import AutoStrategy, Cluster

    strategy = AutoStrategy(strategy="proportional", cluster=Cluster.cpu_testbed())
    with strategy.scope():
        model = keras.Sequential([...])
        model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=64)
    ```
    """

    def __init__(self, strategy="auto", cluster=None, devices=None, plan=None, **options):
        if not isinstance(strategy, str) or strategy not in STRATEGY_NAMES:
            shown = short_repr(strategy, 80)  # (a Plan's repr runs to pages)
            raise StrategyError(
                f"Unknown strategy {shown}.{_strategy_hint(strategy)} Valid names: "
                f"{', '.join(STRATEGY_NAMES)}. Received: strategy={shown}"
            )
        from autodist_keras.strategies.selection import available_families

        if strategy in FAMILY_NAMES and strategy not in available_families():
            raise StrategyError(
                f"The {strategy!r} planner is not available yet in this version of "
                "autodist_keras. Use strategy='auto', 'proportional', 'data_parallel' or "
                f"'single_device'. Received: strategy={strategy!r}"
            )
        unknown = sorted(set(options) - set(OPTION_NAMES))
        if unknown:
            raise StrategyError(
                f"Unknown option(s) {unknown}.{_close_names(unknown, OPTION_NAMES)} Valid "
                f"options: {', '.join(OPTION_NAMES)}. Received: {unknown}"
            )
        if "estimator" in options:
            from autodist_keras.strategies.selection import check_estimator

            check_estimator(options["estimator"])
        if "op_fusion" in options:
            from autodist_keras.fusion.op_fusion import OP_FUSION_POLICIES

            if options["op_fusion"] not in OP_FUSION_POLICIES:
                raise StrategyError(
                    "op_fusion must be 'auto' (realise the plan's op-fusion regions on "
                    "TensorFlow when every replica is a GPU), 'on' or 'off'. "
                    f"Received: op_fusion={options['op_fusion']!r}"
                )
        if "op_fusion_compiler" in options and (
                not isinstance(options["op_fusion_compiler"], str)
                or not options["op_fusion_compiler"]):
            raise StrategyError(
                "op_fusion_compiler must name a torch.compile backend, e.g. 'inductor'. "
                f"Received: op_fusion_compiler={options['op_fusion_compiler']!r}"
            )
        if "step_costs" in options:
            options["step_costs"] = _normalise_step_costs(options["step_costs"])
        from autodist_keras.devices import Cluster

        self.name = strategy
        self.cluster = Cluster.resolve(cluster)
        if devices is not None:
            _check_devices(devices)
            devices = list(devices)
            for name in devices:
                if name not in self.cluster.names:
                    raise StrategyError(
                        f"Unknown device {name!r}; the cluster has {self.cluster.names}. "
                        f"Received: devices={devices}"
                    )
        self.devices = devices or list(self.cluster.names)
        from autodist_keras.strategies.options import check_options

        check_options(strategy, options, self.cluster, fixed_plan=plan is not None)
        self._check_ps_server_runs_a_replica(options, devices)
        if isinstance(plan, dict):
            plan = Plan.from_dict(plan)
        elif plan is not None and not isinstance(plan, Plan):
            if not isinstance(plan, (str, os.PathLike)):
                raise StrategyError(
                    "plan must be a Plan, a dict from Plan.to_dict(), or the path of a plan "
                    f"JSON file. Received: {type(plan).__name__}"
                )
            plan = Plan.from_json(plan)
        if plan is not None:
            self._check_fixed_plan(plan, strategy, devices)
        self._fixed_plan = plan
        self.options = dict(options)
        self.plan = plan
        self.graph = None
        self.measured = {}
        self._measured_plan = None  # the Plan `measured` was taken with
        self.candidates = []
        # Models are held weakly: a strategy reused across trials (a
        # hyper-parameter search) must not keep every model it compiled alive.
        self._plans = {}  # id(model) -> (weakref to the model, graph, plan)
        # Rows of the full batches of the fit under way, when its first training
        # batch may be a short one (`_full_batch_rows`); None otherwise.
        self._fit_batch_rows = None
        self._adapter = None
        self._model_refs = []
        import keras

        if keras.backend.backend() == "tensorflow":
            # Logical devices must exist before TensorFlow runs its first op,
            # which building a model outside `scope()` would do.
            from autodist_keras.backends.tensorflow_adapter import configure_logical_cpus

            configure_logical_cpus(self.cluster)

    def _check_ps_server_runs_a_replica(self, options, devices):
        """On PyTorch, a `ps_server` outside `devices=` cannot be run (the parameter
        server runs in a replica's process): refuses it now, not at the first step."""
        from autodist_keras.devices.detect import active_keras_backend

        server = options.get("ps_server")
        if server is None or devices is None or server in devices:
            return
        if active_keras_backend() != "torch":
            return  # TensorFlow keeps the variables on the server device itself
        raise StrategyError(
            f"ps_server {server!r} is not one of devices={devices}: on the PyTorch backend "
            "the parameter server runs in the process of a replica on its device, so it "
            "must be one of the devices that train. Add it to devices=, name one of them "
            "as ps_server (or leave ps_server out: the first device serves), or use "
            f"KERAS_BACKEND=tensorflow. Received: ps_server={server!r}, devices={devices}"
        )

    def _check_fixed_plan(self, plan, strategy, devices):
        """A plan given with `plan=` must run on this cluster and the devices asked for."""
        plan.check_structure()
        missing = sorted(set(plan.devices) - set(self.cluster.names))
        made_for = plan.provenance.cluster_fingerprint
        if missing:
            other = (f" (it was made for cluster {made_for[:12]}, this one is "
                     f"{self.cluster.fingerprint()[:12]})"
                     if made_for and made_for != self.cluster.fingerprint() else "")
            raise StrategyError(
                f"The plan given with plan= runs on devices {missing} that this cluster lacks"
                f"{other}; the cluster has {self.cluster.names}. Pass the cluster the plan was "
                "made for with cluster=..., or leave plan= out to plan for this cluster. "
                f"Received: plan devices {plan.devices}"
            )
        if devices is not None and not set(plan.devices) <= set(devices):
            raise StrategyError(
                f"The plan given with plan= runs on {plan.devices}, outside devices={devices}. "
                "Leave devices= out (the plan names its devices), or leave plan= out to plan "
                f"for those devices. Received: devices={devices}"
            )
        wanted = BASELINE_FOR_NAME.get(strategy, strategy)
        planner = plan.provenance.planner or ""
        if strategy != "auto" and not planner.startswith(wanted):
            warnings.warn(
                f"strategy={strategy!r} is not used: plan= gives the plan to run, and it is a "
                f"{planner or 'hand-made'} plan. Leave strategy out (or pass the plan's own "
                "strategy) to silence this warning.",
                stacklevel=user_stacklevel(),
            )

    # ----------------------------------------------------------- properties
    @property
    def _models(self):
        """The live models attached to this strategy, in the order they were attached."""
        models = [ref() for ref in self._model_refs]
        return [m for m in models if m is not None]

    @property
    def num_replicas_in_sync(self):
        """Number of replicas a data-parallel step runs on."""
        if self.plan is not None:
            return len(self.plan.devices)
        return len(self.devices)

    @property
    def adapter(self):
        """The backend adapter of the active Keras backend (created lazily)."""
        if self._adapter is None:
            from autodist_keras.backends import get_adapter

            self._adapter = get_adapter(self)
        return self._adapter

    # ---------------------------------------------------------------- scope
    def scope(self):
        """Context in which models are built and compiled for this strategy.

        Every `model.compile(...)` called inside attaches the model to the
        strategy, so its `fit`, `evaluate` and `predict` run the plan; so does
        `keras.models.load_model(...)` of a compiled model (it compiles it).
        A model built inside and compiled after the block attaches to this
        strategy too (as with `tf.distribute` strategies); compiled inside
        another strategy's scope, it attaches to that one (and that strategy
        times its fits). The strategy holds its models weakly: a model the
        user drops is freed.

        Scopes are per thread, as `tf.distribute` scopes are: a model
        compiled in another thread, outside every scope, is plain Keras.

        Raises:
            StrategyError: If entered inside another strategy's scope
                (re-entering this strategy's own scope is fine).
        """
        return _Scope(self)

    @contextlib.contextmanager
    def _entered(self):
        adapter = self.adapter
        with _scope_lock:
            active = _active_strategy()
            if active is not None and active is not self:
                raise StrategyError(
                    "AutoStrategy scopes cannot be nested: this strategy's scope was entered "
                    "inside another strategy's scope, and a model compiled there would be "
                    "planned by one and placed by the other. Leave the outer scope first "
                    "(a model compiled again in another strategy's scope moves to it). "
                    f"Received: scope of {self.name!r} inside the scope of {active.name!r}"
                )
            _install_scope_hooks()
        stack = _thread_scopes()
        stack.append(self)
        try:
            with adapter.variable_scope():
                yield self
        finally:
            stack.pop()
            with _scope_lock:
                _remove_scope_hooks()

    def _attach(self, model):
        if not any(ref() is model for ref in self._model_refs):
            self._model_refs = [r for r in self._model_refs if r() is not None]
            self._model_refs.append(weakref.ref(model))
        # A (re)compile may change what trains (e.g. layers frozen for fine-tuning):
        # the model is planned again at its next fit.
        self._plans.pop(id(model), None)
        self.adapter.attach(model)
        self._time_fit(model)

    def _time_fit(self, model):
        """Wraps `model.fit` to measure step times for `explain()` (measured, not predicted).

        Called at every attach: a model compiled again in another strategy's
        scope is timed for that strategy (the previous wrapper is replaced,
        not wrapped again).
        """
        original_fit = model.fit
        original_fit = getattr(original_fit, "_autodist_untimed", original_fit)
        strategy = self

        def fit(*args, **kwargs):
            from autodist_keras.timing import StepTimer

            active = _active_strategy()
            if active is not None and active is not strategy:
                warnings.warn(
                    f"Model {model.name!r} is fitted inside the scope of another AutoStrategy "
                    "than the one it was compiled in; it trains under the strategy it was "
                    "compiled in (scopes decide where models are compiled, not where they "
                    "fit), and that strategy's explain() describes the fit. To train it "
                    "under the strategy of this scope, call model.compile(...) inside it "
                    f"first. Received: fit inside the scope of AutoStrategy({active.name!r}) "
                    f"(another object), model compiled in AutoStrategy({strategy.name!r})",
                    stacklevel=user_stacklevel(),
                )
            strategy.adapter.before_fit(model)
            if len(args) > 5:  # callbacks passed positionally: leave them alone
                return original_fit(*args, **kwargs)
            timer = StepTimer(warmup=2)
            kwargs["callbacks"] = _with_callbacks(
                kwargs.get("callbacks"), strategy.adapter.callbacks_for_fit, timer)
            strategy.adapter.first_train_batch = None
            strategy.adapter.first_train_shapes = None
            outer_rows = strategy._fit_batch_rows  # (a fit started from a fit's callback)
            strategy._fit_batch_rows = (
                _full_batch_rows(args[0] if args else kwargs.get("x"), kwargs.get("shuffle", True))
                if strategy._needs_plan(model) else None)
            try:
                history = original_fit(*args, **kwargs)
            finally:
                strategy._fit_batch_rows = outer_rows
            known = strategy._known(model)
            if known is not None:
                # explain() describes the model fitted last, beside its measured step.
                _, strategy.graph, strategy.plan = known
            if timer.median_s is not None:
                strategy.measured = {"step_time_s": timer.median_s, "steps": len(timer.times_s),
                                     "batch_size": strategy.adapter.first_train_batch}
                planned = getattr(strategy.plan, _PLANNED_INPUT_SHAPES, None)
                shapes = strategy.adapter.first_train_shapes
                if planned is not None and shapes is not None:
                    # (explain() compares the step with the prediction only for these shapes)
                    strategy.measured["input_shapes"] = [list(s) for s in shapes]
                    strategy.measured["planned_input_shapes"] = [list(s) for s in planned]
                note = strategy.adapter.measurement_note()
                if note:
                    strategy.measured["note"] = note
                strategy._measured_plan = strategy.plan
            elif strategy._measured_plan is not strategy.plan:
                strategy.measured = {}  # another plan's step is no measure of this one
            return history

        fit._autodist_untimed = original_fit
        model.fit = fit

    # ------------------------------------------------------------- planning
    def plan_for(self, model, batch_size, input_shapes=None):
        """Returns the plan to run `model` with global batches of `batch_size`.

        A plan is made once per model and batch size: asked again for the
        same model with another batch size, the strategy plans again (and a
        later `fit` uses that plan). A fixed plan given to the constructor is
        validated and used for every batch size (its shares are scaled to each
        batch). `strategy.plan` is the plan of the model that asked last.

        Args:
            model: The Keras model.
            batch_size: Global batch size, a positive integer.
            input_shapes: Optional per-sample shapes of the model's inputs (in
                the order of `model.inputs`) for the dimensions the model
                leaves unknown, e.g. `[(512,)]` for a text model built on
                `keras.Input((None,))` and trained on sequences of 512
                tokens. Without them such a dimension counts as 1 and the
                predictions come out far too low (a warning says so). `fit`
                passes the first batch's shapes itself.

        Returns:
            A validated `Plan`.

        Example:

        ```python
        strategy = AutoStrategy(cluster="2xV100,2xT4")
        plan = strategy.plan_for(model, 256)
        print(strategy.explain())
        ```
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) \
                or batch_size < 1:
            raise StrategyError(f"batch_size must be a positive integer. Received: {batch_size!r}")
        known = self._known(model)
        if (known is not None and self._fixed_plan is None
                and known[2].global_batch_size != int(batch_size)):
            self._plans.pop(id(model))
        return self._plan_for_training(model, int(batch_size), planning_only=True,
                                       input_shapes=input_shapes)

    def _needs_plan(self, model):
        """Whether `model`'s next training step makes a plan: no plan was given with
        `plan=` and none is kept for it (`_kept`)."""
        return self._fixed_plan is None and self._kept(model) is None

    def _kept(self, model):
        """`(model, graph, plan)` made for this very model while its trainable
        variables are still those it was planned with, else None (a layer frozen or
        unfrozen since makes the plan stale: its buckets list the trainable ones)."""
        known = self._known(model)
        if known is not None and ({v.name for v in known[1].variables}
                                  == {v.path for v in model.trainable_weights}):
            return known
        return None

    def _known(self, model):
        """`(model, graph, plan)` made for this very model, or None (an `id` may be reused
        by a later model once the first is gone)."""
        known = self._plans.get(id(model))
        if known is None or known[0]() is not model:
            return None
        return (model,) + known[1:]

    def _plan_for_training(self, model, batch_size, planning_only=False, input_shapes=None):
        """The runtimes' `plan_for`: the model's plan, made at its first training step
        and kept for later fits, evaluation and prediction whatever their batch size.

        A model whose trainable variables changed since its plan was made (a
        layer frozen or unfrozen between fits without compiling again) is
        planned again: the plan's gradient buckets list the trainable ones.

        `input_shapes` (the first batch's per-sample shapes, or those given
        to `plan_for`) fill the
        dimensions the model leaves unknown, such as a sequence length, for
        the planners' figures (`ModelGraph.from_keras`). A plan given with
        `plan=` is checked against the model's own graph, as the CLI made it."""
        import keras
        from keras.src.models.functional import Functional

        from autodist_keras.graph import ModelGraph

        kept = self._kept(model)
        if kept is not None:
            _, self.graph, self.plan = kept
            return self.plan
        if self._known(model) is not None:
            self._plans.pop(id(model))  # stale
        started = time.perf_counter()
        self.graph = ModelGraph.from_keras(model)
        unknown = self.graph.unknown_dims
        filled = None
        if unknown and input_shapes is not None:
            filled = ModelGraph.from_keras(model, input_shapes=input_shapes)
            if self._fixed_plan is not None:
                # A plan file made for these shapes (by fit or plan_for here) is
                # checked against the filled graph; one the CLI made, against the
                # model's own.
                if self._fixed_plan.provenance.graph_fingerprint == filled.fingerprint():
                    self.graph = filled
                    setattr(self._fixed_plan, _PLANNED_INPUT_SHAPES,
                            [tuple(s) for s in input_shapes])
            elif len(filled.unknown_dims) < len(unknown):
                self.graph = filled
        if unknown and self._fixed_plan is None and self.graph.unknown_dims:
            left = self.graph.unknown_dims
            if input_shapes is None:
                advice = ("Pass the shapes: strategy.plan_for(model, batch_size, "
                          "input_shapes=[...]) (fit passes its first batch's).")
            elif not isinstance(model, (keras.Sequential, Functional)):
                advice = ("They could not be filled from the input shapes given: a "
                          "subclassed model's graph comes from its build shapes. Build it "
                          "with fixed shapes (model.build((None, 512))).")
            elif filled is not None and filled.unknown_dims == unknown:
                why = [w for w in filled.warnings if w.startswith(("input_shapes", "The layers"))]
                advice = ("They could not be filled from the input shapes given"
                          + (f" ({why[0].split('; shapes kept')[0]})" if why else "")
                          + ": give the model's Input a fixed shape (keras.Input((512,))).")
            else:
                advice = (f"Layers {', '.join(left[:3])}{', ...' if len(left) > 3 else ''} "
                          "produce dimensions the input shapes do not fix (a TextVectorization "
                          "without output_sequence_length, say): give them a fixed output "
                          "length.")
            warnings.warn(
                f"Model {model.name!r} leaves some shapes unknown (None: a sequence "
                f"length?) in {len(left)} layer(s) ({', '.join(left[:3])}"
                f"{', ...' if len(left) > 3 else ''}); the plan counts each such "
                "dimension as 1, so its predicted step times are far too low and the "
                f"choice between plans may be wrong. {advice} "
                f"Received: input_shapes={input_shapes!r}",
                stacklevel=user_stacklevel(),
            )
        if self._fixed_plan is not None:
            self.plan = self._fixed_plan
            self._validate_fixed_plan(model)
        else:
            if not planning_only and self._fit_batch_rows:
                # The fit's first batch was a short one that Keras's shuffling put
                # first: plan for its full batches (scaled down, the shares serve
                # the short ones as they would have).
                batch_size = max(batch_size, self._fit_batch_rows)
            self.plan = self._build_plan(self.graph, batch_size)
            self.plan.provenance.planning_time_s = time.perf_counter() - started
            if unknown and len(self.graph.unknown_dims) < len(unknown):
                source = "given with input_shapes=" if planning_only else "the first batch's"
                note = (f"Planned for per-sample input shapes {list(map(tuple, input_shapes))} "
                        f"({source}): the model leaves some dimensions unknown, and "
                        "the predictions hold for batches of these shapes.")
                if note not in self.plan.notes:
                    self.plan.notes = list(self.plan.notes) + [note]
                setattr(self.plan, _PLANNED_INPUT_SHAPES, [tuple(s) for s in input_shapes])
            if not planning_only and self.name != "single_device":
                # (a single_device plan would be the same for any larger batch)
                setattr(self.plan, _PLANNED_FOR_FIRST_BATCH, True)
                if batch_size < len(self.devices) and len(self.plan.devices) < len(self.devices):
                    warnings.warn(
                        f"The plan was made for the first training batch, {batch_size} row(s), "
                        f"fewer than the {len(self.devices)} devices, so it runs on "
                        f"{len(self.plan.devices)} device(s) for the whole fit. If later "
                        "batches are larger, call strategy.plan_for(model, batch_size) with "
                        "their size before fit. "
                        f"Received: first batch of {batch_size} row(s)",
                        stacklevel=user_stacklevel(),
                    )
        self._plans = {k: v for k, v in self._plans.items() if v[0]() is not None}
        self._plans[id(model)] = (weakref.ref(model), self.graph, self.plan)
        return self.plan

    @staticmethod
    def sample_shapes(x, model=None):
        """Per-sample shapes of a batch's inputs, for `_plan_for_training(input_shapes=)`.

        Args:
            x: The inputs of one batch (an array, or a list, tuple or dict of
                arrays, as `fit` takes them).
            model: The model, whose `inputs` order the shapes follow when `x`
                is a dict keyed by input names and the model's inputs are a
                list (Keras matches them by name).

        Returns:
            A list of shapes without the batch axis, in the order of the
            model's `inputs` (`keras.tree.flatten` order), or None when `x`
            holds something without a shape.
        """
        import numpy as np
        from keras import tree

        names = [getattr(t, "name", None) for t in (getattr(model, "inputs", None) or [])]
        if (isinstance(x, dict) and model is not None
                and not isinstance(getattr(model, "_inputs_struct", None), dict)
                and names and all(n in x for n in names)):
            x = [x[n] for n in names]
        try:
            return [tuple(np.shape(t))[1:] for t in tree.flatten(x)]
        except Exception:  # noqa: BLE001  (an input without a shape: plan from the model's)
            return None

    def _validate_fixed_plan(self, model):
        """Checks the plan given with `plan=` against `model`; says so when it was made
        for another model or cluster.

        Errors name where the plan came from (`plan=`, and the file it was read
        from). Notes that the plan was reused from the plan cache (a file saved
        from a cached run carries them) are dropped: no cache was read here.
        """
        import copy

        from autodist_keras.errors import PlanError
        from autodist_keras.strategies.plan import CACHE_NOTE_PREFIX

        if any(n.startswith(CACHE_NOTE_PREFIX) for n in self.plan.notes):
            # (a shallow copy: the caller's Plan object keeps its notes)
            self.plan = self._fixed_plan = copy.copy(self.plan)
            self.plan.notes = [n for n in self.plan.notes if not n.startswith(CACHE_NOTE_PREFIX)]
        given = "The plan given with plan=" + (
            f" ({self.plan.read_from})" if self.plan.read_from else "")
        made_for = self.plan.provenance.graph_fingerprint
        other_model = bool(made_for) and made_for != self.graph.fingerprint()
        renamed, renames = self.plan.renamed_for(self.graph)
        if renamed is not None:
            # The same model, built after another in this process: Keras numbered
            # its unnamed layers differently (or, for another model, the model
            # names in its variable paths).
            renamed.notes = list(renamed.notes) + [
                "plan=: layer (and model) names matched by Keras's per-process numbering: "
                + ", ".join(f"{old} -> {new}" for old, new in list(renames.items())[:6])
                + (" ..." if len(renames) > 6 else "")]
            self.plan = self._fixed_plan = renamed
        trainable = {v.name for v in self.graph.variables}
        frozen = sorted(({n for bucket in self.plan.buckets for n in bucket} | set(self.plan.sync))
                        & ({w.path for w in model.weights} - trainable))
        if frozen:
            # Layers frozen since the plan was made: their variables leave the
            # buckets (the plan given is kept whole for when they train again).
            self.plan = self.plan.without_variables(frozen)
            self.plan.notes = list(self.plan.notes) + [
                f"plan=: {len(frozen)} variable(s) that no longer train (frozen layers) left "
                "out of its gradient buckets and sync: " + ", ".join(frozen[:4])
                + (" ..." if len(frozen) > 4 else "")]
        try:
            notes = self.plan.validate(self.graph, self.cluster)
        except PlanError as e:
            if not other_model:
                hint = ""
                if not made_for and not self.plan.provenance.layer_order and "unknown" in str(e):
                    # A plan written in code for another build of the model: Keras
                    # numbered its unnamed nodes (some cannot be named) differently.
                    hint = (
                        " The plan records no graph (provenance.graph_fingerprint and "
                        "layer_order), so its names could not be matched to this model's: "
                        "Keras numbers unnamed layers and keras.ops nodes per process and per "
                        "model built (an Embedding(mask_zero=True) adds a 'not_equal_N' node "
                        "that cannot be named). Write the plan from the graph of the model it "
                        "runs, or record the graph it was written from: "
                        "plan.provenance.graph_fingerprint = graph.fingerprint() and "
                        "plan.provenance.layer_order = list(graph.nodes), and names are then "
                        "matched by their place in the graph."
                    )
                raise PlanError(f"{given}: {e}{hint}") from None
            raise PlanError(
                f"{given} was made for another model (graph {made_for[:12]}, "
                f"model {model.name!r} is {self.graph.fingerprint()[:12]}), and it does not fit "
                f"this one: {e} Plans name layers, and Keras numbers unnamed layers per "
                "process (dense_3 in one script can be dense in another): name the layers, or "
                "leave plan= out to plan this model."
            ) from None
        for note in notes:
            warnings.warn(f"plan=: {note} The plan still runs as given; its prediction is "
                          "the simulator's for this model and cluster.", stacklevel=user_stacklevel())
        recorded = self.plan.prediction
        if not self.plan.prediction_matches():
            # Edited after its prediction was written: the recorded figures describe
            # another plan.
            why = (f"plan=: the plan was changed after its prediction was written "
                   f"({recorded.step_time_s * 1e3:.3f} ms, {recorded.source}); the prediction "
                   "shown is the simulator's for the plan as given")
        elif recorded is None:
            # A plan made in code (or with frozen layers left out): predict it here,
            # so that explain() has a figure to put beside the measured step.
            why = "plan=: predicted by the simulator for the plan as given"
        elif notes:
            # Made for another model or cluster: its figures (memory included) describe
            # those; until session 26 a plan that does not fit here was not noticed.
            why = (f"plan=: the recorded prediction ({recorded.step_time_s * 1e3:.3f} ms, "
                   f"{recorded.source}) described the model or cluster the plan was made for; "
                   "the prediction shown is the simulator's for this model and cluster")
        else:
            why = None
        from autodist_keras.estimator import simulate

        simulated = simulate(self.graph, self.cluster, self.plan).to_prediction()
        memory_only = False
        if why is None and (simulated.feasible != recorded.feasible
                            or simulated.peak_memory_bytes != recorded.peak_memory_bytes):
            # The same model and cluster, but the recorded memory figures were made
            # for another optimizer (the graph fingerprint leaves it out) or by an
            # earlier memory model. Memory is always the simulator's: its figures for
            # this model replace them; the recorded times stay.
            memory_only = True
            why = ("plan=: the recorded memory figures were made for another optimizer or by "
                   "an earlier memory model; the memory shown is the simulator's for this "
                   "model, its optimizer and this cluster (the step time is as recorded)")
        if why is not None:
            # On a copy: the caller's Plan object keeps what it had.
            if self.plan is self._fixed_plan:
                self.plan = copy.deepcopy(self.plan)
            if memory_only:
                prediction = self.plan.prediction
                prediction.feasible = simulated.feasible
                prediction.infeasible_reason = simulated.infeasible_reason
                prediction.peak_memory_bytes = dict(simulated.peak_memory_bytes)
                for name, figures in prediction.per_device.items():
                    if name in simulated.per_device:
                        figures["peak_memory_bytes"] = (
                            simulated.per_device[name]["peak_memory_bytes"])
            else:
                self.plan.prediction = simulated
            self.plan.notes = list(self.plan.notes) + [why]
        if simulated.feasible is False and self.adapter.cluster_is_here():
            # What a forced strategy refuses (see _build_plan): on GPUs the runtime
            # would start and run out of memory.
            raise StrategyError(
                f"{given} is predicted not to fit in memory here: "
                f"{simulated.infeasible_reason}. Plan for these devices instead (leave plan= "
                f"out: {_placement_advice(self.adapter.name)}), or use a smaller batch size "
                "or devices with more memory. "
                f"Received: a plan for a global batch of {self.plan.global_batch_size} on "
                f"{len(self.plan.devices)} device(s)"
            )

    def _build_plan(self, graph, batch_size):
        from autodist_keras.strategies import selection

        opts = {k: v for k, v in self.options.items() if k not in RUNTIME_ONLY_OPTIONS}
        estimator = self.options.get("estimator", "learned")
        # op_fusion="on" / "off" also decides whether Disco searches fusion regions.
        fusion = ({"op_fusion": self.options["op_fusion"]}
                  if self.options.get("op_fusion") in ("on", "off") else {})
        # On the machine the cluster describes, only plans this backend can run here
        # count; for a cluster that is not here (planning only, as the CLI does) all do.
        here = self.adapter.cluster_is_here()
        executable = getattr(self.adapter, "can_execute", None) if here else None
        if self.name == "auto":
            plan, self.candidates = selection.choose_plan(
                graph, self.cluster, batch_size, devices=self.devices,
                options=dict(opts, backend=self.adapter.name, **fusion),
                show_progress=True, executable=executable, estimator=estimator,
            )
            return _noted_if_not_here(plan, here)
        families = [self.name] if self.name in FAMILY_NAMES else []
        sync_opts = {k: opts[k] for k in ("algorithm", "bucket_bytes", "step_costs") if k in opts}
        scorer = selection.resolve_scorer(estimator, self.adapter.name)
        self.candidates = selection.build_candidates(
            graph, self.cluster, batch_size, devices=self.devices, families=families,
            options=dict(sync_opts, backend=self.adapter.name, **fusion), executable=executable,
            scorer=scorer,
        )
        wanted = BASELINE_FOR_NAME.get(self.name, self.name)
        shaping = {k: v for k, v in opts.items() if k not in sync_opts}
        if self.name in BASELINE_FOR_NAME and shaping:
            # Options such as sync="ps", ps_server, speeds or buckets shape the plan itself:
            # it is none of the candidates (built without them), but it is scored as they
            # were, so that its figure and theirs are on one scale.
            from autodist_keras.strategies import baselines

            from autodist_keras.errors import PlanError

            builder = baselines.BASELINES[BASELINE_FOR_NAME[self.name]]
            try:
                if self.name == "single_device":
                    plan = builder(graph, self.cluster, batch_size, devices=self.devices)
                else:
                    plan = builder(graph, self.cluster, batch_size, devices=self.devices, **opts)
            except PlanError as e:  # as the other strategies say it
                raise _not_made_error(self.name, str(e).rstrip(".")) from None
            forced = selection.score_plan(graph, self.cluster, plan, scorer, self.candidates,
                                          name=wanted)
            # explain() names these options beside the plan, and says that the
            # candidates were built without them.
            plan.provenance.options = dict(plan.provenance.options, shaped_by=dict(shaping))
            digest = plan.structure_digest()
            same = [c.name for c in self.candidates
                    if c.plan is not None and c.plan.structure_digest() == digest]
            if same:  # (sync="ps" gives the search's own data_parallel_even_ps, say)
                plan.provenance.options["same_as"] = same[0]
            if executable is not None:
                forced.executable, why = executable(plan)
                if not forced.executable:
                    forced.reason = why
            chosen = [forced]
            selection.note_scoring(plan, scorer, self.candidates, scorer_why=forced.scorer_why)
        else:
            chosen = [c for c in self.candidates if c.name == wanted]
            if not chosen or chosen[0].plan is None:
                raise not_made_error(self.name, self.candidates,
                                     list(self.devices or self.cluster.names))
            plan = chosen[0].plan
            # Which predictor gave its time, and any machine-speed scaling (as auto says).
            selection.note_scoring(plan, scorer, self.candidates)
        if chosen[0].executable is False and here:
            raise StrategyError(
                f"The {self.name!r} plan cannot run here on the {self.adapter.name} "
                f"backend: {chosen[0].reason}. Use strategy='auto' to pick a plan that "
                f"runs, or plan with the CLI. Received: strategy={self.name!r}"
            )
        prediction = plan.prediction
        if here and prediction is not None and prediction.feasible is False:
            # The runtime would start and run out of memory (on GPUs); auto refuses
            # such plans too ("No plan fits").
            placement = _placement_advice(self.adapter.name)
            raise StrategyError(
                f"The {self.name!r} plan is predicted not to fit in memory: "
                f"{prediction.infeasible_reason}. Use {placement}, a smaller batch size, or "
                "devices with more memory. "
                f"Received: strategy={self.name!r}, batch_size={batch_size}"
            )
        plan.provenance.backend = self.adapter.name
        selection.record_candidates(plan, self.candidates)
        return _noted_if_not_here(plan, here)

    # -------------------------------------------------------------- explain
    def explain(self, format="text"):
        """Describes the plan in force, why it was chosen, and what the alternatives cost.

        Every figure from the simulator is labelled predicted; after `fit`,
        the measured median step time appears beside the predicted one, as
        long as the plan shown is the one it was measured with (not after
        `plan_for` made another model's plan, or another batch size's).

        Args:
            format: `"text"` (rich tables in a terminal, plain text otherwise)
                or `"json"` (a dict).

        Returns:
            A string (text) or a dict (json).
        """
        from autodist_keras.strategies.explain import explanation
        from autodist_keras.strategies.explain import render_text

        if format not in ("text", "json"):
            raise StrategyError(f"format must be 'text' or 'json'. Received: {format!r}")
        if self.plan is None:
            message = (
                "No plan yet: the plan is made at the first training step of a model "
                "compiled inside strategy.scope()."
            )
            return {"plan": None, "message": message} if format == "json" else message
        # A step measured with another plan (another model's, or this model's for
        # another batch size, made since by plan_for) is no measure of this one.
        measured = self.measured if self._measured_plan is self.plan else {}
        data = explanation(self.plan, self.cluster, measured=measured, strategy_name=self.name,
                           fixed=self._fixed_plan is not None)
        # A plan made by plan_for for a model compiled outside this strategy's scope: a
        # what-if, which its fit does not run (the model's name, else None).
        data["unattached_model"] = next(
            (ref().name for ref, _, plan in self._plans.values()
             if plan is self.plan and ref() is not None
             and not any(r() is ref() for r in self._model_refs)), None)
        if format == "json":
            data["plan"] = self.plan.to_dict()
            return data
        return render_text(data)

    def _simulation(self):
        from autodist_keras.estimator import simulate

        if self.plan is None or self.graph is None:
            raise StrategyError(
                "No plan yet: call model.fit (or strategy.plan_for(model, batch_size)) first."
            )
        return simulate(self.graph, self.cluster, self.plan)

    def export_trace(self, path):
        """Writes the simulated timeline of the plan as a Chrome trace (predicted).

        Args:
            path: JSON file to write; open it in Perfetto or chrome://tracing.
                Missing directories are made.

        Returns:
            The path.

        Raises:
            OutputError: If the path is a directory or cannot be written.
        """
        simulation = self._simulation()
        prediction = self.plan.prediction
        other = None
        if prediction is not None and prediction.step_time_s != simulation.step_time_s:
            # The timeline is the simulator's; say what explain() shows as the step.
            other = {"plan_predicted_step_time_s": prediction.step_time_s,
                     "plan_prediction_source": prediction.source}
        return simulation.export_trace(path, other)

    def plot(self, path):
        """Draws the simulated timeline of the plan as a Gantt chart (PNG, predicted).

        Args:
            path: Image file to write: PNG, or another format matplotlib
                writes, by its extension (`.svg`, `.pdf`, ...); without an
                extension `.png` is added. Missing directories are made.

        Returns:
            The path written.

        Raises:
            OutputError: If the path is a directory, cannot be written, or
                names a format matplotlib does not write.
        """
        from autodist_keras.strategies.explain import short_scorer
        from autodist_keras.strategies.gantt import plot_timeline

        simulation = self._simulation()  # says "No plan yet" before any plan
        name = self.plan.provenance.candidate  # the name explain() gives the plan
        title = f"{name} plan: simulated step (predicted)"
        prediction = self.plan.prediction
        if prediction is not None and not prediction.source.startswith("simulator ("):
            # The headline figure is rescaled or learned; the timeline is the simulator's.
            title = (f"{name} plan, predicted {prediction.step_time_s * 1e3:.2f}"
                     f" ms ({short_scorer(prediction.source)}); the simulator's timeline")
        return plot_timeline(simulation, path, title=title)


NOT_HERE_NOTE = ("planned for a cluster whose devices are not on this machine: every candidate "
                 "was considered, as by `autodist-keras plan`; fit here would refuse to run it")


def _full_batch_rows(x, shuffle):
    """Rows of a full batch of `fit`'s input when Keras may hand it over a short batch first.

    Keras shuffles the order of a `keras.utils.PyDataset`'s batches when `fit`
    is given `shuffle=True` (its default), so the first training batch, which
    the plan is made for, may be the short last one: a plan for one row
    failed ("batch_size 1 is smaller than the number of devices") and `"auto"`
    ran the whole fit on fewer devices, depending on the random order (until
    session 29). This reads the dataset's batch 0 (`x[0]`, which Keras itself
    reads before training on the TensorFlow backend) before Keras starts, with
    Python's and NumPy's global random states put back afterwards, so a
    dataset drawing from those in `__getitem__` draws what it would have in
    plain Keras. The read is one call more than plain Keras makes: a dataset
    with its own generator, or other side effects of `__getitem__`, sees it
    (docs/runtime_tensorflow.md, "Hooking into Keras").

    Args:
        x: `fit`'s `x` argument.
        shuffle: `fit`'s `shuffle` argument.

    Returns:
        The number of rows of batch 0, or None when `x` is not a shuffled
        `PyDataset` of two or more batches, or batch 0 cannot be read (Keras
        then reports the error itself).

    Example:

    ```python
    rows = _full_batch_rows(my_py_dataset, shuffle=True)   # e.g. 32
    ```
    """
    import random

    import keras
    import numpy as np

    if not shuffle or not isinstance(x, keras.utils.PyDataset):
        return None
    try:
        if (x.num_batches or 0) < 2:
            return None  # one batch, or infinite: Keras does not shuffle those
        python_state, numpy_state = random.getstate(), np.random.get_state()
        try:
            batch = x[0]
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)
    except Exception:  # noqa: BLE001 - Keras reads the batch again and reports it
        return None
    for leaf in keras.tree.flatten(batch):
        shape = getattr(leaf, "shape", None)
        if shape is not None and len(shape) > 0 and shape[0] is not None:
            return int(shape[0])
    return None


def _with_callbacks(given, adapt, timer):
    """The `callbacks` argument of `fit` with the adapter's changes and `timer` added
    (until session 23 a single callback or a `CallbackList` raised a TypeError).

    Keras takes a list, a single callback or a `CallbackList`; so does this,
    and a `CallbackList` stays one: a new one with the caller's model and
    params (Keras sets neither on a list it is given) and its own choice of
    running callbacks on a thread (the timer must run on the main thread).
    The caller's is not changed.
    """
    import keras

    if isinstance(given, keras.callbacks.CallbackList):
        return keras.callbacks.CallbackList(
            adapt(list(given.callbacks)) + [timer], model=getattr(given, "_model", None),
            **(getattr(given, "params", None) or {}))
    if isinstance(given, keras.callbacks.Callback):
        given = [given]
    return adapt(list(given or [])) + [timer]


def _placement_advice(backend):
    """What to use when a whole replica does not fit, on `backend`."""
    advice = ("strategy='auto' or 'fastt', which place layers on several devices when a "
              "whole replica does not fit")
    if backend == "torch":
        advice = ("KERAS_BACKEND=tensorflow with " + advice + " (the PyTorch runtime runs "
                  "data parallelism only)")
    return advice


def _check_devices(devices):
    """Raises `StrategyError` unless `devices=` is a non-empty list (or tuple) of
    distinct device names (whether the cluster has them is checked after)."""
    if (not isinstance(devices, (list, tuple)) or not devices
            or not all(isinstance(d, str) for d in devices)):
        raise StrategyError(
            "devices must be a non-empty list of device names of the cluster, e.g. "
            "devices=['node0/cpu0', 'node0/cpu1'] (a single device is a list of one), or "
            f"None for all of its devices. Received: devices={devices!r}"
        )
    repeated = sorted({d for d in devices if devices.count(d) > 1})
    if repeated:
        raise StrategyError(
            f"devices names {repeated} more than once; each device runs one replica, so "
            f"name each device once. Received: devices={list(devices)!r}"
        )


def _not_made_error(name, reason):
    """The `StrategyError` of a forced strategy whose plan could not be made."""
    message = (f"The {name!r} plan could not be made for this model and "
               f"cluster: {reason}. Try strategy='auto'.")
    if "Received:" not in reason:  # the reason usually names what it received
        message += f" Received: strategy={name!r}"
    return StrategyError(message)


def not_made_error(name, candidates, device_names):
    """The `StrategyError` of a forced strategy whose candidate was not built.

    Args:
        name: The strategy name asked for (`"data_parallel"`, `"fastt"`, ...).
        candidates: The search's `Candidate` list.
        device_names: The devices planned for.

    Returns:
        A `StrategyError` giving the candidate's reason, or why none was built.
    """
    wanted = BASELINE_FOR_NAME.get(name, name)
    chosen = [c for c in candidates if c.name == wanted]
    if chosen and chosen[0].reason:
        reason = str(chosen[0].reason).rstrip(".")
    elif len(device_names) < 2:
        reason = (f"the cluster has one device ({device_names[0]}), and a {name} plan "
                  "needs two or more. On a machine without GPUs, "
                  "cluster=Cluster.cpu_testbed() gives several CPU devices")
    else:
        reason = f"no {wanted} candidate was built for {len(device_names)} devices"
    return _not_made_error(name, reason)


def _noted_if_not_here(plan, here):
    """Adds `NOT_HERE_NOTE` to a plan made for a cluster that is not on this machine."""
    if not here and NOT_HERE_NOTE not in plan.notes:
        plan.notes = list(plan.notes) + [NOT_HERE_NOTE]
    return plan
