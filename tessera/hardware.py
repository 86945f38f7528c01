"""Facts about the accelerators tessera plans for, in one table: datasheet peaks, memory, links, and which
number formats their tensor cores multiply.

Each consumer asks here: the metrics' MFU (peak TFLOP/s), the planner (memory, links, the device a ``--gpu``
name stands for), and the GEMM route table (whether a device multiplies fp8 or fp4 on tensor cores, so the
planned route is the route the run takes). A GPU missing from the table gets a peak measured on the device
(``tessera.train.metrics``) and its capability read from the device itself.

Rows are keyed by the full name ``torch.cuda.get_device_name`` reports, matched exactly: variants of one chip
differ in clocks and power (the H100 NVL and PCIe cards are not the SXM part).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["GPUS", "GPU_BY_PLAN_NAME", "GpuSpec", "PeakTFLOPS", "FP8_TENSOR_CORES_FROM", "FP4_TENSOR_CORES_FROM",
           "GPUS_PER_NODE", "INTER_NODE_BYTES_S", "NVLINK_BYTES_S", "fp4_tensor_cores", "fp8_tensor_cores", "gpu_named"]

FP8_TENSOR_CORES_FROM = (8, 9)  # Ada, Hopper, Blackwell: torch._scaled_mm runs on tensor cores
FP4_TENSOR_CORES_FROM = (10, 0)  # Blackwell: E2M1 with block scales
GPUS_PER_NODE = 8
NVLINK_BYTES_S = 450e9  # per GPU and direction, H100 SXM class
INTER_NODE_BYTES_S = 50e9  # 400 Gb/s per GPU


class PeakTFLOPS(NamedTuple):
    """Dense datasheet peaks (no sparsity) of one GPU, TFLOP/s; None where it has no such unit."""

    bf16: float | None
    fp16: float | None
    tf32: float | None
    fp32: float | None


class GpuSpec(NamedTuple):
    """One GPU: its peaks, memory as sold (GiB), compute capability, and its ``tools/plan.py --gpu`` name."""

    peaks: PeakTFLOPS
    memory_gib: float | None
    capability: tuple[int, int]
    plan_name: str | None = None


_H100_SXM = PeakTFLOPS(989.0, 989.0, 494.0, 67.0)
_H100_PCIE = PeakTFLOPS(756.0, 756.0, 378.0, 51.0)
_HOPPER_NVL = PeakTFLOPS(835.0, 835.0, 417.0, 60.0)  # H100 NVL / H200 NVL: 1,671 TFLOP/s bf16 with sparsity
_A100 = PeakTFLOPS(312.0, 312.0, 156.0, 19.5)
_SM80, _SM86, _SM89, _SM90, _SM100 = (8, 0), (8, 6), (8, 9), (9, 0), (10, 0)

GPUS: dict[str, GpuSpec] = {
    "NVIDIA H100 80GB HBM3": GpuSpec(_H100_SXM, 80.0, _SM90, "h100"),  # the SXM5 part
    "NVIDIA H100 PCIe": GpuSpec(_H100_PCIE, 80.0, _SM90, "h100-pcie"),
    "NVIDIA H100 NVL": GpuSpec(_HOPPER_NVL, 94.0, _SM90, "h100-nvl"),
    "NVIDIA H200": GpuSpec(_H100_SXM, 141.0, _SM90, "h200"),  # the SXM part: H100's compute with more memory
    "NVIDIA H200 NVL": GpuSpec(_HOPPER_NVL, 141.0, _SM90, "h200-nvl"),
    "NVIDIA GH200 480GB": GpuSpec(_H100_SXM, 96.0, _SM90, "gh200"),
    "NVIDIA H800": GpuSpec(_H100_SXM, 80.0, _SM90, "h800"),
    "NVIDIA H800 PCIe": GpuSpec(_H100_PCIE, 80.0, _SM90),
    "NVIDIA H20": GpuSpec(PeakTFLOPS(148.0, 148.0, 74.0, 44.0), 96.0, _SM90, "h20"),
    "NVIDIA B200": GpuSpec(PeakTFLOPS(2250.0, 2250.0, 1100.0, 80.0), 180.0, _SM100, "b200"),
    "NVIDIA A100-SXM4-80GB": GpuSpec(_A100, 80.0, _SM80, "a100"),
    "NVIDIA A100-SXM4-40GB": GpuSpec(_A100, 40.0, _SM80, "a100-40gb"),
    "NVIDIA A100 80GB PCIe": GpuSpec(_A100, 80.0, _SM80),
    "NVIDIA A100-PCIE-40GB": GpuSpec(_A100, 40.0, _SM80),
    "NVIDIA A800-SXM4-80GB": GpuSpec(_A100, 80.0, _SM80, "a800"),
    "NVIDIA A800 80GB PCIe": GpuSpec(_A100, 80.0, _SM80),
    "NVIDIA L40S": GpuSpec(PeakTFLOPS(362.0, 362.0, 183.0, 91.6), 48.0, _SM89, "l40s"),
    "NVIDIA A10": GpuSpec(PeakTFLOPS(125.0, 125.0, 62.5, 31.2), 24.0, _SM86),
    "Tesla V100-SXM2-16GB": GpuSpec(PeakTFLOPS(None, 125.0, 15.7, 15.7), 16.0, (7, 0)),  # no bf16; tf32 runs as fp32
    "Tesla V100-SXM2-32GB": GpuSpec(PeakTFLOPS(None, 125.0, 15.7, 15.7), 32.0, (7, 0)),
    "NVIDIA GeForce RTX 4090": GpuSpec(PeakTFLOPS(165.2, 165.2, 82.6, 82.6), 24.0, _SM89),  # fp32 accumulation
}

GPU_BY_PLAN_NAME: dict[str, str] = {spec.plan_name: name for name, spec in GPUS.items() if spec.plan_name}


def gpu_named(device_name: str) -> GpuSpec | None:
    """The row of a device name as ``torch.cuda.get_device_name`` reports it (exact match), or None."""
    return GPUS.get(device_name.strip())


def fp8_tensor_cores(capability: tuple[int, int] | None) -> bool:
    """Whether a CUDA device of ``capability`` multiplies fp8 on tensor cores (None: not a CUDA device)."""
    return capability is not None and tuple(capability) >= FP8_TENSOR_CORES_FROM


def fp4_tensor_cores(capability: tuple[int, int] | None) -> bool:
    """Whether a CUDA device of ``capability`` multiplies block-scaled fp4 on tensor cores."""
    return capability is not None and tuple(capability) >= FP4_TENSOR_CORES_FROM
