"""Rotary position embeddings, rotate_half convention, and positions for packed documents.

The rotate_half (GPT-NeoX / Hugging Face Llama) convention pairs dim ``i`` with dim ``i + d/2``, so the
q/k projection rows are in the order a Hugging Face Llama checkpoint expects: export needs no
permutation. Angles are computed in fp32 from the positions on every forward (no cached table, so
there is no buffer to allocate on the meta device and no length limit).
"""

from __future__ import annotations

import torch

__all__ = ["rotary_cos_sin", "apply_rotary", "rotate_half", "positions_from_cu_seqlens"]


def rotary_inv_freq(head_dim: int, base: float, device: torch.device | None = None) -> torch.Tensor:
    """``1 / base^(2i/d)`` for i in [0, d/2), in fp32 (computed as Hugging Face Llama does)."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / (base**exponent)


def rotary_cos_sin(position_ids: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape ``[B, S, 1, head_dim]`` (fp32) for ``position_ids`` ``[B, S]``."""
    inv_freq = rotary_inv_freq(head_dim, base, position_ids.device)
    angles = position_ids.float().unsqueeze(-1) * inv_freq  # [B, S, d/2]
    emb = torch.cat((angles, angles), dim=-1).unsqueeze(2)  # [B, S, 1, d]
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dim's two halves."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, S, heads, d]`` by the angles; computed in (at least) fp32, returned in ``x``'s dtype."""
    xc = x.to(torch.promote_types(x.dtype, torch.float32))
    return (xc * cos + rotate_half(xc) * sin).to(x.dtype)


def document_ids(cu_seqlens: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Index of the document each token belongs to, ``[B, S]`` (int64), from flattened ``cu_seqlens``."""
    flat = torch.arange(batch * seqlen, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return (torch.searchsorted(cu_seqlens, flat, right=True) - 1).view(batch, seqlen)


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Positions that restart at 0 at every document boundary, ``[B, S]`` (int64)."""
    docs = document_ids(cu_seqlens, batch, seqlen).reshape(-1)
    flat = torch.arange(batch * seqlen, device=cu_seqlens.device, dtype=torch.int64)
    return (flat - cu_seqlens.long()[docs]).view(batch, seqlen)
