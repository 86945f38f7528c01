"""The process groups HybridZeroOptimizer talks to: each with its size and this process's rank.

Groups come from the caller (the run description's, ``tessera.core.job.JobGroups``), else there is
none (a single process): size 1 means no communication at all, so the same code runs in a plain test
process.
The flat-buffer collectives here work in place, as NCCL documents its in-place forms, so the ZeRO
reduce-scatter and all-gather need no staging buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tessera.config import ConfigError, resolve_zero1_size
from tessera.parallel.comm import all_reduce as comm_all_reduce

__all__ = ["GroupComm", "OptimizerGroups"]


def _reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None,
                    async_op: bool = False) -> Any:
    # torch 2.13 renamed reduce_scatter_tensor (now deprecated) to reduce_scatter_single
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, group=group, async_op=async_op)


def _all_gather(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None) -> Any:
    # torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group)


@dataclass
class GroupComm:
    """A process group with its size and this process's rank (size 1 = no communication)."""

    group: dist.ProcessGroup | None
    size: int
    rank: int

    @classmethod
    def of(cls, group: dist.ProcessGroup | None, what: str) -> GroupComm:
        if group is None:
            return cls(None, 1, 0)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(f"HybridZeroOptimizer: {what} was given but torch.distributed is not initialized")
        size = dist.get_world_size(group)
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError(f"HybridZeroOptimizer: this process is not a member of the {what}")
        return cls(group if size > 1 else None, size, rank)

    def all_reduce(self, t: torch.Tensor, op: Any = None) -> torch.Tensor:
        if self.size > 1:  # through tessera's comm so a fast node-local route (shared memory) applies
            comm_all_reduce(t, self.group, op or dist.ReduceOp.SUM)
        return t

    def reduce_scatter_flat(self, flat: torch.Tensor, async_op: bool = False) -> Any:
        """Sum ``flat`` over the group into this rank's 1/size chunk of it, in place (the other chunks
        are left unreduced): a DDP all-reduce's traffic split in half, the other half being the
        parameters' all-gather after the step. In place is NCCL's documented in-place reduce-scatter
        (the output is the input's ``rank``-th chunk). ``async_op``: returns the work handle."""
        if self.size == 1:
            return None
        return _reduce_scatter(flat.chunk(self.size)[self.rank], flat, group=self.group, async_op=async_op)

    def all_reduce_async(self, t: torch.Tensor) -> Any:
        """Start a sum over the group (torch.distributed's own async work; the node-local fast route of
        ``all_reduce`` is synchronous, so it is not used here)."""
        if self.size == 1:
            return None
        return dist.all_reduce(t, group=self.group, async_op=True)

    def all_gather_flat(self, flat: torch.Tensor) -> None:
        """Every rank holds its own 1/size slice of ``flat``; afterwards every rank holds all of it.
        In place (the input is the output's ``rank``-th chunk, as NCCL documents): no staging buffer."""
        if self.size == 1:
            return
        _all_gather(flat, flat.chunk(self.size)[self.rank], group=self.group)

    def gather_full(self, shard: torch.Tensor) -> torch.Tensor:
        """Concatenate the 1-D ``shard`` of every rank (rank order)."""
        if self.size == 1:
            return shard.detach().clone()
        out = torch.empty(shard.numel() * self.size, dtype=shard.dtype, device=shard.device)
        _all_gather(out, shard.detach().contiguous(), group=self.group)
        return out


@dataclass(frozen=True)
class OptimizerGroups:
    """TP, DP and ZERO1 groups, and the whole job's group (None: TP then DP reach every rank)."""

    tp: GroupComm
    dp: GroupComm
    zero1: GroupComm
    world: GroupComm | None

    @classmethod
    def resolve(cls, tp_group: dist.ProcessGroup | None = None, dp_group: dist.ProcessGroup | None = None,
                zero1_group: dist.ProcessGroup | None = None,
                global_group: dist.ProcessGroup | None = None) -> OptimizerGroups:
        """The groups given (None: that dimension has one rank); checks that ZERO1 splits DP."""
        tp = GroupComm.of(tp_group, "tp_group")
        dp = GroupComm.of(dp_group, "dp_group")
        zero1 = GroupComm.of(zero1_group, "zero1_group")
        world = global_group
        try:
            resolve_zero1_size(dp.size, zero1.size)
        except ConfigError as e:
            raise ValueError(f"HybridZeroOptimizer: the ZERO1 group (size {zero1.size}) must split the DP "
                             f"group (size {dp.size}): {e}; pass dp_group as well as zero1_group") from None
        return cls(tp, dp, zero1, GroupComm.of(world, "global_group") if world is not None else None)
