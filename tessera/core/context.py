"""Parallel context: process groups per parallel mode, launchers (torchrun / slurm), RNG streams.

Layout (world = tp x dp): TP groups are contiguous ranks ({0,1},{2,3},... for tp=2) so they stay
inside a node under torchrun/slurm; DP groups are strided (rank r has tp_rank = r % tp and
dp_rank = r // tp); ZERO1 groups split every DP group into consecutive chunks of ``zero1`` ranks.

RNG contract:
- the global seed seeds Python's ``random`` and NumPy identically on every rank;
- the DATA stream is torch's ambient generator. Its seed depends on (seed, dp_rank) only: identical on
  all TP ranks of a group (so dropout outside TP regions matches across TP ranks, as replicated
  activations must) and different across DP ranks (which see different data anyway);
- the TENSOR stream depends on (seed, dp_rank, tp_rank): dropout inside TP regions (sharded heads)
  draws different masks per TP rank. Enter it with ``with gpc.seed(ParallelMode.TENSOR): ...``.
Parameter initialization uses neither: each parameter has its own generator (see parallel.layers),
which is what makes weights TP-invariant.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import logging
import re
import socket
import subprocess
from datetime import timedelta
from enum import Enum
from typing import Any, Iterator, Mapping

import numpy as np
import torch
import torch.distributed as dist

from tessera.core.config import Config, ConfigError, check_world_size
from tessera.core.precision import apply_precision

logger = logging.getLogger("tessera")


class ParallelMode(str, Enum):
    GLOBAL = "global"
    DATA = "data"
    TENSOR = "tensor"
    ZERO1 = "zero1"


def derive_seed(seed: int, *parts: Any) -> int:
    """A 63-bit seed from the global seed and a tag; independent streams for different tags."""
    digest = hashlib.sha256(":".join(str(p) for p in (seed, *parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def group_layout(world_size: int, tp: int, zero1: int) -> dict[ParallelMode, list[list[int]]]:
    """All groups of every mode, as lists of global ranks (the single source of the layout).

    ``zero1=-1`` means the whole data-parallel group.
    """
    if world_size % tp:
        raise ConfigError(f"world size {world_size} is not a multiple of parallel.tensor.size={tp}")
    dp = world_size // tp
    zero1 = dp if zero1 == -1 else zero1
    if dp % zero1:
        raise ConfigError(f"parallel.zero1.size={zero1} does not divide the data-parallel size {dp}")
    tensor = [list(range(i * tp, (i + 1) * tp)) for i in range(dp)]
    data = [list(range(j, world_size, tp)) for j in range(tp)]
    zero = [g[k : k + zero1] for g in data for k in range(0, dp, zero1)]
    return {ParallelMode.GLOBAL: [list(range(world_size))], ParallelMode.TENSOR: tensor,
            ParallelMode.DATA: data, ParallelMode.ZERO1: zero}


class ParallelContext:
    """Process groups, ranks and RNG streams of this process (``gpc`` is the process-wide instance)."""

    def __init__(self) -> None:
        self.config: Config | None = None
        self._groups: dict[ParallelMode, Any] = {}
        self._ranks: dict[ParallelMode, list[int]] = {}
        self._global_rank = 0
        self._local_rank = 0  # rank within the node (CUDA device index)
        self.seed_value: int | None = None
        self._rng_states: dict[ParallelMode, dict[str, torch.Tensor]] = {}
        self._current_rng_mode = ParallelMode.DATA
        self.device = torch.device("cpu")
        self.tensor_group_nodes: list[Any] = []
        self.shm_all_reduce: Any = None  # the TP group's ShmAllReduce route, if used

    # ------------------------------------------------------------------ getters
    def is_initialized(self, mode: ParallelMode) -> bool:
        return mode in self._ranks

    def is_using_parallel_mode(self, mode: ParallelMode) -> bool:
        return self.is_initialized(mode) and len(self._ranks[mode]) > 1

    def get_group(self, mode: ParallelMode) -> Any:
        """The process group of ``mode`` (None when not initialized: a plain single process)."""
        return self._groups.get(mode)

    def get_ranks_in_group(self, mode: ParallelMode) -> list[int]:
        return list(self._ranks.get(mode, [self._global_rank]))

    def get_world_size(self, mode: ParallelMode) -> int:
        return len(self._ranks[mode]) if mode in self._ranks else 1

    def get_local_rank(self, mode: ParallelMode) -> int:
        """This process's index inside its group of ``mode``."""
        return self._ranks[mode].index(self._global_rank) if mode in self._ranks else 0

    def get_global_rank(self) -> int:
        return self._global_rank

    def is_rank_for_log(self) -> bool:
        return self._global_rank == 0

    @property
    def local_rank(self) -> int:
        """Rank within the node (selects the CUDA device)."""
        return self._local_rank

    @property
    def tensor_parallel_size(self) -> int:
        return self.get_world_size(ParallelMode.TENSOR)

    @property
    def data_parallel_size(self) -> int:
        return self.get_world_size(ParallelMode.DATA)

    # ------------------------------------------------------------------ setup
    def init_global_dist(
        self, rank: int, world_size: int, backend: str, init_method: Any, local_rank: int, timeout_s: float
    ) -> None:
        if torch.cuda.is_available() and backend == "nccl":
            torch.cuda.set_device(local_rank % torch.cuda.device_count())
            self.device = torch.device("cuda", torch.cuda.current_device())
        if not dist.is_initialized():
            # init_method: a URL, or a Store already connected (see _torchrun_store)
            where = {"store": init_method} if isinstance(init_method, dist.Store) else {"init_method": init_method}
            dist.init_process_group(
                backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s), **where,
            )
        self._global_rank = rank
        self._local_rank = local_rank

    def init_parallel_groups(self, tp: int, zero1: int, timeout_s: float | None = None) -> None:
        """Create every group of every mode; all ranks must call this with the same arguments."""
        world = dist.get_world_size()
        rank = dist.get_rank()
        kwargs = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
        for mode, groups in group_layout(world, tp, zero1).items():
            for ranks in groups:
                group = dist.group.WORLD if mode is ParallelMode.GLOBAL else dist.new_group(ranks, **kwargs)
                if rank in ranks:
                    self._groups[mode] = group
                    self._ranks[mode] = ranks

    def set_seed(self, seed: int) -> None:
        """Seed Python/NumPy globally and build the DATA (ambient) and TENSOR torch streams."""
        self.seed_value = seed
        random.seed(seed)
        np.random.seed(seed % (2**32))
        dp_rank = self.get_local_rank(ParallelMode.DATA)
        tp_rank = self.get_local_rank(ParallelMode.TENSOR)
        self._rng_states = {}
        torch.manual_seed(derive_seed(seed, "tensor", dp_rank, tp_rank))
        self._rng_states[ParallelMode.TENSOR] = _get_torch_rng()
        torch.manual_seed(derive_seed(seed, "data", dp_rank))
        self._rng_states[ParallelMode.DATA] = _get_torch_rng()
        self._current_rng_mode = ParallelMode.DATA

    @contextlib.contextmanager
    def seed(self, mode: ParallelMode) -> Iterator[None]:
        """Draw from ``mode``'s torch RNG stream inside the block (e.g. TENSOR for sharded dropout)."""
        if mode not in self._rng_states or mode is self._current_rng_mode:
            yield
            return
        previous = self._current_rng_mode
        self._rng_states[previous] = _get_torch_rng()
        _set_torch_rng(self._rng_states[mode])
        self._current_rng_mode = mode
        try:
            yield
        finally:
            self._rng_states[mode] = _get_torch_rng()
            _set_torch_rng(self._rng_states[previous])
            self._current_rng_mode = previous

    def get_rng_states(self) -> dict[str, Any]:
        """Every RNG state of this process, as tensors and plain values (safe for weights_only load)."""
        states = dict(self._rng_states)
        states[self._current_rng_mode] = _get_torch_rng()
        py = random.getstate()
        np_state = np.random.get_state()
        return {
            "python": {"version": py[0], "state": torch.tensor(py[1], dtype=torch.int64), "gauss": py[2]},
            "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                      "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
            "torch": {mode.value: s for mode, s in states.items()},
            "current_mode": self._current_rng_mode.value,
        }

    def set_rng_states(self, states: Mapping[str, Any]) -> None:
        py = states["python"]
        random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
        n = states["numpy"]
        np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
        self._rng_states = {ParallelMode(k): v for k, v in states["torch"].items()}
        self._current_rng_mode = ParallelMode(states["current_mode"])
        _set_torch_rng(self._rng_states[self._current_rng_mode])

    def destroy(self) -> None:
        """Tear down the process groups and forget the layout (safe to call twice)."""
        if self.shm_all_reduce is not None:
            from tessera.parallel.comm import use_fast_all_reduce

            use_fast_all_reduce(self.shm_all_reduce.group, None)
            self.shm_all_reduce.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        self.__init__()


