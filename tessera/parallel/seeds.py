"""Named seeds: one global seed, many independent streams (initialization, data, tensor-parallel dropout)."""

from __future__ import annotations

import hashlib
from typing import Any

__all__ = ["derive_seed"]


def derive_seed(seed: int, *parts: Any) -> int:
    """A 63-bit seed from the global seed and a tag; independent streams for different tags."""
    digest = hashlib.sha256(":".join(str(p) for p in (seed, *parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)

