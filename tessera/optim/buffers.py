"""The fp32 main gradients of HybridZeroOptimizer: flat buffers, buckets, hooks and the DP reduction.

The parameters of every inner param group are split by storage dtype into buckets of at most
``reduce_bucket_size`` elements, filled in reverse parameter order (the order backward completes
gradients in), so each bucket's DP reduction can start during backward. The main grads of all buckets
of one dtype are slices of ONE flat buffer, so the DP all-reduce after backward is one collective per
dtype; every bucket is padded to a multiple of the ZERO1 size.

Post-accumulate-grad hooks add each parameter's ``.grad`` into its main-grad view and free it, so
accumulation over micro-batches and the DP reduction run in fp32 (``reduce_dtype="model"``: in the
model's low-precision dtype). With ``fuse_wgrad`` the column/row-parallel linears' weights get their fp32
view as ``param.main_grad``, their backward's GEMM adds into it directly and sets
``param.grad_added_to_main_grad``, and the hook reads and clears that flag and only counts the arrival
(``tessera.parallel.wgrad``).

The DP reduction is per bucket: reduce-scattered straight into the owning ranks' shards when the
ZeRO group is the whole DP group (a DDP all-reduce's traffic, counting the parameters' all-gather after
the step), all-reduced otherwise. Armed for the last micro-batch's backward, the hooks count each
bucket's arrivals and launch its collective asynchronously as soon as the last of its gradients is
in, so communication overlaps the rest of backward; ``finish`` waits for those and reduces whatever
did not start (a parameter that got no gradient, or no overlap asked for).
Every rank runs the same backward graph, so the buckets complete, and launch, in the same order.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tessera.optim.bucket import Bucket, split_reversed
from tessera.optim.groups import GroupComm
from tessera.optim.params import LOW_PRECISION
from tessera.parallel.wgrad import attach_main_grad, is_fusable, take_added

__all__ = ["GradientBuffers"]

# (hyperparameters of the inner group, parameters, main-grad dtype) of one bucket
_Spec = tuple[dict[str, Any], list[nn.Parameter], torch.dtype]


def _bucket_specs(param_groups: list[dict[str, Any]], reduce_dtype: str, bucket_size: int) -> list[_Spec]:
    """One run of buckets per (param group, storage dtype), low-precision parameters first."""
    specs: list[_Spec] = []
    for group in param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        for want_low in (True, False):
            plist = [p for p in group["params"] if p.requires_grad and (p.dtype in LOW_PRECISION) == want_low]
            if plist:
                low = plist[0].dtype in LOW_PRECISION
                grad_dtype = plist[0].dtype if low and reduce_dtype == "model" else torch.float32
                specs += [(hyper, chunk, grad_dtype) for chunk in split_reversed(plist, bucket_size)]
    return specs


class GradientBuffers:
    """The main-grad buffers of one optimizer, the buckets over them, their hooks and DP reduction.

    ``hypers[i]`` are the inner-group hyperparameters of ``buckets[i]`` (the optimizer rebuilds its
    inner groups from them, one per bucket).
    """

    def __init__(self, param_groups: list[dict[str, Any]], names: dict[int, str], *, dp: GroupComm,
                 zero1: GroupComm, master_dtype: torch.dtype, reduce_dtype: str, bucket_size: int,
                 fuse_wgrad: bool = True) -> None:
        specs = _bucket_specs(param_groups, reduce_dtype, bucket_size)
        d = zero1.size
        sizes: dict[torch.dtype, int] = {}
        for _, plist, gdt in specs:
            sizes[gdt] = sizes.get(gdt, 0) + Bucket.shard_size(sum(p.numel() for p in plist), d) * d
        device = specs[0][1][0].device
        self.flat_buffers = {gdt: torch.zeros(n, dtype=gdt, device=device) for gdt, n in sizes.items()}
        used = dict.fromkeys(sizes, 0)
        self.buckets: list[Bucket] = []
        self.hypers: list[dict[str, Any]] = []
        for hyper, plist, gdt in specs:
            n = Bucket.shard_size(sum(p.numel() for p in plist), d) * d
            view = self.flat_buffers[gdt][used[gdt] : used[gdt] + n]
            used[gdt] += n
            self.buckets.append(Bucket(plist, [names[id(p)] for p in plist], view, zero1, master_dtype))
            self.hypers.append(hyper)
        self.dp, self.zero1 = dp, zero1
        # ZeRO over the whole DP group: the grads are reduce-scattered into the shards
        self.reduce_scatter = 1 < zero1.size == dp.size
        self.missing: list[int] | None = None  # gradients still expected per bucket while armed
        self.launched: dict[int, Any] = {}  # bucket index -> work handle (None: nothing to wait for)
        self.clean = True  # the buffers are known to be zero (zero() can skip the memset)
        self._hooks = [self._register_hook(p, view, i) for i, b in enumerate(self.buckets)
                       for p, view in zip(b.params, b.grad_views)]
        for b in self.buckets:  # the linears' backward adds into the fp32 views itself (tessera.parallel.wgrad)
            for p, view in zip(b.params, b.grad_views):
                attach_main_grad(p, view if fuse_wgrad and view.dtype == torch.float32 and is_fusable(p) else None)

    # ------------------------------------------------------------------ accumulation
    def _register_hook(self, p: nn.Parameter, view: torch.Tensor, bucket: int) -> Any:
        def accumulate(param: torch.Tensor) -> None:
            grad = param.grad
            if grad is None:
                return
            if grad.is_sparse:
                raise TypeError("HybridZeroOptimizer: sparse gradients are not supported")
            self.check_open(bucket)
            if not take_added(param):  # else the backward's GEMM already added it (the grad is a placeholder)
                view.add_(grad)
            param.grad = None
            self.clean = False
            self.arrived(bucket)

        return p.register_post_accumulate_grad_hook(accumulate)

    def main_grad(self, param: torch.Tensor) -> torch.Tensor:
        """The main-grad view of ``param``; writing to it counts as a gradient (``zero`` clears it)."""
        self.clean = False
        for b in self.buckets:
            for p, view in zip(b.params, b.grad_views):
                if p is param:
                    return view
        raise KeyError("get_main_grad: the parameter is not managed by this optimizer")

    def zero(self) -> None:
        """Drop reductions no step consumed and zero the buffers (skipped when known to be zero)."""
        self.cancel()
        if not self.clean:
            for buf in self.flat_buffers.values():
                buf.zero_()
            self.clean = True

    # ------------------------------------------------------------------ DP reduction
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
        """Wait for the buckets launched during backward; reduce the others now. The buffers then hold
        reduced (and, in the step, unscaled) sums: no longer zero."""
        self.clean = False
        launched, self.launched = self.launched, {}
        if not launched and not self.reduce_scatter:
            for buf in self.flat_buffers.values():  # one collective per dtype (and the fast node-local route)
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
