"""All-reduce and all-gather through shared memory for a CPU process group whose ranks share one machine.

Why: tensor parallelism all-reduces activations twice per layer forward and twice backward (mtp), or
all-gathers and reduce-scatters them (msp). On CPU the gloo backend hands each collective to worker
threads and sockets, a fixed cost per call whatever the size that a small model's step pays dozens of
times (BENCHMARKS.md §15 measures the step with and without it). Ranks on one machine can instead write
their tensor into a shared segment and each read all slots itself: a little synchronisation plus one copy in
and one pass over the slots.

Protocol (collective number ``k``, counting from 1; every rank calls the same collectives in the same
order, as with any process group):

1. wait until every rank has finished reading buffer ``k % 2`` for collective ``k - 2``;
2. copy the local tensor into this rank's slot of that buffer, then publish ``ready[me] = k``;
3. wait until ``ready[r] >= k`` for every rank ``r``;
4. read the slots: an all-reduce reduces them in rank order 0, 1, ... into the output (the same order on
   every rank, so every rank gets bitwise the same result), an all-gather copies each slot to its rank's
   place in the output; then publish ``done[me] = k``.

Tensors larger than a slot go through in slot-sized chunks, one collective each. Waiting spins and
yields the core. A waiting rank checks every 50 ms that the ranks it waits for still exist (their
process ids are in the segment): a peer that exited is an error at once, naming it, as a closed gloo
socket would be; one that is alive but does not arrive within ``timeout_s`` (hung) is an error then.
The counters are aligned 8-byte words written after the data, which x86-64's store ordering makes
visible in that order to the other processes; other architectures keep gloo
(``shm_unavailable_reason`` says why).
"""

from __future__ import annotations

import mmap
import os
import platform
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["ShmCollectives", "shm_unavailable_reason"]

_LINE = 64  # bytes per counter: one cache line each, so ranks do not write the same line
_MAX_RANKS = 64
_HEADER = 3 * _MAX_RANKS * _LINE  # ready counters, done counters, process ids
_LIVENESS_EVERY_S = 0.05  # how often a waiting rank checks that the ranks it waits for still exist
_SUPPORTED_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.MAX: "max", dist.ReduceOp.MIN: "min"}
_SUPPORTED = tuple(_SUPPORTED_OPS)  # what traced code looks through (``supports``)
SHM_DIR = "/dev/shm"


