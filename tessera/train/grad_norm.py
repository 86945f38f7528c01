"""Overflow agreement, the one global gradient norm, and the clipping factor (HybridZeroOptimizer.step).

The global norm counts every parameter once over the whole TP x DP job: main grads are already
DP-reduced (identical across DP), TP-sharded parameters contribute their shard on every TP rank, and
TP-replicated ones only on TP rank 0 (``count_mask``), then squares are summed over the TP group.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from tessera.parallel.comm import to_host
from tessera.train.grad_buffer import GroupComm

__all__ = ["param_norms", "any_rank_non_finite", "global_norm", "clip_factor"]


def param_norms(views: list[torch.Tensor]) -> torch.Tensor:
    """fp32 L2 norm of every main-grad view, stacked in order."""
    if hasattr(torch, "_foreach_norm"):
        try:
            return torch.stack(torch._foreach_norm(views, 2, dtype=torch.float32))
        except (TypeError, RuntimeError):  # an older signature without dtype
            pass
    return torch.stack([torch.linalg.vector_norm(v, dtype=torch.float32) for v in views])


def any_rank_non_finite(values: torch.Tensor, world: GroupComm | None, tp: GroupComm, dp: GroupComm) -> bool:
    """True on every rank when any rank has an inf/NaN in ``values`` (norms or maxima of the gradients;
    the flag stays on their device)."""
    flag = (~torch.isfinite(values).all()).to(torch.float32).reshape(1)
    if world is not None:
        world.all_reduce(flag, dist.ReduceOp.MAX)
    else:  # TP then DP reaches every rank of a tp x dp layout
        tp.all_reduce(flag, dist.ReduceOp.MAX)
        dp.all_reduce(flag, dist.ReduceOp.MAX)
    return to_host(flag)[0] > 0


def global_norm(norms: torch.Tensor, count_mask: torch.Tensor | None, *groups: GroupComm) -> float:
    """sqrt of the squares of the counted norms summed over ``groups`` (still loss-scaled, DP-summed).

    With whole main grads on every DP rank the sum runs over TP only; with reduce-scattered shards
    each ZeRO rank holds a different part, so it runs over the ZeRO group as well.
    """
    # a 0/1 weight rather than a boolean index: no data-dependent shape, so no device sync
    squares = norms.double().square()
    sq = torch.stack([(squares * count_mask if count_mask is not None else squares).sum()])
    for group in groups:
        group.all_reduce(sq)
    return math.sqrt(to_host(sq)[0])


def clip_factor(grad_norm: float, max_norm: float) -> float:
    """The factor that scales gradients of norm ``grad_norm`` to at most ``max_norm`` (0 disables)."""
    if max_norm > 0:
        coef = max_norm / (grad_norm + 1e-6)
        if coef < 1.0:
            return coef
    return 1.0
