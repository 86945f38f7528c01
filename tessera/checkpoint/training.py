"""Checkpoints during training: every rank saves its part, loads its part (resharded when the TP size
changed), and all ranks agree on which checkpoint to resume from.

Every file is written through ``write_tree`` into ``.step_<N>.partial``; rank 0 writes meta.json last
and publishes the folder with the atomic folder commit. Auto-resume tries complete checkpoints newest
first. Before any collective of a load, every rank checks the files it will read (present, size and
sha256 as meta.json lists them) and all ranks agree on the verdict, exchanging the error texts (on the
device of the group's backend: NCCL refuses CPU tensors): a file damaged or missing on one rank's side
makes all ranks skip that step together, and every rank logs which file on which rank was bad. A
second agreement after every attempt catches what only the load itself finds.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist

from tessera.checkpoint.errors import CheckpointError
from tessera.checkpoint.folders import PARTIAL, clean_partial_checkpoints, list_checkpoints, step_folder
from tessera.checkpoint.meta import new_meta, read_meta, rng_name, shard_files, shard_name, verify_files, write_meta
from tessera.checkpoint.optim_shards import OptimizerShards, optim_shard_files, optim_shard_name
from tessera.checkpoint.reshard import model_param_dims, reshard_tree
from tessera.checkpoint.state import TrainState
from tessera.checkpoint.tree import read_tree, tree_nbytes, write_tree
from tessera.core.layout import Layout
from tessera.files import commit_folder, discard_folder, hidden_sibling, os_error_text
from tessera.parallel.comm import reduce_scalars, share_texts

__all__ = ["save_checkpoint", "load_checkpoint", "find_resumable_checkpoint"]

logger = logging.getLogger("tessera")


# ---------------------------------------------------------------------------------------- collectives
def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _dist():
        dist.barrier()


def _gather_to_rank0(obj: Any, layout: Layout) -> list[Any] | None:
    if not _dist() or layout.world_size == 1:
        return [obj]
    out = [None] * layout.world_size if layout.global_rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def _all_agree(ok: bool) -> bool:
    """True only when ``ok`` holds on every rank (so all ranks take the same branch)."""
    if not _dist():
        return ok
    # on the device the default group's backend serves: NCCL refuses a CPU flag
    return bool(reduce_scalars([1 if ok else 0], None, op=dist.ReduceOp.MIN, dtype=torch.int32)[0])


def _exchange_errors(error: str | None) -> list[str]:
    """Every rank's error text, the same list on every rank; ``[]`` when no rank has one. A collective.

    The success path is the one flag of ``_all_agree``; only when a rank failed are the texts exchanged
    (``tessera.parallel.comm.share_texts``: lengths, then bytes, on the device the group's backend serves).
    """
    return [] if _all_agree(error is None) else share_texts(error, None)


# ---------------------------------------------------------------------------------------- save
def save_checkpoint(
    folder: str,
    step: int,
    state: TrainState,
    *,
    config: Mapping[str, Any] | None,
    layout: Layout,
    keep_last: int = 0,
    before_commit: Callable[[str], None] | None = None,
    writer: Callable[[str, Any], dict[str, Any]] | None = None,
) -> str:
    """Save ``state`` as step ``step`` atomically; every rank must call this. Returns the final folder.

    Every component of ``state`` is written: the model shards, the optimizer shards (its
    ``shard_state_dict()``), the per-rank components in this rank's file and the others in meta.json.
    ``before_commit`` is a test hook run on rank 0 just before the rename that publishes the checkpoint.
    ``writer(path, tree)`` writes one file and returns its meta.json entry (default ``write_tree``; the
    dry run plans without writing).
    """
    write = writer or write_tree
    final = step_folder(folder, step)
    partial = hidden_sibling(final, PARTIAL)

    # this rank's files: (name, state tree)
    model, optimizer = state.model, state.optimizer
    todo: list[tuple[str, Any]] = []
    if layout.dp_rank == 0:
        todo.append((shard_name("model", layout.tp_rank), dict(model.state_dict())))
    # the ZeRO group of the DP-rank-0 replica (DP ranks 0..zero1-1) writes one optimizer file per ZeRO
    # rank: its own shard, as views of the live buffers (nothing gathered, nothing copied on the device)
    if optimizer is not None and layout.dp_rank < optimizer.zero1_size:
        todo.append((optim_shard_name(layout.tp_rank, layout.dp_rank), optimizer.shard_state_dict()))
    rank_state = state.rank_state_dict()
    if rank_state is not None:
        todo.append((rng_name(layout.global_rank), rank_state))
    planned = sum(tree_nbytes(tree) for _, tree in todo)

    # every failure to write (no space left, quota, I/O error) is agreed on: every rank stops together
    error = None
    if layout.global_rank == 0:
        try:
            os.makedirs(folder, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(partial)
        except OSError as e:
            error = os_error_text(e)
    _check_save(_exchange_errors(error), folder, step, partial, planned, layout)  # also the barrier: partial exists
    files: dict[str, Any] = {}
    try:
        for name, tree in todo:
            files[name] = write(os.path.join(partial, name), tree)
    except OSError as e:
        error = os_error_text(e)
    _check_save(_exchange_errors(error), folder, step, partial, planned, layout)

    gathered = _gather_to_rank0(files, layout)
    if layout.global_rank == 0:
        assert gathered is not None  # rank 0 receives every rank's list
        try:
            all_files: dict[str, Any] = {}
            for part in gathered:
                all_files.update(part)
            write_meta(partial, new_meta(step=step, layout=asdict(layout), has_optimizer=optimizer is not None,
                                         trainer_state=state.state_dict(), config=config, files=all_files))
            if before_commit is not None:
                before_commit(partial)
            commit_folder(partial, final)
        except OSError as e:
            error = os_error_text(e)
        if error is None and keep_last > 0:
            for old in list_checkpoints(folder)[:-keep_last]:
                try:
                    discard_folder(old)
                except OSError as e:
                    logger.warning("could not remove the old checkpoint %s (ckpt.keep_last=%d): %s", old, keep_last,
                                   os_error_text(e))
    _check_save(_exchange_errors(error), folder, step, partial, planned, layout)  # also the final barrier
    return final


def _check_save(errors: list[str], folder: str, step: int, partial: str, planned: int, layout: Layout) -> None:
    """After an agreement of a save: when any rank failed, rank 0 removes the partial folder and every rank
    raises the same ``CheckpointError`` (the space it needs and has when a disk or quota was full, and the
    newest complete checkpoint, untouched). A collective, on every rank."""
    if not errors:
        return
    if layout.global_rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
    full = any(m in e for e in errors for m in (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT)))
    free = shutil.disk_usage(folder).free if full and layout.global_rank == 0 and os.path.isdir(folder) else 0
    # the checkpoint's size (the ranks' tensors; the files add a little) and rank 0's view of the free
    # space once the partial folder is gone; also the barrier before anyone reports
    needed, free = (int(v) for v in reduce_scalars([float(planned), float(free)], None)) if _dist() else (planned, free)
    last = list_checkpoints(folder)
    why = "; ".join(errors)
    space = f"; the checkpoint needs at least {_bytes(needed)}, {_bytes(free)} free" if full else ""
    raise CheckpointError(f"cannot save step {step} in {folder}: {why}{space}; step_{step} was not saved (its "
                          f"partial folder is removed), the last complete checkpoint is {last[-1] if last else 'none'}",
                          every_rank=True)


def _bytes(n: int) -> str:
    return f"{n} bytes ({n / 2**30:.2f} GiB)" if n >= 2**30 else f"{n} bytes ({n / 2**20:.1f} MiB)"


# ---------------------------------------------------------------------------------------- load
def _load_state(path: str, kind: str, old_tp: int, layout: Layout, params: Mapping[str, Any]) -> Any:
    """Read ``kind`` (model/optim) for this TP rank, resharded if the TP size changed."""
    if old_tp == layout.tp_size:
        return read_tree(os.path.join(path, shard_name(kind, layout.tp_rank)))
    trees = [read_tree(os.path.join(path, name)) for name in shard_files(kind, old_tp)]
    return reshard_tree(trees, params, layout.tp_rank, layout.tp_size)


def _optim_files(meta: Mapping[str, Any], tp_ranks: list[int]) -> tuple[str, list[list[str]]] | None:
    """``(kind, files per TP rank)`` of the optimizer state of ``tp_ranks``: "sharded" (one file per ZeRO
    rank, in ZeRO-rank order) or "gathered" (one file per TP rank: older and converted checkpoints);
    None when the checkpoint has neither."""
    listed = meta.get("files", {})
    sharded = []
    for t in tp_ranks:
        zero = sorted(n for n in listed if n.startswith(f"optim_tp{t}_zero"))
        sharded.append(optim_shard_files(t, len(zero)) if zero else [])
    if all(sharded) and all(n in listed for names in sharded for n in names):
        return "sharded", sharded
    gathered = [[shard_name("optim", t)] for t in tp_ranks]
    return ("gathered", gathered) if all(names[0] in listed for names in gathered) else None


def _load_optimizer(path: str, kind: str, files: list[list[str]], optimizer: Any, old_tp: int, layout: Layout,
                    params: Mapping[str, Any]) -> bool:
    """Read the optimizer state; True when the parameters still need ``optimizer.publish_parameters()`` (a
    collective, left to the caller so that the ranks agree on the reads first)."""
    if kind == "gathered":
        optimizer.load_state_dict(_load_state(path, "optim", old_tp, layout, params))
    elif old_tp == layout.tp_size:  # read only the element ranges this rank owns
        with OptimizerShards([os.path.join(path, n) for n in files[0]]) as shards:
            optimizer.load_shards(shards, publish=False)
        return True
    else:  # a new TP size: put every old TP rank's state together, then reshard (as for the model)
        trees = []
        for names in files:
            with OptimizerShards([os.path.join(path, n) for n in names]) as shards:
                trees.append(shards.gathered())
        optimizer.load_state_dict(reshard_tree(trees, params, layout.tp_rank, layout.tp_size))
    return False


def load_checkpoint(
    path: str,
    state: TrainState,
    *,
    layout: Layout,
    load_optimizer: bool = True,
    load_components: bool = True,
    verify: bool = True,
) -> dict[str, Any]:
    """Load ``path`` into every component of ``state``; returns meta.json.

    Every rank must call this. First every rank checks the files it will read (meta.json, then each
    file present and, with ``verify``, of the size and sha256 meta.json lists) and all ranks agree on
    the verdict before the load's first collective: when any rank cannot read its files, every rank
    raises the same ``CheckpointError``, naming each bad file and the rank that found it.
    ``load_optimizer=False`` / ``load_components=False`` restore the weights only. Per-rank components
    (RNG streams) are restored only when the layout is unchanged; ``meta["rank_state_loaded"]`` says
    whether they were.
    """
    model, optimizer = state.model, state.optimizer
    error = None
    try:
        meta, need, optim = _files_to_read(path, state, layout, load_optimizer, load_components)
        if verify:
            verify_files(path, need, meta)
        else:
            missing = [n for n in need if not os.path.isfile(os.path.join(path, n))]
            if missing:
                raise CheckpointError(f"{os.path.join(path, missing[0])} is missing")
    except CheckpointError as e:
        error = str(e)
    except OSError as e:  # unreadable (permissions, I/O error) rather than damaged
        error = f"{path}: cannot read {e.filename or 'a file'}: {e.strerror or e}"
    # the agreement: before the optimizer's ZeRO all-gather, which a rank that stopped here would never join
    errors = _exchange_errors(error)
    if errors:
        raise CheckpointError("; ".join(errors), every_rank=True)

    old_tp = int(meta["layout"]["tp_size"])
    if layout.tp_size != old_tp:
        logger.info("resharding %s from TP=%d to TP=%d", path, old_tp, layout.tp_size)
    # Files that pass the checks can still fail to parse or end early, and only on the ranks that read
    # those bytes: every read happens first, then the ranks agree again, and only then the all-gather.
    error, publish = None, False
    try:
        params = model_param_dims(model)
        _load_model_state(model, _load_state(path, "model", old_tp, layout, params), path)
        if optim is not None:
            publish = _load_optimizer(path, *optim, optimizer, old_tp, layout, params)
        if load_components:
            state.load_state_dict(meta["trainer_state"], path)
        rng_file = rng_name(layout.global_rank)
        meta["rank_state_loaded"] = rng_file in need
        if meta["rank_state_loaded"]:
            state.load_rank_state_dict(read_tree(os.path.join(path, rng_file)), path)
    except CheckpointError as e:
        error = str(e)
    except (ValueError, KeyError, OSError, RuntimeError) as e:  # a parse error, a missing entry, a short read
        error = f"{path}: cannot load it: {type(e).__name__}: {e}"
    errors = _exchange_errors(error)
    if errors:
        raise CheckpointError("; ".join(errors), every_rank=True)
    if publish and optimizer is not None:
        optimizer.publish_parameters()
    return meta


def _files_to_read(path: str, state: TrainState, layout: Layout, load_optimizer: bool, load_components: bool
                   ) -> tuple[dict[str, Any], list[str], tuple[str, list[list[str]]] | None]:
    """``(meta, the files this rank reads, the optimizer files as _optim_files gives them or None)``."""
    meta = read_meta(path)
    old = meta["layout"]
    old_tp = int(old["tp_size"])
    tp_ranks = list(range(old_tp)) if old_tp != layout.tp_size else [layout.tp_rank]
    need = [shard_name("model", t) for t in tp_ranks]
    optim: tuple[str, list[list[str]]] | None = None
    if load_optimizer and state.optimizer is not None and meta.get("has_optimizer"):
        optim = _optim_files(meta, tp_ranks)
        if optim is None:
            raise CheckpointError(f"{path}: meta.json says it has an optimizer state but lists no optimizer files "
                                  f"for tensor-parallel ranks {tp_ranks}")
        need += [n for names in optim[1] for n in names]
    same_layout = old_tp == layout.tp_size and int(old["dp_size"]) == layout.dp_size
    rng_file = rng_name(layout.global_rank)
    if load_components and state.per_rank and same_layout and rng_file in meta["files"]:
        need.append(rng_file)
    return meta, need, optim


def _load_model_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor], path: str) -> None:
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: model does not match the checkpoint; missing {missing[:5]}, unexpected {unexpected[:5]} "
            "(was it saved from a different model config?)")
    for k, t in own.items():
        if tuple(state[k].shape) != tuple(t.shape):
            raise CheckpointError(f"{path}: {k} has shape {tuple(state[k].shape)} in the checkpoint, "
                                  f"the model expects {tuple(t.shape)}")
    with torch.no_grad():
        for k, t in own.items():
            t.copy_(state[k])


# ---------------------------------------------------------------------------------------- resume
def find_resumable_checkpoint(folder: str, layout: Layout, *, load: Callable[[str], Any]) -> tuple[str | None, Any]:
    """Try complete checkpoints newest first; all ranks agree on each; a damaged one is skipped.

    ``load(path)`` performs the actual load and raises ``CheckpointError`` when a file is damaged
    (``load_checkpoint`` does so on every rank together, before any collective, when one rank's files
    are missing or damaged). The ranks agree again after every attempt, so whatever a load finds on
    one rank's side makes all ranks fall back to the newest step all can read, and every rank logs
    which file on which rank was bad. Interrupted saves are tidied up (rank 0,
    with a warning) first. Returns ``(None, None)`` when the folder holds no checkpoint; raises
    ``CheckpointError`` when it holds some but none is usable (rather than silently starting over).
    """
    if layout.global_rank == 0:
        clean_partial_checkpoints(folder)
    _barrier()
    candidates = list_checkpoints(folder)
    failures = []
    for path in reversed(candidates):
        error = None
        result = None
        try:
            result = load(path)
        except CheckpointError as e:
            error = str(e)
        errors = _exchange_errors(error)  # agreed before the load's collectives too (load_checkpoint)
        if not errors:
            return path, result
        why = "; ".join(errors)
        logger.warning("checkpoint %s is unusable (%s); falling back to the previous one", path, why)
        failures.append(f"{path}: {why}")
    if failures:
        raise CheckpointError(f"no usable checkpoint in {folder}; tried, newest first: " + " | ".join(failures)
                              + ". Move them away (or set ckpt.auto_resume=False) to start from scratch.",
                              every_rank=True)
    return None, None
