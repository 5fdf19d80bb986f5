"""A catalog of GPU types people train on, with public spec-sheet figures.

Every entry gives the figures one GPU (as the driver lists it) is sold with:
memory, peak FP32 FLOP/s (CUDA cores, no tensor cores), peak FP16/BF16 FLOP/s
(tensor cores, dense, FP32 accumulate: what mixed-precision training uses),
memory bandwidth, NVLink bandwidth (total, both directions, as datasheets
quote it; 0 when the card has none) and the PCIe generation. Each entry says
which vendor document its figures come from.

These figures are peaks from datasheets, not measurements. Planning for a
cluster of catalog GPUs on a machine that does not have them produces
predictions, never measured times.

Conventions:

- Memory: datasheet "GB" of GPU memory is binary (HBM and GDDR stacks come in
  powers of two), so `memory_gb * 2**30` bytes. The driver may report slightly
  less; `Cluster.detect()` uses the driver's figure.
- Bandwidths and FLOP/s are decimal: GB/s = 1e9 bytes/s, TFLOP/s = 1e12.
- GPUs without tensor cores (K80, P100, GTX 1080 Ti) list their best FP16
  arithmetic rate; where FP16 arithmetic is crippled (GP102 runs native FP16 at
  1/64 rate) frameworks compute half-precision data in FP32, so the FP16 figure
  is the FP32 peak.
- GeForce cards (RTX 2080 Ti, 3090, 4090) run FP16 tensor ops with FP32
  accumulate at half the FP16-accumulate rate; the catalog lists the FP32
  accumulate figure.

Ambiguous short names pick a documented default: `"V100"` is the 16 GB SXM2
part, `"V100 32GB"` the 32 GB SXM2, `"P100"` the 16 GB PCIe card, `"A100"` the
40 GB SXM4, `"A100 80GB"` the 80 GB SXM4, `"H100"` the 80 GB SXM5, `"H200"` the
141 GB SXM.

Example:

```python
spec = lookup_gpu("Tesla V100-SXM2-16GB")
spec.key                 # "V100-SXM2-16GB"
spec.peak_flops_fp16     # 1.25e14
lookup_gpu("1080ti").key # "GTX1080Ti"
```
"""

import dataclasses
import difflib
import re

from autodist_keras.errors import ClusterSpecError

GiB = 2**30
GB = 1e9
TFLOPS = 1e12

# PCIe x16 bandwidth per direction after line encoding (8b/10b for gen 1-2,
# 128b/130b from gen 3): gen3 8 GT/s x 16 lanes x 128/130 / 8 = 15.75 GB/s.
PCIE_X16_BANDWIDTH = {
    1: 16 * 2.5e9 * 8 / 10 / 8,
    2: 16 * 5e9 * 8 / 10 / 8,
    3: 16 * 8e9 * 128 / 130 / 8,
    4: 16 * 16e9 * 128 / 130 / 8,
    5: 16 * 32e9 * 128 / 130 / 8,
}


@dataclasses.dataclass(frozen=True)
class GPUSpec:
    """Spec-sheet figures of one GPU type.

    Args:
        key: Catalog key, e.g. `"V100-SXM2-16GB"`; becomes `Device.model`.
        memory_bytes: GPU memory in bytes.
        peak_flops_fp32: Peak FP32 FLOP/s (non-tensor).
        peak_flops_fp16: Peak FP16/BF16 FLOP/s (tensor cores, dense, FP32
            accumulate; see the module docstring for GPUs without them).
        memory_bandwidth: Memory bandwidth in bytes/s.
        nvlink_bandwidth: Total NVLink bandwidth of one GPU in bytes/s, both
            directions together (as datasheets quote it); 0 without NVLink.
        nvlink_links: Number of NVLink links behind `nvlink_bandwidth`.
        pcie_gen: PCIe generation of the host interface.
        form_factor: `"sxm"` (NVLink board) or `"pcie"` (card).
        architecture: GPU architecture name.
        aliases: Other names that resolve to this entry (normalised on lookup).
        source: The vendor document the figures come from.
    """

    key: str
    memory_bytes: int
    peak_flops_fp32: float
    peak_flops_fp16: float
    memory_bandwidth: float
    nvlink_bandwidth: float
    nvlink_links: int
    pcie_gen: int
    form_factor: str
    architecture: str
    aliases: tuple
    source: str

    @property
    def pcie_bandwidth(self):
        """PCIe x16 bandwidth per direction, bytes/s."""
        return PCIE_X16_BANDWIDTH[self.pcie_gen]

    @property
    def nvlink_pair_bandwidth(self):
        """Bandwidth per direction through all NVLinks of the GPU, bytes/s.

        What one GPU can send over its NVLinks at once (half the both-ways
        datasheet figure); 0 without NVLink.
        """
        return self.nvlink_bandwidth / 2

    @property
    def nvlink_link_bandwidth(self):
        """Bandwidth per direction of one NVLink link, bytes/s (0 without NVLink)."""
        if not self.nvlink_links:
            return 0.0
        return self.nvlink_bandwidth / 2 / self.nvlink_links

    def to_dict(self):
        """Returns the entry as a JSON-serialisable dict."""
        d = dataclasses.asdict(self)
        d["aliases"] = list(self.aliases)
        return d


