"""Exception types raised by autodist_keras.

Every error a user can cause derives from `AutodistError`, so a program can
catch them all at once. Messages name what was wrong, where, and how to fix it,
and quote the offending value as `Received: ...`.
"""


def received_repr(value, limit=200):
    """`repr(value)` cut to `limit` characters (then "..."), for a message's `Received:`.

    Args:
        value: The offending value.
        limit: The most characters of its repr to show.

    Returns:
        A string.
    """
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


class AutodistError(Exception):
    """Base class of every error autodist_keras raises on purpose."""


class ClusterSpecError(AutodistError, ValueError):
    """A cluster description (YAML file, string, dict or detection) is invalid.

    Args:
        message: What was wrong and how to fix it.
        source: The file or string the spec came from, if any.
        field: The dotted path of the offending field, e.g. `nodes[1].gpus[0].type`.
        value: The offending value.
    """

    def __init__(self, message, source=None, field=None, value=None):
        self.source = source
        self.field = field
        self.value = value
        parts = []
        if source is not None:
            parts.append(f"In {source}")
        if field is not None:
            parts.append(f"field `{field}`")
        prefix = ", ".join(parts)
        text = f"{prefix}: {message}" if prefix else message
        if value is not None and "Received:" not in message:
            text += f" Received: {value!r}"
        super().__init__(text)


class GraphError(AutodistError, ValueError):
    """A Keras model cannot be turned into a `ModelGraph`."""


class PlanError(AutodistError, ValueError):
    """A Plan is malformed or does not fit the graph and cluster it is used with."""


class EstimatorError(AutodistError, RuntimeError):
    """The profiler, cost model or simulator cannot produce an estimate."""


class StrategyError(AutodistError, ValueError):
    """An AutoStrategy option, strategy name or planner request is invalid."""


class BackendError(AutodistError, RuntimeError):
    """A backend adapter cannot run a plan (unsupported feature, bad input)."""


class WorkerError(BackendError):
    """A worker process died or raised during distributed training.

    Args:
        rank: The rank of the failing worker.
        message: The worker's error (type, message and traceback excerpt).
    """

    def __init__(self, rank, message):
        self.rank = rank
        super().__init__(f"Worker rank {rank} failed: {message}")


class OutputError(AutodistError, OSError):
    """A file autodist_keras was asked to write (plan, trace, chart) cannot be written.

    Nothing is left at the path: files are written to a temporary file and
    renamed into place only when complete.
    """
