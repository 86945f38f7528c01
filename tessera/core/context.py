"""Joining a job: torchrun / slurm / a plain single process, then every group, seed and precision switch.

``from tessera.core.context import gpc, ParallelMode, launch_from_torch, launch_from_slurm`` is the
documented path of the parallel context; launching leaves the run description in ``gpc.job``.

``launch`` validates the layout before any collective (a bad world size is a ConfigError on every
rank, never a hang), joins the default group (through ``tessera.core.rendezvous``: every launch failure
is a one-line ``LaunchError`` within ``dist.timeout_s``), builds the TENSOR/DATA/ZERO1 groups of ``gpc``, warns
when a TP group crosses nodes, routes a node-local CPU TP group's all-reduces and all-gathers through shared
memory, applies the precision switches (TF32, reduced-precision reductions) and seeds the RNG streams.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from tessera.config import Config, check_world_size
from tessera.core.config import as_config
from tessera.core.job import Job
from tessera.core.layout import Layout
from tessera.core.parallel_context import ParallelContext, ParallelMode, gpc
from tessera.core.rendezvous import LaunchError, Rendezvous, check_backend, check_rank
from tessera.parallel.comm import use_fast_collectives
from tessera.parallel.shm_comm import ShmCollectives

__all__ = ["Job", "LaunchError", "Layout", "ParallelContext", "ParallelMode", "expand_slurm_nodelist", "gpc",
           "launch", "launch_from_slurm", "launch_from_torch", "node_id"]

logger = logging.getLogger("tessera")


def launch(
    config: Config | Mapping[str, Any] | str | os.PathLike,
    rank: int,
    world_size: int,
    init_method: Any,
    local_rank: int = 0,
    backend: str | None = None,
    seed: int | None = None,
) -> ParallelContext:
    """Validate the layout, join the job, build every group, apply precision switches, seed RNGs.

    The layout and backend checks run before any collective, on every rank alike, so a bad world size is a
    ``ConfigError`` and a backend this machine lacks a ``LaunchError`` on all ranks instead of a hang in the
    rendezvous. ``init_method``: a ``Rendezvous`` (joined here, every failure a ``LaunchError``), a store or
    a URL.
    """
    cfg = as_config(config)
    tp, _, zero1 = check_world_size(cfg, world_size)
    if backend is None:
        backend = cfg.dist.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    check_backend(backend)
    gpc.config = cfg
    if isinstance(init_method, Rendezvous):  # every rank has joined the store once this returns
        init_method = init_method.connect(cfg.dist.timeout_s)
    try:
        device = gpc.init_global_dist(rank, world_size, backend, init_method, local_rank, cfg.dist.timeout_s)
    except RuntimeError as e:  # torch's DistError and backend failures: one line, the traceback chained
        raise LaunchError(f"joining the {backend} process group of {world_size} ranks failed: "
                          f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}") from e
    groups = gpc.new_groups(tp, zero1, cfg.dist.timeout_s)
    gpc.job = Job.of(cfg, groups, layout=Layout.of(world_size, tp, zero1, rank), device=device, seed=seed)
    _check_tensor_groups_are_node_local()
    _setup_shm_collectives(cfg)
    gpc.job.precision.apply()
    torch.backends.cudnn.deterministic = cfg.cudnn_deterministic
    torch.backends.cudnn.benchmark = cfg.cudnn_benchmark
    gpc.set_seed(gpc.job.seed)
    return gpc


def node_id() -> str:
    """This process's node: torchrun's GROUP_RANK, slurm's SLURM_NODEID, else the host name."""
    for key in ("GROUP_RANK", "SLURM_NODEID"):
        if key in os.environ:
            return f"node{os.environ[key]}"
    return socket.gethostname()