def _gpu(key, memory_gb, fp32_tflops, fp16_tflops, bandwidth_gbs, nvlink_gbs, nvlink_links,
         pcie_gen, form_factor, architecture, aliases, source):
    return GPUSpec(
        key=key,
        memory_bytes=int(memory_gb * GiB),
        peak_flops_fp32=fp32_tflops * TFLOPS,
        peak_flops_fp16=fp16_tflops * TFLOPS,
        memory_bandwidth=bandwidth_gbs * GB,
        nvlink_bandwidth=nvlink_gbs * GB,
        nvlink_links=nvlink_links,
        pcie_gen=pcie_gen,
        form_factor=form_factor,
        architecture=architecture,
        aliases=tuple(aliases),
        source=source,
    )


_ENTRIES = [
    _gpu("K80", 12, 4.365, 4.365, 240, 0, 0, 3, "pcie", "Kepler GK210",
         ["K80", "Tesla K80"],
         "NVIDIA Tesla K80 datasheet (2014): per board 24 GB GDDR5, 480 GB/s, 8.73 "
         "TFLOP/s FP32 with GPU Boost; the board holds two GK210 GPUs and drivers list "
         "each, so this entry is half a board. No FP16 arithmetic: FP16 = FP32."),
    _gpu("P100-PCIE-12GB", 12, 9.3, 18.7, 549, 0, 0, 3, "pcie", "Pascal GP100",
         ["P100 12GB", "P100-PCIE-12GB", "P100 PCIe 12GB"],
         "NVIDIA Tesla P100 PCIe datasheet (2016): 12 GB CoWoS HBM2, 549 GB/s, 9.3 "
         "TFLOP/s FP32, 18.7 TFLOP/s FP16 (no tensor cores)."),
    _gpu("P100-PCIE-16GB", 16, 9.3, 18.7, 732, 0, 0, 3, "pcie", "Pascal GP100",
         ["P100", "P100 16GB", "P100-PCIE-16GB", "P100 PCIe", "P100 PCIe 16GB"],
         "NVIDIA Tesla P100 PCIe datasheet (2016): 16 GB CoWoS HBM2, 732 GB/s, 9.3 "
         "TFLOP/s FP32, 18.7 TFLOP/s FP16 (no tensor cores). Default for \"P100\"."),
    _gpu("P100-SXM2-16GB", 16, 10.6, 21.2, 732, 160, 4, 3, "sxm", "Pascal GP100",
         ["P100-SXM2-16GB", "P100 SXM2", "P100 SXM2 16GB", "P100 NVLink", "P100 SXM"],
         "NVIDIA Tesla P100 datasheet and 'NVIDIA Tesla P100' Pascal whitepaper (2016): "
         "SXM2 module, 16 GB HBM2, 732 GB/s, 10.6 TFLOP/s FP32, 21.2 TFLOP/s FP16, 4 "
         "NVLink links, 160 GB/s bidirectional."),
    _gpu("V100-PCIE-16GB", 16, 14.0, 112.0, 900, 0, 0, 3, "pcie", "Volta GV100",
         ["V100-PCIE-16GB", "V100 PCIe", "V100 PCIe 16GB"],
         "NVIDIA Tesla V100 GPU datasheet (2020, PCIe column): 16 GB HBM2, 900 GB/s, 14 "
         "TFLOP/s FP32, 112 TFLOP/s tensor."),
    _gpu("V100-PCIE-32GB", 32, 14.0, 112.0, 900, 0, 0, 3, "pcie", "Volta GV100",
         ["V100-PCIE-32GB", "V100 PCIe 32GB"],
         "NVIDIA Tesla V100 GPU datasheet (2020, PCIe column): 32 GB HBM2, 900 GB/s, 14 "
         "TFLOP/s FP32, 112 TFLOP/s tensor."),
    _gpu("V100-SXM2-16GB", 16, 15.7, 125.0, 900, 300, 6, 3, "sxm", "Volta GV100",
         ["V100", "V100 16GB", "V100-SXM2-16GB", "V100 SXM2", "V100 SXM2 16GB", "V100 SXM",
          "V100-DGXS-16GB"],
         "NVIDIA Tesla V100 GPU datasheet (2020, SXM2 column): 16 GB HBM2, 900 GB/s, 15.7 "
         "TFLOP/s FP32, 125 TFLOP/s tensor, 6 NVLink links, 300 GB/s. Default for \"V100\"."),
    _gpu("V100-SXM2-32GB", 32, 15.7, 125.0, 900, 300, 6, 3, "sxm", "Volta GV100",
         ["V100 32GB", "V100-SXM2-32GB", "V100 SXM2 32GB", "V100-SXM3-32GB", "V100-DGXS-32GB"],
         "NVIDIA Tesla V100 GPU datasheet (2020, SXM2 column): 32 GB HBM2, 900 GB/s, 15.7 "
         "TFLOP/s FP32, 125 TFLOP/s tensor, 6 NVLink links, 300 GB/s."),
    _gpu("V100S-PCIE-32GB", 32, 16.4, 130.0, 1134, 0, 0, 3, "pcie", "Volta GV100",
         ["V100S", "V100S-PCIE-32GB", "V100S PCIe"],
         "NVIDIA V100S datasheet (Tesla V100 datasheet, 2020, V100S PCIe column): 32 GB "
         "HBM2, 1134 GB/s, 16.4 TFLOP/s FP32, 130 TFLOP/s tensor."),
    _gpu("T4", 16, 8.1, 65.0, 320, 0, 0, 3, "pcie", "Turing TU104",
         ["T4", "Tesla T4"],
         "NVIDIA T4 Tensor Core GPU datasheet (2019): 16 GB GDDR6, 320 GB/s, 8.1 TFLOP/s "
         "FP32, 65 TFLOP/s FP16 mixed precision, PCIe Gen3 x16."),
    _gpu("GTX1080Ti", 11, 11.34, 11.34, 484, 0, 0, 3, "pcie", "Pascal GP102",
         ["1080Ti", "1080 Ti", "GTX 1080 Ti", "GTX1080Ti", "GeForce GTX 1080 Ti"],
         "NVIDIA GeForce GTX 1080 Ti specifications (2017) and the GTX 1080 Pascal "
         "whitepaper: 3584 CUDA cores at 1582 MHz boost = 11.34 TFLOP/s FP32, 11 GB GDDR5X "
         "at 11 Gbps on 352 bits = 484 GB/s. No tensor cores, FP16 at 1/64 rate: FP16 = "
         "FP32."),
    _gpu("RTX2080Ti", 11, 13.4, 53.8, 616, 100, 2, 3, "pcie", "Turing TU102",
         ["2080Ti", "2080 Ti", "RTX 2080 Ti", "RTX2080Ti", "GeForce RTX 2080 Ti"],
         "NVIDIA Turing GPU Architecture whitepaper (2018), RTX 2080 Ti reference: 13.4 "
         "TFLOP/s FP32, 53.8 TFLOP/s FP16 tensor with FP32 accumulate, 11 GB GDDR6, 616 "
         "GB/s, NVLink bridge 2 links 100 GB/s bidirectional."),
    _gpu("RTX3090", 24, 35.6, 71.0, 936, 112.5, 4, 4, "pcie", "Ampere GA102",
         ["3090", "RTX 3090", "RTX3090", "GeForce RTX 3090"],
         "NVIDIA Ampere GA102 GPU Architecture whitepaper (2020), RTX 3090: 35.6 TFLOP/s "
         "FP32, 71 TFLOP/s FP16 tensor with FP32 accumulate (dense), 24 GB GDDR6X, 936 "
         "GB/s, NVLink bridge 112.5 GB/s, PCIe Gen4."),
    _gpu("RTX4090", 24, 82.6, 165.2, 1008, 0, 0, 4, "pcie", "Ada AD102",
         ["4090", "RTX 4090", "RTX4090", "GeForce RTX 4090"],
         "NVIDIA Ada GPU Architecture whitepaper (2022), RTX 4090: 82.6 TFLOP/s FP32, "
         "165.2 TFLOP/s FP16 tensor with FP32 accumulate (dense), 24 GB GDDR6X, 1008 GB/s, "
         "PCIe Gen4, no NVLink."),
    _gpu("A10", 24, 31.2, 125.0, 600, 0, 0, 4, "pcie", "Ampere GA102",
         ["A10"],
         "NVIDIA A10 Tensor Core GPU datasheet (2021): 24 GB GDDR6, 600 GB/s, 31.2 TFLOP/s "
         "FP32, 125 TFLOP/s BF16/FP16 tensor (250 with sparsity), PCIe Gen4."),
    _gpu("A40", 48, 37.4, 149.7, 696, 112.5, 4, 4, "pcie", "Ampere GA102",
         ["A40"],
         "NVIDIA A40 datasheet (2021): 48 GB GDDR6, 696 GB/s, 37.4 TFLOP/s FP32, 149.7 "
         "TFLOP/s BF16/FP16 tensor (299.4 with sparsity), NVLink bridge 112.5 GB/s."),
    _gpu("RTXA6000", 48, 38.7, 154.8, 768, 112.5, 4, 4, "pcie", "Ampere GA102",
         ["RTX A6000", "RTXA6000", "A6000"],
         "NVIDIA RTX A6000 datasheet (2021): 48 GB GDDR6, 768 GB/s, 38.7 TFLOP/s FP32, "
         "309.7 TFLOP/s tensor with sparsity (154.8 dense), NVLink bridge 112.5 GB/s."),
    _gpu("A100-PCIE-40GB", 40, 19.5, 312.0, 1555, 600, 12, 4, "pcie", "Ampere GA100",
         ["A100-PCIE-40GB", "A100 PCIe", "A100 PCIe 40GB", "A100 40GB PCIe"],
         "NVIDIA A100 Tensor Core GPU datasheet (2021, PCIe column): 40 GB HBM2, 1555 "
         "GB/s, 19.5 TFLOP/s FP32, 312 TFLOP/s BF16/FP16 tensor (dense), NVLink bridge "
         "600 GB/s for 2 GPUs."),
    _gpu("A100-PCIE-80GB", 80, 19.5, 312.0, 1935, 600, 12, 4, "pcie", "Ampere GA100",
         ["A100-PCIE-80GB", "A100 80GB PCIe", "A100 PCIe 80GB"],
         "NVIDIA A100 Tensor Core GPU datasheet (2021, PCIe column): 80 GB HBM2e, 1935 "
         "GB/s, 19.5 TFLOP/s FP32, 312 TFLOP/s BF16/FP16 tensor (dense), NVLink bridge "
         "600 GB/s for 2 GPUs."),
    _gpu("A100-SXM4-40GB", 40, 19.5, 312.0, 1555, 600, 12, 4, "sxm", "Ampere GA100",
         ["A100", "A100 40GB", "A100-SXM4-40GB", "A100 SXM4", "A100 SXM", "A100 SXM4 40GB"],
         "NVIDIA A100 Tensor Core GPU datasheet (2021, SXM column): 40 GB HBM2, 1555 GB/s, "
         "19.5 TFLOP/s FP32, 312 TFLOP/s BF16/FP16 tensor (dense), 12 NVLink links, 600 "
         "GB/s. Default for \"A100\"."),
    _gpu("A100-SXM4-80GB", 80, 19.5, 312.0, 2039, 600, 12, 4, "sxm", "Ampere GA100",
         ["A100 80GB", "A100-SXM4-80GB", "A100 SXM4 80GB", "A100 SXM 80GB"],
         "NVIDIA A100 Tensor Core GPU datasheet (2021, SXM column): 80 GB HBM2e, 2039 GB/s, "
         "19.5 TFLOP/s FP32, 312 TFLOP/s BF16/FP16 tensor (dense), 12 NVLink links, 600 "
         "GB/s. Default for \"A100 80GB\"."),
    _gpu("L4", 24, 30.3, 121.0, 300, 0, 0, 4, "pcie", "Ada AD104",
         ["L4"],
         "NVIDIA L4 Tensor Core GPU datasheet (2023): 24 GB GDDR6, 300 GB/s, 30.3 TFLOP/s "
         "FP32, 242 TFLOP/s BF16/FP16 tensor with sparsity, so 121 dense; PCIe Gen4."),
    _gpu("L40S", 48, 91.6, 362.05, 864, 0, 0, 4, "pcie", "Ada AD102",
         ["L40S"],
         "NVIDIA L40S datasheet (2023): 48 GB GDDR6, 864 GB/s, 91.6 TFLOP/s FP32, 362.05 "
         "TFLOP/s BF16/FP16 tensor (733 with sparsity), PCIe Gen4, no NVLink."),
    _gpu("H100-PCIE-80GB", 80, 51.0, 756.0, 2000, 600, 12, 5, "pcie", "Hopper GH100",
         ["H100 PCIe", "H100-PCIE-80GB", "H100 80GB PCIe", "H100 PCIe 80GB"],
         "NVIDIA H100 Tensor Core GPU datasheet (2023, H100 PCIe column): 80 GB HBM2e, 2 "
         "TB/s, 51 TFLOP/s FP32, 1513 TFLOP/s BF16/FP16 tensor with sparsity (756 dense), "
         "NVLink bridge 600 GB/s, PCIe Gen5."),
    _gpu("H100-SXM5-80GB", 80, 67.0, 989.5, 3350, 900, 18, 5, "sxm", "Hopper GH100",
         ["H100", "H100 80GB", "H100-SXM5-80GB", "H100 SXM", "H100 SXM5", "H100 80GB HBM3",
          "H100 SXM5 80GB"],
         "NVIDIA H100 Tensor Core GPU datasheet (2023, H100 SXM column): 80 GB HBM3, 3.35 "
         "TB/s, 67 TFLOP/s FP32, 1979 TFLOP/s BF16/FP16 tensor with sparsity (989.5 dense), "
         "18 NVLink links, 900 GB/s, PCIe Gen5. Default for \"H100\"."),
    _gpu("H200-SXM-141GB", 141, 67.0, 989.5, 4800, 900, 18, 5, "sxm", "Hopper GH100",
         ["H200", "H200 SXM", "H200-SXM-141GB", "H200 141GB", "H200 SXM 141GB"],
         "NVIDIA H200 Tensor Core GPU datasheet (2024, H200 SXM column): 141 GB HBM3e, 4.8 "
         "TB/s, 67 TFLOP/s FP32, 1979 TFLOP/s BF16/FP16 tensor with sparsity (989.5 dense), "
         "NVLink 900 GB/s, PCIe Gen5. Default for \"H200\"."),
]

