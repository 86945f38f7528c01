"""Autograd-aware collectives over an explicit tensor-parallel process group.

Why explicit groups: leaf layers must not read global state, so every function takes ``group``. A
``None`` group or a group of one rank is the identity (no communication, no autograd node), so the
same layer code runs unchanged in a plain single process.

The four region functions are the conjugate pairs of Megatron-style tensor parallelism:

==================  ===========================  ===========================
function            forward                      backward
==================  ===========================  ===========================
copy_to_region      identity                     all-reduce (sum)
reduce_from_region  all-reduce (sum)             identity
gather_from_region  all-gather along last dim    keep this rank's slice
scatter_to_region   keep this rank's slice       all-gather along last dim
==================  ===========================  ===========================

``MetaGroup`` stands in for a group when only shapes matter (meta-device builds, summaries).

Run coordination (the flags, counts and error texts every rank agrees on: ``reduce_scalars``, ``all_agree``,
``agree_on_errors``, ``share_texts``) is not autograd and lives in ``tessera.parallel.coordination``.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

__all__ = [
    "MetaGroup",
    "group_size",
    "group_rank",
    "copy_to_region",
    "reduce_from_region",
    "gather_from_region",
    "scatter_to_region",
    "all_reduce",
    "gather_tensor",
    "use_fast_collectives",
    "fast_collectives_for",
    "to_host",
]


@dataclass(frozen=True)
class MetaGroup:
    """A stand-in for a process group of ``size`` ranks, as seen from ``rank``; it cannot communicate.

    Layers built with it get the shard shapes of a real TP run, which is all a meta-device build
    (parameter counts, per-rank shapes) needs. A collective on a real tensor raises; on a meta tensor
    it only propagates shapes.
    """

    size: int
    rank: int = 0

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"MetaGroup(size={self.size}, rank={self.rank}): need size >= 1 and 0 <= rank < size")


def group_size(group: Any) -> int:
    """Number of ranks in ``group`` (1 for None)."""
    if group is None:
        return 1
    if isinstance(group, MetaGroup):
        return group.size
    return dist.get_world_size(group)


def group_rank(group: Any) -> int:
    """This process's index inside ``group`` (0 for None)."""
    if group is None:
        return 0
    if isinstance(group, MetaGroup):
        return group.rank
    return dist.get_rank(group)


def _check_can_communicate(x: torch.Tensor, group: Any) -> bool:
    """True when a real collective must run; False for a shape-only (meta) call."""
    if isinstance(group, MetaGroup):
        if x.is_meta:
            return False
        raise RuntimeError(
            f"a collective was called on a real tensor with {group}: a MetaGroup only describes shard shapes"
        )
    return True


# group -> an object with ``supports(x, op)``, ``all_reduce(x, op)`` and ``all_gather(x)`` used instead of
# torch.distributed for CPU tensors (the shared-memory collectives of ``tessera.parallel.shm_comm`` for
# node-local CPU groups). Weak keys: a destroyed group drops its route with it.
_FAST_ROUTES: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


# the routes in use, by the number each got when registered: a compiled graph names its route by that number
# (graph ops take ints, not Python objects). A counter, not ``id()``: a number is never handed out twice, so a
# graph traced before a route was replaced can never reach another object that reused its address.
_ROUTES: dict[int, Any] = {}
_ROUTE_NUMBERS = itertools.count(1)
_NUMBER = "_tessera_route_number"  # the attribute a registered route carries its number in
# pairs, not a dict keyed by ReduceOp: traced code looks names up here, and Dynamo before torch 2.12 can neither
# hash nor compare a ReduceOp (a graph break at every collective); identity it traces
_OP_NAMES: tuple[tuple[Any, str], ...] = ((dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.MAX, "max"),
                                          (dist.ReduceOp.MIN, "min"))


def _op_name(op: Any) -> str:
    for red, name in _OP_NAMES:
        if op is red:
            return name
    raise ValueError(f"no fast-collective route reduces with {op}")


def use_fast_collectives(group: dist.ProcessGroup | None, impl: Any | None) -> None:
    """Route this module's all-reduces and all-gathers of CPU tensors over ``group`` through ``impl``
    (``None`` removes the route)."""
    old = _FAST_ROUTES.pop(group, None)
    if old is not None:
        _ROUTES.pop(getattr(old, _NUMBER, 0), None)
    if impl is not None:
        _FAST_ROUTES[group] = impl
        number = next(_ROUTE_NUMBERS)
        setattr(impl, _NUMBER, number)
        _ROUTES[number] = impl


def fast_collectives_for(group: Any) -> Any | None:
    try:
        return _FAST_ROUTES.get(group)
    except TypeError:  # a group object that cannot be weakly referenced has no route
        return None


@torch.library.custom_op("tessera::routed_all_reduce", mutates_args=())
def routed_all_reduce(x: torch.Tensor, route: int, op: str) -> torch.Tensor:
    """A copy of ``x`` reduced over the group of fast route number ``route`` (``use_fast_collectives``).

    The route is plain Python; as one opaque op it stays inside a ``torch.compile`` graph (``model.compile``)
    instead of breaking it, and compiled blocks keep the route that eager ones use.
    """
    out = x.clone(memory_format=torch.contiguous_format)
    return _ROUTES[route].all_reduce(out, next(red for red, name in _OP_NAMES if name == op))


