"""autodist_keras.fusion: op fusion and tensor fusion.

- `op_fusion`: which layers run as one compiled region (XLA `jit_compile` on
  TensorFlow, `torch.compile` on PyTorch), what that saves in the cost model
  (`FusionAwareCostModel`), and `regions_for(plan)` for the backends.
- `tensor_fusion`: gradient bucket layouts (no fusion, DDP 25 MiB, Horovod
  64 MiB, chain-optimal) and the fully-overlapped bound.

Disco (`strategies.disco`) searches both; the backends realise them.
Importing this package imports neither Keras nor a framework.
"""

from autodist_keras.fusion.op_fusion import FusionAwareCostModel
from autodist_keras.fusion.op_fusion import regions_for
from autodist_keras.fusion.tensor_fusion import BASELINE_LAYOUTS
from autodist_keras.fusion.tensor_fusion import overlapped_bound_of

__all__ = ["BASELINE_LAYOUTS", "FusionAwareCostModel", "overlapped_bound_of", "regions_for"]
