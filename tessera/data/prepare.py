"""Turn documents (from ``readers``: text, JSON lines, Parquet, datasets folders) into train/valid token
folders.

Reading is streamed so corpora larger than memory work; tokenizing runs on ``workers`` processes
(``tokenize_pool``) and the output is the same bytes whatever their number. The output appears atomically:
everything is written under a temporary sibling folder that is renamed into place only when complete, so a
crash never leaves a half-written folder that looks done.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

from tessera.data.errors import DataError
from tessera.data.readers import DEFAULT_PATTERNS, Document, iter_documents, list_input_files
from tessera.data.token_file import META_FILE, TokenFileWriter
from tessera.data.tokenize_pool import TokenizePool
from tessera.data.tokenizer import AnyTokenizer
from tessera.files import commit_folder, os_error_text

__all__ = ["DEFAULT_PATTERNS", "Document", "is_valid_document", "iter_documents", "list_input_files",
           "prepare_corpus"]
_BATCH_DOCS, _BATCH_CHARS = 256, 1 << 20  # one batch of work for a tokenizer worker

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
    tokenizer: AnyTokenizer,
    *,
    valid_fraction: float = 0.0,
    valid_every_nth: int = 0,
    created_by: str = "tessera.data.prepare",
    total_bytes: int | None = None,
    progress: bool = True,
    exist_ok: bool = False,
    overwrite: bool = False,
    extra_meta: dict[str, Any] | None = None,
    workers: int = 1,
) -> dict[str, Any]:
    """Write ``output/train`` (and ``output/valid`` when anything is held out); return both metas, and
    under ``"stats"`` what was read and how fast (documents, text bytes, seconds, workers).

    ``total_bytes``: the inputs' size, for the progress bar's ETA (documents report ``input_bytes``).
    ``exist_ok``: a complete ``output`` made by someone else meanwhile is kept (cache semantics).
    ``overwrite``: replace an existing ``output``. ``workers``: tokenizer processes (1: this one).
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
        with _writing(output):
            splits = _Splits(tmp, tokenizer, created_by)
        stats = splits.fill(documents, valid_fraction, valid_every_nth, workers, progress, total_bytes, output)
        with _writing(output):
            metas = splits.close(valid_fraction, valid_every_nth, extra_meta or {})
        _publish(tmp, output, exist_ok=exist_ok, overwrite=overwrite)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    metas["stats"] = stats
    return metas


@contextlib.contextmanager
def _writing(output: str) -> Iterator[None]:
    """A failed write (a full disk, a quota, an I/O error) becomes one ``DataError`` naming ``output`` (the
    ``OSError`` chained as its cause); the caller removes the temporary folder, so nothing under ``output`` looks
    complete."""
    try:
        yield
    except OSError as e:
        raise DataError(f"cannot write the prepared data for {output}: {os_error_text(e)}; nothing was kept "
                        "(free space or choose another --output, then run again)") from e


def _batches(documents: Iterable[Document], valid_fraction: float, valid_every_nth: int
             ) -> Iterator[list[tuple[str, Document]]]:
    """(split, document) pairs in batches of work for one tokenizer call."""
    batch: list[tuple[str, Document]] = []
    chars = 0
    for i, doc in enumerate(documents):
        batch.append(("valid" if is_valid_document(i, valid_fraction, valid_every_nth) else "train", doc))
        chars += len(doc.text)
        if len(batch) >= _BATCH_DOCS or chars >= _BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


class _Splits:
    """The train and valid writers of one preparation, and what they received."""

    def __init__(self, folder: str, tokenizer: AnyTokenizer, created_by: str):
        self.writers = {s: TokenFileWriter(os.path.join(folder, s), tokenizer, created_by) for s in ("train", "valid")}
        self.invalid = {"train": 0, "valid": 0}
        self.tokens = {"train": 0, "valid": 0}  # without the end-of-document tokens the writers add
        self.sources: dict[str, None] = {}  # the first input files, for messages
        self.tokenizer = tokenizer

    def fill(self, documents: Iterable[Document], valid_fraction: float, valid_every_nth: int, workers: int,
             progress: bool, total_bytes: int | None, output: str) -> dict[str, Any]:
        """Tokenize every document (on ``workers`` processes) into its split's writer, in input order.
        ``output``: the final folder, named when a write fails."""
        from tqdm import tqdm

        bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing",
                   disable=not progress, smoothing=0.1)
        pending: collections.deque[list[tuple[str, Document]]] = collections.deque()
        docs = text_bytes = 0
        start = time.perf_counter()

        def texts() -> Iterator[list[str]]:
            for batch in _batches(documents, valid_fraction, valid_every_nth):
                pending.append(batch)
                yield [d.text for _, d in batch]

        with TokenizePool(self.tokenizer, workers) as pool:
            for ids in pool.map(texts()):
                batch = pending.popleft()
                for (split, doc), toks in zip(batch, ids):
                    n = len(doc.text.encode("utf-8"))
                    with _writing(output):
                        self.writers[split].add(toks, n, doc.source)
                    self.invalid[split] += doc.invalid_utf8
                    self.tokens[split] += len(toks)
                    text_bytes += n
                    if len(self.sources) <= 5:
                        self.sources.setdefault(re.sub(r":(\d+|row \d+)$", "", doc.source))
                docs += len(batch)
                bar.update(sum(d.input_bytes for _, d in batch))
                bar.set_postfix_str(f"{docs} docs, {text_bytes / 2**20:.1f} MiB text", refresh=False)
        bar.close()
        seconds = time.perf_counter() - start
        return {"documents": docs, "text_bytes": text_bytes, "seconds": seconds, "workers": workers,
                "text_mb_per_s": text_bytes / 1e6 / max(seconds, 1e-9)}

    def close(self, valid_fraction: float, valid_every_nth: int, extra_meta: dict[str, Any]) -> dict[str, Any]:
        if self.writers["train"].num_documents == 0:
            raise DataError("no training documents: the inputs are empty or everything was held out")
        for split, w in self.writers.items():
            if w.num_documents and not self.tokens[split]:
                shown = list(self.sources)[:5]
                more = ", ..." if len(self.sources) > len(shown) else ""
                raise DataError(f"every {split} document tokenizes to nothing ({w.num_documents} documents from "
                                f"{', '.join(shown)}{more}): the inputs are empty or hold only what the tokenizer "
                                "drops; nothing was written")
        rule = (f"every {valid_every_nth}th document" if valid_every_nth else
                f"fraction {valid_fraction}, evenly spread" if valid_fraction else "none")
        metas: dict[str, Any] = {"valid": None}
        for split, w in self.writers.items():
            if split == "valid" and w.num_documents == 0:
                w.discard()
                continue
            metas[split] = w.close({"split": split, "valid_rule": rule,
                                    "num_invalid_utf8_documents": self.invalid[split], **extra_meta})
        return metas


def _publish(tmp: str, output: str, exist_ok: bool, overwrite: bool) -> None:
    """Commit the finished temporary folder as ``output`` (an old one is replaced only with ``overwrite``)."""
    try:
        commit_folder(tmp, output, replace=overwrite)
    except OSError as e:
        if exist_ok and os.path.isfile(os.path.join(output, "train", META_FILE)):
            return  # a concurrent preparer finished first; theirs is equivalent
        raise DataError(f"cannot move prepared data into {output}: it exists and is not a complete token folder") from e
