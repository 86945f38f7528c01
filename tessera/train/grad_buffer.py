"""The flat buffers behind HybridZeroOptimizer: the groups it talks to, and one bucket per (group, dtype).

A bucket owns the parameters' storage (``param_flat``, model dtype: the parameters' ``.data`` are views
of it, so the updated shards are all-gathered in place), a slice of the main-gradient buffer
(``grad_flat``, fp32 by default, filled by the post-accumulate-grad hooks) and the master slice this
ZERO1 rank updates: fp32, or a view of ``param_flat`` for fp32 parameters (their own masters) and for
bf16 parameters under bf16 masters (which share the weights' storage).
Every buffer is padded to a multiple of the ZERO1 size so each rank's shard has the same length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn

from tessera.parallel.comm import all_reduce as comm_all_reduce

__all__ = ["GroupComm", "Bucket", "param_name_map", "split_reversed"]


def _reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: Any, async_op: bool = False) -> Any:
    # torch 2.13 renamed reduce_scatter_tensor (now deprecated) to reduce_scatter_single
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, group=group, async_op=async_op)


def _all_gather(output: torch.Tensor, input: torch.Tensor, group: Any) -> Any:
    # torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group)


@dataclass
class GroupComm:
    """A process group with its size and this process's rank (size 1 = no communication)."""

    group: Any
    size: int
    rank: int

    @classmethod
    def of(cls, group: Any, what: str) -> "GroupComm":
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


class Bucket:
    """Parameters of one inner param group and one storage dtype, in flat padded buffers."""

    def __init__(self, params: list[nn.Parameter], names: list[str], grad_flat: torch.Tensor, zero1: GroupComm,
                 master_dtype: torch.dtype = torch.float32) -> None:
        self.params = params
        self.names = names
        self.dtype = params[0].dtype
        # fp32 parameters, and parameters kept in the master dtype (bf16 masters), are their own masters
        self.own_masters = self.dtype in (torch.float32, master_dtype)
        self.numels = [p.numel() for p in params]
        self.offsets = [0]
        for n in self.numels[:-1]:
            self.offsets.append(self.offsets[-1] + n)
        self.numel = sum(self.numels)
        self.shard = self.shard_size(self.numel, zero1.size)
        self.padded = self.shard * zero1.size
        if grad_flat.numel() != self.padded:
            raise AssertionError("internal: main-grad slice of the wrong size")
        self.lo, self.hi = zero1.rank * self.shard, (zero1.rank + 1) * self.shard
        device = params[0].device
        with torch.no_grad():
            self.param_flat = torch.zeros(self.padded, dtype=self.dtype, device=device)
            for p, off, n in zip(params, self.offsets, self.numels):
                self.param_flat[off : off + n].copy_(p.data.reshape(-1))
                p.data = self.param_flat[off : off + n].view(p.shape)
            self.grad_flat = grad_flat  # a slice of one buffer shared by all buckets of its dtype
            self.grad_views = [self.grad_flat[off : off + n].view(p.shape) for p, off, n in
                               zip(params, self.offsets, self.numels)]
            if self.own_masters:
                self.master = self.param_flat[self.lo : self.hi].detach()
            else:
                self.master = self.param_flat[self.lo : self.hi].detach().float()

    def shard_segments(self, counted: list[bool]) -> list[tuple[int, int]]:
        """``[start, end)`` ranges of ``grad_flat`` inside this rank's shard that belong to a counted
        parameter (the pieces of each parameter this rank updates; padding is never counted)."""
        out = []
        for off, n, keep in zip(self.offsets, self.numels, counted):
            a, z = max(off, self.lo), min(off + n, self.hi)
            if keep and a < z:
                out.append((a, z))
        return out

    def shard_pieces(self) -> list[tuple[int, int, int]]:
        """``(parameter index, start, stop)``: the element range of each parameter (flattened, its own
        indexing) that lies in this rank's shard ``[lo, hi)``."""
        out = []
        for i, (off, n) in enumerate(zip(self.offsets, self.numels)):
            a, z = max(off, self.lo), min(off + n, self.hi)
            if a < z:
                out.append((i, a - off, z - off))
        return out

    @staticmethod
    def shard_size(numel: int, d: int) -> int:
        return max(1, math.ceil(numel / d))

    def full_from(self, tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """A padded flat buffer built from per-parameter tensors (used when loading)."""
        flat = torch.zeros(self.padded, dtype=dtype, device=self.param_flat.device)
        for t, off, n in zip(tensors, self.offsets, self.numels):
            flat[off : off + n].copy_(t.reshape(-1))
        return flat

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter tensors (parameter shapes) cut out of a padded flat buffer."""
        return [flat[off : off + n].view(p.shape).clone() for p, off, n in zip(self.params, self.offsets, self.numels)]


def param_name_map(param_names: Any, params: list[nn.Parameter]) -> dict[int, str]:
    """id(param) -> name from a Module, a {Parameter: name} mapping or (name, Parameter) pairs."""
    if param_names is None:
        return {id(p): f"param_{i}" for i, p in enumerate(params)}
    if isinstance(param_names, nn.Module):
        pairs = list(getattr(param_names, "model", param_names).named_parameters())  # NaiveAMPModel keeps .model
    elif isinstance(param_names, Mapping):
        items = list(param_names.items())
        pairs = [(v, k) if isinstance(k, torch.Tensor) else (k, v) for k, v in items]
    else:
        pairs = list(param_names)
    out: dict[int, str] = {}
    for name, p in pairs:
        if not isinstance(name, str) or not isinstance(p, torch.Tensor):
            raise TypeError("param_names: expected a Module, {Parameter: name} or (name, Parameter) pairs")
        out[id(p)] = name
    missing = [i for i, p in enumerate(params) if id(p) not in out]
    if missing:
        raise ValueError(
            f"param_names: {len(missing)} optimized parameter(s) have no name (e.g. index {missing[0]} with "
            f"shape {tuple(params[missing[0]].shape)}); pass the unwrapped model's named_parameters()"
        )
    names = [out[id(p)] for p in params]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"param_names: duplicate names {dup[:5]}")
    return out


def split_reversed(params: list[nn.Parameter], max_numel: int) -> list[list[nn.Parameter]]:
    """``params`` in reverse order, cut into runs of at most ``max_numel`` elements (a larger parameter
    is a bucket of its own)."""
    chunks: list[list[nn.Parameter]] = []
    size = 0
    for p in reversed(params):
        if not chunks or size + p.numel() > max_numel:
            chunks.append([])
            size = 0
        chunks[-1].append(p)
        size += p.numel()
    return chunks