@routed_all_reduce.register_fake
def _routed_all_reduce_shape(x: torch.Tensor, route: int, op: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("tessera::routed_all_gather", mutates_args=())
def routed_all_gather(x: torch.Tensor, route: int, size: int) -> torch.Tensor:
    """``[size, *x.shape]``: every rank's ``x`` over the group of fast route ``route``, stacked in rank order
    (one graph op under ``torch.compile``, as ``routed_all_reduce``)."""
    return _ROUTES[route].all_gather(x)


@routed_all_gather.register_fake
def _routed_all_gather_shape(x: torch.Tensor, route: int, size: int) -> torch.Tensor:
    return x.new_empty((size, *x.shape))


def all_reduce(x: torch.Tensor, group: Any,
               op: dist.ReduceOp | dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce of ``x`` over ``group`` (no autograd); the identity for a 1-rank group."""
    if group_size(group) > 1 and _check_can_communicate(x, group):
        fast = fast_collectives_for(group)
        if fast is not None and fast.supports(x, op):
            if torch.compiler.is_compiling():  # traced: the route as one graph op
                x.copy_(routed_all_reduce(x, getattr(fast, _NUMBER), _op_name(op)))
            else:
                fast.all_reduce(x, op)
        else:
            dist.all_reduce(x, op=op, group=group)
    return x


def to_host(t: torch.Tensor) -> Any:
    """``t.tolist()`` (nested lists; a number for a 0-dim tensor): the one place device values are read
    back to Python.

    A fake or meta tensor (dry runs of a real-size config without a GPU) has no values; it reads as
    zeros, so control flow continues down the normal (no overflow, no stop) path.
    """
    from torch._subclasses.fake_tensor import is_fake

    if t.is_meta or is_fake(t):
        zero: Any = 0.0 if t.is_floating_point() else (False if t.dtype == torch.bool else 0)
        for n in reversed(t.shape):  # nested lists of zeros, built without torch (the fake mode is active)
            zero = [zero] * n if not isinstance(zero, list) else [list(zero) for _ in range(n)]
        return zero
    return t.tolist()


def _all_reduce_copy(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The sum of ``x`` over ``group`` in a new tensor (``x`` may be saved by another autograd node, or a leaf).

    Traced by ``torch.compile``, one out-of-place collective, not an in-place one into a copy: an autograd
    Function's forward that returns a tensor it wrote in place gets zero input gradients under torch 2.11
    (``tests/test_traced_function_outputs.py``), and the copy is one pass fewer."""
    if torch.compiler.is_compiling() and group_size(group) > 1 and _check_can_communicate(x, group):
        fast = fast_collectives_for(group)
        if fast is not None and fast.supports(x, dist.ReduceOp.SUM):
            return routed_all_reduce(x, getattr(fast, _NUMBER), "sum")
        return funcol.all_reduce(x, "sum", group)
    return all_reduce(x.contiguous().clone(), group)


def _split_last(x: torch.Tensor, group: Any) -> torch.Tensor:
    size, rank = group_size(group), group_rank(group)
    last = x.shape[-1]
    if last % size:
        raise ValueError(f"last dimension {last} is not divisible by tensor-parallel size {size}")
    return x.narrow(-1, rank * (last // size), last // size).contiguous()


def gather_tensor(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """All-gather ``x`` along ``dim`` in rank order (no autograd); useful for tests, export, checkpoints."""
    size = group_size(group)
    if size == 1:
        return x
    if not _check_can_communicate(x, group):
        shape = list(x.shape)
        shape[dim] *= size
        return torch.empty(shape, dtype=x.dtype, device=x.device)
    x = x.contiguous()
    fast = fast_collectives_for(group)
    if fast is not None and x.device.type == "cpu":
        if torch.compiler.is_compiling():
            stacked = routed_all_gather(x, getattr(fast, _NUMBER), size)
        else:
            stacked = fast.all_gather(x)
        dim %= x.dim()  # [size, ..., n_dim, ...] -> [..., size * n_dim, ...], rank-major
        return stacked.movedim(0, dim).flatten(dim, dim + 1)
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce_copy(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        return _all_reduce_copy(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return gather_tensor(x, -1, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _split_last(grad, ctx.group), None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return gather_tensor(grad, -1, ctx.group), None


def copy_to_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Enter a TP region with a replicated input: identity forward, all-reduce of the gradient backward."""
    return x if group_size(group) == 1 else _CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Leave a TP region by summing partial results: all-reduce forward, identity backward."""
    return x if group_size(group) == 1 else _ReduceFromRegion.apply(x, group)


def gather_from_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Concatenate the ranks' last-dim shards (rank order); backward keeps this rank's slice."""
    return x if group_size(group) == 1 else _GatherFromRegion.apply(x, group)


def scatter_to_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Keep this rank's slice of the last dim; backward all-gathers the gradient."""
    return x if group_size(group) == 1 else _ScatterToRegion.apply(x, group)
