"""Which of rank 0's variables changed between training steps (PyTorch runtime).

Keras callbacks may write rank 0's weights or optimizer variables between
steps: `set_weights` in `on_epoch_end` (weight averaging, a max-norm
constraint), `EarlyStopping(restore_best_weights=True)` at the end of fit,
`ReduceLROnPlateau` and `LearningRateScheduler` on the learning rate. The
workers hold their own copies, so rank 0 sends them what changed before the
next step (and before the end of fit), and every replica goes on from the
same weights.

PyTorch counts the in-place writes to every tensor (`tensor._version`; a
Keras variable's `assign` is an in-place `copy_`), so the check costs one
integer comparison per variable and step, and a variable whose tensor was
replaced counts as changed too.

Example:

```python
watch = StateWatch(model.weights + model.optimizer.variables)
...                       # the training step; then
watch.mark()
...                       # callbacks run
watch.changed()           # indices of the variables written since `mark()`
```
"""


class StateWatch:
    """Notices writes to Keras variables (PyTorch backend) made since `mark()`.

    Args:
        variables: The Keras variables to watch, in the order the indices of
            `changed()` refer to.
    """

    def __init__(self, variables):
        self.variables = list(variables)
        self._stamps = []
        self.mark()

    @staticmethod
    def _stamp(variable):
        tensor = variable._value  # the torch tensor (`value` may autocast)
        return id(tensor), tensor._version

    def mark(self):
        """Records the variables' state as the one the workers hold."""
        self._stamps = [self._stamp(v) for v in self.variables]

    def changed(self):
        """Indices of the variables written (or replaced) since the last `mark()`."""
        return [i for i, (v, stamp) in enumerate(zip(self.variables, self._stamps))
                if self._stamp(v) != stamp]
