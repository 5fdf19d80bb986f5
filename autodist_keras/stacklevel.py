"""Where a warning points: the user's line that led to it.

A warning raised while Keras runs a fit (a plan made at the first step, a
loss checked at the first batch) is many frames below the user's `fit` call,
and how many depends on the backend and the path taken. `user_stacklevel`
counts them, so the warning names the user's line instead of one inside
autodist_keras, Keras or the framework.
"""

import sys

# Top-level packages whose frames are not the user's.
_INTERNAL = frozenset({"autodist_keras", "keras", "tensorflow", "torch", "optree", "namex",
                       "contextlib", "threading", "functools", "runpy"})


def user_stacklevel():
    """The `stacklevel` for `warnings.warn` that names the nearest user frame.

    Call it in the function that warns. Frames of autodist_keras, Keras,
    TensorFlow, PyTorch and the standard library's wrappers are skipped; where
    no user frame is on the stack (a worker process), the warning names the
    function that warns.

    Returns:
        An int for `warnings.warn(..., stacklevel=...)`.

    Example:

    ```python
    warnings.warn("The plan was made for ...", stacklevel=user_stacklevel())
    ```
    """
    frame = sys._getframe(1)  # the function that warns: stacklevel 1
    level = 1
    while frame is not None:
        module = frame.f_globals.get("__name__") or ""
        if module.split(".")[0] not in _INTERNAL:
            return level
        frame = frame.f_back
        level += 1
    return 1
