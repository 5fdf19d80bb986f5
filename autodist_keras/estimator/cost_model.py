"""Cost models: how long a layer, a transfer or an update takes on a device.

The simulator asks a cost model for every duration it needs, through the
`CostModel` interface below. `AnalyticCostModel` answers from first
principles (a roofline per layer and device, alpha-beta links); a profiled or
learned cost model can replace it by implementing the same methods (usually by
subclassing `AnalyticCostModel` and correcting its answers).

The analytic roofline of one layer call on `batch` samples:

```
time = max(FLOPs / (peak FLOP/s x compute efficiency),
           bytes / (memory bandwidth x memory efficiency))
       + kernels x launch overhead
```

- FLOPs: `node.forward_flops * batch` or `node.backward_flops * batch`.
- Bytes moved, forward: weights (trainable and non-trainable) + input
  activations + output activations. Backward: read the weights, write their
  gradients (2 x weights), read the input activations and write their
  gradients (2 x inputs), read the output gradient (1 x outputs).
- Kernels: one forward; backward two for a layer with trainable weights
  (input gradient and weight gradient), else one. An `InputLayer` costs 0.

Constants (documented guesses, to be corrected by profiling; see
`docs/estimator.md`):

| constant | GPU | CPU |
| --- | --- | --- |
| compute efficiency, matmul-like (Dense, Conv, attention, RNN) | 0.55 | 0.40 |
| compute efficiency, depthwise / separable conv | 0.20 | 0.15 |
| compute efficiency, everything else | 0.25 | 0.10 |
| memory bandwidth efficiency | 0.75 | 0.50 |
| launch overhead per kernel | 8 us | 25 us |

GPU figures follow what cuDNN / cuBLAS reach on mid-size layers in FP32 and
the 5-10 us per-op launch; CPU figures reflect oneDNN / ATen on a few cores
and a larger per-op dispatch cost.

Host time on a GPU, PyTorch backend (`framework="torch"`): Keras runs eagerly
on PyTorch, so every layer's forward call costs the host a fixed time in
Python to dispatch its kernels, and the GPU cannot go faster than the host
feeds it. A layer's forward pass on a GPU costs `max(device time, host time)`
(`TORCH_GPU_HOST_S` per layer type, by category for other types); the
backward pass runs in PyTorch's C++ autograd engine and keeps the launch
overhead; each step adds a fixed host time for the loss, Keras's train step
and the optimizer's Python (`TORCH_GPU_STEP_HOST_S`). Measured on NVIDIA H200
machines (Keras 3.15, PyTorch 2.11; `benchmarks/gpu_check.py`;
docs/estimator.md "On a GPU"), they depend on the host CPU: two machines
differed by up to 1.9x. TensorFlow runs a traced graph, whose per-op host cost
is small; no TensorFlow GPU was measured, so TensorFlow keeps the launch
overhead alone.

Optimizer update: Adam reads the parameter, its gradient and two slots and
writes the parameter and the two slots: `7 x parameter bytes`, memory-bound,
plus one launch per tensor (`ADAM_UPDATE_BYTES_FACTOR`).

Example:

```python
cost = AnalyticCostModel(cluster)
t = cost.layer_time(graph.nodes["conv1"], cluster.device("node0/gpu0"), 64, "forward")
t = cost.transfer_time(4 * 2**20, "node0/gpu0", "node0/gpu1")
t = cost.allreduce_time(100 * 2**20, cluster.names, "ring")
```
"""

import copy
import math

from autodist_keras.devices.detect import active_keras_backend
from autodist_keras.errors import EstimatorError
from autodist_keras.estimator.comm import CommModel

PHASES = ("forward", "backward")

