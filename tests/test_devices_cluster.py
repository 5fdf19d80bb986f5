"""Cluster, Topology, the CPU testbed, detection, fingerprints and summaries."""

import json
import os
import subprocess
import sys

import pytest

from autodist_keras.devices import Cluster
from autodist_keras.devices import Device
from autodist_keras.devices import GPU_CATALOG
from autodist_keras.devices import UnknownDeviceError
from autodist_keras.devices import cluster as cluster_module
from autodist_keras.devices import detect
from autodist_keras.errors import ClusterSpecError
from autodist_keras.strategies.baselines import device_speeds
from autodist_keras.strategies.plan import split_batch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples", "clusters")


# ------------------------------------------------------------------ topology
def test_topology_link_types_bandwidths_and_latencies():
    cluster = Cluster.from_string("node0:2xV100;node1:2x1080Ti,V100@50")
    topo = cluster.topology
    assert cluster.names == ["node0/gpu0", "node0/gpu1", "node1/gpu0", "node1/gpu1",
                             "node1/gpu2"]
    # Same device.
    assert topo.link_type("node0/gpu0", "node0/gpu0") == "local"
    assert topo.bandwidth("node0/gpu0", "node0/gpu0") == float("inf")
    assert topo.latency("node0/gpu0", "node0/gpu0") == 0.0
    # NVLink between two V100 SXM2: half the 300 GB/s both-ways datasheet figure.
    assert topo.link_type("node0/gpu0", "node0/gpu1") == "nvlink"
    assert topo.bandwidth("node0/gpu0", "node0/gpu1") == 150e9
    assert topo.latency("node0/gpu1", "node0/gpu0") == cluster_module.NVLINK_LATENCY
    # A 1080 Ti has no NVLink, so its node defaults to PCIe gen3.
    assert topo.link_type("node1/gpu0", "node1/gpu2") == "pcie"
    assert topo.bandwidth("node1/gpu0", "node1/gpu2") == pytest.approx(15.754e9, rel=1e-3)
    assert topo.latency("node1/gpu0", "node1/gpu1") == cluster_module.PCIE_LATENCY
    # Across nodes: the slower NIC (default 25 Gbit/s vs 50) and network latency.
    assert topo.link_type("node0/gpu0", "node1/gpu1") == "network"
    assert topo.bandwidth("node0/gpu0", "node1/gpu1") == 25e9 / 8
    assert topo.latency("node1/gpu1", "node0/gpu0") == cluster_module.NETWORK_LATENCY
    assert cluster.nodes["node1"].nic_bandwidth == 50e9 / 8
    # Documented latency ordering: local < NVLink < PCIe < network.
    assert 0 < 2e-6 <= cluster_module.NVLINK_LATENCY <= 5e-6 < cluster_module.PCIE_LATENCY
    assert cluster_module.PCIE_LATENCY <= 10e-6 < 20e-6 <= cluster_module.NETWORK_LATENCY <= 50e-6


def test_unknown_devices_raise_cluster_spec_error_that_is_also_a_key_error():
    cluster = Cluster.from_string("2xT4")
    for call in (lambda: cluster.device("node0/gpu7"),
                 lambda: cluster.topology.bandwidth("node0/gpu0", "gpu1"),
                 lambda: cluster.topology.latency("nodeX/gpu0", "node0/gpu0")):
        with pytest.raises(ClusterSpecError) as info:
            call()
        assert isinstance(info.value, KeyError) and isinstance(info.value, UnknownDeviceError)
        assert "node0/gpu0" in str(info.value) and "node0/gpu1" in str(info.value)
        assert "Received" in str(info.value) and not str(info.value).startswith("'")
    with pytest.raises(KeyError):
        cluster.device(["not", "hashable"])


