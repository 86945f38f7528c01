"""torch's own variable-length attention (``torch.nn.attention.varlen.varlen_attn``, torch >= 2.10), adapted once.

Packed rows (several documents a row) need attention that restarts at every document boundary. Without
the ``flash_attn`` package, the only other way on CUDA used to be SDPA with a block-diagonal mask, whose
memory-efficient kernel reads an ``[S, S]`` mask per row and cannot skip the masked blocks. torch ships
FlashAttention-2's varlen kernel itself since 2.10: forward and backward, a registered custom op (so it
compiles without a graph break), CUDA only, fp16/bf16 only, no dropout.

Its keyword arguments changed between releases: 2.10 takes ``is_causal``; later releases take a
``window_size`` pair instead (``(-1, 0)``: everything before, nothing after) and add ``enable_gqa``. The
signature is read once here; without ``enable_gqa`` grouped K/V heads are expanded to the query heads.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["TorchVarlen", "torch_varlen", "adapt_varlen"]


@dataclass(frozen=True)
class TorchVarlen:
    """``call(q, k, v, cu_seqlens, max_seqlen)`` on ``[T, H, d]`` tensors, causal within each document."""

    call: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]
    convention: str  # how causality is asked for: "window_size" | "is_causal"
    native_gqa: bool  # grouped K/V heads passed as they are (else expanded first)


def adapt_varlen(varlen_attn: Callable[..., Any]) -> TorchVarlen | None:
    """One calling convention over ``varlen_attn``'s, read from its signature; None when neither is there."""
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal: dict[str, Any] = {"window_size": (-1, 0)}
        convention = "window_size"
    elif "is_causal" in params:
        causal = {"is_causal": True}
        convention = "is_causal"
    else:
        return None
    native_gqa = "enable_gqa" in params

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
             max_seqlen: int) -> torch.Tensor:
        groups = q.shape[1] // k.shape[1]
        extra = dict(causal)
        if groups > 1 and native_gqa:
            extra["enable_gqa"] = True
        elif groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **extra)

    return TorchVarlen(call, convention, native_gqa)


@functools.lru_cache(maxsize=1)
def torch_varlen() -> tuple[TorchVarlen | None, str]:
    """torch's varlen kernel adapted, or None and why not (this torch has none, or an unknown signature)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, f"torch {torch.__version__} has no torch.nn.attention.varlen (torch >= 2.10 has)"
    adapted = adapt_varlen(varlen_attn)
    if adapted is None:
        return None, "torch.nn.attention.varlen.varlen_attn takes neither window_size nor is_causal"
    return adapted, ""
