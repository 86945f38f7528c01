"""The demo corpus: the Python standard library's own source, byte-tokenized on first use.

Which files: every ``*.py`` under ``sysconfig.get_paths()["stdlib"]`` -- the standard library's own
source, its test suites included -- skipping what is not stdlib source: third-party code
(``site-packages``, ``dist-packages``), byte-code caches, build configuration (``config-*``) and
hidden folders. A few test files are deliberately not valid UTF-8; they are decoded with replacement
characters (counted in meta.json). Files are sorted by their path relative to the stdlib root; each
file is one document; every 20th file (the 20th, 40th, ...) is held out for validation.

The prepared folder lives in ``cache_folder`` under a name keyed by the Python version, the stdlib
location and the token format version, so another interpreter never reuses a wrong cache. Rank 0
prepares (atomically: temp folder, then rename) while the others wait on ``barrier``.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from collections.abc import Callable

from tessera.data.errors import DataError
from tessera.data.prepare import prepare_corpus
from tessera.data.readers import Document, iter_documents
from tessera.data.token_file import FORMAT_VERSION, META_FILE
from tessera.data.tokenizer import ByteTokenizer

VALID_EVERY_NTH = 20
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
CORPUS_VERSION = 2  # bump when the file selection changes, so old caches are not reused


def stdlib_root() -> str:
    return os.path.realpath(sysconfig.get_paths()["stdlib"])


def _excluded(dirname: str) -> bool:
    return dirname in EXCLUDED_DIRS or dirname.startswith(".") or dirname.startswith("config-")


def stdlib_files(root: str | None = None, max_files: int | None = None) -> list[str]:
    """The corpus files, sorted by path relative to ``root``; ``max_files`` keeps the first N (tests)."""
    root = root or stdlib_root()
    if not os.path.isdir(root):
        raise DataError(f"Python standard library folder not found: {root}")
    rel: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not _excluded(d)]
        base = os.path.relpath(dirpath, root)
        rel += [os.path.normpath(os.path.join(base, f)) for f in filenames if f.endswith(".py")]
    rel.sort(key=lambda p: p.replace(os.sep, "/"))
    if max_files is not None:
        rel = rel[:max_files]
    return [os.path.join(root, p) for p in rel]


def cache_key(root: str | None = None, max_files: int | None = None) -> str:
    """Folder name of the prepared corpus for this interpreter (version + stdlib location + format)."""
    root = root or stdlib_root()
    v = sys.version_info
    where = hashlib.sha256(f"{sys.implementation.cache_tag}:{root}".encode()).hexdigest()[:12]
    subset = f"-first{max_files}" if max_files is not None else ""
    return f"stdlib-py{v.major}.{v.minor}.{v.micro}-{where}-v{FORMAT_VERSION}.{CORPUS_VERSION}{subset}"


def stdlib_corpus_folder(cache_folder: str | os.PathLike, max_files: int | None = None) -> str:
    """Where ``prepare_stdlib_corpus`` keeps this Python's corpus in ``cache_folder``."""
    return os.path.join(os.path.abspath(os.fspath(cache_folder)), cache_key(stdlib_root(), max_files))


def stdlib_corpus_ready(cache_folder: str | os.PathLike, max_files: int | None = None) -> bool:
    """Whether ``cache_folder`` already holds the prepared corpus (then nothing is written there)."""
    return os.path.isfile(os.path.join(stdlib_corpus_folder(cache_folder, max_files), "train", META_FILE))


def prepare_stdlib_corpus(
    cache_folder: str | os.PathLike,
    *,
    is_main: bool = True,
    barrier: Callable[[], None] | None = None,
    max_files: int | None = None,
    progress: bool = False,
) -> str:
    """Return the prepared corpus folder (holding ``train/`` and ``valid/``), preparing it if needed.

    With a ``barrier`` (e.g. ``lambda: dist.barrier(group)``), only ``is_main`` prepares and everyone
    waits; ``cache_folder`` must then be visible to all ranks. Without one, the caller prepares if
    the cache is missing (concurrent preparers are safe: the first rename wins).
    """
    root = stdlib_root()
    target = stdlib_corpus_folder(cache_folder, max_files)
    done = os.path.join(target, "train", META_FILE)
    if (is_main or barrier is None) and not os.path.isfile(done):
        files = stdlib_files(root, max_files)
        if len(files) < VALID_EVERY_NTH:
            raise DataError(f"only {len(files)} stdlib files under {root}; need at least {VALID_EVERY_NTH}")
        docs = (Document(d.text, os.path.relpath(d.source, root).replace(os.sep, "/"), d.invalid_utf8,
                         d.input_bytes)
                for d in iter_documents(files, strict_utf8=False))
        try:
            prepare_corpus(docs, target, ByteTokenizer(), valid_every_nth=VALID_EVERY_NTH,
                           created_by="tessera.data.stdlib_corpus", total_bytes=sum(map(os.path.getsize, files)),
                           progress=progress,
                           exist_ok=True, extra_meta={"source_root": root, "python": sys.version.split()[0]})
        except DataError as e:  # a failed write: the file error itself, which train.py names with data.cache_folder
            if isinstance(e.__cause__, OSError):
                raise e.__cause__ from None
            raise
    if barrier is not None:
        barrier()
    if not os.path.isfile(done):
        raise DataError(f"stdlib corpus missing at {target} after preparation; with several ranks, "
                        "data.cache_folder must be on a filesystem they all see")
    return target
