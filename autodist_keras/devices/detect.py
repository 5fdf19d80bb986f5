"""Finding the devices of this machine: `detect_cluster()`.

Order of the attempts:

1. NVML (package `nvidia-ml-py`, `import pynvml`): GPU names, memory, PCI bus
   ids and the NVLink links of every GPU (`nvmlDeviceGetNvLinkState`,
   `nvmlDeviceGetNvLinkRemotePciInfo`), so each GPU pair gets its real link:
   direct NVLink links, an NVSwitch, or PCIe. `CUDA_VISIBLE_DEVICES` is honoured.
2. Only when NVML cannot answer: `torch.cuda`, then TensorFlow
   (`tf.config.list_physical_devices("GPU")`). A framework is asked when it
   is already imported (cheap), or when it is the active Keras backend (the
   program imports it anyway) and the CUDA driver library (`libcuda.so.1`)
   loads: without a driver no framework can see a GPU, so detection does not
   pay a framework import (seconds for TensorFlow) to learn that. Both are
   imported inside this function only.
3. Else the CPU as one device, `"node0/cpu0"`: memory = physical RAM
   (`os.sysconf`), peak FP32 = available cores x `CPU_CORE_PEAK_FLOPS`
   (an estimate, see `devices/cluster.py`), memory bandwidth = cores x 10 GB/s
   (an estimate).

The cluster's `source` says which attempt found the devices (`"detect: nvml"`,
`"detect: torch.cuda"`, `"detect: tensorflow"`, `"detect: cpu"`) and its
`notes` say what each attempt answered, e.g. `"no GPU found (NVML: library not
found ...; torch.cuda: not available); using the CPU as one device"`.

GPU figures come from the catalog (`lookup_gpu` of the driver's name); memory
is the driver's figure when it reports one. A GPU the catalog does not know
raises `ClusterSpecError`: describe it with explicit figures in a YAML spec.
"""

import itertools
import json
import os
import sys

from autodist_keras.devices import catalog
from autodist_keras.devices.cluster import CPU_CORE_MEMORY_BANDWIDTH
from autodist_keras.devices.cluster import CPU_CORE_PEAK_FLOPS
from autodist_keras.devices.cluster import DEFAULT_NIC_GBPS
from autodist_keras.devices.cluster import NETWORK_LATENCY
from autodist_keras.devices.cluster import NVLINK_LATENCY
from autodist_keras.devices.cluster import PCIE_LATENCY
from autodist_keras.devices.cluster import SHM_BANDWIDTH
from autodist_keras.devices.cluster import SHM_LATENCY
from autodist_keras.devices.cluster import Cluster
from autodist_keras.devices.cluster import Device
from autodist_keras.devices.cluster import Link
from autodist_keras.devices.cluster import NodeSpec
from autodist_keras.devices.cluster import Topology
from autodist_keras.errors import ClusterSpecError


# The cores this process could use before a fit pinned it to one device's cores
# (`backends/torch_device.pin` pushes, `unpin` pops), so that a cluster made while
# a fit runs (in a callback) still sees every core.
cores_before_pinning = []


def available_cores():
    """Sorted CPU core numbers this process may run on (those it had before a
    running fit pinned it to a device's cores)."""
    if cores_before_pinning:
        return sorted(cores_before_pinning[0])
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def physical_memory_bytes():
    """Physical RAM in bytes (`os.sysconf`); 8 GiB when the OS does not say."""
    try:
        pages = os.sysconf("SC_PHYS_PAGES")
        page_size = os.sysconf("SC_PAGE_SIZE")
        if pages > 0 and page_size > 0:
            return int(pages * page_size)
    except (AttributeError, ValueError, OSError):
        pass
    return 8 * 2**30


def host_cpu_name():
    """The host CPU's model name, as `/proc/cpuinfo` gives it.

    Returns:
        The first `model name` of `/proc/cpuinfo`; where there is none,
        `platform.processor()`, else `platform.machine()` (e.g. `"arm64"`).
    """
    import platform

    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def active_keras_backend():
    """The Keras backend name, without importing Keras when it is not imported yet.

    Returns:
        Keras's own answer once Keras is imported, else `$KERAS_BACKEND`, else
        the `backend` of `keras.json`, else `"tensorflow"` (Keras's default).
    """
    if "keras" in sys.modules:
        try:
            return sys.modules["keras"].backend.backend()
        except Exception:  # noqa: BLE001 - a half-imported keras
            pass
    if os.environ.get("KERAS_BACKEND"):
        return os.environ["KERAS_BACKEND"]
    home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    try:
        with open(os.path.join(home, "keras.json"), encoding="utf-8") as f:
            backend = json.load(f).get("backend")
        if isinstance(backend, str):
            return backend
    except (OSError, ValueError, AttributeError):
        pass
    return "tensorflow"