def _header(mm: mmap.mmap, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Views of the segment's per-rank ``ready`` counters, ``done`` counters and process ids."""
    step = _LINE // 8
    words = np.frombuffer(mm, dtype=np.int64, count=_HEADER // 8)
    ready, done, pids = (words[i * _MAX_RANKS * step:(i + 1) * _MAX_RANKS * step:step][:size] for i in range(3))
    return ready, done, pids


def shm_unavailable_reason(group_size: int) -> str | None:
    """``None`` when this machine can run the shared-memory collectives, else why not."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the CPU is {platform.machine()}: the lock-free protocol relies on x86-64 store ordering"
    if not os.path.isdir(SHM_DIR):
        return f"{SHM_DIR} does not exist"
    if group_size > _MAX_RANKS:
        return f"the group has {group_size} ranks (at most {_MAX_RANKS})"
    return None


class ShmCollectives:
    """All-reduce and all-gather of CPU tensors over ``group`` through one shared-memory segment.

    Build it with the collective ``ShmCollectives.create(group)``.
    """

    def __init__(self, group: dist.ProcessGroup | None, mm: mmap.mmap, slot_bytes: int, timeout_s: float) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.global_ranks = dist.get_process_group_ranks(group)
        self.slot_bytes = slot_bytes
        self.timeout_s = timeout_s
        self._k = 0
        self._mm = mm
        self._ready, self._done, self._pids = _header(mm, self.size)
        data = torch.frombuffer(mm, dtype=torch.uint8, offset=_HEADER, count=2 * self.size * slot_bytes)
        self._slots = data.view(2, self.size, slot_bytes)

    @classmethod
    def create(cls, group: dist.ProcessGroup | None, *, slot_bytes: int = 1 << 20,
               timeout_s: float = 1800.0) -> tuple[ShmCollectives | None, str | None]:
        """Collective over ``group``: ``(instance, None)``, or ``(None, why)`` on every rank alike.

        Rank 0 of the group creates the segment, the others map it, all agree that everyone
        succeeded, then the name is unlinked: nothing is left in /dev/shm even if a process is killed.
        """
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        ranks = dist.get_process_group_ranks(group)
        slot_bytes = max(64, slot_bytes // 64 * 64)
        total = _HEADER + 2 * size * slot_bytes
        path: str | None = None
        error: str | None = shm_unavailable_reason(size)
        if rank == 0 and error is None:
            path = os.path.join(SHM_DIR, f"tessera-shm-{uuid.uuid4().hex}")
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                try:  # reserve the pages now: a full /dev/shm is an error here, not a SIGBUS mid-training
                    os.posix_fallocate(fd, 0, total)
                finally:
                    os.close(fd)
            except OSError as e:
                if os.path.exists(path):
                    os.unlink(path)
                error, path = f"cannot create {total} bytes at {path}: {e}", None
        shared = [path, error]
        dist.broadcast_object_list(shared, src=ranks[0], group=group)
        path, error = shared
        mm = None
        if path is not None:
            try:
                fd = os.open(path, os.O_RDWR)
                try:
                    mm = mmap.mmap(fd, total)
                finally:
                    os.close(fd)
            except OSError as e:
                error = f"rank {dist.get_rank()} cannot map {path}: {e}"
        pids = None
        if mm is not None:
            pids = _header(mm, size)[2]
            pids[rank] = os.getpid()
        ok = torch.tensor([0 if mm is None else 1], dtype=torch.int32)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)  # everyone mapped it and wrote its pid
        if pids is not None and int(ok.item()) == 1:
            hidden = [ranks[r] for r in range(size) if not _process_alive(int(pids[r]))]
            if hidden:  # e.g. separate PID namespaces: a dead peer could not be told from an invisible one
                error = f"the processes of global rank(s) {hidden} are not visible from rank {dist.get_rank()}"
                ok.zero_()
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
        del pids
        if rank == 0 and path is not None:
            os.unlink(path)
        dist.barrier(group=group)  # when create returns, the name is gone on every rank's view
        if int(ok.item()) == 0:
            if mm is not None:
                mm.close()
            if error is None:  # another rank failed: learn why so every rank reports the same reason
                error = "another rank could not map the shared segment"
            return None, error
        assert mm is not None  # ok == 1: every rank, this one included, mapped the segment
        return cls(group, mm, slot_bytes, timeout_s), None

    def close(self) -> None:
        """Drop the mapping (the numpy/torch views must not be used afterwards)."""
        self._ready = self._done = self._pids = self._slots = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with the process
            pass

    @staticmethod
    def supports(x: torch.Tensor, op: Any) -> bool:
        """Whether ``all_reduce(x, op)`` can run here (``all_gather`` takes any CPU tensor)."""
        # traced: by identity over a tuple (Dynamo before torch 2.12 can neither hash nor compare a ReduceOp)
        known = any(op is k for k in _SUPPORTED) if torch.compiler.is_compiling() else op in _SUPPORTED_OPS
        return x.device.type == "cpu" and known and not x.is_complex() and x.dtype is not torch.bool

    def all_reduce(self, x: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
        """Reduce ``x`` in place over the group and return it (same contract as ``dist.all_reduce``)."""
        flat = x.view(-1) if x.is_contiguous() else x.contiguous().view(-1)
        kind = _SUPPORTED_OPS[op]

        def reduce(chunk: torch.Tensor, slots: torch.Tensor) -> None:
            chunk.copy_(slots[0])
            for r in range(1, self.size):
                if kind == "sum":
                    chunk.add_(slots[r])
                elif kind == "max":
                    torch.maximum(chunk, slots[r], out=chunk)
                else:
                    torch.minimum(chunk, slots[r], out=chunk)

        for _, chunk in self._chunks(flat):
            self._exchange(chunk, "all-reduce", reduce)
        if flat.data_ptr() != x.data_ptr():
            x.copy_(flat.view_as(x))
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` in rank order, stacked: ``[size, *x.shape]`` (every rank passes the same shape)."""
        flat = x.reshape(-1)
        out = torch.empty(self.size, flat.numel(), dtype=x.dtype)
        for start, chunk in self._chunks(flat):
            place = out[:, start:start + chunk.numel()]

            def copy_out(_chunk: torch.Tensor, slots: torch.Tensor, place: torch.Tensor = place) -> None:
                place.copy_(slots)

            self._exchange(chunk, "all-gather", copy_out)
        return out.view(self.size, *x.shape)

    def _chunks(self, flat: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        per_chunk = max(1, self.slot_bytes // flat.element_size())
        return [(start, flat[start:start + per_chunk]) for start in range(0, flat.numel(), per_chunk)]

    def _exchange(self, chunk: torch.Tensor, name: str, read: Callable[[torch.Tensor, torch.Tensor], Any]) -> None:
        """One collective: ``chunk`` into this rank's slot, then ``read(chunk, slots)`` once all have arrived."""
        self._k += 1
        k, b = self._k, self._k % 2
        nbytes = chunk.numel() * chunk.element_size()
        slots = self._slots[b, :, :nbytes].view(chunk.dtype)  # [size, n]
        self._wait(self._done, k - 2, f"{name} #{k}", "finish reading the previous use of its buffer")
        slots[self.rank].copy_(chunk)
        self._ready[self.rank] = k
        self._wait(self._ready, k, f"{name} #{k}", "contribute")
        read(chunk, slots)
        self._done[self.rank] = k

    def _wait(self, counters: np.ndarray, k: int, collective: str, what: str) -> None:
        if k <= 0 or (counters >= k).all():
            return
        spins = 0
        start = last_check = time.monotonic()
        while not (counters >= k).all():
            spins += 1
            if spins > 200:
                os.sched_yield()  # give the core to a peer when there are more processes than cores
            if spins % 256 == 0:
                now = time.monotonic()
                if now - last_check < _LIVENESS_EVERY_S:
                    continue
                last_check = now
                late = [r for r in range(self.size) if counters[r] < k]
                gone = [r for r in late if not _process_alive(int(self._pids[r]))]
                if gone:  # fail now, as gloo does when a peer's socket closes, instead of at the timeout
                    raise RuntimeError(
                        f"shared-memory {collective}: global rank(s) {[self.global_ranks[r] for r in gone]} "
                        f"(pid {[int(self._pids[r]) for r in gone]}) exited while rank "
                        f"{self.global_ranks[self.rank]} waited for them to {what}")
                if now - start > self.timeout_s:
                    raise RuntimeError(
                        f"shared-memory {collective}: timed out after {self.timeout_s:g} s (dist.timeout_s) "
                        f"waiting for global rank(s) {[self.global_ranks[r] for r in late]} to {what}; "
                        "a peer has died or hung")


def _process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie waiting to be reaped counts as exited)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2:][:1] not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: fall back to a signal-0 probe
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
