"""Resource specs: YAML files, dicts and strings, their errors, and fuzzing.

The property-based tests feed random and mutated specs to every entry point:
the only exception allowed to escape is ClusterSpecError.
"""

import copy
import os
import string

import pytest
import yaml
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from autodist_keras.devices import GPU_CATALOG
from autodist_keras.devices import Cluster
from autodist_keras.devices import cluster as cluster_module
from autodist_keras.devices import detect
from autodist_keras.errors import ClusterSpecError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples", "clusters")
EXAMPLE_FILES = sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".yaml"))
FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


def _write(tmp_path, text, name="spec.yaml"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


# ------------------------------------------------------------------ examples
def test_examples_exist_and_load():
    assert {"hetero_testbed.yaml", "v100x8_nvlink.yaml", "a100x4_t4x4.yaml",
            "cpu_testbed.yaml"} <= set(EXAMPLE_FILES)
    for name in EXAMPLE_FILES:
        path = os.path.join(EXAMPLES, name)
        cluster = Cluster.from_yaml(path)
        assert cluster.source == path and len(cluster) > 0
        assert cluster.notes  # every example has a description


def test_hetero_testbed():
    cluster = Cluster.from_yaml(os.path.join(EXAMPLES, "hetero_testbed.yaml"))
    models = [d.model for d in cluster]
    assert models.count("V100-PCIE-16GB") == 2
    assert models.count("GTX1080Ti") == 4
    assert models.count("P100-PCIE-16GB") == 2
    nics = sorted({n.nic_bandwidth * 8 / 1e9 for n in cluster.nodes.values()})
    assert nics == [50.0, 100.0] and len(cluster.nodes) == 4
    topo = cluster.topology
    assert topo.bandwidth("node0/gpu0", "node3/gpu0") == 100e9 / 8
    assert topo.bandwidth("node0/gpu0", "node1/gpu0") == 50e9 / 8
    assert topo.link_type("node2/gpu0", "node2/gpu1") == "pcie"
    addresses = [n.address for n in cluster.nodes.values()]
    assert len(set(addresses)) == 4


def test_v100x8_and_a100_t4():
    v100 = Cluster.from_yaml(os.path.join(EXAMPLES, "v100x8_nvlink.yaml"))
    assert len(v100) == 8 and {d.model for d in v100} == {"V100-SXM2-16GB"}
    assert v100.topology.link_type("node0/gpu0", "node0/gpu7") == "nvlink"
    assert v100.topology.bandwidth("node0/gpu0", "node0/gpu7") == 150e9
    mixed = Cluster.from_yaml(os.path.join(EXAMPLES, "a100x4_t4x4.yaml"))
    assert [d.model for d in mixed] == ["A100-SXM4-40GB"] * 4 + ["T4"] * 4
    a, t = "a100-node/gpu0", "t4-node/gpu3"
    assert mixed.topology.bandwidth(a, t) == 25e9 / 8
    assert mixed.topology.latency(a, t) == 40e-6  # the T4 node's override, the larger
    assert mixed.topology.link_type("t4-node/gpu0", "t4-node/gpu1") == "pcie"


# ---------------------------------------------------------------- spec forms
def test_gpu_entry_forms_and_overrides():
    cluster = Cluster.from_dict({
        "nodes": [{
            "name": "box", "address": "10.0.0.1", "nic_gbps": 40, "nic_latency_us": 12,
            "intra_link": 20, "intra_latency_us": 1.5,
            "gpus": ["T4", "2xL4", {"type": "A10", "count": 1},
                     {"name": "MyGPU", "memory_gb": 24, "fp32_tflops": 30,
                      "fp16_tflops": 120, "bandwidth_gbps": 800, "count": 2}],
        }],
    })
    assert [d.model for d in cluster] == ["T4", "L4", "L4", "A10", "MyGPU", "MyGPU"]
    mine = cluster.device("box/gpu5")
    assert (mine.memory_bytes, mine.peak_flops_fp32, mine.peak_flops_fp16,
            mine.memory_bandwidth) == (24 * 2**30, 30e12, 120e12, 800e9)
    node = cluster.nodes["box"]
    assert (node.intra_link, node.intra_bandwidth, node.intra_latency) == ("custom", 20e9, 1.5e-6)
    assert (node.nic_bandwidth, node.nic_latency, node.address) == (5e9, 12e-6, "10.0.0.1")
    explicit = Cluster.from_dict({"nodes": [{"gpus": [
        {"name": "X", "memory_gb": 8, "fp32_tflops": 5, "bandwidth_gbps": 300,
         "nvlink_gbps": 100}] * 2}]})
    assert explicit.device("node0/gpu0").peak_flops_fp16 == 5e12  # default: FP32
    assert explicit.nodes["node0"].intra_link == "nvlink"
    assert explicit.nodes["node0"].intra_bandwidth == 50e9


def test_from_string_forms():
    one = Cluster.from_string("2xV100,4x1080Ti")
    # Leading zeros are read as in "0002xV100", however many (13 or more digits were refused).
    assert Cluster.from_string("0000000000002xV100").names == ["node0/gpu0", "node0/gpu1"]
    assert len(Cluster.from_string("node0:0000000000000000003xT4").devices) == 3
    assert len(one) == 6 and set(one.nodes) == {"node0"}
    assert one.nodes["node0"].intra_link == "pcie"  # the 1080 Ti has no NVLink
    assert one.nodes["node0"].nic_bandwidth == cluster_module.DEFAULT_NIC_GBPS * 1e9 / 8
    multi = Cluster.from_string(" node0 : 2 x V100 ; node1:4*1080Ti @ 50 ")
    assert multi.names[:2] == ["node0/gpu0", "node0/gpu1"] and len(multi) == 6
    assert multi.nodes["node1"].nic_bandwidth == 50e9 / 8
    assert Cluster.from_string("8xA100@100;8xA100@100").names[-1] == "node1/gpu7"
    assert Cluster.from_string("A100 80GB").device("node0/gpu0").model == "A100-SXM4-80GB"
    assert Cluster.from_string("2XH100").nodes["node0"].intra_link == "nvlink"


def test_a_node_of_several_gpu_models_defaults_to_pcie():
    """`8xA100,8xV100` was one NVLink node of 16 GPUs: no NVLink board holds two GPU
    models (a 16-GPU SXM node is an NVSwitch box of one type)."""
    mixed = Cluster.from_string("8xA100,8xV100")
    node = mixed.nodes["node0"]
    assert (node.intra_link, node.intra_latency) == ("pcie", cluster_module.PCIE_LATENCY)
    assert mixed.topology.link_type("node0/gpu0", "node0/gpu15") == "pcie"
    assert any("node0: its GPU models differ (A100-SXM4-40GB, V100-SXM2-16GB)" in n
               and "PCIe" in n for n in mixed.notes)
    assert "its GPU models differ" in mixed.summary(rich=False)  # `autodist-keras devices`
    one = Cluster.from_string("16xV100")  # one model: a DGX-2-class NVSwitch box
    assert one.nodes["node0"].intra_link == "nvlink" and one.notes == []
    # Said explicitly, nvlink is taken as given, at the slowest model's figure, noted.
    told = Cluster.from_dict({"nodes": [{"name": "box", "intra_link": "nvlink",
                                         "gpus": ["2xA100", "2xV100"]}]})
    assert (told.nodes["box"].intra_link, told.nodes["box"].intra_bandwidth) == ("nvlink", 150e9)
    assert any("box: intra_link nvlink on GPU models that differ" in n for n in told.notes)


BAD_YAML = [
    ("nodes:\n  - gpus: [V1000]\n", "nodes[0].gpus[0]", "Did you mean"),
    ("nodes:\n  - gpus: [{type: 1080 Tie, count: 2}]\n", "nodes[0].gpus[0].type",
     "Unknown GPU type"),
    ("nodes:\n  - gpus: [{type: T4, count: two}]\n", "nodes[0].gpus[0].count",
     "whole number"),
    ("nodes:\n  - gpus: [{type: T4, count: 0}]\n", "nodes[0].gpus[0].count", "from 1"),
    ("nodes:\n  - gpus: [{type: T4, count: 2.5}]\n", "nodes[0].gpus[0].count", "whole number"),
    ("nodes:\n  - gpus: [{type: T4, count: true}]\n", "nodes[0].gpus[0].count", "whole number"),
    ("nodes:\n  - gpus: [{name: X, memory_gb: -16, fp32_tflops: 10, bandwidth_gbps: 900}]\n",
     "nodes[0].gpus[0].memory_gb", "positive"),
    ("nodes:\n  - gpus: [{name: X, memory_gb: 16, bandwidth_gbps: 900}]\n",
     "nodes[0].gpus[0].fp32_tflops", "needs `fp32_tflops`"),
    ("nodes:\n  - gpus: [{name: X, memory_gb: .nan, fp32_tflops: 1, bandwidth_gbps: 9}]\n",
     "nodes[0].gpus[0].memory_gb", "finite"),
    ("nodes:\n  - gpus: [{name: X, memory_gb: '16', fp32_tflops: 1, bandwidth_gbps: 9}]\n",
     "nodes[0].gpus[0].memory_gb", "without quotes"),
    ("nodes:\n  - gpus: [{name: X, memory_gb: 1e12, fp32_tflops: 1, bandwidth_gbps: 9}]\n",
     "nodes[0].gpus[0].memory_gb", "implausibly large"),
    ("nodes:\n  - gpus: [T4]\n    nic_gbps: 1" + "0" * 400 + "\n", "nodes[0].nic_gbps",
     "finite"),
    ("nodes:\n  - gpus: [T4]\n    nic_gbps: 1e3\n    intra_link: 2e400\n",
     "nodes[0].intra_link", "finite"),
    ("nodes:\n  - gpus: [{type: T4, name: X}]\n", "nodes[0].gpus[0]", "not both"),
    ("nodes:\n  - gpus: [{count: 2}]\n", "nodes[0].gpus[0]", "Each `gpus` entry"),
    ("nodes:\n  - gpus: [T4]\n    nic_gbps: -10\n", "nodes[0].nic_gbps", "positive"),
    ("nodes:\n  - gpus: [T4]\n    nic_gbs: 10\n", "nodes[0].nic_gbs", "Did you mean 'nic_gbps'"),
    ("nodes:\n  - gpus: [T4]\n    intra_latency_us: -1\n", "nodes[0].intra_latency_us",
     "non-negative"),
    ("nodes:\n  - gpus: [T4, T4]\n    intra_link: nvlink\n", "nodes[0].intra_link",
     "no NVLink"),
    ("nodes:\n  - gpus: [T4]\n    intra_link: infiniband\n", "nodes[0].intra_link",
     "must be `nvlink`"),
    ("nodes:\n  - gpus: [T4]\n    core_gflops: 10\n", "nodes[0].core_gflops", "cpus"),
    ("nodes:\n  - {name: a, gpus: [T4]}\n  - {name: a, gpus: [T4]}\n", "nodes[1].name",
     "unique"),
    ("nodes:\n  - {address: h1, gpus: [T4]}\n  - {address: h1, gpus: [T4]}\n",
     "nodes[1].address", "unique"),
    ("nodes:\n  - {name: a/b, gpus: [T4]}\n", "nodes[0].name", "letters"),
    ("nodes:\n  - {name: 1, gpus: [T4]}\n", "nodes[0].name", "must be a string; YAML read this one as int 1. Quote it"),
    ("nodes:\n  - {name: Node0, gpus: [T4]}\n  - {name: node0, gpus: [T4]}\n",
     "nodes[1].name", "unique, ignoring case"),
    ("nodes:\n  - gpus: [{name: X1, memory_gb: 16, fp32_tflops: 10}]\n",
     "nodes[0].gpus[0].bandwidth_gbps", "needs `bandwidth_gbps` (and `memory_gb`, `fp32_tflops`;"),
    ("nodes:\n  - {address: 10, gpus: [T4]}\n", "nodes[0].address", "non-empty string"),
    ("nodes: []\n", "nodes", "must not be empty"),
    ("nodes:\n  - {name: a}\n", "nodes[0]", "exactly one"),
    ("nodes:\n  - {gpus: [T4], cpus: [{cores: [0]}]}\n", "nodes[0]", "exactly one"),
    ("nodes:\n  - {gpus: []}\n", "nodes[0].gpus", "must not be empty"),
    ("nodes:\n  - {gpus: T4}\n", "nodes[0].gpus", "must be a list"),
    ("nodes:\n  - {cpus: [{cores: [0]}], intra_link: pcie}\n", "nodes[0].intra_link", "shm"),
    ("nodes:\n  - {gpus: ['2000xT4']}\n", "nodes[0].gpus[0]", "from 1 to 1024"),
    ("nodes:\n" + "  - {gpus: [{type: T4, count: 1000}]}\n" * 5, "nodes[4].gpus[0]",
     "at most 4096"),
    ("node:\n  - {gpus: [T4]}\n", "node", "Did you mean 'nodes'"),
    ("description: x\n", "nodes", "needs a `nodes` list"),
    ("- gpus: [T4]\n", None, "top level"),
    ("nodes: [T4]\n", "nodes[0]", "must be a mapping"),
]


@pytest.mark.parametrize("text, field, needle", BAD_YAML)
def test_bad_yaml_specs_name_file_field_and_value(tmp_path, text, field, needle):
    path = _write(tmp_path, text)
    with pytest.raises(ClusterSpecError) as info:
        Cluster.from_yaml(path)
    error = info.value
    assert error.source == path
    assert error.field == field, str(error)
    assert needle in str(error)
    assert "Received:" in str(error) and str(error).startswith(f"In {path}")
    assert f"Received: {error.value!r}" in str(error)  # the value travels on the error too


@pytest.mark.parametrize("text, needle", [
    ("", "empty"),
    ("# only a comment\n", "empty"),
    ("nodes:\n  - gpus: [T4\n", "Not valid YAML at line"),
    ("nodes:\n\t- gpus: [T4]\n", "Not valid YAML"),
    ("nodes: [{gpus: [T4]}]\nnodes: {\n", "Not valid YAML"),
    ("!!python/object:os.system {}\n", "Not valid YAML"),  # safe_load refuses objects
    # A repeated key would silently drop the first (YAML keeps the last).
    ("nodes:\n  - {name: a, gpus: [2xV100]}\nnodes:\n  - {name: b, gpus: [2xT4]}\n",
     r"line 3, column 1: duplicate key 'nodes' \(first at line 1\).*merge them"),
    ("nodes:\n  - name: n0\n    gpus: [4xV100]\n    gpus: [4xT4]\n",
     r"duplicate key 'gpus' \(first at line 3\)"),
])
def test_malformed_yaml(tmp_path, text, needle):
    path = _write(tmp_path, text)
    with pytest.raises(ClusterSpecError, match=needle) as info:
        Cluster.from_yaml(path)
    assert info.value.source == path and "Received" in str(info.value)


def test_yaml_merge_keys_still_load(tmp_path):
    """`<<: *anchor` may be overridden by the mapping's own keys (YAML's merge rule):
    the repeated-key check must not refuse it."""
    path = _write(tmp_path, "nodes:\n"
                            "  - &first {name: a, nic_gbps: 25, gpus: [{type: V100, count: 2}]}\n"
                            "  - {<<: *first, name: b, gpus: [{type: T4, count: 2}]}\n")
    cluster = Cluster.from_yaml(path)
    assert cluster.names == ["a/gpu0", "a/gpu1", "b/gpu0", "b/gpu1"]
    assert cluster.device("b/gpu0").model == "T4"


def test_unreadable_files(tmp_path):
    with pytest.raises(ClusterSpecError, match="No such file"):
        Cluster.from_yaml(tmp_path / "nope.yaml")
    # (A raw "ValueError: embedded null byte" from open(); the fuzz test met "/\x00".)
    with pytest.raises(ClusterSpecError, match="cannot hold a NUL character.*Received"):
        Cluster.resolve("/\x00")
    with pytest.raises(ClusterSpecError, match="Cannot read"):
        Cluster.from_yaml(tmp_path)
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00nodes")
    with pytest.raises(ClusterSpecError, match="Cannot read"):
        Cluster.from_yaml(binary)
    with pytest.raises(ClusterSpecError, match="path-like"):
        Cluster.from_yaml(12)


@pytest.mark.parametrize("text, needle", [
    ("", "empty"),
    ("   ", "empty"),
    ("2xV1000", "Unknown GPU type"),
    ("MI250X", "in a YAML spec's gpus list \\(a cluster string cannot carry them\\)"),
    ("2xV100@fast", "after '@'"),
    ("2xV100@-5", "positive"),
    ("2xV100@inf", "finite"),
    ("2xV100@1@2", "at most one '@'"),
    ("0xV100", "`nodes\\[0\\].gpus\\[0\\]`: The count before 'x' must be a whole number "
               "from 1 to 1024; it is '0'"),
    # A sign, a fraction or an exponent was read as a GPU type ("Unknown GPU type '-2xV100'.
    # Did you mean 'V100-SXM2-16GB'?").
    ("-2xV100", "must be a whole number from 1 to 1024; it is '-2'. Write e.g. '2xV100'"),
    ("+2xV100", "whole number from 1 to 1024; it is '\\+2'"),
    ("2.5xV100", "whole number from 1 to 1024; it is '2.5'"),
    ("1e1xV100", "whole number from 1 to 1024; it is '1e1'"),
    # No count before the 'x' (was "Unknown GPU type 'xV100'"; "*T4" was one T4).
    (" xV100", "`nodes\\[0\\].gpus\\[0\\]`: The count before 'x' must be a whole number "
               "from 1 to 1024; it is empty. Write e.g. '2xV100'"),
    ("2xV100,X T4", "`nodes\\[0\\].gpus\\[1\\]`: The count before 'x'.*it is empty"),
    ("*T4", "The count before 'x'.*it is empty"),
    # An unknown type that starts with an x is named as unknown (it was "the count before
    # 'x' ... is empty" for "Xavier", though no count was meant).
    ("2xV100,Xavier", "`nodes\\[0\\].gpus\\[1\\]`: Unknown GPU type 'Xavier'. Known types"),
    ("00000xT4", "whole number from 1 to 1024; it is '00000'"),
    ("01025xT4", "whole number from 1 to 1024; it is '01025'"),
    # Empty entries and nodes name the entry (was `nodes[0]`: "A node lists one or more GPUs").
    ("2xV100,,4x1080Ti", "`nodes\\[0\\].gpus\\[1\\]`: This GPU entry is empty: two ',' in a "
                         "row.*Remove the extra ','"),
    ("2xV100,", "`nodes\\[0\\].gpus\\[1\\]`: This GPU entry is empty"),
    ("2xV100;", "`nodes\\[1\\]`: This node is empty.*Remove the extra ';'"),
    ("2xV100;;T4", "`nodes\\[1\\]`: This node is empty"),
    ("n1:@50", "`nodes\\[0\\].gpus`: Node 'n1' lists no GPUs.*'n1:2xV100@50'"),
    ("a:b:c", "Unknown GPU type"),
    ("bad name:T4", "letters"),
    ("n:T4;n:T4", "unique"),
    ("2xT4 16GB", "Did you mean 'T4'"),
    ("CPU_TESTBED", "use the cluster 'cpu_testbed'"),
    ("99999999999999xT4", "from 1 to 1024"),
    ("3x", "The GPU type after the count is missing.*'3xV100'"),  # (said what a type is)
])
def test_bad_strings(text, needle):
    with pytest.raises(ClusterSpecError, match=needle) as info:
        Cluster.from_string(text)
    assert info.value.source == f"cluster string {text!r}"
    assert "Received" in str(info.value)


def test_bad_dicts_and_canonical_forms():
    with pytest.raises(ClusterSpecError, match="mapping"):
        Cluster.from_dict(["nodes"])
    data = Cluster.from_string("2xT4").to_dict()
    for mutate, needle in [
        (lambda d: d.update(schema_version=2), "schema version"),
        (lambda d: d["devices"][0].update(memory_bytes=-1), "from 1"),
        (lambda d: d["devices"][1].update(name="node0/gpu0"), "unique"),
        (lambda d: d["devices"][0].update(node="elsewhere"), "not listed"),
        (lambda d: d["devices"][0].pop("kind"), "needs `kind`"),
        (lambda d: d["nodes"][0].update(intra_link="warp"), "intra_link"),
        (lambda d: d["nodes"].append(dict(d["nodes"][0])), "unique"),
        (lambda d: d.update(links=[{"devices": ["node0/gpu0", "node0/gpu0"], "type": "nvlink",
                                    "bandwidth": 1e9, "latency": 0.0}]), "two different"),
        (lambda d: d.update(devices=[]), "must not be empty"),
        (lambda d: d.update(extra=1), "Unknown key"),
    ]:
        broken = copy.deepcopy(data)
        mutate(broken)
        with pytest.raises(ClusterSpecError, match=needle):
            Cluster.from_dict(broken)


# --------------------------------------------------------------- fuzzing
_scalars = (st.none() | st.booleans() | st.integers(-10**20, 10**20)
            | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12)
            | st.sampled_from(["V100", "2xT4", "nvlink", "pcie", "shm", "node0", "type",
                               "count", "gpus", "cpus", "cores", "name", "nodes"]))
