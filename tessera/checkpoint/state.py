"""What a resume restores, registered once: ``TrainState``.

A checkpoint is ``{component: component.state_dict()}``. The model and the optimizer are written as
tensor shards (one file per TP rank, one per ZeRO rank); every other component registers under a name
and ``save_checkpoint`` / ``load_checkpoint`` iterate the same registry, so adding a resumable part of
training is one ``register`` call. Small host components (step counters, LR schedule, data position)
go into meta.json's ``trainer_state``; per-rank ones (RNG streams) into the rank's own file, restored
only when the TP/DP layout is unchanged (a new layout cannot carry per-rank streams over).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from torch import nn

from tessera.checkpoint.errors import CheckpointError

__all__ = ["Stateful", "Progress", "RngStreams", "TrainState"]


@runtime_checkable
class Stateful(Protocol):
    """Anything with torch's ``state_dict`` / ``load_state_dict`` pair."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


@dataclass
class Progress:
    """The step counters of a run."""

    step: int = 0
    consumed_tokens: int = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "consumed_tokens": self.consumed_tokens}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.step = int(state["step"])
        self.consumed_tokens = int(state.get("consumed_tokens", 0))


class RngStreams:
    """The launched job's RNG streams (python, numpy, torch per parallel mode) as a component."""

    def __init__(self, context: Any) -> None:
        self.context = context  # the parallel context (gpc)

    def state_dict(self) -> dict[str, Any]:
        return self.context.get_rng_states()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.context.set_rng_states(state)


class TrainState:
    """The model, the optimizer and the named components of one run (see the module docstring).

    ``model`` is the unwrapped module (parameter names without wrapper prefixes); ``optimizer`` is a
    HybridZeroOptimizer or None (weights only).
    """

    def __init__(self, model: nn.Module, optimizer: Any | None = None, **components: Stateful) -> None:
        self.model = model
        self.optimizer = optimizer
        self.components: dict[str, Stateful] = {}
        self.per_rank: dict[str, Stateful] = {}
        for name, component in components.items():
            self.register(name, component)

    def register(self, name: str, component: Stateful, *, per_rank: bool = False) -> None:
        """Add a component saved and restored with every checkpoint (``per_rank``: in each rank's file)."""
        if not isinstance(component, Stateful):
            raise TypeError(f"TrainState.register({name!r}): {type(component).__name__} has no "
                            "state_dict/load_state_dict")
        if name in self.components or name in self.per_rank:
            raise ValueError(f"TrainState: a component named {name!r} is already registered")
        (self.per_rank if per_rank else self.components)[name] = component

    # ------------------------------------------------------------------ host components (meta.json)
    def state_dict(self) -> dict[str, Any]:
        return {name: c.state_dict() for name, c in self.components.items()}

    def load_state_dict(self, state: Mapping[str, Any], path: str = "checkpoint") -> None:
        state = _legacy_trainer_state(state)
        missing = [name for name in self.components if name not in state]
        if missing:
            raise CheckpointError(f"{path}: meta.json has no state for {missing} (saved by a run that did not "
                                  "register them)")
        for name, component in self.components.items():
            component.load_state_dict(state[name])

    # ------------------------------------------------------------------ per-rank components (own file)
    def rank_state_dict(self) -> dict[str, Any] | None:
        return {name: c.state_dict() for name, c in self.per_rank.items()} or None

    def load_rank_state_dict(self, state: Mapping[str, Any], path: str = "checkpoint") -> None:
        if len(self.per_rank) == 1 and not set(state) & set(self.per_rank):
            state = {next(iter(self.per_rank)): state}  # written before components had names: the RNG tree itself
        missing = [name for name in self.per_rank if name not in state]
        if missing:
            raise CheckpointError(f"{path}: this rank's file has no state for {missing}")
        for name, component in self.per_rank.items():
            component.load_state_dict(state[name])


def _legacy_trainer_state(state: Mapping[str, Any]) -> Mapping[str, Any]:
    """Checkpoints written before ``Progress`` was a component keep its counters at the top level."""
    if "progress" in state or "step" not in state:
        return state
    out = {k: v for k, v in state.items() if k not in ("step", "consumed_tokens")}
    out["progress"] = {"step": state["step"], "consumed_tokens": state.get("consumed_tokens", 0)}
    return out