def test_cluster_api():
    cluster = Cluster.from_string("4xA100,2xT4")
    assert len(cluster) == 6 and list(cluster) == cluster.devices
    assert "node0/gpu5" in cluster and "node0/gpu6" not in cluster
    assert isinstance(cluster.device("node0/gpu4"), Device)
    assert cluster.device("node0/gpu4").model == "T4"
    assert set(cluster.nodes) == {"node0"}
    assert isinstance(cluster.notes, list)
    assert "4xA100-SXM4-40GB" in repr(cluster)
    with pytest.raises(ClusterSpecError, match="at least one device"):
        Cluster([], cluster.topology)


# -------------------------------------------------------------- serialisation
@pytest.mark.parametrize("make", [
    lambda: Cluster.from_string("node0:2xV100;node1:4x1080Ti@50"),
    lambda: Cluster.cpu_testbed(),
    lambda: Cluster.detect(),
    lambda: Cluster.from_yaml(os.path.join(EXAMPLES, "hetero_testbed.yaml")),
    lambda: _dgx1(),
])
def test_to_dict_from_dict_round_trip(make):
    cluster = make()
    data = cluster.to_dict()
    text = json.dumps(data)  # JSON-serialisable
    again = Cluster.from_dict(json.loads(text))
    assert again.to_dict() == data
    assert again == cluster and again.fingerprint() == cluster.fingerprint()
    assert again.source == cluster.source and again.notes == cluster.notes
    for a in cluster.names[:3]:
        for b in cluster.names[-3:]:
            assert again.topology.bandwidth(a, b) == cluster.topology.bandwidth(a, b)
            assert again.topology.link_type(a, b) == cluster.topology.link_type(a, b)


def test_fingerprint_is_of_the_hardware_and_changes_with_it():
    from_string = Cluster.from_string("2xV100")
    from_dict = Cluster.from_dict({"nodes": [{"gpus": [{"type": "V100", "count": 2}]}]})
    assert from_string.source != from_dict.source
    assert from_string.fingerprint() == from_dict.fingerprint()
    assert len(from_string.fingerprint()) == 64
    assert Cluster.from_string("2xV100@100").fingerprint() != from_string.fingerprint()
    assert Cluster.from_string("3xV100").fingerprint() != from_string.fingerprint()
    assert Cluster.from_string("2xV100 32GB").fingerprint() != from_string.fingerprint()


