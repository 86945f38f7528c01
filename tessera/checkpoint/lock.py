"""One writer per save folder: an advisory lock (``flock``) on ``<folder>/.tessera.lock``.

Two runs writing ``step_*`` folders into one save folder (a requeued job whose predecessor still runs,
the same command typed twice) would each tidy up the other's partial saves and interleave their steps.
A process that writes into a save folder holds its lock: ``train.py`` (rank 0, for the whole run) and
the offline tools while they write a step folder. A second writer is refused at once, with a message
naming the folder and the holder (host, pid, slurm job, start time) that the holder wrote into the lock
file. Readers (``ckpt.load_ckpt_folder``, inference, conversion's source) take no lock.

Why ``flock``: the kernel drops it when the holder's last file descriptor closes, so a process killed
in any way (``kill -9`` included) never leaves a stale lock; the file it leaves behind is taken by the
next run at once. On a local file system and on NFSv4 (Linux emulates ``flock`` with byte-range locks
there) the lock holds across processes and nodes; on Lustre it holds across nodes with the ``flock``
mount option, only within a node with ``localflock``, and where a file system refuses locks (Lustre
without either) the run goes on with a warning that a second run would not be detected.

A holder that finishes removes the file while it still holds the lock; a process that opened the old
file meanwhile finds, once it gets the lock, that the file at the path is no longer the one it locked,
and starts over. Within one process the lock is re-entrant (a tool's write inside a run's lifetime).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass

from tessera.checkpoint.errors import CheckpointError

__all__ = ["LOCK_FILE", "FolderLock", "hold_folder", "folder_lock", "release_held_folders", "lock_holder"]

logger = logging.getLogger("tessera")

LOCK_FILE = ".tessera.lock"
# errors meaning "this file system does not do flock", not "someone holds it"
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


@dataclass
class FolderLock:
    """A held lock: the open lock file (its descriptor carries the lock) and how many holders share it here."""

    folder: str
    path: str
    fd: int | None  # None: the file system does not support the lock; nothing is held
    count: int = 1


_HELD: dict[str, FolderLock] = {}  # by the folder's real path: this process's locks


def hold_folder(folder: str) -> FolderLock:
    """Take ``folder``'s lock for this process (until ``release`` or exit); ``CheckpointError`` when another
    process holds it. The folder is created if missing."""
    key = os.path.realpath(folder)
    held = _HELD.get(key)
    if held is not None:
        held.count += 1
        return held
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, LOCK_FILE)
    fd = _lock_file(path, folder)
    if fd is not None:
        _write_holder(fd)
    if not _HELD:
        atexit.register(release_held_folders)
    held = _HELD[key] = FolderLock(folder, path, fd)
    return held


def release(lock: FolderLock) -> None:
    """Give one hold back; the last one removes the lock file (while still locked) and unlocks."""
    lock.count -= 1
    if lock.count > 0:
        return
    _HELD.pop(os.path.realpath(lock.folder), None)
    if lock.fd is None:
        return
    with contextlib.suppress(OSError):
        if _same_file(lock.fd, lock.path):
            os.unlink(lock.path)
    os.close(lock.fd)  # unlocks
    lock.fd = None


def release_held_folders() -> None:
    """Release every lock this process holds (at exit; before ``os._exit``, which skips ``atexit``)."""
    for lock in list(_HELD.values()):
        lock.count = 1
        release(lock)


@contextlib.contextmanager
def folder_lock(folder: str) -> Iterator[FolderLock]:
    """``hold_folder`` for the duration of a block (an offline tool writing one step folder)."""
    lock = hold_folder(folder)
    try:
        yield lock
    finally:
        release(lock)


def lock_holder(folder: str) -> str | None:
    """Who wrote ``folder``'s lock file (``pid 12 on host h, slurm job 7, since ...``); None if unreadable."""
    try:
        with open(os.path.join(folder, LOCK_FILE), encoding="utf-8") as f:
            info = json.loads(f.read())
        parts = [f"pid {info['pid']} on host {info['host']}"]
        if info.get("slurm_job"):
            parts.append(f"slurm job {info['slurm_job']}")
        parts.append(f"since {info['started']}")
        return ", ".join(parts)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _lock_file(path: str, folder: str) -> int | None:
    """An open descriptor of the lock file at ``path``, locked; None where the file system has no locks."""
    while True:
        fd = _open(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = lock_holder(folder) or "a process that has not said who it is yet"
            raise CheckpointError(
                f"{folder} is in use by another run ({holder}): two runs must not save into one folder; wait for "
                f"that run to end or stop it, or save into another folder (the lock is {path}, released when "
                "that process exits)") from None
        except OSError as e:
            os.close(fd)
            if e.errno not in _UNSUPPORTED:
                raise
            logger.warning("cannot lock %s (%s): this file system does not support flock (Lustre: mount with "
                           "-o flock); a second run saving into %s would not be detected", path,
                           e.strerror or e, folder)
            return None
        if _same_file(fd, path):
            return fd
        os.close(fd)  # the holder we waited behind removed that file: lock the one at the path now


def _open(path: str) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except PermissionError:  # someone else's lock file: a read-only descriptor locks as well
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)


def _same_file(fd: int, path: str) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        st, mine = os.stat(path), os.fstat(fd)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _write_holder(fd: int) -> None:
    """Say who holds the lock, for the message of whoever is refused (fsynced: NFS clients read it from the
    server)."""
    info = {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job": os.environ.get("SLURM_JOB_ID"),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": " ".join(sys.argv)[:500]}
    with contextlib.suppress(OSError):  # a read-only lock file still locks; the holder just stays unnamed
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        os.fsync(fd)
