"""What a GPU run holds beyond the closed forms of the training state and the activations, from the config.

The run's memory check and the plan both add the first two (``tessera.memory.estimate``):

1. **SDPA's extra tensors.** Without flash_attn (not installed, ``model.use_flash_attn=False``, or q/k/v
   in fp32) and, for packed rows, without torch's own varlen kernel (``tessera.model.torch_varlen``: torch
   >= 2.10, fp16/bf16, no attention dropout), attention runs through
   ``torch.nn.functional.scaled_dot_product_attention``
   (``tessera.model.attention``). Packed rows (several documents per row: ``data.pack_sample_into_one``
   False) pass it a ``[B, 1, S, S]`` boolean mask, built once per forward. On CUDA, SDPA converts it into
   an additive mask in q's dtype on every call (its last dimension padded to a multiple of 8 for the
   memory-efficient kernel when S is not one) and keeps that copy for the backward. With grouped KV
   heads, K and V are expanded to the query heads (``repeat_interleave``) whenever a mask is passed or
   q/k/v are not fp16/bf16, and SDPA keeps the expanded copies. Layers whose attention core is
   recomputed (``model.checkpoint`` True or "selective") hold one layer's copies at a time; otherwise
   every layer keeps its own until its backward.
2. **An allowance for the runtime's own buffers** (``runtime_allowance``): NCCL's buffers for every
   communicator this rank joins, and the cuBLAS/cuBLASLt workspaces of the stream the matmuls run on.
   These are stated figures, not counted tensors: see the constants below for where they come from.
3. **The low-precision GEMMs' operand copies** (``low_precision_gemm_bytes``), on any device: the memory
   check adds them to the activations' peak.

The dry run (``tessera.plan.dry_run``) cannot trace either: its meta attention goes through a flash
kernel's shape function and it opens no communicator. The plan shows both beside the traced figures.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tessera.model.args import ModelArgs
from tessera.model.torch_varlen import torch_varlen
from tessera.precision.plan import LowPrecisionGemms
from tessera.precision.routes import gemm_copy_bytes

__all__ = ["NCCL_COMMUNICATOR_BYTES", "MATMUL_WORKSPACE_BYTES", "MATMUL_STREAMS", "communicators",
           "runtime_allowance", "sdpa_extra_bytes", "low_precision_gemm_bytes"]

MIB, GIB = 2**20, 2**30

# NCCL's device memory per communicator: per-channel FIFOs for its three protocols (Simple: NCCL_BUFFSIZE,
# 4 MiB by default; LL128; LL) for each ring/tree peer, times the channels it opens (up to 32 on NVLink
# systems), plus NVLS buffers on NVSwitch systems. Public reports for PyTorch process groups: 544 MB (2
# ranks) and 688 MB (4 ranks) per group on A100 NVLink (NVIDIA/nccl#964); about 1.06 GB per GPU on 8 x
# H100 before any all-to-all (NVIDIA/nccl#1685); 1.6 GB for one H100 communicator with NVLS
# (NVIDIA/nccl#864). 1 GiB per communicator sits between the A100 and H100 figures; NVLS can take more
# (covered by memory.headroom, or NCCL_NVLS_ENABLE=0), fewer channels (NCCL_MAX_NCHANNELS) or a smaller
# NCCL_BUFFSIZE take less.
NCCL_COMMUNICATOR_BYTES = 1 * GIB
# cuBLAS + cuBLASLt workspaces per stream that runs matmuls, as PyTorch sizes them on Hopper and Blackwell
# (32 MiB each: cuBLAS's recommended size for sm90; older GPUs take 8.125 MiB + 1 to 4 MiB). PyTorch
# allocates them through its caching allocator at the first matmul of a stream, so they appear in
# torch.cuda.max_memory_allocated.
MATMUL_WORKSPACE_BYTES = 64 * MIB
# tessera runs every matmul (forward, backward, optimizer) on the current stream; the overlapped gradient
# reduction only launches NCCL collectives, which run on NCCL's own streams without cuBLAS
MATMUL_STREAMS = 1


def communicators(world: int, tp: int, dp: int, zero1: int) -> int:
    """NCCL communicators a rank joins: one per process group of more than one rank that it belongs to
    (GLOBAL, TENSOR, DATA, ZERO1 are distinct groups, each used by the step; torch opens a group's
    communicator at its first collective, and tessera runs none on a group of one rank)."""
    return sum(n > 1 for n in (world, tp, dp, zero1))


def runtime_allowance(world: int, tp: int, dp: int, zero1: int, device_type: str) -> dict[str, float]:
    """Bytes per rank for NCCL communicators and cuBLAS workspaces (``nccl``, ``cublas``); none off CUDA
    (gloo keeps no device buffers, and CPU BLAS workspaces are small)."""
    if device_type != "cuda":
        return {"nccl": 0.0, "cublas": 0.0}
    return {"nccl": float(communicators(world, tp, dp, zero1) * NCCL_COMMUNICATOR_BYTES),
            "cublas": float(MATMUL_STREAMS * MATMUL_WORKSPACE_BYTES)}


def _uses_flash(dtype: torch.dtype, use_flash_attn: bool, flash_installed: bool) -> bool:
    return use_flash_attn and flash_installed and dtype in (torch.float16, torch.bfloat16)


def _uses_torch_varlen(dtype: torch.dtype, model_cfg: Mapping[str, Any], packed: bool) -> bool:
    """Packed rows in fp16/bf16 without attention dropout run torch's varlen kernel where this torch has one
    (``tessera.model.attention.select_backend``): no mask, no K/V expansion."""
    return (packed and bool(model_cfg.get("use_flash_attn", True)) and dtype in (torch.float16, torch.bfloat16)
            and not float(model_cfg.get("attn_dropout", 0.0) or 0.0) and torch_varlen()[0] is not None)


def sdpa_extra_bytes(cfg: Mapping[str, Any], tp: int, checkpoint: Any, flash_installed: bool,
                     attention_dtypes: list[torch.dtype]) -> dict[str, float]:
    """Bytes SDPA adds on CUDA at one micro-batch's activation peak (see the module doc): ``mask`` (the
    boolean mask once, plus the additive copies kept) and ``gqa`` (the expanded K/V kept); zero where
    every layer runs flash_attn. ``cfg`` holds the ``model`` and ``data`` sections; ``attention_dtypes``
    the dtype of q/k/v in each layer (``tessera.memory.census.meta_census``: fp32 where a mark covers the attention)."""
    model_cfg, data = cfg["model"], cfg["data"]
    a = ModelArgs.from_config(model_cfg)
    b, s = int(data["micro_bsz"]), int(data["seq_len"])
    packed = not data.get("pack_sample_into_one", False)
    s_pad = -(-s // 8) * 8  # the memory-efficient kernel's alignment of the mask's rows
    groups = a.num_attention_heads // a.num_kv_attention_heads
    q_heads = a.num_attention_heads // tp
    masks, copies = [], []
    for dtype in attention_dtypes:
        if (_uses_flash(dtype, bool(model_cfg.get("use_flash_attn", True)), flash_installed)
                or _uses_torch_varlen(dtype, model_cfg, packed)):
            masks.append(0)
            copies.append(0)
            continue
        e = torch.empty((), dtype=dtype).element_size()
        masks.append(b * s * s_pad * e if packed else 0)
        expand = groups > 1 and (packed or dtype not in (torch.float16, torch.bfloat16))
        copies.append(2 * b * s * q_heads * a.head_dim * e if expand else 0)
    # the attention core is recomputed layer by layer (full / selective): one layer's copies live at a time
    # (compiled blocks without checkpointing keep every layer's, as eager ones do: measured on an H100)
    one_at_a_time = checkpoint is True or checkpoint == "selective"

    def kept(per_layer: list[int]) -> float:
        return float(max(per_layer, default=0) if one_at_a_time else sum(per_layer))

    bool_mask = b * s * s if any(masks) else 0  # the AttentionPlan's, shared by all layers of the forward
    return {"mask": bool_mask + kept(masks), "gqa": kept(copies)}


def low_precision_gemm_bytes(model_cfg: Mapping[str, Any], data: Mapping[str, Any], tp: int, gemms: LowPrecisionGemms,
                             device_type: str, capability: tuple[int, int] | None) -> float:
    """Bytes the low-precision GEMM routes add at the backward's peak: the quantized (and, emulated, dequantized
    fp32) copies of one linear's operands, for the largest linear (the MLP's: ``T x f/tp`` activations and an
    ``f/tp x h`` weight). The routes keep the model-dtype input and weight for backward (what a forward keeps
    is unchanged); the copies live only inside one GEMM's backward. Per operand element: the route's own
    ``copy_bytes`` (``tessera.parallel.gemm``), for the route the run takes on this device kind
    (``tessera.precision.routes``); zero without low-precision recipes."""
    per_element = gemm_copy_bytes(gemms, device_type, capability)
    if not per_element:
        return 0.0
    a = ModelArgs.from_config(model_cfg)
    tokens = int(data["micro_bsz"]) * int(data["seq_len"])
    f_t = a.ffn_hidden_size // tp
    return float(per_element * (tokens * f_t + f_t * a.hidden_size))
