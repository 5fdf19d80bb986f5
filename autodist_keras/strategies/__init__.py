"""Plans and the planners that write them."""

from autodist_keras.strategies.plan import LayerGroup
from autodist_keras.strategies.plan import Plan
from autodist_keras.strategies.plan import Prediction
from autodist_keras.strategies.plan import Provenance
from autodist_keras.strategies.plan import Replica
from autodist_keras.strategies.plan import SyncSpec
