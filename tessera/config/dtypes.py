"""Dtype names: the one table of them, and what a ``model.dtype`` value means (``ModelDtype``).

``DTYPE_TABLE`` names every dtype tessera reads or writes: torch's name, the short name of configs and
tools (``bf16``), the safetensors code (``BF16``) and torch's other names (``half``). The precision
aliases, the safetensors codes, the Hugging Face ``torch_dtype`` names and the optimizer's dtype keys
are all derived from it.

This module is the one place a dtype name is parsed; it sits in ``config`` because the config checks parse
``model.dtype`` before any run exists. ``torch.tf32`` is not a storage type: the parameters stay fp32 and
TF32 is a compute mode. The run's resolved precision (``PrecisionPlan``: this model dtype, the fp32 marks,
fp8, the optimizer's dtypes) and the backend switches are ``tessera.precision``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tessera.config.errors import ConfigError

__all__ = ["DTYPE_TABLE", "MODEL_DTYPE_NAMES", "SAFETENSORS_CODES", "DTypeNames", "ModelDtype", "dtype_from_name",
           "dtype_name", "dtypes_by_short_name", "parse_dtype", "resolve_model_dtype"]


@dataclass(frozen=True)
class DTypeNames:
    """One dtype's names, as each file format and tool spells it."""

    dtype: torch.dtype
    name: str  # torch's: str(dtype) without "torch."
    short: str | None  # configs' and tools' short name
    safetensors: str  # the safetensors header's code
    aliases: tuple[str, ...] = ()  # torch's other names for it (torch.half is torch.float16)


DTYPE_TABLE: tuple[DTypeNames, ...] = (
    DTypeNames(torch.float64, "float64", "fp64", "F64", ("double",)),
    DTypeNames(torch.float32, "float32", "fp32", "F32", ("float",)),
    DTypeNames(torch.float16, "float16", "fp16", "F16", ("half",)),
    DTypeNames(torch.bfloat16, "bfloat16", "bf16", "BF16"),
    DTypeNames(torch.int64, "int64", None, "I64", ("long",)),
    DTypeNames(torch.int32, "int32", None, "I32", ("int",)),
    DTypeNames(torch.int16, "int16", None, "I16", ("short",)),
    DTypeNames(torch.int8, "int8", None, "I8"),
    DTypeNames(torch.uint8, "uint8", None, "U8"),
    DTypeNames(torch.bool, "bool", None, "BOOL"),
)
_BY_DTYPE = {row.dtype: row for row in DTYPE_TABLE}
SAFETENSORS_CODES: dict[torch.dtype, str] = {row.dtype: row.safetensors for row in DTYPE_TABLE}


def _names(row: DTypeNames) -> set[str]:
    """Every spelling of ``row``'s dtype: torch's names with and without ``torch.``, and the short name."""
    torch_names = (row.name, *row.aliases)
    return {*torch_names, *(f"torch.{n}" for n in torch_names), *((row.short,) if row.short else ())}


def dtype_name(dtype: torch.dtype) -> str:
    """torch's name of ``dtype`` (``torch.bfloat16`` -> ``"bfloat16"``, as Hugging Face configs write it)."""
    return _BY_DTYPE[dtype].name


def dtype_from_name(name: str, among: tuple[torch.dtype, ...] | None = None) -> torch.dtype:
    """``"bf16"``, ``"bfloat16"``, ``"torch.bfloat16"`` (any case) -> ``torch.bfloat16``; restricted to
    ``among`` when given. An unknown name is a ValueError listing the short names allowed."""
    rows = [_BY_DTYPE[d] for d in among] if among is not None else DTYPE_TABLE
    key = str(name).strip().lower()
    for row in rows:
        if key in _names(row):
            return row.dtype
    raise ValueError(f"unknown dtype {name!r}: use {', '.join(r.short or r.name for r in rows)}")


def dtypes_by_short_name(*short: str) -> dict[str, torch.dtype]:
    """``{"fp32": torch.float32, "bf16": torch.bfloat16}`` for ``dtypes_by_short_name("fp32", "bf16")``."""
    by_short = {row.short: row.dtype for row in DTYPE_TABLE if row.short}
    return {n: by_short[n] for n in short}


@dataclass(frozen=True)
class ModelDtype:
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


# model.dtype: the three storage dtypes of training, and tf32 (fp32 storage, TF32 compute)
_CANONICAL = {dtype_name(d): (d, False) for d in (torch.float16, torch.bfloat16, torch.float32)}
_CANONICAL["tf32"] = (torch.float32, True)
_ALIASES = {alias: dtype_name(d) for d in (torch.float16, torch.bfloat16, torch.float32)
            for alias in _names(_BY_DTYPE[d])}
_ALIASES.update({"tf32": "tf32", "torch.tf32": "tf32"})
MODEL_DTYPE_NAMES = sorted(_ALIASES)


def resolve_model_dtype(value: str | torch.dtype | ModelDtype) -> ModelDtype:
    """Resolve a dtype name, alias or torch dtype to a ``ModelDtype``; unknown names list the valid ones."""
    if isinstance(value, ModelDtype):
        return value
    if isinstance(value, torch.dtype):
        for name, (dt, tf32) in _CANONICAL.items():
            if dt == value and not tf32:
                return ModelDtype(name, dt, False)
        raise ConfigError(f"model.dtype: unsupported torch dtype {value}; valid: {MODEL_DTYPE_NAMES}")
    if not isinstance(value, str) or value.strip().lower() not in _ALIASES:
        raise ConfigError(f"model.dtype: unknown dtype {value!r}; valid names: {MODEL_DTYPE_NAMES}")
    name = _ALIASES[value.strip().lower()]
    dt, tf32 = _CANONICAL[name]
    return ModelDtype(name, dt, tf32)


def parse_dtype(value: str | torch.dtype) -> tuple[torch.dtype, bool]:
    """``"torch.tf32"`` -> ``(torch.float32, True)``; ``"bf16"`` -> ``(torch.bfloat16, False)``."""
    p = resolve_model_dtype(value)
    return p.dtype, p.tf32
