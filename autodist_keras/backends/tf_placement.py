"""Runs placement and hybrid plans (several layer groups) in one TensorFlow process.

FastT plans put runs of layers on single devices and split some layers over
several; HeteroG hybrid plans replicate some layer groups over a subset of
the devices with uneven batch shares. This module executes such a plan
inside the ordinary `model.fit` / `evaluate` / `predict` of a Keras model on
the TensorFlow backend (wired in from `tensorflow_adapter.py`):

- Every layer call of the model's functional graph runs under the device of
  the plan group holding its graph node (`tf.device`); TensorFlow moves the
  activations between devices. The hook is per call: while our traced step
  runs the model, `Functional._get_operation_for_node` of each functional
  graph (the top model and any nested model) is replaced on the instance so
  that each Keras node is called through `_PlacedCall`, which knows the graph
  node name (`ModelGraph.calls` maps names to Keras nodes, so shared layers
  called twice are told apart).
- A group with several replicas runs each of its layer calls as replicas:
  batch-major inputs are split by the group's shares (rescaled to the actual
  batch with `split_batch`), the layer runs on each part under its device,
  and the outputs are concatenated. An input is batch-major when its Keras
  tensor in the model graph has the batch axis first, whether or not its
  traced value knows its batch size (TextVectorization's does not; such a
  value is checked against the batch at run time); dense, sparse
  (`tf.sparse.slice` / `tf.sparse.concat`) and ragged (by rows) tensors are
  cut. A batch-major input whose static rows are not the batch's raises
  `BackendError`. Consecutive calls of the same split group
  hand the parts on directly (the concatenation is then unused and pruned).
  Every part starts from the state as the call found it and draws from its
  own seeds; what the parts assign (counters, moving averages, seed
  counters) becomes one update, as one unsplit call would make
  (`_SplitState`: float state share-weighted, integer state the first
  part's).
- Gradients: one backward pass over the whole step. Each replica device reads
  its own copy of each variable it uses (a `tf.identity` of the variable on
  that device, watched as a leaf), so the backward pass yields one gradient
  per (variable, device); the backward ops are colocated with their forward
  ops (`tf.gradients` in a traced step). The copies' gradients are fused into
  the plan's buckets and summed with the plan's sync method (`tf_reduce`:
  ring, tree, hierarchical or a PS server), exactly as in data parallelism.
- `plan.order`: in a traced step, the tensor inputs of each forward layer
  call on a device pass through a `tf.identity` with a control dependency on
  the outputs of the previous forward entry of that device's order, when that
  entry was already traced and does not already feed the call through the
  model graph (ops inside the layer, such as variable reads, get no control
  inputs: graph rewrites that fuse ops could turn those into cycles).

See docs/runtime_tensorflow.md ("Placement and hybrid plans") for what is
and is not honoured.

Example:

```python
strategy = AutoStrategy("fastt", cluster=Cluster.cpu_testbed())
with strategy.scope():
    model = build_model()
    model.compile(optimizer="sgd", loss="mse")
model.fit(x, y, batch_size=48)   # each layer runs on its planned device
```
"""

import contextlib

from autodist_keras.backends import tf_reduce
from autodist_keras.backends.loss_trackers import is_float
from autodist_keras.errors import BackendError
from autodist_keras.strategies.plan import split_batch


def unsupported(plan, graph):
    """Why a multi-group plan cannot run on this model in one process, or None.

    Checks the Keras hook this module uses, that the graph has Keras calls
    (it was made with `ModelGraph.from_keras`, not read from JSON) and is not
    an opaque subclassed model, and that every layer of a group with several
    replicas can be split along the batch axis.

    Args:
        plan: A `Plan` with several layer groups.
        graph: The `ModelGraph` of the model, or None (then only the
            graph-independent checks run).

    Returns:
        A reason string, or None when the plan can run.
    """
    from keras.src.models.functional import Functional

    if not hasattr(Functional, "_get_operation_for_node"):
        return (
            "this Keras version has no Functional._get_operation_for_node, the hook the "
            "TensorFlow placement runtime uses to place each layer call"
        )
    if graph is None:
        return None
    if graph.data_parallel_only or any(n.kind == "model" for n in graph.nodes.values()):
        return (
            "the model is subclassed (no functional layer graph), so its layers cannot be "
            "placed on different devices; use a data-parallel strategy"
        )
    if not graph.calls:
        return (
            "the model graph has no Keras layer calls (it was read from JSON); build it with "
            "ModelGraph.from_keras(model)"
        )
    for group in plan.groups:
        if sum(1 for s in group.shares if s > 0) < 2:
            continue
        for name in group.layers:
            reason = _split_problem(graph, name)
            if reason:
                return (
                    f"group {group.name!r} splits layer {name!r} over "
                    f"{len(group.replicas)} devices, but {reason}"
                )
    return None


