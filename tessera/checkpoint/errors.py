"""The checkpoint stack's one error type."""

from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used (missing, incomplete, damaged, or incompatible); names the file.

    ``every_rank``: raised on every rank alike after the ranks agreed (a failed save, no usable checkpoint),
    so a launcher may let every rank report it before any exits.
    """

    def __init__(self, message: str, *, every_rank: bool = False) -> None:
        super().__init__(message)
        self.every_rank = every_rank
