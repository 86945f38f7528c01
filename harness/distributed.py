"""Run a function on N CPU processes (gloo) for tests and benchmarks.

Why a helper of our own: tests must fail, not hang, when one rank raises or deadlocks, and they must
report the failing rank's traceback. ``torch.multiprocessing.spawn`` waits forever on a rank stuck in
a collective; this helper bounds the whole run by a timeout and kills the survivors.

Workers are forked from a forkserver that imported torch once per test process: a spawned worker would
import torch again (about 2 s of CPU each, the largest part of a small distributed test on 2 cores). A
forkserver child inherits the server's environment and standard streams, not the caller's, so each worker
takes the caller's environment and standard output and error (pytest's capture of the current test) as
arguments and installs them before anything else runs.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import socket
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any


@contextlib.contextmanager
def fake_process_group(backend: str, world_size: int) -> Iterator[None]:
    """This process as rank 0 of a ``world_size``-rank job on torch's fake backend (``"fake"``, or ``"cuda:fake"``
    for groups that refuse CPU tensors as NCCL does): collectives return at once; destroyed on exit."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group(backend, store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


class WorkerError(RuntimeError):
    """A worker raised; the message carries the worker's rank and traceback."""


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PRELOAD = ["torch", "torch.distributed"]  # what the forkserver imports once, so no worker imports it again


class _CallerFd:
    """The caller's file descriptor ``fd``, handed to the worker while the process object is pickled."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        from multiprocessing import reduction

        return (_received_fd, (reduction.DupFd(self.fd),))


def _received_fd(dup: Any) -> int:
    return int(dup.detach())


def _context() -> Any:
    """The forkserver context, torch preloaded (the server starts at the first worker and serves every later one)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _worker(
    rank: int,
    world_size: int,
    fn: Callable[..., Any],
    args: Sequence[Any],
    env: dict[str, str],
    init_process_group: bool,
    init_file: str,
    results: mp.Queue,
    caller_env: dict[str, str] | None = None,
    stdio: tuple[int, int] | None = None,
) -> None:
    if stdio is not None:  # the caller's stdout and stderr (pytest's capture), not the forkserver's
        for received, target in zip(stdio, (1, 2)):
            os.dup2(received, target)
            os.close(received)
    if caller_env is not None:  # the caller's environment as it is now, not the forkserver's from its start
        os.environ.clear()
        os.environ.update(caller_env)
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size)
    )
    try:
        import faulthandler

        faulthandler.enable()  # a worker killed as hung (SIGABRT first) prints its stacks
        import torch

        torch.set_num_threads(1)
        if init_process_group:
            import torch.distributed as dist

            dist.init_process_group(
                "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
            )
        out = fn(rank, world_size, *args)
        # plain pickle copies tensors; torch's queue reducer would share memory that dies with the worker
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    init_process_group: bool = True,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` worker processes; return per-rank results.

    With ``init_process_group`` each worker joins a default gloo group through a file store first;
    otherwise the torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) are set so
    ``fn`` can launch itself (e.g. through ``launch_from_torch``). The first failing rank's traceback is
    raised as ``WorkerError``; a run longer than ``timeout`` seconds kills every worker and raises too.
    ``fn`` and its arguments must be picklable (module-level functions).
    """
    import sys

    ctx = _context()
    results = ctx.Queue()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    tmpdir = tempfile.mkdtemp(prefix="tessera_dist_")
    init_file = os.path.join(tmpdir, "store")
    base_env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    base_env.update(env or {})
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, fn, args, base_env, init_process_group, init_file, results, dict(os.environ),
                  (_CallerFd(1), _CallerFd(2))),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outputs) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(outputs))
                _dump_stacks([procs[r] for r in missing])
                raise WorkerError(f"distributed run timed out after {timeout:.0f}s; ranks {missing} did not finish "
                                  "(their Python stacks are in the captured stderr)")
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outputs]
                if dead:
                    # a worker died without reporting (segfault, os._exit, SIGKILL); give the queue a moment
                    try:
                        rank, ok, payload = results.get(timeout=2.0)
                    except queue.Empty:
                        raise WorkerError(
                            f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} without a result"
                        ) from None
                else:
                    continue
            if not ok:
                raise WorkerError(f"rank {rank} failed:\n{payload}")
            outputs[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [outputs[r] for r in range(world_size)]


def _dump_stacks(procs: Sequence[Any], grace_s: float = 3.0) -> None:
    """SIGABRT each live worker: ``faulthandler`` (enabled in ``_worker``) prints its stacks to the inherited stderr."""
    import signal

    for p in procs:
        if p.is_alive() and p.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGABRT)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.is_alive() for p in procs):
        time.sleep(0.1)


def run_torchrun(
    args: Sequence[str],
    nproc_per_node: int = 2,
    *,
    timeout: float = 300.0,
    cwd: str | None = None,
    env: dict[str, str] | None = None,
    torchrun_args: Sequence[str] = ("--standalone",),
    launcher: str = "torch.distributed.run",
) -> subprocess.CompletedProcess[str]:
    """Run ``torchrun <torchrun_args> --nproc_per_node=N <args>`` and capture its output (no check).

    ``launcher`` is the module run as torchrun: ``tessera.run`` is tessera's wrapper, which takes the same arguments.

    A run longer than ``timeout`` is killed (torchrun and every process below it: torchrun starts each
    worker in a session of its own, so killing torchrun's process group alone would leave hung workers
    holding the output pipes open) and reported with exit code 124.
    """
    import subprocess
    import sys

    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    full_env.update(env or {})
    cmd = [sys.executable, "-m", launcher, *torchrun_args, f"--nproc_per_node={nproc_per_node}", *args]
    proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        kill_with_stacks(proc.pid)
        out, err = proc.communicate()
        err += f"\n[harness] killed after {timeout:g} s (a hang): the Python stacks above were dumped at the kill\n"
        code = 124
    return subprocess.CompletedProcess(cmd, code, out, err)


def kill_with_stacks(pid: int, grace_s: float = 3.0) -> None:
    """Kill ``pid`` and every process below it, after asking each to dump its Python stacks.

    A hung run says nothing about where it hangs; with ``PYTHONFAULTHANDLER=1`` in their environment, Python
    processes print every thread's stack on SIGABRT, so the test's failure message shows where each rank waited.
    """
    import signal

    below = descendants(pid)
    for child in below:  # the workers first (torchrun's agent would otherwise tear them down on its own abort)
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGABRT)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(child) for child in below):
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    for child in below:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2:][:1] not in (b"Z", b"X")
    except OSError:
        return False


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, grandchildren, ...), read from /proc; [] without /proc."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
