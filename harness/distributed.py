"""Run a function on N CPU processes (gloo) for tests and benchmarks.

Why a helper of our own: tests must fail, not hang, when one rank raises or deadlocks, and they must
report the failing rank's traceback. ``torch.multiprocessing.spawn`` waits forever on a rank stuck in
a collective; this helper bounds the whole run by a timeout and kills the survivors.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any


class WorkerError(RuntimeError):
    """A worker raised; the message carries the worker's rank and traceback."""


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int,
    world_size: int,
    fn: Callable[..., Any],
    args: Sequence[Any],
    env: dict[str, str],
    init_process_group: bool,
    init_file: str,
    results: mp.Queue,
) -> None:
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size)
    )
    try:
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
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; return per-rank results.

    With ``init_process_group`` each worker joins a default gloo group through a file store first;
    otherwise the torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) are set so
    ``fn`` can launch itself (e.g. through ``launch_from_torch``). The first failing rank's traceback is
    raised as ``WorkerError``; a run longer than ``timeout`` seconds kills every worker and raises too.
    ``fn`` and its arguments must be picklable (module-level functions).
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    tmpdir = tempfile.mkdtemp(prefix="tessera_dist_")
    init_file = os.path.join(tmpdir, "store")
    base_env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    base_env.update(env or {})
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, fn, args, base_env, init_process_group, init_file, results),
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
                raise WorkerError(f"distributed run timed out after {timeout:.0f}s; ranks {missing} did not finish")
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


def run_torchrun(
    args: Sequence[str],
    nproc_per_node: int = 2,
    *,
    timeout: float = 300.0,
    cwd: str | None = None,
    env: dict[str, str] | None = None,
    torchrun_args: Sequence[str] = ("--standalone",),
) -> subprocess.CompletedProcess[str]:
    """Run ``torchrun <torchrun_args> --nproc_per_node=N <args>`` and capture its output (no check).

    A run longer than ``timeout`` is killed (torchrun and every process below it: torchrun starts each
    worker in a session of its own, so killing torchrun's process group alone would leave hung workers
    holding the output pipes open) and reported with exit code 124.
    """
    import signal
    import subprocess
    import sys

    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    full_env.update(env or {})
    cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun_args, f"--nproc_per_node={nproc_per_node}", *args]
    proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        below = descendants(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        for pid in below:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out, err = proc.communicate()
        code = 124
    return subprocess.CompletedProcess(cmd, code, out, err)


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