def whole_batch_problem(layer):
    """Why `layer` computes on the whole batch, so that batch-split replicas of it
    would compute something else, or None.

    A trainable BatchNormalization (or a subclass) normalises with the whole
    batch's statistics; a stateful layer keeps state per batch row. The
    runtime refuses to split such a layer, and FastT does not plan it
    (`strategies._common.unsplittable_layers`).

    Args:
        layer: A Keras layer.

    Returns:
        A reason (a string), or None.

    Example:

    ```python
    whole_batch_problem(keras.layers.BatchNormalization())  # "BatchNormalization in ..."
    ```
    """
    import keras

    if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable:
        return (
            "BatchNormalization in training mode normalises with the statistics of the "
            "whole batch, which splitting would change (freeze it with trainable=False, or "
            "plan without splitting it)"
        )
    if getattr(layer, "stateful", False):
        return "it is stateful (its state is per batch row), so it cannot be split"
    return None


def _split_problem(graph, name):
    """Why the layer call `name` cannot run as batch-split replicas, or None."""
    node = graph.nodes[name]
    if node.kind == "input":
        return None
    op, knode = graph.calls.get(name, (None, None))
    if op is None or knode is None:
        return "its Keras call is unknown"
    reason = whole_batch_problem(op)
    if reason:
        return reason
    batch_dim = _batch_dim(graph)
    outputs = list(knode.outputs)
    if not outputs:
        return "it has no outputs"
    for t in outputs:
        shape = tuple(t.shape)
        if not shape or shape[0] != batch_dim:
            return (
                f"its output of shape {shape} has no leading batch axis, so its result "
                "depends on the whole batch"
            )
    inputs = list(knode.input_tensors)
    if inputs and not any(tuple(t.shape)[:1] == (batch_dim,) for t in inputs):
        return "none of its inputs has a leading batch axis"
    return None


def _batch_dim(graph):
    """The leading dimension of the model's inputs (None unless a batch size is fixed)."""
    for name in graph.inputs:
        _, knode = graph.calls.get(name, (None, None))
        if knode is not None and knode.outputs:
            shape = tuple(knode.outputs[0].shape)
            if shape:
                return shape[0]
    return None


def _functionals(model):
    """The functional graphs run by `model`: its own and those of nested models."""
    from autodist_keras.graph.model_graph import _functional_of

    found, stack = [], [_functional_of(model)]
    while stack:
        functional = stack.pop()
        if functional is None or any(f is functional for f in found):
            continue
        found.append(functional)
        for op in functional._operations:
            inner = _functional_of(op)
            if inner is not None:
                stack.append(inner)
    return found


def _placement_scope(runner, tape):
    """A Keras `StatelessScope` that records assignments and serves per-device variable copies."""
    import tensorflow as tf

    from keras.src.backend.common.stateless_scope import StatelessScope

    from autodist_keras.backends.tensorflow_adapter import _assigned_read
    from autodist_keras.backends.tensorflow_adapter import _in_nested_function
    from autodist_keras.backends.tensorflow_adapter import _leaf_read
    from autodist_keras.backends.tensorflow_adapter import _lifted_read
    from autodist_keras.backends.tensorflow_adapter import _outer_graph
    from autodist_keras.backends.tensorflow_adapter import _read_outside

    class PlacementScope(StatelessScope):
        def __init__(self):
            super().__init__(collect_losses=True, initialize_variables=False)
            self.assigned = []
            self.log = []  # every assigned variable, in order (repeats kept)
            self.device = None  # TF device of the layer call running now (when copying)
            self.copies = {}  # (id(variable), device) -> (variable, device, copy)
            self.outer = _outer_graph()
            self.lifted = {}  # id(variable) -> its value read in `outer` (no copy needed)

        def add_update(self, update):
            variable, value = update
            self.log.append(variable)
            if all(v is not variable for v in self.assigned):
                self.assigned.append(variable)
            if getattr(variable, "trainable", False):
                # Later reads: the assigned value, the gradient of a read (plain Keras).
                value = _assigned_read(value, _leaf_read(self, variable))
            super().add_update((variable, value))

        def get_current_value(self, variable):
            value = self.state_mapping.get(id(variable))
            if value is not None:
                return value
            # Read inside a function Keras traces within the pass (its XLA
            # convolutions): the copy or read is made in the pass's graph.
            nested = _in_nested_function(self.outer)
            if self.device is None or id(variable) not in runner.trainable_ids:
                return _lifted_read(self, variable) if nested else None
            key = (id(variable), self.device)
            if key not in self.copies:
                if nested:
                    copy = _read_outside(variable, self.outer, self.device)
                else:
                    with tf.control_dependencies(None), tf.device(self.device):
                        copy = tf.identity(tf.stop_gradient(variable._value))
                if tape is not None:
                    tape.watch(copy)
                self.copies[key] = (variable, self.device, copy)
            return self.copies[key][2]

    return PlacementScope()


class _PlacedCall:
    """Stands in for one Keras node's operation: runs it where the plan says."""

    def __init__(self, forward, name, operation):
        self._forward = forward
        self._name = name
        self._operation = operation
        self._call_context_args = getattr(operation, "_call_context_args", {})

    def __call__(self, *args, **kwargs):
        return self._forward.call(self._name, self._operation, args, kwargs)


