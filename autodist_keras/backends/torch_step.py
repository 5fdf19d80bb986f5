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

from autodist_keras.backends.torch_reducer import GradientReducer
from autodist_keras.backends.torch_reducer import StateSync
from autodist_keras.errors import BackendError

SUPPORTED_REDUCTIONS = ("sum_over_batch_size", "mean")


def check_loss_reductions(model):
    """Raises `BackendError` if a compiled loss cannot be split by batch share.

    Losses that divide by the number of elements (Keras's default
    `"sum_over_batch_size"`, and `"mean"`) split exactly; `"sum"` and
    `"mean_with_sample_weight"` would need another weighting.
    """
    import keras

    losses = model.loss
    if isinstance(losses, dict):
        items = list(losses.items())
    elif isinstance(losses, (list, tuple)):
        items = list(enumerate(losses))
    else:
        items = [("loss", losses)]
    for key, loss in items:
        reduction = getattr(loss, "reduction", None)
        if isinstance(loss, keras.losses.Loss) and reduction not in SUPPORTED_REDUCTIONS:
            raise BackendError(
                f"Loss {key!r} ({type(loss).__name__}) uses reduction={reduction!r}. "
                "The PyTorch runtime weights each replica's loss by its share of the "
                "global batch, which is exact for losses averaged over the batch. "
                f"Use reduction='sum_over_batch_size' (the default). Received: {reduction!r}"
            )


class ReplicaTrainer:
    """Runs training steps of one replica with planned gradient reduction.

    Args:
        model: The compiled Keras model (this rank's replica).
        comm: The rank's `Comm`.
        plan: The data-parallel `Plan`.
        rank_nodes: Node name of each rank.
        device_ranks: Dict from device name to rank.
    """

    def __init__(self, model, comm, plan, rank_nodes, device_ranks):
        if type(model).train_step is not _keras_train_step():
            raise BackendError(
                f"Model class {type(model).__name__} overrides train_step; the PyTorch "
                "runtime runs Keras's standard step on each replica and cannot "
                "distribute a custom one. Override compute_loss instead of train_step, "
                f"or train it without AutoStrategy. Received: {type(model).__name__}.train_step"
            )
        check_loss_reductions(model)
        self.model = model
        self.comm = comm
        self.reducer = GradientReducer(comm, model.trainable_weights, plan, rank_nodes, device_ranks)
        self.state_sync = StateSync(comm, model.non_trainable_weights)

    def attach(self):
        self.reducer.attach()

    def detach(self):
        self.reducer.detach()

    def step(self, x, y, sample_weight, share, global_batch, after_forward=None):
        """One training step on this replica's shard.

        Args:
            x, y, sample_weight: The shard (`share` samples), or None when
                `share` is 0.
            share: Number of samples of this replica.
            global_batch: Number of samples of the whole step.
            after_forward: Optional callable `(y_pred, loss)` run right after
                the forward pass (rank 0 and workers exchange predictions
                there, overlapping backward).

        Returns:
            `(y_pred, loss)`: this shard's predictions and unscaled loss
            (None, None when `share` is 0).
        """
        import torch

        model = self.model
        weight = float(share) / float(global_batch)
        self.state_sync.snapshot()
        self.reducer.start_step()
        y_pred = loss = None
        if share > 0:
            if model._call_has_training_arg:
                y_pred = model(x, training=True)
            else:
                y_pred = model(x)
            model.zero_grad()
            loss = model._compute_loss(
                x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
            )
            self.state_sync.launch(weight)
            if after_forward is not None:
                after_forward(y_pred, loss)
            scaled = model.optimizer.scale_loss(loss * weight)
            if model.trainable_weights:
                scaled.backward()
        else:
            model.zero_grad()
            self.state_sync.launch(0.0)
        grads = self.reducer.finish()
        if model.trainable_weights:
            with torch.no_grad():
                model.optimizer.apply(grads, model.trainable_weights)
        self.state_sync.finish()
        return y_pred, loss


def _keras_train_step():
    from keras.src.backend.torch.trainer import TorchTrainer

    return TorchTrainer.train_step
