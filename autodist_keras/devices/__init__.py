"""autodist_keras.devices: the devices a plan runs on.

`Cluster` = devices + topology. Make one with `Cluster.detect()`,
`Cluster.from_yaml(path)`, `Cluster.from_string("2xV100,4x1080Ti")`,
`Cluster.from_dict(spec)`, `Cluster.cpu_testbed()` or `Cluster.resolve(value)`.
`GPU_CATALOG` / `lookup_gpu(name)` hold the spec-sheet figures of common GPUs.
Importing this package imports neither TensorFlow nor PyTorch.
"""

from autodist_keras.devices.catalog import GPU_CATALOG
from autodist_keras.devices.catalog import GPUSpec
from autodist_keras.devices.catalog import lookup_gpu
from autodist_keras.devices.cluster import Cluster
from autodist_keras.devices.cluster import Device
from autodist_keras.devices.cluster import Link
from autodist_keras.devices.cluster import NodeSpec
from autodist_keras.devices.cluster import Topology
from autodist_keras.devices.cluster import UnknownDeviceError

__all__ = [
    "Cluster",
    "Device",
    "GPUSpec",
    "GPU_CATALOG",
    "Link",
    "NodeSpec",
    "Topology",
    "UnknownDeviceError",
    "lookup_gpu",
]