class _Forward:
    """State of one forward pass of the model under a placement plan."""

    def __init__(self, runner, batch_size, training, tape):
        self.runner = runner
        self.batch_size = batch_size
        self.training = training
        self.graph_mode = tape is None
        self.scope = _placement_scope(runner, tape if training else None)
        self.split = {}  # id(whole tensor) -> (whole, shares, parts)
        self.joined = {}  # (id(whole), device) -> concatenation on that device
        self.produced = {}  # (node name, plan device) -> output tensors on that device
        self.keep = []  # tensors whose ids are keys above stay alive for the pass
        self.order_skipped = 0

    # ------------------------------------------------------------ patching
    @contextlib.contextmanager
    def active(self):
        runner = self.runner
        patched = []
        try:
            for functional in runner.functionals:
                original = functional._get_operation_for_node
                by_node = runner.name_of_node

                def get_operation(node, original=original, by_node=by_node):
                    operation = original(node)
                    name = by_node.get(id(node))
                    if name is None:
                        return operation  # a nested model: its own graph is patched
                    return _PlacedCall(self, name, operation)

                functional._get_operation_for_node = get_operation
                patched.append(functional)
            top = runner.functionals[0]
            run = top._run_through_graph

            def run_through_graph(inputs, *args, **kwargs):
                from keras.src import tree

                flat = tree.flatten(inputs)
                placed = [self.place_input(ref, t) for ref, t in zip(top.inputs, flat)]
                return run(placed, *args, **kwargs)

            top._run_through_graph = run_through_graph
            patched.append(top)
            with self.scope:
                yield self
        finally:
            for functional in patched:
                for attr in ("_get_operation_for_node", "_run_through_graph"):
                    functional.__dict__.pop(attr, None)

    # -------------------------------------------------------------- inputs
    def place_input(self, reference, value):
        import tensorflow as tf

        name = self.runner.input_names.get(id(reference))
        if name is None or value is None:
            return value
        group = self.runner.group_of[name]
        devices = self.runner.devices[group.name]
        with tf.device(devices[0]):
            whole = tf.identity(value)
        plan_devices = self.runner.plan_devices[group.name]
        shares = self.shares(group)
        if len([s for s in shares if s > 0]) > 1 and self._splits(name, whole, reference):
            parts = self._split(whole, shares, name)
            for share, device, part in zip(shares, plan_devices, parts):
                if share > 0:
                    self.produced[(name, device)] = [part]
        else:
            self.produced[(name, plan_devices[0])] = [whole]
        return whole

    def shares(self, group):
        return tuple(split_batch(group.shares, self.batch_size))

    def _splits(self, name, value, symbolic):
        """Whether the input `value` of the split call `name` is split by the shares.

        Batch-major inputs are: those whose Keras tensor in the model graph
        (`symbolic`) has the graph's batch axis first (a model input or a
        layer's output; its traced value may not know its batch size
        statically, e.g. TextVectorization's output), and, for values the
        graph does not name, those whose static leading dimension is the
        batch. Dense, sparse and ragged tensors are split.

        Raises:
            BackendError: If a batch-major input of the graph has a static
                leading dimension other than the batch's (it cannot be split
                by the shares, and each part would get all its rows).
        """
        if not _is_batch_value(value):
            return False
        rows = _static_rows(value)
        if symbolic is None:
            return rows == self.batch_size
        if not _symbolic_batch_major(symbolic, self.runner.batch_dim):
            return False
        if rows is None or rows == self.batch_size:
            return True
        raise BackendError(
            f"Layer call {name!r} runs as split replicas, but its input of shape "
            f"{tuple(value.shape)} (batch-major in the model graph: "
            f"{tuple(symbolic.shape)}) has {rows} rows, not the batch's {self.batch_size}, "
            "so it cannot be split along the batch axis. Plan without splitting this "
            f"layer. Received: input of shape {tuple(value.shape)}, batch of {self.batch_size}"
        )

    # -------------------------------------------------------------- calls
    def call(self, name, operation, args, kwargs):
        runner = self.runner
        group = runner.group_of[name]
        devices = runner.devices[group.name]
        plan_devices = runner.plan_devices[group.name]
        shares = self.shares(group)
        active = [i for i, s in enumerate(shares) if s > 0]
        if len(active) <= 1:
            i = active[0] if active else 0
            args, kwargs = self._joined((args, kwargs), devices[i])
            out = self._run(name, operation, args, kwargs, devices[i], plan_devices[i])
            return out
        return self._run_split(name, operation, args, kwargs, group, shares, active)

    def _run(self, name, operation, args, kwargs, device, plan_device):
        import tensorflow as tf

        from keras.src import tree

        scope = self.scope
        args, kwargs, ordered = self._ordered(name, (args, kwargs), device, plan_device)
        with ordered, tf.device(device):
            previous, scope.device = scope.device, (device if self.training else None)
            try:
                out = operation(*args, **kwargs)
            finally:
                scope.device = previous
        self.produced[(name, plan_device)] = [t for t in tree.flatten(out) if _is_tensor(t)]
        return out

    def _run_split(self, name, operation, args, kwargs, group, shares, active):
        import tensorflow as tf

        from keras import ops
        from keras.src import tree
        from keras.src.backend import get_keras_mask
        from keras.src.backend import set_keras_mask

        runner = self.runner
        devices = runner.devices[group.name]
        plan_devices = runner.plan_devices[group.name]
        structure = (args, kwargs)
        leaves = tree.flatten(structure)
        symbolic = _symbolic_leaves(runner.graph.calls[name][1], args, kwargs)
        split_leaves = []
        for leaf in leaves:
            if self._splits(name, leaf, symbolic.get(id(leaf))):
                split_leaves.append(self._split(leaf, shares, name))
            else:
                split_leaves.append(None)
        outs = []
        state = _SplitState(self.scope, operation)
        for i in active:
            part_leaves = [
                parts[i] if parts is not None else leaf
                for leaf, parts in zip(leaves, split_leaves)
            ]
            part_args, part_kwargs = tree.pack_sequence_as(structure, part_leaves)
            first_loss = len(self.scope.losses)
            with state.part(i, shares[i], devices[i]):
                out = self._run(name, operation, part_args, part_kwargs, devices[i],
                                plan_devices[i])
            self._scale_new_losses(operation, first_loss, shares[i] / self.batch_size)
            outs.append(out)
        with tf.device(self.runner.adapter.home):
            state.combine()

        def join(*parts):
            if not _is_batch_value(parts[0]):
                return parts[0]
            if parts[0].shape.rank == 0:
                raise BackendError(
                    f"Layer call {name!r} returned a scalar, which cannot be concatenated "
                    "along the batch axis after running it as split replicas. Plan without "
                    f"splitting this layer. Received: output of shape {parts[0].shape}"
                )
            with tf.device(devices[active[0]]):
                whole = _concat_rows(list(parts))
                masks = [get_keras_mask(p) for p in parts]
                if all(m is not None for m in masks):
                    set_keras_mask(whole, ops.concatenate(masks, axis=0))
            full = [None] * len(shares)
            for i, p in zip(active, parts):
                full[i] = p
            self.split[id(whole)] = (whole, shares, full)
            self.keep.append(whole)
            return whole

        return tree.map_structure(join, *outs)

    def _split(self, tensor, shares, name):
        """Parts of a batch-major tensor by `shares` (reusing parts a split call produced).

        `tensor` may be dense, a `tf.SparseTensor` (cut with `tf.sparse.slice`)
        or a `tf.RaggedTensor` (cut by rows). When its batch size is not known
        statically (a layer such as TextVectorization traces `(None, ...)`),
        the step checks at run time that it has the batch's rows.
        """
        import tensorflow as tf

        from keras.src.backend import get_keras_mask
        from keras.src.backend import set_keras_mask

        key = id(tensor)
        known = self.split.get(key)
        if known is not None and known[1] == tuple(shares):
            return known[2]
        whole = tensor
        if known is not None:
            whole = self._join(tensor, known, _device_of(known[0]))
        device = _device_of(whole)
        # Slices, not tf.split: Grappler's arithmetic optimizer (TF 2.21) rewrote a
        # SplitV of a ConcatV2 of uneven parts wrongly in a traced step.
        mask = get_keras_mask(whole)
        parts, start = [], 0
        with tf.device(device) if device else contextlib.nullcontext():
            if _static_rows(whole) is None:
                whole = _checked_rows(whole, self.batch_size, name)
            for share in shares:
                if share == 0:
                    parts.append(None)
                    continue
                piece = _slice_rows(whole, start, share)
                if mask is not None:
                    set_keras_mask(piece, mask[start:start + share])
                parts.append(piece)
                start += share
        self.split[key] = (tensor, tuple(shares), parts)
        self.keep.append(tensor)
        return parts

    def _joined(self, structure, device):
        """Replaces split tensors in `structure` by their concatenation on `device`."""
        from keras.src import tree

        def whole(leaf):
            known = self.split.get(id(leaf)) if _is_batch_value(leaf) else None
            return leaf if known is None else self._join(leaf, known, device)

        return tree.map_structure(whole, structure)

    def _join(self, tensor, known, device):
        import tensorflow as tf

        from keras.src.backend import get_keras_mask
        from keras.src.backend import set_keras_mask

        key = (id(tensor), device)
        if key not in self.joined:
            parts = [p for p in known[2] if p is not None]
            with tf.device(device):
                joined = _concat_rows(parts) if len(parts) > 1 else tf.identity(parts[0])
            mask = get_keras_mask(tensor)
            if mask is not None:
                set_keras_mask(joined, mask)
            self.joined[key] = joined
        return self.joined[key]

    def _ordered(self, name, structure, device, plan_device):
        """Makes this call follow the previous forward entry of its device's order.

        The dependency gates the call's tensor inputs: each becomes a
        `tf.identity` on `device` with a control dependency on the previous
        entry's outputs on that plan device, so no op inside the layer (a
        variable read, a constant) gets a control input of its own. It is left
        out when the previous entry is an ancestor of this call in the model
        graph (the data already orders them).

        Putting the whole call under `tf.control_dependencies` made forward-only
        steps fail with "N nodes in a cycle": the kernel read of a Conv2D got a
        control input from the ZeroPadding2D before it, and oneDNN's graph
        rewrite fused that Pad into the Conv2D, so the fused op fed the read
        that feeds it. (Training steps escaped: they read trainable variables
        through copies made outside any control dependency.)

        Args:
            name: The graph node name of the call.
            structure: The call's `(args, kwargs)`.
            device: The TensorFlow device the call runs on.
            plan_device: The plan's name for that device.

        Returns:
            `(args, kwargs, context)`: the call's arguments (tensor inputs
            gated when a dependency is added) and a context to run the call in
            (a `tf.control_dependencies` only when the call has no tensor
            input to gate, otherwise a null context).
        """
        import tensorflow as tf

        from keras.src import tree
        from keras.src.backend import get_keras_mask
        from keras.src.backend import set_keras_mask

        args, kwargs = structure
        unordered = (args, kwargs, contextlib.nullcontext())
        if not self.graph_mode:
            return unordered
        previous = self.runner.previous_forward.get((plan_device, name))
        if previous is None:
            return unordered
        outputs = self.produced.get((previous, plan_device))
        if not outputs:
            self.order_skipped += 1
            return unordered
        if self.runner.is_ancestor(previous, name):
            return unordered
        gated = []

        def gate(leaf):
            if not _is_tensor(leaf):
                return leaf
            with tf.device(device), tf.control_dependencies(outputs):
                out = tf.identity(leaf)
            mask = get_keras_mask(leaf)
            if mask is not None:
                set_keras_mask(out, mask)
            gated.append(out)
            return out

        args, kwargs = tree.map_structure(gate, (args, kwargs))
        if not gated:  # no tensor input: order the ops of the call itself
            return args, kwargs, tf.control_dependencies(outputs)
        return args, kwargs, contextlib.nullcontext()

    def _scale_new_losses(self, operation, first, factor):
        """Weights losses added by one split replica (activity regularisers) by its share.

        Keras divides an activity regularisation loss by the batch size of
        the call; over the replicas, `sum_i (n_i / B) * reg(part_i) / n_i`
        equals `reg(whole) / B`, the loss of the unsplit call.
        """
        losses = self.scope.losses
        if len(losses) <= first:
            return
        layers = operation._flatten_layers() if hasattr(operation, "_flatten_layers") else []
        for k in range(first, len(losses)):
            old = losses[k]
            new = old * factor
            losses[k] = new
            for layer in layers:
                ids = getattr(layer, "_loss_ids", None)
                if ids is not None and id(old) in ids:
                    ids.discard(id(old))
                    ids.add(id(new))
            self.keep.append(old)


