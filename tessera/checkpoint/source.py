"""Offline, single-process access to tessera checkpoint folders, tensor by tensor.

The training-time loader (``tessera.checkpoint.core.load_checkpoint``) reads whole shards into a live
(possibly distributed) model. Offline tools need the opposite: no process group, no model in memory,
any TP layout in, one full tensor at a time out, so a 7B checkpoint can be exported or resharded in a
few GB of RAM. This module provides that (``CheckpointSource``) and the pieces shared by the writers:
the model's parameter layout from its config (built on the meta device), and meta.json assembly in
the format ``load_checkpoint`` verifies.

Tensor paths inside a shard file follow ``tessera.checkpoint.core.write_tree``: the model file keys a
parameter ``name`` as ``/name``, the optimizer file as ``/master/name`` and ``/state/name/<key>``; a
tensor stored once for several paths (tied weights) is listed in the file's ``aliases`` metadata.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch

import tessera
from tessera.checkpoint.core import CHECKPOINT_FORMAT, CheckpointError, list_checkpoints, read_meta, verify_files
from tessera.checkpoint.safetensors_io import SafetensorsReader, read_header

__all__ = ["CheckpointSource", "ParamLayout", "param_layout", "resolve_step_folder", "commit_folder",
           "write_meta", "new_meta", "file_entry", "output_step_folder", "shard_files"]


def resolve_step_folder(path: str) -> str:
    """A ``step_<N>`` folder as is; a save folder (holding step folders) -> its newest complete step."""
    path = os.path.normpath(path)
    if os.path.isfile(os.path.join(path, "meta.json")):
        return path
    found = list_checkpoints(path)
    if found:
        return found[-1]
    raise CheckpointError(f"{path} is neither a checkpoint step folder (no meta.json) "
                          "nor a folder of step_<N> checkpoints")


def shard_files(kind: str, tp_size: int) -> list[str]:
    """``model_tp0.safetensors`` ... for ``kind`` in (model, optim)."""
    return [f"{kind}_tp{r}.safetensors" for r in range(tp_size)]


@dataclass
class ParamLayout:
    """A model config's parameters at a TP size: names, TP-local shapes, partition dims, tied aliases."""

    state_keys: list[str]  # model.state_dict() order (tied weights appear under both names)
    shapes: dict[str, tuple[int, ...]]  # TP-local shape per state key
    dims: dict[str, int | None]  # partition dim per state key (None: replicated)
    aliases: dict[str, str]  # state key -> the key it shares storage with (tied output -> embedding)

    def dim_of_path(self, path: str, ndim: int) -> int | None:
        """Partition dim of the tensor stored at ``path`` (e.g. ``/state/<name>/exp_avg``): that of the
        parameter named by one of its components, when the tensor has the parameter's rank (a 0-dim
        Adam ``step`` next to a matrix is replicated)."""
        for part in path.split("/"):
            if part in self.dims:
                return self.dims[part] if ndim == len(self.shapes[part]) else None
        return None


def param_layout(model_cfg: Mapping[str, Any], tp_size: int) -> ParamLayout:
    """Build the model on the meta device (no memory) to learn its parameters' names, shapes and TP tags."""
    from tessera.model import build_model
    from tessera.model.transformer import check_tensor_parallel_sizes
    from tessera.model.args import ModelArgs
    from tessera.parallel import MetaGroup, partition_dim

    check_tensor_parallel_sizes(ModelArgs.from_config(model_cfg), tp_size)
    model = build_model(model_cfg, tp_group=MetaGroup(tp_size) if tp_size > 1 else None, device="meta")
    params = dict(model.named_parameters(remove_duplicate=False))
    state = model.state_dict()
    unknown = [k for k in state if k not in params]
    if unknown:
        raise CheckpointError(f"model has buffers this tool does not know how to reshard: {unknown[:5]}")
    first_owner: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for k in state:
        key = id(params[k])
        if key in first_owner:
            aliases[k] = first_owner[key]
        else:
            first_owner[key] = k
    return ParamLayout(list(state), {k: tuple(params[k].shape) for k in state},
                       {k: partition_dim(params[k]) for k in state}, aliases)


