"""Overflow agreement, the one global gradient norm, and the clipping factor (HybridZeroOptimizer.step).

The global norm counts every parameter once over the whole TP x DP job: main grads are already
DP-reduced (identical across DP), TP-sharded parameters contribute their shard on every TP rank, and
TP-replicated ones only on TP rank 0 (tags from ``tessera.parallel.attrs``), then squares are summed
over the TP group. When the grads were reduce-scattered each ZeRO rank holds a different part of
them, so it reads only its shard and the squares are summed over the ZeRO group as well.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from tessera.optim.buffers import GradientBuffers
from tessera.optim.groups import GroupComm, OptimizerGroups
from tessera.parallel.attrs import is_tensor_parallel
from tessera.parallel.comm import to_host

__all__ = ["GradNorm", "param_norms", "any_rank_non_finite", "global_norm", "clip_factor"]


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


class GradNorm:
    """Overflow check and global norm over one optimizer's DP-reduced main grads.

    ``local()`` reads this rank's grads once per step (per-parameter norms, or the maxima of the shards
    when they were reduce-scattered); ``any_non_finite`` and ``norm`` then agree over the job.
    """

    def __init__(self, grads: GradientBuffers, groups: OptimizerGroups) -> None:
        self.grads, self.groups = grads, groups
        buckets = grads.buckets
        counted = [[is_tensor_parallel(p) or groups.tp.rank == 0 for p in b.params] for b in buckets]
        if grads.reduce_scatter:
            self._shards = [b.grad_shard for b in buckets]
            self._shard_views = [b.grad_flat[a:z] for b, c in zip(buckets, counted) for a, z in b.shard_segments(c)]
        else:  # TP-replicated parameters enter the global norm on TP rank 0 only
            device = grads.buckets[0].grad_flat.device
            self._count_mask = torch.tensor([c for cs in counted for c in cs], dtype=torch.float64, device=device)

    def local(self) -> torch.Tensor:
        """This rank's view of its grads: shard maxima after a reduce-scatter, else per-parameter norms."""
        if self.grads.reduce_scatter:
            return torch.stack([s.abs().amax() for s in self._shards])
        return param_norms([v for b in self.grads.buckets for v in b.grad_views])

    def any_non_finite(self, local: torch.Tensor) -> bool:
        """inf/NaN anywhere in the job: every rank agrees (one flag over the global group)."""
        g = self.groups
        return any_rank_non_finite(local, g.world, g.tp, g.dp)

    def norm(self, local: torch.Tensor) -> float:
        """The global L2 norm of the main grads, still loss-scaled and summed (not averaged) over DP."""
        g = self.groups
        if self.grads.reduce_scatter:
            shard_norms = param_norms(self._shard_views) if self._shard_views else local.new_zeros(0)
            return global_norm(shard_norms, None, g.tp, g.zero1)
        return global_norm(local, self._count_mask, g.tp)
