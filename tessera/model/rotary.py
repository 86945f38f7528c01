"""Rotary position embeddings, rotate_half convention, frequency scaling, and positions for packed documents.

The rotate_half (GPT-NeoX / Hugging Face Llama) convention pairs dim ``i`` with dim ``i + d/2``, so the
q/k projection rows are in the order a Hugging Face Llama checkpoint expects: export needs no
permutation. Angles are computed in fp32 from the positions once per forward of the model (no cached
table, so there is no buffer to allocate on the meta device and no length limit), at half width: both
halves of a pair share one angle, so the other half would be a copy.

Frequency scaling (``model.rope_scaling``) is how long-context checkpoints stretch rotary past the length
they were pretrained at; the three kinds the Llama family ships are implemented from their papers'
formulas (position interpolation, Llama 3.1's wavelength bands, YaRN's ramp with its attention factor),
and the kinds that change with the length being decoded (dynamic NTK, LongRoPE) are refused: training
would bake one length's frequencies into the weights.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from tessera.model.fused_ops import rotary

__all__ = ["ROPE_SCALING_TYPES", "rope_scaling_problem", "rotary_inv_freq", "rotary_cos_sin", "apply_rotary",
           "positions_from_cu_seqlens"]

# type -> (required keys, optional keys); "type" itself is required
ROPE_SCALING_TYPES: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "linear": (frozenset({"factor"}), frozenset()),
    "llama3": (frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
               frozenset()),
    "yarn": (frozenset({"factor", "original_max_position_embeddings"}),
             frozenset({"attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"})),
}
_REFUSED_TYPES = {
    "dynamic": "dynamic NTK scaling changes the frequencies with the length being decoded",
    "longrope": "LongRoPE switches between two frequency sets by the length being decoded",
}


def rope_scaling_problem(scaling: Any) -> str | None:
    """What is wrong with a ``model.rope_scaling`` value (None: nothing; None and ``{"type": "default"}`` are
    plain rotary)."""
    if scaling is None:
        return None
    if not isinstance(scaling, Mapping):
        return f"must be a dict with a 'type' key (one of {sorted(ROPE_SCALING_TYPES)}) or None"
    kind = scaling.get("type")
    if kind == "default":
        return None if set(scaling) == {"type"} else "type 'default' takes no other keys"
    if kind in _REFUSED_TYPES:
        return f"type {kind!r} is not supported: {_REFUSED_TYPES[kind]}; use one of {sorted(ROPE_SCALING_TYPES)}"
    if kind not in ROPE_SCALING_TYPES:
        return f"type {kind!r}: must be one of {sorted(ROPE_SCALING_TYPES)} (or 'default')"
    required, optional = ROPE_SCALING_TYPES[kind]
    missing = sorted(required - set(scaling))
    unknown = sorted(set(scaling) - required - optional - {"type"})
    if missing or unknown:
        parts = ([f"missing {missing}"] if missing else []) + ([f"unknown keys {unknown}"] if unknown else [])
        return f"type {kind!r}: {'; '.join(parts)} (it takes {sorted(required)} and optionally {sorted(optional)})"
    for key, value in scaling.items():
        if key == "type" or (key != "truncate" and value is None):
            continue
        if key == "truncate":
            if not isinstance(value, bool):
                return f"'truncate' must be a bool, got {value!r}"
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            return f"{key!r} must be a positive number, got {value!r}"
    if kind in ("llama3", "yarn") and scaling["factor"] < 1:
        return f"'factor' must be >= 1 for type {kind!r}, got {scaling['factor']!r}"
    if kind == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        return (f"'high_freq_factor'={scaling['high_freq_factor']} must exceed "
                f"'low_freq_factor'={scaling['low_freq_factor']}")
    return None


def _plain_inv_freq(head_dim: int, base: float, device: torch.device | None) -> torch.Tensor:
    """``1 / base^(2i/d)`` for i in [0, d/2), in fp32."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / (base**exponent)


def _llama3(inv_freq: torch.Tensor, s: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3.1: wavelengths longer than ``original / low_freq_factor`` are stretched by ``factor``, shorter than
    ``original / high_freq_factor`` kept, and the band between blends the two linearly in ``original / wavelength``."""
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    original = float(s["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv_freq
    blend = ((original / wavelength - low) / (high - low)).clamp(0.0, 1.0)  # 0: stretched, 1: kept
    out = (1 - blend) * inv_freq / factor + blend * inv_freq
    out = torch.where(wavelength > original / low, inv_freq / factor, out)
    return torch.where(wavelength < original / high, inv_freq, out)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(head_dim: int, base: float, s: Mapping[str, Any], device: torch.device | None) -> tuple[torch.Tensor, float]:
    """YaRN: dims that turn fewer than ``beta_slow`` times over the original length are interpolated (divided by
    ``factor``), dims that turn more than ``beta_fast`` times are kept, a linear ramp in between; cos/sin are
    scaled by the attention factor (``0.1 ln(factor) + 1`` unless given)."""
    factor, original = float(s["factor"]), float(s["original_max_position_embeddings"])
    attention = s.get("attention_factor")
    if attention is None:
        mscale, mscale_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all) if mscale and mscale_all
                     else _yarn_mscale(factor))
    fast, slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def dim_of(turns: float) -> float:  # the (fractional) dim index that turns `turns` times over `original`
        return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(fast), dim_of(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0.0, 1.0)
    kept = _plain_inv_freq(head_dim, base, device)
    return kept / factor * ramp + kept * (1 - ramp), float(attention)


def rotary_inv_freq(head_dim: int, base: float, scaling: Mapping[str, Any] | None = None,
                    device: torch.device | None = None) -> tuple[torch.Tensor, float]:
    """The rotary frequencies ``[head_dim / 2]`` (fp32) and the factor cos/sin are multiplied by (1.0 unless YaRN)."""
    problem = rope_scaling_problem(scaling)
    if problem:
        raise ValueError(f"rope_scaling={dict(scaling or {})!r}: {problem}")
    kind = None if scaling is None else scaling["type"]
    if kind == "yarn":
        assert scaling is not None
        return _yarn(head_dim, base, scaling, device)
    inv_freq = _plain_inv_freq(head_dim, base, device)
    if kind == "linear":
        assert scaling is not None
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        assert scaling is not None
        inv_freq = _llama3(inv_freq, scaling)
    return inv_freq, 1.0


def rotary_cos_sin(position_ids: torch.Tensor, head_dim: int, base: float,
                   scaling: Mapping[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape ``[B, S, 1, head_dim / 2]`` (fp32) for ``position_ids`` ``[B, S]``: the angle of the
    pair (``i``, ``i + head_dim/2``) at index ``i``; ``scaling``: ``model.rope_scaling``."""
    inv_freq, attention_factor = rotary_inv_freq(head_dim, base, scaling, position_ids.device)
    angles = (position_ids.float().unsqueeze(-1) * inv_freq).unsqueeze(2)  # [B, S, 1, d/2]
    if attention_factor == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * attention_factor, angles.sin() * attention_factor


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