class _SplitState:
    """Makes the parts of one split layer call update its state as one call would.

    The parts of a split call run one after another in the same recording
    scope. Without this, each part would read the state the previous part
    assigned (a counter advanced once per part, a seed generator's counter
    too). Here every part starts from the state as it was before the call,
    and draws random numbers from its own seeds (part `i` from its seed
    generators' seeds plus `i x replica_random.SEED_STRIDE`, as data-parallel
    replica `i` does, so the parts' Dropout masks are not copies of one
    another); afterwards the parts' new values are combined into one
    assignment, as the data-parallel step combines its replicas': float
    state gets the share-weighted mean of the parts' values (exact for a
    moving average of per-row means; exactly the common value when the
    parts agree, e.g. a float step counter), integer state the first part's
    (seed counters, with the part's seed offset removed, advance once).
    """

    def __init__(self, scope, operation):
        from autodist_keras.backends import replica_random

        self.scope = scope
        self.before = dict(scope.state_mapping)  # the state as the call found it
        # (a functional graph may call plain Keras operations, which have no variables)
        self.seeds = (replica_random.seed_state_variables(operation)
                      if hasattr(operation, "variables") else [])
        self.order = []  # variables assigned by some part, in order
        self.values = {}  # id(variable) -> [(share, value), ...]

    @contextlib.contextmanager
    def part(self, index, share, device):
        """Runs one part (replica `index` of the group) from the state before the call."""
        import tensorflow as tf

        from autodist_keras.backends import replica_random

        scope = self.scope
        offset = {}
        if index and self.seeds:
            with tf.device(device):
                offset = dict(
                    (id(v), value)
                    for v, value in replica_random.offset_states(self.seeds, index)
                )
            scope.state_mapping.update(offset)
        first = len(scope.log)
        try:
            yield
        finally:
            touched = []
            for variable in scope.log[first:]:
                if all(v is not variable for v in touched):
                    touched.append(variable)
            for variable in touched:
                value = scope.state_mapping[id(variable)]
                if id(variable) in offset:
                    with tf.device(device):
                        value = replica_random.restore_seed(value, index, variable.dtype)
                if id(variable) not in self.values:
                    self.order.append(variable)
                    self.values[id(variable)] = []
                self.values[id(variable)].append((share, value))
            for key in set(offset) | {id(v) for v in touched}:
                if key in self.before:
                    scope.state_mapping[key] = self.before[key]
                else:
                    scope.state_mapping.pop(key, None)

    def combine(self):
        """Records one assignment per variable the parts assigned."""
        import tensorflow as tf

        for variable in self.order:
            entries = self.values[id(variable)]
            if len(entries) == 1 or not is_float(variable):
                value = entries[0][1]
            else:
                # The share-weighted mean, written as the first part's value plus
                # the weighted differences: exact when every part assigned the
                # same value (a float counter stays an integer).
                total = float(sum(s for s, _ in entries))
                first = tf.cast(entries[0][1], variable.dtype)
                value = first + tf.add_n([
                    (tf.cast(v, variable.dtype) - first) * tf.constant(s / total, variable.dtype)
                    for s, v in entries[1:]
                ])
            self.scope.add_update((variable, value))