def _get_torch_rng() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_torch_rng(state: Mapping[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


gpc = ParallelContext()


def _as_config(config: Config | Mapping[str, Any] | str | os.PathLike) -> Config:
    if isinstance(config, Config):
        return config
    if isinstance(config, (str, os.PathLike)):
        return Config.from_file(config)
    return Config.from_dict(config)


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

    The layout check runs before any collective, on every rank alike, so a bad world size is a
    ``ConfigError`` on all ranks instead of a hang in the rendezvous.
    """
    cfg = _as_config(config)
    tp, _, zero1 = check_world_size(cfg, world_size)
    if backend is None:
        backend = cfg.dist.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    gpc.config = cfg
    gpc.init_global_dist(rank, world_size, backend, init_method, local_rank, cfg.dist.timeout_s)
    gpc.init_parallel_groups(tp, zero1, cfg.dist.timeout_s)
    _check_tensor_groups_are_node_local()
    _setup_shm_all_reduce(cfg)
    apply_precision(cfg.model.dtype)
    torch.backends.cudnn.deterministic = cfg.cudnn_deterministic
    torch.backends.cudnn.benchmark = cfg.cudnn_benchmark
    gpc.set_seed(cfg.seed if seed is None else seed)
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


def _setup_shm_all_reduce(cfg: Config) -> None:
    """Route the TP group's all-reduces through shared memory when it is on one machine (CPU only).

    Every input to the decision is the same on all ranks of a TP group (config, the gathered node
    list, the machine), so they all take the same route; the choice is logged once.
    """
    from tessera.parallel.comm import use_fast_all_reduce  # tessera.parallel imports this module
    from tessera.parallel.shm_comm import ShmAllReduce

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
        impl, why = ShmAllReduce.create(group, timeout_s=cfg.dist.timeout_s)
        if impl is not None:
            use_fast_all_reduce(group, impl)
            gpc.shm_all_reduce = impl
            if gpc.get_global_rank() == 0:
                logger.info("tensor-parallel all-reduce: shared memory (%d ranks on one machine); "
                            "dist.cpu_shm_allreduce='off' uses gloo", size)
            return
    if gpc.get_global_rank() == 0:
        log = logger.warning if mode == "on" else logger.info
        log("tensor-parallel all-reduce: gloo (shared memory not used: %s)", why)


def _env_int(name: str, *fallbacks: str) -> int:
    for key in (name, *fallbacks):
        if key in os.environ:
            try:
                return int(os.environ[key])
            except ValueError:
                raise ConfigError(f"environment variable {key}={os.environ[key]!r} is not an integer") from None
    raise ConfigError(f"environment variable {name} is not set: launch with torchrun/srun or set it")


_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def launch_from_torch(
    config: Config | Mapping[str, Any] | str | os.PathLike, seed: int | None = 1024, backend: str | None = None
) -> ParallelContext:
    """Launch under torchrun: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT from the env.

    Joins through ``env://``, which reuses the store torchrun's agent already serves on MASTER_PORT.
    ``seed=None`` takes the config's ``seed`` key. Without any of torchrun's variables (``python
    train.py ...``) it runs as a single process: world size 1, an in-process store, no port.
    """
    if not any(key in os.environ for key in _TORCHRUN_ENV):
        logger.info("no torchrun environment (%s): running as a single process, world size 1", "/".join(_TORCHRUN_ENV))
        return launch(config, rank=0, world_size=1, init_method=dist.HashStore(), local_rank=0, backend=backend,
                      seed=seed)
    _env_int("MASTER_PORT")  # a clear error instead of a hang when it is missing
    world_size = _env_int("WORLD_SIZE")
    init = _torchrun_store(world_size, _as_config(config).dist.timeout_s) or "env://"
    return launch(
        config, rank=_env_int("RANK"), world_size=world_size, init_method=init,
        local_rank=_env_int("LOCAL_RANK"), backend=backend, seed=seed,
    )


def _torchrun_store(world_size: int, timeout_s: float) -> Any:
    """torchrun's agent store, with a key prefix per restart attempt on a single node; else None.

    The agent serves one TCPStore for the whole job and does not clear it between restart attempts
    (``--max-restarts``), so a restarted worker can read the addresses the previous attempt's
    workers published and fail to connect (pytorch/pytorch#135712). On one node every worker of an
    attempt sees the same TORCHELASTIC_RESTART_COUNT, so that count separates the attempts. Across
    nodes it does not (an agent restarted for a membership change keeps its count): there we keep
    the plain store and say how to get a fresh one per attempt.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return None
    if os.environ.get("GROUP_WORLD_SIZE", "1") != "1":
        if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
            logger.warning("torchrun --max-restarts on several nodes with the shared agent store can reuse stale "
                           "rendezvous keys after a restart; launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], _env_int("MASTER_PORT"), world_size, is_master=False,
                          timeout=timedelta(seconds=timeout_s))
    return dist.PrefixStore(f"tessera/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}/", store)


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
    """Launch under ``srun``: SLURM_PROCID, SLURM_NPROCS/SLURM_NTASKS, SLURM_LOCALID.

    ``host`` defaults to the first node of SLURM_JOB_NODELIST / SLURM_NODELIST.
    """
    if host is None:
        nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
        if not nodelist:
            raise ConfigError("launch_from_slurm: no host given and SLURM_JOB_NODELIST / SLURM_NODELIST is not set")
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
            host = out.stdout.split()[0]
        except (OSError, subprocess.CalledProcessError, IndexError):
            host = expand_slurm_nodelist(nodelist)[0]
    return launch(
        config, rank=_env_int("SLURM_PROCID"), world_size=_env_int("SLURM_NPROCS", "SLURM_NTASKS"),
        init_method=f"tcp://{host}:{port}", local_rank=_env_int("SLURM_LOCALID"), backend=backend, seed=seed,
    )
