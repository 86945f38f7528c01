"""The two forms of HybridZeroOptimizer's state, as checkpoints read and write them.

- ``STATE_DICT_FORMAT`` (``state_dict()``): full TP-local tensors keyed by parameter name (masters and
  Adam moments gathered over ZERO1); a collective, and a full copy of the state on every rank.
- ``SHARD_FORMAT`` (``shard_state_dict()``): only this ZERO1 rank's shard, as the flat per-bucket slices
  it updates, with the names, shapes and offsets that say which elements of which parameter each slice
  holds. No collective, no copy: what training checkpoints write, one file per ZeRO rank. It is loaded
  back through ``load_shards`` from any ``ShardSource``, which reads element ranges of a parameter.

Both load into any DP / ZeRO layout with the same TP-local shapes.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

__all__ = ["STATE_DICT_FORMAT", "SHARD_FORMAT", "ShardSource"]

STATE_DICT_FORMAT = "tessera.hybrid_zero_optimizer/1"
SHARD_FORMAT = "tessera.hybrid_zero_optimizer.shard/1"


class ShardSource(Protocol):
    """Saved optimizer state read by parameter name and element range (``checkpoint.optim_shards``)."""

    def shape(self, name: str) -> tuple[int, ...] | None: ...
    def read(self, name: str, key: str, start: int, stop: int) -> torch.Tensor: ...
    def state_keys(self, name: str) -> tuple[list[str], dict[str, Any]]: ...
    def group(self, name: str) -> dict[str, Any]: ...
    @property
    def header(self) -> dict[str, Any]: ...
