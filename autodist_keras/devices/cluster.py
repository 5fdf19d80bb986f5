"""`Device`, `NodeSpec`, `Topology` and `Cluster`: the devices a plan runs on.

A `Cluster` is a list of devices plus the topology that connects them. Every
device has a stable name (`"node0/gpu1"`, `"node0/cpu0"`), its node, kind,
catalog model, memory, peak FLOP/s and memory bandwidth. The topology gives the
bandwidth and latency between any two devices:

- the same device: link type `"local"`, infinite bandwidth, zero latency;
- two devices of one node: the node's intra-node link (`"nvlink"`, `"pcie"` or
  `"custom"` for a given figure or the CPU testbed's shared memory), unless a
  per-pair link overrides it (detection records NVLink per GPU pair);
- devices of two nodes: `"network"`, the slower of the two NICs and the larger
  of the two network latencies.

Default latencies (documented estimates; the profiler measures real ones):

| link | latency | bandwidth per direction |
| --- | --- | --- |
| NVLink | 3 us | half the datasheet NVLink figure (which counts both directions) |
| PCIe | 8 us | PCIe x16 of the older GPU's generation (gen3 15.75 GB/s) |
| custom (a figure in GB/s) | 8 us | the figure |
| shared memory (CPU testbed) | 10 us | 5 GB/s |
| network (TCP over Ethernet) | 30 us | NIC Gbit/s / 8 |

Constructors: `Cluster.detect()`, `Cluster.from_yaml(path)`,
`Cluster.from_string("2xV100,4x1080Ti")`, `Cluster.from_dict(spec)`,
`Cluster.cpu_testbed()` and `Cluster.resolve(value)`. The file formats are in
`docs/clusters.md`.

Example:

```python
cluster = Cluster.from_string("node0:2xV100;node1:4x1080Ti@50")
cluster.names                                  # ['node0/gpu0', ..., 'node1/gpu3']
cluster.topology.bandwidth("node0/gpu0", "node1/gpu0")   # 3.125e9 bytes/s (25 Gbit/s NIC)
print(cluster.summary())
```
"""

import dataclasses
import hashlib
import io
import json
import math
import os
import sys

from autodist_keras.errors import ClusterSpecError

SCHEMA_VERSION = 1

# Latency defaults, seconds (see the module docstring).
NVLINK_LATENCY = 3e-6
PCIE_LATENCY = 8e-6
CUSTOM_LATENCY = 8e-6
SHM_LATENCY = 10e-6
NETWORK_LATENCY = 30e-6

# Shared-memory link between CPU testbed devices: a memcpy through shared
# memory or a loopback socket on one machine, bytes/s (estimate).
SHM_BANDWIDTH = 5e9

# Default NIC when a spec does not give one: 25 Gbit/s Ethernet.
DEFAULT_NIC_GBPS = 25.0

# CPU estimates. A core with AVX2 and two 256-bit FMA units does 2 x 8 x 2 = 32
# FP32 FLOP per cycle; at a nominal 2.5 GHz that is 80 GFLOP/s. CPUs have no
# faster FP16 path in Keras, so the FP16 peak equals the FP32 peak. Memory
# bandwidth: 10 GB/s per core (a STREAM-like share of a server socket).
CPU_CORE_PEAK_FLOPS = 32 * 2.5e9
CPU_CORE_MEMORY_BANDWIDTH = 10e9

LINK_TYPES = ("local", "nvlink", "pcie", "custom", "network")
INTRA_LINK_TYPES = ("nvlink", "pcie", "custom")
DEVICE_KINDS = ("gpu", "cpu")


class UnknownDeviceError(ClusterSpecError, KeyError):
    """A device name that is not in the cluster.

    A `ClusterSpecError` that is also a `KeyError`, so code that looks devices
    up like dictionary keys can catch it either way.
    """

    def __str__(self):
        return Exception.__str__(self)


