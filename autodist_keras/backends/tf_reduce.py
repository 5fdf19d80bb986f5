"""Gradient fusion and in-process reductions for the TensorFlow adapter.

One job: given per-replica gradients, build the fused buffers a plan's
buckets ask for, sum them across devices the way the plan's sync method says,
and split the sum back into per-variable gradients. Everything here runs
inside a traced `tf.function`; device placement uses `tf.device`.

In one process every replica device sees the same memory, so an all-reduce
whose result is only needed where the variables live is a reduction to that
device. The algorithms keep their data flow: a ring reduces each of `n`
chunks hop by hop along the ring (the reduce-scatter half of a ring
all-reduce), a tree adds pairs level by level, hierarchical sums within each
node first, and a parameter server adds every replica's buffer on the server.

Example:

```python
layout = bucket_layout(plan, variables)
with tf.device(home):
    summed = reduce_gradients(per_replica_grads, layout, devices, home, plan_sync)
```
"""

from autodist_keras.errors import BackendError


class Bucket:
    """One fused buffer: variables reduced together with one sync method.

    Args:
        indices: Positions of the variables in `model.trainable_variables`,
            in launch order.
        method: `"allreduce"` or `"ps"`.
        algorithm: All-reduce algorithm (`"ring"`, `"tree"`, `"hierarchical"`).
        server: PS server device name (plan name), for `method == "ps"`.
    """

    def __init__(self, indices, method, algorithm, server):
        self.indices = list(indices)
        self.method = method
        self.algorithm = algorithm
        self.server = server

    def __repr__(self):
        return (
            f"Bucket({len(self.indices)} vars, {self.method}"
            f"{'/' + str(self.algorithm) if self.method == 'allreduce' else '@' + str(self.server)})"
        )


# Ops through which a sparse gradient's row indices pass unchanged from the
# lookup ids (the gather's gradient reshapes them), and the ops whose first
# output is a tensor's distinct values.
_INDEX_PASSTHROUGH_OPS = frozenset(
    {"Identity", "Reshape", "Cast", "Squeeze", "ExpandDims", "StopGradient", "Snapshot"})
_UNIQUE_OPS = frozenset({"Unique", "UniqueV2", "UniqueWithCounts", "UniqueWithCountsV2"})


def rows_from_unique(slices):
    """Whether the rows of `slices` are the distinct ids a `Unique` op returned (None: eager).

    True for the gradient of `tf.nn.embedding_lookup_sparse` (a gather of
    the table at `tf.unique(ids)`), False for that of `tf.gather` at the ids
    themselves (`Embedding`) or for rows concatenated from several lookups.

    Args:
        slices: A `tf.IndexedSlices` gradient.

    Returns:
        True or False read from the graph, or None for an eager tensor.
    """
    t = slices.indices
    for _ in range(32):
        try:
            op = t.op
        except AttributeError:  # an EagerTensor: no graph to read
            return None
        if op.type in _UNIQUE_OPS:
            return t.value_index == 0
        if op.type not in _INDEX_PASSTHROUGH_OPS or not op.inputs:
            return False
        t = op.inputs[0]
    return False


def merge_rows(values, indices):
    """One row per distinct index, in order of first appearance, holding the sum of its rows.

    Args:
        values: The rows (first axis).
        indices: Their indices.

    Returns:
        `(values, indices)` with each index once.
    """
    import tensorflow as tf

    unique, position = tf.unique(indices)
    return tf.math.unsorted_segment_sum(values, position, tf.shape(unique)[0]), unique


def rows_deduplicated(slices, variable, model, x, traced):
    """Whether the replicas' sparse gradient `slices` of `variable` have one row per distinct id.

    In a traced step, read from the graph (`rows_from_unique`) for every
    replica's slices; in an eager step (`run_eagerly=True`), whose tensors
    carry no graph, from one trace of `model` on `x`
    (`traced_rows_deduplicated`), kept in `traced` per variable path. A
    variable whose gradient there is not `IndexedSlices` counts as one row
    per lookup.

    Args:
        slices: The replicas' (or a split call's parts') `IndexedSlices`.
        variable: Their variable.
        model: The Keras model.
        x: A batch of its inputs.
        traced: A dict kept by the caller across steps (`{path: bool}`).

    Returns:
        True when the rows are distinct ids (merge them, `merge_rows`).
    """
    found = [rows_from_unique(s) for s in slices]
    if all(f is not None for f in found):
        return all(found)
    if variable.path not in traced:
        traced.update(traced_rows_deduplicated(model, x))
        traced.setdefault(variable.path, False)
    return traced[variable.path]


