"""The checkpoint stack's one error type."""

from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used (missing, incomplete, damaged, or incompatible); names the file."""