GPU_CATALOG = {entry.key: entry for entry in _ENTRIES}
"""dict: catalog key -> `GPUSpec`, in catalog order."""

# Words drivers and people put around a GPU name that carry no information.
_VENDOR_WORDS = ("nvidia", "tesla", "geforce", "quadro")


def normalise_gpu_name(name):
    """Normalises a GPU name for lookup: lower case, no vendor words, only [a-z0-9].

    Example: `"NVIDIA GeForce RTX 3090"` -> `"rtx3090"`, `"Tesla V100-SXM2-16GB"`
    -> `"v100sxm216gb"`.
    """
    text = str(name).lower()
    for word in _VENDOR_WORDS:
        text = re.sub(rf"\b{word}\b", " ", text)
    return re.sub(r"[^a-z0-9]", "", text)


def _build_aliases():
    table = {}
    for entry in _ENTRIES:
        for alias in (entry.key, *entry.aliases):
            norm = normalise_gpu_name(alias)
            owner = table.setdefault(norm, entry.key)
            if owner != entry.key:  # pragma: no cover - a catalog bug, caught by tests
                raise AssertionError(f"alias {alias!r} names both {owner} and {entry.key}")
    # "GTX 1080 Ti" and "1080 Ti" both work; so does "rtx3090" and "3090" (above).
    return table