def concat_slices(slices, merge):
    """The rows and indices of several `IndexedSlices` concatenated, in order.

    Args:
        slices: `IndexedSlices` of one variable.
        merge: Whether rows of the same index are then summed into one
            (`merge_rows`): for rows that are distinct ids (`rows_deduplicated`).

    Returns:
        `(values, indices)`.
    """
    import tensorflow as tf

    values = tf.concat([s.values for s in slices], 0)
    indices = tf.concat([s.indices for s in slices], 0)
    if merge and len(slices) > 1:
        values, indices = merge_rows(values, indices)
    return values, indices


def traced_rows_deduplicated(model, x):
    """Which variables' sparse gradients have one row per distinct id, from a trace.

    For eager steps (`run_eagerly=True`), whose tensors carry no graph for
    `rows_from_unique` to read: the model's forward and backward pass on `x`
    is traced once (never run; assignments such as BN statistics are
    recorded and dropped) and each sparse gradient of that trace is read.

    Args:
        model: The Keras model.
        x: A batch of its inputs.

    Returns:
        `{variable path: bool}` for the variables whose gradient is
        `IndexedSlices` in the trace.
    """
    import tensorflow as tf
    from keras.src import tree
    from keras.src.backend.common.stateless_scope import StatelessScope

    variables = model.trainable_variables
    found = {}

    def trace(x):
        with StatelessScope(initialize_variables=False):
            with tf.GradientTape() as tape:
                y_pred = model(x, training=True) if model._call_has_training_arg else model(x)
                sums = [tf.reduce_sum(tf.cast(t, "float32")) for t in tree.flatten(y_pred)
                        if t.dtype.is_floating]
            if not sums:
                return tf.constant(0)
            grads = tape.gradient(tf.add_n(sums), variables)
        for v, g in zip(variables, grads):
            if isinstance(g, tf.IndexedSlices):
                found[v.path] = bool(rows_from_unique(g))
        return tf.constant(0)

    tf.function(trace, autograph=False).get_concrete_function(x)
    return found


def bucket_layout(plan, variable_paths, dtypes):
    """Turns a plan's buckets into `Bucket`s over variable positions.

    A plan bucket whose variables differ in sync method, algorithm, server
    or dtype is split into consecutive runs that agree (a flat buffer has
    one dtype and one destination). Variables in no plan bucket get one
    bucket each, after the planned ones.

    Args:
        plan: The `Plan`.
        variable_paths: `v.path` of each trainable variable, in
            `model.trainable_variables` order.
        dtypes: The dtype name of each trainable variable.

    Returns:
        A list of `Bucket`.

    Raises:
        BackendError: If a bucket names a variable the model does not have,
            or names one twice.
    """
    position = {path: i for i, path in enumerate(variable_paths)}
    seen = set()
    layout = []

    def key_of(i):
        spec = plan.sync.get(variable_paths[i])
        if spec is None:
            return ("allreduce", "ring", None, dtypes[i])
        if spec.method == "ps":
            return ("ps", None, spec.server, dtypes[i])
        return ("allreduce", spec.algorithm or "ring", None, dtypes[i])

    def add_run(indices):
        run, run_key = [], None
        for i in indices:
            key = key_of(i)
            if run and key != run_key:
                layout.append(Bucket(run, *run_key[:3]))
                run = []
            run.append(i)
            run_key = key
        if run:
            layout.append(Bucket(run, *run_key[:3]))

    for bi, bucket in enumerate(plan.buckets):
        indices = []
        for name in bucket:
            if name not in position:
                raise BackendError(
                    f"Plan bucket {bi} names variable {name!r}, which the model does not "
                    f"have. Re-plan for this model (its trainable variables are e.g. "
                    f"{list(variable_paths)[:4]}). Received: {name!r}"
                )
            if name in seen:
                raise BackendError(
                    f"Variable {name!r} appears in more than one plan bucket; each "
                    f"variable must be reduced exactly once. Received: bucket {bi}"
                )
            seen.add(name)
            indices.append(position[name])
        add_run(indices)
    for i, path in enumerate(variable_paths):
        if path not in seen:
            add_run([i])
    return layout


