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


class StepTimer(keras.callbacks.Callback):
    """Records the wall time of every training batch (measured, not predicted).

    In distributed fit the user's process waits for the step's gradient
    synchronisation, so the time of a batch is the time of the whole
    distributed step. It also records this process's CPU time per batch
    (`cpu_times_s`, all threads): on a machine shared with other jobs, CPU time
    shows the work a step costs even when wall time is inflated by waiting
    for a core.

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

    def on_train_batch_begin(self, batch, logs=None):
        self._cpu_start = time.process_time()
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        if self._start is not None:
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
