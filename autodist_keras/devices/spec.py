"""Parsing and validation of cluster specs (YAML, dict, string) into a `Cluster`.

Three inputs, one path: a YAML file is read with `yaml.safe_load` into a dict,
a string such as `"node0:2xV100;node1:4x1080Ti@50"` is turned into the same
kind of dict, and the dict is validated field by field into devices and a
topology. Every problem raises `ClusterSpecError` naming the source (file or
string), the dotted field (`nodes[1].gpus[0].type`), the value, and the fix.
The formats are documented in `docs/clusters.md`.

A dict with a `"devices"` key is `Cluster.to_dict()` output and is read back
exactly (`_cluster_from_canonical`).
"""

import difflib
import math
import os
import re

from autodist_keras.devices import catalog
from autodist_keras.devices.cluster import CPU_CORE_MEMORY_BANDWIDTH
from autodist_keras.devices.cluster import CPU_CORE_PEAK_FLOPS
from autodist_keras.devices.cluster import CUSTOM_LATENCY
from autodist_keras.devices.cluster import DEFAULT_NIC_GBPS
from autodist_keras.devices.cluster import DEVICE_KINDS
from autodist_keras.devices.cluster import INTRA_LINK_TYPES
from autodist_keras.devices.cluster import NETWORK_LATENCY
from autodist_keras.devices.cluster import NVLINK_LATENCY
from autodist_keras.devices.cluster import PCIE_LATENCY
from autodist_keras.devices.cluster import SCHEMA_VERSION
from autodist_keras.devices.cluster import SHM_BANDWIDTH
from autodist_keras.devices.cluster import SHM_LATENCY
from autodist_keras.devices.cluster import Cluster
from autodist_keras.devices.cluster import Device
from autodist_keras.devices.cluster import Link
from autodist_keras.devices.cluster import NodeSpec
from autodist_keras.devices.cluster import Topology
from autodist_keras.errors import ClusterSpecError

NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.-]+$")
MAX_DEVICES = 4096  # per cluster
MAX_COUNT = 1024  # per `count`
MAX_THREADS = 1024

TOP_KEYS = ("nodes", "description")
NODE_KEYS = (
    "name", "address", "gpus", "cpus", "nic_gbps", "nic_latency_us", "intra_link",
    "intra_latency_us", "core_gflops",
)
GPU_TYPE_KEYS = ("type", "count")
GPU_EXPLICIT_KEYS = (
    "name", "memory_gb", "fp32_tflops", "fp16_tflops", "bandwidth_gbps", "nvlink_gbps",
    "pcie_gen", "count",
)
CPU_KEYS = ("cores", "threads", "count", "memory_gb")
CANONICAL_KEYS = ("schema_version", "devices", "nodes", "links", "source", "notes")
DEVICE_KEYS = (
    "name", "node", "index", "kind", "model", "memory_bytes", "peak_flops_fp32",
    "peak_flops_fp16", "memory_bandwidth", "cpu_affinity", "threads",
)
NODESPEC_KEYS = (
    "name", "address", "nic_bandwidth", "intra_link", "intra_bandwidth", "intra_latency",
    "nic_latency",
)
LINK_KEYS = ("devices", "type", "bandwidth", "latency")

# Upper bounds that catch unit mistakes and absurd values (and keep arithmetic finite).
LIMITS = {
    "memory_gb": 1e6,
    "tflops": 1e6,
    "bandwidth_gbps": 1e6,
    "nic_gbps": 1e6,
    "latency_us": 1e9,
    "link_gbps": 1e6,
    "core_gflops": 1e6,
    "bytes": 2.0**70,
    "flops": 1e21,
    "bytes_per_s": 1e18,
    "seconds": 1e6,
}

DEFAULT_TESTBED = (
    {"cores": [0], "threads": 1},
    {"cores": [1], "threads": 1},
    {"cores": [1], "threads": 1},
)

CPU_ESTIMATE_NOTE = (
    "CPU figures are estimates: peak FP32 = cores x {gflops:g} GFLOP/s per core "
    "(AVX2, 2 FMA units x 8 lanes x 2 FLOP at a nominal 2.5 GHz unless core_gflops "
    "is given), FP16 = FP32, memory bandwidth = cores x 10 GB/s."
)


def _fail(message, source, field, value):
    return ClusterSpecError(f"{message} Received: {value!r}", source=source, field=field,
                            value=value)


def _child(field, key):
    if isinstance(key, int):
        return f"{field}[{key}]" if field else f"[{key}]"
    return f"{field}.{key}" if field else str(key)


def _check_mapping(value, source, field, what, example):
    if not isinstance(value, dict):
        raise _fail(
            f"{what} must be a mapping, e.g. {example}; got a {type(value).__name__}.",
            source, field, value,
        )


def _check_keys(mapping, allowed, source, field):
    for key in mapping:
        if not isinstance(key, str) or key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ClusterSpecError(
                f"Unknown key {key!r}.{hint} Valid keys here: {', '.join(allowed)}. "
                f"Received: {key!r}",
                source=source, field=_child(field, str(key)), value=key,
            )


# PyYAML (YAML 1.1) reads `1e12` (exponent, no dot) as a string: accept that form.
_EXPONENT_NUMBER = re.compile(r"^[+-]?[0-9]+(\.[0-9]*)?[eE][+-]?[0-9]+$")


