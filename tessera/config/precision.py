"""Precision names -> storage dtype + TF32 switch.

``torch.tf32`` is not a storage type: the parameters stay fp32 and TF32 is a compute mode of CUDA
matmuls and cuDNN convolutions. We flip it only through the legacy ``allow_tf32`` setters: on torch
2.13 those keep both the legacy getters and the new ``fp32_precision`` getters readable, whereas the
new setters make any later ``allow_tf32`` read raise "mix of the legacy and new APIs".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tessera.config.errors import ConfigError


@dataclass(frozen=True)
class Precision:
    """What a ``model.dtype`` value means: storage dtype, TF32 compute, loss scaling."""

    name: str  # canonical: float16 | bfloat16 | float32 | tf32
    dtype: torch.dtype  # parameter / activation storage dtype
    tf32: bool  # TF32 matmul + cuDNN on CUDA

    @property
    def uses_loss_scaling(self) -> bool:
        return self.dtype == torch.float16

    @property
    def is_low_precision(self) -> bool:
        return self.dtype in (torch.float16, torch.bfloat16)


_CANONICAL = {
    "float16": (torch.float16, False),
    "bfloat16": (torch.bfloat16, False),
    "float32": (torch.float32, False),
    "tf32": (torch.float32, True),
}
_ALIASES = {
    "torch.float16": "float16", "torch.half": "float16", "float16": "float16", "half": "float16", "fp16": "float16",
    "torch.bfloat16": "bfloat16", "bfloat16": "bfloat16", "bf16": "bfloat16",
    "torch.float32": "float32", "torch.float": "float32", "float32": "float32", "float": "float32", "fp32": "float32",
    "torch.tf32": "tf32", "tf32": "tf32",
}
VALID_NAMES = sorted(_ALIASES)


def resolve_precision(value: str | torch.dtype | Precision) -> Precision:
    """Resolve a dtype name, alias or torch dtype to a ``Precision``; unknown names list the valid ones."""
    if isinstance(value, Precision):
        return value
    if isinstance(value, torch.dtype):
        for name, (dt, tf32) in _CANONICAL.items():
            if dt == value and not tf32:
                return Precision(name, dt, False)
        raise ConfigError(f"model.dtype: unsupported torch dtype {value}; valid: {VALID_NAMES}")
    if not isinstance(value, str) or value.strip().lower() not in _ALIASES:
        raise ConfigError(f"model.dtype: unknown dtype {value!r}; valid names: {VALID_NAMES}")
    name = _ALIASES[value.strip().lower()]
    dt, tf32 = _CANONICAL[name]
    return Precision(name, dt, tf32)


def parse_dtype(value: str | torch.dtype) -> tuple[torch.dtype, bool]:
    """``"torch.tf32"`` -> ``(torch.float32, True)``; ``"bf16"`` -> ``(torch.bfloat16, False)``."""
    p = resolve_precision(value)
    return p.dtype, p.tf32


def set_tf32(enabled: bool) -> None:
    """Switch TF32 for CUDA matmuls and cuDNN through the legacy setters (see module docstring)."""
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def apply_precision(value: str | torch.dtype | Precision) -> Precision:
    """Apply the process-wide switches a precision asks for: TF32 on for tf32, IEEE fp32 otherwise.

    fp16/bf16 runs also get TF32 off, so the fp32 parts of a mixed run (marked modules, the loss,
    the optimizer) compute in IEEE fp32 as the precision table promises.
    """
    p = resolve_precision(value)
    set_tf32(p.tf32)
    return p
