"""The GPUs the planner knows: memory, peaks and link bandwidths per GPU, each figure sourced.

Peaks are dense (no 2:4 sparsity): NVIDIA's datasheets print the sparse figure, twice the dense.
Bandwidths are per GPU and per direction, in GB/s (1e9 bytes): NVLink's datasheet figure is both
directions together, so it is halved here; the network is the GPU's own NIC in NVIDIA's
reference node (DGX/HGX: one NIC per GPU). Memory is GiB as torch.cuda reports the card's total,
where that was seen, else the datasheet's GB converted. Every figure can be overridden on the
command line (a cluster with other links, or a card held at lower power).
"""

from dataclasses import dataclass, replace

from titanlite.config import ConfigError


@dataclass(frozen=True)
class Device:
    name: str
    memory_gib: float  # per GPU, what the caching allocator can reach at most
    bf16_tflops: float  # dense peak
    fp8_tflops: float  # dense peak; 0 = no float8 matmuls
    hbm_gbps: float  # memory bandwidth
    intra_node_gbps: float  # to any GPU of the same node, one direction
    inter_node_gbps: float  # to GPUs of other nodes, one direction


DEVICES = {
    d.name: d
    for d in (
        # H100 SXM5 datasheet: 80 GB HBM3 at 3.35 TB/s; BF16 1,979 / FP8 3,958 TFLOPS sparse;
        # NVLink 900 GB/s. DGX H100: eight ConnectX-7 at 400 Gb/s. torch reports 79.1 GiB.
        Device("h100-sxm", 79.1, 989.5, 1979.0, 3350.0, 450.0, 50.0),
        # H100 PCIe datasheet: 80 GB HBM2e at 2.0 TB/s; BF16 1,513 / FP8 3,026 sparse. No
        # NVSwitch: GPUs of a node talk over PCIe Gen5 x16 (64 GB/s one way).
        Device("h100-pcie", 79.1, 756.5, 1513.0, 2000.0, 64.0, 50.0),
        # H200 SXM datasheet: 141 GB HBM3e at 4.8 TB/s, the H100's tensor cores and NVLink.
        # DGX H200: eight ConnectX-7 at 400 Gb/s. torch reports 139.8 GiB (seen here).
        Device("h200", 139.8, 989.5, 1979.0, 4800.0, 450.0, 50.0),
        # A100 SXM 80GB datasheet: 2,039 GB/s; BF16 312 dense; NVLink 600 GB/s; no float8.
        # DGX A100: eight ConnectX-6 at 200 Gb/s.
        Device("a100-80gb", 79.1, 312.0, 0.0, 2039.0, 300.0, 25.0),
        # HGX B200 datasheet, per GPU (eight): ~180 GB HBM3e, 7.7 TB/s, FP8 9 / BF16 4.5 PFLOPS
        # sparse; NVLink 5 at 1.8 TB/s. DGX B200: eight ConnectX-7 at 400 Gb/s. Not seen here.
        Device("b200", 167.6, 2250.0, 4500.0, 7700.0, 900.0, 50.0),
    )
}

# torch.cuda.get_device_name() words -> the entry; a row matches when all its words are words of
# the name (split on spaces and dashes), first match first: "NVIDIA H100 80GB HBM3" is h100-sxm.
_NAMES = ((("H100", "PCIE"), "h100-pcie"), (("H100",), "h100-sxm"), (("H200",), "h200"),
          (("A100",), "a100-80gb"), (("B200",), "b200"))  # fmt: skip


def device_named(gpu_name: str) -> str | None:
    """The table's entry for a GPU as torch names it, or None for one the table lacks."""
    words = set(gpu_name.upper().replace("-", " ").split())
    return next((entry for need, entry in _NAMES if set(need) <= words), None)


# The Device field behind each override flag of plan.py.
OVERRIDES = {
    "device_memory_gib": "memory_gib",
    "device_tflops": "bf16_tflops",
    "device_fp8_tflops": "fp8_tflops",
    "device_hbm_gbps": "hbm_gbps",
    "intra_node_gbps": "intra_node_gbps",
    "inter_node_gbps": "inter_node_gbps",
}


def get_device(name: str, **overrides: float | None) -> Device:
    """The named device with any figure replaced (keys of OVERRIDES; None leaves it)."""
    if name not in DEVICES:
        known = ", ".join(DEVICES)
        raise ConfigError(
            f"unknown device {name!r}; known: {known} (or name the closest and override its "
            f"figures: --device_memory_gib, --device_tflops, --intra_node_gbps, ...)"
        )
    changes = {OVERRIDES[k]: float(v) for k, v in overrides.items() if v is not None}
    for field_name, value in changes.items():
        if value < 0 or (value == 0 and field_name != "fp8_tflops"):
            raise ConfigError(f"device figure {field_name} must be positive, got {value}")
    return replace(DEVICES[name], **changes)
