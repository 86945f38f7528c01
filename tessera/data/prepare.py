"""Turn text (files, folders, .jsonl) into train/valid token folders.

Preparation may loop per document (it runs once); reading is streamed so corpora larger than memory
work. The output appears atomically: everything is written under a temporary sibling folder that is
renamed into place only when complete, so a crash never leaves a half-written folder that looks done.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import re
import shutil
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tessera.data.errors import DataError
from tessera.data.token_file import META_FILE, TokenFileWriter
from tessera.data.tokenizer import ByteTokenizer, HFTokenizer
from tessera.files import commit_folder

DEFAULT_PATTERNS = ("*.txt", "*.md", "*.jsonl")


@dataclass
class Document:
    """One training document and where it came from (``path`` or ``path:line`` for .jsonl)."""

    text: str
    source: str
    invalid_utf8: bool = False


def list_input_files(paths: Sequence[str | os.PathLike], patterns: Sequence[str] = DEFAULT_PATTERNS) -> list[str]:
    """Files named directly, plus files under folders (recursively) matching any pattern; sorted per input."""
    out: list[str] = []
    for p in (os.fspath(path) for path in paths):  # not map(): mypy cannot pick fspath's overload
        if os.path.isfile(p):
            out.append(p)
        elif os.path.isdir(p):
            found = []
            for dirpath, dirnames, filenames in os.walk(p):
                dirnames[:] = [d for d in dirnames if not d.startswith(".")]
                found += [os.path.join(dirpath, f) for f in filenames
                          if any(fnmatch.fnmatch(f, pat) for pat in patterns)]
            if not found:
                raise DataError(f"input folder {p} has no files matching {list(patterns)}")
            out += sorted(found, key=lambda f: os.path.relpath(f, p))
        else:
            raise DataError(f"input not found: {p}")
    return out


def _decode(data: bytes) -> tuple[str, bool]:
    try:
        return data.decode("utf-8"), False
    except UnicodeDecodeError:
        return data.decode("utf-8", errors="replace"), True


def iter_documents(files: Sequence[str], jsonl_key: str = "text") -> Iterator[Document]:
    """A text file is one document; each line of a .jsonl file is one (its ``jsonl_key`` field)."""
    for path in files:
        if path.endswith(".jsonl"):
            with open(path, "rb") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"{path}:{lineno}: not valid JSON: {e}") from None
                    if not isinstance(record, dict) or not isinstance(record.get(jsonl_key), str):
                        raise DataError(f"{path}:{lineno}: expected an object with a string field {jsonl_key!r}")
                    yield Document(record[jsonl_key], f"{path}:{lineno}")
        else:
            with open(path, "rb") as f:
                text, bad = _decode(f.read())
            yield Document(text, path, bad)


def is_valid_document(index: int, valid_fraction: float = 0.0, valid_every_nth: int = 0) -> bool:
    """Whether input document ``index`` (0-based) is held out for validation.

    ``valid_every_nth=N``: documents N-1, 2N-1, ... (every Nth, counting from 1).
    ``valid_fraction=f``: the documents where floor((i+1)*f) steps up, i.e. evenly spread.
    """
    if valid_every_nth:
        return (index + 1) % valid_every_nth == 0
    if valid_fraction:
        return math.floor((index + 1) * valid_fraction) > math.floor(index * valid_fraction)
    return False


def prepare_corpus(
    documents: Iterable[Document],
    output: str | os.PathLike,
    tokenizer: ByteTokenizer | HFTokenizer,
    *,
    valid_fraction: float = 0.0,
    valid_every_nth: int = 0,
    created_by: str = "tessera.data.prepare",
    total: int | None = None,
    progress: bool = True,
    exist_ok: bool = False,
    overwrite: bool = False,
    extra_meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write ``output/train`` (and ``output/valid`` when anything is held out); return both metas.

    ``exist_ok``: a complete ``output`` made by someone else meanwhile is kept (cache semantics).
    ``overwrite``: replace an existing ``output``.
    """
    if valid_fraction and valid_every_nth:
        raise DataError("give valid_fraction or valid_every_nth, not both")
    if not 0 <= valid_fraction < 1:
        raise DataError(f"valid_fraction={valid_fraction} must be in [0, 1)")
    if valid_every_nth < 0 or valid_every_nth == 1:
        raise DataError(f"valid_every_nth={valid_every_nth} must be 0 (none) or >= 2")
    output = os.path.abspath(os.fspath(output))
    if os.path.exists(output) and not (overwrite or exist_ok):
        raise DataError(f"output folder {output} already exists (pass --overwrite to replace it)")
    os.makedirs(os.path.dirname(output), exist_ok=True)
    tmp = f"{output}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        metas = _write_splits(documents, tmp, tokenizer, valid_fraction, valid_every_nth, created_by, total,
                              progress, extra_meta or {})
        _publish(tmp, output, exist_ok=exist_ok, overwrite=overwrite)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return metas


