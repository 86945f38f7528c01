"""torch's scaled-dot-product attention as the model calls it: upcast where the CPU's GEMMs are, flash shapes on meta.

Low precision on CPUs whose bf16/fp16 matmuls run upcast (``tessera.parallel.cpu_kernels``) runs SDPA in
fp32 on the low-precision inputs, as flash kernels accumulate in fp32, and returns the input dtype. On
meta tensors (dry runs) it takes a flash kernel's shape function (``_flash_shapes``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.parallel.cpu_kernels import upcast_on_cpu

__all__ = ["scaled_dot_product_attention"]


def scaled_dot_product_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """SDPA; low precision on such CPUs runs in fp32 on the low-precision inputs (as flash kernels
    accumulate in fp32) and returns the input dtype."""
    if q.is_meta:
        return _flash_shapes(q, k, v, **kwargs)
    if q.device.type == "cpu" and upcast_on_cpu(q.dtype):
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kwargs).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


def _flash_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                  dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                  enable_gqa: bool = False) -> torch.Tensor:
    """SDPA on meta tensors (dry runs) through a flash kernel's shape function.

    On meta, SDPA would pick its math kernel, which materializes the [S, S] scores and saves them for
    backward; the GPU (flash_attn, SDPA's flash / memory-efficient kernels) and the CPU flash kernel
    keep only the output and the fp32 log-sum-exp. The CPU flash operator's meta function has exactly
    that footprint, takes grouped KV heads and a mask, and has a backward.
    """
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    return out
