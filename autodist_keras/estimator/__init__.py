"""autodist_keras.estimator: predicted step times of plans.

- `cost_model`: `CostModel` (the interface), `AnalyticCostModel` (roofline
  compute, alpha-beta communication).
- `comm`: closed forms for point-to-point, ring, tree, hierarchical
  all-reduce and parameter-server traffic; `CommModel` over a topology.
- `simulator`: `simulate(graph, cluster, plan, cost_model=None)`, the
  discrete-event simulation of one training step, returning a `SimResult`.

Every number these produce is a prediction, not a measurement.

```python
from autodist_keras.estimator import simulate

result = simulate(graph, cluster, plan)
plan.prediction = result.to_prediction()
```

Importing this package imports neither Keras nor a framework.
"""

from autodist_keras.estimator.comm import CommModel
from autodist_keras.estimator.cost_model import AnalyticCostModel
from autodist_keras.estimator.cost_model import CostModel
from autodist_keras.estimator.simulator import DeviceStats
from autodist_keras.estimator.simulator import SimEvent
from autodist_keras.estimator.simulator import SimResult
from autodist_keras.estimator.simulator import simulate

__all__ = [
    "AnalyticCostModel",
    "CommModel",
    "CostModel",
    "DeviceStats",
    "SimEvent",
    "SimResult",
    "simulate",
]
