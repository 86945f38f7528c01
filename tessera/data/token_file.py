"""The on-disk token format: write it, open it (memory-mapped) and validate it.

A token folder holds

- ``tokens.bin``: every document's token ids followed by the end-of-document (EOD) id, back to back,
  little-endian uint16 when the vocabulary fits, else uint32;
- ``docs.idx``: little-endian int64 offsets into tokens.bin, ``num_documents + 1`` of them: document
  ``i`` (its EOD included) is ``tokens[idx[i]:idx[i+1]]``; ``idx[0] == 0`` and ``idx[-1] == num_tokens``;
- ``meta.json``: format version, tokenizer description, dtype, counts, file sizes and sha256;
- ``tokenizer.json`` for a Hugging Face tokenizer (a copy, so the folder stands alone);
- ``sources.json`` (optional): the source name of each document, for provenance and tests.

The EOD is stored in the file so that the packed training stream *is* tokens.bin: a row is a slice.
A train/valid folder is one such set, or sub-folders (shards) that each hold one.
"""

from __future__ import annotations

import array
import datetime
import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from typing import Any

import numpy as np

from tessera import __version__
from tessera.data.errors import DataError
from tessera.data.tokenizer import AnyTokenizer, ByteTokenizer, load_tokenizer
from tessera.data.vocab import vocab_advice
from tessera.files import atomic_write_text, sha256_file

FORMAT = "tessera-tokens"
FORMAT_VERSION = 1
TOKENS_FILE = "tokens.bin"
INDEX_FILE = "docs.idx"
META_FILE = "meta.json"
SOURCES_FILE = "sources.json"
_CHUNK = 1 << 24  # tokens per chunk when scanning a file (64 MiB of uint32)


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id of a vocabulary."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


