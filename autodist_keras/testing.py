"""Failure drills: a layer that makes one worker of a distributed `fit` fail or hang.

Use it to see what your program does when a worker goes wrong: `fit` raises
`WorkerError` naming the rank within seconds when the worker raises, and after
`timeout_s` when it hangs, and no worker process is left running
(docs/runtime_torch.md, "Failures"). It acts only in the PyTorch runtime's
spawned workers; in rank 0 (your process) and everywhere else it is the
identity. The package's tests and `benchmarks/gpu_check.py` use it.

Example:

```python
from autodist_keras.testing import FailOnWorker

x = keras.layers.Dense(64)(inputs)
x = FailOnWorker(rank=1, after=2)(x)   # rank 1 raises in its third training step
```
"""

import os
import time

import keras

from autodist_keras.errors import BackendError

WORKER_RANK_ENV = "AUTODIST_KERAS_WORKER_RANK"  # set in each spawned worker
MODES = ("raise", "hang")


@keras.saving.register_keras_serializable(package="autodist_keras")
class FailOnWorker(keras.layers.Layer):
    """Identity layer that raises (or blocks) in the worker of rank `rank`.

    Args:
        rank: The worker rank that fails (1 or more; rank 0 never does).
        after: Training calls that pass before the failure.
        mode: `"raise"` (a `ValueError`) or `"hang"` (sleeps `hang_s`).
        hang_s: How long a hanging worker sleeps.
    """

    def __init__(self, rank=1, after=2, mode="raise", hang_s=3600.0, **kwargs):
        super().__init__(**kwargs)
        if mode not in MODES:
            raise BackendError(f"mode must be one of {MODES}. Received: mode={mode!r}")
        self.rank = int(rank)
        self.after = int(after)
        self.mode = mode
        self.hang_s = float(hang_s)
        self.calls = 0

    def call(self, inputs, training=None):
        if training and os.environ.get(WORKER_RANK_ENV) == str(self.rank):
            self.calls += 1
            if self.calls > self.after:
                if self.mode == "hang":
                    time.sleep(self.hang_s)
                else:
                    raise ValueError(f"injected failure in rank {self.rank}")
        return inputs

    def get_config(self):
        return dict(super().get_config(), rank=self.rank, after=self.after, mode=self.mode,
                    hang_s=self.hang_s)
