"""The global order of training rows: shuffled per epoch from a seed, independent of the DP size.

The run consumes one infinite sequence: epoch 0's permutation of all rows, then epoch 1's, ...
A position in that sequence (``consumed_rows``) is all a resume needs. The order depends only on
(seed, number of rows), never on how many data-parallel ranks share it, so a run resumed at another
DP size continues exactly where the old one stopped; only the slicing of each step changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from tessera.data.errors import DataError

STATE_VERSION = 1


class GlobalRowSampler:
    """Maps positions of the global row sequence to row indices, and remembers how far the run got."""

    def __init__(self, num_rows: int, seed: int, shuffle: bool = True):
        if num_rows < 1:
            raise DataError(f"the data has {num_rows} rows; need at least one")
        self.num_rows = int(num_rows)
        self.seed = int(seed)
        self.shuffle = shuffle
        self.consumed_rows = 0
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    @property
    def epoch(self) -> int:
        return self.consumed_rows // self.num_rows

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            if self.shuffle:
                self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)
            else:
                self._perm = np.arange(self.num_rows, dtype=np.int64)
            self._perm_epoch = epoch
        return self._perm

    def rows_at(self, start: int, count: int) -> np.ndarray:
        """Row indices at global positions ``[start, start+count)``, crossing epochs as needed."""
        out = np.empty(count, dtype=np.int64)
        done = 0
        while done < count:
            pos = start + done
            epoch, offset = divmod(pos, self.num_rows)
            n = min(count - done, self.num_rows - offset)
            out[done:done + n] = self._permutation(epoch)[offset:offset + n]
            done += n
        return out

    def take(self, count: int) -> np.ndarray:
        """The next ``count`` rows of the sequence; advances the position."""
        rows = self.rows_at(self.consumed_rows, count)
        self.consumed_rows += count
        return rows

    def state_dict(self) -> dict[str, Any]:
        """Plain ints only (safe for ``torch.load(weights_only=True)`` and JSON); equal on every rank."""
        return {
            "version": STATE_VERSION,
            "consumed_rows": self.consumed_rows,
            "epoch": self.epoch,
            "row_in_epoch": self.consumed_rows % self.num_rows,
            "num_rows": self.num_rows,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a saved position; the saved seed wins so the sequence is the same one."""
        try:
            version, consumed, num_rows = int(state["version"]), int(state["consumed_rows"]), int(state["num_rows"])
            seed, epoch = int(state["seed"]), int(state["epoch"])
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"bad data sampler state {dict(state)!r}: {e}") from None
        if version != STATE_VERSION:
            raise DataError(f"data sampler state version {version} is not supported (expected {STATE_VERSION})")
        if num_rows != self.num_rows:
            raise DataError(f"data sampler state was saved for {num_rows} rows but the data now has "
                            f"{self.num_rows} (different data folder, seq_len or shards?)")
        if consumed < 0 or epoch != consumed // num_rows:
            raise DataError(f"data sampler state is inconsistent: consumed_rows={consumed}, epoch={epoch}")
        self.seed = seed
        self.shuffle = bool(state.get("shuffle", self.shuffle))
        self.consumed_rows = consumed
        self._perm_epoch = -1
