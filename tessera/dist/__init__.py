"""The job: process-group layout, the parallel context ``gpc``, RNG streams, launching, node-local routes."""

from tessera.dist.context import ParallelContext, gpc
from tessera.dist.launch import launch, launch_from_slurm, launch_from_torch
from tessera.dist.layout import Layout, ParallelMode, group_layout
from tessera.parallel.seeds import derive_seed

__all__ = ["Layout", "ParallelContext", "ParallelMode", "gpc", "group_layout", "launch", "launch_from_torch",
           "launch_from_slurm", "derive_seed"]
