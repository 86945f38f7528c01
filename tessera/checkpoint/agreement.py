"""The cross-rank agreements of checkpoint saves and loads: every rank learns whether every rank succeeded
before any collective that depends on it, so one rank's local failure never leaves the others waiting.

Flags and error texts travel on the device the default group's backend serves (NCCL refuses CPU tensors);
without a process group every function answers for this one rank.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from tessera.core.layout import Layout
from tessera.parallel.coordination import all_agree, share_texts

__all__ = ["is_distributed", "barrier", "gather_to_rank0", "exchange_errors"]


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def gather_to_rank0(obj: Any, layout: Layout) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0 (in rank order), None on the others. A collective."""
    if not is_distributed() or layout.world_size == 1:
        return [obj]
    out = [None] * layout.world_size if layout.global_rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def exchange_errors(error: str | None) -> list[str]:
    """Every rank's error text, the same list on every rank; ``[]`` when no rank has one. A collective.

    The success path is the one flag of ``all_agree``; only when a rank failed are the texts exchanged
    (``tessera.parallel.coordination.share_texts``: lengths, then bytes, on the device the group's backend serves).
    """
    return [] if all_agree(error is None) else share_texts(error, None)
