"""The GPU catalog: coverage, figures, name lookup as drivers report names."""

import pytest

from autodist_keras.devices import GPU_CATALOG
from autodist_keras.devices import lookup_gpu
from autodist_keras.devices.catalog import PCIE_X16_BANDWIDTH
from autodist_keras.devices.catalog import normalise_gpu_name
from autodist_keras.errors import ClusterSpecError

REQUIRED = ["K80", "P100", "V100 16GB", "V100 32GB", "T4", "1080Ti", "2080Ti", "RTX 3090",
            "RTX 4090", "A10", "A100 40GB", "A100 80GB", "L4", "L40S", "H100", "H200"]


def test_catalog_covers_the_required_types():
    keys = {lookup_gpu(name).key for name in REQUIRED}
    assert len(keys) == len(REQUIRED)  # 16 distinct entries
    assert len(GPU_CATALOG) >= 14


@pytest.mark.parametrize("key", list(GPU_CATALOG))
def test_every_entry_is_complete_and_sourced(key):
    spec = GPU_CATALOG[key]
    assert spec.key == key
    assert spec.memory_bytes >= 8 * 2**30
    assert 1e12 < spec.peak_flops_fp32 < 1e15
    assert spec.peak_flops_fp16 >= spec.peak_flops_fp32
    assert 1e11 < spec.memory_bandwidth < 1e13
    assert spec.pcie_gen in PCIE_X16_BANDWIDTH
    assert spec.form_factor in ("sxm", "pcie")
    assert (spec.nvlink_bandwidth > 0) == (spec.nvlink_links > 0)
    if spec.form_factor == "sxm":
        assert spec.nvlink_bandwidth > 0
    assert "datasheet" in spec.source or "whitepaper" in spec.source or "specifications" in spec.source
    assert lookup_gpu(key) is spec
    for alias in spec.aliases:
        assert lookup_gpu(alias) is spec, alias
    assert spec.to_dict()["key"] == key


def test_spec_sheet_figures():
    v100 = GPU_CATALOG["V100-SXM2-16GB"]
    assert (v100.peak_flops_fp32, v100.peak_flops_fp16) == (15.7e12, 125e12)
    assert v100.memory_bandwidth == 900e9 and v100.memory_bytes == 16 * 2**30
    assert v100.nvlink_pair_bandwidth == 150e9 and v100.nvlink_link_bandwidth == 25e9
    assert GPU_CATALOG["A100-SXM4-80GB"].memory_bandwidth == 2039e9
    assert GPU_CATALOG["A100-SXM4-40GB"].peak_flops_fp16 == 312e12
    # Datasheets quote H100/H200/L4 tensor peaks with sparsity; the catalog keeps dense.
    assert GPU_CATALOG["H100-SXM5-80GB"].peak_flops_fp16 == 1979e12 / 2
    assert GPU_CATALOG["L4"].peak_flops_fp16 == 242e12 / 2
    # The K80 entry is one of the board's two GPUs, as drivers list them.
    assert GPU_CATALOG["K80"].memory_bytes == 12 * 2**30
    assert GPU_CATALOG["GTX1080Ti"].peak_flops_fp16 == GPU_CATALOG["GTX1080Ti"].peak_flops_fp32
    assert GPU_CATALOG["T4"].pcie_bandwidth == pytest.approx(15.75e9, rel=1e-3)


@pytest.mark.parametrize(
    "name, key",
    [
        ("Tesla V100-SXM2-16GB", "V100-SXM2-16GB"),
        ("Tesla V100-PCIE-32GB", "V100-PCIE-32GB"),
        ("NVIDIA A100-SXM4-80GB", "A100-SXM4-80GB"),
        ("A100-SXM4-40GB", "A100-SXM4-40GB"),
        ("NVIDIA A100 80GB PCIe", "A100-PCIE-80GB"),
        ("NVIDIA GeForce RTX 3090", "RTX3090"),
        ("NVIDIA GeForce RTX 4090", "RTX4090"),
        ("GeForce RTX 2080 Ti", "RTX2080Ti"),
        ("Tesla K80", "K80"),
        ("Tesla P100-PCIE-16GB", "P100-PCIE-16GB"),
        ("Tesla P100-SXM2-16GB", "P100-SXM2-16GB"),
        ("Tesla T4", "T4"),
        ("1080Ti", "GTX1080Ti"),
        ("GTX 1080 Ti", "GTX1080Ti"),
        ("NVIDIA GeForce GTX 1080 Ti", "GTX1080Ti"),
        ("v100", "V100-SXM2-16GB"),
        ("V100", "V100-SXM2-16GB"),
        ("V100 32GB", "V100-SXM2-32GB"),
        ("A100", "A100-SXM4-40GB"),
        ("A100 80GB", "A100-SXM4-80GB"),
        ("a100_80gb", "A100-SXM4-80GB"),
        ("NVIDIA A10", "A10"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA H100 80GB HBM3", "H100-SXM5-80GB"),
        ("NVIDIA H100 PCIe", "H100-PCIE-80GB"),
        ("NVIDIA H200", "H200-SXM-141GB"),
        ("P100", "P100-PCIE-16GB"),
    ],
)
def test_lookup_tolerates_driver_names(name, key):
    assert lookup_gpu(name).key == key


def test_normalisation_drops_vendor_words_only_as_words():
    assert normalise_gpu_name("NVIDIA GeForce RTX 3090") == "rtx3090"
    assert normalise_gpu_name("Tesla V100-SXM2-16GB") == "v100sxm216gb"
    assert lookup_gpu("A10").key != lookup_gpu("A100").key


@pytest.mark.parametrize("name, expected", [("V1000", "V100"), ("RTX 3080", "RTX3090"),
                                            ("A100 90GB", "A100")])
def test_unknown_names_suggest_close_catalog_names(name, expected):
    with pytest.raises(ClusterSpecError) as info:
        lookup_gpu(name, source="spec.yaml", field="nodes[0].gpus[0]")
    message = str(info.value)
    assert "Unknown GPU type" in message and "Did you mean" in message
    assert expected in message.split("Did you mean")[1].split("?")[0]
    assert f"Received: {name!r}" in message
    assert info.value.source == "spec.yaml" and info.value.field == "nodes[0].gpus[0]"


@pytest.mark.parametrize("name", [None, 3, ["V100"], "", "zzzz"])
def test_bad_names_raise_cluster_spec_error(name):
    with pytest.raises(ClusterSpecError, match="Received"):
        lookup_gpu(name)
