"""Compiled models of the testbed benchmarks, importable by worker processes."""

import keras

from autodist_keras.graph import zoo


def _compile(model):
    model.compile(optimizer="sgd",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def build_cnn():
    keras.utils.set_random_seed(0)
    return _compile(zoo.small_cnn(input_shape=(32, 32, 3), filters=(32, 64)))


def build_small_cnn():
    return build_cnn()


def build_mlp():
    keras.utils.set_random_seed(0)
    return _compile(zoo.mlp(input_dim=512, hidden=(1024, 1024), num_classes=10))


@keras.saving.register_keras_serializable(package="autodist_keras_benchmarks")
class FailOnWorker(keras.layers.Layer):
    """Identity layer that raises in the worker of rank `rank` after `after` training calls.

    The failure checks of `gpu_check.py` put it into a model: rank 0 (the
    user's process) never raises, the chosen worker does, mid-training.
    """

    def __init__(self, rank=1, after=2, **kwargs):
        super().__init__(**kwargs)
        self.rank = int(rank)
        self.after = int(after)
        self.calls = 0

    def call(self, inputs, training=None):
        import os

        if training and os.environ.get("AUTODIST_KERAS_WORKER_RANK") == str(self.rank):
            self.calls += 1
            if self.calls > self.after:
                raise ValueError(f"injected failure in rank {self.rank}")
        return inputs

    def get_config(self):
        return dict(super().get_config(), rank=self.rank, after=self.after)