def fuse(grads, shapes, dtype):
    """Flattens gradients into one buffer (zeros for a missing gradient).

    Each part is reshaped to its variable's element count, not `[-1]`: in a
    step traced for inputs of unknown length (batches padded to different
    sequence lengths), a gradient's static shape can be partly unknown
    (`(None, 3)` for a per-timestep Dense kernel), and the buffer's size must
    stay static for the ring reduction and the multi-worker all-reduce.
    """
    import tensorflow as tf

    parts = []
    for g, shape in zip(grads, shapes):
        if g is None:
            parts.append(tf.zeros([_num_elements(shape)], dtype=dtype))
        else:
            if isinstance(g, tf.IndexedSlices):
                g = tf.convert_to_tensor(g)
            parts.append(tf.reshape(tf.cast(g, dtype), [_num_elements(shape)]))
    if len(parts) == 1:
        return parts[0]
    return tf.concat(parts, axis=0)


def unfuse(buffer, shapes):
    """Splits a fused buffer back into tensors of the given shapes."""
    import tensorflow as tf

    sizes = [_num_elements(s) for s in shapes]
    if len(sizes) == 1:
        return [tf.reshape(buffer, shapes[0])]
    pieces = tf.split(buffer, sizes, axis=0)
    return [tf.reshape(p, s) for p, s in zip(pieces, shapes)]


def reduce_local(buffers, devices, target, method, algorithm=None, server=None, nodes=None):
    """Sums per-device buffers in one process; the sum ends on `target`.

    Args:
        buffers: One tensor per replica, each already placed on its device.
        devices: TF device strings of the replicas, same order.
        target: TF device string where the sum is needed (the variables).
        method: `"allreduce"` or `"ps"`.
        algorithm: `"ring"`, `"tree"` or `"hierarchical"` for all-reduce.
        server: TF device string of the PS server, for `"ps"`.
        nodes: Node name of each replica (for `"hierarchical"`).

    Returns:
        The summed buffer, placed on `target`.
    """
    import tensorflow as tf

    if len(buffers) == 1:
        with tf.device(target):
            return tf.identity(buffers[0])
    if method == "ps":
        with tf.device(server):
            total = tf.add_n(buffers)
        if server == target:
            return total
        with tf.device(target):
            return tf.identity(total)
    if algorithm == "tree":
        total, _ = _tree(list(zip(devices, buffers)))
    elif algorithm == "hierarchical":
        groups = {}
        for node, device, buf in zip(nodes or [None] * len(devices), devices, buffers):
            groups.setdefault(node, []).append((device, buf))
        leaders = []
        for members in groups.values():
            with tf.device(members[0][0]):
                leaders.append((members[0][0], tf.add_n([b for _, b in members])))
        total, _ = _tree(leaders) if len(leaders) > 1 else (leaders[0][1], None)
    else:
        total = _ring(buffers, devices)
    with tf.device(target):
        return tf.identity(total)


def _tree(items):
    import tensorflow as tf

    level = list(items)
    while len(level) > 1:
        nxt = []
        for j in range(0, len(level), 2):
            if j + 1 < len(level):
                device = level[j][0]
                with tf.device(device):
                    nxt.append((device, level[j][1] + level[j + 1][1]))
            else:
                nxt.append(level[j])
        level = nxt
    return level[0][1], level[0][0]


def _ring(buffers, devices):
    """Ring reduce-scatter: chunk c travels c+1, c+2, ..., c, adding at each hop."""
    import tensorflow as tf

    from autodist_keras.strategies.plan import split_batch

    n = len(buffers)
    size = buffers[0].shape[0]
    if size is None or size < n:
        with tf.device(devices[0]):
            return tf.add_n(buffers)
    sizes = split_batch([1] * n, int(size))
    chunks = []
    for device, buf in zip(devices, buffers):
        with tf.device(device):
            chunks.append(tf.split(buf, sizes, axis=0))
    reduced = []
    for c in range(n):
        start = (c + 1) % n
        acc = chunks[start][c]
        for hop in range(2, n + 1):
            d = (c + hop) % n
            with tf.device(devices[d]):
                acc = acc + chunks[d][c]
        reduced.append(acc)
    with tf.device(devices[0]):
        return tf.concat(reduced, axis=0)


def _num_elements(shape):
    n = 1
    for d in shape:
        n *= int(d)
    return n
