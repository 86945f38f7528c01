"""``from tessera.core.context import gpc, ParallelMode, launch_from_torch, launch_from_slurm``: the
DESIGN.md path of the parallel context.

Re-exports of ``tessera.dist``, where the context and the launchers live; patch them there.
"""

from tessera.dist import ParallelMode, gpc, launch_from_slurm, launch_from_torch

__all__ = ["gpc", "ParallelMode", "launch_from_torch", "launch_from_slurm"]
