"""What kind of corpus file a path is: decided from its name, then checked against its first bytes.

Why both: a name alone lets a ``.parquet`` renamed ``.txt`` (or any binary file) be tokenized as one
text document, silently wrong training data; content alone cannot tell JSON lines from prose. So the
name picks the reader, the leading bytes must agree with it, and a file of no known format is refused
(``DataError`` naming it), never read as text.
"""

from __future__ import annotations

import os

from tessera.data.errors import DataError

__all__ = ["EXTRAS", "FORMATS", "HF_DATASET", "JSONL", "JSONL_GZ", "JSONL_ZST", "PARQUET", "TEXT", "binary_kind",
           "file_format", "is_hf_dataset_folder", "require"]

TEXT, JSONL, JSONL_GZ, JSONL_ZST, PARQUET, HF_DATASET = "text", "jsonl", "jsonl.gz", "jsonl.zst", "parquet", "hf"
FORMATS = {
    TEXT: "UTF-8 text, one document per file (.txt, .md, ...)",
    JSONL: "JSON lines, one document per line (.jsonl)",
    JSONL_GZ: "gzip-compressed JSON lines (.jsonl.gz)",
    JSONL_ZST: "zstd-compressed JSON lines (.jsonl.zst)",
    PARQUET: "Parquet, one document per row (.parquet)",
    HF_DATASET: "a Hugging Face datasets folder written by save_to_disk",
}
# the optional package each reader needs, and the extra of setup.py that installs it
EXTRAS = {"pyarrow": "parquet", "zstandard": "zstd", "sentencepiece": "sentencepiece", "tokenizers": "tokenizers"}

_MAGIC = (
    (b"\x1f\x8b", "gzip data"), (b"\x28\xb5\x2f\xfd", "zstd data"), (b"PAR1", "Parquet"),
    (b"PK\x03\x04", "a zip archive"), (b"BZh", "bzip2 data"), (b"\xfd7zXZ\x00", "xz data"),
    (b"ARROW1", "an Arrow file"), (b"\xff\xff\xff\xff", "an Arrow stream"), (b"\x93NUMPY", "a numpy array"),
    (b"\x89PNG", "a PNG image"), (b"\xff\xd8\xff", "a JPEG image"), (b"%PDF", "a PDF"), (b"\x7fELF", "an executable"),
    (b"\x80\x02", "a pickle"), (b"\x80\x04", "a pickle"), (b"SQLite format 3", "SQLite"),
)
_SUFFIXES = ((".jsonl.gz", JSONL_GZ), (".jsonl.zst", JSONL_ZST), (".jsonl.zstd", JSONL_ZST), (".jsonl", JSONL),
             (".parquet", PARQUET))
_RENAME = {"gzip data": "*.jsonl.gz (gzip-compressed JSON lines)",
           "zstd data": "*.jsonl.zst (zstd-compressed JSON lines)", "Parquet": "*.parquet"}
_EXPECTED_MAGIC = {JSONL_GZ: b"\x1f\x8b", JSONL_ZST: b"\x28\xb5\x2f\xfd", PARQUET: b"PAR1"}


def is_hf_dataset_folder(path: str) -> bool:
    """A ``Dataset.save_to_disk`` folder (state.json) or a ``DatasetDict`` one (dataset_dict.json)."""
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f))
                                       for f in ("state.json", "dataset_dict.json"))


def binary_kind(head: bytes) -> str | None:
    """What binary format ``head`` (a file's first bytes) starts like, or None when it may be text."""
    for magic, kind in _MAGIC:
        if head.startswith(magic):
            return kind
    if b"\x00" in head:
        return "binary data (NUL bytes)"
    return None


def file_format(path: str, check_text: bool = True) -> str:
    """The reader for ``path`` (one of FORMATS); a DataError when its content contradicts its name.
    ``check_text=False``: a file of no other format is text whatever its bytes (the stdlib demo corpus)."""
    if is_hf_dataset_folder(path):
        return HF_DATASET
    name = os.path.basename(path).lower()
    fmt = next((f for suffix, f in _SUFFIXES if name.endswith(suffix)), TEXT)
    with open(path, "rb") as f:
        head = f.read(4096)
    expected = _EXPECTED_MAGIC.get(fmt)
    if expected is not None:
        if head and not head.startswith(expected):
            raise DataError(f"{path}: named as {FORMATS[fmt]} but its content is not ({binary_kind(head) or 'text'})")
        return fmt
    kind = binary_kind(head) if check_text else None
    if kind in _RENAME:
        raise DataError(f"{path}: {kind}, not text; prepare_data reads it when named {_RENAME[kind]}")
    if kind:
        raise DataError(f"{path}: {kind}, not a format prepare_data reads (it reads: {'; '.join(FORMATS.values())})")
    return fmt


def require(module: str, what: str) -> object:
    """Import an optional package, or a DataError naming the extra that installs it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        top = module.split(".")[0]
        raise DataError(f"{what} needs the '{top}' package: pip install 'tessera[{EXTRAS[top]}]'") from None
