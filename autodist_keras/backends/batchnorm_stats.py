"""Exact moving variances of BatchNormalization layers under data parallelism.

Each replica normalises with its own batch statistics (as DDP without
SyncBatchNorm and `MirroredStrategy` without sync-BN do) and updates the
moving statistics with them:

    moving_mean_r = m * moving_mean + (1 - m) * mean_r
    moving_var_r  = m * moving_var  + (1 - m) * var_r

The runtimes combine the replicas' new values weighted by their share `w_r`
of the global batch. For the mean that is exact. For the variance it misses
how far the replicas' means lie apart: the global batch's (biased) variance
is `sum w_r var_r + sum w_r (mean_r - mean)^2`. With `d_r` the change of
replica `r`'s moving mean, `d_r = (1 - m) (mean_r - moving_mean)`, the missing
part of the moving variance is

    (sum w_r d_r^2 - (sum w_r d_r)^2) / (1 - m),

which the runtimes add: the moving variance then follows the global batch's
variance exactly, as on one device. Small replica shares are where it
matters: with 4 samples per replica the replicas' means spread by about a
quarter of the variance.

Example:

```python
pairs = moving_pairs(model)          # [(moving_mean, moving_variance, momentum), ...]
extra = variance_correction(s1, s2, momentum)
```
"""


def moving_pairs(model):
    """`(moving_mean, moving_variance, momentum)` of every BatchNormalization layer.

    Args:
        model: A built Keras model.

    Returns:
        A list of triples; layers without moving statistics are left out.
    """
    import keras

    pairs = []
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if not isinstance(layer, keras.layers.BatchNormalization):
            continue
        mean = getattr(layer, "moving_mean", None)
        variance = getattr(layer, "moving_variance", None)
        momentum = float(getattr(layer, "momentum", 0.99))
        if mean is not None and variance is not None and momentum < 1.0:
            pairs.append((mean, variance, momentum))
    return pairs


def variance_correction(weighted_sum, weighted_square_sum, momentum):
    """What the share-weighted mean of the replicas' moving variances misses.

    Args:
        weighted_sum: `sum_r w_r d_r` (tensors), `d_r` replica `r`'s change of
            the moving mean, `w_r` its share of the global batch.
        weighted_square_sum: `sum_r w_r d_r^2`.
        momentum: The layer's momentum `m` (< 1).

    Returns:
        `(weighted_square_sum - weighted_sum^2) / (1 - m)`, to add to the
        moving variance.
    """
    return (weighted_square_sum - weighted_sum * weighted_sum) / (1.0 - momentum)
