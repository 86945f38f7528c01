"""The rank layout: where every global rank sits in the TP x DP (x ZeRO-1) grid. The one rank-layout type.

world = tp x dp. TP groups are contiguous ranks ({0,1},{2,3},... for tp=2) so they stay inside a node
under torchrun/slurm; DP groups are strided (rank r has tp_rank = r % tp and dp_rank = r // tp); ZERO1
groups split every DP group into consecutive chunks of ``zero1`` ranks.

``Layout`` is one rank's place in that grid, held by the run description (``tessera.core.job.Job``).
The process groups, the checkpoint code (which shard a rank writes and reads; meta.json's ``layout``)
and the plan (which rank's memory it traces) all take it; ``group_layout`` lists the groups of every
mode for a world size.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from tessera.config import parallel_sizes

__all__ = ["Layout", "ParallelMode", "group_layout"]


class ParallelMode(str, Enum):
    GLOBAL = "global"
    DATA = "data"
    TENSOR = "tensor"
    ZERO1 = "zero1"


@dataclass(frozen=True)
class Layout:
    """One rank's place in the TP x DP grid, explicit so code that takes it needs no globals.

    The defaults are a plain single process. ``Layout.of(world, tp, zero1, rank)`` derives it from the
    sizes; a launched job's is ``gpc.job.layout``.
    """

    global_rank: int = 0
    world_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    zero1_size: int = 1

    @classmethod
    def of(cls, world_size: int, tp: int, zero1: int = 1, rank: int = 0) -> Layout:
        """Rank ``rank`` of ``world_size`` ranks at TP size ``tp`` and ZeRO-1 size ``zero1`` (-1: all of DP);
        an impossible combination is a ``ConfigError`` (``tessera.config.parallel_sizes``)."""
        tp, dp, zero1 = parallel_sizes(world_size, tp, zero1)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size} ranks")
        return cls(rank, world_size, rank % tp, tp, rank // tp, dp, zero1)

    def size(self, mode: ParallelMode) -> int:
        """The number of ranks in this rank's group of ``mode``."""
        return {ParallelMode.GLOBAL: self.world_size, ParallelMode.TENSOR: self.tp_size,
                ParallelMode.DATA: self.dp_size, ParallelMode.ZERO1: self.zero1_size}[mode]

    def ranks(self, mode: ParallelMode) -> list[int]:
        """The global ranks of this rank's group of ``mode``, in group order."""
        if mode is ParallelMode.GLOBAL:
            return list(range(self.world_size))
        if mode is ParallelMode.TENSOR:
            return list(range(self.dp_rank * self.tp_size, (self.dp_rank + 1) * self.tp_size))
        data = list(range(self.tp_rank, self.world_size, self.tp_size))
        if mode is ParallelMode.DATA:
            return data
        start = self.dp_rank // self.zero1_size * self.zero1_size
        return data[start : start + self.zero1_size]

    def groups(self) -> dict[ParallelMode, list[list[int]]]:
        """Every group of every mode, as lists of global ranks."""
        tp, dp, zero1, world = self.tp_size, self.dp_size, self.zero1_size, self.world_size
        tensor = [list(range(i * tp, (i + 1) * tp)) for i in range(dp)]
        data = [list(range(j, world, tp)) for j in range(tp)]
        zero = [g[k : k + zero1] for g in data for k in range(0, dp, zero1)]
        return {ParallelMode.GLOBAL: [list(range(world))], ParallelMode.TENSOR: tensor,
                ParallelMode.DATA: data, ParallelMode.ZERO1: zero}


def group_layout(world_size: int, tp: int, zero1: int) -> dict[ParallelMode, list[list[int]]]:
    """All groups of every mode for ``world_size`` ranks, as lists of global ranks (``Layout.groups``).

    ``zero1=-1`` means the whole data-parallel group.
    """
    return Layout.of(world_size, tp, zero1).groups()
