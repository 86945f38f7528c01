"""The parallel context ``gpc`` (InternEvo's getters and RNG streams) and the launchers that fill it.

``from tessera.core.context import gpc, ParallelMode, launch_from_torch, launch_from_slurm`` is the
documented path. Joining the job (rendezvous, process groups, shared-memory route, precision switches) is
``tessera.core.launch``, which knows nothing of ``gpc``; the launchers here call it and record what it made
in ``gpc``: ``gpc.job`` is then the run description (``tessera.core.job``) and every group getter reads it.
The groups are those of the rank layout (``tessera.core.layout``: contiguous TP, strided DP, ZERO1 in
consecutive chunks of each DP group).

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
import random
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
import torch.distributed as dist

from tessera.config import Config
from tessera.core.job import Job
from tessera.core.launch import ConfigLike, Launched, Peer, join_job, slurm_peer, torchrun_peer
from tessera.core.layout import ParallelMode
from tessera.parallel.comm import use_fast_collectives
from tessera.parallel.seeds import derive_seed

if TYPE_CHECKING:
    from tessera.parallel.shm_comm import ShmCollectives

__all__ = ["ParallelContext", "ParallelMode", "gpc", "launch", "launch_from_slurm", "launch_from_torch"]


class ParallelContext:
    """This process's launched job (``job``, the run description) and its RNG streams; ``gpc`` is the
    process-wide instance. The group getters are InternEvo's, read from ``job``."""

    def __init__(self) -> None:
        self.config: Config | None = None
        self.job: Job | None = None  # set by launch (record): the one description of this run
        self._global_rank = 0
        self._local_rank = 0  # rank within the node (CUDA device index)
        self.seed_value: int | None = None
        self._rng_states: dict[ParallelMode, dict[str, torch.Tensor]] = {}
        self._current_rng_mode = ParallelMode.DATA
        self.tensor_group_nodes: list[Any] = []
        self.shm_collectives: ShmCollectives | None = None  # the TP group's ShmCollectives route, if used

    # ------------------------------------------------------------------ getters (InternEvo's names)
    def is_initialized(self, mode: ParallelMode) -> bool:
        return self.job is not None

    def is_using_parallel_mode(self, mode: ParallelMode) -> bool:
        return self.get_world_size(mode) > 1

    def get_group(self, mode: ParallelMode) -> dist.ProcessGroup | None:
        """The process group of ``mode`` (None when nothing is launched: a plain single process)."""
        return self.job.groups.of(mode) if self.job is not None else None

    def get_ranks_in_group(self, mode: ParallelMode) -> list[int]:
        return self.job.ranks(mode) if self.job is not None else [self._global_rank]

    def get_world_size(self, mode: ParallelMode) -> int:
        return self.job.layout.size(mode) if self.job is not None else 1

    def get_local_rank(self, mode: ParallelMode) -> int:
        """This process's index inside its group of ``mode``."""
        return self.get_ranks_in_group(mode).index(self._global_rank) if self.job is not None else 0

    def get_global_rank(self) -> int:
        return self._global_rank

    @property
    def local_rank(self) -> int:
        """Rank within the node (selects the CUDA device)."""
        return self._local_rank

    @property
    def device(self) -> torch.device:
        """The launched job's device (the CPU when nothing is launched)."""
        return self.job.device if self.job is not None else torch.device("cpu")

    @property
    def data_parallel_size(self) -> int:
        return self.get_world_size(ParallelMode.DATA)

    # ------------------------------------------------------------------ setup
    def record(self, launched: Launched) -> None:
        """Take what ``join_job`` made as this process's launched job, then seed the RNG streams from its seed."""
        self.config = launched.config
        self.job = launched.job
        self._global_rank = launched.job.layout.global_rank
        self._local_rank = launched.local_rank
        self.tensor_group_nodes = list(launched.tensor_group_nodes)
        self.shm_collectives = launched.shm_collectives
        self.set_seed(launched.job.seed)

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
        np_state = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())  # legacy=True: the tuple
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
        np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                             n["cached_gaussian"]))
        self._rng_states = {ParallelMode(k): v for k, v in states["torch"].items()}
        self._current_rng_mode = ParallelMode(states["current_mode"])
        _set_torch_rng(self._rng_states[self._current_rng_mode])

    def destroy(self) -> None:
        """Tear down the process groups and forget the layout (safe to call twice)."""
        if self.shm_collectives is not None:
            use_fast_collectives(self.shm_collectives.group, None)
            self.shm_collectives.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        type(self).__init__(self)  # (self.__init__() reads the same; mypy flags it as unsound)


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


def launch(
    config: ConfigLike,
    rank: int,
    world_size: int,
    init_method: Any,
    local_rank: int = 0,
    backend: str | None = None,
    seed: int | None = None,
) -> ParallelContext:
    """Join the job as ``rank`` of ``world_size`` (``tessera.core.launch.join_job``) and record it in ``gpc``.

    ``init_method``: a ``Rendezvous`` (joined there, every failure a ``LaunchError``), a store or a URL.
    ``seed=None`` takes the config's ``seed`` key.
    """
    gpc.record(join_job(config, Peer(rank, world_size, local_rank, init_method), backend=backend, seed=seed))
    return gpc


def launch_from_torch(config: ConfigLike, seed: int | None = 1024, backend: str | None = None) -> ParallelContext:
    """Launch under torchrun (its environment read by ``tessera.core.launch.torchrun_peer``; without it, a single
    process). ``seed=None`` takes the config's ``seed`` key. A bad variable or rendezvous is a ``LaunchError``."""
    gpc.record(join_job(config, torchrun_peer(), backend=backend, seed=seed))
    return gpc


def launch_from_slurm(
    config: ConfigLike,
    host: str | None = None,
    port: int = 29500,
    backend: str | None = None,
    seed: int | None = 1024,
) -> ParallelContext:
    """Launch under ``srun`` (``tessera.core.launch.slurm_peer``: rank 0 serves the rendezvous on ``host:port``,
    ``host`` by default the first node of the job's node list). A bad variable or rendezvous is a ``LaunchError``."""
    gpc.record(join_job(config, slurm_peer(host, port), backend=backend, seed=seed))
    return gpc
