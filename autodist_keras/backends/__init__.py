"""Backend adapters: run a Plan inside `model.fit` on the active Keras backend.

Adapters import TensorFlow or PyTorch lazily; importing this package imports
neither.
"""

from autodist_keras.errors import BackendError


def get_adapter(strategy):
    """Returns the adapter for the active Keras backend.

    Args:
        strategy: The `AutoStrategy` the adapter serves.

    Raises:
        BackendError: If the active Keras backend has no adapter.
    """
    import keras

    backend = keras.backend.backend()
    if backend == "tensorflow":
        from autodist_keras.backends.tensorflow_adapter import TensorFlowAdapter

        return TensorFlowAdapter(strategy)
    if backend == "torch":
        from autodist_keras.backends.torch_adapter import TorchAdapter

        return TorchAdapter(strategy)
    raise BackendError(
        "autodist_keras runs on the 'tensorflow' and 'torch' Keras backends. Set "
        "KERAS_BACKEND=tensorflow or KERAS_BACKEND=torch before importing keras. "
        f"Received: {backend!r}"
    )
