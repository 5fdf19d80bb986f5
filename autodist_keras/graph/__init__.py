"""autodist_keras.graph: the layer-call DAG of a Keras model, with costs.

```python
from autodist_keras.graph import ModelGraph, load_model

graph = ModelGraph.from_keras(load_model("ResNet50"))
print(graph.summary())
```

Importing this package imports neither Keras nor a framework.
"""

from autodist_keras.graph.loading import load_model
from autodist_keras.graph.model_graph import LayerNode
from autodist_keras.graph.model_graph import ModelGraph
from autodist_keras.graph.model_graph import TensorInfo

__all__ = ["LayerNode", "ModelGraph", "TensorInfo", "load_model"]
