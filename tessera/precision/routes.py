"""The GEMM route a linear takes on a kind of device, as the memory plan and the dry run ask it: the run's own
rule (``tessera.parallel.gemm.pick_route``) on a device described by the hardware table, not by the device at
hand, so ``tools/plan.py --gpu a100`` plans the route an A100 runs.

A device kind is ``"cpu"`` or ``"cuda"`` with a compute capability: the capability decides whether the fp8
recipes take ``torch._scaled_mm`` under ``model.low_precision.backend='auto'`` (``tessera.hardware.fp8_tensor_cores``).
"""

from __future__ import annotations

import torch

from tessera import hardware
from tessera.parallel.gemm import GemmRoute, pick_route, policy_for
from tessera.precision.plan import LowPrecisionGemms

__all__ = ["current_capability", "gemm_copy_bytes", "planned_route"]


def current_capability(device_type: str) -> tuple[int, int] | None:
    """The compute capability of this process's current device of ``device_type`` (None: not a CUDA device, or
    no CUDA here)."""
    if device_type != "cuda" or not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return major, minor


def planned_route(device_type: str, capability: tuple[int, int] | None, recipe: str | None,
                  backend: str = "auto", dtype: torch.dtype | None = torch.bfloat16) -> GemmRoute:
    """The route a linear of ``recipe`` (None: the model's dtype) on ``backend`` takes on a ``device_type`` device
    of ``capability``, whose operands are ``dtype``."""
    cores = device_type == "cuda" and hardware.fp8_tensor_cores(capability)
    return pick_route(device_type, dtype, policy_for(recipe, backend), cores)[0]


def gemm_copy_bytes(gemms: LowPrecisionGemms, device_type: str, capability: tuple[int, int] | None) -> int:
    """Bytes per operand element the section's routes copy inside one backward GEMM: the largest over its
    recipes (``GemmRoute.copy_bytes``); 0 without low-precision GEMMs."""
    return max((planned_route(device_type, capability, r, gemms.backend).copy_bytes for r in gemms.recipes
                if r not in ("bf16", "none")), default=0)