_ALIASES = _build_aliases()


def closest_gpu_names(name, n=3):
    """Catalog keys whose names are closest to `name` (difflib), best first."""
    norm = normalise_gpu_name(name)
    matches = difflib.get_close_matches(norm, list(_ALIASES), n=n * 3, cutoff=0.5)
    # "T4 16GB": the type with a memory size the catalog does not spell that way.
    size = re.search(r"\d+gb$", norm)
    for cut in range(1, len(size.group(0)) - 1) if size else ():
        bare = norm[:-(cut + 2)]  # "t416gb" -> "t41", "t4", "t"
        if bare in _ALIASES:
            matches.insert(0, bare)
            break
    keys = []
    for match in matches:
        key = _ALIASES[match]
        if key not in keys:
            keys.append(key)
    return keys[:n]


def lookup_gpu(name, source=None, field=None):
    """Returns the catalog entry for a GPU name as drivers or people write it.

    Case, spaces, dashes, underscores and vendor words ("NVIDIA", "Tesla",
    "GeForce", "Quadro") are ignored, so `"Tesla V100-SXM2-16GB"`, `"v100"`,
    `"NVIDIA A100-SXM4-80GB"`, `"A100 80GB"`, `"GTX 1080 Ti"` and `"1080Ti"`
    all resolve.

    Args:
        name: The GPU name.
        source: For error messages: the file or string the name came from.
        field: For error messages: the dotted path of the field.

    Returns:
        A `GPUSpec`.

    Raises:
        ClusterSpecError: If the name is not a string or not in the catalog;
            the message lists the closest catalog names.

    Example:

    ```python
    lookup_gpu("NVIDIA GeForce RTX 3090").memory_bytes  # 24 * 2**30
    ```
    """
    if not isinstance(name, str):
        raise ClusterSpecError(
            f"A GPU type must be a string naming a catalog entry (one of "
            f"{', '.join(GPU_CATALOG)}). Received: {name!r}",
            source=source, field=field, value=name,
        )
    key = _ALIASES.get(normalise_gpu_name(name))
    if key is None:
        close = closest_gpu_names(name)
        hint = (
            f"Did you mean {' or '.join(repr(k) for k in close)}? " if close else ""
        )
        if "cpu" in normalise_gpu_name(name):
            hint += ("For devices made of this machine's CPU cores use the cluster "
                     "'cpu_testbed' (Cluster.cpu_testbed()). ")
        raise ClusterSpecError(
            f"Unknown GPU type {name!r}. {hint}Known types: {', '.join(GPU_CATALOG)}. "
            "For a GPU not in the catalog give its figures explicitly in a YAML spec's gpus "
            "list (a cluster string cannot carry them): "
            "{name: ..., memory_gb: ..., fp32_tflops: ..., fp16_tflops: ..., bandwidth_gbps: ...} "
            "(docs/clusters.md). "
            f"Received: {name!r}",
            source=source, field=field, value=name,
        )
    return GPU_CATALOG[key]


# Architectures whose tensor cores run bfloat16 (NVIDIA Ampere and later); Volta,
# Turing and Pascal run float16 only.
BFLOAT16_ARCHITECTURES = ("Ampere", "Ada", "Hopper", "Blackwell")


def has_bfloat16_tensor_cores(model):
    """Whether the catalog GPU `model` computes bfloat16 at its FP16 (tensor-core) peak.

    Args:
        model: A device's catalog key or GPU name (`Device.model`).

    Returns:
        True for a catalog GPU of an Ampere or later architecture; False for
        older GPUs, CPUs and names outside the catalog (priced at the FP32
        peak, the conservative choice).
    """
    key = _ALIASES.get(normalise_gpu_name(model)) if isinstance(model, str) else None
    return key is not None and GPU_CATALOG[key].architecture.startswith(BFLOAT16_ARCHITECTURES)