def _check_tensor_groups_are_node_local() -> None:
    """TP all-reduces run every layer: warn loudly when a TP group crosses nodes (slow interconnect)."""
    if not gpc.is_using_parallel_mode(ParallelMode.TENSOR):
        return
    nodes: list[Any] = [None] * gpc.get_world_size(ParallelMode.TENSOR)
    dist.all_gather_object(nodes, node_id(), group=gpc.get_group(ParallelMode.TENSOR))
    gpc.tensor_group_nodes = sorted(set(nodes))
    if len(gpc.tensor_group_nodes) > 1:
        logger.warning("tensor-parallel group %s spans nodes %s: make parallel.tensor.size divide the "
                       "processes per node", gpc.get_ranks_in_group(ParallelMode.TENSOR), gpc.tensor_group_nodes)
    else:
        logger.info("tensor-parallel groups are node-local (%s holds ranks %s)", gpc.tensor_group_nodes[0],
                    gpc.get_ranks_in_group(ParallelMode.TENSOR))


def _setup_shm_collectives(cfg: Config) -> None:
    """Route the TP group's all-reduces and all-gathers through shared memory when it is on one machine (CPU only).

    Every input to the decision is the same on all ranks of a TP group (config, the gathered node
    list, the machine), so they all take the same route; the choice is logged once.
    """
    mode = cfg.dist.cpu_shm_allreduce
    if mode == "off" or not gpc.is_using_parallel_mode(ParallelMode.TENSOR) or gpc.device.type != "cpu":
        return
    group = gpc.get_group(ParallelMode.TENSOR)
    size = gpc.get_world_size(ParallelMode.TENSOR)
    local, cores = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())), os.cpu_count() or 1
    why = None
    if len(gpc.tensor_group_nodes) > 1:
        why = "the tensor-parallel group spans nodes"
    elif dist.get_backend(group) != "gloo":
        why = f"the backend is {dist.get_backend(group)}"
    elif mode == "auto" and local > cores:
        why = (f"{local} processes share {cores} cores and waiting ranks would spin on them "
               "(dist.cpu_shm_allreduce='on' forces it)")
    if why is None:
        impl, why = ShmCollectives.create(group, timeout_s=cfg.dist.timeout_s)
        if impl is not None:
            use_fast_collectives(group, impl)
            gpc.shm_collectives = impl
            if gpc.get_global_rank() == 0:
                logger.info("tensor-parallel all-reduce and all-gather: shared memory (%d ranks on one machine); "
                            "dist.cpu_shm_allreduce='off' uses gloo", size)
            return
    if gpc.get_global_rank() == 0:
        log = logger.warning if mode == "on" else logger.info
        log("tensor-parallel all-reduce and all-gather: gloo (shared memory not used: %s)", why)


def _env_int(name: str, *fallbacks: str) -> int:
    for key in (name, *fallbacks):
        if key in os.environ:
            try:
                return int(os.environ[key])
            except ValueError:
                raise LaunchError(f"environment variable {key}={os.environ[key]!r} is not an integer") from None
    raise LaunchError(f"environment variable {name} is not set: launch with torchrun/srun or set it")


