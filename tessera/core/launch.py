"""Joining a job: from a rank, a world size and a rendezvous to the run description and its process groups.

``join_job`` validates the layout before any collective (a bad world size is a ConfigError on every
rank, never a hang), joins the default group (through ``tessera.core.rendezvous``: every launch failure
is a one-line ``LaunchError`` within ``dist.timeout_s``), builds the TENSOR/DATA/ZERO1 groups, warns
when a TP group crosses nodes, routes a node-local CPU TP group's all-reduces and all-gathers through shared
memory and applies the precision switches (TF32, reduced-precision reductions, cuDNN) and, first of all, the
determinism switches (``tessera.core.determinism``: ``deterministic=True``). It returns what it
did as a ``Launched`` and records it nowhere: ``tessera.core.context`` fills ``gpc`` from it and seeds the
RNG streams. ``torchrun_peer`` / ``slurm_peer`` read a launcher's environment into the arguments it takes.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tessera.config import Config, RunConfig, check_world_size
from tessera.core.config import as_config
from tessera.core.determinism import apply_determinism
from tessera.core.job import Job, JobGroups
from tessera.core.layout import Layout, ParallelMode, group_layout
from tessera.core.rendezvous import LaunchError, Rendezvous, check_backend, check_rank
from tessera.parallel.comm import use_fast_collectives
from tessera.parallel.shm_comm import ShmCollectives

__all__ = ["Launched", "Peer", "expand_slurm_nodelist", "join_default_group", "join_job", "new_groups", "node_id",
           "slurm_peer", "torchrun_peer"]

logger = logging.getLogger("tessera")

ConfigLike = Config | Mapping[str, Any] | str | os.PathLike


@dataclass(frozen=True)
class Launched:
    """What joining a job made: the config, the run description, where this process sits, the TP route."""

    config: Config
    job: Job
    local_rank: int  # rank within the node (selects the CUDA device)
    tensor_group_nodes: list[str]  # the nodes this rank's TP group spans ([] without TP)
    shm_collectives: ShmCollectives | None  # the TP group's shared-memory route, if used


@dataclass(frozen=True)
class Peer:
    """One process's place in a job, as its launcher's environment gives it: what ``join_job`` takes."""

    rank: int
    world_size: int
    local_rank: int
    init_method: Any  # a Rendezvous, a connected store or a URL


def join_job(config: ConfigLike, peer: Peer, backend: str | None = None, seed: int | None = None) -> Launched:
    """Validate the layout, join the job, build every group and apply the precision switches.

    The layout and backend checks run before any collective, on every rank alike, so a bad world size is a
    ``ConfigError`` and a backend this machine lacks a ``LaunchError`` on all ranks instead of a hang in the
    rendezvous. ``seed=None`` takes the config's ``seed`` key.
    """
    cfg = as_config(config)
    run = cfg.typed  # the launch reads the typed view only (mypy checks every field)
    tp, _, zero1 = check_world_size(cfg, peer.world_size)
    if backend is None:
        backend = run.dist.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    check_backend(backend)
    apply_determinism(run, backend, peer.world_size)  # before the group and CUDA: env vars read at their start
    init_method = peer.init_method
    if isinstance(init_method, Rendezvous):  # every rank has joined the store once this returns
        init_method = init_method.connect(run.dist.timeout_s)
        logger.debug("launch: rank %d joined the rendezvous at %s", peer.rank, peer.init_method.where)
    try:
        device = join_default_group(peer.rank, peer.world_size, backend, init_method, peer.local_rank,
                                    run.dist.timeout_s)
    except RuntimeError as e:  # torch's DistError and backend failures: one line, the traceback chained
        raise LaunchError(f"joining the {backend} process group of {peer.world_size} ranks failed: "
                          f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}") from e
    logger.debug("launch: rank %d joined the %s process group of %d ranks", peer.rank, backend, peer.world_size)
    groups = new_groups(tp, zero1, run.dist.timeout_s)
    logger.debug("launch: rank %d built its tensor, data and zero1 groups", peer.rank)
    job = Job.of(run, groups, layout=Layout.of(peer.world_size, tp, zero1, peer.rank), device=device, seed=seed)
    nodes = _tensor_group_nodes(job)
    shm = _shm_collectives(run, job, nodes)
    job.precision.apply()
    torch.backends.cudnn.deterministic = run.cudnn_deterministic or run.deterministic
    torch.backends.cudnn.benchmark = run.cudnn_benchmark  # refused with deterministic=True (apply_determinism)
    return Launched(cfg, job, peer.local_rank, nodes, shm)


def join_default_group(
    rank: int, world_size: int, backend: str, init_method: Any, local_rank: int, timeout_s: float
) -> torch.device:
    """Join the default group; returns this rank's device (its CUDA device under NCCL, else the CPU)."""
    device = torch.device("cpu")
    if torch.cuda.is_available() and backend == "nccl":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    if not dist.is_initialized():
        # init_method: a URL, or a Store already connected (Rendezvous.connect)
        where = {"store": init_method} if isinstance(init_method, dist.Store) else {"init_method": init_method}
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s),
                                **where)
    return device