def test_fingerprint_stable_across_processes_and_no_framework_import():
    code = (
        "import sys, json, os\n"
        "from autodist_keras.devices import Cluster\n"
        "clusters = [Cluster.from_string('node0:2xV100;node1:4x1080Ti@50'),\n"
        "            Cluster.from_yaml(os.path.join(sys.argv[1], 'a100x4_t4x4.yaml')),\n"
        "            Cluster.cpu_testbed(), Cluster.detect()]\n"
        "print(json.dumps({'fp': [c.fingerprint() for c in clusters],\n"
        "  'frameworks': [m for m in ('tensorflow', 'torch') if m in sys.modules]}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, EXAMPLES], cwd=ROOT, capture_output=True, text=True,
        timeout=120, env=dict(os.environ, PYTHONPATH=ROOT, PYTHONHASHSEED="123"),
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    here = [Cluster.from_string("node0:2xV100;node1:4x1080Ti@50").fingerprint(),
            Cluster.from_yaml(os.path.join(EXAMPLES, "a100x4_t4x4.yaml")).fingerprint(),
            Cluster.cpu_testbed().fingerprint(), Cluster.detect().fingerprint()]
    assert result["fp"] == here
    # Detection on a machine without a CUDA driver must not pull in a framework.
    if not detect.cuda_driver_present():
        assert result["frameworks"] == []


# -------------------------------------------------------------------- summary
def test_summary_plain_and_rich():
    cluster = Cluster.from_yaml(os.path.join(EXAMPLES, "hetero_testbed.yaml"))
    plain = cluster.summary(rich=False)
    assert isinstance(plain, str) and "\x1b[" not in plain
    for name in cluster.names + ["V100-PCIE-16GB", "GTX1080Ti", "P100-PCIE-16GB", "10.0.0.13"]:
        assert name in plain
    assert cluster.fingerprint()[:12] in plain and "not measurements" in plain
    fancy = cluster.summary(rich=True)
    assert "\x1b[" in fancy and "node3/gpu1" in fancy
    # Under pytest stdout is not a terminal: the default is plain text.
    if not sys.stdout.isatty():
        assert cluster.summary() == plain


# -------------------------------------------------------------------- resolve
def test_resolve(tmp_path):
    cluster = Cluster.from_string("2xT4")
    assert Cluster.resolve(cluster) is cluster
    assert Cluster.resolve("2xT4") == cluster
    assert Cluster.resolve({"nodes": [{"gpus": ["2xT4"]}]}) == cluster
    path = os.path.join(EXAMPLES, "v100x8_nvlink.yaml")
    assert Cluster.resolve(path).source == path
    import pathlib

    assert len(Cluster.resolve(pathlib.Path(path))) == 8
    assert Cluster.resolve("cpu_testbed") == Cluster.cpu_testbed()
    assert Cluster.resolve(None).source.startswith("detect: ")
    with pytest.raises(ClusterSpecError, match="No such file"):
        Cluster.resolve(str(tmp_path / "missing.yml"))
    # A path is a path, with or without a YAML ending: a directory, or a missing file,
    # was read as a cluster string ("Unknown GPU type '/tmp/.../specs'").
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "mine.yaml").write_text("nodes: [{gpus: [T4]}]\n")
    for folder in (str(tmp_path / "specs"), str(tmp_path / "specs") + os.sep):
        with pytest.raises(ClusterSpecError, match=r"a directory, not a YAML resource spec "
                           r"file\. It holds 'mine\.yaml'.*Received"):
            Cluster.resolve(folder)
    with pytest.raises(ClusterSpecError, match="No such file"):
        Cluster.resolve(str(tmp_path / "specs" / "mine"))
    # ... but a cluster string whose GPU type holds a "/" stays a cluster string (it
    # read "No such file" for a while in session 29), and its typos stay GPU-type errors.
    assert [d.model for d in Cluster.resolve("2xV100/32GB").devices] == ["V100-SXM2-32GB"] * 2
    assert len(Cluster.resolve("node0:2xV100;node1:1xA100/80GB@50").devices) == 3
    with pytest.raises(ClusterSpecError, match="Unknown GPU type 'V100/33GB'"):
        Cluster.resolve("2xV100/33GB")
    for bad in (3, 2.5, ["2xT4"], object()):
        with pytest.raises(ClusterSpecError, match="Received"):
            Cluster.resolve(bad)


# --------------------------------------------------------------- CPU testbed
def test_cpu_testbed_default_gives_2_1_1():
    if not {0, 1} <= set(detect.available_cores()):
        pytest.skip("needs cores 0 and 1")
    cluster = Cluster.cpu_testbed()
    assert cluster.names == ["node0/cpu0", "node0/cpu1", "node0/cpu2"]
    assert [d.cpu_affinity for d in cluster] == [(0,), (1,), (1,)]
    assert [d.threads for d in cluster] == [1, 1, 1]
    assert all(d.kind == "cpu" and d.model == "cpu" for d in cluster)
    peaks = [d.peak_flops_fp32 for d in cluster]
    assert peaks == [cluster_module.CPU_CORE_PEAK_FLOPS,
                     cluster_module.CPU_CORE_PEAK_FLOPS / 2,
                     cluster_module.CPU_CORE_PEAK_FLOPS / 2]
    # The proportional baseline weighs devices by peak FP32: 2:1:1.
    speeds = device_speeds(cluster)
    assert split_batch([speeds[n] for n in cluster.names], 64) == [32, 16, 16]
    assert cluster.topology.link_type("node0/cpu1", "node0/cpu2") == "custom"
    assert cluster.topology.bandwidth("node0/cpu0", "node0/cpu1") == cluster_module.SHM_BANDWIDTH
    assert any("estimate" in note for note in cluster.notes)
    # The YAML example describes the same hardware.
    assert Cluster.from_yaml(os.path.join(EXAMPLES, "cpu_testbed.yaml")) == cluster


