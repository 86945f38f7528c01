"""Tokenizing on every core: batches of documents go to worker processes and come back in order.

Why processes: each document is encoded by one single-threaded call (``encode_document``; never a
library's own batch thread pool), so ``--workers N`` means N cores and one worker means one, and
Python threads would share one interpreter lock. Why ordered: the output must be the same bytes
whatever the worker count, so results are consumed in submission order. Why bounded: at most
``2 x workers`` batches are in flight, so a corpus larger than memory streams through.
"""

from __future__ import annotations

import collections
import multiprocessing
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

__all__ = ["TokenizePool", "default_workers", "encode_documents"]

_worker_tokenizer: Any = None


def default_workers() -> int:
    """Every core this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def encode_documents(tokenizer: Any, texts: Sequence[str]) -> list[np.ndarray]:
    """Each text's training ids (BOS where the tokenizer adds one; the EOD is the writer's) as a compact array."""
    dtype = np.uint32 if tokenizer.vocab_size > 1 << 16 else np.uint16
    return [np.asarray(tokenizer.encode_document(t), dtype=dtype) for t in texts]


def _init_worker(tokenizer: Any) -> None:
    global _worker_tokenizer
    os.environ["OMP_NUM_THREADS"] = "1"
    _worker_tokenizer = tokenizer


def _encode_in_worker(texts: Sequence[str]) -> list[np.ndarray]:
    return encode_documents(_worker_tokenizer, texts)


class TokenizePool:
    """``map(batches)`` -> the batches' ids, in order; in-process when ``workers == 1``."""

    def __init__(self, tokenizer: Any, workers: int):
        if workers < 1:
            raise ValueError(f"workers={workers} must be >= 1")
        self.tokenizer, self.workers = tokenizer, workers
        self._pool: Any = None
        if workers > 1:
            method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
            self._pool = multiprocessing.get_context(method).Pool(workers, _init_worker, (tokenizer,))

    def map(self, batches: Iterable[Sequence[str]]) -> Iterator[list[np.ndarray]]:
        if self._pool is None:
            for texts in batches:
                yield encode_documents(self.tokenizer, texts)
            return
        pending: collections.deque[Any] = collections.deque()
        for texts in batches:
            pending.append(self._pool.apply_async(_encode_in_worker, (texts,)))
            if len(pending) >= 2 * self.workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def __enter__(self) -> TokenizePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
