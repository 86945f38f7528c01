"""Corpus readers: documents out of text, JSON lines (plain, gzip, zstd), Parquet and ``save_to_disk`` folders.

Every reader streams (a line, a record batch or a row group at a time), so corpora larger than memory
work; every bad record is a ``DataError`` naming the file and the line or row. ``formats.file_format``
decides which reader a file gets; no file is ever read as text unless it is UTF-8 text.

Each ``Document`` carries ``input_bytes``: how much of its input file it accounts for (compressed
bytes for compressed files), so a progress bar over the input sizes shows a true rate and ETA.
"""

from __future__ import annotations

import fnmatch
import gzip
import io
import json
import os
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any

from tessera.data.errors import DataError
from tessera.data.formats import (
    HF_DATASET,
    JSONL,
    JSONL_GZ,
    JSONL_ZST,
    PARQUET,
    file_format,
    is_hf_dataset_folder,
    require,
)

__all__ = ["CONFIG_KEYS", "DEFAULT_PATTERNS", "Document", "SettingNames", "TOOL_FLAGS", "input_size", "iter_documents",
           "list_input_files"]

DEFAULT_PATTERNS = ("*.txt", "*.md", "*.jsonl", "*.jsonl.gz", "*.jsonl.zst", "*.parquet")
_BATCH_ROWS = 1024  # rows per record batch read from Parquet / Arrow


@dataclass(frozen=True)
class SettingNames:
    """How the caller's user names the readers' settings, for the hints of their errors: prepare_data.py's flags,
    or train.py's ``data.text`` keys (a hint naming the other tool's spelling sends the user nowhere)."""

    text_column: str
    hf_split: str


TOOL_FLAGS = SettingNames("--text-column", "--hf-split")  # tools/prepare_data.py
CONFIG_KEYS = SettingNames("data.text.text_column", "data.text.hf_split")  # train.py's data.type='text'


@dataclass
class Document:
    """One training document and where it came from (``path``, ``path:line`` or ``path:row N``)."""

    text: str
    source: str
    invalid_utf8: bool = False
    input_bytes: int = 0


def list_input_files(paths: Sequence[str | os.PathLike], patterns: Sequence[str] = DEFAULT_PATTERNS) -> list[str]:
    """Files named directly, plus files under folders (recursively) matching any pattern; sorted per input.
    A ``save_to_disk`` folder is one input, named as such or found under a folder."""
    out: list[str] = []
    for p in (os.fspath(path) for path in paths):  # not map(): mypy cannot pick fspath's overload
        if os.path.isfile(p) or is_hf_dataset_folder(p):
            out.append(p)
        elif os.path.isdir(p):
            found = []
            for dirpath, dirnames, filenames in os.walk(p):
                dirnames[:] = [d for d in dirnames if not d.startswith(".")]
                datasets = [d for d in dirnames if is_hf_dataset_folder(os.path.join(dirpath, d))]
                found += [os.path.join(dirpath, d) for d in datasets]
                dirnames[:] = [d for d in dirnames if d not in datasets]
                found += [os.path.join(dirpath, f) for f in filenames
                          if any(fnmatch.fnmatch(f, pat) for pat in patterns)]
            if not found:
                raise DataError(f"input folder {p} has no files matching {list(patterns)}")
            out += sorted(found, key=lambda f: os.path.relpath(f, p))
        else:
            raise DataError(f"input not found: {p}")
    return out


def input_size(path: str) -> int:
    """Bytes of an input (a folder's data files summed): the total of a progress bar."""
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(path) for f in fs)
    return os.path.getsize(path)


def iter_documents(files: Sequence[str], text_column: str = "text", strict_utf8: bool = True,
                   hf_split: str = "train", names: SettingNames = TOOL_FLAGS) -> Iterator[Document]:
    """The documents of ``files`` in order: a text file is one, a JSON line or a table row is one.

    ``text_column``: the field (JSON) or column (Parquet, datasets) holding the text. ``strict_utf8``:
    text that is not valid UTF-8 is an error (False: replaced and counted, for the stdlib demo corpus,
    which holds a few deliberately invalid files). ``hf_split``: the split of a ``DatasetDict`` folder.
    ``names``: how the user sets ``text_column`` and ``hf_split``, named by the errors' hints.
    """
    for path in files:
        try:
            yield from _file_documents(path, text_column, strict_utf8, hf_split, names)
        except OSError as e:  # e.g. permission denied: a read problem, never reported as a write problem
            raise DataError(f"cannot read {path}: {e.strerror or e}") from None