def test_cpu_testbed_custom_devices():
    cores = detect.available_cores()
    cluster = Cluster.cpu_testbed([{"cores": cores, "threads": len(cores)},
                                   {"cores": cores[:1], "threads": 1, "memory_gb": 1}])
    first, second = cluster.devices
    share_first0 = 1 / 2  # core cores[0] is used by both devices
    expected = (share_first0 + (len(cores) - 1)) * cluster_module.CPU_CORE_PEAK_FLOPS
    assert first.peak_flops_fp32 == pytest.approx(expected)
    assert second.peak_flops_fp32 == pytest.approx(cluster_module.CPU_CORE_PEAK_FLOPS / 2)
    assert second.memory_bytes == 2**30


@pytest.mark.parametrize("devices, field, text", [
    ([{"cores": [4096], "threads": 1}], "devices[0].cores[0]", "not available"),
    ([{"cores": [], "threads": 1}], "devices[0].cores", "must not be empty"),
    ([{"cores": [0], "threads": 0}], "devices[0].threads", "from 1"),
    ([{"cores": [0, 0]}], "devices[0].cores", "once"),
    ([{"cores": "0"}], "devices[0].cores", "must be a list"),
    ([{"threads": 1}], "devices[0].cores", "needs `cores`"),
    ([{"cores": [0], "thread": 1}], "devices[0].thread", "Did you mean 'threads'"),
    ([], "devices", "must not be empty"),
    ("0,1", "devices", "list of"),
])
def test_cpu_testbed_errors(devices, field, text):
    with pytest.raises(ClusterSpecError) as info:
        Cluster.cpu_testbed(devices)
    assert info.value.field == field, str(info.value)
    assert text in str(info.value) and "Received" in str(info.value)
    assert info.value.source == "cpu_testbed()"


# ------------------------------------------------------------------ detection
def test_detect_on_this_machine_returns_the_cpu_and_says_why():
    gpus, status = detect.query_nvml()
    if gpus:
        pytest.skip("this machine has NVIDIA GPUs")
    cluster = Cluster.detect()
    assert cluster.source == "detect: cpu"
    assert cluster.names == ["node0/cpu0"]
    device = cluster.device("node0/cpu0")
    assert (device.kind, device.model) == ("cpu", "cpu")
    assert device.memory_bytes == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cores = len(os.sched_getaffinity(0))
    assert device.peak_flops_fp32 == cores * cluster_module.CPU_CORE_PEAK_FLOPS
    why = cluster.notes[0]
    assert why.startswith("no GPU found (NVML: ") and why.endswith("using the CPU as one device")
    assert "torch.cuda: " in why and "TensorFlow: " in why
    assert status in why
    try:
        import pynvml  # noqa: F401  (nvidia-ml-py installed: the library is what is missing)
        assert "Not Found" in status or "0 GPU" in status, status
    except ImportError:
        assert "not installed" in status
    assert any("estimate" in note for note in cluster.notes)


def _dgx1_links():
    # DGX-1 (V100) hybrid cube-mesh: 6 NVLink links per GPU, some pairs doubled.
    edges = {(0, 1): 1, (0, 2): 1, (0, 3): 2, (0, 4): 2, (1, 2): 2, (1, 3): 1, (1, 5): 2,
             (2, 3): 1, (2, 6): 2, (3, 7): 2, (4, 5): 1, (4, 6): 1, (4, 7): 2, (5, 6): 2,
             (5, 7): 1, (6, 7): 1}
    bus = [f"00000000:{0x06 + 8 * i:02X}:00.0" for i in range(8)]
    links = [[] for _ in range(8)]
    for (a, b), n in edges.items():
        links[a] += [bus[b].replace("00000000:", "0000:")] * n
        links[b] += [bus[a]] * n
    assert all(len(x) == 6 for x in links)
    return [{"name": "Tesla V100-SXM2-16GB", "memory_bytes": 16945512448,
             "bus_id": detect.normalise_bus_id(bus[i]), "nvlink": links[i]}
            for i in range(8)], edges