def _number(value, source, field, unit, maximum, minimum=0.0, allow_zero=False):
    if isinstance(value, str) and _EXPONENT_NUMBER.match(value.strip()):
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(
            f"Expected a number ({unit}); got a {type(value).__name__}. Write it as a "
            "plain number without quotes or units.",
            source, field, value,
        )
    try:
        value = float(value)
    except OverflowError:  # an int too large for a float
        value = math.inf
    if not math.isfinite(value):
        raise _fail(f"Expected a finite number ({unit}).", source, field, value)
    if value < minimum or (value == minimum and not allow_zero):
        relation = "non-negative" if allow_zero else "positive"
        raise _fail(f"Expected a {relation} number ({unit}).", source, field, value)
    if value > maximum:
        raise _fail(
            f"{value:g} {unit} is implausibly large (limit {maximum:g}); check the unit.",
            source, field, value,
        )
    return value


def _integer(value, source, field, what, minimum, maximum):
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(
            f"{what} must be a whole number from {minimum} to {maximum}; got a "
            f"{type(value).__name__}.",
            source, field, value,
        )
    if not minimum <= value <= maximum:
        raise _fail(f"{what} must be from {minimum} to {maximum}.", source, field, value)
    return value


def _string(value, source, field, what, allow_empty=False):
    if not isinstance(value, str) or (not allow_empty and not value.strip()):
        raise _fail(f"{what} must be a non-empty string.", source, field, value)
    return value


def _list(value, source, field, what, example, allow_empty=False):
    if not isinstance(value, list):
        raise _fail(
            f"{what} must be a list, e.g. {example}; got a {type(value).__name__}.",
            source, field, value,
        )
    if not value and not allow_empty:
        raise _fail(f"{what} must not be empty, e.g. {example}.", source, field, value)
    return value


# ----------------------------------------------------------------- GPU entries
_COUNT_PREFIX = re.compile(r"^\s*(\d+)\s*[xX*]\s*(.*)$")
# A count that is not a whole number from 1 up: "-2xV100", "+2xV100", "2.5xV100", "1e1xV100"
# (read as GPU types called "-2xV100", with a "Did you mean 'V100-SXM2-16GB'?").
_BAD_COUNT_PREFIX = re.compile(
    r"^\s*([-+]\s*[\d.]*|[\d.]*\.[\d.]*|\d+[eE][-+]?\d+)\s*[xX*]\s*(.*)$")
# No count at all before the 'x': "xV100", " x V100", "*T4" (was "Unknown GPU type 'xV100'",
# or silently one T4 for "*T4").
_EMPTY_COUNT_PREFIX = re.compile(r"^\s*()[xX*]\s*(.*)$")


def _count_value(digits):
    """The value of a count's digits, leading zeros ignored ("0002" is 2); a count of
    more than four significant digits is MAX_COUNT + 1 (no huge int is built)."""
    significant = digits.lstrip("0") or "0"
    return int(significant) if len(significant) <= 4 else MAX_COUNT + 1


def _is_catalog_gpu(name):
    try:
        catalog.lookup_gpu(name)
    except ClusterSpecError:
        return False
    return True


def _gpu_entries(item, source, field):
    """Returns `(count, figures)` of one `gpus` entry; figures is a dict."""
    if isinstance(item, str):
        match = _COUNT_PREFIX.match(item)
        count, name = 1, item
        bad_count = _BAD_COUNT_PREFIX.match(item)
        empty = None if match or bad_count else _EMPTY_COUNT_PREFIX.match(item)
        # An empty count only where a catalog type follows the 'x' ("xV100", "X T4") or
        # the '*' ("*T4"): an unknown type that starts with an x ("Xavier", "Xp") is named
        # as unknown, with the known types (a catalog type starting with 'x' is one GPU).
        if empty and (item.lstrip().startswith("*") or (
                not _is_catalog_gpu(item) and _is_catalog_gpu(empty.group(2)))):
            bad_count = empty
        if bad_count or (match and not 1 <= _count_value(match.group(1)) <= MAX_COUNT):
            given = (bad_count or match).group(1).strip()
            raise _fail(
                f"The count before 'x' must be a whole number from 1 to {MAX_COUNT}; it "
                f"is {repr(given) if given else 'empty'}. Write e.g. '2xV100' (a type "
                "without a count is one GPU), and leave out a type the node has none of.",
                source, field, item,
            )
        if match:
            count, name = _count_value(match.group(1)), match.group(2)
        if not name.strip():
            raise _fail(
                f"The GPU type after the count is missing: write the count, 'x' and a "
                f"catalog type, e.g. '{match.group(1) if match else 2}xV100'.",
                source, field, item,
            )
        return count, _catalog_figures(catalog.lookup_gpu(name.strip(), source, field))
    if isinstance(item, dict):
        if "type" in item and "name" in item:
            raise _fail(
                "A GPU entry has either `type` (a catalog GPU) or `name` with explicit "
                "figures, not both.",
                source, field, item,
            )
        if "type" in item:
            _check_keys(item, GPU_TYPE_KEYS, source, field)
            count = _integer(
                item.get("count", 1), source, _child(field, "count"), "count", 1, MAX_COUNT
            )
            spec = catalog.lookup_gpu(item["type"], source, _child(field, "type"))
            return count, _catalog_figures(spec)
        if "name" in item:
            _check_keys(item, GPU_EXPLICIT_KEYS, source, field)
            return _explicit_gpu(item, source, field)
    raise _fail(
        "Each `gpus` entry is a catalog type ('V100' or '2xV100'), {type: V100, count: 2}, "
        "or explicit figures {name: MyGPU, memory_gb: 16, fp32_tflops: 15, fp16_tflops: "
        "120, bandwidth_gbps: 900}.",
        source, field, item,
    )


