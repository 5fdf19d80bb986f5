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
import threading
import time

from autodist_keras.errors import StrategyError
from autodist_keras.strategies.plan import Plan

STRATEGY_NAMES = ("auto", "single_device", "data_parallel", "proportional", "fastt", "heterog", "disco")
NOT_YET = ("fastt", "heterog", "disco")
OPTION_NAMES = (
    "sync",  # "allreduce" or "ps"
    "ps_server",  # device name for PS sync
    "algorithm",  # all-reduce algorithm
    "bucket_bytes",  # gradient bucket threshold in bytes
    "buckets",  # explicit bucket layout
    "speeds",  # measured relative device speeds for the proportional plan
    "timeout_s",  # how long the runtime waits for a worker before failing
)

_scope_lock = threading.Lock()


class AutoStrategy:
    """Distributes `model.fit` of an unchanged Keras program according to a plan.

    Args:
        strategy: Plan family: `"auto"` (default), `"single_device"`,
            `"data_parallel"` (even shares), `"proportional"` (shares by
            device speed), or the planner families `"fastt"`, `"heterog"`,
            `"disco"`.
        cluster: The devices: `None` (detect the local ones), a `Cluster`,
            a path to a YAML resource spec, or a string such as
            `"2xV100,4x1080Ti"`.
        devices: Optional subset of device names to use.
        plan: A ready `Plan` (or a path to its JSON) to run instead of planning.
        **options: Planner and runtime options: `sync` (`"allreduce"` or
            `"ps"`), `ps_server`, `algorithm`, `bucket_bytes`, `buckets`,
            `speeds`, `timeout_s`.

    Example:

    ```python
    strategy = AutoStrategy(strategy="proportional", cluster=Cluster.cpu_testbed())
    with strategy.scope():
        model = keras.Sequential([...])
        model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=64)
    ```
    """

    def __init__(self, strategy="auto", cluster=None, devices=None, plan=None, **options):
        if strategy not in STRATEGY_NAMES:
            raise StrategyError(
                f"Unknown strategy {strategy!r}. Valid names: {', '.join(STRATEGY_NAMES)}. "
                f"Received: strategy={strategy!r}"
            )
        if strategy in NOT_YET:
            raise StrategyError(
                f"The {strategy!r} planner is not available yet in this version of "
                "autodist_keras. Use strategy='auto', 'proportional', 'data_parallel' or "
                f"'single_device'. Received: strategy={strategy!r}"
            )
        unknown = sorted(set(options) - set(OPTION_NAMES))
        if unknown:
            raise StrategyError(
                f"Unknown option(s) {unknown}. Valid options: {', '.join(OPTION_NAMES)}. "
                f"Received: {unknown}"
            )
        from autodist_keras.devices import Cluster

        self.name = strategy
        self.cluster = Cluster.resolve(cluster)
        if devices is not None:
            devices = list(devices)
            for name in devices:
                if name not in self.cluster.names:
                    raise StrategyError(
                        f"Unknown device {name!r}; the cluster has {self.cluster.names}. "
                        f"Received: devices={devices}"
                    )
        self.devices = devices or list(self.cluster.names)
        if plan is not None and not isinstance(plan, Plan):
            plan = Plan.from_json(plan)
        self._fixed_plan = plan
        self.options = dict(options)
        self.plan = plan
        self.graph = None
        self.measured = {}
        self._adapter = None
        self._models = []

    # ----------------------------------------------------------- properties
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
    @contextlib.contextmanager
    def scope(self):
        """Context in which models are built and compiled for this strategy.

        Every `model.compile(...)` called inside attaches the model to the
        strategy, so its `fit`, `evaluate` and `predict` run the plan.
        """
        import keras

        adapter = self.adapter
        with _scope_lock:
            original_compile = keras.Model.compile
            strategy = self

            def compile(model, *args, **kwargs):
                with adapter.variable_scope():
                    result = original_compile(model, *args, **kwargs)
                strategy._attach(model)
                return result

            keras.Model.compile = compile
        try:
            with adapter.variable_scope():
                yield self
        finally:
            with _scope_lock:
                keras.Model.compile = original_compile

    def _attach(self, model):
        if model not in self._models:
            self._models.append(model)
        self.adapter.attach(model)

    # ------------------------------------------------------------- planning
    def plan_for(self, model, batch_size):
        """Returns the plan to run `model` with global batches of `batch_size`.

        The plan is made once per strategy (at the first training step) and
        reused; a fixed plan given to the constructor is validated and used.

        Args:
            model: The Keras model.
            batch_size: Global batch size of the first training batch.

        Returns:
            A validated `Plan`.
        """
        from autodist_keras.graph import ModelGraph

        if self.plan is not None and self.graph is not None:
            return self.plan
        started = time.perf_counter()
        self.graph = ModelGraph.from_keras(model)
        if self._fixed_plan is not None:
            self.plan = self._fixed_plan
            self.plan.validate(self.graph, self.cluster)
            return self.plan
        self.plan = self._build_plan(self.graph, batch_size)
        self.plan.provenance.planning_time_s = time.perf_counter() - started
        return self.plan

    def _build_plan(self, graph, batch_size):
        from autodist_keras.strategies import baselines

        opts = {k: v for k, v in self.options.items() if k != "timeout_s"}
        name = self.name
        if name == "single_device":
            return baselines.single_device(
                graph, self.cluster, batch_size,
                device=self.devices[0] if len(self.devices) == 1 else None,
                bucket_bytes=opts.get("bucket_bytes", baselines.DDP_BUCKET_BYTES),
            )
        if name == "data_parallel":
            opts.pop("speeds", None)
            return baselines.data_parallel_even(
                graph, self.cluster, batch_size, devices=self.devices, **opts
            )
        # "auto" uses the proportional baseline until the planners land.
        return baselines.proportional(graph, self.cluster, batch_size, devices=self.devices, **opts)

    # -------------------------------------------------------------- explain
    def explain(self, format="text"):
        """Describes the plan in force and what it is predicted to cost.

        Args:
            format: `"text"` for a readable summary or `"json"` for a dict.

        Returns:
            A string (text) or a dict (json).
        """
        if format not in ("text", "json"):
            raise StrategyError(f"format must be 'text' or 'json'. Received: {format!r}")
        if self.plan is None:
            message = (
                "No plan yet: the plan is made at the first training step of a model "
                "compiled inside strategy.scope()."
            )
            return {"plan": None, "message": message} if format == "json" else message
        if format == "json":
            return {
                "strategy": self.name,
                "plan": self.plan.to_dict(),
                "measured": dict(self.measured),
            }
        lines = [f"AutoStrategy({self.name!r}) on {len(self.cluster)} device(s)", self.plan.summary()]
        for key, value in self.measured.items():
            lines.append(f"  measured {key}: {value}")
        return "\n".join(lines)
