"""One data-parallel training step of one replica (shared by every rank).

Each replica runs Keras's own loss on its shard and scales it by
`share / global_batch`. Keras's default loss reduction divides by the number of
loss elements of the shard, so the scaled losses add up to the loss of the
whole batch, and the summed gradients to the single-device gradient.
Regularisation losses (`model.losses`) ride on the same scaling, so they count
once in the sum. The reducer sums the gradients across ranks while backward
runs; every rank then applies the identical sum with its own copy of the same
optimizer, so the replicas stay bit-identical.

Example:

```python
trainer = ReplicaTrainer(model, comm, plan, rank_nodes, device_ranks)
trainer.attach()
y_pred, loss = trainer.step(x, y, sample_weight, share=16, global_batch=48)
```
"""

import json
import os
import time

from autodist_keras.backends import batchnorm_stats
from autodist_keras.backends import model_checks
from autodist_keras.backends.loss_trackers import TorchTrackerDeltas
from autodist_keras.backends.torch_reducer import GradientReducer
from autodist_keras.backends.torch_reducer import StateSync
from autodist_keras.errors import BackendError
from autodist_keras.stacklevel import user_stacklevel

PROFILE_ENV = "AUTODIST_KERAS_TORCH_PROFILE"


def placement_facts():
    """Where this process runs: its CPU affinity and PyTorch thread counts, and
    the cores each of its threads may use (by thread name, e.g. gloo's)."""
    import torch

    threads = {}
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            cores = sorted(os.sched_getaffinity(int(tid)))
            threads.setdefault(name, []).append(cores)
    except OSError:
        pass
    return {
        "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "thread_affinities": threads,
    }


class StepProfile:
    """Optional per-step phase timings of one rank (for diagnosing step time).

    Enabled when the environment variable `AUTODIST_KERAS_TORCH_PROFILE` names
    a directory (set it before `fit`; workers inherit it). Each rank then
    records, per step, the wall time since the step began at each phase
    boundary (`mark(name)` stores `name`) and the process's CPU time (all its
    threads, gloo's included) up to it (`cpu_<name>`), and `save()` writes
    `rank<r>.json` into the directory. Disabled, `mark` is a no-op.

    Args:
        rank: This process's rank.
    """

    def __init__(self, rank):
        self.rank = int(rank)
        self.directory = os.environ.get(PROFILE_ENV) or None
        self.steps = []
        self.facts = {}
        self._current = None

    @property
    def enabled(self):
        return self.directory is not None

    def begin(self):
        if self.directory is not None:
            if not self.facts:
                self.facts = placement_facts()
            self._current = {"t0": time.perf_counter(), "cpu0": time.process_time()}

    def mark(self, name):
        current = self._current
        if current is not None:
            current[name] = time.perf_counter() - current["t0"]
            current["cpu_" + name] = time.process_time() - current["cpu0"]

    def end(self):
        current = self._current
        if current is not None:
            current["start"] = current.pop("t0")  # perf_counter: comparable across local ranks
            current["total"] = time.perf_counter() - current["start"]
            current["cpu"] = time.process_time() - current.pop("cpu0")
            self.steps.append(current)
            self._current = None

    def save(self, extra=None):
        """Writes the recorded steps (and `extra` facts) as JSON; returns the path."""
        if self.directory is None:
            return None
        path = os.path.join(self.directory, f"rank{self.rank}.json")
        facts = {"rank": self.rank, "pid": os.getpid(), "steps": self.steps}
        facts.update(self.facts or placement_facts())
        facts.update(extra or {})
        try:
            os.makedirs(self.directory, exist_ok=True)
            with open(path, "w") as f:
                json.dump(facts, f)
        except OSError as e:  # a diagnostic must not fail the fit
            import warnings

            warnings.warn(
                f"autodist_keras: could not write the step profile to {path} ({e}); "
                f"set {PROFILE_ENV} to a writable directory. Received: {self.directory!r}",
                stacklevel=user_stacklevel(),
            )
            return None
        return path