def _catalog_figures(spec):
    return {
        "model": spec.key,
        "memory_bytes": spec.memory_bytes,
        "peak_flops_fp32": spec.peak_flops_fp32,
        "peak_flops_fp16": spec.peak_flops_fp16,
        "memory_bandwidth": spec.memory_bandwidth,
        "nvlink": spec.nvlink_pair_bandwidth,
        "nvlink_fabric": spec.form_factor == "sxm" and spec.nvlink_bandwidth > 0,
        "pcie": spec.pcie_bandwidth,
    }


def _explicit_gpu(item, source, field):
    for key in ("memory_gb", "fp32_tflops", "bandwidth_gbps"):
        if key not in item:
            others = [k for k in ("memory_gb", "fp32_tflops", "bandwidth_gbps") if k != key]
            raise _fail(
                f"A GPU with explicit figures needs `{key}` (and `{others[0]}`, `{others[1]}`; "
                "optional `fp16_tflops`, `nvlink_gbps`, `pcie_gen`, `count`).",
                source, _child(field, key), None,
            )
    name = _string(item["name"], source, _child(field, "name"), "The GPU name")
    memory = _number(item["memory_gb"], source, _child(field, "memory_gb"), "GB",
                     LIMITS["memory_gb"])
    fp32 = _number(item["fp32_tflops"], source, _child(field, "fp32_tflops"), "TFLOP/s",
                   LIMITS["tflops"])
    fp16 = _number(item.get("fp16_tflops", fp32), source, _child(field, "fp16_tflops"),
                   "TFLOP/s", LIMITS["tflops"])
    bandwidth = _number(item["bandwidth_gbps"], source, _child(field, "bandwidth_gbps"),
                        "GB/s of memory bandwidth", LIMITS["bandwidth_gbps"])
    nvlink = _number(item.get("nvlink_gbps", 0), source, _child(field, "nvlink_gbps"),
                     "GB/s, both directions", LIMITS["bandwidth_gbps"], allow_zero=True)
    gen = _integer(item.get("pcie_gen", 3), source, _child(field, "pcie_gen"), "pcie_gen",
                   1, 5)
    count = _integer(item.get("count", 1), source, _child(field, "count"), "count", 1,
                     MAX_COUNT)
    return count, {
        "model": name.strip(),
        "memory_bytes": int(memory * catalog.GiB),
        "peak_flops_fp32": fp32 * catalog.TFLOPS,
        "peak_flops_fp16": fp16 * catalog.TFLOPS,
        "memory_bandwidth": bandwidth * catalog.GB,
        "nvlink": nvlink * catalog.GB / 2,
        "nvlink_fabric": nvlink > 0,
        "pcie": catalog.PCIE_X16_BANDWIDTH[gen],
    }


# ----------------------------------------------------------------- CPU entries
def _cpu_entries(item, source, field, available):
    _check_mapping(item, source, field, "A `cpus` entry", "{cores: [0], threads: 1}")
    _check_keys(item, CPU_KEYS, source, field)
    if "cores" not in item:
        raise _fail(
            "A CPU device needs `cores`, the CPU cores it may run on, e.g. {cores: [0], "
            "threads: 1}.",
            source, _child(field, "cores"), None,
        )
    cores_field = _child(field, "cores")
    cores = _list(item["cores"], source, cores_field, "cores", "[0, 1]")
    seen = []
    for j, core in enumerate(cores):
        _integer(core, source, _child(cores_field, j), "A core number", 0, 1 << 20)
        if core in seen:
            raise _fail("Each core may appear once per device.", source, cores_field, cores)
        if core not in available:
            raise _fail(
                f"Core {core} is not available to this process; available cores "
                f"(os.sched_getaffinity): {sorted(available)}. Use those core numbers.",
                source, _child(cores_field, j), core,
            )
        seen.append(core)
    threads = _integer(item.get("threads", len(cores)), source, _child(field, "threads"),
                       "threads", 1, MAX_THREADS)
    count = _integer(item.get("count", 1), source, _child(field, "count"), "count", 1,
                     MAX_COUNT)
    memory = None
    if "memory_gb" in item:
        memory = int(_number(item["memory_gb"], source, _child(field, "memory_gb"), "GB",
                             LIMITS["memory_gb"]) * catalog.GiB)
    return count, {"cores": tuple(sorted(cores)), "threads": threads, "memory_bytes": memory}


