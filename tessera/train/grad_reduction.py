"""The DP reduction of HybridZeroOptimizer's gradient buckets: after backward, or during the last one.

Each bucket is reduced on its own: reduce-scattered straight into the owning ranks' shards when the
ZeRO group is the whole DP group (a DDP all-reduce's traffic, counting the parameters' all-gather after
the step), all-reduced otherwise. Armed for the last micro-batch's backward, the post-accumulate-grad
hooks count each bucket's arrivals and launch its collective asynchronously as soon as the last of
its gradients is in, so communication overlaps the rest of backward; ``finish`` waits for those and
reduces whatever did not start (a parameter that got no gradient, or no overlap asked for).
Every rank runs the same backward graph, so the buckets complete, and launch, in the same order.
"""

from __future__ import annotations

from typing import Any

import torch

from tessera.train.grad_buffer import Bucket, GroupComm

__all__ = ["GradReduction"]


class GradReduction:
    """Launch / wait bookkeeping of the buckets' DP reductions for one optimizer."""

    def __init__(self, buckets: list[Bucket], grad_buffers: dict[torch.dtype, torch.Tensor], dp: GroupComm,
                 zero1: GroupComm) -> None:
        self.buckets = buckets
        self.grad_buffers = grad_buffers
        self.dp, self.zero1 = dp, zero1
        self.reduce_scatter = 1 < zero1.size == dp.size
        self.missing: list[int] | None = None  # gradients still expected per bucket while armed
        self.launched: dict[int, Any] = {}  # bucket index -> work handle (None: nothing to wait for)

    def arm(self) -> None:
        """The next backward is the last before the step: launch buckets as they complete."""
        self.missing = [len(b.params) for b in self.buckets]

    def disarm(self) -> None:
        self.missing = None

    def arrived(self, i: int) -> None:
        """Called by bucket ``i``'s hook after adding a gradient into its main-grad buffer."""
        if self.missing is None:
            return
        self.missing[i] -= 1
        if self.missing[i] == 0:
            self.launched[i] = self.start(self.buckets[i])

    def check_open(self, i: int) -> None:
        if i in self.launched:
            raise RuntimeError(
                "HybridZeroOptimizer: a gradient arrived for a bucket whose DP reduction already started "
                "(backward(..., overlap_reduction=True) must be the last backward before step())")

    def start(self, b: Bucket) -> Any:
        """Launch one bucket's reduction asynchronously; returns its work handle."""
        if self.reduce_scatter:
            return self.zero1.reduce_scatter_flat(b.grad_flat, async_op=True)
        return self.dp.all_reduce_async(b.grad_flat)

    def finish(self) -> None:
        """Wait for the buckets launched during backward; reduce the others now."""
        launched, self.launched = self.launched, {}
        if not launched and not self.reduce_scatter:
            for buf in self.grad_buffers.values():  # one collective per dtype (and the fast node-local route)
                self.dp.all_reduce(buf)
            return
        for i, b in enumerate(self.buckets):
            if i in launched:
                if launched[i] is not None:
                    launched[i].wait()
            elif self.reduce_scatter:
                self.zero1.reduce_scatter_flat(b.grad_flat)
            else:
                self.dp.all_reduce(b.grad_flat)

    def cancel(self) -> None:
        """Wait for reductions a backward launched when no step follows (their sums are discarded)."""
        for work in self.launched.values():
            if work is not None:
                work.wait()
        self.launched = {}
