"""Op-fusion regions as XLA clusters in a traced TensorFlow step.

Disco plans carry `plan.op_fusion`: lists of adjacent layers to compile as one
unit. On TensorFlow a region becomes one XLA cluster: every op its layers
create in the forward pass, and every gradient op the tape creates for them,
gets the attributes `_XlaCompile=True` and one `_XlaScope` per (region,
replica), the same attributes `tf.xla.experimental.jit_scope` sets. TensorFlow's
XLA pass then compiles each scope into one fused kernel cluster, on the
replica's device.

Only layers called inside `FusionRegions.recording()` while a `tf.function`
traces are affected; eager calls and layers outside every region run as usual.

A region with a layer that draws random numbers (a layer, or a layer nested in
it, holding a `keras.random.SeedGenerator`: Dropout, GaussianNoise, random
augmentation) is not compiled: XLA draws different numbers from TensorFlow's
own kernels for the same seeds (Dropout masks unlike one device's). Such a
region runs uncompiled, layer by layer, and `fallbacks` says why, as in the
PyTorch runtime (`torch_fusion.py`); `runtime_info["op_fusion"]` reports it.

Example:

```python
regions = FusionRegions(model, [["conv0", "bn0", "relu0"]])
with regions.recording(replica=0):
    with tf.GradientTape() as tape:
        y = model(x, training=True)
        loss = ...
    grads = tape.gradient(loss, model.trainable_variables)
regions.mark()   # inside the traced function, after the gradients
```
"""

import contextlib

from autodist_keras.graph.model_graph import random_layer

GRADIENT_PREFIX = "gradient_tape/"


class FusionRegions:
    """Marks the ops of op-fusion regions for XLA, one trace at a time.

    Args:
        model: The Keras model whose layers the regions name.
        regions: List of lists of layer names (`fusion.op_fusion.regions_for(plan)`).
            Names that are not layers of `model` raise `BackendError`.

    Attributes:
        regions: The regions of two or more layers.
        realised: Indexes (into `regions`) of the regions compiled by XLA.
        fallbacks: Dict `{index: reason}` of the regions run uncompiled.
    """

    def __init__(self, model, regions):
        from autodist_keras.fusion.op_fusion import region_layers

        self.regions, layers = region_layers(model, regions)
        self.realised = []
        self.fallbacks = {}
        self._region_of = {}
        for index, region in enumerate(self.regions):
            reason = _region_problem([layers[name] for name in region])
            if reason is not None:
                self.fallbacks[index] = reason
                continue
            self.realised.append(index)
            for name in region:
                self._region_of[name] = index
        self._layers = {name: layers[name] for name in self._region_of}
        self._ranges = []  # (first_id, last_id, scope) of recorded layer calls

    @property
    def active(self):
        """True when at least one region of two or more layers is compiled."""
        return bool(self.realised)

    def summary(self):
        """A JSON-ready dict: regions, realised, fallbacks (with reasons), compiler."""
        return {
            "regions": [list(r) for r in self.regions],
            "realised": list(self.realised),
            "fallbacks": {str(k): v for k, v in self.fallbacks.items()},
            "compiler": "xla",
        }

    @contextlib.contextmanager
    def recording(self, replica=0):
        """Records which ops each region's layers create while tracing.

        Args:
            replica: Index of the replica being traced; each replica's regions
                get their own XLA scopes (a cluster cannot span devices).
        """
        if not self.active:
            yield self
            return
        import tensorflow as tf

        originals = {}
        for name, layer in self._layers.items():
            original = layer.call
            scope = f"autodist_fusion_r{self._region_of[name]}_p{replica}"
            originals[name] = original
            # Instance attribute: Keras' Operation.__call__ looks `self.call` up per call.
            object.__setattr__(layer, "call", _recording_call(original, scope, self._ranges, tf))
        try:
            yield self
        finally:
            for name, layer in self._layers.items():
                object.__delattr__(layer, "call")

    def mark(self):
        """Sets the XLA attributes on the recorded ops and their gradient ops.

        Call it inside the traced function, after `tape.gradient`.

        Returns:
            The number of ops marked (0 outside a `tf.function` trace).
        """
        import tensorflow as tf
        from tensorflow.core.framework import attr_value_pb2

        ranges, self._ranges = self._ranges, []
        if not ranges or tf.executing_eagerly():
            return 0
        graph = tf.compat.v1.get_default_graph()
        operations = graph.get_operations()
        scope_of_op = {}
        for op in operations:
            for first, last, scope in ranges:
                if first < op._id <= last:
                    scope_of_op[op.name] = scope
                    break
        marked = 0
        for op in operations:
            scope = scope_of_op.get(op.name)
            if scope is None and op.name.startswith(GRADIENT_PREFIX):
                scope = _forward_scope(op.name[len(GRADIENT_PREFIX):], scope_of_op)
            if scope is None:
                continue
            op._set_attr("_XlaCompile", attr_value_pb2.AttrValue(b=True))
            op._set_attr("_XlaScope", attr_value_pb2.AttrValue(s=scope.encode()))
            marked += 1
        return marked


def _recording_call(original, scope, ranges, tf):
    def call(*args, **kwargs):
        if tf.executing_eagerly():
            return original(*args, **kwargs)
        graph = tf.compat.v1.get_default_graph()
        before = _last_op_id(graph)
        outputs = original(*args, **kwargs)
        ranges.append((before, _last_op_id(graph), scope))
        return outputs

    return call


def _last_op_id(graph):
    """Id of the newest op in `graph` (ids grow as ops are added)."""
    # Graph.version grows with every op added; op ids run one ahead of it.
    return graph.version + 1


def _forward_scope(path, scope_of_op):
    """Scope of the forward op whose name is the longest prefix of `path`."""
    parts = path.split("/")
    for end in range(len(parts), 0, -1):
        scope = scope_of_op.get("/".join(parts[:end]))
        if scope is not None:
            return scope
    return None


def _region_problem(layers):
    """Why a region of `layers` must not be compiled, or None."""
    for layer in layers:
        drawing = random_layer(layer)
        if drawing is not None:
            inner = "" if drawing is layer else f" (its layer {drawing.name!r})"
            return (f"layer {layer.name!r}{inner} draws random numbers (e.g. Dropout), which "
                    "compiled code would draw differently from Keras's own call")
    return None


def run_info(fusion):
    """The adapter's `runtime_info` facts for `fusion` (a `FusionRegions` or None)."""
    return {"op_fusion_regions": len(fusion.realised) if fusion else 0,
            "op_fusion": fusion.summary() if fusion else None}


def for_plan(model, plan, device_kinds, policy="auto"):
    """The `FusionRegions` to realise for `plan`, or None.

    Args:
        model: The Keras model.
        plan: The `Plan` (its `op_fusion` regions).
        device_kinds: Kinds of the replicas' devices (`"gpu"`, `"cpu"`).
        policy: `"auto"` realises the regions when every replica is a GPU
            (`fusion.op_fusion.compiled_by_default`), `"on"` always, `"off"`
            never.

    Returns:
        A `FusionRegions`, or None when the policy compiles nothing. Regions
        with random layers are in its `fallbacks` (its `active` is False when
        no region is left to compile).
    """
    from autodist_keras.fusion.op_fusion import regions_to_realise

    regions = regions_to_realise(plan, device_kinds, policy)
    return None if regions is None else FusionRegions(model, regions)