_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def launch_from_torch(
    config: Config | Mapping[str, Any] | str | os.PathLike, seed: int | None = 1024, backend: str | None = None
) -> ParallelContext:
    """Launch under torchrun: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT from the env.

    Joins the store torchrun's agent serves on MASTER_PORT, or (no agent: the variables set by hand) the
    one rank 0 serves there. ``seed=None`` takes the config's ``seed`` key. Without any of torchrun's
    variables (``python train.py ...``) it runs as a single process: world size 1, an in-process store, no
    port. A rank outside WORLD_SIZE, a missing variable or a failed rendezvous is a ``LaunchError``.
    """
    if not any(key in os.environ for key in _TORCHRUN_ENV):
        logger.info("no torchrun environment (%s): running as a single process, world size 1", "/".join(_TORCHRUN_ENV))
        return launch(config, rank=0, world_size=1, init_method=dist.HashStore(), local_rank=0, backend=backend,
                      seed=seed)
    world_size, rank, local_rank = _env_int("WORLD_SIZE"), _env_int("RANK"), _env_int("LOCAL_RANK")
    check_rank(rank, world_size, "RANK", "WORLD_SIZE")
    if "LOCAL_WORLD_SIZE" in os.environ:
        check_rank(local_rank, _env_int("LOCAL_WORLD_SIZE"), "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    if not os.environ.get("MASTER_ADDR"):
        raise LaunchError("environment variable MASTER_ADDR is not set: launch with torchrun, or set it to the host "
                          "of rank 0")
    rendezvous = Rendezvous(os.environ["MASTER_ADDR"], _env_int("MASTER_PORT"), rank, world_size,
                            **_torchrun_agent())
    return launch(config, rank=rank, world_size=world_size, init_method=rendezvous, local_rank=local_rank,
                  backend=backend, seed=seed)


def _torchrun_agent() -> dict[str, Any]:
    """How to use torchrun's agent store: ``agent`` (it serves the store) and a key ``prefix`` per restart attempt on
    a single node.

    The agent serves one TCPStore for the whole job and does not clear it between restart attempts
    (``--max-restarts``), so a restarted worker can read the addresses the previous attempt's
    workers published and fail to connect (pytorch/pytorch#135712). On one node every worker of an
    attempt sees the same TORCHELASTIC_RESTART_COUNT, so that count separates the attempts. Across
    nodes it does not (an agent restarted for a membership change keeps its count): there we keep
    the plain store and say how to get a fresh one per attempt.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return {"agent": True}
    if os.environ.get("GROUP_WORLD_SIZE", "1") != "1":
        if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
            logger.warning("torchrun --max-restarts on several nodes with the shared agent store can reuse stale "
                           "rendezvous keys after a restart; launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")
        return {"agent": True}
    return {"agent": True, "prefix": f"tessera/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}/"}


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """``"gpu[01-03,07],cpu5"`` -> ``["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]`` (no scontrol needed)."""
    hosts: list[str] = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", nodelist):
        if plain:
            hosts.append(plain)
            continue
        for part in ranges.split(","):
            if "-" in part:
                lo, hi = part.split("-")
                hosts.extend(f"{prefix}{i:0{len(lo)}d}" for i in range(int(lo), int(hi) + 1))
            else:
                hosts.append(prefix + part)
    return hosts


def launch_from_slurm(
    config: Config | Mapping[str, Any] | str | os.PathLike,
    host: str | None = None,
    port: int = 29500,
    backend: str | None = None,
    seed: int | None = 1024,
) -> ParallelContext:
    """Launch under ``srun``: SLURM_PROCID, SLURM_NTASKS (or SLURM_NPROCS), SLURM_LOCALID; rank 0 serves the
    rendezvous on ``host:port``.

    ``host`` defaults to the first node of SLURM_JOB_NODELIST / SLURM_NODELIST. A rank outside the task count,
    a missing variable or a failed rendezvous is a ``LaunchError``.
    """
    rank, world_size, local_rank = _env_int("SLURM_PROCID"), _slurm_tasks(), _env_int("SLURM_LOCALID")
    check_rank(rank, world_size, "SLURM_PROCID", "SLURM_NTASKS")
    if host is None:
        nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
        if not nodelist:
            raise LaunchError("launch_from_slurm: no host given (--host) and SLURM_JOB_NODELIST / SLURM_NODELIST is "
                              "not set")
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                                 check=True)
            host = out.stdout.split()[0]
        except (OSError, subprocess.CalledProcessError, IndexError):
            host = expand_slurm_nodelist(nodelist)[0]
    rendezvous = Rendezvous(host, port, rank, world_size, names=("--host", "--port"), world_name="SLURM_NTASKS",
                            rank_name="SLURM_PROCID")
    return launch(config, rank=rank, world_size=world_size, init_method=rendezvous, local_rank=local_rank,
                  backend=backend, seed=seed)


def _slurm_tasks() -> int:
    """The job's task count: SLURM_NTASKS, or the older SLURM_NPROCS; both set and different is an error."""
    if "SLURM_NTASKS" in os.environ and "SLURM_NPROCS" in os.environ:
        ntasks, nprocs = _env_int("SLURM_NTASKS"), _env_int("SLURM_NPROCS")
        if ntasks != nprocs:
            raise LaunchError(f"SLURM_NTASKS={ntasks} and SLURM_NPROCS={nprocs} disagree: launch with srun, or set "
                              "both to the number of tasks")
    return _env_int("SLURM_NTASKS", "SLURM_NPROCS")