class CheckpointSource:
    """One checkpoint step folder, read tensor by tensor whatever its TP layout (use as a context manager).

    ``full(name)`` is parameter ``name`` put together over the TP shards: from the fp32 optimizer
    masters when the checkpoint has them (exact: the model shards may be bf16 roundings of them), else
    from the model shards in their stored dtype. ``verify`` checks every shard's size and sha256
    against meta.json first (reads every byte once; skip it for speed on trusted files).
    """

    def __init__(self, path: str, *, verify: bool = True) -> None:
        self.path = resolve_step_folder(path)
        self.meta = read_meta(self.path)
        config = self.meta.get("config")
        if not isinstance(config, Mapping) or not isinstance(config.get("model"), Mapping):
            raise CheckpointError(f"{self.path}/meta.json has no config.model section: cannot rebuild the model")
        self.config: dict[str, Any] = dict(config)
        self.model_cfg: dict[str, Any] = dict(config["model"])
        layout = self.meta.get("layout") or {}
        try:
            self.tp_size = int(layout["tp_size"])
            self.dp_size = int(layout["dp_size"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{self.path}/meta.json: layout lacks tp_size/dp_size: {layout}") from None
        files = self.meta.get("files", {})
        self.model_files = shard_files("model", self.tp_size)
        self.optim_files = shard_files("optim", self.tp_size)
        missing = [n for n in self.model_files if n not in files]
        if missing:
            raise CheckpointError(f"{self.path}/meta.json does not list {missing}")
        self.has_optimizer = bool(self.meta.get("has_optimizer")) and all(n in files for n in self.optim_files)
        if verify:
            verify_files(self.path, self.model_files + (self.optim_files if self.has_optimizer else []), self.meta)
        self.layout = param_layout(self.model_cfg, self.tp_size)
        self._stack = contextlib.ExitStack()
        self._handles: dict[str, Any] = {}
        self._headers: dict[str, tuple[dict[str, dict[str, Any]], dict[str, str]]] = {}
        self._check_model_files()

    # ------------------------------------------------------------------ files
    def __enter__(self) -> "CheckpointSource":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def header(self, name: str) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
        """``(tensors, metadata)`` of one shard file (cached)."""
        if name not in self._headers:
            try:
                self._headers[name] = read_header(os.path.join(self.path, name))
            except ValueError as e:
                raise CheckpointError(str(e)) from None
        return self._headers[name]

    def aliases(self, name: str) -> dict[str, str]:
        return json.loads(self.header(name)[1].get("aliases", "{}"))

    def skeleton(self, name: str) -> Any:
        meta = self.header(name)[1]
        if "skeleton" not in meta:
            raise CheckpointError(f"{self.path}/{name} has no tessera skeleton metadata")
        return json.loads(meta["skeleton"])

    def tensor(self, name: str, key: str) -> torch.Tensor:
        """Tensor ``key`` (a path such as ``/master/norm.weight``, aliases resolved) of shard file ``name``."""
        if name not in self._handles:
            self._handles[name] = self._stack.enter_context(SafetensorsReader(os.path.join(self.path, name)))
        key = self.aliases(name).get(key, key)
        try:
            return self._handles[name].get_tensor(key)
        except (KeyError, ValueError) as e:
            raise CheckpointError(str(e).strip('"')) from None

    def _check_model_files(self) -> None:
        for r, name in enumerate(self.model_files):
            tensors, _ = self.header(name)
            aliases = self.aliases(name)
            for key in self.layout.state_keys:
                stored = aliases.get("/" + key, "/" + key)
                if stored not in tensors:
                    raise CheckpointError(f"{self.path}/{name} has no tensor for parameter {key!r} "
                                          "(was it saved from a different model config?)")
                if tensors[stored]["shape"] != self.layout.shapes[key]:
                    raise CheckpointError(f"{self.path}/{name}: {key} has shape {tensors[stored]['shape']}, the config "
                                          f"in meta.json gives {self.layout.shapes[key]} at TP={self.tp_size}")

    # ------------------------------------------------------------------ parameters
    @property
    def param_names(self) -> list[str]:
        """Parameters once each (a tied output head is left out: it is the embedding)."""
        return [k for k in self.layout.state_keys if k not in self.layout.aliases]

    def full_shape(self, name: str) -> tuple[int, ...]:
        shape = list(self.layout.shapes[name])
        dim = self.layout.dims[name]
        if dim is not None:
            shape[dim] *= self.tp_size
        return tuple(shape)

    def source_kind(self, name: str) -> str:
        """Where ``full(name)`` reads from: ``master`` (fp32 optimizer masters) or ``model``."""
        if self.has_optimizer and f"/master/{name}" in self.header(self.optim_files[0])[0]:
            return "master"
        return "model"

    def full(self, name: str, *, prefer_master: bool = True) -> torch.Tensor:
        """Parameter ``name`` put together over the TP shards (fp32 masters when present)."""
        name = self.layout.aliases.get(name, name)
        if prefer_master and self.source_kind(name) == "master":
            files, key = self.optim_files, f"/master/{name}"
        else:
            files, key = self.model_files, f"/{name}"
        dim = self.layout.dims[name]
        if dim is None:
            return self.tensor(files[0], key)
        parts = [self.tensor(f, key) for f in files]
        return torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0]

    def iter_full(self, *, prefer_master: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.param_names:
            yield name, self.full(name, prefer_master=prefer_master)


# ---------------------------------------------------------------------------------------- writing
def file_entry(path: str) -> dict[str, Any]:
    """meta.json's ``files`` entry for a file written by other means than ``SafetensorsWriter``."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return {"size": os.path.getsize(path), "sha256": h.hexdigest()}


def write_meta(folder: str, meta: dict[str, Any]) -> None:
    """meta.json through the checkpoint writer (atomic, written last, with its self-digest)."""
    from tessera.checkpoint.core import write_meta as _write

    _write(folder, meta)


def new_meta(*, step: int, layout: Mapping[str, int], has_optimizer: bool, trainer_state: Mapping[str, Any],
             config: Mapping[str, Any], files: Mapping[str, Any], **extra: Any) -> dict[str, Any]:
    """A meta.json dict in the format ``tessera.checkpoint.core.load_checkpoint`` reads."""
    return {
        "format": CHECKPOINT_FORMAT,
        "tessera_version": tessera.__version__,
        "step": step,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "layout": {"global_rank": None, "world_size": layout["tp_size"] * layout["dp_size"], "tp_rank": None,
                   "tp_size": layout["tp_size"], "dp_rank": None, "dp_size": layout["dp_size"],
                   "zero1_size": layout["zero1_size"]},
        "has_optimizer": has_optimizer,
        "trainer_state": dict(trainer_state),
        "config": config,
        "files": dict(files),
        **extra,
    }


def output_step_folder(dst: str, step: int) -> str:
    """``dst`` itself when it is named ``step_<N>``, else ``dst/step_<step>`` (a save folder train.py resumes from)."""
    base = os.path.basename(os.path.normpath(dst))
    if base.startswith("step_") and base[5:].isdigit():
        return os.path.normpath(dst)
    return os.path.join(dst, f"step_{step}")


@contextlib.contextmanager
def commit_folder(final: str, *, overwrite: bool = False) -> Iterator[str]:
    """Yield a temporary sibling folder to fill; rename it to ``final`` only if the block succeeds."""
    final = os.path.normpath(final)
    if os.path.exists(final):
        if not overwrite:
            raise CheckpointError(f"{final} already exists; remove it or pass --overwrite")
    parent = os.path.dirname(final) or "."
    os.makedirs(parent, exist_ok=True)
    partial = os.path.join(parent, f".{os.path.basename(final)}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    try:
        yield partial
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(partial, final)
