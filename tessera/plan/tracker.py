"""Live tensor bytes and collective traffic, counted the same way on real and on meta tensors.

``LiveBytes`` sees every tensor an operator returns (a ``TorchDispatchMode``) and counts each storage
an operator creates once while it is alive, by the storage's identity, never its address: meta tensors
have no address, and the dry run must count them exactly like the real CPU step it is calibrated
against. A view or in-place result of an operator's input is not an allocation and is not counted: a
storage first met that way was made outside the block (``track`` it) or inside a backend (gloo's
reduce-scatter splits its private full-size copy of the input on the caller's thread when the work
is waited on, and that copy lives as long as gloo's worker thread keeps it, a matter of timing; NCCL
makes no such copy).
``CollectiveTraffic`` sees every c10d operator and adds the bytes a ring algorithm sends per rank
(``ring_bytes``, the one ring formula of the plan's closed forms and of the benchmarks), keyed by the
name of the group it ran on, and the largest communication buffer: the bytes of a
collective's tensors that are not persistent state (gradient reductions and weight gathers work in
place in the persistent buffers; TP collectives work on activation-sized buffers of their own).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveBytes", "CollectiveTraffic", "ring_bytes", "storage_key"]


def storage_key(t: torch.Tensor) -> int:
    """Identity of ``t``'s storage (the same for every view of it), valid on any device, meta included."""
    return t.untyped_storage()._cdata


def _storage_keys(tree: Any) -> set[int]:
    keys = set()
    for t in tree_leaves(tree):
        if isinstance(t, torch.Tensor):
            try:
                keys.add(storage_key(t))
            except (RuntimeError, NotImplementedError):
                pass
    return keys


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages created inside the block that are still alive, and their peak.

    Storages made before the block are not counted; ``mark`` records the current figure under a name,
    ``reset_peak`` starts a new phase.
    """

    def __init__(self, device_type: str | None = None) -> None:
        super().__init__()
        self.device_type = device_type  # count only storages on this kind of device (None: all)
        self.current = 0
        self.peak = 0
        self._live: dict[int, int] = {}
        self.marks: dict[str, int] = {}

    def _add(self, t: torch.Tensor) -> None:
        if self.device_type is not None and t.device.type != self.device_type:
            return
        st = t.untyped_storage()
        key = st._cdata
        if key in self._live:
            return
        n = st.nbytes()
        self._live[key] = n
        self.current += n
        self.peak = max(self.peak, self.current)
        weakref.finalize(st, self._drop, key)

    def _drop(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def reset_peak(self) -> None:
        self.peak = self.current

    def live_storages(self) -> set[int]:
        """Identities (``storage_key``) of the storages counted as alive now."""
        return set(self._live)

    def mark(self, name: str) -> int:
        self.marks[name] = self.current
        return self.current

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = _storage_keys((args, kwargs))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                try:
                    if storage_key(t) not in inputs:  # an allocation, not a view or an in-place result
                        self._add(t)
                except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, nested)
                    pass
        return out


def ring_bytes(kind: str, numel_bytes: float, world: int) -> float:
    """Bytes one rank sends for a collective over ``world`` ranks (ring algorithms); ``numel_bytes`` is
    the full tensor (all-reduce, all-gather output, reduce-scatter input, broadcast)."""
    if world <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (world - 1) / world * numel_bytes
    if kind in ("all_gather", "reduce_scatter"):
        return (world - 1) / world * numel_bytes
    return numel_bytes  # broadcast, send/recv: the payload


def _nbytes(t: Any) -> int:
    ts = [x for x in tree_leaves(t) if isinstance(x, torch.Tensor)]
    return sum(x.numel() * x.element_size() for x in ts)


# c10d operator -> (kind, bytes of the full tensor from the op's arguments)
_C10D: dict[str, tuple[str, Callable[[tuple], int]]] = {
    "allreduce_": ("all_reduce", lambda a: _nbytes(a[0])),
    "allreduce_coalesced_": ("all_reduce", lambda a: _nbytes(a[0])),
    "_allgather_base_": ("all_gather", lambda a: _nbytes(a[0])),
    "allgather_": ("all_gather", lambda a: _nbytes(a[0])),
    "allgather_into_tensor_coalesced_": ("all_gather", lambda a: _nbytes(a[0])),
    "_reduce_scatter_base_": ("reduce_scatter", lambda a: _nbytes(a[1])),
    "reduce_scatter_": ("reduce_scatter", lambda a: _nbytes(a[1])),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", lambda a: _nbytes(a[1])),
    "broadcast_": ("broadcast", lambda a: _nbytes(a[0])),
}


def _buffer_bytes(args: tuple, persistent: set[int]) -> int:
    """Bytes of the distinct storages a collective works on, outside ``persistent``."""
    seen: dict[int, int] = {}
    for t in tree_leaves(args):
        if isinstance(t, torch.Tensor):
            key = storage_key(t)
            if key not in persistent:
                seen[key] = t.untyped_storage().nbytes()
    return sum(seen.values())


class CollectiveTraffic(TorchDispatchMode):
    """Per-rank bytes sent by each group's collectives inside the block: ``{group_name: {kind: bytes,
    kind + "_calls": n}}``; ``name_of`` maps a process group's name to a readable one (TENSOR, DATA...).
    ``largest_buffer``: the most bytes one collective worked on outside the storages in ``persistent``
    (set it to the persistent state's storages before the block)."""

    def __init__(self, name_of: Callable[[str], str] | None = None) -> None:
        super().__init__()
        self.sent: dict[str, dict[str, float]] = {}
        self._name_of = name_of or (lambda n: n)
        self.persistent: set[int] = set()
        self.largest_buffer = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func.namespace == "c10d":
            op = func._schema.name.split("::")[-1]
            if op in _C10D:
                kind, size_of = _C10D[op]
                pg = next((dist.ProcessGroup.unbox(a) for a in args
                           if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type())), None)
                if pg is not None and pg.size() > 1:
                    entry = self.sent.setdefault(self._name_of(pg.group_name), {})
                    entry[kind] = entry.get(kind, 0.0) + ring_bytes(kind, size_of(args), pg.size())
                    entry[kind + "_calls"] = entry.get(kind + "_calls", 0) + 1
                    self.largest_buffer = max(self.largest_buffer, _buffer_bytes(args, self.persistent))
        return func(*args, **(kwargs or {}))

    def by_kind(self) -> dict[str, float]:
        """``sent`` summed over the groups: ``{kind: bytes, kind + "_calls": n}``."""
        out: dict[str, float] = {}
        for kinds in self.sent.values():
            for kind, value in kinds.items():
                out[kind] = out.get(kind, 0) + value
        return out
