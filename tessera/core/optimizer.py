"""The optimizer's side of the run description, and the documented path of ``HybridZeroOptimizer``.

``OptimizerDtypes`` is what the ``hybrid_zero_optimizer`` section's dtype keys mean, resolved once into
torch dtypes (the run description's ``precision.optimizer``; the plan and the memory check read it).

``from tessera.core.optimizer import HybridZeroOptimizer`` (DESIGN.md's path) resolves lazily to
``tessera.optim.hybrid_zero``: the optimizer sits above ``core`` in the import order (it takes the run
description), so this module cannot import it at load time without a cycle. This is the one upward
name in ``core``; ``tests/test_architecture.py`` allows exactly it.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tessera.config.precision import Precision, dtype_from_name

__all__ = ["OptimizerDtypes", "optimizer_dtypes"]  # and, lazily, HybridZeroOptimizer and TooManySkippedSteps

_OPTIMIZER_DTYPES = (torch.float32, torch.bfloat16)
_LAZY = {"HybridZeroOptimizer": "tessera.optim.hybrid_zero", "TooManySkippedSteps": "tessera.optim.skips"}


@dataclass(frozen=True)
class OptimizerDtypes:
    """The dtypes HybridZeroOptimizer keeps (``hybrid_zero_optimizer`` keys), as torch dtypes."""

    master: torch.dtype = torch.float32
    state: torch.dtype = torch.float32  # Adam moments
    reduce: torch.dtype = torch.float32  # gradient accumulation and the DP reduction
    compensation: str = "none"  # bf16 masters: "none" | "kahan" | "stochastic"


def optimizer_dtypes(section: Mapping[str, Any], precision: Precision) -> OptimizerDtypes:
    """``hybrid_zero_optimizer``'s dtype keys as torch dtypes: ``master_dtype`` and ``optimizer_state_dtype``
    (fp32 | bf16), ``reduce_dtype`` (fp32 | model: the model's storage dtype)."""
    def pick(key: str) -> torch.dtype:
        value = section.get(key) or "fp32"
        try:
            return dtype_from_name(value, among=_OPTIMIZER_DTYPES)
        except ValueError as e:
            raise ValueError(f"hybrid_zero_optimizer.{key}: {e}") from None

    reduce = section.get("reduce_dtype") or "fp32"
    return OptimizerDtypes(
        master=pick("master_dtype"), state=pick("optimizer_state_dtype"),
        reduce=precision.dtype if reduce == "model" else pick("reduce_dtype"),
        compensation=str(section.get("master_compensation") or "none"),
    )


def __getattr__(name: str) -> Any:
    """``HybridZeroOptimizer`` and ``TooManySkippedSteps`` from the optimizer package, on first use."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
