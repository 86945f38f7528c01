"""Loading a training checkpoint and choosing the one to resume from: every rank loads its part (resharded
when the TP size changed), and all ranks agree on which checkpoint to resume from. Saving is
``tessera.checkpoint.save``; the agreements are ``tessera.checkpoint.agreement``.

Auto-resume tries complete checkpoints newest first. Before any collective of a load, every rank checks
the files it will read (present, size and sha256 as meta.json lists them) and all ranks agree on the
verdict, exchanging the error texts (on the device of the group's backend: NCCL refuses CPU tensors): a
file damaged or missing on one rank's side makes all ranks skip that step together, and every rank logs
which file on which rank was bad. A second agreement after every attempt catches what only the load
itself finds.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from tessera.checkpoint.agreement import barrier, exchange_errors
from tessera.checkpoint.errors import CheckpointError
from tessera.checkpoint.folders import clean_partial_checkpoints, list_checkpoints
from tessera.checkpoint.meta import read_meta, rng_name, shard_files, shard_name, verify_files
from tessera.checkpoint.optim_shards import OptimizerShards, optim_shard_files
from tessera.checkpoint.reshard import model_param_dims, reshard_tree
from tessera.checkpoint.state import TrainState
from tessera.checkpoint.tree import read_tree
from tessera.core.layout import Layout

__all__ = ["load_checkpoint", "find_resumable_checkpoint"]

logger = logging.getLogger("tessera")


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
    errors = exchange_errors(error)
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
    errors = exchange_errors(error)
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
    barrier()
    candidates = list_checkpoints(folder)
    failures = []
    for path in reversed(candidates):
        error = None
        result = None
        try:
            result = load(path)
        except CheckpointError as e:
            error = str(e)
        errors = exchange_errors(error)  # agreed before the load's collectives too (load_checkpoint)
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
