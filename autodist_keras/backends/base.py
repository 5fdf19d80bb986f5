"""The interface every backend adapter implements."""

import contextlib


class BackendAdapter:
    """Realises a `Plan` inside `model.fit`, `evaluate` and `predict`.

    Args:
        strategy: The `AutoStrategy` this adapter serves. The adapter calls
            `strategy._plan_for_training(model, batch_size)` at the first training step
            to get the plan, and `strategy.cluster` for the devices.
    """

    name = "base"

    def __init__(self, strategy):
        self.strategy = strategy
        # Rows of the current fit's first training batch (the runtimes set it; the
        # strategy clears it before each fit): the batch its measured steps ran.
        self.first_train_batch = None
        # Per-sample input shapes of that batch (`AutoStrategy.sample_shapes`).
        self.first_train_shapes = None

    def variable_scope(self):
        """Context in which the model's variables are created (default: none)."""
        return contextlib.nullcontext()

    def attach(self, model):
        """Installs the plan-running train/test/predict functions on `model`."""
        raise NotImplementedError

    def callbacks_for_fit(self, callbacks):
        """The callbacks this process runs in `fit` (default: the user's, unchanged)."""
        return callbacks

    def before_fit(self, model):
        """Called as `model.fit` is called, before Keras builds anything (default: nothing)."""

    def measurement_note(self):
        """What a reader of the measured step time should know, or None.

        `explain()` prints it beside the measured step time, e.g. when the
        run could not reproduce what the prediction models.
        """
        return None

    def cluster_is_here(self):
        """Whether the strategy's devices exist on this machine (default True).

        When they do not (e.g. a catalog GPU cluster on a CPU-only machine),
        the strategy plans without asking which plans could run here, as the
        CLI does, and `fit` refuses to run.
        """
        return True
