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
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

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
    "collective_device",
    "to_host",
    "reduce_scalars",
    "agree_on_errors",
    "all_agree",
    "share_texts",
    "on_rank0_while_others_wait",
]

T = TypeVar("T")


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


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device whose tensors ``group``'s backend accepts (``None``: the default group).

    NCCL serves CUDA tensors only (``No backend type associated with device type cpu``), so a flag
    or count reduced over an NCCL group must live on the GPU; a group that serves the CPU (gloo, or
    a ``cpu:gloo,cuda:nccl`` group) takes it on the CPU, where no device sync is needed.
    """
    pg = group if group is not None else dist.group.WORLD
    kinds = {d.type for d in getattr(pg, "_device_types", ())}
    if not kinds:  # a torch without per-group device types: infer from the backend name
        kinds = {"cpu"} if "gloo" in str(dist.get_backend(pg)) else {"cuda"}
    return torch.device("cpu") if "cpu" in kinds else torch.device(sorted(kinds)[0])


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


def reduce_scalars(values: Sequence[float], group: dist.ProcessGroup | None,
                   op: dist.ReduceOp | dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                   device: torch.device | None = None, dtype: torch.dtype = torch.float64) -> list[Any]:
    """All-reduce a few Python numbers over ``group`` (``None``: the default group) and return them.

    The tensor is built on ``device`` (default: the group's :func:`collective_device`), so counts,
    flags and loss sums obey the backend's device rule like every other collective. Without an
    initialized process group the values come back unchanged, and so they do from a fake
    reduction (a dry run: every simulated rank is taken to hold what this one holds).
    """
    from torch._subclasses.fake_tensor import is_fake

    t = torch.tensor(values, dtype=dtype, device=device or (collective_device(group) if dist.is_initialized()
                                                              else torch.device("cpu")))
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        all_reduce(t, group if group is not None else dist.group.WORLD, op)
    return list(values) if t.is_meta or is_fake(t) else t.tolist()


def agree_on_errors(error: str | None, group: Any = None) -> list[str]:
    """Every rank's error text over ``group``, the same list on every rank; ``[]`` when no rank has one.

    One flag reduced (the success path); only when a rank failed, the texts (``share_texts``). For a
    verdict that every rank must act on together: stop, fall back, report.
    """
    failed = reduce_scalars([0 if error is None else 1], group, op=dist.ReduceOp.MAX, dtype=torch.int32)[0]
    return share_texts(error, group) if failed else []


def all_agree(ok: bool, group: Any = None) -> bool:
    """True only when ``ok`` holds on every rank of ``group`` (so all ranks take the same branch). A collective;
    without a process group, ``ok``."""
    if not dist.is_initialized():
        return ok
    # on the device the group's backend serves: NCCL refuses a CPU flag
    return bool(reduce_scalars([1 if ok else 0], group, op=dist.ReduceOp.MIN, dtype=torch.int32)[0])


def on_rank0_while_others_wait(is_rank0: bool, work: Callable[[], T], *, round_s: float = 2.0,
                               timeout_s: float | None = None, name: str = "tessera-rank0-work") -> T | None:
    """``work()`` on rank 0, in a thread, while every rank meets in a small agreement every ``round_s``: work
    that takes longer than the process group's timeout never times out the waiting ranks' collective. Returns
    rank 0's result there (its exception raised again there), None elsewhere.

    ``timeout_s``: when rank 0's work still runs after that long, every rank raises ``TimeoutError`` together
    (the thread is left running, a daemon: the caller is expected to stop the process)."""
    result: list[T | None] = [None]
    raised: list[BaseException] = []
    thread = None
    if is_rank0:
        def run() -> None:
            try:
                result[0] = work()
            except BaseException as e:  # noqa: BLE001 -- raised again below, in the caller's thread
                raised.append(e)
        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
    start = time.monotonic()
    late = False
    while True:
        if thread is not None:
            thread.join(round_s)
            late = thread.is_alive() and timeout_s is not None and time.monotonic() - start > timeout_s
        if all_agree(thread is None or not thread.is_alive() or late):
            break
    if timeout_s is not None and not all_agree(not late):
        raise TimeoutError(f"rank 0's work is still running after {timeout_s:g} s")
    if raised:
        raise raised[0]
    return result[0]


_TEXT_BYTES = 2000  # the most of one rank's text (UTF-8) that ``share_texts`` carries


def share_texts(text: str | None, group: Any = None) -> list[str]:
    """The texts of the ranks of ``group`` that have one, on every rank: ``"rank 1: ..."``, ranks with the
    same text named once (``"ranks 0,2: ..."``), a text every rank has without ranks. A collective.

    Two ``reduce_scalars`` (so on the device the backend serves): the texts' lengths, then their bytes,
    every rank filling only its own slots. An empty text counts (as "failed without a message"); without
    a process group this rank's own text comes back, as it does from a fake reduction (dry run).
    """
    data = b"" if text is None else (text or "failed without a message").encode("utf-8")[:_TEXT_BYTES]
    if not dist.is_initialized():
        return [data.decode("utf-8", errors="replace")] if text is not None else []
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    lengths = [0] * world
    lengths[rank] = len(data)
    lengths = [int(n) for n in reduce_scalars(lengths, group, dtype=torch.int32)]
    start = sum(lengths[:rank])
    buf = [0] * sum(lengths)
    buf[start:start + len(data)] = data
    got = bytes(int(b) for b in reduce_scalars(buf, group, dtype=torch.uint8)) if buf else b""
    by_text: dict[str, list[int]] = {}
    at = 0
    for r, n in enumerate(lengths):
        if n:
            by_text.setdefault(got[at:at + n].decode("utf-8", errors="replace"), []).append(r)
        at += n
    return [t if len(ranks) == world else f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}: {t}"
            for t, ranks in by_text.items()]


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
