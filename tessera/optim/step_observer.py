"""What HybridZeroOptimizer shows an observer of one step (``observe_next_step``): the gradients it
received and the update it applied, where that data lives (the update chunk by chunk: no shard-sized copy).

Why an observer rather than a getter: the data only exists during ``step()``. The DP-reduced main
grads are unscaled in place right after the overflow check, and the fp32 update of a low-precision
master exists only chunk by chunk inside the fused AdamW pass, before it is rounded into storage.
An observer sees both at those moments and keeps only what it reduces them to.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from tessera.optim.bucket import Bucket

__all__ = ["StepObserver"]


class StepObserver(Protocol):
    """Called by ``HybridZeroOptimizer.step()`` on every rank, with no collective in between."""

    def gradients(self, buckets: Sequence[Bucket], reduce_scattered: bool) -> None:
        """The main grads after the DP reduction: loss-scaled, summed (not averaged) over DP, before the
        overflow check. ``reduce_scattered``: only this rank's ZeRO shard ``[lo, hi)`` of each bucket's
        ``grad_flat`` holds the reduced sum (else the whole buffer does)."""

    def update(self, bucket: int, start: int, stop: int, update: torch.Tensor, before: torch.Tensor,
               unchanged: torch.Tensor) -> None:
        """Elements ``[start, stop)`` of bucket ``bucket``'s master shard after the update (not called on a
        skipped step). ``update``: the fp32 change the optimizer's arithmetic computed, before it was
        stored; ``before``: the fp32 value it was computed from (a bf16 master widened, plus its Kahan
        compensation); ``unchanged``: True where the stored master (and compensation) kept its old bits."""
