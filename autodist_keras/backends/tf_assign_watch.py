"""Sees which Keras variables a piece of code assigns, on the TensorFlow backend.

One job: tell the TensorFlow runtime which variables a model's `compute_loss`
(or anything else run outside its recording scope) assigns, as it assigns
them.

The runtime runs every replica's forward pass inside a recording Keras
`StatelessScope`, which captures the pass's assignments; `compute_loss` runs
outside it (inside one, Keras would look up weight regularisers and `add_loss`
losses in that scope), so its assignments really happen, once per replica. A
variable that a `compute_loss` override assigns (a moving average of the loss,
a step counter) then took every replica's update in turn: with 3 replicas a
float step counter advanced by 3 per batch, and a moving average followed the
replicas' shard losses one after the other. The runtime now watches
`compute_loss` (`watching(on_assign)`), learns each such variable at its first
assignment, before it is made, and combines the replicas' new values by the
rule of the other state (`tensorflow_adapter._TrackerRecord`).

`install()` wraps Keras's TensorFlow `Variable._direct_assign` (the method a
real assignment, `assign`, `assign_add` or `assign_sub` outside a stateless
scope, ends in) once per process. The wrapper calls the callback set by
`watching` in the current thread, if any, and then assigns as before; in
every other thread, and outside `watching`, it only assigns.

Example:

```python
from autodist_keras.backends import tf_assign_watch

tf_assign_watch.install()
seen = []
with tf_assign_watch.watching(seen.append):
    loss = model.compute_loss(x, y, y_pred)
# `seen` lists the variables compute_loss assigned, in order (with repeats).
```
"""

import contextlib
import threading

_WRAPPED_ATTRIBUTE = "_autodist_keras_assign_watch"
_state = threading.local()


def install():
    """Wraps Keras's TensorFlow `Variable._direct_assign` once per process.

    Returns:
        True when this call installed the wrapper, False when it was there.
    """
    from keras.src.backend.tensorflow.core import Variable

    original = Variable._direct_assign
    if getattr(original, _WRAPPED_ATTRIBUTE, False):
        return False

    def _direct_assign(self, value):
        callback = getattr(_state, "callback", None)
        if callback is not None:
            callback(self)
        return original(self, value)

    setattr(_direct_assign, _WRAPPED_ATTRIBUTE, True)
    _direct_assign.__wrapped__ = original
    _direct_assign.__doc__ = original.__doc__
    Variable._direct_assign = _direct_assign
    return True


@contextlib.contextmanager
def watching(on_assign):
    """Calls `on_assign(variable)` before each real assignment in this thread.

    Args:
        on_assign: Callable taking the Keras variable about to be assigned;
            it runs before the assignment, so a read of the variable inside
            it gives the value before this assignment.

    Yields:
        None. Watches nest: the innermost callback is called.

    Example:

    ```python
    seen = []
    with watching(seen.append):
        counter.assign_add(1.0)
    assert seen == [counter]
    ```
    """
    install()
    previous = getattr(_state, "callback", None)
    _state.callback = on_assign
    try:
        yield
    finally:
        _state.callback = previous
