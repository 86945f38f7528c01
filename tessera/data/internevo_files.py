"""InternEvo's tokenized data as it is on disk: ``*.bin`` files of JSON lines ``{"tokens": [...]}``, each with a
``*.bin.meta`` index (``numpy.save`` of an int array ``[num_documents, 2]``: byte offset of the line, token
count), as InternEvo's ``tools/tokenizer.py`` writes them, in a folder and its sub-folders (``en/``, ``cn/``...).

Read memory-mapped, one JSON line per document when a row needs it, never the whole file. Like InternEvo:
files are found by walking the folder (sub-folders and files sorted, links followed), documents shorter
than ``min_length`` are left out (``min_length_dict`` sets it per file whose path contains a key), and a
negative id is a token that is input but never a label (InternEvo's SFT data masks prompts so). Opening
checks the index against the file (every offset starts a line, sizes agree), so a damaged or missing
``.meta`` is a ``DataError`` naming it before training; a line whose tokens disagree with the index, or
hold an id outside the vocabulary, is one naming the file and line when it is read.
"""

from __future__ import annotations

import collections
import json
import mmap
import os
from collections.abc import Mapping

import numpy as np

from tessera.data.errors import DataError

__all__ = ["InternEvoFile", "find_internevo_files", "is_internevo_folder", "open_internevo_folder"]

_CACHE_DOCS = 64  # parsed documents kept per file (a row reads a few neighbours, often again)


def find_internevo_files(folder: str) -> list[str]:
    """Every ``*.bin`` under ``folder`` in InternEvo's order (sorted sub-folders, sorted names, links followed)."""
    found = []
    for root, dirs, files in os.walk(folder, followlinks=True):
        dirs.sort()
        found += [os.path.join(root, f) for f in sorted(files) if f.endswith(".bin")]
    return found


def is_internevo_folder(folder: str) -> bool:
    """Whether ``folder`` holds InternEvo ``.bin`` files (and no tessera ``meta.json`` at its top)."""
    if not os.path.isdir(folder) or os.path.isfile(os.path.join(folder, "meta.json")):
        return False
    return any(f.endswith(".bin") and f != "tokens.bin" for _, _, fs in os.walk(folder, followlinks=True) for f in fs)


def _min_length_for(path: str, min_length: int, per_file: Mapping[str, int] | None) -> int:
    if not per_file:
        return min_length
    hits = [k for k in per_file if k in path]
    if len(hits) > 1:
        raise DataError(f"data.min_length_dict: {path} matches several keys {hits}; make them match one each")
    return int(per_file[hits[0]]) if hits else min_length


