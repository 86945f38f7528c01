"""Published low-precision recipes as one key: ``model.low_precision.preset`` fills the section's switches the way
a recipe in the field sets them, before validation; a key the config gives beside the preset wins.

- ``nvidia``: "Pretraining Large Language Models with NVFP4" (NVIDIA, arXiv 2509.25149; Transformer Engine's
  ``NVFP4BlockScaling``): NVFP4 with 16x16 weight blocks, a random Hadamard transform of the weight-gradient
  GEMM's operands, stochastic rounding of gradients, and the first and last blocks kept in BF16 (the paper keeps
  its first 2 and last 8 of 62 blocks: here the same shares, at least one block each, and at least one block
  left in NVFP4).
- ``torchtitan``: torchtitan's NVFP4 converter: NVFP4 with the last 15% of blocks and the head in BF16.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from tessera.config.errors import ConfigError, where

__all__ = ["PRESETS", "apply_low_precision_preset"]

_NVIDIA_FIRST, _NVIDIA_LAST = 2 / 62, 8 / 62  # the paper's 12B model: 2 first and 8 last of its 62 blocks in BF16
_TORCHTITAN_LAST = 0.15


def _kept(num_layers: int, first_share: float, last_share: float) -> dict[str, int]:
    """Blocks kept in BF16 at each end: the shares rounded up (at least one where a share is given), leaving at
    least one block in low precision (a 2-block model keeps its first only)."""
    first = min(max(1, math.ceil(num_layers * first_share)) if first_share else 0, num_layers - 1)
    last = min(max(1, math.ceil(num_layers * last_share)) if last_share else 0, num_layers - 1 - first)
    return {"keep_first_blocks": first, "keep_last_blocks": last}


def _nvidia(num_layers: int) -> dict[str, Any]:
    return {"recipe": "nvfp4", "nvfp4_2d_weights": True, "hadamard_wgrad": True, "stochastic_gradients": True,
            **_kept(num_layers, _NVIDIA_FIRST, _NVIDIA_LAST)}


def _torchtitan(num_layers: int) -> dict[str, Any]:
    return {"recipe": "nvfp4", **_kept(num_layers, 0.0, _TORCHTITAN_LAST)}


PRESETS = {"nvidia": _nvidia, "torchtitan": _torchtitan}


def apply_low_precision_preset(raw: Mapping[str, Any], source: str | None = None) -> dict[str, Any]:
    """``raw`` with ``model.low_precision.preset``'s switches filled in where the config does not set them (and
    ``enabled`` on unless set); unchanged without a preset."""
    model = raw.get("model")
    if not isinstance(model, Mapping):
        return dict(raw)
    section = model.get("low_precision")
    if not isinstance(section, Mapping) or section.get("preset") is None:
        return dict(raw)
    name = section["preset"]
    if name not in PRESETS:
        raise ConfigError(f"model.low_precision.preset={name!r}: must be one of {list(PRESETS)}{where(source)}")
    layers = model.get("num_layers")
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
        raise ConfigError(f"model.low_precision.preset={name!r} needs model.num_layers (an int >= 1), got "
                          f"{layers!r}{where(source)}")
    filled = {"enabled": True, **PRESETS[name](layers), **section}
    return {**raw, "model": {**model, "low_precision": filled}}
