"""RMSNorm with fp32 statistics.

The mean of squares is computed in fp32 (fp64 for fp64 inputs) whatever the input dtype (bf16/fp16 sums of
squares lose precision and can overflow); the result is scaled by the weight in fp32 and cast back to the
input dtype once (``tessera.model.fused_ops.rms_norm``). The weight is TP-replicated. Under sequence
parallelism (msp) a norm sees only this rank's sequence chunk, so its weight gradient is partial:
``forward(x, sequence_parallel=True)`` sums it over the TP group inside autograd (``process_group``), and
the optimizer sees the full gradient as in mtp. The q/k norms of attention see only this rank's heads,
partial in the same way: ``forward(x, sharded_heads=True)``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from tessera.model.fused_ops import compute_dtype, rms_norm
from tessera.parallel.attrs import set_tensor_parallel_attrs
from tessera.parallel.comm import group_size
from tessera.parallel.sequence import reduce_grad_over_group

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    """``y = x / sqrt(mean(x^2) + eps) * weight`` over the last dim."""

    def __init__(self, dim: int, eps: float = 1e-5, *, process_group: Any = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.process_group = process_group  # the TP group: sums the weight gradient under sequence parallelism
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

    def forward(self, x: torch.Tensor, *, sequence_parallel: bool = False, sharded_heads: bool = False) -> torch.Tensor:
        """``sequence_parallel=True``: ``x`` is a sequence chunk; ``sharded_heads=True``: ``x`` holds this TP
        rank's heads. Either way the weight gradient is partial and is summed over the TP group."""
        weight: torch.Tensor = self.weight
        if (sequence_parallel or sharded_heads) and group_size(self.process_group) > 1:
            # the partial weight gradients are summed in fp32, then cast back once
            weight = reduce_grad_over_group(weight.to(compute_dtype(x.dtype)), self.process_group)
        return rms_norm(x, weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"
