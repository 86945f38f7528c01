"""``data.type='text'``: raw corpora (every format ``tools/prepare_data.py`` reads) tokenized when a run starts.

Why through a cache of token folders rather than tokens streamed into the batches: the training order is a
permutation of all rows of the corpus (``sampler.py``), and the number of rows is known only once every
document is tokenized, so even a streaming loader could not start its first step sooner and keep the order a
prepared folder gives. So the run does what ``prepare_data.py`` does, with the same code (``prepare_corpus``:
the same readers, the same ``TokenizePool`` worker processes, the same writer) into
``data.cache_folder/text-KEY``, and trains on that folder as ``data.type='tokens'`` trains on a prepared one:
the same rows, batches and resume position, bit for bit.

``KEY`` is a hash of everything that decides the token files: each input file's path, size and modification
time (a changed corpus is tokenized again; its content is not hashed, so a second run starts at once), the
tokenizer (its description and its file's sha256) and the reader and split settings. A resumed run or a sweep
over precision settings finds the folder and tokenizes nothing. With several ranks, ``is_main`` tokenizes while
the others wait on ``barrier``; the folder appears atomically (temp folder, then rename), so concurrent
preparers are safe.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tessera.data.errors import DataError
from tessera.data.prepare import prepare_corpus
from tessera.data.readers import CONFIG_KEYS, DEFAULT_PATTERNS, input_size, iter_documents, list_input_files
from tessera.data.token_file import FORMAT_VERSION, META_FILE
from tessera.data.tokenize_pool import default_workers
from tessera.data.tokenizer import AnyTokenizer, ByteTokenizer, build_tokenizer
from tessera.files import sha256_file

__all__ = ["CACHE_VERSION", "text_cache_folder", "text_corpus_folders", "text_tokenizer"]

logger = logging.getLogger(__name__)
CACHE_VERSION = 1  # bump when what decides the token files changes, so old caches are not reused


def text_tokenizer(text: Mapping[str, Any]) -> AnyTokenizer:
    """The tokenizer ``data.text`` names (``prepare_data.py``'s ``--tokenizer``, ``--eod-token``, ``--add-bos``)."""
    return build_tokenizer(text["tokenizer"], eod_token=text["eod_token"], add_bos=text["add_bos"])


def _fingerprint(path: str) -> list[Any]:
    """What identifies one input without reading it: its files' paths, sizes and modification times (a
    ``save_to_disk`` folder's every file)."""
    if os.path.isdir(path):
        files = sorted(os.path.join(dp, f) for dp, _, fs in os.walk(path) for f in fs)
    else:
        files = [path]
    out: list[Any] = []
    for f in files:
        st = os.stat(f)
        out.append([os.path.abspath(f), st.st_size, st.st_mtime_ns])
    return out


def _tokenizer_identity(tokenizer: AnyTokenizer) -> dict[str, Any]:
    ident = dict(tokenizer.describe())
    if not isinstance(tokenizer, ByteTokenizer):
        ident["sha256"] = sha256_file(tokenizer.path)
    return ident


def text_cache_folder(cache_folder: str, files: Sequence[str], tokenizer: AnyTokenizer, settings: Mapping[str, Any]
                      ) -> str:
    """``cache_folder/text-KEY`` for these inputs, this tokenizer and these reader/split settings."""
    try:
        inputs = [_fingerprint(f) for f in files]
    except OSError as e:
        raise DataError(f"cannot read {e.filename}: {e.strerror or e}") from None
    key = {"cache_version": CACHE_VERSION, "format_version": FORMAT_VERSION, "inputs": inputs,
           "tokenizer": _tokenizer_identity(tokenizer), "settings": dict(settings)}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return os.path.join(os.path.abspath(cache_folder), f"text-{digest}")


def _ready(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, "train", META_FILE))


def _prepared(what: str, inputs: str, text: Mapping[str, Any], tokenizer: AnyTokenizer, cache_folder: str,
              hold_out: bool, is_main: bool, barrier: Callable[[], None] | None, progress: bool) -> str:
    """The cache folder of ``inputs`` (``data.train_folder`` or ``data.valid_folder``, named by ``what``),
    tokenized here when this rank prepares and it is missing; ``hold_out``: apply data.text's valid rule."""
    files = list_input_files([inputs], text["patterns"] or DEFAULT_PATTERNS)
    settings = {"text_column": text["text_column"], "hf_split": text["hf_split"],
                "valid_fraction": float(text["valid_fraction"]) if hold_out else 0.0,
                "valid_every_nth": int(text["valid_every_nth"]) if hold_out else 0}
    folder = text_cache_folder(cache_folder, files, tokenizer, settings)
    if (is_main or barrier is None) and not _ready(folder):
        workers = text["workers"] or default_workers()
        start = time.perf_counter()
        logger.info("data.type='text': tokenizing %s=%s (%d file%s) on %d worker%s into %s", what, inputs,
                    len(files), "s" * (len(files) != 1), workers, "s" * (workers != 1), folder)
        metas = prepare_corpus(
            iter_documents(files, settings["text_column"], hf_split=settings["hf_split"], names=CONFIG_KEYS),
            folder, tokenizer, valid_fraction=settings["valid_fraction"], valid_every_nth=settings["valid_every_nth"],
            created_by="data.type='text'", total_bytes=sum(map(input_size, files)), progress=progress,
            exist_ok=True, workers=workers, extra_meta={"text_inputs": os.path.abspath(inputs), **settings})
        st = metas["stats"]
        logger.info("data.type='text': %d documents, %.1f MB of text in %.1f s (%.2f MB/s)", st["documents"],
                    st["text_bytes"] / 1e6, time.perf_counter() - start, st["text_mb_per_s"])
    else:  # train.py's data line names the folder in use
        logger.debug("data.type='text': %s=%s already tokenized in %s", what, inputs, folder)
    return folder


def text_corpus_folders(data: Mapping[str, Any], *, is_main: bool = True, barrier: Callable[[], None] | None = None,
                        progress: bool = False) -> tuple[str, str | None]:
    """(train token folder, valid token folder or None) of a ``data`` section with ``type='text'``.

    Validation: the documents data.text's rule holds out of ``train_folder`` (as ``prepare_data.py``'s
    ``--valid-fraction`` / ``--valid-every-nth``), or every document of ``valid_folder``. With a ``barrier``,
    only ``is_main`` tokenizes and everyone waits; ``data.cache_folder`` must then be visible to every rank.
    """
    text, cache = data["text"], data["cache_folder"]
    tokenizer = text_tokenizer(text)
    train = _prepared("data.train_folder", data["train_folder"], text, tokenizer, cache, True, is_main, barrier,
                      progress)
    valid_source = None
    if data["valid_folder"]:
        valid_source = _prepared("data.valid_folder", data["valid_folder"], text, tokenizer, cache, False, is_main,
                                 barrier, progress)
    if barrier is not None:
        barrier()
    for folder in (train, valid_source):
        if folder is not None and not _ready(folder):
            raise DataError(f"the tokenized data is missing at {folder} after rank 0 made it; with several ranks, "
                            "data.cache_folder must be on a filesystem they all see")
    if valid_source is not None:
        return f"{train}/train", f"{valid_source}/train"  # every document of valid_folder went to its 'train' split
    held_out = os.path.join(train, "valid")
    return f"{train}/train", held_out if os.path.isfile(os.path.join(held_out, META_FILE)) else None