class PlacementRuntime:
    """Builds the traced train, test and predict steps of one model under a multi-group plan.

    Args:
        adapter: The `TensorFlowAdapter`.
        model: The compiled Keras model.
        plan: The validated `Plan` (several layer groups).
        graph: The model's `ModelGraph` (from `ModelGraph.from_keras`).

    Raises:
        BackendError: If the plan cannot run here (see `unsupported`).
    """

    def __init__(self, adapter, model, plan, graph):
        reason = unsupported(plan, graph)
        if reason:
            raise BackendError(
                f"The TensorFlow adapter cannot run this placement plan: {reason}. "
                f"Received: {len(plan.groups)} groups"
            )
        self.adapter = adapter
        self.model = model
        self.plan = plan
        self.graph = graph
        self.group_of = {layer: g for g in plan.groups for layer in g.layers}
        self.devices = {g.name: [adapter.tf_device(r.device) for r in g.replicas] for g in plan.groups}
        self.plan_devices = {g.name: [r.device for r in g.replicas] for g in plan.groups}
        self.node_of = {n: adapter.cluster.device(n).node for n in plan.devices}
        self.name_of_node = {
            id(knode): name for name, (_, knode) in graph.calls.items() if knode is not None
        }
        self.functionals = _functionals(model)
        self.input_names = {}
        for name in graph.inputs:
            _, knode = graph.calls[name]
            for t in knode.outputs:
                self.input_names[id(t)] = name
        self.previous_forward = {}
        for device, entries in plan.order.items():
            last = None
            for layer, phase in entries:
                if phase != "forward":
                    continue
                if last is not None:
                    self.previous_forward[(device, layer)] = last
                last = layer
        self.dataflow = graph.nx  # networkx DiGraph of the layer calls
        self.batch_dim = _batch_dim(graph)  # the graph's leading dimension (None: any batch)
        variables = model.trainable_variables
        self.trainable_ids = {id(v) for v in variables}
        # Variables of layers called once in the graph: their gradients on several
        # devices are the parts of one split call (`_reduce` merges distinct-id rows).
        calls = {}
        for op, _ in graph.calls.values():
            for v in getattr(op, "trainable_weights", None) or []:
                calls[id(v)] = calls.get(id(v), 0) + 1
        self.single_call_ids = {i for i, n in calls.items() if n == 1}
        self.eager_rows_deduplicated = {}  # {variable path: bool}, for eager steps
        self.layout = tf_reduce.bucket_layout(
            plan, [v.path for v in variables],
            [_dtype_name(v) for v in variables],
        )
        outputs = [self.group_of[n] for n in graph.outputs] or [plan.groups[-1]]
        self.output_device = self.devices[outputs[-1].name][0]
        self.last_pass = None

    def is_ancestor(self, earlier, later):
        """Whether the outputs of graph node `earlier` flow (maybe indirectly) into `later`."""
        import networkx

        return (earlier != later and earlier in self.dataflow and later in self.dataflow
                and networkx.has_path(self.dataflow, earlier, later))

    def info(self):
        """Where each graph node runs (TF devices), for `adapter.runtime_info`."""
        return {
            "mode": "single-process placement",
            "groups": {
                g.name: {"layers": list(g.layers), "devices": self.devices[g.name],
                         "shares": list(g.shares)}
                for g in self.plan.groups
            },
            "home_device": self.adapter.home,
            "output_device": self.output_device,
            "buckets": len(self.layout),
        }

    # ------------------------------------------------------------ forward
    def _forward(self, x, batch_size, training, tape=None):
        model = self.model
        forward = _Forward(self, batch_size, training, tape)
        with forward.active():
            if model._call_has_training_arg:
                y_pred = model(x, training=training)
            else:
                y_pred = model(x)
        from autodist_keras.backends.tensorflow_adapter import _restore_losses

        _restore_losses(model, forward.scope)
        self.last_pass = forward
        return y_pred, forward

    def _assign_state(self, forward):
        import tensorflow as tf

        scope = forward.scope
        with tf.device(self.adapter.home):
            for variable in scope.assigned:
                variable.assign(scope.state_mapping[id(variable)])

    # -------------------------------------------------------------- steps
    def train_step(self, batch_size):
        """The body of one traced training step for global batches of `batch_size`."""
        import tensorflow as tf

        model = self.model
        adapter = self.adapter

        def step(x, y, sw):
            variables = model.trainable_variables
            eager = tf.executing_eagerly()
            tape = tf.GradientTape(persistent=False) if eager else None
            with tape if tape is not None else contextlib.nullcontext():
                y_pred, forward = self._forward(x, batch_size, True, tape)
                with tf.device(self.output_device):
                    loss = model._compute_loss(
                        x=x, y=y, y_pred=y_pred, sample_weight=sw, training=True
                    )
                    scaled = model.optimizer.scale_loss(loss) if model.optimizer is not None else loss
            copies = list(forward.scope.copies.values())
            xs = [c for _, _, c in copies] + [v._value for v in variables]
            if eager:
                grads = tape.gradient(scaled, xs)
            else:
                grads = tf.gradients(scaled, xs)
            copy_grads, direct = grads[:len(copies)], grads[len(copies):]
            per_var = {}
            for (variable, device, _), g in zip(copies, copy_grads):
                if g is not None:
                    per_var.setdefault(id(variable), []).append((device, g))
            self._assign_state(forward)
            with tf.device(adapter.home):
                reduced = self._reduce(variables, per_var, direct, x)
                if model.optimizer is not None:
                    model.optimizer.apply_gradients(zip(reduced, variables))
                model._loss_tracker.update_state(loss, sample_weight=batch_size)
                return model.compute_metrics(x, y, y_pred, sample_weight=sw)

        return step

    def test_step(self, batch_size):
        """The body of one traced evaluation step."""
        import tensorflow as tf

        model = self.model

        def step(x, y, sw):
            y_pred, forward = self._forward(x, batch_size, False)
            self._assign_state(forward)
            with tf.device(self.output_device):
                loss = model._compute_loss(
                    x=x, y=y, y_pred=y_pred, sample_weight=sw, training=False
                )
            with tf.device(self.adapter.home):
                model._loss_tracker.update_state(loss, sample_weight=batch_size)
                return model.compute_metrics(x, y, y_pred, sample_weight=sw)

        return step

    def predict_step(self, batch_size):
        """The body of one traced prediction step."""

        def step(x):
            y_pred, forward = self._forward(x, batch_size, False)
            self._assign_state(forward)
            return y_pred

        return step

    # ---------------------------------------------------------- reduction
    def _rows_deduplicated(self, variable, slices, x):
        """Whether the parts' sparse gradient rows of `variable` are distinct ids.

        Read from the traced step's graph (`tf_reduce.rows_from_unique`); in an
        eager step from one trace of the model on `x`, kept per variable
        (`tf_reduce.traced_rows_deduplicated`).
        """
        return tf_reduce.rows_deduplicated(slices, variable, self.model, x,
                                           self.eager_rows_deduplicated)

    def _reduce(self, variables, per_var, direct, x):
        """Sums each variable's per-device gradients with its planned sync method.

        Per bucket (in plan order), the variables whose gradients come from
        the same devices are fused into one buffer per device and summed by
        `tf_reduce.reduce_local` (ring, tree, hierarchical, or on the PS
        server); sparse gradients are concatenated (rows of distinct ids of
        one split call merged; `x`, the batch, serves an eager step's check).
        A gradient that reaches a variable directly (weight regularisers,
        computed where the loss is) is added on the home device.
        """
        import tensorflow as tf

        adapter = self.adapter
        home = adapter.home
        shapes = [tuple(v.shape) for v in variables]
        reduced = [None] * len(variables)
        for bucket in self.layout:
            server = adapter.tf_device(bucket.server) if bucket.method == "ps" else None
            target = server or home
            runs = {}
            for i in bucket.indices:
                entries = per_var.get(id(variables[i]))
                if not entries:
                    continue
                if any(isinstance(g, tf.IndexedSlices) for _, g in entries):
                    slices = [g for _, g in entries]
                    # The parts of one split call whose rows are distinct ids (a
                    # Dense on a SparseTensor): one device's gradient has each id
                    # of the batch once (`tf_reduce.rows_from_unique`).
                    merge = (len(slices) > 1 and id(variables[i]) in self.single_call_ids
                             and all(isinstance(g, tf.IndexedSlices) for g in slices)
                             and self._rows_deduplicated(variables[i], slices, x))
                    with tf.device(target):
                        reduced[i] = _sum_sparse(slices, merge)
                    continue
                key = tuple(d for d, _ in entries)
                runs.setdefault(key, []).append(i)
            for devices, indices in runs.items():
                dtype = variables[indices[0]].dtype
                b_shapes = [shapes[i] for i in indices]
                grads = {i: dict(per_var[id(variables[i])]) for i in indices}
                buffers = []
                for device in devices:
                    with tf.device(device):
                        buffers.append(
                            tf_reduce.fuse([grads[i][device] for i in indices], b_shapes, dtype)
                        )
                nodes = [self._node_of_tf_device(d) for d in devices]
                summed = tf_reduce.reduce_local(
                    buffers, list(devices), target, bucket.method, bucket.algorithm, server, nodes
                )
                with tf.device(target):
                    for i, g in zip(indices, tf_reduce.unfuse(summed, b_shapes)):
                        reduced[i] = g
        with tf.device(home):
            for i, g in enumerate(direct):
                if g is None:
                    continue
                if reduced[i] is None:
                    reduced[i] = g
                elif isinstance(reduced[i], tf.IndexedSlices) or isinstance(g, tf.IndexedSlices):
                    reduced[i] = tf.convert_to_tensor(reduced[i]) + tf.convert_to_tensor(g)
                else:
                    reduced[i] = reduced[i] + g
        return reduced

    def _node_of_tf_device(self, device):
        for group in self.plan.groups:
            for name, tf_name in zip(self.plan_devices[group.name], self.devices[group.name]):
                if tf_name == device:
                    return self.node_of[name]
        return None