MATMUL_TYPES = frozenset(
    {
        "Dense", "EinsumDense", "Conv1D", "Conv2D", "Conv3D", "Conv1DTranspose",
        "Conv2DTranspose", "Conv3DTranspose", "MultiHeadAttention", "GroupedQueryAttention",
        "Attention", "AdditiveAttention", "LSTM", "GRU", "SimpleRNN", "Bidirectional",
        "ConvLSTM1D", "ConvLSTM2D", "ConvLSTM3D", "TimeDistributed",
    }
)
DEPTHWISE_TYPES = frozenset({"DepthwiseConv1D", "DepthwiseConv2D", "SeparableConv1D", "SeparableConv2D"})
FREE_TYPES = frozenset({"InputLayer"})

COMPUTE_EFFICIENCY = {
    "gpu": {"matmul": 0.55, "depthwise": 0.20, "other": 0.25},
    "cpu": {"matmul": 0.40, "depthwise": 0.15, "other": 0.10},
}
MEMORY_EFFICIENCY = {"gpu": 0.75, "cpu": 0.50}
LAUNCH_OVERHEAD_S = {"gpu": 8e-6, "cpu": 25e-6}
# Host time of one eager Keras layer call's forward pass on a GPU, PyTorch
# backend, seconds: the profiler's figures on an NVIDIA H200 host
# (benchmarks/gpu_check.py) x 1.1, the factor that fits 17 step times of ten
# models best. The backward pass runs in PyTorch's C++ autograd engine: its
# host time fits as 0 (the launch overhead alone).
TORCH_GPU_HOST_S = {
    "Dense": 344e-6,
    "Conv2D": 342e-6,
    "MultiHeadAttention": 1989e-6,
    "BatchNormalization": 967e-6,
    "LayerNormalization": 208e-6,
    "Embedding": 304e-6,
    "Add": 392e-6,
    "ReLU": 139e-6,
    "MaxPooling2D": 210e-6,
    "GlobalAveragePooling1D": 240e-6,
    "GlobalAveragePooling2D": 174e-6,
    "PositionEmbedding": 129e-6,
}
# Types not measured, by category.
TORCH_GPU_HOST_BY_CATEGORY_S = {"matmul": 344e-6, "depthwise": 342e-6, "other": 210e-6}
TORCH_GPU_STEP_HOST_S = 4.0e-3
ADAM_UPDATE_BYTES_FACTOR = 7.0
AGGREGATE_BYTES_FACTOR = 1.0  # per input buffer read, plus one write of the result
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int32": 4, "int64": 8}


def op_category(layer_type):
    """Returns `"matmul"`, `"depthwise"`, `"free"` or `"other"` for a layer type."""
    if layer_type in FREE_TYPES:
        return "free"
    if layer_type in DEPTHWISE_TYPES:
        return "depthwise"
    if layer_type in MATMUL_TYPES:
        return "matmul"
    return "other"


def _computes_in_half(node, device):
    """Whether the layer computes in a half-precision dtype the device's tensor cores
    run at its FP16 peak: float16, or bfloat16 on Ampere and later GPUs."""
    dtypes = getattr(node, "output_dtypes", None) or ()
    if not dtypes or dtypes[0] not in ("float16", "bfloat16"):
        return False
    from autodist_keras.devices.catalog import has_bfloat16_tensor_cores

    return dtypes[0] == "float16" or has_bfloat16_tensor_cores(getattr(device, "model", None))


def input_bytes_per_sample(node, dtype_bytes=4):
    """Bytes of a node's input activations per sample (unknown dims count as 1)."""
    total = 0
    for shape in node.input_shapes or []:
        if shape is None:
            continue
        count = 1
        for dim in shape:
            count *= int(dim) if dim is not None else 1
        total += count
    return total * dtype_bytes