def _file_documents(path: str, text_column: str, strict_utf8: bool, hf_split: str,
                    names: SettingNames) -> Iterator[Document]:
    """The documents of one input (see ``iter_documents``)."""
    fmt = file_format(path, check_text=strict_utf8)
    if fmt == JSONL:
        with open(path, "rb") as f:
            yield from _jsonl(path, f, f, text_column, names)
    elif fmt == JSONL_GZ:
        with open(path, "rb") as raw, gzip.GzipFile(fileobj=raw, mode="rb") as gz:
            yield from _jsonl(path, gz, raw, text_column, names)
    elif fmt == JSONL_ZST:
        zstd: Any = require("zstandard", f"reading {path}")
        with open(path, "rb") as raw:
            yield from _jsonl(path, io.BufferedReader(_ZstdFrames(raw, zstd)), raw, text_column, names)
    elif fmt == PARQUET:
        yield from _parquet(path, text_column, names)
    elif fmt == HF_DATASET:
        yield from _hf_dataset(path, text_column, hf_split, names)
    else:
        yield _text_file(path, strict_utf8)


def _text_file(path: str, strict_utf8: bool) -> Document:
    with open(path, "rb") as f:
        data = f.read()
    try:
        return Document(data.decode("utf-8"), path, False, len(data))
    except UnicodeDecodeError as e:
        if strict_utf8:
            raise DataError(f"{path}: not UTF-8 text (invalid byte at offset {e.start}); convert it to UTF-8 or "
                            "leave it out") from None
        return Document(data.decode("utf-8", errors="replace"), path, True, len(data))


_STREAM_ERRORS: tuple[type[BaseException], ...] = (OSError, EOFError, zlib.error)


def _jsonl(path: str, lines: Iterable[bytes], raw: IO[bytes], key: str, names: SettingNames) -> Iterator[Document]:
    """One document per non-blank line; ``raw`` is the file on disk (its position is the progress)."""
    lineno, done = 0, 0
    it = iter(lines)
    while True:
        try:
            line = next(it)
        except StopIteration:
            return
        except _STREAM_ERRORS + _zstd_errors() as e:
            raise DataError(f"{path}: corrupt or truncated compressed data after line {lineno}: {e}") from None
        lineno += 1
        pos = raw.tell()
        used, done = pos - done, pos
        if not line.strip():
            continue
        try:
            record = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise DataError(f"{path}:{lineno}: not UTF-8 (invalid byte at column {e.start + 1})") from None
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: not valid JSON: {e}") from None
        if not isinstance(record, dict) or not isinstance(record.get(key), str):
            raise DataError(f"{path}:{lineno}: {_not_a_text_record(record, key, names)}")
        yield Document(record[key], f"{path}:{lineno}", False, used)


def _not_a_text_record(record: Any, key: str, names: SettingNames) -> str:
    """Why a JSON line gives no document, with the fields it has (so the right text column can be named)."""
    if not isinstance(record, dict):
        return f"expected a JSON object with a string field {key!r}, got {type(record).__name__}"
    fields = ", ".join(map(repr, record)) or "none"
    problem = (f"no field {key!r}" if key not in record
               else f"field {key!r} holds {type(record[key]).__name__}, not a string")
    return f"{problem}; its fields: {fields} (name the text field with {names.text_column})"


class _ZstdFrames(io.RawIOBase):
    """Every frame of a zstd file, decompressed, as a raw byte stream; an unfinished frame at the end of
    the file raises ``EOFError``.

    zstandard's own ``stream_reader`` returns end-of-file, without a word, for a frame cut short (an
    interrupted download) and by default stops after the first frame: both would drop documents silently.
    """

    _READ = 1 << 18  # compressed bytes fed per step

    def __init__(self, raw: IO[bytes], zstd: Any):
        self._raw, self._dctx = raw, zstd.ZstdDecompressor()
        self._frame: Any = None  # the decompressor of the frame under way (None: between frames)
        self._unfed = b""  # compressed bytes read past the end of the last frame
        self._out = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._out:
            if not self._decompress_more():
                return 0
        n = min(len(buffer), len(self._out))
        buffer[:n] = self._out[:n]
        self._out = self._out[n:]
        return n

    def _decompress_more(self) -> bool:
        """Decompress one more step into ``_out``; False at the end of the file after a finished frame."""
        data, self._unfed = self._unfed or self._raw.read(self._READ), b""
        if not data:
            if self._frame is not None:
                raise EOFError("the file ends inside a zstd frame (cut short, e.g. an interrupted download)")
            return False
        if self._frame is None:
            self._frame = self._dctx.decompressobj()
        self._out = self._frame.decompress(data)
        if self._frame.eof:
            self._unfed, self._frame = self._frame.unused_data, None
        return True


