"""Checkpoints: one folder per step, written atomically, verified on load, reshardable across TP/DP.

Layout of ``<save_ckpt_folder>/step_<N>/``::

    model_tp<r>.safetensors   TP-rank r's model shard (written by the DP-rank-0 replica)
    optim_tp<r>.safetensors   TP-rank r's optimizer state: fp32 masters, Adam moments, scaler
    rng_rank<g>.safetensors   RNG states of global rank g
    meta.json                 step, tokens, config, layout, trainer state, file sizes + sha256

Every file is safetensors: tensors plus a JSON "skeleton" in the header for the non-tensor structure,
so loading never unpickles anything. The folder is assembled under ``.step_<N>.partial`` and renamed
into place only after ``meta.json`` (written last) is on disk; auto-resume considers only folders with
a ``meta.json`` and verifies each file's size and hash before trusting it.

Resharding: optimizer states are saved gathered over ZeRO (layout-independent within a TP rank) and
model weights are identical across DP, so a different DP/ZeRO layout loads as is. A different TP size
concatenates the old shards of every TP-sharded tensor along its ``partition_dim`` (read from the new
model's parameter tags) and slices the new rank's part.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

import tessera
from tessera.parallel.attrs import partition_dim
from tessera.parallel.comm import reduce_scalars

logger = logging.getLogger("tessera")

CHECKPOINT_FORMAT = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used (missing, incomplete, damaged, or incompatible); names the file."""


@dataclass(frozen=True)
class Layout:
    """Where this process sits in the TP x DP grid (explicit, so this module needs no globals)."""

    global_rank: int = 0
    world_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    zero1_size: int = 1

    @classmethod
    def from_gpc(cls) -> "Layout":
        from tessera.dist.context import ParallelMode, gpc

        return cls(gpc.get_global_rank(), gpc.get_world_size(ParallelMode.GLOBAL),
                   gpc.get_local_rank(ParallelMode.TENSOR), gpc.get_world_size(ParallelMode.TENSOR),
                   gpc.get_local_rank(ParallelMode.DATA), gpc.get_world_size(ParallelMode.DATA),
                   gpc.get_world_size(ParallelMode.ZERO1))


