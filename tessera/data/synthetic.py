"""Random tokens for benchmarks and tests: deterministic from a seed, generated on demand.

Token ``t`` of the stream is a hash of (seed, t), so any window can be produced without storing
anything and every rank, run and resume sees the same data. Documents have a fixed length (their
last token is EOD), so synthetic batches exercise the same packing and label rules as real data.
"""

from __future__ import annotations

import numpy as np

from tessera.data.errors import DataError

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer: a fast, well-spread hash of uint64 values (wraps modulo 2**64)."""
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class SyntheticStream:
    """``num_documents`` documents of ``doc_len`` tokens (EOD last) of uniform random ids < vocab_size-1."""

    def __init__(self, num_documents: int, doc_len: int, vocab_size: int, seed: int):
        if vocab_size < 2:
            raise DataError(f"synthetic data needs vocab_size >= 2 (ids plus an EOD), got {vocab_size}")
        if doc_len < 1 or num_documents < 1:
            raise DataError(f"synthetic data needs doc_len >= 1 and num_documents >= 1, got {doc_len}, {num_documents}")
        self.doc_len = int(doc_len)
        self.num_tokens = int(num_documents) * self.doc_len
        self.vocab_size = int(vocab_size)
        self.eod_id = self.vocab_size - 1
        self._key = _mix(np.array([seed], dtype=np.uint64))[0]

    def read(self, start: int, stop: int) -> np.ndarray:
        pos = np.arange(start, min(stop, self.num_tokens), dtype=np.uint64)
        tok = (_mix(pos ^ self._key) % np.uint64(self.vocab_size - 1)).astype(np.int64)
        tok[(pos + np.uint64(1)) % np.uint64(self.doc_len) == 0] = self.eod_id
        return tok

    def doc_starts_in(self, start: int, stop: int) -> np.ndarray:
        first = (start // self.doc_len + 1) * self.doc_len
        return np.arange(first, min(stop, self.num_tokens) + 1, self.doc_len, dtype=np.int64)

    def byte_lengths(self) -> np.ndarray:
        """One "byte" per token and none for EOD, so bits per byte reads as bits per token."""
        lengths = np.ones(self.vocab_size, dtype=np.int64)
        lengths[self.eod_id] = 0
        return lengths