class TokenFileWriter:
    """Streams documents into a new token folder; ``close()`` writes meta.json last.

    meta.json is written last so a folder without it is visibly incomplete.
    """

    def __init__(self, folder: str | os.PathLike, tokenizer: AnyTokenizer, created_by: str,
                 record_sources: bool = True):
        self.folder = os.fspath(folder)
        os.makedirs(self.folder, exist_ok=True)
        if os.listdir(self.folder):
            raise DataError(f"refusing to write token files into non-empty folder {self.folder}")
        self.tokenizer = tokenizer
        self.created_by = created_by
        self.dtype = dtype_for_vocab(tokenizer.vocab_size)
        self._file = open(os.path.join(self.folder, TOKENS_FILE), "wb")
        self._hash = hashlib.sha256()
        self._offsets = array.array("q", [0])  # compact: corpora may hold many millions of documents
        self._num_bytes = 0
        self._max_id = -1
        self._sources: list[str] | None = [] if record_sources else None
        self._eod = np.array([tokenizer.eod_id], dtype=self.dtype)

    @property
    def num_documents(self) -> int:
        return len(self._offsets) - 1

    def add(self, tokens: Sequence[int] | np.ndarray, num_bytes: int, source: str | None = None) -> None:
        """Append one document (its EOD is added here). ``num_bytes``: its UTF-8 size in the source."""
        arr = np.asarray(tokens)
        if arr.size:
            lo, hi = int(arr.min()), int(arr.max())
            if lo < 0 or hi >= self.tokenizer.vocab_size:
                raise DataError(f"tokenizer produced id {hi if hi >= 0 else lo} outside its vocab "
                                f"{self.tokenizer.vocab_size} for document {source or self.num_documents}")
            self._max_id = max(self._max_id, hi)
        data = np.concatenate([arr.astype(self.dtype, copy=False), self._eod]).tobytes()
        self._file.write(data)
        self._hash.update(data)
        self._offsets.append(self._offsets[-1] + arr.size + 1)
        self._num_bytes += int(num_bytes)
        self._max_id = max(self._max_id, self.tokenizer.eod_id)
        if self._sources is not None:
            self._sources.append(source or "")

    def discard(self) -> None:
        """Abandon the folder (e.g. a split that received no documents)."""
        self._file.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    def close(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Finish the files and write meta.json; returns the meta dict."""
        self._file.close()
        if self.num_documents == 0:
            raise DataError(f"no documents were written to {self.folder}")
        index_path = os.path.join(self.folder, INDEX_FILE)
        np.frombuffer(self._offsets, dtype=np.int64).astype("<i8").tofile(index_path)
        tok_desc = self.tokenizer.describe()
        if not isinstance(self.tokenizer, ByteTokenizer):  # the folder stands alone: a copy of the file
            name = self.tokenizer.folder_file
            shutil.copyfile(self.tokenizer.path, os.path.join(self.folder, name))
            tok_desc.update(file=name, source_path=os.path.abspath(self.tokenizer.path),
                            sha256=sha256_file(self.tokenizer.path))
        if self._sources is not None:
            with open(os.path.join(self.folder, SOURCES_FILE), "w", encoding="utf-8") as f:
                json.dump(self._sources, f, indent=0)
        num_tokens = self._offsets[-1]
        meta = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "tokenizer": tok_desc,
            "vocab_size": self.tokenizer.vocab_size,
            "eod_id": self.tokenizer.eod_id,
            "dtype": self.dtype.name,
            "eod_appended": True,
            "num_documents": self.num_documents,
            "num_tokens": num_tokens,
            "num_bytes": self._num_bytes,
            "max_token_id": self._max_id,
            "files": {
                TOKENS_FILE: {"size": num_tokens * self.dtype.itemsize, "sha256": self._hash.hexdigest()},
                INDEX_FILE: {"size": (self.num_documents + 1) * 8, "sha256": sha256_file(index_path)},
            },
            "created_by": f"tessera {__version__} ({self.created_by})",
            "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        meta.update(extra or {})
        atomic_write_text(os.path.join(self.folder, META_FILE), json.dumps(meta, indent=2) + "\n")
        return meta


class TokenShard:
    """One token folder, memory-mapped read-only and validated at open.

    Validation is cheap but complete enough that a corrupt or mismatched file fails here, naming the
    file, instead of as a CUDA index error or a silent garbage loss hours later: file sizes against
    meta.json, the index against the token count, every document ending in EOD, and (one chunked pass)
    the largest token id against ``vocab_size``.
    """

    def __init__(self, folder: str | os.PathLike, vocab_size: int | None = None, check_ids: bool = True):
        self.folder = os.fspath(folder)
        self.meta = _read_meta(self.folder)
        m = self.meta
        self.dtype = np.dtype(m["dtype"]).newbyteorder("<")
        self.num_tokens = int(m["num_tokens"])
        self.num_documents = int(m["num_documents"])
        self.eod_id = int(m["eod_id"])
        self.tokens_path = os.path.join(self.folder, TOKENS_FILE)
        self.index_path = os.path.join(self.folder, INDEX_FILE)
        if self.num_tokens <= 0 or self.num_documents <= 0:
            raise DataError(f"{os.path.join(self.folder, META_FILE)}: empty token file "
                            f"({self.num_documents} documents, {self.num_tokens} tokens)")
        _check_size(self.tokens_path, self.num_tokens * self.dtype.itemsize,
                    f"{self.num_tokens} {self.dtype.name} tokens")
        _check_size(self.index_path, (self.num_documents + 1) * 8, f"{self.num_documents}+1 int64 offsets")
        self.tokens = np.memmap(self.tokens_path, dtype=self.dtype, mode="r", shape=(self.num_tokens,))
        self.offsets = np.memmap(self.index_path, dtype="<i8", mode="r", shape=(self.num_documents + 1,))
        self._check_index()
        if check_ids:
            if vocab_size is not None and vocab_size < int(m["vocab_size"]):
                self._check_ids(vocab_size, "the model's vocab_size")
            else:
                self._check_ids(int(m["vocab_size"]), "its tokenizer's vocab_size (file corrupt?)")

    def _check_index(self) -> None:
        off = self.offsets
        if off[0] != 0 or off[-1] != self.num_tokens:
            raise DataError(f"{self.index_path}: document offsets run from {int(off[0])} to {int(off[-1])}, "
                            f"expected 0 to num_tokens={self.num_tokens}")
        for a in range(0, off.size - 1, _CHUNK):
            chunk = np.asarray(off[a:a + _CHUNK + 1])
            steps = np.diff(chunk)
            if steps.size and steps.min() <= 0:
                i = a + int(np.argmax(steps <= 0))
                raise DataError(f"{self.index_path}: offsets not increasing at document {i} "
                                f"({int(off[i])} -> {int(off[i + 1])})")
            ends = np.asarray(self.tokens[chunk[1:] - 1])
            if ends.size and (ends != self.eod_id).any():
                i = a + int(np.argmax(ends != self.eod_id))
                raise DataError(f"{self.index_path} does not match {self.tokens_path}: document {i} ends with "
                                f"token {int(ends[i - a])} at offset {int(off[i + 1]) - 1}, "
                                f"not the EOD id {self.eod_id}")

    def _check_ids(self, limit: int, what: str) -> None:
        """One chunked pass over the file (the smaller of the two limits implies the other)."""
        for a in range(0, self.num_tokens, _CHUNK):
            chunk = np.asarray(self.tokens[a:a + _CHUNK])
            if int(chunk.max()) >= limit:
                pos = int(np.argmax(chunk >= limit))
                made = int(self.meta["vocab_size"])
                advice = f"; use {vocab_advice(made)}" if limit < made else ""
                raise DataError(f"{self.tokens_path}: token id {int(chunk[pos])} at position {a + pos} is >= "
                                f"{what} {limit}; the data was made with a vocab of {made} "
                                f"({self.meta['tokenizer'].get('kind')} tokenizer){advice}")

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` (clipped to the file) as int64."""
        return np.asarray(self.tokens[start:min(stop, self.num_tokens)], dtype=np.int64)

    def doc_starts_in(self, start: int, stop: int) -> np.ndarray:
        """Offsets ``s`` with ``start < s <= stop`` where a document starts (``num_tokens`` counts as one)."""
        lo = int(np.searchsorted(self.offsets, start, side="right"))
        hi = int(np.searchsorted(self.offsets, stop, side="right"))
        return np.asarray(self.offsets[lo:hi], dtype=np.int64)

    def tokenizer(self) -> AnyTokenizer:
        return load_tokenizer(self.meta, self.folder)


def _check_size(path: str, expected: int, what: str) -> None:
    if not os.path.isfile(path):
        raise DataError(f"missing token file {path}")
    size = os.path.getsize(path)
    if size != expected:
        kind = "truncated" if size < expected else "too large"
        raise DataError(f"{path} is {kind}: {size} bytes, meta.json says {expected} ({what})")


def _read_meta(folder: str) -> dict[str, Any]:
    path = os.path.join(folder, META_FILE)
    if not os.path.isfile(path):
        raise DataError(f"missing {path}: not a token folder (make one with tools/prepare_data.py)")
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"cannot read {path}: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DataError(f"{path}: not a {FORMAT} meta file")
    if meta.get("format_version") != FORMAT_VERSION:
        raise DataError(f"{path}: format_version {meta.get('format_version')} is not supported "
                        f"(this tessera reads {FORMAT_VERSION})")
    for key in ("tokenizer", "vocab_size", "eod_id", "dtype", "num_documents", "num_tokens", "files"):
        if key not in meta:
            raise DataError(f"{path}: missing key {key!r}")
    if meta["dtype"] not in ("uint16", "uint32"):
        raise DataError(f"{path}: dtype {meta['dtype']!r} must be uint16 or uint32")
    return meta


def find_shards(folder: str | os.PathLike) -> list[str]:
    """The token folders in ``folder``: itself when it holds meta.json, else its sub-folders that do."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise DataError(f"data folder not found: {folder}")
    if os.path.isfile(os.path.join(folder, META_FILE)):
        return [folder]
    subs = sorted(
        os.path.join(folder, d) for d in os.listdir(folder)
        if os.path.isfile(os.path.join(folder, d, META_FILE))
    )
    if subs:
        return subs
    if os.path.exists(os.path.join(folder, TOKENS_FILE)):
        raise DataError(f"missing {os.path.join(folder, META_FILE)} next to {TOKENS_FILE} "
                        "(incomplete preparation?)")
    raise DataError(f"data folder {folder} holds no token files (expected {META_FILE}, {TOKENS_FILE} and "
                    f"{INDEX_FILE}, or sub-folders holding them); make them with tools/prepare_data.py")


def open_token_folder(folder: str | os.PathLike, vocab_size: int | None = None) -> list[TokenShard]:
    """Open and validate every shard of a train/valid folder; all must share one tokenizer."""
    shards = [TokenShard(p, vocab_size=vocab_size) for p in find_shards(folder)]
    first = shards[0]
    for s in shards[1:]:
        a = {k: v for k, v in first.meta["tokenizer"].items() if k != "source_path"}
        b = {k: v for k, v in s.meta["tokenizer"].items() if k != "source_path"}
        if a != b:
            raise DataError(f"shards {first.folder} and {s.folder} were made with different tokenizers: {a} vs {b}")
    return shards
