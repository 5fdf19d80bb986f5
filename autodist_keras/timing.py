"""Measuring training step times from inside `model.fit`.

Example:

```python
timer = StepTimer(warmup=3)
model.fit(x, y, batch_size=64, epochs=2, callbacks=[timer])
print(timer.median_s, len(timer.times_s))
```
"""

import statistics
import time

import keras


def _no_sync():
    return None


def accelerator_sync():
    """A function that waits for the active backend's queued GPU work.

    Returns:
        `torch.cuda.synchronize` on the PyTorch backend once CUDA is in use,
        TensorFlow's `sync_devices` when TensorFlow sees a GPU, else a
        function that returns at once (CPU work is synchronous).
    """
    backend = keras.backend.backend()
    if backend == "torch":
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return torch.cuda.synchronize
    elif backend == "tensorflow":
        import tensorflow as tf

        sync = getattr(getattr(tf.test, "experimental", None), "sync_devices", None)
        if sync is not None and tf.config.list_logical_devices("GPU"):
            return sync
    return _no_sync


class StepTimer(keras.callbacks.Callback):
    """Records the wall time of every training batch (measured, not predicted).

    In distributed fit the user's process waits for the step's gradient
    synchronisation, so the time of a batch is the time of the whole
    distributed step. It also records this process's CPU time per batch
    (`cpu_times_s`, all threads): on a machine shared with other jobs, CPU time
    shows the work a step costs even when wall time is inflated by waiting
    for a core.

    On a GPU the timer waits for the device's queued work at both ends of a
    batch (`torch.cuda.synchronize`, or TensorFlow's `sync_devices`), so a
    step's time includes its kernels, not only their launch.

    Args:
        warmup: Number of first batches to leave out of `times_s` (compilation,
            worker start-up).
    """

    def __init__(self, warmup=3):
        super().__init__()
        self.warmup = int(warmup)
        self.all_times_s = []
        self.all_cpu_times_s = []
        self._start = None
        self._cpu_start = None
        self._sync = None

    def _wait_for_device(self):
        if self._sync is None:
            self._sync = accelerator_sync()
        self._sync()

    def on_train_batch_begin(self, batch, logs=None):
        self._wait_for_device()
        self._cpu_start = time.process_time()
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        if self._start is not None:
            self._wait_for_device()
            self.all_times_s.append(time.perf_counter() - self._start)
            self.all_cpu_times_s.append(time.process_time() - self._cpu_start)
            self._start = None

    @property
    def times_s(self):
        """Step times after warm-up, in seconds."""
        return self.all_times_s[self.warmup:]

    @property
    def cpu_times_s(self):
        """This process's CPU time per step after warm-up, in seconds."""
        return self.all_cpu_times_s[self.warmup:]

    @property
    def median_s(self):
        """Median step time after warm-up, in seconds (None before any step)."""
        times = self.times_s
        return statistics.median(times) if times else None