# ---------------------------------------------------------------------- nodes
def _intra_link(node, figures, kind, source, field, notes=None, name=None):
    """Returns `(type, bandwidth, default_latency)` of a node's intra-node link.

    The default for GPUs is `nvlink` when the node holds one GPU model and it is
    an NVLink (SXM) part, else `pcie`: no NVLink board holds two GPU models
    (`8xA100,8xV100` was one NVLink node of 16 GPUs). An explicit `nvlink` on a
    node of several models is taken as given, at the slowest model's figure.

    Args:
        node: The node's spec (a dict; `intra_link` is read from it).
        figures: One dict of figures per device of the node.
        kind: `"gpu"` or `"cpu"`.
        source: Where the spec came from, for errors.
        field: The node's field path, for errors.
        notes: A list the cluster's notes go to (what a mixed node's link is
            taken to be), or None.
        name: The node's name, for the notes.

    Returns:
        `(link type, bytes/s per direction, default latency in seconds)`.

    Raises:
        ClusterSpecError: If `intra_link` is not `nvlink`, `pcie` or a
            figure, or is `nvlink` on a GPU without NVLink.

    Example:

    ```python
    figures = [_catalog_figures(catalog.lookup_gpu("V100"))] * 2
    _intra_link({}, figures, "gpu", "<dict>", "nodes[0]")  # ("nvlink", 150e9, 3e-06)
    ```
    """
    link_field = _child(field, "intra_link")
    value = node.get("intra_link")
    numeric = isinstance(value, str) and _EXPONENT_NUMBER.match(value.strip())
    if isinstance(value, str) and not numeric:
        value = value.strip().lower()
    if value is not None and (numeric or not isinstance(value, str)):
        gbps = _number(value, source, link_field, "GB/s per direction", LIMITS["link_gbps"])
        return "custom", gbps * catalog.GB, CUSTOM_LATENCY
    if kind == "cpu":
        if value in (None, "shm"):
            return "custom", SHM_BANDWIDTH, SHM_LATENCY
        raise _fail(
            "Between CPU devices the link is shared memory: use `shm` (the default) or a "
            "figure in GB/s.",
            source, link_field, node.get("intra_link"),
        )
    models = list(dict.fromkeys(f["model"] for f in figures))  # in the node's order
    mixed = len(models) > 1
    node_name = name if name is not None else field
    if value is None:
        value = "nvlink" if all(f["nvlink_fabric"] for f in figures) else "pcie"
        if value == "nvlink" and mixed:
            value = "pcie"
            _add_note(notes, f"{node_name}: its GPU models differ ({', '.join(models)}), so "
                             "its GPUs are taken to talk over PCIe: no NVLink board holds "
                             "two GPU models. If they do share NVLink, say `intra_link: "
                             "nvlink` (or a figure in GB/s) in a YAML spec.")
    if value == "nvlink":
        missing = sorted({f["model"] for f in figures if f["nvlink"] <= 0})
        if missing:
            raise _fail(
                f"intra_link is nvlink but {missing} have no NVLink. Use `pcie` or a "
                "figure in GB/s.",
                source, link_field, node.get("intra_link"),
            )
        bandwidth = min(f["nvlink"] for f in figures)
        if mixed:
            _add_note(notes, f"{node_name}: intra_link nvlink on GPU models that differ "
                             f"({', '.join(models)}), taken as given at the slowest model's "
                             f"NVLink figure, {bandwidth / catalog.GB:g} GB/s per direction.")
        return "nvlink", bandwidth, NVLINK_LATENCY
    if value == "pcie":
        return "pcie", min(f["pcie"] for f in figures), PCIE_LATENCY
    raise _fail(
        "intra_link must be `nvlink`, `pcie` or a bandwidth in GB/s (a number).",
        source, link_field, node.get("intra_link"),
    )


def _add_note(notes, text):
    if notes is not None and text not in notes:
        notes.append(text)