_keys = st.sampled_from(["nodes", "gpus", "cpus", "type", "count", "name", "address",
                         "nic_gbps", "intra_link", "memory_gb", "fp32_tflops",
                         "bandwidth_gbps", "cores", "threads", "devices", "description",
                         "schema_version", "links", "kind", "node"]) | st.text(max_size=6)
_json = st.recursive(_scalars, lambda children: st.lists(children, max_size=4)
                     | st.dictionaries(_keys, children, max_size=5), max_leaves=25)


def _only_cluster_spec_errors(call):
    try:
        result = call()
    except ClusterSpecError as e:
        assert str(e)  # a message, never empty
        return None
    assert isinstance(result, Cluster) and len(result) >= 1
    # Anything accepted round-trips and fingerprints.
    assert Cluster.from_dict(result.to_dict()).fingerprint() == result.fingerprint()
    return result


@FUZZ
@given(spec=st.dictionaries(_keys, _json, max_size=4) | _json)
def test_fuzz_random_dicts(spec):
    _only_cluster_spec_errors(lambda: Cluster.from_dict(spec))


@settings(FUZZ, max_examples=100)
@given(spec=_json)
def test_fuzz_random_node_lists(spec):
    _only_cluster_spec_errors(lambda: Cluster.from_dict({"nodes": [spec]}))
    _only_cluster_spec_errors(lambda: Cluster.from_dict({"nodes": [{"gpus": spec}]}))
    _only_cluster_spec_errors(lambda: Cluster.from_dict({"nodes": [{"cpus": [spec]}]}))


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def _mutate(obj, data):
    obj = copy.deepcopy(obj)
    for _ in range(data.draw(st.integers(1, 3))):
        paths = [p for p in _paths(obj) if p]
        if not paths:
            return data.draw(_json)
        path = data.draw(st.sampled_from(paths))
        parent = obj
        for key in path[:-1]:
            parent = parent[key]
        action = data.draw(st.sampled_from(["replace", "delete", "add", "duplicate"]))
        key = path[-1]
        if action == "replace":
            parent[key] = data.draw(_json)
        elif action == "delete":
            del parent[key]
        elif action == "add" and isinstance(parent, dict):
            parent[data.draw(_keys)] = data.draw(_json)
        elif action == "duplicate" and isinstance(parent, list):
            parent.append(copy.deepcopy(parent[key]))
    return obj


