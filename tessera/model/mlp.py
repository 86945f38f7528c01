"""SwiGLU feed-forward: ``w2(silu(w1 x) * w3 x)``; w1 (gate) and w3 (up) column-parallel, w2 row-parallel."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from tessera.model.fused_ops import swiglu
from tessera.model.recompute import keep_gemm_outputs
from tessera.parallel.layers import ColumnParallelLinear, RowParallelLinear, column_parallel_linears

__all__ = ["FeedForward", "ffn_hidden_size"]


def ffn_hidden_size(hidden_size: int, mlp_ratio: float, multiple_of: int) -> int:
    """``multiple_of * ceil(int(hidden_size * mlp_ratio) / multiple_of)``: 4096, 8/3, 256 -> 11008."""
    raw = int(hidden_size * mlp_ratio)
    return multiple_of * -(-raw // multiple_of)


class FeedForward(nn.Module):
    """SwiGLU MLP, tensor-parallel over the hidden (intermediate) features."""

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden: int,
        process_group: Any = None,
        *,
        bias: bool = False,
        init_std: float = 0.02,
        out_init_std: float | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.process_group = process_group
        kw = dict(process_group=process_group, init_seed=None, device=device, dtype=dtype)
        self.w1 = ColumnParallelLinear(hidden_size, ffn_hidden, bias, init_std=init_std, **kw)
        self.w3 = ColumnParallelLinear(hidden_size, ffn_hidden, bias, init_std=init_std, **kw)
        out_std = init_std if out_init_std is None else out_init_std
        self.w2 = RowParallelLinear(ffn_hidden, hidden_size, bias, init_std=out_std, **kw)

    def forward(self, x: torch.Tensor, sequence_parallel: bool = False) -> torch.Tensor:
        """``sequence_parallel``: ``x`` is this rank's sequence chunk (msp), and so is the output."""
        with keep_gemm_outputs():  # entering the TP region once for w1 and w3 (one gradient collective)
            gate, up = column_parallel_linears(x, [self.w1, self.w3], sequence_parallel=sequence_parallel)
        return self.w2(swiglu(gate, up), sequence_parallel=sequence_parallel)
