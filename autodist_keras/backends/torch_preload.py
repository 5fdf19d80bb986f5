"""Imports a PyTorch worker needs, run once in the fork server (internal).

`torch_pool` starts CPU workers with the `forkserver` start method and names
this module as the server's preload: the server imports Keras (with the
PyTorch backend) and PyTorch once, and every worker forked from it starts with
them already loaded, in a fraction of a second instead of the several seconds a
fresh interpreter needs. The server itself never runs a PyTorch operation, so
forking from it is safe. Importing this module sets `KERAS_BACKEND=torch` in
the importing process: do not import it elsewhere.
"""

import os

os.environ["KERAS_BACKEND"] = "torch"

import keras  # noqa: E402,F401
import torch  # noqa: E402,F401
import torch.distributed  # noqa: E402,F401

import autodist_keras.backends.torch_session  # noqa: E402,F401
import autodist_keras.backends.torch_worker  # noqa: E402,F401