_EXAMPLE_SPECS = []
for _name in EXAMPLE_FILES:
    with open(os.path.join(EXAMPLES, _name), encoding="utf-8") as _f:
        _EXAMPLE_SPECS.append(yaml.safe_load(_f))


@FUZZ
@given(data=st.data())
def test_fuzz_mutated_examples(data):
    spec = data.draw(st.sampled_from(_EXAMPLE_SPECS))
    _only_cluster_spec_errors(lambda: Cluster.from_dict(_mutate(spec, data)))


@FUZZ
@given(data=st.data())
def test_fuzz_mutated_canonical_dicts(data):
    base = data.draw(st.sampled_from([
        Cluster.from_string("node0:2xV100;node1:T4@10").to_dict(),
        Cluster.cpu_testbed([{"cores": detect.available_cores()[:1]}]).to_dict(),
    ]))
    _only_cluster_spec_errors(lambda: Cluster.from_dict(_mutate(base, data)))


_yaml_alphabet = st.sampled_from(list(string.printable) + ["nodes", "gpus", "V100", "count",
                                                            "- ", ": ", "\n  ", "{", "}", "&a",
                                                            "*a", "!!", "cpus", "cores"])


@FUZZ
@given(text=st.lists(_yaml_alphabet, max_size=40).map("".join) | _json.map(yaml.safe_dump))
def test_fuzz_random_yaml_text(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("fuzz") / "spec.yaml"
    path.write_text(text, encoding="utf-8")
    _only_cluster_spec_errors(lambda: Cluster.from_yaml(path))


_string_alphabet = st.sampled_from(list("0123456789xX*;:,@. -_")
                                   + [k for k in GPU_CATALOG][:8] + ["V100", "T4", "1080Ti",
                                                                    "node0", "A100 80GB", "e9"])


@FUZZ
@given(text=st.lists(_string_alphabet, max_size=16).map("".join) | st.text(max_size=30))
def test_fuzz_random_strings(text):
    _only_cluster_spec_errors(lambda: Cluster.from_string(text))
    _only_cluster_spec_errors(lambda: Cluster.resolve(text) if text.strip() != "" else
                              Cluster.from_string(text))