def _parse_node(node, i, source, state, cpus_field=None):
    field = f"nodes[{i}]"
    _check_mapping(node, source, field, "A node", "{name: node0, gpus: [V100, V100]}")
    _check_keys(node, NODE_KEYS, source, field)
    name = node.get("name", f"node{i}")
    if not isinstance(name, str):
        raise _fail(
            f"A node name must be a string; YAML read this one as {type(name).__name__} {name!r}. "
            f"Quote it (name: \"{name}\") or start it with a letter (name: node{name}).",
            source, _child(field, "name"), name,
        )
    if not NAME_PATTERN.match(name):
        raise _fail(
            "A node name uses letters, digits, '_', '.' and '-' only (it becomes part of "
            "device names such as 'node0/gpu1').",
            source, _child(field, "name"), name,
        )
    if name.lower() in state["names"]:
        raise _fail(
            f"Node names must be unique, ignoring case; {name!r} is also "
            f"nodes[{state['names'][name.lower()]}]. Rename one.",
            source, _child(field, "name"), name,
        )
    state["names"][name.lower()] = i
    address = node.get("address")
    if address is not None:
        address = _string(address, source, _child(field, "address"), "address").strip()
        if address in state["addresses"]:
            raise _fail(
                f"Node addresses must be unique; {address!r} is also the address of "
                f"nodes[{state['addresses'][address]}]. Give each machine its own address.",
                source, _child(field, "address"), address,
            )
        state["addresses"][address] = i
    has_gpus, has_cpus = "gpus" in node, "cpus" in node
    if has_gpus == has_cpus:
        raise _fail(
            "A node lists its devices under `gpus` (e.g. gpus: [V100, {type: T4, count: "
            "2}]) or `cpus` (e.g. cpus: [{cores: [0], threads: 1}]): exactly one of them.",
            source, field, sorted(k for k in node if k in ("gpus", "cpus")),
        )
    nic = _number(node.get("nic_gbps", DEFAULT_NIC_GBPS), source, _child(field, "nic_gbps"),
                  "Gbit/s", LIMITS["nic_gbps"])
    nic_latency = NETWORK_LATENCY
    if "nic_latency_us" in node:
        nic_latency = _number(
            node["nic_latency_us"], source, _child(field, "nic_latency_us"), "microseconds",
            LIMITS["latency_us"], allow_zero=True,
        ) / 1e6
    devices = []
    if has_gpus:
        if "core_gflops" in node:
            raise _fail("core_gflops applies to `cpus` nodes only; remove it.", source,
                        _child(field, "core_gflops"), node["core_gflops"])
        gpus_field = _child(field, "gpus")
        items = _list(node["gpus"], source, gpus_field, "gpus",
                      "[V100, {type: 1080Ti, count: 2}]")
        figures = []
        for j, item in enumerate(items):
            count, fig = _gpu_entries(item, source, _child(gpus_field, j))
            state["total"] += count
            _check_total(state, source, _child(gpus_field, j))
            figures.extend([fig] * count)
        link, bandwidth, latency = _intra_link(node, figures, "gpu", source, field,
                                               notes=state["notes"], name=name)
        for k, fig in enumerate(figures):
            devices.append(Device(
                name=f"{name}/gpu{k}", node=name, index=k, kind="gpu", model=fig["model"],
                memory_bytes=fig["memory_bytes"], peak_flops_fp32=fig["peak_flops_fp32"],
                peak_flops_fp16=fig["peak_flops_fp16"],
                memory_bandwidth=fig["memory_bandwidth"],
            ))
    else:
        from autodist_keras.devices.detect import available_cores
        from autodist_keras.devices.detect import physical_memory_bytes

        core_gflops = _number(
            node.get("core_gflops", CPU_CORE_PEAK_FLOPS / 1e9), source,
            _child(field, "core_gflops"), "GFLOP/s per core", LIMITS["core_gflops"],
        )
        cpus_field = cpus_field or _child(field, "cpus")
        items = _list(node["cpus"], source, cpus_field, "cpus",
                      "[{cores: [0], threads: 1}, {cores: [1], threads: 1}]")
        available = set(available_cores())
        entries = []
        for j, item in enumerate(items):
            count, entry = _cpu_entries(item, source, _child(cpus_field, j), available)
            state["total"] += count
            _check_total(state, source, _child(cpus_field, j))
            entries.extend([entry] * count)
        link, bandwidth, latency = _intra_link(node, entries, "cpu", source, field)
        users = {}
        for entry in entries:
            for core in entry["cores"]:
                users[core] = users.get(core, 0) + 1
        default_memory = physical_memory_bytes() // len(entries)
        for k, entry in enumerate(entries):
            share = sum(1.0 / users[c] for c in entry["cores"])
            peak = share * core_gflops * 1e9
            devices.append(Device(
                name=f"{name}/cpu{k}", node=name, index=k, kind="cpu", model="cpu",
                memory_bytes=entry["memory_bytes"] or default_memory,
                peak_flops_fp32=peak, peak_flops_fp16=peak,
                memory_bandwidth=share * CPU_CORE_MEMORY_BANDWIDTH,
                cpu_affinity=entry["cores"], threads=entry["threads"],
            ))
        note = CPU_ESTIMATE_NOTE.format(gflops=core_gflops)
        if any(n > 1 for n in users.values()):
            note += (" Devices sharing a core split it: each gets 1/n of the core's peak "
                     "and bandwidth.")
        if note not in state["notes"]:
            state["notes"].append(note)
    if "intra_latency_us" in node:
        latency = _number(node["intra_latency_us"], source, _child(field, "intra_latency_us"),
                          "microseconds", LIMITS["latency_us"], allow_zero=True) / 1e6
    spec = NodeSpec(
        name=name, address=address, nic_bandwidth=nic * 1e9 / 8, intra_link=link,
        intra_bandwidth=bandwidth, intra_latency=latency, nic_latency=nic_latency,
    )
    return spec, devices


def _check_total(state, source, field):
    if state["total"] > MAX_DEVICES:
        raise _fail(
            f"A cluster holds at most {MAX_DEVICES} devices; this spec asks for "
            f"{state['total']} so far. Lower the counts.",
            source, field, state["total"],
        )


def _cluster_from_spec(spec, source, cpus_field=None, notes=None):
    _check_keys(spec, TOP_KEYS, source, "")
    if "nodes" not in spec:
        raise _fail(
            "A cluster spec needs a `nodes` list, e.g. {nodes: [{name: node0, gpus: "
            "[V100, V100]}]}.",
            source, "nodes", None,
        )
    nodes = _list(spec["nodes"], source, "nodes", "nodes", "[{gpus: [V100, V100]}]")
    state = {"names": {}, "addresses": {}, "total": 0, "notes": list(notes or [])}
    if "description" in spec:
        description = _string(spec["description"], source, "description", "description",
                              allow_empty=True)
        if description.strip():
            state["notes"].insert(0, description.strip())
    node_specs, devices = {}, []
    for i, node in enumerate(nodes):
        node_spec, node_devices = _parse_node(node, i, source, state, cpus_field)
        node_specs[node_spec.name] = node_spec
        devices.extend(node_devices)
    topology = Topology(node_specs, {d.name: d.node for d in devices})
    return Cluster(devices, topology, source=source, notes=state["notes"])