def _write_splits(documents: Iterable[Document], folder: str, tokenizer: ByteTokenizer | HFTokenizer,
                  valid_fraction: float, valid_every_nth: int, created_by: str, total: int | None,
                  progress: bool, extra_meta: dict[str, Any]) -> dict[str, Any]:
    from tqdm import tqdm

    writers = {s: TokenFileWriter(os.path.join(folder, s), tokenizer, created_by) for s in ("train", "valid")}
    invalid = {"train": 0, "valid": 0}
    tokens = {"train": 0, "valid": 0}  # without the end-of-document tokens the writers add
    sources: dict[str, None] = {}  # the first input files, for messages (a .jsonl line's source is "file:line")
    bar = tqdm(total=total, unit="doc", desc="tokenizing", disable=not progress)
    batch: list[tuple[str, Document]] = []

    def flush() -> None:
        ids: Sequence[Sequence[int] | np.ndarray]
        if isinstance(tokenizer, HFTokenizer):
            ids = tokenizer.encode_batch([d.text for _, d in batch])
        else:
            ids = [tokenizer.encode_array(d.text) for _, d in batch]
        for (split, doc), toks in zip(batch, ids):
            writers[split].add(toks, len(doc.text.encode("utf-8")), doc.source)
            invalid[split] += doc.invalid_utf8
            tokens[split] += len(toks)
            if len(sources) <= 5:
                sources.setdefault(re.sub(r":\d+$", "", doc.source) if ".jsonl:" in doc.source else doc.source)
        bar.update(len(batch))
        batch.clear()

    for i, doc in enumerate(documents):
        batch.append(("valid" if is_valid_document(i, valid_fraction, valid_every_nth) else "train", doc))
        if len(batch) >= 256:
            flush()
    flush()
    bar.close()
    if writers["train"].num_documents == 0:
        raise DataError("no training documents: the inputs are empty or everything was held out")
    for split, w in writers.items():
        if w.num_documents and not tokens[split]:
            shown = list(sources)[:5]
            more = ", ..." if len(sources) > len(shown) else ""
            raise DataError(f"every {split} document tokenizes to nothing ({w.num_documents} documents from "
                            f"{', '.join(shown)}{more}): the inputs are empty or hold only what the tokenizer "
                            "drops; nothing was written")
    rule = (f"every {valid_every_nth}th document" if valid_every_nth else
            f"fraction {valid_fraction}, evenly spread" if valid_fraction else "none")
    metas: dict[str, Any] = {"valid": None}
    for split, w in writers.items():
        if split == "valid" and w.num_documents == 0:
            w.discard()
            continue
        metas[split] = w.close({"split": split, "valid_rule": rule,
                                "num_invalid_utf8_documents": invalid[split], **extra_meta})
    return metas


def _publish(tmp: str, output: str, exist_ok: bool, overwrite: bool) -> None:
    """Commit the finished temporary folder as ``output`` (an old one is replaced only with ``overwrite``)."""
    try:
        commit_folder(tmp, output, replace=overwrite)
    except OSError as e:
        if exist_ok and os.path.isfile(os.path.join(output, "train", META_FILE)):
            return  # a concurrent preparer finished first; theirs is equivalent
        raise DataError(f"cannot move prepared data into {output}: it exists and is not a complete token folder") from e
