"""A resumable component for checkpoint tests: it holds whatever state tree it is given."""

from __future__ import annotations

from typing import Any


class HeldState:
    """Saved and restored like any ``TrainState`` component (a stand-in for the RNG streams)."""

    def __init__(self, state: Any = None) -> None:
        self.state = state

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state: Any) -> None:
        self.state = state
