"""The persistent training state of a rank, bytes per parameter by role, in closed form.

Weights, main grads, fp32 masters, the Kahan compensation of bf16 masters and Adam's two moments, under the
run's optimizer dtypes (``PrecisionPlan.optimizer``) with ZeRO-1 over ``zero1_size`` ranks: ``2 + 4 + (4 +
8)/d`` bytes per bf16 parameter by default, ``4 + 4 + 8/d`` per fp32 one. The run's memory check
(``tessera.memory.estimate``), the plan (``tessera.plan.report``) and the precision report, which measures the
allocated tensors beside it (``tessera.train.precision_report``), all count with it.
"""

from __future__ import annotations

import torch

from tessera.precision.plan import PrecisionPlan

__all__ = ["ROLES", "closed_form_bytes"]

# the persistent buffers, in the order the reports list them
ROLES = ("weights", "main_grads", "masters", "compensation", "optimizer_states")


def closed_form_bytes(precision: PrecisionPlan, zero1_size: int, low_params: int, fp32_params: int) -> dict[str, float]:
    """Bytes per parameter by role for ``low_params`` model-dtype and ``fp32_params`` fp32 parameters, under
    the run's optimizer dtypes (masters, moments, gradient reduction, compensation)."""
    p, opt, d = precision.model, precision.optimizer, zero1_size
    low_w = p.dtype.itemsize if p.is_low_precision else 4
    low_g = opt.reduce.itemsize if p.is_low_precision else 4
    bf16_masters = opt.master == torch.bfloat16
    # fp32 parameters are their own masters; bf16 masters share the bf16 weights' storage
    low_m = 4 / d if p.is_low_precision and not bf16_masters else 0.0
    comp = 2 / d if bf16_masters and opt.compensation == "kahan" else 0.0
    moments = 2 * opt.state.itemsize  # Adam's two moments
    per = {
        "weights": low_w * low_params + 4 * fp32_params,
        "main_grads": low_g * low_params + 4 * fp32_params,
        "masters": low_m * low_params,
        "compensation": comp * low_params,
        "optimizer_states": moments / d * (low_params + fp32_params),
    }
    n = max(1, low_params + fp32_params)
    out = {k: v / n for k, v in per.items()}
    out["total"] = sum(out.values())
    return out
