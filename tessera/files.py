"""Crash-safe file primitives: sha256 of a file, fsync, atomic file writes and the atomic folder commit.

Token folders, the corpus cache and checkpoints all publish their output through these, so a crash
never leaves a half-written file or folder under its final name. Imports nothing from tessera.

The folder protocol: build the folder under a temporary sibling name, then ``commit_folder`` it. An
existing folder of that name is never deleted first: it is renamed aside to ``.<name>.replaced``, the
new folder renamed into place, the parent fsynced, and only then the old copy deleted. After a crash
at any point, either ``<name>`` is complete (old or new) or the old copy waits, complete, under
``.<name>.replaced`` for the reader's tidy-up to put back. ``discard_folder`` removes a folder the same
way round: out of sight first (``.<name>.deleting``), then deleted.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable

__all__ = ["sha256_file", "fsync_file", "fsync_dir", "publish_file", "atomic_write", "atomic_write_text",
           "hidden_sibling", "commit_folder", "discard_folder", "folder_write_problem", "os_error_text", "REPLACED",
           "DELETING"]

REPLACED = "replaced"  # suffix of the previous copy of a folder while its new copy is renamed into place
DELETING = "deleting"  # suffix of a folder being removed


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_file(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    try:
        fsync_file(path)
    except OSError:  # some filesystems do not support fsync on directories
        pass


def publish_file(tmp: str, path: str) -> None:
    """Make the finished file ``tmp`` durable and rename it to ``path`` (then fsync the folder)."""
    fsync_file(tmp)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def atomic_write(path: str, write: Callable[[str], None]) -> None:
    """Create ``path`` by ``write(tmp)`` on the temporary name ``path + ".tmp"``, then ``publish_file``:
    ``path`` holds either nothing (or its old content) or the whole file."""
    tmp = path + ".tmp"
    write(tmp)
    publish_file(tmp, path)


def atomic_write_text(path: str, text: str) -> None:
    """``atomic_write`` of a UTF-8 text file."""
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    atomic_write(path, write)


def hidden_sibling(path: str, what: str) -> str:
    """``<parent>/.<name>.<what>``: a name next to ``path`` that listings of ``<name>``-like folders skip."""
    path = os.path.normpath(path)
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{what}")


def commit_folder(partial: str, final: str, *, replace: bool = True) -> None:
    """Publish the complete folder ``partial`` as ``final`` (a sibling on the same filesystem), crash-safely.

    With ``replace`` an existing ``final`` is moved aside to ``.<name>.replaced`` (never deleted first)
    and deleted only once the new folder is in place. Without it, an existing non-empty ``final`` makes
    the rename raise ``OSError``, so of several concurrent writers the first one wins.
    """
    final = os.path.normpath(final)
    aside = None
    if replace and os.path.exists(final):
        aside = hidden_sibling(final, REPLACED)
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    try:
        os.replace(partial, final)
    except BaseException:
        if aside is not None and not os.path.exists(final):
            os.replace(aside, final)
        raise
    fsync_dir(os.path.dirname(final) or ".")
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def discard_folder(path: str) -> None:
    """Remove a folder crash-safely: rename it out of sight (``.<name>.deleting``) first, then delete it.

    Deleting in place could die half-way and leave a folder that still looks complete next to missing files.
    """
    trash = hidden_sibling(path, DELETING)
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def os_error_text(e: OSError) -> str:
    """``path: reason`` of a failed file operation (``path -> other: reason`` for a rename), as an error line
    shows it; the exception's own text when it names no file."""
    if not (e.filename and e.strerror):
        return str(e)
    where = f"{e.filename} -> {e.filename2}" if e.filename2 else f"{e.filename}"
    return f"{where}: {e.strerror}"


def folder_write_problem(path: str | os.PathLike) -> str | None:
    """None when ``path`` is a folder this process can create files in (created if missing), else why not:
    ``cannot create ...`` / ``... is not a folder`` / ``cannot write in ...``, with the system's reason."""
    path = os.fspath(path)
    try:
        os.makedirs(path, exist_ok=True)
    except FileExistsError:
        return f"{path} exists and is not a folder"
    except OSError as e:
        return f"cannot create {e.filename or path}: {e.strerror or e}"
    try:
        fd, probe = tempfile.mkstemp(dir=path, prefix=".write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"cannot write in {path}: {e.strerror or e}"
    return None
