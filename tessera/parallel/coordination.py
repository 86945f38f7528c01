"""Run coordination: the small agreements every rank of a run takes part in, so all ranks act together.

A verdict every rank must act on (stop, fall back, report an error) is agreed here: a few Python numbers
reduced over a group (``reduce_scalars``), a flag every rank must hold (``all_agree``), every rank's error
text (``agree_on_errors``, ``share_texts``), and long work on rank 0 while the others keep meeting in
small agreements (``on_rank0_while_others_wait``). None of it is autograd: the tensor-parallel collectives
of the model are ``tessera.parallel.comm``, whose ``all_reduce`` (and its fast routes) these use.

Every flag, count and text travels on the device the group's backend serves (``collective_device``: NCCL
refuses CPU tensors); without a process group every function answers for this one rank.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from tessera.parallel.comm import all_reduce

__all__ = [
    "collective_device",
    "reduce_scalars",
    "agree_on_errors",
    "all_agree",
    "share_texts",
    "on_rank0_while_others_wait",
]

T = TypeVar("T")


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