def _dgx1():
    gpus, _ = _dgx1_links()
    return detect.gpu_cluster(gpus, "detect: nvml", ["NVML: 8 GPU(s) visible of 8"])


def test_nvml_topology_of_a_hybrid_cube_mesh():
    gpus, edges = _dgx1_links()
    cluster = _dgx1()
    topo = cluster.topology
    assert cluster.nodes["node0"].intra_link == "pcie"  # not every pair has NVLink
    per_link = GPU_CATALOG["V100-SXM2-16GB"].nvlink_link_bandwidth
    for i in range(8):
        for j in range(i + 1, 8):
            a, b = f"node0/gpu{i}", f"node0/gpu{j}"
            if (i, j) in edges:
                assert topo.link_type(a, b) == "nvlink"
                assert topo.bandwidth(b, a) == edges[(i, j)] * per_link
            else:
                assert topo.link_type(a, b) == "pcie"
    assert cluster.device("node0/gpu3").memory_bytes == 16945512448  # the driver's figure
    assert any("NVLink joins 16 of 28" in note for note in cluster.notes)


def test_nvml_topology_through_nvswitch():
    switches = [f"0000:{0xc0 + k:02x}:00.0" for k in range(6)]
    gpus = [{"name": "NVIDIA A100-SXM4-80GB", "memory_bytes": 85899345920,
             "bus_id": f"0000:{0x10 + i:02x}:00.0", "nvlink": switches * 2} for i in range(8)]
    cluster = detect.gpu_cluster(gpus, "detect: nvml", [])
    node = cluster.nodes["node0"]
    assert node.intra_link == "nvlink" and node.intra_bandwidth == 300e9
    assert not cluster.topology.links
    assert cluster.topology.bandwidth("node0/gpu0", "node0/gpu7") == 300e9


def test_detected_gpu_missing_from_the_catalog():
    with pytest.raises(ClusterSpecError, match="not in the GPU catalog") as info:
        detect.gpu_cluster([{"name": "NVIDIA Imaginary X9"}], "detect: torch.cuda", [])
    assert "explicit figures" in str(info.value)
    # Without a driver memory figure the catalog's is used.
    cluster = detect.gpu_cluster([{"name": "Tesla T4"}], "detect: tensorflow", [])
    assert cluster.device("node0/gpu0").memory_bytes == GPU_CATALOG["T4"].memory_bytes


@pytest.mark.parametrize("value, expected", [
    (None, [0, 1, 2]), ("2,0", [2, 0]), ("", []), ("0,7,1", [0]), ("GPU-bb", [1]),
    ("1,1", [1]),
])
def test_cuda_visible_devices(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    assert detect._visible_indices(3, ["GPU-aa11", "GPU-bb22", "GPU-cc33"]) == expected


def test_bus_id_normalisation():
    assert detect.normalise_bus_id(b"00000000:07:00.0") == detect.normalise_bus_id("0000:07:00.0")
    assert detect.normalise_bus_id("garbage") == "garbage"


def test_shipped_clusters_resolve_by_name_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no examples/ here, as after `pip install`
    for name, size in (("hetero_testbed", 8), ("v100x8_nvlink", 8), ("a100x4_t4x4", 8)):
        cluster = Cluster.resolve(name)
        assert len(cluster) == size
        assert cluster.fingerprint() == Cluster.from_yaml(os.path.join(EXAMPLES,
                                                                       f"{name}.yaml")).fingerprint()
    with pytest.raises(ClusterSpecError, match="Did you mean the cluster shipped with the "
                                               "package, 'hetero_testbed'") as info:
        Cluster.resolve("hetero-testbed")
    assert "Received: 'hetero-testbed'" in str(info.value)
    with pytest.raises(ClusterSpecError, match="Unknown GPU type 'A100x4'"):
        Cluster.resolve("A100x4,T4x4")  # a cluster string's typo: its own error, no hint
    with pytest.raises(ClusterSpecError, match="name of one shipped with the package") as info:
        Cluster.resolve("missing.yaml")
    assert "hetero_testbed" in str(info.value)