# ---------------------------------------------------------------------------------------- encoding
def _encode(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Nested dict/list/tensor/primitive -> JSON skeleton; tensors collected under their path."""
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj.detach().cpu().contiguous()
        return {"t": path}
    if isinstance(obj, Mapping):
        return {"d": [[k, _encode(v, f"{path}/{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {"l": [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(obj)], "tuple": isinstance(obj, tuple)}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"v": obj}
    if isinstance(obj, torch.dtype):
        return {"dtype": str(obj)}
    raise CheckpointError(f"cannot save a value of type {type(obj).__name__} at {path!r} in a checkpoint")


def _decode(node: Any, get: Callable[[str], torch.Tensor]) -> Any:
    if "t" in node:
        return get(node["t"])
    if "d" in node:
        return {k: _decode(v, get) for k, v in node["d"]}
    if "l" in node:
        items = [_decode(v, get) for v in node["l"]]
        return tuple(items) if node.get("tuple") else items
    if "dtype" in node:
        return getattr(torch, node["dtype"].split(".")[-1])
    return node["v"]


def write_tree(path: str, obj: Any) -> dict[str, Any]:
    """Write ``obj`` to ``path`` (via a temporary name), fsync, and return its size and sha256."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _encode(obj, "", tensors)
    # safetensors refuses tensors that share memory (tied weights): store each storage once
    seen: dict[tuple[int, int, tuple[int, ...]], str] = {}
    aliases: dict[str, str] = {}
    unique: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)) if t.numel() else None
        if key is not None and key in seen:
            aliases[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
        unique[name] = t.clone() if any(t.untyped_storage().data_ptr() == u.untyped_storage().data_ptr()
                                        for u in unique.values() if u.numel()) else t
    tmp = path + ".tmp"
    save_file(unique, tmp, metadata={"skeleton": json.dumps(skeleton), "aliases": json.dumps(aliases)})
    _fsync_file(tmp)
    os.replace(tmp, path)
    return {"size": os.path.getsize(path), "sha256": _sha256(path)}


def read_tree(path: str) -> Any:
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        aliases = json.loads(meta.get("aliases", "{}"))
        return _decode(json.loads(meta["skeleton"]), lambda name: f.get_tensor(aliases.get(name, name)))


def sha256_file(path: str) -> str:
    """Hex sha256 of a file, read in 4 MiB blocks (checkpoint shards and token files alike)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


_sha256 = sha256_file


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    try:
        _fsync_file(path)
    except OSError:  # some filesystems do not support fsync on directories
        pass


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


# ---------------------------------------------------------------------------------------- discovery
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
        if _STEP_DIR.match(name) and os.path.isfile(os.path.join(full, "meta.json")):
            found.append((int(_STEP_DIR.match(name).group(1)), full))
    return [p for _, p in sorted(found)]


def _hidden(folder: str, step: int, what: str) -> str:
    """A name auto-resume never lists: ``.step_<N>.<what>`` (partial, replaced, deleting)."""
    return os.path.join(folder, f".step_{step}.{what}")


def _discard(path: str, folder: str, step: int) -> None:
    """Remove a checkpoint folder crash-safely: rename it out of sight first, then delete it.

    Deleting in place could die half-way and leave ``step_<N>/meta.json`` next to missing shards.
    """
    trash = _hidden(folder, step, "deleting")
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


_HIDDEN = re.compile(r"^\.step_(\d+)\.(partial|replaced|deleting)$")


def clean_partial_checkpoints(folder: str) -> list[str]:
    """Tidy up after interrupted saves (called on rank 0); returns the folders removed.

    ``.step_<N>.partial`` (a save that never completed) and ``.step_<N>.deleting`` (a removal that
    never completed) are deleted, as is a ``step_<N>`` without ``meta.json``. A ``.step_<N>.replaced``
    is the complete previous copy of a step being re-saved: it is put back when the save died before
    its new copy took its place, else deleted.
    """
    removed = []
    if not folder or not os.path.isdir(folder):
        return removed
    for name in sorted(os.listdir(folder)):
        full = os.path.join(folder, name)
        hidden = _HIDDEN.match(name)
        if hidden and hidden.group(2) == "replaced":
            final = os.path.join(folder, f"step_{hidden.group(1)}")
            if not os.path.exists(final) and os.path.isfile(os.path.join(full, "meta.json")):
                logger.warning("restoring %s from %s (a re-save of that step was interrupted)", final, full)
                os.replace(full, final)
                continue
        incomplete = _STEP_DIR.match(name) and not os.path.isfile(os.path.join(full, "meta.json"))
        if hidden or name.endswith(".partial") or incomplete:
            logger.warning("removing incomplete checkpoint folder %s (an interrupted save)", full)
            shutil.rmtree(full, ignore_errors=True)
            removed.append(full)
    return removed


def write_meta(folder: str, meta: dict[str, Any]) -> None:
    """Write ``folder/meta.json`` last and atomically, with its self-digest (``meta_sha256``).

    Its presence is what makes a step folder complete; every writer of checkpoints goes through here.
    """
    meta["meta_sha256"] = _meta_digest(meta)
    tmp = os.path.join(folder, "meta.json.tmp")
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=2, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, "meta.json"))
    _fsync_dir(folder)


def _meta_digest(meta: Mapping[str, Any]) -> str:
    """sha256 of meta.json's content (all but this digest): meta.json vouches for every other file."""
    body = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def read_meta(path: str) -> dict[str, Any]:
    meta_path = os.path.join(path, "meta.json")
    if not os.path.isfile(meta_path):
        raise CheckpointError(f"{meta_path} is missing: {path} is not a complete checkpoint")
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:  # ValueError: bad JSON or bad UTF-8
        raise CheckpointError(f"{meta_path} is damaged or unreadable: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(f"{meta_path}: unsupported checkpoint format {got!r}")
    if "meta_sha256" in meta and meta["meta_sha256"] != _meta_digest(meta):
        raise CheckpointError(f"{meta_path} is damaged: its content does not match its sha256")
    missing = [k for k in ("step", "layout", "files", "trainer_state") if k not in meta]
    if missing:
        raise CheckpointError(f"{meta_path} is damaged: missing {missing}")
    return meta


def verify_files(path: str, names: list[str], meta: Mapping[str, Any]) -> None:
    """Check size and sha256 of ``names`` against meta.json; raise naming the first damaged file."""
    for name in names:
        full = os.path.join(path, name)
        want = meta["files"].get(name)
        if want is None:
            raise CheckpointError(f"{full} is not listed in {path}/meta.json")
        if not os.path.isfile(full):
            raise CheckpointError(f"{full} is missing")
        size = os.path.getsize(full)
        if size != want["size"]:
            raise CheckpointError(f"{full} is damaged: size {size} bytes, expected {want['size']}")
        if _sha256(full) != want["sha256"]:
            raise CheckpointError(f"{full} is damaged: sha256 does not match meta.json")


# ---------------------------------------------------------------------------------------- save
def save_checkpoint(
    folder: str,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: Any | None,
    trainer_state: Mapping[str, Any],
    config: Mapping[str, Any] | None,
    rng_states: Mapping[str, Any] | None,
    layout: Layout,
    keep_last: int = 0,
    before_commit: Callable[[str], None] | None = None,
) -> str:
    """Save step ``step`` atomically; every rank must call this. Returns the final folder.

    ``model`` is the unwrapped module (parameter names without wrapper prefixes); ``optimizer`` has
    ``state_dict()`` (a collective under ZeRO: every rank calls it). ``before_commit`` is a test hook
    run on rank 0 just before the rename that publishes the checkpoint.
    """
    final = os.path.join(folder, f"step_{step}")
    partial = os.path.join(folder, f".step_{step}.partial")
    if layout.global_rank == 0:
        os.makedirs(folder, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    _barrier()

    files: dict[str, Any] = {}
    writes_shards = layout.dp_rank == 0
    if writes_shards:
        files[f"model_tp{layout.tp_rank}.safetensors"] = write_tree(
            os.path.join(partial, f"model_tp{layout.tp_rank}.safetensors"), dict(model.state_dict()))
    optim_state = optimizer.state_dict() if optimizer is not None else None  # collective under ZeRO
    if writes_shards and optim_state is not None:
        files[f"optim_tp{layout.tp_rank}.safetensors"] = write_tree(
            os.path.join(partial, f"optim_tp{layout.tp_rank}.safetensors"), optim_state)
    if rng_states is not None:
        files[f"rng_rank{layout.global_rank}.safetensors"] = write_tree(
            os.path.join(partial, f"rng_rank{layout.global_rank}.safetensors"), rng_states)

    gathered = _gather_to_rank0(files, layout)
    if layout.global_rank == 0:
        all_files: dict[str, Any] = {}
        for part in gathered:
            all_files.update(part)
        meta = {
            "format": CHECKPOINT_FORMAT,
            "tessera_version": tessera.__version__,
            "step": step,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "layout": asdict(layout) | {"global_rank": None, "tp_rank": None, "dp_rank": None},
            "has_optimizer": optimizer is not None,
            "trainer_state": dict(trainer_state),
            "config": config,
            "files": all_files,
        }
        write_meta(partial, meta)
        if before_commit is not None:
            before_commit(partial)
        replaced = None
        if os.path.exists(final):  # re-saving a step: move the old copy aside, never delete it first
            replaced = _hidden(folder, step, "replaced")
            shutil.rmtree(replaced, ignore_errors=True)
            os.replace(final, replaced)
        os.replace(partial, final)
        _fsync_dir(folder)
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
        if keep_last > 0:
            for old in list_checkpoints(folder)[:-keep_last]:
                _discard(old, folder, step_of(old))
    _barrier()
    return final


# ---------------------------------------------------------------------------------------- load
def _tp_source_files(kind: str, old_tp: int) -> list[str]:
    return [f"{kind}_tp{r}.safetensors" for r in range(old_tp)]


def _reshard_tensor(shards: list[torch.Tensor], dim: int | None, new_rank: int, new_size: int, name: str) -> torch.Tensor:
    if dim is None:
        return shards[0]
    full = torch.cat(shards, dim=dim) if len(shards) > 1 else shards[0]
    if full.shape[dim] % new_size:
        raise CheckpointError(f"{name}: size {full.shape[dim]} along dim {dim} does not split over tensor size {new_size}")
    return full.chunk(new_size, dim=dim)[new_rank].clone()


def _load_resharded(path: str, kind: str, old_tp: int, layout: Layout,
                    sharded_dim_of: Callable[[str, torch.Tensor], int | None]) -> Any:
    """Read ``kind`` (model/optim) for this TP rank, concatenating/slicing if the TP size changed."""
    if old_tp == layout.tp_size:
        return read_tree(os.path.join(path, f"{kind}_tp{layout.tp_rank}.safetensors"))
    per_rank = [read_tree(os.path.join(path, name)) for name in _tp_source_files(kind, old_tp)]

    def merge(nodes: list[Any], key_path: str) -> Any:
        first = nodes[0]
        if isinstance(first, torch.Tensor):
            return _reshard_tensor(nodes, sharded_dim_of(key_path, first), layout.tp_rank, layout.tp_size, key_path)
        if isinstance(first, dict):
            return {k: merge([n[k] for n in nodes], f"{key_path}/{k}") for k in first}
        if isinstance(first, (list, tuple)):
            return type(first)(merge([n[i] for n in nodes], f"{key_path}/{i}") for i in range(len(first)))
        return first

    return merge(per_rank, "")


def _param_dims(model: torch.nn.Module) -> dict[str, tuple[int | None, int]]:
    # remove_duplicate=False: a tied output head (same tensor as the embedding) must be resharded too
    return {name: (partition_dim(p), p.dim()) for name, p in model.named_parameters(remove_duplicate=False)}


def _sharded_dim_lookup(model: torch.nn.Module) -> Callable[[str, torch.Tensor], int | None]:
    dims = _param_dims(model)

    def lookup(key_path: str, tensor: torch.Tensor) -> int | None:
        # a tensor belongs to a parameter when a component of its path is that parameter's name
        for part in key_path.split("/"):
            if part in dims:
                dim, ndim = dims[part]
                return dim if tensor.dim() == ndim else None
        return None

    return lookup


def load_checkpoint(
    path: str,
    *,
    model: torch.nn.Module,
    optimizer: Any | None,
    layout: Layout,
    load_optimizer: bool = True,
    verify: bool = True,
) -> dict[str, Any]:
    """Load ``path`` into ``model`` (and ``optimizer``); returns meta.json (with ``trainer_state``).

    Every rank must call this. A damaged or missing file raises ``CheckpointError`` naming it.
    RNG states are returned under ``meta["rng_states"]`` when the layout is unchanged (else None).
    """
    meta = read_meta(path)
    old = meta["layout"]
    old_tp = int(old["tp_size"])
    if layout.tp_size != old_tp:
        logger.info("resharding %s from TP=%d to TP=%d", path, old_tp, layout.tp_size)
    need = _tp_source_files("model", old_tp) if old_tp != layout.tp_size else [f"model_tp{layout.tp_rank}.safetensors"]
    want_optim = load_optimizer and optimizer is not None and meta.get("has_optimizer")
    if want_optim:
        need += [n.replace("model_", "optim_") for n in need]
    same_layout = old_tp == layout.tp_size and int(old["dp_size"]) == layout.dp_size
    rng_name = f"rng_rank{layout.global_rank}.safetensors"
    if same_layout and rng_name in meta["files"]:
        need.append(rng_name)
    if verify:
        verify_files(path, need, meta)

    lookup = _sharded_dim_lookup(model)
    model_state = _load_resharded(path, "model", old_tp, layout, lookup)
    _load_model_state(model, model_state, path)
    if want_optim:
        optimizer.load_state_dict(_load_resharded(path, "optim", old_tp, layout, lookup))
    meta["rng_states"] = read_tree(os.path.join(path, rng_name)) if rng_name in need else None
    return meta


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


def _gather_errors(error: str | None, layout: Layout) -> list[str]:
    """Every rank's error message (rank-tagged), so rank 0 can report what another rank found."""
    if not _dist() or layout.world_size == 1:
        return [error] if error else []
    errors: list[Any] = [None] * layout.world_size
    dist.all_gather_object(errors, error)
    return [f"rank {r}: {e}" for r, e in enumerate(errors) if e]


def find_resumable_checkpoint(folder: str, layout: Layout, *, load: Callable[[str], Any]) -> tuple[str | None, Any]:
    """Try complete checkpoints newest first; all ranks agree on each; a damaged one is skipped.

    ``load(path)`` performs the actual load and raises ``CheckpointError`` when a file is damaged. The
    ranks agree after every attempt, so a file damaged on one rank's side makes all ranks fall back,
    and every rank logs which file on which rank was damaged. Interrupted saves are tidied up (rank 0,
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
        if _all_agree(error is None):
            return path, result
        why = "; ".join(_gather_errors(error, layout))
        logger.warning("checkpoint %s is unusable (%s); falling back to the previous one", path, why)
        failures.append(f"{path}: {why}")
    if failures:
        raise CheckpointError(f"no usable checkpoint in {folder}; tried, newest first: " + " | ".join(failures)
                              + ". Move them away (or set ckpt.auto_resume=False) to start from scratch.")
    return None, None
