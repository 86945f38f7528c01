"""Whether the ``flash_attn`` package (FlashAttention-2) can run the attention of a given call.

The package is imported for real, once per process: finding it on the path proves nothing, since a wheel
built for another torch or CUDA fails only when its compiled extension loads (an ``ImportError`` naming an
undefined symbol, an ``OSError`` from the loader, or a ``RuntimeError`` from torch). What the kernels
accept is checked per call: a CUDA device of compute capability 8.0 or more (Ampere and later), fp16 or
bf16, and a head dimension of at most 256 that is a multiple of 8 (others are padded by a copy on every
call). Whatever fails is returned as the reason, which the attention logs once with the backend used.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["FlashAttnKernels", "load_flash_attn", "flash_attn_available", "flash_attn_unusable", "MIN_CAPABILITY",
           "MAX_HEAD_DIM"]

MIN_CAPABILITY = (8, 0)
MAX_HEAD_DIM = 256
_PROBE: tuple[FlashAttnKernels | None, str] | None = None
_CAPABILITY: dict[int, tuple[int, int]] = {}


@dataclass(frozen=True)
class FlashAttnKernels:
    """The two entry points attention calls."""

    func: Callable[..., Any]  # flash_attn_func(q, k, v, dropout_p=..., causal=...), [B, S, H, d]
    varlen_func: Callable[..., Any]  # flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, ...), [T, H, d]


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def load_flash_attn() -> tuple[FlashAttnKernels | None, str]:
    """The kernels, or None and why not (not installed, or its import failed and how). Probed once."""
    global _PROBE
    if _PROBE is None:
        try:
            import flash_attn
            from flash_attn import flash_attn_func, flash_attn_varlen_func
        except ModuleNotFoundError as e:
            if e.name == "flash_attn":
                _PROBE = (None, "the flash_attn package is not installed")
            else:
                _PROBE = (None, f"importing flash_attn failed ({_first_line(e)})")
        except Exception as e:  # noqa: BLE001 - a broken build raises what its loader does (ImportError, OSError, ...)
            _PROBE = (None, f"importing flash_attn failed ({_first_line(e)})")
        else:
            version = getattr(flash_attn, "__version__", "unknown version")
            _PROBE = (FlashAttnKernels(flash_attn_func, flash_attn_varlen_func), f"flash_attn {version}")
    return _PROBE


def flash_attn_available() -> bool:
    """Whether flash_attn imports here (the planner and the memory check count SDPA's masks otherwise)."""
    return load_flash_attn()[0] is not None


def _capability(device: torch.device) -> tuple[int, int]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITY:
        _CAPABILITY[index] = tuple(torch.cuda.get_device_capability(index))  # type: ignore[assignment]
    return _CAPABILITY[index]


def flash_attn_unusable(device: torch.device, head_dim: int | None) -> str:
    """Why flash_attn cannot run on ``device`` (a CUDA device) for ``head_dim``; "" when it can.

    The caller has already checked the device type and the dtype; ``head_dim`` None skips that check."""
    kernels, why = load_flash_attn()
    if kernels is None:
        return why
    major, minor = _capability(device)
    if (major, minor) < MIN_CAPABILITY:
        return (f"the GPU's compute capability is {major}.{minor}; flash_attn needs "
                f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or more (Ampere and later)")
    if head_dim is not None and (head_dim > MAX_HEAD_DIM or head_dim % 8):
        return f"head_dim {head_dim}: flash_attn takes head dims up to {MAX_HEAD_DIM} that are multiples of 8"
    return ""