# ------------------------------------------------------------------------ NVML
def _text(value):
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def normalise_bus_id(bus_id):
    """PCI bus id in one form: `"00000000:07:00.0"` and `"0000:07:00.0"` agree."""
    text = _text(bus_id).strip().lower()
    try:
        domain, bus, rest = text.split(":")
        device, function = rest.split(".")
        return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(device, 16):02x}.{int(function, 16)}"
    except ValueError:
        return text


def _visible_indices(count, uuids):
    """Indices of the GPUs `CUDA_VISIBLE_DEVICES` leaves visible, in its order."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return list(range(count))
    chosen = []
    for entry in value.split(","):
        entry = entry.strip()
        if entry.isdigit() and int(entry) < count:
            index = int(entry)
        else:
            matches = [i for i, u in enumerate(uuids) if entry and u.startswith(entry)]
            if len(matches) != 1:
                break  # CUDA stops at the first invalid entry
            index = matches[0]
        if index in chosen:
            break
        chosen.append(index)
    return chosen


def query_nvml():
    """Reads the GPUs through NVML.

    Returns:
        `(gpus, status)`: `gpus` is a list of dicts (`name`, `memory_bytes`,
        `bus_id`, `nvlink`: remote PCI bus ids of the GPU's active NVLink
        links), or `None` when NVML cannot answer; `status` says what NVML
        answered.
    """
    try:
        import pynvml
    except ImportError:
        return None, "NVML: nvidia-ml-py not installed (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return None, f"NVML: {_text(e)}"
    except OSError as e:  # pragma: no cover - broken driver installs
        return None, f"NVML: {e}"
    try:
        count = pynvml.nvmlDeviceGetCount()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        uuids = []
        for handle in handles:
            try:
                uuids.append(_text(pynvml.nvmlDeviceGetUUID(handle)))
            except pynvml.NVMLError:
                uuids.append("")
        gpus = []
        for i in _visible_indices(count, uuids):
            handle = handles[i]
            gpu = {
                "name": _text(pynvml.nvmlDeviceGetName(handle)),
                "memory_bytes": int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                "bus_id": normalise_bus_id(pynvml.nvmlDeviceGetPciInfo(handle).busId),
                "nvlink": [],
            }
            for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    state = pynvml.nvmlDeviceGetNvLinkState(handle, link)
                except pynvml.NVMLError:
                    continue  # no such link, or NVLink not supported
                if state == pynvml.NVML_FEATURE_ENABLED:
                    remote = pynvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link)
                    gpu["nvlink"].append(normalise_bus_id(remote.busId))
            gpus.append(gpu)
        return gpus, f"NVML: {len(gpus)} GPU(s) visible of {count}"
    except pynvml.NVMLError as e:
        return None, f"NVML: {_text(e)}"
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def gpu_links(gpus):
    """Per-pair NVLink bandwidth from the NVLink remote bus ids NVML reports.

    A link whose remote end is another listed GPU joins that pair directly;
    a link to anything else (an NVSwitch) joins the GPU to every other GPU on
    the switch. Bandwidth per direction = links x the catalog's per-link figure
    (the smaller of the two GPUs').

    Args:
        gpus: Dicts with `bus_id`, `nvlink` (remote bus ids) and `spec` (a
            `GPUSpec`), in device order.

    Returns:
        Dict `(i, j)` -> bytes/s for every pair joined by NVLink (i < j).
    """
    index = {g["bus_id"]: i for i, g in enumerate(gpus) if g.get("bus_id")}
    switch = [sum(1 for r in g["nvlink"] if r not in index) for g in gpus]
    result = {}
    for i, j in itertools.combinations(range(len(gpus)), 2):
        direct = sum(1 for r in gpus[i]["nvlink"] if index.get(r) == j)
        direct = max(direct, sum(1 for r in gpus[j]["nvlink"] if index.get(r) == i))
        links = direct + min(switch[i], switch[j])
        per_link = min(gpus[i]["spec"].nvlink_link_bandwidth, gpus[j]["spec"].nvlink_link_bandwidth)
        if links and per_link > 0:
            result[(i, j)] = links * per_link
    return result


def gpu_cluster(gpus, source, notes):
    """Builds a one-node GPU cluster from detected GPUs (pure; used by every path).

    Args:
        gpus: Dicts with `name` (as the driver reports it), optional
            `memory_bytes` (driver figure; default the catalog's), optional
            `bus_id` and `nvlink` (see `query_nvml`).
        source: `Cluster.source`, e.g. `"detect: nvml"`.
        notes: Notes to attach.

    Returns:
        A `Cluster` with node `"node0"` at `"localhost"`.

    Raises:
        ClusterSpecError: If a GPU is not in the catalog.
    """
    notes = list(notes)
    entries = []
    for i, gpu in enumerate(gpus):
        try:
            spec = catalog.lookup_gpu(gpu["name"])
        except ClusterSpecError as e:
            raise ClusterSpecError(
                f"Detected GPU {i} ({gpu['name']!r}) is not in the GPU catalog, so its peak "
                "figures are unknown. Describe the machine in a YAML resource spec with "
                "explicit figures ({name: ..., memory_gb: ..., fp32_tflops: ..., "
                "fp16_tflops: ..., bandwidth_gbps: ...}, see docs/clusters.md) and pass "
                f"cluster='that.yaml'. Catalog lookup said: {e} Received: {gpu['name']!r}",
                source=source,
            ) from None
        bus_id = gpu.get("bus_id")
        entries.append(dict(
            gpu, spec=spec, bus_id=normalise_bus_id(bus_id) if bus_id else None,
            nvlink=[normalise_bus_id(r) for r in gpu.get("nvlink") or []],
        ))
    devices = [
        Device(
            name=f"node0/gpu{i}", node="node0", index=i, kind="gpu", model=e["spec"].key,
            memory_bytes=int(e.get("memory_bytes") or e["spec"].memory_bytes),
            peak_flops_fp32=e["spec"].peak_flops_fp32,
            peak_flops_fp16=e["spec"].peak_flops_fp16,
            memory_bandwidth=e["spec"].memory_bandwidth,
        )
        for i, e in enumerate(entries)
    ]
    nvlink = gpu_links(entries)
    pairs = list(itertools.combinations(range(len(entries)), 2))
    pcie = min(e["spec"].pcie_bandwidth for e in entries)
    if pairs and all(p in nvlink for p in pairs):
        intra = ("nvlink", min(nvlink.values()), NVLINK_LATENCY)
        overrides = {p: bw for p, bw in nvlink.items() if bw != intra[1]}
        notes.append("NVLink joins every GPU pair (from NVML).")
    else:
        intra = ("pcie", pcie, PCIE_LATENCY)
        overrides = nvlink
        if nvlink:
            notes.append(f"NVLink joins {len(nvlink)} of {len(pairs)} GPU pairs (from NVML); "
                         "the others use PCIe.")
    links = {
        (devices[i].name, devices[j].name): Link("nvlink", bw, NVLINK_LATENCY)
        for (i, j), bw in overrides.items()
    }
    node = NodeSpec(
        name="node0", address="localhost", nic_bandwidth=DEFAULT_NIC_GBPS * 1e9 / 8,
        intra_link=intra[0], intra_bandwidth=intra[1], intra_latency=intra[2],
        nic_latency=NETWORK_LATENCY,
    )
    topology = Topology({"node0": node}, {d.name: "node0" for d in devices}, links)
    notes.append("GPU peak figures are catalog spec-sheet values, not measurements.")
    return Cluster(devices, topology, source=source, notes=notes)


# ------------------------------------------------------------------ frameworks
_CUDA_DRIVER_NAMES = ("libcuda.so.1", "libcuda.so", "nvcuda.dll")


def cuda_driver_present():
    """Whether the CUDA driver library loads (cheap; no framework import)."""
    import ctypes

    for name in _CUDA_DRIVER_NAMES:
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            continue
    return False


def _skip_reason(module, label):
    """Why a framework is not asked, or None to ask it.

    Asking is cheap when the framework is imported. Otherwise it is asked only
    when it is the Keras backend (imported soon anyway) and a CUDA driver is
    present (without one no framework can see a GPU, so the import is saved).
    """
    if module in sys.modules:
        return None
    backend = active_keras_backend()
    if backend != module:
        return f"{label}: not asked ({module} not imported; Keras backend is {backend!r})"
    if not cuda_driver_present():
        return f"{label}: not asked (no CUDA driver library: {_CUDA_DRIVER_NAMES[0]} not found)"
    return None


def _query_torch():
    reason = _skip_reason("torch", "torch.cuda")
    if reason:
        return None, reason
    try:
        import torch
    except ImportError:
        return None, "torch.cuda: torch not installed"
    try:
        if not torch.cuda.is_available():
            return None, "torch.cuda: not available"
        gpus = []
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            gpus.append({"name": props.name, "memory_bytes": int(props.total_memory)})
    except Exception as e:  # noqa: BLE001 - a CUDA init failure is an answer, not a crash
        return None, f"torch.cuda: {type(e).__name__}: {e}"
    if not gpus:
        return None, "torch.cuda: 0 devices"
    return gpus, f"torch.cuda: {len(gpus)} GPU(s)"


def _query_tensorflow():
    reason = _skip_reason("tensorflow", "TensorFlow")
    if reason:
        return None, reason
    try:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        import tensorflow as tf
    except ImportError:
        return None, "TensorFlow: not installed"
    try:
        physical = tf.config.list_physical_devices("GPU")
        gpus = []
        for device in physical:
            details = tf.config.experimental.get_device_details(device)
            name = details.get("device_name")
            if not name:
                return None, f"TensorFlow: {device.name} does not report its model name"
            gpus.append({"name": name})
    except Exception as e:  # noqa: BLE001
        return None, f"TensorFlow: {type(e).__name__}: {e}"
    if not gpus:
        return None, "TensorFlow: no GPU"
    return gpus, f"TensorFlow: {len(gpus)} GPU(s)"


# ------------------------------------------------------------------------ CPU
def cpu_cluster(notes):
    """This machine's CPU as one device, `"node0/cpu0"` (figures: see the module doc)."""
    cores = len(available_cores())
    peak = cores * CPU_CORE_PEAK_FLOPS
    device = Device(
        name="node0/cpu0", node="node0", index=0, kind="cpu", model="cpu",
        memory_bytes=physical_memory_bytes(), peak_flops_fp32=peak, peak_flops_fp16=peak,
        memory_bandwidth=cores * CPU_CORE_MEMORY_BANDWIDTH,
    )
    node = NodeSpec(
        name="node0", address="localhost", nic_bandwidth=DEFAULT_NIC_GBPS * 1e9 / 8,
        intra_link="custom", intra_bandwidth=SHM_BANDWIDTH, intra_latency=SHM_LATENCY,
        nic_latency=NETWORK_LATENCY,
    )
    notes = list(notes) + [
        f"CPU figures are estimates: peak FP32 = {cores} core(s) x "
        f"{CPU_CORE_PEAK_FLOPS / 1e9:g} GFLOP/s per core (AVX2, 2 FMA units x 8 lanes x 2 "
        f"FLOP at a nominal 2.5 GHz) = {peak / 1e9:g} GFLOP/s; memory = physical RAM; "
        f"memory bandwidth = {cores} x {CPU_CORE_MEMORY_BANDWIDTH / 1e9:g} GB/s."
    ]
    return Cluster([device], Topology({"node0": node}, {"node0/cpu0": "node0"}),
                   source="detect: cpu", notes=notes)


def detect_cluster():
    """The devices of this machine (see the module docstring for the order).

    Returns:
        A `Cluster` whose `source` and `notes` say how the devices were found.

    Example:

    ```python
    cluster = detect_cluster()
    print(cluster.source, cluster.notes)
    ```
    """
    answers = []
    gpus, status = query_nvml()
    answers.append(status)
    if gpus:
        return gpu_cluster(gpus, "detect: nvml", [status])
    if gpus is None:  # NVML could not answer: ask the frameworks already in use
        for query, source in ((_query_torch, "detect: torch.cuda"),
                              (_query_tensorflow, "detect: tensorflow")):
            gpus, status = query()
            answers.append(status)
            if gpus:
                return gpu_cluster(gpus, source, answers)
    return cpu_cluster([f"no GPU found ({'; '.join(answers)}); using the CPU as one device"])