def _sum_sparse(slices, merge=False):
    """Concatenates `IndexedSlices` gradients (one per device) into one.

    Args:
        slices: The devices' gradients of one variable.
        merge: Whether rows of the same index are summed into one
            (`tf_reduce.merge_rows`): for the split parts of one call whose
            rows are distinct ids, as one device computes the whole batch's.
            Otherwise the rows are concatenated, as TensorFlow joins the
            gradients of several lookups on one device.

    Returns:
        One gradient.
    """
    import tensorflow as tf

    if len(slices) == 1:
        return slices[0]
    if not all(isinstance(s, tf.IndexedSlices) for s in slices):
        return tf.add_n([tf.convert_to_tensor(s) for s in slices])
    return tf.IndexedSlices(*tf_reduce.concat_slices(slices, merge), slices[0].dense_shape)


def _is_tensor(value):
    import tensorflow as tf

    return isinstance(value, tf.Tensor)


def _is_batch_value(value):
    """Whether `value` is a tensor a split call can cut by rows (dense, sparse, ragged)."""
    import tensorflow as tf

    return isinstance(value, (tf.Tensor, tf.SparseTensor, tf.RaggedTensor))


def _static_rows(value):
    """The static leading dimension of a dense, sparse or ragged tensor (None: unknown)."""
    shape = value.shape
    if shape.rank is None or shape.rank < 1:
        return None
    return shape[0]


