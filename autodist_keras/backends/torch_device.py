"""Puts a PyTorch process on its planned device.

On the CPU testbed a device is a set of cores and a thread count: the process
(every one of its threads) is pinned to those cores with
`os.sched_setaffinity` and `torch.set_num_threads(threads)` is applied, so the
testbed's heterogeneity is real. On a GPU device the process selects that CUDA
device. Either way Keras is told where to put new tensors (`keras.device`):
on a machine with CUDA, Keras's PyTorch backend puts everything on the GPU
unless told otherwise, so a CPU testbed device would silently run on the GPU.
`pin` returns what it changed so `unpin` can put it back (rank 0 is the
user's process and is restored after `fit`).

Example:

```python
token = pin(device_info(cluster.device("node0/cpu1")))
...
unpin(token)
```
"""

import os
import threading

from autodist_keras.devices import detect
from autodist_keras.errors import BackendError


def device_info(device):
    """The JSON-able facts of a `Device` a rank needs to place itself."""
    return {
        "name": device.name,
        "node": device.node,
        "kind": device.kind,
        "index": int(device.index),
        "cpu_affinity": list(device.cpu_affinity) if device.cpu_affinity else None,
        "threads": int(device.threads) if device.threads else None,
    }


def _threads_of_process():
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def _set_affinity_all_threads(cores):
    for tid in _threads_of_process():
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:
            pass  # a thread that ended meanwhile


def keras_device_name(info):
    """The Keras device string of a device (from `device_info`).

    Returns:
        `"cpu"` for a CPU (testbed) device, `"cuda:<index>"` for a GPU when
        CUDA is available here, None for a GPU without CUDA (Keras's default
        device, the CPU, serves).
    """
    import torch

    if info is None:
        return None
    if info.get("kind") != "gpu":
        return "cpu"
    if torch.cuda.is_available():
        return f"cuda:{int(info.get('index', 0))}"
    return None


def variables_device(model):
    """The torch device of the model's first variable (`"cpu"`, `"cuda:0"`), or None."""
    for v in model.variables:
        value = getattr(v, "value", None)
        if value is not None and hasattr(value, "device"):
            return str(value.device)
    return None


def check_model_device(model, info, rank):
    """Raises unless the model's variables are where `info`'s device computes.

    Args:
        model: The replica on this rank.
        info: The rank's device (from `device_info`).
        rank: The rank (for the message).

    Raises:
        BackendError: Naming both devices and how to fix it.
    """
    import torch

    expected = keras_device_name(info)
    actual = variables_device(model)
    if expected is None or actual is None:
        return
    if torch.device(expected) != torch.device(actual):
        raise BackendError(
            f"Rank {rank} runs on {info.get('name')!r} ({expected}) but its model's "
            f"variables are on {actual}. The PyTorch runtime trains each replica where its "
            "variables live: build and compile the model inside strategy.scope(), and put "
            "the device that rank 0 runs on first in AutoStrategy(devices=[...]) (or pass a "
            f"plan whose first replica is that device). Received: variables on {actual}, "
            f"device {expected}"
        )


# The pins in force, oldest first (fits nest in callbacks, or overlap in threads).
_PINS = []
_PINS_LOCK = threading.Lock()


def pin(info):
    """Places this process on the device described by `info` (from `device_info`).

    Returns:
        A token for `unpin`.
    """
    import torch

    token = {}
    if info is None:
        return token
    with _PINS_LOCK:
        cores = info.get("cpu_affinity")
        if cores and hasattr(os, "sched_setaffinity"):
            # (a fit inside another fit's callback starts from the cores before pinning)
            available = set(detect.available_cores())
            wanted = {c for c in cores if c in available}
            if wanted:
                token["affinity"] = sorted(os.sched_getaffinity(0))
                detect.cores_before_pinning.append(available)
                _set_affinity_all_threads(wanted)
        threads = info.get("threads")
        # Only a real change: torch.set_num_threads also turns MKL's dynamic
        # thread choice off for good, which made a tiny model's steps 3-7x slower
        # here, in this process, even when set to the count it already had.
        if threads:
            token["threads"] = torch.get_num_threads()
            if int(threads) != token["threads"]:
                torch.set_num_threads(int(threads))
        if "affinity" in token or "threads" in token:
            _PINS.append(token)
    if info.get("kind") == "gpu" and torch.cuda.is_available():
        token["cuda"] = torch.cuda.current_device()
        torch.cuda.set_device(int(info.get("index", 0)))
    name = keras_device_name(info)
    if name is not None:
        import keras

        scope = keras.device(name)
        scope.__enter__()
        token["keras_device"] = scope
    return token


def unpin(token):
    """Restores what `pin` changed."""
    import torch

    if not token:
        return
    if "keras_device" in token:
        token["keras_device"].__exit__(None, None, None)
    with _PINS_LOCK:
        at = next((i for i, t in enumerate(_PINS) if t is token), None)
        later_pins = _PINS[at + 1:] if at is not None else []
        for key in ("affinity", "threads"):
            if key not in token:
                continue
            # Fits in two threads can end out of order: the next pin that set the
            # same thing saved this one's value, so it restores what this one saved.
            later = next((t for t in later_pins if key in t), None)
            if later is not None:
                later[key] = token[key]
            elif key == "affinity":
                _set_affinity_all_threads(set(token["affinity"]))
            elif int(token["threads"]) != torch.get_num_threads():
                torch.set_num_threads(int(token["threads"]))
        if at is not None:
            del _PINS[at]
        if "affinity" in token and detect.cores_before_pinning:
            detect.cores_before_pinning.pop()
    if "cuda" in token:
        torch.cuda.set_device(int(token["cuda"]))


def grad_backend(devices):
    """`"nccl"` when every replica is a GPU and CUDA is available, else `"gloo"`."""
    if devices and all(d.get("kind") == "gpu" for d in devices):
        try:
            import torch

            if torch.cuda.is_available() and torch.distributed.is_nccl_available():
                return "nccl"
        except ImportError:
            pass
    return "gloo"