class CostModel:
    """The interface the simulator uses for every duration, in seconds.

    Devices are `devices.Device` objects or device names (resolved through
    `cluster`). A replacement cost model (profiled or learned) implements the
    same methods; `with_cluster(cluster)` returns a model bound to the cluster
    being simulated.

    Args:
        cluster: The `Cluster` whose devices and topology the model prices.
    """

    def __init__(self, cluster=None):
        self.cluster = cluster

    def with_cluster(self, cluster):
        """Returns this model bound to `cluster` (itself when already bound).

        The default makes a shallow copy with `cluster` replaced; override it
        when the model caches anything that depends on the cluster.
        """
        if cluster is self.cluster:
            return self
        clone = copy.copy(self)
        clone.cluster = cluster
        return clone

    def layer_time(self, node, device, batch, phase):
        """Time of one call of graph node `node` on `batch` samples.

        Args:
            node: A `graph.LayerNode`.
            device: A `Device` (or its name).
            batch: Number of samples (0 costs 0).
            phase: `"forward"` or `"backward"`.
        """
        raise NotImplementedError

    def transfer_time(self, nbytes, src, dst):
        """Time to move `nbytes` from device `src` to device `dst` (names)."""
        raise NotImplementedError

    def allreduce_time(self, nbytes, devices, algorithm="ring"):
        """Time of one all-reduce of `nbytes` over `devices` (names, ring order)."""
        raise NotImplementedError

    def update_time(self, nbytes, device, num_tensors=1):
        """Optimizer update of `nbytes` of parameters held in `num_tensors` tensors."""
        raise NotImplementedError

    def aggregate_time(self, nbytes, num_inputs, device):
        """Summing `num_inputs` gradient buffers of `nbytes` each (PS server)."""
        raise NotImplementedError

    def step_overhead_time(self, device):
        """Fixed time per training step on `device` outside the layers (default 0)."""
        return 0.0

    def replica_update_time(self, nbytes, device, num_tensors=1):
        """A replica's update task in a step: its optimizer update plus the step's
        fixed overhead (`update_time + step_overhead_time`)."""
        return self.update_time(nbytes, device, num_tensors) + self.step_overhead_time(device)


class WrappedCostModel(CostModel):
    """A cost model over another one: it delegates every duration to `base`.

    Subclasses override what they price differently (usually `layer_time`)
    and inherit the delegation of transfers, all-reduces, updates and
    aggregation, so a wrapper can never drop one of them.

    Args:
        base: The wrapped `CostModel` (analytic, profiled or learned); its
            `cluster` becomes this model's.

    Example:

    ```python
    class Doubled(WrappedCostModel):
        def layer_time(self, node, device, batch, phase):
            return 2.0 * self.base.layer_time(node, device, batch, phase)

    cost = Doubled(AnalyticCostModel(cluster))
    ```
    """

    def __init__(self, base):
        super().__init__(getattr(base, "cluster", None))
        self.base = base

    def base_with_cluster(self, cluster):
        """`base` bound to `cluster` (`base` itself when it cannot rebind)."""
        return self.base.with_cluster(cluster) if hasattr(self.base, "with_cluster") else self.base

    def layer_time(self, node, device, batch, phase):
        return self.base.layer_time(node, device, batch, phase)

    def transfer_time(self, nbytes, src, dst):
        return self.base.transfer_time(nbytes, src, dst)

    def allreduce_time(self, nbytes, devices, algorithm="ring"):
        return self.base.allreduce_time(nbytes, devices, algorithm)

    def update_time(self, nbytes, device, num_tensors=1):
        return self.base.update_time(nbytes, device, num_tensors)

    def aggregate_time(self, nbytes, num_inputs, device):
        return self.base.aggregate_time(nbytes, num_inputs, device)

    def step_overhead_time(self, device):
        return self.base.step_overhead_time(device)