class InternEvoFile:
    """One ``.bin`` + ``.bin.meta``: its kept documents, their lengths, and (as a TokenStream) their tokens
    back to back, so tessera's own row packing can read it too (validation)."""

    eod_id = 0  # padding: InternEvo pads with 0; documents carry their own BOS/EOS
    signed = True  # negative ids: input tokens that are never labels

    def __init__(self, path: str, min_length: int = 0, vocab_size: int | None = None):
        self.path, self.meta_path, self.vocab_size = path, f"{path}.meta", vocab_size
        offsets, lengths = self._read_index()
        keep = np.flatnonzero(lengths >= min_length) if min_length > 0 else np.arange(lengths.size)
        self.line_numbers = keep + 1  # 1-based, for messages
        self.offsets, self.lengths = offsets[keep], lengths[keep]
        self.num_documents = int(keep.size)
        self.num_dropped = int(lengths.size - keep.size)
        self.starts = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)  # as one stream
        self.num_tokens = int(self.starts[-1])
        self._cache: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()

    def _read_index(self) -> tuple[np.ndarray, np.ndarray]:
        if not os.path.isfile(self.meta_path):
            raise DataError(f"missing {self.meta_path}: every InternEvo .bin needs its .bin.meta index "
                            "(InternEvo's tools/tokenizer.py writes both)")
        try:
            with open(self.meta_path, "rb") as f:
                meta = np.load(f, allow_pickle=False)
        except (OSError, ValueError, EOFError) as e:
            raise DataError(f"{self.meta_path}: not a readable .meta index (numpy array of offsets and lengths): "
                            f"{e}") from None
        if meta.ndim != 2 or meta.shape[1] < 2 or meta.dtype.kind not in "iu":
            raise DataError(f"{self.meta_path}: expected an integer array [documents, 2] (offset, length), got "
                            f"{meta.dtype} {meta.shape}")
        offsets, lengths = meta[:, 0].astype(np.int64), meta[:, -1].astype(np.int64)
        self._check_index(offsets, lengths)
        return offsets, lengths

    def _check_index(self, offsets: np.ndarray, lengths: np.ndarray) -> None:
        size = os.path.getsize(self.path)
        where = f"{self.meta_path} does not match {self.path}"
        if offsets.size == 0:
            if size:
                raise DataError(f"{where}: the index is empty but the file holds {size} bytes")
            self._mm = None
            return
        if offsets[0] != 0 or (np.diff(offsets) <= 0).any() or offsets[-1] >= size:
            raise DataError(f"{where}: offsets must start at 0, increase, and stay below its size {size} bytes "
                            f"(truncated or a different file?)")
        if (lengths < 0).any():
            raise DataError(f"{where}: negative token counts")
        with open(self.path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        raw = np.frombuffer(self._mm, dtype=np.uint8)
        bad = np.flatnonzero(raw[offsets[1:] - 1] != ord("\n"))
        if bad.size:
            raise DataError(f"{where}: document {int(bad[0]) + 2} (byte {int(offsets[bad[0] + 1])}) does not start "
                            "a line")

    def document(self, i: int) -> np.ndarray:
        """Kept document ``i``'s ids (int64, signed as stored), checked against the index and the vocabulary."""
        hit = self._cache.get(i)
        if hit is not None:
            self._cache.move_to_end(i)
            return hit
        assert self._mm is not None
        start = int(self.offsets[i])
        end = self._mm.find(b"\n", start)
        line = self._mm[start:end if end >= 0 else len(self._mm)]
        where = f"{self.path}:{int(self.line_numbers[i])}"
        try:
            tokens = json.loads(line)["tokens"]
            ids = np.asarray(tokens, dtype=np.int64)
        except (ValueError, TypeError, KeyError) as e:
            raise DataError(f"{where}: not a JSON line {{\"tokens\": [ints]}}: {e}") from None
        if ids.ndim != 1 or ids.size != self.lengths[i]:
            raise DataError(f"{where}: {ids.size} tokens, but {self.meta_path} says {int(self.lengths[i])}")
        top = int(np.abs(ids).max()) if ids.size else 0
        if self.vocab_size is not None and top >= self.vocab_size:
            raise DataError(f"{where}: token id {top} is >= the model's vocab_size {self.vocab_size}")
        self._cache[i] = ids
        if len(self._cache) > _CACHE_DOCS:
            self._cache.popitem(last=False)
        return ids

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the kept documents back to back (TokenStream)."""
        stop = min(stop, self.num_tokens)
        if stop <= start:
            return np.zeros(0, dtype=np.int64)
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        last = int(np.searchsorted(self.starts, stop, side="left"))
        parts = [self.document(d) for d in range(first, last)]
        joined = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        base = int(self.starts[first])
        return joined[start - base:stop - base]

    def doc_starts_in(self, start: int, stop: int) -> np.ndarray:
        """Offsets ``s`` with ``start < s <= stop`` where a document starts (``num_tokens`` counts as one)."""
        lo = int(np.searchsorted(self.starts, start, side="right"))
        hi = int(np.searchsorted(self.starts, stop, side="right"))
        return np.unique(self.starts[lo:hi])


def open_internevo_folder(folder: str, min_length: int = 0, min_length_dict: Mapping[str, int] | None = None,
                          vocab_size: int | None = None) -> list[InternEvoFile]:
    """Every ``.bin`` of ``folder`` (InternEvo's order), its short documents left out; files left empty are
    skipped, as InternEvo skips them."""
    if not os.path.isdir(folder):
        raise DataError(f"data folder not found: {folder}")
    paths = find_internevo_files(folder)
    if not paths:
        raise DataError(f"{folder} holds no InternEvo .bin files")
    files = [InternEvoFile(p, _min_length_for(p, min_length, min_length_dict), vocab_size) for p in paths]
    kept = [f for f in files if f.num_documents]
    if not kept:
        raise DataError(f"no document of {folder} is at least data.min_length={min_length} tokens long")
    return kept
