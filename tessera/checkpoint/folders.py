"""Step folders in a save folder: names, discovery, publishing, tidying up after interrupted saves.

A step folder ``step_<N>`` is built under ``.step_<N>.partial`` and published with the atomic folder
commit of ``tessera.files`` (a re-saved step's previous copy waits under ``.step_<N>.replaced``; a
removed one passes through ``.step_<N>.deleting``). Only ``step_<N>`` folders holding ``meta.json``
count as checkpoints; ``clean_partial_checkpoints`` resolves every hidden leftover.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
from collections.abc import Iterator

from tessera.checkpoint.errors import CheckpointError
from tessera.checkpoint.lock import folder_lock
from tessera.checkpoint.meta import META_FILE
from tessera.files import DELETING, REPLACED, commit_folder, hidden_sibling

__all__ = ["PARTIAL", "step_folder", "step_of", "list_checkpoints", "resolve_step_folder", "output_step_folder",
           "new_step_folder", "clean_partial_checkpoints"]

logger = logging.getLogger("tessera")

PARTIAL = "partial"  # suffix of a step folder being written
_STEP_DIR = re.compile(r"^step_(\d+)$")
_HIDDEN = re.compile(rf"^\.step_(\d+)\.({PARTIAL}|{REPLACED}|{DELETING})$")


def step_folder(folder: str, step: int) -> str:
    return os.path.join(folder, f"step_{step}")


def step_of(path: str) -> int:
    m = _STEP_DIR.match(os.path.basename(os.path.normpath(path)))
    if not m:
        raise CheckpointError(f"{path} is not a checkpoint folder (expected a name like step_100)")
    return int(m.group(1))


def list_checkpoints(folder: str) -> list[str]:
    """Complete checkpoint folders (those with meta.json), oldest first."""
    if not folder or not os.path.isdir(folder):
        return []
    found = []
    for name in os.listdir(folder):
        full = os.path.join(folder, name)
        m = _STEP_DIR.match(name)
        if m and os.path.isfile(os.path.join(full, META_FILE)):
            found.append((int(m.group(1)), full))
    return [p for _, p in sorted(found)]


def resolve_step_folder(path: str) -> str:
    """A ``step_<N>`` folder as is; a save folder (holding step folders) -> its newest complete step."""
    path = os.path.normpath(path)
    if os.path.isfile(os.path.join(path, META_FILE)):
        return path
    found = list_checkpoints(path)
    if found:
        return found[-1]
    raise CheckpointError(f"{path} is neither a checkpoint step folder (no meta.json) "
                          "nor a folder of step_<N> checkpoints")


def output_step_folder(dst: str, step: int) -> str:
    """``dst`` itself when it is named ``step_<N>``, else ``dst/step_<step>`` (a save folder train.py resumes from)."""
    base = os.path.basename(os.path.normpath(dst))
    if _STEP_DIR.match(base):
        return os.path.normpath(dst)
    return step_folder(dst, step)


@contextlib.contextmanager
def new_step_folder(final: str, *, overwrite: bool = False) -> Iterator[str]:
    """Yield ``.<name>.partial`` to fill (one process); it is committed as ``final`` if the block succeeds.

    The save folder holding ``final`` is locked meanwhile (``tessera.checkpoint.lock``): a run saving there
    makes this a ``CheckpointError`` naming it, before anything is written."""
    final = os.path.normpath(final)
    with folder_lock(os.path.dirname(final) or "."):
        if os.path.exists(final) and not overwrite:
            raise CheckpointError(f"{final} already exists; remove it or pass --overwrite")
        partial = hidden_sibling(final, PARTIAL)
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
        try:
            yield partial
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        commit_folder(partial, final)


def clean_partial_checkpoints(folder: str) -> list[str]:
    """Tidy up after interrupted saves (called on rank 0); returns the folders removed.

    ``.step_<N>.partial`` (a save that never completed) and ``.step_<N>.deleting`` (a removal that
    never completed) are deleted, as is a ``step_<N>`` without ``meta.json``. A ``.step_<N>.replaced``
    is the complete previous copy of a step being re-saved: it is put back when the save died before
    its new copy took its place, else deleted.
    """
    removed: list[str] = []
    if not folder or not os.path.isdir(folder):
        return removed
    for name in sorted(os.listdir(folder)):
        full = os.path.join(folder, name)
        hidden = _HIDDEN.match(name)
        if hidden and hidden.group(2) == REPLACED:
            final = os.path.join(folder, f"step_{hidden.group(1)}")
            if not os.path.exists(final) and os.path.isfile(os.path.join(full, META_FILE)):
                logger.warning("restoring %s from %s (a re-save of that step was interrupted)", final, full)
                os.replace(full, final)
                continue
        incomplete = _STEP_DIR.match(name) and not os.path.isfile(os.path.join(full, META_FILE))
        if hidden or name.endswith(f".{PARTIAL}") or incomplete:
            logger.warning("removing incomplete checkpoint folder %s (an interrupted save)", full)
            shutil.rmtree(full, ignore_errors=True)
            removed.append(full)
    return removed
