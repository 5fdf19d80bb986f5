"""Keeps Keras's TensorFlow `add` from adding a per-row tensor as a per-column bias.

One job: correct one case of `keras.ops.add` on the TensorFlow backend that the
replicas' static row counts expose.

Keras's TF `add` (keras/src/backend/tensorflow/numpy.py) calls
`tf.nn.bias_add(x1, squeeze(x2))` whenever `x2` has exactly one dimension
other than 1, of a static size equal to `x1`'s axis 1 or last axis, so that
TensorFlow can fuse the bias into a preceding MatMul or convolution. It does
not check that this dimension is the one numpy broadcasting lines up with
that axis. A per-row statistic such as `h + ops.mean(h, axis=-1,
keepdims=True)` has shape `(rows, 1)`; when `rows` equals `h`'s width, it is
added along the columns instead of the rows. Plain Keras traces `fit`,
`evaluate` and `predict` with an unknown number of rows, so it never meets the
case there; each replica of a data-parallel plan knows its row count (its
share of the batch), so a share equal to a feature width trained silently
wrong.

`install()` wraps that function once per process. The wrapper passes every
call through to Keras unchanged, except a call where Keras would take the
`bias_add` path and that path disagrees with broadcasting; that call becomes a
plain `tf.add` of the same converted operands, which is what Keras computes
when the row count is unknown. Only those calls change: they give numpy
broadcasting's result, or, where broadcasting has none (`(3, 8) + (8, 1)`),
TensorFlow's shape error instead of a silently wrong sum, also in the
process's own code outside AutoStrategy.

Example:

```python
from autodist_keras.backends import tf_add_guard

tf_add_guard.install()  # the TensorFlow adapter does this when it is created
```
"""

_GUARD_ATTRIBUTE = "_autodist_keras_add_guard"


def _static_dims(value):
    """`value`'s static dimensions as a list (None for unknown), or None when
    its rank is unknown or it has no shape (Python numbers)."""
    import tensorflow as tf

    shape = getattr(value, "shape", None)
    if shape is None:
        return None
    try:
        shape = tf.TensorShape(shape)
    except (TypeError, ValueError):
        return None
    return None if shape.rank is None else shape.as_list()


def bias_add_misplaces(x1_dims, x2_dims):
    """Whether Keras's TF `add` would add `x2` along another axis than broadcasting.

    Args:
        x1_dims: Static dimensions of `x1` (a list; None for unknown sizes).
        x2_dims: Static dimensions of `x2`.

    Returns:
        True when Keras takes its `tf.nn.bias_add` path for these shapes and
        that path adds `x2` along an axis of `x1` other than the one numpy
        broadcasting aligns `x2`'s long dimension with (or broadcasting would
        give a result of higher rank). False when Keras would not take the
        path, or takes it correctly.

    Example:

    >>> bias_add_misplaces([8, 8], [8, 1])  # per-row means, 8 rows of width 8
    True
    >>> bias_add_misplaces([8, 8], [8])  # a real bias
    False
    """
    long_axes = [i for i, d in enumerate(x2_dims) if d is None or d > 1]
    if len(long_axes) != 1 or len(x1_dims) < 2:
        return False
    size = x2_dims[long_axes[0]]
    if size is None or size not in (x1_dims[1], x1_dims[-1]):
        return False  # Keras adds with tf.add
    bias_axis = len(x1_dims) - 1 if x1_dims[-1] == size else 1  # NHWC, else NCHW
    if len(x2_dims) > len(x1_dims):
        return True
    return len(x1_dims) - len(x2_dims) + long_axes[0] != bias_axis


def install():
    """Wraps Keras's TensorFlow `add` so that a misplaced `bias_add` becomes `tf.add`.

    Idempotent: a second call (another `AutoStrategy`) changes nothing. Does
    nothing when the Keras build has no TensorFlow backend module.

    Returns:
        True when the guard is in place after the call, else False.
    """
    try:
        from keras.src.backend.tensorflow import numpy as tf_numpy
    except ImportError:
        return False
    keras_add = tf_numpy.add
    if getattr(keras_add, _GUARD_ATTRIBUTE, False):
        return True

    def add(x1, x2):
        x1_dims, x2_dims = _static_dims(x1), _static_dims(x2)
        if (x1_dims is None or x2_dims is None or _is_sparse(x1) or _is_sparse(x2)
                or not bias_add_misplaces(x1_dims, x2_dims)):
            return keras_add(x1, x2)
        return _broadcast_add(x1, x2)

    add.__doc__ = keras_add.__doc__
    add.__wrapped__ = keras_add
    setattr(add, _GUARD_ATTRIBUTE, True)
    tf_numpy.add = add
    return True


def _is_sparse(value):
    import tensorflow as tf

    return isinstance(value, (tf.SparseTensor, tf.IndexedSlices))


def _broadcast_add(x1, x2):
    """`x1 + x2` with numpy broadcasting, in the dtype Keras's `add` would use."""
    import tensorflow as tf
    from keras.src.backend.common import dtypes
    from keras.src.backend.tensorflow.core import convert_to_tensor

    dtype = dtypes.result_type(getattr(x1, "dtype", type(x1)), getattr(x2, "dtype", type(x2)))
    return tf.add(convert_to_tensor(x1, dtype), convert_to_tensor(x2, dtype))
