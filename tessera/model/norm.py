"""RMSNorm with fp32 statistics.

The mean of squares is computed in fp32 (fp64 for fp64 inputs) whatever the input dtype (bf16/fp16 sums of squares lose
precision and can overflow); the result is scaled by the weight in fp32 and cast back to the input
dtype once. The weight is TP-replicated.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tessera.parallel.attrs import set_tensor_parallel_attrs

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    """``y = x / sqrt(mean(x^2) + eps) * weight`` over the last dim."""

    def __init__(self, dim: int, eps: float = 1e-5, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, device=device, dtype=dtype))
        set_tensor_parallel_attrs(self.weight, None)
        self.init_weights()

    def init_weights(self, seed: int | None = None, prefix: str = "") -> None:
        """Weight = 1 (``seed`` and ``prefix`` are accepted for a uniform init walk; unused)."""
        if not self.weight.is_meta:
            with torch.no_grad():
                self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        compute = torch.promote_types(x.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
        xc = x.to(compute)
        y = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.to(compute)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"
