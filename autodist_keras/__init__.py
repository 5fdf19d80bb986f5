"""autodist_keras: automatic distributed training of Keras 3 models on mixed GPUs.

Importing this package imports neither TensorFlow nor PyTorch; the backend
adapters load them lazily when a plan runs.
"""

from autodist_keras.errors import AutodistError
from autodist_keras.errors import BackendError
from autodist_keras.errors import ClusterSpecError
from autodist_keras.errors import EstimatorError
from autodist_keras.errors import GraphError
from autodist_keras.errors import OutputError
from autodist_keras.errors import PlanError
from autodist_keras.errors import StrategyError
from autodist_keras.errors import WorkerError
from autodist_keras.devices import Cluster
from autodist_keras.devices import Device
from autodist_keras.graph import ModelGraph
from autodist_keras.strategies.auto import AutoStrategy
from autodist_keras.strategies.plan import Plan

__version__ = "0.1.0"