def _unknown_device(name, names):
    preview = names if len(names) <= 16 else names[:16] + [f"... ({len(names)} in all)"]
    return UnknownDeviceError(
        f"Unknown device {name!r}. Device names look like 'node0/gpu1'; this cluster "
        f"has {preview}. Received: {name!r}"
    )


@dataclasses.dataclass(frozen=True)
class Device:
    """One device a plan can place work on.

    Args:
        name: Stable name, `"node0/gpu1"` or `"node0/cpu0"`.
        node: Name of the node the device sits in, e.g. `"node0"`.
        index: Index of the device within its node and kind.
        kind: `"gpu"` or `"cpu"`.
        model: Catalog key (e.g. `"V100-SXM2-16GB"`), the name given with
            explicit figures, or `"cpu"`.
        memory_bytes: Device memory in bytes.
        peak_flops_fp32: Peak FP32 FLOP/s.
        peak_flops_fp16: Peak FP16/BF16 FLOP/s (tensor cores where present).
        memory_bandwidth: Memory bandwidth in bytes/s.
        cpu_affinity: CPU testbed only: the cores the device may run on.
        threads: CPU testbed only: intra-op threads of the device.
    """

    name: str
    node: str
    index: int
    kind: str
    model: str
    memory_bytes: int
    peak_flops_fp32: float
    peak_flops_fp16: float
    memory_bandwidth: float
    cpu_affinity: tuple = None
    threads: int = None

    def to_dict(self):
        """Returns the device as a JSON-serialisable dict."""
        d = dataclasses.asdict(self)
        if self.cpu_affinity is not None:
            d["cpu_affinity"] = list(self.cpu_affinity)
        return d

    @classmethod
    def from_dict(cls, d, source="<dict>", field="device"):
        """Builds a device from `to_dict()` output, validating every field.

        Raises:
            ClusterSpecError: If a field is missing, unknown or of the wrong type.
        """
        from autodist_keras.devices import spec

        return spec.device_from_dict(d, source, field)