def new_groups(tp: int, zero1: int, timeout_s: float | None = None) -> JobGroups:
    """Create every group of every mode and return this rank's; all ranks must call this alike."""
    world = dist.get_world_size()
    rank = dist.get_rank()
    kwargs: dict[str, Any] = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
    mine: dict[ParallelMode, dist.ProcessGroup | None] = {}
    for mode, groups in group_layout(world, tp, zero1).items():
        for ranks in groups:
            group = dist.group.WORLD if mode is ParallelMode.GLOBAL else dist.new_group(ranks, **kwargs)
            if rank in ranks:
                mine[mode] = group
    return JobGroups(tp=mine[ParallelMode.TENSOR], dp=mine[ParallelMode.DATA], zero1=mine[ParallelMode.ZERO1],
                     world=mine[ParallelMode.GLOBAL])


def node_id() -> str:
    """This process's node: torchrun's GROUP_RANK, slurm's SLURM_NODEID, else the host name."""
    for key in ("GROUP_RANK", "SLURM_NODEID"):
        if key in os.environ:
            return f"node{os.environ[key]}"
    return socket.gethostname()


def _tensor_group_nodes(job: Job) -> list[str]:
    """The nodes of this rank's TP group; TP all-reduces run every layer: warn loudly when it crosses nodes."""
    size = job.layout.size(ParallelMode.TENSOR)
    if size <= 1:
        return []
    nodes: list[Any] = [None] * size
    dist.all_gather_object(nodes, node_id(), group=job.groups.tp)
    found = sorted(set(nodes))
    ranks = job.ranks(ParallelMode.TENSOR)
    if len(found) > 1:
        logger.warning("tensor-parallel group %s spans nodes %s: make parallel.tensor.size divide the "
                       "processes per node", ranks, found)
    else:
        logger.info("tensor-parallel groups are node-local (%s holds ranks %s)", found[0], ranks)
    return found


