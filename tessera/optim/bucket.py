"""One bucket: the parameters of one inner param group and one storage dtype, in flat padded buffers.

A bucket owns the parameters' storage (``param_flat``, model dtype: the parameters' ``.data`` are views
of it, so the updated shards are all-gathered in place), a slice of the main-gradient buffer
(``grad_flat``, fp32 by default, filled by the post-accumulate-grad hooks of ``buffers``) and the master
slice this ZERO1 rank updates: fp32, or a view of ``param_flat`` for fp32 parameters (their own masters)
and for bf16 parameters under bf16 masters (which share the weights' storage).
Every buffer is padded to a multiple of the ZERO1 size so each rank's shard has the same length.

The bucket also translates between its flat shard and per-parameter tensors, which is what the
optimizer's state dicts are made of: it is the one place that knows the layout (offsets, shard range).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tessera.optim.groups import GroupComm
from tessera.optim.state_format import ShardSource

__all__ = ["Bucket", "split_reversed"]


class Bucket:
    """Parameters of one inner param group and one storage dtype, in flat padded buffers."""

    def __init__(self, params: list[nn.Parameter], names: list[str], grad_flat: torch.Tensor, zero1: GroupComm,
                 master_dtype: torch.dtype = torch.float32) -> None:
        self.params = params
        self.names = names
        self.zero1 = zero1
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

    # ------------------------------------------------------------------ layout
    @staticmethod
    def shard_size(numel: int, d: int) -> int:
        return max(1, math.ceil(numel / d))

    @property
    def grad_shard(self) -> torch.Tensor:
        """This rank's shard of the main grads (what the update consumes)."""
        return self.grad_flat[self.lo : self.hi]

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

    def full_from(self, tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """A padded flat buffer built from per-parameter tensors (used when loading)."""
        flat = torch.zeros(self.padded, dtype=dtype, device=self.param_flat.device)
        for t, off, n in zip(tensors, self.offsets, self.numels):
            flat[off : off + n].copy_(t.reshape(-1))
        return flat

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter tensors (parameter shapes) cut out of a padded flat buffer."""
        return [flat[off : off + n].view(p.shape).clone() for p, off, n in zip(self.params, self.offsets, self.numels)]

    def publish_masters(self) -> None:
        """Masters -> parameters: round this rank's masters into ``param_flat`` (unless they are its
        storage), then all-gather every rank's shard over ZERO1. A collective."""
        if not self.own_masters:
            self.param_flat[self.lo : self.hi].copy_(self.master)
        self.zero1.all_gather_flat(self.param_flat)

    # ------------------------------------------------------------------ full (layout-free) state
    def full_masters(self) -> list[torch.Tensor]:
        """fp32 masters of every parameter, parameter shapes (a collective over ZERO1 unless own masters)."""
        full = self.param_flat.float() if self.own_masters else self.zero1.gather_full(self.master)
        return self.split(full)

    def full_states(self, inner: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The inner optimizer's state of this bucket per parameter: sharded tensors gathered over ZERO1
        and cut to parameter shapes, anything else (``step``) copied to every parameter."""
        per_param: list[dict[str, Any]] = [{} for _ in self.params]
        for key, value in inner.items():
            if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == self.shard:
                for d, t in zip(per_param, self.split(self.zero1.gather_full(value))):
                    d[key] = t
            else:
                for d in per_param:
                    d[key] = value.detach().clone() if isinstance(value, torch.Tensor) else value
        return per_param

    def load_full_masters(self, tensors: list[torch.Tensor]) -> None:
        """Set masters and parameters from full fp32 per-parameter masters (no collective)."""
        full = self.full_from(tensors, torch.float32)
        self.param_flat.copy_(full)
        if not self.own_masters:
            self.master.copy_(full[self.lo : self.hi])

    def shard_state_from_full(self, states: list[Mapping[str, Any]], group: Mapping[str, Any]) -> dict[str, Any]:
        """This rank's inner state from full per-parameter states (as ``full_states`` returns them)."""
        first, p0 = states[0], self.params[0]
        new_state: dict[str, Any] = {}
        for key, value in first.items():
            if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(p0.shape) and (
                value.dim() > 0 or p0.dim() == 0
            ) and key != "step":
                flat = self.full_from([s[key] for s in states], value.dtype)  # as saved (fp32 / bf16)
                new_state[key] = flat[self.lo : self.hi].clone()
            else:
                new_state[key] = self._replicated(key, value, group)
        return new_state

    # ------------------------------------------------------------------ this rank's shard only
    def shard_record(self, group: Mapping[str, Any], inner: Mapping[str, Any]) -> dict[str, Any]:
        """This shard as ``shard_state_dict`` lists it: views of the live buffers, no copy."""
        return {
            "group": {k: v for k, v in group.items() if k != "params"},
            "names": list(self.names), "shapes": [list(p.shape) for p in self.params], "offsets": list(self.offsets),
            "lo": self.lo, "hi": self.hi, "master": self.master.detach(),
            "state": {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in inner.items()},
        }

    def load_master_shard(self, source: ShardSource, *, publish: bool = True) -> None:
        """Read this rank's element ranges of the masters, then rebuild the parameters (a collective;
        ``publish=False`` leaves that to a later ``publish_masters``)."""
        for i, a, z in self.shard_pieces():
            at = self.offsets[i] + a - self.lo
            self.master[at : at + z - a].copy_(source.read(self.names[i], "master", a, z))
        if publish:
            self.publish_masters()

    def shard_state_from(self, source: ShardSource, group: Mapping[str, Any]) -> dict[str, Any] | None:
        """This rank's inner state read from ``source`` (None when nothing was saved for the bucket)."""
        sharded, replicated = source.state_keys(self.names[0])
        if not (sharded or replicated):
            return None
        pieces = self.shard_pieces()  # (parameter index, start, stop): param-local ranges this rank owns
        new_state: dict[str, Any] = {}
        for key in sharded:
            flat = None
            for i, a, z in pieces:
                at = self.offsets[i] + a - self.lo
                piece = source.read(self.names[i], key, a, z)
                if flat is None:  # the dtype it was saved in (fp32 or bf16 moments)
                    flat = torch.zeros(self.shard, dtype=piece.dtype, device=self.master.device)
                flat[at : at + z - a].copy_(piece)
            new_state[key] = flat if flat is not None else torch.zeros_like(self.master)
        for key, value in replicated.items():
            new_state[key] = self._replicated(key, value, group)
        return new_state

    def _replicated(self, key: str, value: Any, group: Mapping[str, Any]) -> Any:
        """A state entry every parameter shares (``step``), copied to where torch expects it."""
        if not isinstance(value, torch.Tensor):
            return value
        # torch keeps "step" on the CPU unless the group is capturable / fused
        on_device = key != "step" or group.get("capturable") or group.get("fused")
        return value.detach().clone().to(self.master.device if on_device else value.device)


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