@dataclasses.dataclass(frozen=True)
class NodeSpec:
    """One machine: its address, NIC and the link between its devices.

    Args:
        name: Node name, e.g. `"node0"`.
        address: Host name or IP address, or `None` when not given.
        nic_bandwidth: NIC bandwidth in bytes/s.
        intra_link: Link between two devices of the node: `"nvlink"`,
            `"pcie"` or `"custom"`.
        intra_bandwidth: Bandwidth of that link in bytes/s, per direction.
        intra_latency: Latency of that link in seconds.
        nic_latency: Latency of a network hop from this node, seconds.
    """

    name: str
    address: str
    nic_bandwidth: float
    intra_link: str
    intra_bandwidth: float
    intra_latency: float
    nic_latency: float = NETWORK_LATENCY

    def to_dict(self):
        """Returns the node as a JSON-serialisable dict."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Link:
    """A per-pair link overriding a node's intra-node link.

    Args:
        type: `"nvlink"`, `"pcie"` or `"custom"`.
        bandwidth: Bytes/s per direction.
        latency: Seconds.
    """

    type: str
    bandwidth: float
    latency: float


class Topology:
    """Bandwidth and latency between any two devices of a cluster.

    Args:
        nodes: Dict of node name -> `NodeSpec`.
        device_nodes: Dict of device name -> node name.
        links: Optional dict of `(device_a, device_b)` -> `Link` for pairs
            whose link differs from their node's intra-node link (either
            order of the pair works).

    Example:

    ```python
    topo = cluster.topology
    topo.link_type("node0/gpu0", "node0/gpu1")   # "nvlink"
    topo.bandwidth("node0/gpu0", "node1/gpu0")   # bytes/s
    topo.latency("node0/gpu0", "node0/gpu0")     # 0.0
    ```
    """

    def __init__(self, nodes, device_nodes, links=None):
        self.nodes = dict(nodes)
        self.device_nodes = dict(device_nodes)
        self.links = {}
        for (a, b), link in (links or {}).items():
            for name in (a, b):
                if name not in self.device_nodes:
                    raise _unknown_device(name, list(self.device_nodes))
            if self.device_nodes[a] != self.device_nodes[b] or a == b:
                raise ClusterSpecError(
                    "A per-pair link joins two different devices of one node. "
                    f"Received: {(a, b)!r}"
                )
            self.links[tuple(sorted((a, b)))] = link
        for device, node in self.device_nodes.items():
            if node not in self.nodes:
                raise ClusterSpecError(
                    f"Device {device!r} sits in node {node!r}, which the topology does "
                    f"not list (nodes: {sorted(self.nodes)}). Received: {node!r}"
                )

    def _link(self, a, b):
        for name in (a, b):
            if name not in self.device_nodes:
                raise _unknown_device(name, list(self.device_nodes))
        if a == b:
            return Link("local", math.inf, 0.0)
        node_a, node_b = self.nodes[self.device_nodes[a]], self.nodes[self.device_nodes[b]]
        if node_a.name != node_b.name:
            return Link(
                "network",
                min(node_a.nic_bandwidth, node_b.nic_bandwidth),
                max(node_a.nic_latency, node_b.nic_latency),
            )
        link = self.links.get(tuple(sorted((a, b))))
        if link is not None:
            return link
        return Link(node_a.intra_link, node_a.intra_bandwidth, node_a.intra_latency)

    def bandwidth(self, a, b):
        """Bandwidth from device `a` to device `b`, bytes/s (`inf` on one device)."""
        return self._link(a, b).bandwidth

    def latency(self, a, b):
        """Latency from device `a` to device `b`, seconds (0 on one device)."""
        return self._link(a, b).latency

    def link_type(self, a, b):
        """`"local"`, `"nvlink"`, `"pcie"`, `"custom"` or `"network"`."""
        return self._link(a, b).type

    def to_dict(self):
        """Nodes and per-pair links as JSON-serialisable data."""
        return {
            "nodes": [node.to_dict() for node in self.nodes.values()],
            "links": [
                {"devices": list(pair), **dataclasses.asdict(link)}
                for pair, link in sorted(self.links.items())
            ],
        }


class Cluster:
    """Devices and the topology connecting them.

    Args:
        devices: List of `Device`.
        topology: The `Topology`.
        source: Where the description came from (a file, a string,
            `"detect: cpu"`, ...).
        notes: Human-readable notes on how the cluster was made (what detection
            tried, which figures are estimates).

    Example:

    ```python
    cluster = Cluster.resolve("2xV100,4x1080Ti")
    len(cluster)                   # 6
    cluster.device("node0/gpu0").model   # "V100-SXM2-16GB"
    cluster.fingerprint()          # stable sha256 hex digest
    ```
    """

    def __init__(self, devices, topology, source="<unknown>", notes=None):
        devices = list(devices)
        if not devices:
            raise ClusterSpecError(
                "A cluster needs at least one device. Add GPUs or CPUs to a node. "
                "Received: no devices", source=source,
            )
        names = [d.name for d in devices]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ClusterSpecError(
                f"Device names must be unique; {duplicates} appear more than once. "
                f"Received: {names}", source=source,
            )
        for d in devices:
            if topology.device_nodes.get(d.name) != d.node:
                raise ClusterSpecError(
                    f"Device {d.name!r} (node {d.node!r}) is not in the topology. Build "
                    "the topology from the same devices. "
                    f"Received: {topology.device_nodes.get(d.name)!r}", source=source,
                )
        self.devices = devices
        self.topology = topology
        self.source = str(source)
        self.notes = list(notes or [])
        self._by_name = {d.name: d for d in devices}

    # ------------------------------------------------------------ constructors
    @classmethod
    def detect(cls):
        """The devices of this machine: GPUs through NVML, torch or TF, else the CPU.

        `cluster.source` and `cluster.notes` say how the devices were found.
        See `devices/detect.py` for the order of the attempts.

        Returns:
            A `Cluster`.
        """
        from autodist_keras.devices.detect import detect_cluster

        return detect_cluster()

    @classmethod
    def from_yaml(cls, path):
        """Reads a resource spec file (format: `docs/clusters.md`).

        Args:
            path: Path to a YAML file.

        Returns:
            A `Cluster` whose `source` is the path.

        Raises:
            ClusterSpecError: If the file is missing, not valid YAML or not a
                valid spec; the message names the file, the field and the value.
        """
        from autodist_keras.devices import spec

        return spec.cluster_from_yaml(path)

    @classmethod
    def from_string(cls, text):
        """Builds a cluster from a short description.

        `"2xV100,4x1080Ti"` is one node; `"node0:2xV100;node1:4x1080Ti@50"` is
        two nodes, the second with a 50 Gbit/s NIC. Grammar: `docs/clusters.md`.

        Returns:
            A `Cluster`.

        Raises:
            ClusterSpecError: If the string does not parse or names an unknown GPU.
        """
        from autodist_keras.devices import spec

        return spec.cluster_from_string(text)

    @classmethod
    def from_dict(cls, spec, source="<dict>"):
        """Builds a cluster from a spec dict or from `Cluster.to_dict()` output.

        A dict with a `"devices"` key is read as `to_dict()` output (exact
        round trip); otherwise as a resource spec (`nodes: [...]`).

        Returns:
            A `Cluster`.
        """
        from autodist_keras.devices import spec as spec_module

        return spec_module.cluster_from_dict(spec, source)

    @classmethod
    def cpu_testbed(cls, devices=None):
        """Devices made of CPU cores: real heterogeneity on a CPU-only machine.

        Each device is a set of cores (its CPU affinity) and a thread count.
        Its peak FP32 FLOP/s is `sum over its cores of (1 / number of testbed
        devices using that core) x CPU_CORE_PEAK_FLOPS`, so a device owning a
        core is twice as fast as each of two devices sharing one. Memory: this
        machine's RAM split evenly. Devices talk over shared memory (link type
        `"custom"`, 5 GB/s, 10 us).

        Args:
            devices: List of dicts `{"cores": [...], "threads": n}` (optional
                `"count"`, `"memory_gb"`). Default: `[{"cores": [0], "threads":
                1}, {"cores": [1], "threads": 1}, {"cores": [1], "threads": 1}]`:
                node0/cpu0 owns core 0, node0/cpu1 and node0/cpu2 share core 1.

        Returns:
            A `Cluster` with one node, `"node0"`.

        Raises:
            ClusterSpecError: If a core is not available to this process
                (`os.sched_getaffinity(0)`), or an entry is malformed.
        """
        from autodist_keras.devices import spec

        return spec.cpu_testbed_cluster(devices)

    @classmethod
    def resolve(cls, value):
        """Turns whatever a user passed as `cluster=` into a `Cluster`.

        Args:
            value: `None` (detect this machine), a `Cluster` (returned as is),
                a path to a YAML file (an existing file, a string ending in
                `.yaml` / `.yml`, or one with a path separator that is no cluster
                string: a missing file or a directory is an error that says so),
                `"cpu_testbed"`, the name of a spec shipped
                with the package (`"hetero_testbed"`, `"v100x8_nvlink"`,
                `"a100x4_t4x4"`: `autodist_keras/devices/clusters/`), another
                string (`from_string`), or a dict (`from_dict`).

        Returns:
            A `Cluster`.

        Raises:
            ClusterSpecError: For any other type, or an invalid spec.
        """
        if value is None:
            return cls.detect()
        if isinstance(value, Cluster):
            return value
        if isinstance(value, os.PathLike):
            return cls.from_yaml(value)
        if isinstance(value, str):
            text = value.strip()
            if text.lower().endswith((".yaml", ".yml")) or (text and os.path.isfile(text)):
                return cls.from_yaml(text)
            from autodist_keras.devices import spec

            if "/" in text or os.sep in text:
                # A path, unless it parses as a cluster string: a GPU type may hold a
                # "/" ("2xV100/32GB", which catalog lookups read as "V100 32GB"). A
                # missing file or a directory is reported as one, not as a GPU type.
                if os.path.isdir(text):
                    return cls.from_yaml(text)
                try:
                    return cls.from_string(text)
                except ClusterSpecError:
                    if spec.looks_like_cluster_string(text):
                        raise
                return cls.from_yaml(text)
            if text == "cpu_testbed":
                return cls.cpu_testbed()

            builtin = spec.builtin_cluster_path(text)
            if builtin is not None:
                return cls.from_yaml(builtin)
            try:
                return cls.from_string(value)
            except ClusterSpecError:
                if os.path.isdir(text):  # e.g. `--cluster clusters`: says it is a directory
                    return cls.from_yaml(text)
                close = spec.close_builtin_cluster(text)
                if close is None or spec.looks_like_cluster_string(text):
                    raise
                raise ClusterSpecError(
                    f"Unknown cluster {text!r}. Did you mean the cluster shipped with the "
                    f"package, {close!r}? Shipped clusters: "
                    f"{', '.join(spec.builtin_cluster_names())}; a cluster string reads like "
                    f"'2xV100,4x1080Ti'. Received: {value!r}"
                ) from None
        if isinstance(value, dict):
            return cls.from_dict(value)
        raise ClusterSpecError(
            "cluster must be None (detect this machine), a Cluster, a path to a YAML "
            "resource spec, a string such as '2xV100,4x1080Ti', or a dict. "
            f"Received: {value!r} of type {type(value).__name__}"
        )

    # ------------------------------------------------------------------ access
    @property
    def names(self):
        """Device names, in cluster order."""
        return [d.name for d in self.devices]

    @property
    def nodes(self):
        """Dict of node name -> `NodeSpec`."""
        return self.topology.nodes

    def device(self, name):
        """Returns the `Device` called `name`.

        Raises:
            ClusterSpecError: (an `UnknownDeviceError`, also a `KeyError`) with
                the valid names when there is no such device.
        """
        try:
            return self._by_name[name]
        except (KeyError, TypeError):
            raise _unknown_device(name, self.names) from None

    def __len__(self):
        return len(self.devices)

    def __iter__(self):
        return iter(self.devices)

    def __contains__(self, name):
        return name in self._by_name

    def __eq__(self, other):
        if not isinstance(other, Cluster):
            return NotImplemented
        return self._hardware_dict() == other._hardware_dict()

    def __hash__(self):
        return hash(self.fingerprint())

    def __repr__(self):
        kinds = {}
        for d in self.devices:
            kinds[d.model] = kinds.get(d.model, 0) + 1
        text = ", ".join(f"{n}x{m}" for m, n in kinds.items())
        return f"Cluster({len(self.nodes)} node(s): {text}; source={self.source!r})"

    # ---------------------------------------------------------- serialisation
    def _hardware_dict(self):
        topo = self.topology.to_dict()
        return {
            "schema_version": SCHEMA_VERSION,
            "devices": [d.to_dict() for d in self.devices],
            "nodes": topo["nodes"],
            "links": topo["links"],
        }

    def to_dict(self):
        """The cluster as JSON-serialisable data; `from_dict` reads it back exactly.

        Keys: `schema_version`, `devices`, `nodes`, `links` (per-pair links),
        `source` and `notes`.
        """
        d = self._hardware_dict()
        d["source"] = self.source
        d["notes"] = list(self.notes)
        return d

    def fingerprint(self):
        """sha256 (hex) of the canonical JSON of the hardware in `to_dict()`.

        Canonical JSON: sorted keys, no whitespace. `source` and `notes` are
        left out, so the same hardware described as a YAML file or as a string
        has the same fingerprint. Stable across runs and processes.
        """
        text = json.dumps(self._hardware_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode("utf-8")).hexdigest()

    # ----------------------------------------------------------------- summary
    def _device_rows(self):
        rows = []
        for d in self.devices:
            cores = ""
            if d.cpu_affinity is not None:
                cores = ",".join(str(c) for c in d.cpu_affinity)
                if d.threads is not None:
                    cores += f" ({d.threads} thr)"
            rows.append([
                d.name, d.kind, d.model, f"{d.memory_bytes / 2**30:.1f}",
                f"{d.peak_flops_fp32 / 1e12:.3g}", f"{d.peak_flops_fp16 / 1e12:.3g}",
                f"{d.memory_bandwidth / 1e9:.4g}", cores,
            ])
        return rows

    def _node_rows(self):
        rows = []
        for node in self.nodes.values():
            n = sum(1 for d in self.devices if d.node == node.name)
            rows.append([
                node.name, str(node.address) if node.address is not None else "-", str(n),
                f"{node.nic_bandwidth * 8 / 1e9:.4g}", node.intra_link,
                f"{node.intra_bandwidth / 1e9:.4g}", f"{node.intra_latency * 1e6:.3g}",
            ])
        return rows

    DEVICE_COLUMNS = ["device", "kind", "model", "memory GiB", "fp32 TFLOP/s",
                      "fp16 TFLOP/s", "mem GB/s", "cores"]
    NODE_COLUMNS = ["node", "address", "devices", "NIC Gbit/s", "intra link",
                    "intra GB/s", "intra us"]

    def summary(self, rich=None):
        """A readable table of the devices, nodes and notes.

        Args:
            rich: `True` for a rich table (with terminal colours), `False` for
                plain text; default: rich when standard output is a terminal.

        Returns:
            A string (print it).
        """
        if rich is None:
            rich = sys.stdout.isatty()
        header = (
            f"Cluster: {len(self)} device(s) on {len(self.nodes)} node(s); "
            f"source: {self.source}; fingerprint {self.fingerprint()[:12]}"
        )
        footer = [f"links: {self._link_summary()}"] if self.topology.links else []
        footer += [f"note: {note}" for note in self.notes]
        footer.append("Figures are spec-sheet peaks or documented estimates, not measurements.")
        if rich:
            return self._rich_summary(header, footer)
        return "\n".join(
            [header, _plain_table(self.DEVICE_COLUMNS, self._device_rows()), "",
             _plain_table(self.NODE_COLUMNS, self._node_rows()), *footer]
        )

    def _link_summary(self):
        parts = [
            f"{a}<->{b} {link.type} {link.bandwidth / 1e9:.4g} GB/s"
            for (a, b), link in sorted(self.topology.links.items())
        ]
        if len(parts) > 8:
            parts = parts[:8] + [f"... ({len(self.topology.links)} in all)"]
        return "; ".join(parts)

    def _rich_summary(self, header, footer):
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text

        buffer = io.StringIO()
        console = Console(file=buffer, force_terminal=True, width=120)
        console.print(header, markup=False, highlight=False)
        for title, columns, rows in (
            ("devices", self.DEVICE_COLUMNS, self._device_rows()),
            ("nodes", self.NODE_COLUMNS, self._node_rows()),
        ):
            table = Table(title=title)
            for i, column in enumerate(columns):
                table.add_column(column, justify="right" if i >= 3 else "left")
            for row in rows:
                # Text, not markup: a GPU named "RTX [lab]" (or "X[/]") in a spec
                # was styled away, or stopped the summary with rich's MarkupError.
                table.add_row(*(Text(str(cell)) for cell in row))
            console.print(table)
        for line in footer:
            console.print(line, markup=False, highlight=False)
        return buffer.getvalue().rstrip("\n")


def _plain_table(columns, rows):
    widths = [max(len(str(x)) for x in [c] + [r[i] for r in rows]) for i, c in enumerate(columns)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(columns, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append("  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip())
    return "\n".join(lines)
