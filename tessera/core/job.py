"""The run description: one frozen object with every fact of a run that the layers below need.

A ``Job`` is built once, after launch, from the config: the rank layout (sizes and ranks of world /
TP / DP / ZeRO-1), the process groups of this rank, the tensor mode, the device, the seed and the
precision plan (``PrecisionPlan``, ``tessera.precision``). ``train.py`` passes it explicitly to the builder of the
training stack, the memory check, checkpointing and metrics; ``gpc`` (for InternEvo-style user code)
reads its groups and ranks from it. Nothing below re-parses a dtype name or re-derives a group size
from the config.

``Job.single_process(cfg)`` describes a plain process with no process group (tests, tools, a CPU
notebook); ``Job.of(cfg, groups, ...)`` one whose groups a test made itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tessera.config.typed import RunConfig
from tessera.core.layout import Layout, ParallelMode
from tessera.parallel.sequence import TENSOR_MODES
from tessera.precision.plan import PrecisionPlan, run_config_of

__all__ = ["Job", "JobGroups"]

ProcessGroup = dist.ProcessGroup


@dataclass(frozen=True)
class JobGroups:
    """This rank's process groups; None: that dimension has one rank (or nothing is launched)."""

    tp: ProcessGroup | None = None
    dp: ProcessGroup | None = None
    zero1: ProcessGroup | None = None
    world: ProcessGroup | None = None

    def of(self, mode: ParallelMode) -> ProcessGroup | None:
        return {ParallelMode.GLOBAL: self.world, ParallelMode.TENSOR: self.tp, ParallelMode.DATA: self.dp,
                ParallelMode.ZERO1: self.zero1}[mode]

    def layout(self) -> Layout:
        """The layout these groups form (each group's size and this rank's place in it)."""
        def size_rank(group: ProcessGroup | None) -> tuple[int, int]:
            if group is None or not dist.is_initialized():
                return 1, 0
            return dist.get_world_size(group), dist.get_rank(group)

        world, rank = size_rank(self.world) if self.world is not None else (
            (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0))
        tp, tp_rank = size_rank(self.tp)
        dp, dp_rank = size_rank(self.dp)
        zero1, _ = size_rank(self.zero1)
        return Layout(rank, world, tp_rank, tp, dp_rank, dp, zero1)


@dataclass(frozen=True)
class Job:
    """What a run is, resolved once: layout, groups, tensor mode, device, seed and precision."""

    layout: Layout
    groups: JobGroups
    precision: PrecisionPlan
    tensor_mode: str = "mtp"
    device: torch.device = torch.device("cpu")
    seed: int = 0

    def __post_init__(self) -> None:
        if self.tensor_mode not in TENSOR_MODES:
            raise ValueError(f"parallel.tensor.mode must be one of {list(TENSOR_MODES)}, got {self.tensor_mode!r}")

    @property
    def dtype(self) -> torch.dtype:
        """The model's storage dtype."""
        return self.precision.dtype

    @property
    def is_rank0(self) -> bool:
        return self.layout.global_rank == 0

    def ranks(self, mode: ParallelMode) -> list[int]:
        """The global ranks of this rank's group of ``mode``."""
        return self.layout.ranks(mode)

    def replace(self, **changes: Any) -> Job:
        """A copy with some fields changed (e.g. another seed or device for one stack)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def of(cls, cfg: RunConfig | Mapping[str, Any], groups: JobGroups | None = None, *, layout: Layout | None = None,
           device: torch.device | str = "cpu", seed: int | None = None) -> Job:
        """The job ``cfg`` describes (its typed view; a plain dict is validated first) over ``groups`` (none: a
        single process); the layout is read from the groups unless given (a dry run's fake groups state theirs)."""
        groups = groups or JobGroups()
        run = run_config_of(cfg)
        return cls(layout=layout or groups.layout(), groups=groups, precision=PrecisionPlan.from_run(run),
                   tensor_mode=run.parallel.tensor.mode, device=torch.device(device),
                   seed=run.seed if seed is None else seed)

    @classmethod
    def single_process(cls, cfg: RunConfig | Mapping[str, Any], *, device: torch.device | str = "cpu",
                       seed: int | None = None) -> Job:
        """A plain process: no process group, world size 1."""
        return cls.of(cfg, JobGroups(), layout=Layout(), device=device, seed=seed)