# ------------------------------------------------------------ canonical form
def device_from_dict(d, source="<dict>", field="device"):
    """Validates one `Device.to_dict()` dict and returns the `Device`."""
    _check_mapping(d, source, field, "A device", "Device.to_dict() output")
    _check_keys(d, DEVICE_KEYS, source, field)
    for key in DEVICE_KEYS[:9]:
        if key not in d:
            raise _fail(f"A device needs `{key}`.", source, _child(field, key), None)
    name = _string(d["name"], source, _child(field, "name"), "name")
    node = _string(d["node"], source, _child(field, "node"), "node")
    index = _integer(d["index"], source, _child(field, "index"), "index", 0, 1 << 20)
    kind = d["kind"]
    if kind not in DEVICE_KINDS:
        raise _fail(f"kind must be one of {DEVICE_KINDS}.", source, _child(field, "kind"), kind)
    model = _string(d["model"], source, _child(field, "model"), "model")
    memory = _integer(d["memory_bytes"], source, _child(field, "memory_bytes"), "memory_bytes",
                      1, int(LIMITS["bytes"]))
    fp32 = _number(d["peak_flops_fp32"], source, _child(field, "peak_flops_fp32"), "FLOP/s",
                   LIMITS["flops"])
    fp16 = _number(d["peak_flops_fp16"], source, _child(field, "peak_flops_fp16"), "FLOP/s",
                   LIMITS["flops"])
    bandwidth = _number(d["memory_bandwidth"], source, _child(field, "memory_bandwidth"),
                        "bytes/s", LIMITS["bytes_per_s"])
    affinity = d.get("cpu_affinity")
    if affinity is not None:
        affinity_field = _child(field, "cpu_affinity")
        _list(affinity, source, affinity_field, "cpu_affinity", "[0, 1]")
        for j, core in enumerate(affinity):
            _integer(core, source, _child(affinity_field, j), "A core number", 0, 1 << 20)
        affinity = tuple(affinity)
    threads = d.get("threads")
    if threads is not None:
        threads = _integer(threads, source, _child(field, "threads"), "threads", 1, MAX_THREADS)
    return Device(name=name, node=node, index=index, kind=kind, model=model,
                  memory_bytes=memory, peak_flops_fp32=fp32, peak_flops_fp16=fp16,
                  memory_bandwidth=bandwidth, cpu_affinity=affinity, threads=threads)


def _nodespec_from_dict(d, source, field):
    _check_mapping(d, source, field, "A node", "NodeSpec.to_dict() output")
    _check_keys(d, NODESPEC_KEYS, source, field)
    for key in NODESPEC_KEYS:
        if key not in d:
            raise _fail(f"A node needs `{key}`.", source, _child(field, key), None)
    name = d["name"]
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise _fail("A node name uses letters, digits, '_', '.' and '-' only.", source,
                    _child(field, "name"), name)
    address = d["address"]
    if address is not None:
        address = _string(address, source, _child(field, "address"), "address")
    if d["intra_link"] not in INTRA_LINK_TYPES:
        raise _fail(f"intra_link must be one of {INTRA_LINK_TYPES}.", source,
                    _child(field, "intra_link"), d["intra_link"])
    return NodeSpec(
        name=name, address=address,
        nic_bandwidth=_number(d["nic_bandwidth"], source, _child(field, "nic_bandwidth"),
                              "bytes/s", LIMITS["bytes_per_s"]),
        intra_link=d["intra_link"],
        intra_bandwidth=_number(d["intra_bandwidth"], source, _child(field, "intra_bandwidth"),
                                "bytes/s", LIMITS["bytes_per_s"]),
        intra_latency=_number(d["intra_latency"], source, _child(field, "intra_latency"),
                              "seconds", LIMITS["seconds"], allow_zero=True),
        nic_latency=_number(d["nic_latency"], source, _child(field, "nic_latency"), "seconds",
                            LIMITS["seconds"], allow_zero=True),
    )


def _link_from_dict(d, source, field, device_nodes):
    _check_mapping(d, source, field, "A link", "{devices: [a, b], type: nvlink, ...}")
    _check_keys(d, LINK_KEYS, source, field)
    for key in LINK_KEYS:
        if key not in d:
            raise _fail(f"A link needs `{key}`.", source, _child(field, key), None)
    pair = d["devices"]
    if (not isinstance(pair, list) or len(pair) != 2
            or not all(isinstance(p, str) and p in device_nodes for p in pair)
            or pair[0] == pair[1] or device_nodes[pair[0]] != device_nodes[pair[1]]):
        raise _fail("A link joins two different devices of one node, by name.", source,
                    _child(field, "devices"), pair)
    if d["type"] not in INTRA_LINK_TYPES:
        raise _fail(f"A link type is one of {INTRA_LINK_TYPES}.", source,
                    _child(field, "type"), d["type"])
    link = Link(
        type=d["type"],
        bandwidth=_number(d["bandwidth"], source, _child(field, "bandwidth"), "bytes/s",
                          LIMITS["bytes_per_s"]),
        latency=_number(d["latency"], source, _child(field, "latency"), "seconds",
                        LIMITS["seconds"], allow_zero=True),
    )
    return tuple(pair), link


