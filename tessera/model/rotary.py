"""Rotary position embeddings, rotate_half convention, and positions for packed documents.

The rotate_half (GPT-NeoX / Hugging Face Llama) convention pairs dim ``i`` with dim ``i + d/2``, so the
q/k projection rows are in the order a Hugging Face Llama checkpoint expects: export needs no
permutation. Angles are computed in fp32 from the positions once per forward of the model (no cached
table, so there is no buffer to allocate on the meta device and no length limit), at half width: both
halves of a pair share one angle, so the other half would be a copy.
"""

from __future__ import annotations

import torch

from tessera.model.fused_ops import rotary

__all__ = ["rotary_cos_sin", "apply_rotary", "positions_from_cu_seqlens"]


def rotary_inv_freq(head_dim: int, base: float, device: torch.device | None = None) -> torch.Tensor:
    """``1 / base^(2i/d)`` for i in [0, d/2), in fp32 (computed as Hugging Face Llama does)."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / (base**exponent)


def rotary_cos_sin(position_ids: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape ``[B, S, 1, head_dim / 2]`` (fp32) for ``position_ids`` ``[B, S]``: the angle of the
    pair (``i``, ``i + head_dim/2``) at index ``i``."""
    inv_freq = rotary_inv_freq(head_dim, base, position_ids.device)
    angles = (position_ids.float().unsqueeze(-1) * inv_freq).unsqueeze(2)  # [B, S, 1, d/2]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, S, heads, d]`` by ``rotary_cos_sin``'s angles; computed in (at least) fp32, returned in
    ``x``'s dtype (``tessera.model.fused_ops.rotary``)."""
    return rotary(x, cos, sin)


def document_ids(cu_seqlens: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Index of the document each token belongs to, ``[B, S]`` (int64), from flattened ``cu_seqlens``."""
    flat = torch.arange(batch * seqlen, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return (torch.searchsorted(cu_seqlens, flat, right=True) - 1).view(batch, seqlen)


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Positions that restart at 0 at every document boundary, ``[B, S]`` (int64)."""
    docs = document_ids(cu_seqlens, batch, seqlen).reshape(-1)
    flat = torch.arange(batch * seqlen, device=cu_seqlens.device, dtype=torch.int64)
    return (flat - cu_seqlens.long()[docs]).view(batch, seqlen)