class AnalyticCostModel(CostModel):
    """Roofline compute costs and alpha-beta communication costs.

    Args:
        cluster: The `Cluster`; needed for transfers and collectives, and to
            resolve device names.
        compute_efficiency: Overrides of `COMPUTE_EFFICIENCY`, a dict
            `{kind: {category: fraction}}`.
        memory_efficiency: Overrides of `MEMORY_EFFICIENCY`, `{kind: fraction}`.
        launch_overhead_s: Overrides of `LAUNCH_OVERHEAD_S`, `{kind: seconds}`.
        precision: `"fp32"` (default) or `"mixed"` (matmul-like layers use
            the device's FP16 peak). Either way a matmul-like layer that
            computes in float16 (its output dtype: a `mixed_float16` policy,
            or a float16 layer) uses the FP16 peak, and so does one in
            bfloat16 on an Ampere or later GPU (Volta, Turing and Pascal
            have no bfloat16 tensor cores).
        dtype_bytes: Bytes per activation element for input activations.
        framework: The Keras backend that will run the plan (`"torch"`,
            `"tensorflow"`, ...); default the active one. On the PyTorch
            backend a GPU layer costs at least its host dispatch time (see
            the module docs); other backends add no host time.

    Example:

    ```python
    cost = AnalyticCostModel(Cluster.from_string("2xV100"), precision="mixed")
    ```
    """

    def __init__(
        self,
        cluster=None,
        compute_efficiency=None,
        memory_efficiency=None,
        launch_overhead_s=None,
        precision="fp32",
        dtype_bytes=4,
        framework=None,
    ):
        super().__init__(cluster)
        self.framework = framework if framework is not None else active_keras_backend()
        if precision not in ("fp32", "mixed"):
            raise EstimatorError(
                f"precision must be 'fp32' or 'mixed'. Received: precision={precision!r}"
            )
        self.compute_efficiency = {k: dict(v) for k, v in COMPUTE_EFFICIENCY.items()}
        for kind, values in (compute_efficiency or {}).items():
            self.compute_efficiency.setdefault(kind, {}).update(values)
        self.memory_efficiency = dict(MEMORY_EFFICIENCY, **(memory_efficiency or {}))
        self.launch_overhead_s = dict(LAUNCH_OVERHEAD_S, **(launch_overhead_s or {}))
        for table, name in (
            (self.memory_efficiency, "memory_efficiency"),
            *[(v, "compute_efficiency") for v in self.compute_efficiency.values()],
        ):
            for key, value in table.items():
                if not (0 < value <= 1):
                    raise EstimatorError(
                        f"{name}[{key!r}] must be a fraction in (0, 1]. Received: {value!r}"
                    )
        for key, value in self.launch_overhead_s.items():
            if value < 0:
                raise EstimatorError(
                    f"launch_overhead_s[{key!r}] must be >= 0 seconds. Received: {value!r}"
                )
        self.precision = precision
        self.dtype_bytes = int(dtype_bytes)
        self._comm = None
        self._input_bytes = {}

    # ------------------------------------------------------------ plumbing
    def config(self):
        """The constants of this model, as a JSON-ready dict."""
        return {
            "type": type(self).__name__,
            "compute_efficiency": self.compute_efficiency,
            "memory_efficiency": self.memory_efficiency,
            "launch_overhead_s": self.launch_overhead_s,
            "precision": self.precision,
            "dtype_bytes": self.dtype_bytes,
            "framework": self.framework,
        }

    def with_cluster(self, cluster):
        clone = super().with_cluster(cluster)
        if clone is not self:
            clone._comm = None
        return clone

    @property
    def comm(self):
        """The `CommModel` over the bound cluster's topology."""
        if self._comm is None:
            if self.cluster is None:
                raise EstimatorError(
                    "This cost model is not bound to a cluster, so it cannot price "
                    "transfers. Create it as AnalyticCostModel(cluster) or call "
                    "with_cluster(cluster). Received: cluster=None"
                )
            self._comm = CommModel(
                self.cluster.topology, {d.name: d.node for d in self.cluster.devices}
            )
        return self._comm

    def _device(self, device):
        if isinstance(device, str):
            if self.cluster is None:
                raise EstimatorError(
                    "A device name needs a cluster to resolve it; pass a Device object "
                    f"or bind the cost model to a cluster. Received: {device!r}"
                )
            return self.cluster.device(device)
        return device

    def _kind(self, device):
        kind = getattr(device, "kind", "gpu")
        return kind if kind in self.memory_efficiency else "gpu"

    # -------------------------------------------------------------- compute
    def layer_time(self, node, device, batch, phase):
        if phase not in PHASES:
            raise EstimatorError(
                f"phase must be one of {PHASES}. Received: phase={phase!r}"
            )
        if batch < 0:
            raise EstimatorError(
                f"batch must be a non-negative number of samples for layer "
                f"{node.name!r}. Received: batch={batch!r}"
            )
        category = op_category(node.layer_type)
        if batch == 0 or category == "free" or getattr(node, "kind", None) == "input":
            return 0.0
        device = self._device(device)
        kind = self._kind(device)
        weight_bytes = sum(v.bytes for v in node.variables) + int(node.non_trainable_bytes or 0)
        in_bytes = self._input_bytes.get(node.name)
        if in_bytes is None:
            in_bytes = self._input_bytes[node.name] = input_bytes_per_sample(node, self.dtype_bytes)
        out_bytes = node.output_bytes
        if phase == "forward":
            flops = node.forward_flops * batch
            moved = weight_bytes + (in_bytes + out_bytes) * batch
            kernels = 1
        else:
            flops = node.backward_flops * batch
            moved = 2 * weight_bytes + (2 * in_bytes + out_bytes) * batch
            kernels = 2 if node.variables else 1
        peak = device.peak_flops_fp32
        if category == "matmul" and (self.precision == "mixed"
                                     or _computes_in_half(node, device)):
            peak = max(peak, getattr(device, "peak_flops_fp16", 0.0) or 0.0)
        efficiency = self.compute_efficiency[kind].get(category, self.compute_efficiency[kind]["other"])
        compute = flops / (peak * efficiency) if flops else 0.0
        memory = moved / (device.memory_bandwidth * self.memory_efficiency[kind])
        device_time = max(compute, memory) + kernels * self.launch_overhead_s[kind]
        return max(device_time, self.host_time(node.layer_type, device, phase))

    def _torch_on_gpu(self, device):
        return self.framework == "torch" and getattr(device, "kind", "gpu") == "gpu"

    def host_time(self, layer_type, device, phase):
        """Host (dispatch) time of one layer call, which the device's work overlaps.

        Non-zero on a GPU under the PyTorch backend only (see the module docs).
        """
        if phase != "forward" or not self._torch_on_gpu(device):
            return 0.0
        host = TORCH_GPU_HOST_S.get(layer_type)
        if host is None:
            host = TORCH_GPU_HOST_BY_CATEGORY_S.get(op_category(layer_type),
                                                    TORCH_GPU_HOST_BY_CATEGORY_S["other"])
        return host

    def step_overhead_time(self, device):
        """Fixed host time per training step on `device` (loss, Keras's train step)."""
        device = self._device(device)
        return TORCH_GPU_STEP_HOST_S if self._torch_on_gpu(device) else 0.0

    def update_time(self, nbytes, device, num_tensors=1):
        if nbytes <= 0 and num_tensors <= 0:
            return 0.0
        device = self._device(device)
        kind = self._kind(device)
        memory = ADAM_UPDATE_BYTES_FACTOR * nbytes / (
            device.memory_bandwidth * self.memory_efficiency[kind]
        )
        return memory + max(int(num_tensors), 0) * self.launch_overhead_s[kind]

    def aggregate_time(self, nbytes, num_inputs, device):
        if nbytes <= 0 or num_inputs <= 1:
            return 0.0
        device = self._device(device)
        kind = self._kind(device)
        moved = (AGGREGATE_BYTES_FACTOR * num_inputs + 1) * nbytes
        return moved / (device.memory_bandwidth * self.memory_efficiency[kind]) + (
            self.launch_overhead_s[kind]
        )

    # -------------------------------------------------------- communication
    def link(self, src, dst):
        """`(latency_s, bandwidth_bytes_per_s)` of the link `src -> dst`."""
        return self.comm.link(src, dst)

    def transfer_time(self, nbytes, src, dst):
        if math.isnan(nbytes):
            raise EstimatorError(f"nbytes must be a number. Received: {nbytes!r}")
        return self.comm.transfer_time(nbytes, src, dst)

    def allreduce_time(self, nbytes, devices, algorithm="ring"):
        return self.comm.allreduce_time(nbytes, devices, algorithm)