def _zstd_errors() -> tuple[type[BaseException], ...]:
    try:
        import zstandard
    except ImportError:
        return ()
    return (zstandard.ZstdError,)


def _text_batches(path: str, batches: Iterator[Any], column: str, rows: int) -> Iterator[Document]:
    """Documents of Arrow record batches holding one string column; ``rows``: the total (for progress)."""
    share = input_size(path) / max(rows, 1)
    row, done = 0, 0.0
    for batch in batches:
        col = batch.column(0)
        if col.null_count:
            bad = row + next(i for i, v in enumerate(col.is_valid().to_pylist()) if not v)
            raise DataError(f"{path}: row {bad}: column {column!r} is null")
        for text in col.to_pylist():
            done += share
            yield Document(text, f"{path}:row {row}", False, int(done) - int(done - share))
            row += 1


def _string_column(path: str, schema: Any, column: str, names: SettingNames) -> None:
    pa: Any = require("pyarrow", f"reading {path}")
    columns = list(schema.names)
    hint = f"name the text column with {names.text_column}"
    if column not in columns:
        raise DataError(f"{path}: no column {column!r} (columns: {columns}); {hint}")
    kind = schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or str(kind) == "string_view"):
        raise DataError(f"{path}: column {column!r} holds {kind}, not text; {hint}")


def _parquet(path: str, column: str, names: SettingNames) -> Iterator[Document]:
    """Row groups streamed, only ``column`` read: the file is never in memory whole."""
    pa: Any = require("pyarrow", f"reading {path}")
    pq: Any = require("pyarrow.parquet", f"reading {path}")
    try:
        pf = pq.ParquetFile(path)
        _string_column(path, pf.schema_arrow, column, names)
        batches = pf.iter_batches(batch_size=_BATCH_ROWS, columns=[column])
        yield from _text_batches(path, batches, column, pf.metadata.num_rows)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: cannot read Parquet: {e}") from None


def _hf_dataset(folder: str, column: str, split: str, names: SettingNames) -> Iterator[Document]:
    """A ``save_to_disk`` folder: state.json lists Arrow stream files (memory-mapped, read batch by batch)."""
    dict_file = os.path.join(folder, "dataset_dict.json")
    if os.path.isfile(dict_file):
        splits = _json_file(dict_file).get("splits", [])
        if split not in splits:
            raise DataError(f"{dict_file}: no split {split!r} (splits: {splits}); choose one with {names.hf_split}")
        folder = os.path.join(folder, split)
    state_file = os.path.join(folder, "state.json")
    files = _json_file(state_file).get("_data_files")
    if not isinstance(files, list) or not all(isinstance(f, dict) and "filename" in f for f in files):
        raise DataError(f"{state_file}: no '_data_files' list of {{'filename': ...}}: not written by save_to_disk")
    pa: Any = require("pyarrow", f"reading {folder}")
    for entry in files:
        path = os.path.join(folder, entry["filename"])
        if not os.path.isfile(path):
            raise DataError(f"{state_file} lists {entry['filename']}, which is missing")
        try:
            with pa.memory_map(path) as source:
                reader = pa.ipc.open_stream(source)
                _string_column(path, reader.schema, column, names)
                batches = (b.select([column]) for b in reader)
                table_rows = _arrow_rows(path)
                yield from _text_batches(path, batches, column, table_rows)
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{path}: cannot read the Arrow data: {e}") from None


def _arrow_rows(path: str) -> int:
    pa: Any = require("pyarrow", f"reading {path}")
    with pa.memory_map(path) as source:
        return sum(b.num_rows for b in pa.ipc.open_stream(source))


def _json_file(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise DataError(f"{path}: expected a JSON object")
    return data
