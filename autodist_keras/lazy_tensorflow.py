"""Keras's serializer without a TensorFlow import (the PyTorch runtime, the profiler).

`keras.src.saving.serialization_lib.serialize_keras_object` asks
`tf.available` (Keras's lazy TensorFlow module) for every object it
serializes, which imports TensorFlow wherever it is installed: several
seconds and TensorFlow's start-up log lines in a PyTorch job, where plain
Keras imports none. `tensorflow_left_unimported` answers "not available"
while TensorFlow is not imported, for serialization only: deserializing
builds layers, and Keras's TensorFlow-backed preprocessing layers (Hashing,
StringLookup, ...) refuse to be built where TensorFlow is "not available".
"""

import contextlib
import sys


@contextlib.contextmanager
def tensorflow_left_unimported():
    """Within the block, Keras's serializer does not import TensorFlow.

    While TensorFlow is not imported no object can be one of its types, so
    "not available" is the true answer to the serializer's question. After
    the block the lazy module asks again (it imports TensorFlow when first
    asked, as before). Where TensorFlow is already imported, where the lazy
    module has answered already, or in a Keras without it, nothing changes.
    Use it around `serialize_keras_object` and `get_config()` calls only,
    never around code that builds layers.

    Example:

    ```python
    with tensorflow_left_unimported():
        config = serialization_lib.serialize_keras_object(optimizer)
    ```
    """
    try:
        from keras.src.utils import module_utils
    except ImportError:  # a Keras without the lazy module
        module_utils = None
    lazy = getattr(module_utils, "tensorflow", None)
    if (lazy is None or "tensorflow" in sys.modules
            or getattr(lazy, "_available", False) is not None):
        yield
        return
    lazy._available = False
    try:
        yield
    finally:
        # Asked again after the block (TensorFlow may have been imported inside it).
        lazy._available = None
