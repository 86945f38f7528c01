"""Tensor-parallel tags on parameters, so optimizer, grad-norm and checkpoint code need no model knowledge.

A parameter is either TP-sharded along ``partition_dim`` (each TP rank holds a different slice; the
full tensor is the concatenation of the slices in TP-rank order) or TP-replicated (every TP rank
holds the same tensor and gets the same gradient; counted once in global norms, saved once).
"""

from __future__ import annotations

import torch


def set_tensor_parallel_attrs(param: torch.Tensor, partition_dim: int | None) -> torch.Tensor:
    """Tag ``param`` as sharded along ``partition_dim`` (None: replicated over the TP group)."""
    # ad-hoc attributes on the tensor (what the readers below look for)
    param.is_tensor_parallel = partition_dim is not None  # type: ignore[attr-defined]
    param.partition_dim = partition_dim  # type: ignore[attr-defined]
    return param


def is_tensor_parallel(param: torch.Tensor) -> bool:
    """True when each TP rank holds a different slice of ``param``."""
    return bool(getattr(param, "is_tensor_parallel", False))


def partition_dim(param: torch.Tensor) -> int | None:
    """The dim along which ``param`` is sharded over TP, or None when replicated/untagged."""
    return getattr(param, "partition_dim", None) if is_tensor_parallel(param) else None
