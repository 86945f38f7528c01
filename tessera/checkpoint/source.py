"""Offline, single-process access to a tessera checkpoint folder, tensor by tensor.

The training-time loader (``tessera.checkpoint.training.load_checkpoint``) reads whole shards into a
live (possibly distributed) model. Offline tools need the opposite: no process group, no model in
memory, any TP layout in, one full tensor at a time out, so a 7B checkpoint can be exported or
resharded in a few GB of RAM. Shard files are read through their safetensors headers; tensor paths and
aliases follow ``tessera.checkpoint.tree``.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from typing import Any

import torch

from tessera.checkpoint.errors import CheckpointError
from tessera.checkpoint.folders import resolve_step_folder
from tessera.checkpoint.meta import read_meta, shard_files, verify_files
from tessera.checkpoint.optim_shards import OptimizerShards
from tessera.checkpoint.reshard import param_layout, reshard
from tessera.checkpoint.safetensors_io import SafetensorsReader, read_header

__all__ = ["CheckpointSource"]


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
        # optimizer state: one gathered file per TP rank, or (training saves) one per ZeRO rank, which
        # is presented under the gathered file's name (``OptimizerShards.gathered_view``)
        self.optim_files = shard_files("optim", self.tp_size)
        zero_files = {name: sorted(n for n in files if n.startswith(f"optim_tp{t}_zero"))
                      for t, name in enumerate(self.optim_files)}
        sharded = all(zero_files.values()) and not all(n in files for n in self.optim_files)
        stored_optim = [n for names in zero_files.values() for n in names] if sharded else self.optim_files
        missing = [n for n in self.model_files if n not in files]
        if missing:
            raise CheckpointError(f"{self.path}/meta.json does not list {missing}")
        self.has_optimizer = bool(self.meta.get("has_optimizer")) and all(n in files for n in stored_optim)
        if verify:
            verify_files(self.path, self.model_files + (stored_optim if self.has_optimizer else []), self.meta)
        self.layout = param_layout(self.model_cfg, self.tp_size)
        self._stack = contextlib.ExitStack()
        self._handles: dict[str, Any] = {}
        self._headers: dict[str, tuple[dict[str, dict[str, Any]], dict[str, str]]] = {}
        self._zero_shards: dict[str, OptimizerShards] = {}
        if sharded and self.has_optimizer:
            for name, names in zero_files.items():
                shards = self._stack.enter_context(OptimizerShards([os.path.join(self.path, n) for n in names]))
                self._zero_shards[name] = shards
                self._headers[name] = shards.gathered_view()
        self._check_model_files()

    # ------------------------------------------------------------------ files
    def __enter__(self) -> CheckpointSource:
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
        if name in self._zero_shards:
            return self._zero_shards[name].gathered_tensor(key)
        if name not in self._handles:
            self._handles[name] = self._stack.enter_context(SafetensorsReader(os.path.join(self.path, name)))
        key = self.aliases(name).get(key, key)
        try:
            return self._handles[name].get_tensor(key)
        except (KeyError, ValueError) as e:
            raise CheckpointError(str(e).strip('"')) from None

    def _check_model_files(self) -> None:
        for name in self.model_files:
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
        return reshard([self.tensor(f, key) for f in files], dim, 1, name=name)[0]
