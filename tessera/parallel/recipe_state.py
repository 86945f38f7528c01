"""What a GEMM recipe owns for one linear beyond its switches: ``RecipeState`` (the interface checkpoints save) and
``RecipeStream``, the random stream of the published recipes' stochastic rounding and Hadamard signs.

The stream is counter-based: each draw is ``torch.rand`` of the WHOLE logical operand (all TP shards) from a
generator seeded by (the run's seed, the linear's name, the draw's number), of which a shard keeps its slice. So a
TP=2 run draws exactly the numbers of the TP=1 run for every element, and the state a checkpoint carries is one
counter. The Hadamard signs depend on the run's seed only: one fixed sign vector for the run, as Transformer
Engine's recipe keeps.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

from tessera.parallel.hadamard import random_signs

__all__ = ["RecipeState", "RecipeStream"]


class RecipeState:
    """A recipe's state for one linear (an RNG stream, fixed random signs, an amax history): made by a route row's
    ``make_state(seed, name)``, held in the linear's policy, saved by checkpoints (``state_dict``). The base holds
    nothing."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


def _mix(*parts: int) -> int:
    """A 62-bit seed from integers (stable across processes and runs, unlike ``hash``)."""
    h = 0
    for p in parts:
        h = (h * 0x9E3779B97F4A7C15 + (p & 0xFFFFFFFFFFFFFFFF)) & 0xFFFFFFFFFFFFFFFF
    return h >> 2


class RecipeStream(RecipeState):
    """One linear's counter-based uniform stream (see the module docstring); ``draws`` is its whole state."""

    def __init__(self, seed: int, name: str) -> None:
        self.seed, self.key, self.draws = int(seed), zlib.crc32(name.encode()), 0
        self.signs = random_signs(_mix(seed, 0x5157))  # the run's one sign vector

    def uniform(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """The next draw: uniform [0, 1) numbers of ``shape`` (the whole logical operand), on ``device``."""
        g = torch.Generator().manual_seed(_mix(self.seed, self.key, self.draws))
        self.draws += 1
        return torch.rand(shape, generator=g).to(device)

    def state_dict(self) -> dict[str, Any]:
        return {"draws": torch.tensor(self.draws, dtype=torch.int64)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.draws = int(state["draws"])