def _shm_collectives(run: RunConfig, job: Job, nodes: list[str]) -> ShmCollectives | None:
    """Route the TP group's all-reduces and all-gathers through shared memory when it is on one machine (CPU only).

    Every input to the decision is the same on all ranks of a TP group (config, the gathered node
    list, the machine), so they all take the same route; the choice is logged once.
    """
    mode = run.dist.cpu_shm_allreduce
    size = job.layout.size(ParallelMode.TENSOR)
    if mode == "off" or size <= 1 or job.device.type != "cpu":
        return None
    group = job.groups.tp
    local, cores = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())), os.cpu_count() or 1
    why = None
    if len(nodes) > 1:
        why = "the tensor-parallel group spans nodes"
    elif dist.get_backend(group) != "gloo":
        why = f"the backend is {dist.get_backend(group)}"
    elif mode == "auto" and local > cores:
        why = (f"{local} processes share {cores} cores and waiting ranks would spin on them "
               "(dist.cpu_shm_allreduce='on' forces it)")
    if why is None:
        impl, why = ShmCollectives.create(group, timeout_s=run.dist.timeout_s)
        if impl is not None:
            use_fast_collectives(group, impl)
            if job.is_rank0:
                logger.info("tensor-parallel all-reduce and all-gather: shared memory (%d ranks on one machine); "
                            "dist.cpu_shm_allreduce='off' uses gloo", size)
            return impl
    if job.is_rank0:
        log = logger.warning if mode == "on" else logger.info
        log("tensor-parallel all-reduce and all-gather: gloo (shared memory not used: %s)", why)
    return None


# ------------------------------------------------------------------ the launchers' environments
def _env_int(name: str, *fallbacks: str) -> int:
    for key in (name, *fallbacks):
        if key in os.environ:
            try:
                return int(os.environ[key])
            except ValueError:
                raise LaunchError(f"environment variable {key}={os.environ[key]!r} is not an integer") from None
    raise LaunchError(f"environment variable {name} is not set: launch with torchrun/srun or set it")


TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def torchrun_peer() -> Peer:
    """This process under torchrun: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT from the env.

    It joins the store torchrun's agent serves on MASTER_PORT, or (no agent: the variables set by hand) the
    one rank 0 serves there. Without any of torchrun's variables (``python train.py ...``) it is a single
    process: world size 1, an in-process store, no port. A rank outside WORLD_SIZE or a missing variable is a
    ``LaunchError``.
    """
    if not any(key in os.environ for key in TORCHRUN_ENV):
        logger.info("no torchrun environment (%s): running as a single process, world size 1", "/".join(TORCHRUN_ENV))
        return Peer(rank=0, world_size=1, local_rank=0, init_method=dist.HashStore())
    world_size, rank, local_rank = _env_int("WORLD_SIZE"), _env_int("RANK"), _env_int("LOCAL_RANK")
    check_rank(rank, world_size, "RANK", "WORLD_SIZE")
    if "LOCAL_WORLD_SIZE" in os.environ:
        check_rank(local_rank, _env_int("LOCAL_WORLD_SIZE"), "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    if not os.environ.get("MASTER_ADDR"):
        raise LaunchError("environment variable MASTER_ADDR is not set: launch with torchrun, or set it to the host "
                          "of rank 0")
    rendezvous = Rendezvous(os.environ["MASTER_ADDR"], _env_int("MASTER_PORT"), rank, world_size,
                            **_torchrun_agent())
    return Peer(rank, world_size, local_rank, rendezvous)


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


def slurm_peer(host: str | None = None, port: int = 29500) -> Peer:
    """This process under ``srun``: SLURM_PROCID, SLURM_NTASKS (or SLURM_NPROCS), SLURM_LOCALID; rank 0 serves
    the rendezvous on ``host:port``.

    ``host`` defaults to the first node of SLURM_JOB_NODELIST / SLURM_NODELIST. A rank outside the task count
    or a missing variable is a ``LaunchError``.
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
    return Peer(rank, world_size, local_rank, rendezvous)


def _slurm_tasks() -> int:
    """The job's task count: SLURM_NTASKS, or the older SLURM_NPROCS; both set and different is an error."""
    if "SLURM_NTASKS" in os.environ and "SLURM_NPROCS" in os.environ:
        ntasks, nprocs = _env_int("SLURM_NTASKS"), _env_int("SLURM_NPROCS")
        if ntasks != nprocs:
            raise LaunchError(f"SLURM_NTASKS={ntasks} and SLURM_NPROCS={nprocs} disagree: launch with srun, or set "
                              "both to the number of tasks")
    return _env_int("SLURM_NTASKS", "SLURM_NPROCS")