def _cluster_from_canonical(spec, source):
    _check_keys(spec, CANONICAL_KEYS, source, "")
    version = spec.get("schema_version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION or isinstance(version, bool):
        raise _fail(
            f"This version of autodist_keras reads cluster schema version {SCHEMA_VERSION}.",
            source, "schema_version", version,
        )
    devices_raw = _list(spec["devices"], source, "devices", "devices", "[Device.to_dict()]")
    if len(devices_raw) > MAX_DEVICES:
        raise _fail(f"A cluster holds at most {MAX_DEVICES} devices.", source, "devices",
                    len(devices_raw))
    devices = [device_from_dict(d, source, f"devices[{i}]") for i, d in enumerate(devices_raw)]
    nodes_raw = _list(spec.get("nodes"), source, "nodes", "nodes", "[NodeSpec.to_dict()]")
    nodes = {}
    for i, d in enumerate(nodes_raw):
        node = _nodespec_from_dict(d, source, f"nodes[{i}]")
        if node.name in nodes:
            raise _fail("Node names must be unique.", source, f"nodes[{i}].name", node.name)
        nodes[node.name] = node
    device_nodes = {}
    for i, d in enumerate(devices):
        if d.node not in nodes:
            raise _fail(f"The device's node is not listed in `nodes` ({sorted(nodes)}).",
                        source, f"devices[{i}].node", d.node)
        if d.name in device_nodes:
            raise _fail("Device names must be unique.", source, f"devices[{i}].name", d.name)
        device_nodes[d.name] = d.node
    links_raw = _list(spec.get("links", []), source, "links", "links", "[]", allow_empty=True)
    links = dict(_link_from_dict(d, source, f"links[{i}]", device_nodes)
                 for i, d in enumerate(links_raw))
    if "source" in spec:
        source = _string(spec["source"], source, "source", "source", allow_empty=True)
    notes = _list(spec.get("notes", []), source, "notes", "notes", "[]", allow_empty=True)
    for i, note in enumerate(notes):
        _string(note, source, f"notes[{i}]", "A note", allow_empty=True)
    return Cluster(devices, Topology(nodes, device_nodes, links), source=source, notes=notes)


# ------------------------------------------------------------------ entry points
def cluster_from_dict(spec, source="<dict>"):
    """A `Cluster` from a resource-spec dict or from `Cluster.to_dict()` output."""
    if not isinstance(spec, dict):
        raise _fail(
            "A cluster spec is a mapping with a `nodes` list, e.g. {nodes: [{gpus: [V100, "
            f"V100]}}]}}; got a {type(spec).__name__}.",
            source, None, spec,
        )
    if "devices" in spec:
        return _cluster_from_canonical(spec, source)
    return _cluster_from_spec(spec, source)


def _repeated_key(text):
    """The first key repeated in one mapping of a YAML text, or None.

    `yaml.safe_load` keeps the last of repeated keys: a spec with two
    `nodes:` blocks would lose the first block's GPUs without a word. The
    text is composed (not constructed) with PyYAML's `SafeLoader` and its
    mappings' scalar keys compared; merge keys (`<<: *anchor`) may be
    overridden, as YAML allows.

    Returns:
        `(key, first_line, line, column)` (1-based) or None.
    """
    import yaml

    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
    finally:
        loader.dispose()
    stack, visited = ([root] if root is not None else []), set()
    while stack:
        node = stack.pop()
        if id(node) in visited:  # an alias of an anchored node
            continue
        visited.add(id(node))
        if isinstance(node, yaml.MappingNode):
            seen = {}
            for key, value in node.value:
                stack.append(value)
                if key.tag == "tag:yaml.org,2002:merge":
                    continue
                if isinstance(key, yaml.ScalarNode):
                    first = seen.setdefault((key.tag, key.value), key)
                    if first is not key:
                        return (key.value, first.start_mark.line + 1,
                                key.start_mark.line + 1, key.start_mark.column + 1)
                stack.append(key)
        elif isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
    return None


def cluster_from_yaml(path):
    """A `Cluster` from a YAML resource spec file (read with `yaml.safe_load`)."""
    import yaml

    try:
        path = os.fspath(path)
    except TypeError:
        raise ClusterSpecError(
            f"A cluster spec path must be a string or path-like. Received: {path!r}"
        ) from None
    if "\0" in path:  # (open() raised a raw "ValueError: embedded null byte")
        raise ClusterSpecError(
            "A cluster spec path cannot hold a NUL character ('\\x00'): no file has such a "
            "name. Give the path of an existing YAML resource spec. "
            f"Received: {path!r}"
        )
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ClusterSpecError(
            f"No such file (working directory: {os.getcwd()}). Give the path of an "
            "existing YAML resource spec, or the name of one shipped with the package ("
            f"{', '.join(builtin_cluster_names())}). Received: {path!r}",
            source=path,
        ) from None
    except IsADirectoryError:
        try:
            specs = sorted(n for n in os.listdir(path) if n.lower().endswith((".yaml", ".yml")))
        except OSError:  # an unreadable directory: no names to suggest
            specs = []
        found = (f" It holds {', '.join(repr(n) for n in specs[:5])}"
                 f"{' ...' if len(specs) > 5 else ''}." if specs else "")
        raise ClusterSpecError(
            f"Cannot read it: it is a directory, not a YAML resource spec file.{found} Give "
            f"the path of the spec file, e.g. "
            f"{os.path.join(path, specs[0] if specs else 'cluster.yaml')!r}. Received: {path!r}",
            source=path,
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ClusterSpecError(
            f"Cannot read the file as UTF-8 text ({type(e).__name__}: {e}). "
            f"Received: {path!r}",
            source=path,
        ) from None
    try:
        data = yaml.safe_load(text)
        repeated = _repeated_key(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ClusterSpecError(
            f"Not valid YAML{where}: {problem}. Fix the syntax (indentation, colons, "
            "brackets). Received: the file's text",
            source=path,
        ) from None
    except RecursionError:
        raise ClusterSpecError(
            "The YAML nests too deeply to be a cluster spec. Received: the file's text",
            source=path,
        ) from None
    if repeated is not None:
        key, first, line, column = repeated
        raise ClusterSpecError(
            f"Not valid YAML at line {line}, column {column}: duplicate key {key!r} (first "
            f"at line {first}). YAML keeps only the last of repeated keys, so the earlier "
            "one would be dropped silently: merge them into one. Received: the file's text",
            source=path,
        )
    if data is None:
        raise ClusterSpecError(
            "The file is empty. A spec needs a `nodes` list, e.g. `nodes: [{gpus: [V100, "
            "V100]}]`. Received: an empty document",
            source=path,
        )
    if isinstance(data, dict) and "devices" in data:
        return _cluster_from_canonical(data, path)
    if not isinstance(data, dict):
        raise _fail(
            "The top level of a cluster spec is a mapping with a `nodes` list; got a "
            f"{type(data).__name__}.",
            path, None, data,
        )
    return _cluster_from_spec(data, path)


def cluster_from_string(text):
    """A `Cluster` from `"2xV100,4x1080Ti"` or `"node0:2xV100;node1:4x1080Ti@50"`.

    Grammar (EBNF, whitespace ignored between tokens):

    ```
    cluster  = node { ";" node } ;
    node     = [ name ":" ] items [ "@" nic_gbps ] ;
    items    = item { "," item } ;
    item     = [ count ( "x" | "X" | "*" ) ] gpu_type ;
    name     = ( letter | digit | "_" | "." | "-" ) { ... } ;
    count    = digit { digit } ;            (* 1 to 1024 *)
    nic_gbps = number ;                     (* Gbit/s, default 25 *)
    gpu_type = a catalog name or alias, e.g. "V100", "A100 80GB", "1080Ti" ;
    ```
    """
    if not isinstance(text, str):
        raise ClusterSpecError(
            f"A cluster string is a str such as '2xV100,4x1080Ti'. Received: {text!r}"
        )
    source = f"cluster string {text!r}"
    grammar = ("Write devices as '2xV100,4x1080Ti' (one node) or "
               "'node0:2xV100;node1:4x1080Ti@50' (nodes separated by ';', NIC Gbit/s "
               "after '@').")
    if not text.strip():
        raise _fail(f"The string is empty. {grammar}", source, None, text)
    nodes = []
    for i, part in enumerate(text.split(";")):
        field = f"nodes[{i}]"
        node = {}
        body = part
        if body.count("@") > 1:
            raise _fail(f"A node has at most one '@'. {grammar}", source, field, part)
        if "@" in body:
            body, nic_text = body.split("@")
            try:
                node["nic_gbps"] = float(nic_text.strip())
            except ValueError:
                raise _fail(f"The NIC bandwidth after '@' is a number in Gbit/s. {grammar}",
                            source, _child(field, "nic_gbps"), nic_text.strip()) from None
        if ":" in body:
            name, body = body.split(":", 1)
            node["name"] = name.strip()
        # (An empty entry was "A node lists one or more GPUs", naming no entry.)
        if not part.strip():
            raise _fail("This node is empty: two ';' in a row, or a ';' at the start or "
                        f"end. Remove the extra ';'. {grammar}", source, field, text)
        if not body.strip():
            who = f"Node {node['name']!r}" if node.get("name") else "This node"
            raise _fail(f"{who} lists no GPUs: write them before any '@', after the "
                        f"node's name and ':', e.g. '{node.get('name') or 'node0'}:2xV100@50'. "
                        f"{grammar}", source, _child(field, "gpus"), part.strip())
        items = [item.strip() for item in body.split(",")]
        for j, item in enumerate(items):
            if not item:
                raise _fail("This GPU entry is empty: two ',' in a row, or a ',' at the "
                            f"start or end of the node's list. Remove the extra ','. "
                            f"{grammar}", source, _child(_child(field, "gpus"), j),
                            part.strip())
        node["gpus"] = items
        nodes.append(node)
    return _cluster_from_spec({"nodes": nodes}, source)


BUILTIN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "clusters")


def builtin_cluster_names():
    """Names of the cluster specs shipped with the package (`devices/clusters/*.yaml`)."""
    return sorted(name[:-len(".yaml")] for name in os.listdir(BUILTIN_DIR)
                  if name.endswith(".yaml"))


def builtin_cluster_path(name):
    """Path of the shipped spec called `name` (e.g. `"hetero_testbed"`), or None."""
    if name in builtin_cluster_names():
        return os.path.join(BUILTIN_DIR, f"{name}.yaml")
    return None


def looks_like_cluster_string(text):
    """Whether `text` reads as a cluster string (`"2xV100,4x1080Ti"`), not a name."""
    return bool(re.search(r"[,;:@]", text) or re.match(r"\s*\d+\s*[xX*]", text))


def close_builtin_cluster(text):
    """The shipped cluster name `text` looks like a typo of, or None."""
    close = difflib.get_close_matches(text.strip().lower(), builtin_cluster_names(), n=1,
                                      cutoff=0.75)
    return close[0] if close else None


def cpu_testbed_cluster(devices=None):
    """The CPU testbed cluster (see `Cluster.cpu_testbed`)."""
    source = "cpu_testbed()"
    if devices is None:
        devices = [dict(d) for d in DEFAULT_TESTBED]
    if not isinstance(devices, (list, tuple)):
        raise _fail(
            "devices is a list of {'cores': [...], 'threads': n} dicts, e.g. "
            "[{'cores': [0], 'threads': 1}, {'cores': [1], 'threads': 1}].",
            source, "devices", devices,
        )
    spec = {"nodes": [{"name": "node0", "address": "localhost", "cpus": list(devices)}]}
    notes = [
        "CPU testbed: each device is a set of cores (its CPU affinity) and a thread "
        "count; devices sharing a core split its compute."
    ]
    return _cluster_from_spec(spec, source, cpus_field="devices", notes=notes)