def _symbolic_batch_major(keras_tensor, batch_dim):
    """Whether a Keras tensor of the model graph has the graph's batch axis first."""
    shape = tuple(keras_tensor.shape)
    return bool(shape) and shape[0] == batch_dim


def _symbolic_leaves(knode, args, kwargs):
    """Maps `id` of each value of a layer call to the Keras tensor it stands for.

    Keras' `_run_through_graph` fills the node's symbolic arguments in
    (`node.arguments.fill_in`), so the call's `args` and the node's keyword
    arguments have the node's structure; keyword arguments Keras adds
    (`training`) are not Keras tensors.
    """
    from keras import KerasTensor
    from keras.src import tree

    arguments = getattr(knode, "arguments", None)
    if arguments is None:
        return {}
    pairs = [(arguments.args, args)]
    pairs += [(v, kwargs[k]) for k, v in arguments.kwargs.items() if k in kwargs]
    found = {}
    for symbolic, actual in pairs:
        try:
            flat_symbolic, flat_actual = tree.flatten(symbolic), tree.flatten(actual)
        except (TypeError, ValueError):
            continue
        if len(flat_symbolic) != len(flat_actual):
            continue
        for s, a in zip(flat_symbolic, flat_actual):
            if isinstance(s, KerasTensor) and a is not None:
                found[id(a)] = s
    return found