class ReplicaTrainer:
    """Runs training steps of one replica with planned gradient reduction.

    Args:
        model: The compiled Keras model (this rank's replica).
        comm: The rank's `Comm`.
        plan: The data-parallel `Plan`.
        rank_nodes: Node name of each rank.
        device_ranks: Dict from device name to rank.
        paths: Optional names of the trainable variables as the plan knows them
            (rank 0's paths), in `model.trainable_weights` order; default: the
            variables' own paths.
    """

    def __init__(self, model, comm, plan, rank_nodes, device_ranks, paths=None):
        if type(model).train_step is not _keras_train_step():
            raise BackendError(
                f"Model class {type(model).__name__} overrides train_step; the PyTorch "
                "runtime runs Keras's standard step on each replica and cannot "
                "distribute a custom one. Override compute_loss instead of train_step, "
                f"or train it without AutoStrategy. Received: {type(model).__name__}.train_step"
            )
        model_checks.check_loss_reductions(model)
        self.model = model
        self.comm = comm
        self.reducer = GradientReducer(comm, model.trainable_weights, plan, rank_nodes, device_ranks,
                                       paths=paths)
        self.state_sync = StateSync(comm, model.non_trainable_weights,
                                    batchnorm_stats.moving_pairs(model))
        self.profile = StepProfile(comm.rank)
        # Custom metric trackers the step updates (in compute_loss): their change
        # goes to rank 0, which makes it one update of the whole batch.
        self.trackers = TorchTrackerDeltas(model)
        # Optional `torch_fusion.TorchFusionRegions`, installed while attached.
        self.fusion = None

    def attach(self):
        self.reducer.attach()
        if self.fusion is not None:
            self.fusion.install()

    def detach(self):
        self.reducer.detach()
        if self.fusion is not None:
            self.fusion.uninstall()

    def step(self, x, y, sample_weight, share, global_batch, after_forward=None,
             before_wait=None):
        """One training step on this replica's shard.

        Args:
            x, y, sample_weight: The shard (`share` samples), or None when
                `share` is 0.
            share: Number of samples of this replica.
            global_batch: Number of samples of the whole step.
            after_forward: Optional callable `(y_pred, loss)` run right after
                the forward pass (rank 0 and workers exchange predictions
                there, overlapping backward); `self.trackers.delta` then
                holds what the pass changed in the model's custom metric
                trackers, which are back at their old values.
            before_wait: Optional callable `()` run after backward (or, with
                `share` 0, after the zero gradients are set), while the
                gradient collectives are in flight and before this rank waits
                for them (rank 0 updates the global metrics there).

        Returns:
            `(y_pred, loss)`: this shard's predictions and unscaled loss
            (None, None when `share` is 0).
        """
        import torch

        model = self.model
        profile = self.profile
        weight = float(share) / float(global_batch)
        trainable = model.trainable_weights
        if len(trainable) != len(self.reducer.variables) or any(
                a is not b for a, b in zip(trainable, self.reducer.variables)):
            # A callback froze or unfroze a layer since the fit began (rank 0):
            # refused before this step's collectives start, so no rank waits.
            raise model_checks.trainable_changed_during_fit(len(self.reducer.variables),
                                                            len(trainable))
        profile.mark("step_begin")
        self.state_sync.snapshot()
        self.trackers.begin()
        self.reducer.start_step()
        y_pred = loss = None
        if share > 0:
            try:
                if model._call_has_training_arg:
                    y_pred = model(x, training=True)
                else:
                    y_pred = model(x)
                model.zero_grad()
                loss = model._compute_loss(
                    x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
                )
            except (ValueError, TypeError) as e:
                _note_shard_rows(e, share, global_batch)
                raise
            # The change of custom trackers (`self.trackers.delta`), restored here;
            # rank 0 combines every replica's (`loss_trackers`).
            self.trackers.end()
            profile.mark("forward")
            self.state_sync.launch(weight)
            if after_forward is not None:
                after_forward(y_pred, loss)
            profile.mark("after_forward")
            scaled = model.optimizer.scale_loss(loss * weight)
            if model.trainable_weights:
                scaled.backward()
        else:
            model.zero_grad()
            self.state_sync.launch(0.0)
        profile.mark("backward")
        if before_wait is not None:
            self.reducer.launch_rest()
            before_wait()
        grads = self.reducer.finish()
        profile.mark("reduce_wait")
        if model.trainable_weights:
            with torch.no_grad():
                model.optimizer.apply(grads, model.trainable_weights)
        profile.mark("apply")
        self.state_sync.finish()
        profile.mark("state_sync")
        return y_pred, loss


def _note_shard_rows(error, share, global_batch):
    """Notes on `error` that the shapes it names count this replica's rows.

    A shape error raised by the model or the loss on a replica names the
    shard's first dimension (e.g. 6), where plain Keras would name the
    batch's (e.g. 16); without the note the user looks for a 6 in their data.
    No note when the error names no shape, when the replica holds the whole
    batch, or before Python 3.11.
    """
    if share != global_batch and hasattr(error, "add_note") and "shape" in str(error):
        error.add_note(
            f"autodist_keras: this replica computed {share} of the step's {global_batch} "
            f"rows (its share of the batch), so the shapes above count {share} rows "
            f"where plain Keras would show {global_batch}.")


def _keras_train_step():
    from keras.src.backend.torch.trainer import TorchTrainer

    return TorchTrainer.train_step
