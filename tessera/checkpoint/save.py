"""Saving a training checkpoint, in three phases every rank runs in order (``save_checkpoint`` composes them):

1. ``plan_save``: which files this rank writes and what goes in each; nothing is touched.
2. ``write_shards``: rank 0 makes the hidden ``.step_<N>.partial`` folder, the ranks agree it exists, every
   rank writes its files into it (``write_tree``), and the ranks agree every write succeeded.
3. ``commit_save``: rank 0 gathers every rank's file entries, writes meta.json last, renames the folder into
   place (the atomic folder commit: the checkpoint exists whole or not at all), prunes old checkpoints
   (``ckpt.keep_last``), and the ranks agree on the outcome.

After each agreement a failure on any rank (no space left, quota, I/O error) makes rank 0 remove the
partial folder and every rank raise the same ``CheckpointError``; the last complete checkpoint is never
touched. Tests inject faults by patching what a phase calls (``write_tree``, ``commit_folder``) in this
module, not through arguments.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from tessera.checkpoint.agreement import exchange_errors, gather_to_rank0, is_distributed
from tessera.checkpoint.errors import CheckpointError
from tessera.checkpoint.folders import PARTIAL, list_checkpoints, step_folder
from tessera.checkpoint.meta import new_meta, rng_name, shard_name, write_meta
from tessera.checkpoint.optim_shards import optim_shard_name
from tessera.checkpoint.state import TrainState
from tessera.checkpoint.tree import tree_nbytes, write_tree
from tessera.core.layout import Layout
from tessera.files import commit_folder, discard_folder, hidden_sibling, os_error_text
from tessera.parallel.coordination import reduce_scalars

__all__ = ["SavePlan", "plan_save", "write_shards", "commit_save", "prune_checkpoints", "save_checkpoint"]

logger = logging.getLogger("tessera")

Writer = Callable[[str, Any], dict[str, Any]]  # (path, state tree) -> its meta.json entry


@dataclass(frozen=True)
class SavePlan:
    """One rank's part of saving step ``step`` into ``folder``, decided before anything is written."""

    folder: str
    step: int
    final: str  # the step folder the commit publishes
    partial: str  # its hidden sibling, where every file is written first
    files: tuple[tuple[str, Any], ...]  # (file name, state tree) this rank writes
    planned_bytes: int  # the tensors of ``files``: reported when a disk or quota is full
    layout: Layout


def plan_save(folder: str, step: int, state: TrainState, layout: Layout) -> SavePlan:
    """This rank's files: the model shard (DP rank 0 of each TP rank), its optimizer shard (the ZeRO group of
    the DP-rank-0 replica, one file per ZeRO rank, as views of the live buffers: nothing gathered or copied on
    the device) and its per-rank components (RNG streams). Local: no collective, no file touched."""
    files: list[tuple[str, Any]] = []
    if layout.dp_rank == 0:
        files.append((shard_name("model", layout.tp_rank), dict(state.model.state_dict())))
    optimizer = state.optimizer
    if optimizer is not None and layout.dp_rank < optimizer.zero1_size:
        files.append((optim_shard_name(layout.tp_rank, layout.dp_rank), optimizer.shard_state_dict()))
    rank_state = state.rank_state_dict()
    if rank_state is not None:
        files.append((rng_name(layout.global_rank), rank_state))
    final = step_folder(folder, step)
    return SavePlan(folder=folder, step=step, final=final, partial=hidden_sibling(final, PARTIAL), files=tuple(files),
                    planned_bytes=sum(tree_nbytes(tree) for _, tree in files), layout=layout)


def write_shards(plan: SavePlan, writer: Writer | None = None) -> dict[str, Any]:
    """Write this rank's files into the partial folder; returns their meta.json entries. A collective: rank 0
    first makes the folder and every rank learns it exists, then every rank learns every write succeeded.
    ``writer`` writes one file (default ``write_tree``; the dry run plans without writing)."""
    error = _make_partial_folder(plan) if plan.layout.global_rank == 0 else None
    _agree(plan, error)  # also the barrier: nobody writes before the folder exists
    write = writer or write_tree
    entries: dict[str, Any] = {}
    try:
        for name, tree in plan.files:
            entries[name] = write(os.path.join(plan.partial, name), tree)
    except OSError as e:
        error = os_error_text(e)
    _agree(plan, error)
    return entries