def _device_of(value):
    """The device a dense, sparse or ragged tensor was placed on ("" when unknown)."""
    import tensorflow as tf

    if isinstance(value, tf.SparseTensor):
        value = value.values
    elif isinstance(value, tf.RaggedTensor):
        value = value.flat_values
    return getattr(value, "device", "") or ""


def _checked_rows(value, rows, name):
    """`value` with a run-time check that it has `rows` rows (and that static size, when
    dense or sparse); `name` is the split layer call, for the message."""
    import tensorflow as tf

    from keras.src.backend import get_keras_mask
    from keras.src.backend import set_keras_mask

    if isinstance(value, tf.SparseTensor):
        actual = value.dense_shape[0]
    elif isinstance(value, tf.RaggedTensor):
        actual = value.nrows()
    else:
        actual = tf.shape(value, out_type=tf.int64)[0]
    check = tf.debugging.assert_equal(
        tf.cast(actual, tf.int64), tf.constant(rows, tf.int64),
        message=(
            # (no quotes: TensorFlow escapes them in the error it raises)
            f"autodist_keras placement: layer call {name} runs as split replicas and gets "
            f"an input of shape {tuple(value.shape)} that is batch-major in the model graph, "
            f"but it does not have the batch size of {rows} rows, so it cannot be split along "
            "the batch axis; plan without splitting this layer. Received rows:"
        ),
    )
    with tf.control_dependencies([check]):
        checked = tf.identity(value)
    if isinstance(value, (tf.Tensor, tf.SparseTensor)):
        checked.set_shape([rows] + list(value.shape)[1:])
    mask = get_keras_mask(value)
    if mask is not None:
        set_keras_mask(checked, mask)
    return checked


def _slice_rows(value, start, size):
    """Rows `start:start + size` of a dense, sparse or ragged tensor."""
    import tensorflow as tf

    if isinstance(value, tf.SparseTensor):
        rank = value.shape.rank
        if rank is None:
            raise BackendError(
                "A sparse input of a split layer call has no static rank, so it cannot be "
                f"split along the batch axis. Received: sparse tensor of shape {value.shape}"
            )
        begin = [start] + [0] * (rank - 1)
        extent = tf.concat([tf.constant([size], tf.int64), value.dense_shape[1:]], axis=0)
        piece = tf.sparse.slice(value, begin, extent)
        piece.set_shape([size] + list(value.shape)[1:])
        return piece
    return value[start:start + size]


def _concat_rows(parts):
    """Concatenates dense, sparse or ragged parts along the batch axis."""
    import tensorflow as tf

    if isinstance(parts[0], tf.SparseTensor):
        return tf.sparse.concat(0, parts)
    return tf.concat(parts, axis=0)


def _dtype_name(variable):
    import keras

    return keras.backend.standardize_dtype(variable.dtype)