def commit_save(plan: SavePlan, entries: dict[str, Any], state: TrainState, *, config: Mapping[str, Any] | None,
                keep_last: int = 0) -> str:
    """Publish the written files as ``plan.final``; returns it. A collective: every rank's ``entries`` go to
    rank 0, which writes meta.json, commits the folder and prunes to the newest ``keep_last`` checkpoints
    (0: all kept); then every rank learns whether the commit succeeded (the save's last barrier)."""
    gathered = gather_to_rank0(entries, plan.layout)
    error = None
    if plan.layout.global_rank == 0:
        assert gathered is not None  # rank 0 receives every rank's entries
        error = _publish(plan, gathered, state, config)
        if error is None and keep_last > 0:
            prune_checkpoints(plan.folder, keep_last)
    _agree(plan, error)
    return plan.final


def prune_checkpoints(folder: str, keep_last: int) -> None:
    """Remove all but the newest ``keep_last`` complete checkpoints; a removal that fails is logged, not
    raised (the new checkpoint is already published)."""
    for old in list_checkpoints(folder)[:-keep_last]:
        try:
            discard_folder(old)
        except OSError as e:
            logger.warning("could not remove the old checkpoint %s (ckpt.keep_last=%d): %s", old, keep_last,
                           os_error_text(e))


def save_checkpoint(folder: str, step: int, state: TrainState, *, config: Mapping[str, Any] | None, layout: Layout,
                    keep_last: int = 0, writer: Writer | None = None) -> str:
    """Save ``state`` as step ``step`` atomically; every rank must call this. Returns the final folder.

    Every component of ``state`` is written: the model shards, the optimizer shards (its
    ``shard_state_dict()``), the per-rank components in this rank's file and the others in meta.json.
    ``writer`` as for ``write_shards``.
    """
    plan = plan_save(folder, step, state, layout)
    entries = write_shards(plan, writer)
    return commit_save(plan, entries, state, config=config, keep_last=keep_last)


def _make_partial_folder(plan: SavePlan) -> str | None:
    """Rank 0: an empty partial folder (a leftover of an interrupted save of this step removed); the error
    text when it cannot be made."""
    try:
        os.makedirs(plan.folder, exist_ok=True)
        shutil.rmtree(plan.partial, ignore_errors=True)
        os.makedirs(plan.partial)
    except OSError as e:
        return os_error_text(e)
    return None


def _publish(plan: SavePlan, gathered: list[dict[str, Any]], state: TrainState,
             config: Mapping[str, Any] | None) -> str | None:
    """Rank 0: meta.json (every rank's file entries) written last, then the folder committed under its final
    name; the error text when either fails."""
    try:
        files: dict[str, Any] = {}
        for part in gathered:
            files.update(part)
        write_meta(plan.partial, new_meta(step=plan.step, layout=asdict(plan.layout),
                                          has_optimizer=state.optimizer is not None,
                                          trainer_state=state.state_dict(), config=config, files=files))
        commit_folder(plan.partial, plan.final)
    except OSError as e:
        return os_error_text(e)
    return None


def _agree(plan: SavePlan, error: str | None) -> None:
    """One agreement of the save (a collective, on every rank): when any rank failed, rank 0 removes the
    partial folder and every rank raises the same ``CheckpointError`` (the space it needs and has when a disk
    or quota was full, and the newest complete checkpoint, untouched)."""
    errors = exchange_errors(error)
    if not errors:
        return
    layout, folder = plan.layout, plan.folder
    if layout.global_rank == 0:
        shutil.rmtree(plan.partial, ignore_errors=True)
    full = any(m in e for e in errors for m in (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT)))
    free = shutil.disk_usage(folder).free if full and layout.global_rank == 0 and os.path.isdir(folder) else 0
    # the checkpoint's size (the ranks' tensors; the files add a little) and rank 0's view of the free
    # space once the partial folder is gone; also the barrier before anyone reports
    planned = plan.planned_bytes
    needed, free = ((int(v) for v in reduce_scalars([float(planned), float(free)], None)) if is_distributed()
                    else (planned, free))
    last = list_checkpoints(folder)
    space = f"; the checkpoint needs at least {_bytes(needed)}, {_bytes(free)} free" if full else ""
    raise CheckpointError(f"cannot save step {plan.step} in {folder}: {'; '.join(errors)}{space}; step_{plan.step} "
                          f"was not saved (its partial folder is removed), the last complete checkpoint is "
                          f"{last[-1] if last else 'none'}", every_rank=True)


def _bytes(n: int) -> str:
    return f"{n} bytes ({n / 2**30:.2f} GiB)" if n >= 2**30 else f"{n} bytes ({n / 2**20:.1f} MiB)"
