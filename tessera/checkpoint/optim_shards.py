"""Optimizer checkpoints written one file per ZeRO rank, read back by parameter and element range.

Each ZeRO rank of the DP-rank-0 replica writes ``optim_tp<t>_zero<z>.safetensors``: the flat slices
of masters and Adam moments it updates, per bucket, with the names, shapes and offsets that locate
them (``HybridZeroOptimizer.shard_state_dict``). Nothing is gathered or copied at save time.

``OptimizerShards`` indexes one TP rank's files from their headers alone and reads any element range
of any parameter with positioned reads of just those bytes, so a rank loading into a new DP / ZeRO
layout reads only what it will own. For a new TP size (and for offline tools) it also presents the
files as the gathered, layout-independent state dict (``gathered()`` / ``virtual_file``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tessera.checkpoint.errors import CheckpointError
from tessera.checkpoint.safetensors_io import SafetensorsReader
from tessera.optim.state_format import SHARD_FORMAT, STATE_DICT_FORMAT

__all__ = ["OptimizerShards", "optim_shard_name", "optim_shard_files"]



def optim_shard_name(tp_rank: int, zero_rank: int) -> str:
    return f"optim_tp{tp_rank}_zero{zero_rank}.safetensors"


def optim_shard_files(tp_rank: int, zero1_size: int) -> list[str]:
    """Every ZeRO rank's optimizer file of TP rank ``tp_rank``, in ZeRO-rank order."""
    return [optim_shard_name(tp_rank, z) for z in range(zero1_size)]


class _Stored:
    """A tensor of a shard file, known by its path in the file (read only when needed)."""

    def __init__(self, path: str) -> None:
        self.path = path


def _decode(node: Any) -> Any:
    """``tree``'s JSON skeleton with every tensor left as a ``_Stored`` reference."""
    if "t" in node:
        return _Stored(node["t"])
    if "d" in node:
        return {k: _decode(v) for k, v in node["d"]}
    if "l" in node:
        items = [_decode(v) for v in node["l"]]
        return tuple(items) if node.get("tuple") else items
    if "dtype" in node:
        return getattr(torch, node["dtype"].split(".")[-1])
    return node["v"]


def _plain(obj: Any) -> Any:
    """A non-tensor value as a tree skeleton node (the encoding of ``tessera.checkpoint.tree``)."""
    if isinstance(obj, dict):
        return {"d": [[k, _plain(v)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {"l": [_plain(v) for v in obj], "tuple": isinstance(obj, tuple)}
    if isinstance(obj, torch.dtype):
        return {"dtype": str(obj)}
    if isinstance(obj, _Stored):
        raise CheckpointError(f"optimizer shard: unexpected tensor {obj.path} among the settings")
    return {"v": obj}


@dataclass
class _Piece:
    """Elements ``[start, stop)`` of a parameter (flattened) stored at ``[at, at + stop - start)`` of
    bucket ``bucket``'s flat tensors in file ``file``."""

    file: int
    bucket: int
    start: int
    stop: int
    at: int


class OptimizerShards:
    """One TP rank's per-ZeRO-rank optimizer files, indexed by parameter name (headers only)."""

    def __init__(self, paths: Sequence[str]) -> None:
        self.paths = list(paths)
        self._readers: list[SafetensorsReader] = []
        self.trees: list[dict[str, Any]] = []
        try:
            for path in self.paths:
                reader = SafetensorsReader(path)
                self._readers.append(reader)
                if "skeleton" not in reader.metadata:
                    raise CheckpointError(f"{path} has no tessera skeleton metadata")
                tree = _decode(json.loads(reader.metadata["skeleton"]))
                if not isinstance(tree, dict) or tree.get("format") != SHARD_FORMAT:
                    raise CheckpointError(f"{path} is not an optimizer shard ({SHARD_FORMAT})")
                self.trees.append(tree)
        except (ValueError, OSError) as e:
            self.close()
            raise CheckpointError(str(e)) from None
        except BaseException:
            self.close()
            raise
        sizes = {int(t["zero1_size"]) for t in self.trees}
        ranks = sorted(int(t["zero1_rank"]) for t in self.trees)
        if len(sizes) != 1 or ranks != list(range(len(self.paths))) or sizes != {len(self.paths)}:
            raise CheckpointError(f"optimizer shards {[os.path.basename(p) for p in self.paths]} are not one "
                                  f"complete ZeRO group (zero1 sizes {sorted(sizes)}, ranks {ranks})")
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._pieces: dict[str, list[_Piece]] = {}
        self._home: dict[str, tuple[int, int]] = {}  # name -> (file, bucket) of its first piece
        for f, tree in enumerate(self.trees):
            for k, b in enumerate(tree["buckets"]):
                lo, hi = int(b["lo"]), int(b["hi"])
                for name, shape, off in zip(b["names"], b["shapes"], b["offsets"]):
                    numel = math.prod(shape)
                    self._shapes[name] = tuple(shape)
                    a, z = max(off, lo), min(off + numel, hi)
                    if a < z:
                        self._pieces.setdefault(name, []).append(_Piece(f, k, a - off, z - off, a - lo))
                    if name not in self._home or (a < z and a - off == 0):
                        self._home[name] = (f, k)
        for name, shape in self._shapes.items():
            have = sum(p.stop - p.start for p in self._pieces.get(name, []))
            if have != math.prod(shape):
                raise CheckpointError(f"optimizer shards hold {have} of the {math.prod(shape)} elements of {name!r}")

    # ------------------------------------------------------------------ ShardSource (optim.state_format)
    @property
    def header(self) -> dict[str, Any]:
        """Format, scaler, counters and TP tags (the same in every ZeRO rank's file)."""
        return self.trees[0]

    @property
    def names(self) -> list[str]:
        return list(self._shapes)

    def shape(self, name: str) -> tuple[int, ...] | None:
        return self._shapes.get(name)

    def _bucket(self, name: str) -> dict[str, Any]:
        f, k = self._home[name]
        return self.trees[f]["buckets"][k]

    def state_keys(self, name: str) -> tuple[list[str], dict[str, Any]]:
        """(keys of the sharded state tensors, {key: value} of the replicated ones, e.g. Adam's step)."""
        f, k = self._home[name]
        sharded, replicated = [], {}
        for key, value in self._bucket(name)["state"].items():
            if isinstance(value, _Stored):
                t = self._readers[f].tensors[value.path]
                if len(t["shape"]) == 1 and t["shape"][0] == self._bucket(name)["hi"] - self._bucket(name)["lo"]:
                    sharded.append(key)
                    continue
                replicated[key] = self._readers[f].get_tensor(value.path)
            else:
                replicated[key] = value
        return sharded, replicated

    def group(self, name: str) -> dict[str, Any]:
        return dict(self._bucket(name)["group"])

    def read(self, name: str, key: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of parameter ``name``'s ``key`` ("master" or a state key), flat."""
        out: torch.Tensor | None = None
        filled = 0
        for p in self._pieces.get(name, []):
            a, z = max(start, p.start), min(stop, p.stop)
            if a >= z:
                continue
            bucket = self.trees[p.file]["buckets"][p.bucket]
            stored = bucket["master"] if key == "master" else bucket["state"].get(key)
            if not isinstance(stored, _Stored):
                raise CheckpointError(f"{self.paths[p.file]}: no {key!r} for {name!r}")
            at = p.at + a - p.start
            piece = self._readers[p.file].get_range(stored.path, at, at + z - a)
            if out is None:
                out = torch.empty(stop - start, dtype=piece.dtype)
            out[a - start : z - start].copy_(piece)
            filled += z - a
        if out is None or filled != stop - start:
            raise CheckpointError(f"optimizer shards do not cover elements [{start}, {stop}) of {name!r}")
        return out

    # ------------------------------------------------------------------ the gathered (layout-free) form
    def gathered(self) -> dict[str, Any]:
        """The state dict ``HybridZeroOptimizer.state_dict()`` would have given (full TP-local tensors)."""
        master, state, groups = {}, {}, []
        for tree in self.trees[:1]:
            for b in tree["buckets"]:
                groups.append({**b["group"], "params": list(b["names"])})
        for name, shape in self._shapes.items():
            numel = math.prod(shape)
            master[name] = self.read(name, "master", 0, numel).view(shape)
            sharded, replicated = self.state_keys(name)
            if sharded or replicated:
                state[name] = {**{k: self.read(name, k, 0, numel).view(shape) for k in sharded}, **replicated}
        head = self.header
        return {"format": STATE_DICT_FORMAT, "dtype": head["dtype"], "zero1_size": head["zero1_size"],
                "scaler": head["scaler"], "skipped_steps": head["skipped_steps"], "num_steps": head["num_steps"],
                "param_groups": groups, "master": master, "state": state, "partition_dim": head["partition_dim"]}

    def gathered_view(self) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
        """The header a gathered optimizer file of this TP rank would have (``({path: {"dtype", "shape"}},
        metadata with the tree skeleton)``), for offline tools that stream tensor by tensor; read the
        tensors with ``gathered_tensor``."""
        tensors: dict[str, dict[str, Any]] = {}
        master, state = [], []
        for name, shape in self._shapes.items():
            f, _ = self._home[name]
            dtype = self._readers[f].tensors[self._bucket(name)["master"].path]["dtype"]
            tensors[f"/master/{name}"] = {"dtype": dtype, "shape": shape}
            master.append([name, {"t": f"/master/{name}"}])
            sharded, replicated = self.state_keys(name)
            if not (sharded or replicated):
                continue
            entries = []
            for key in sharded:
                tensors[f"/state/{name}/{key}"] = {"dtype": dtype, "shape": shape}
                entries.append([key, {"t": f"/state/{name}/{key}"}])
            for key, value in replicated.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"/state/{name}/{key}"] = {"dtype": value.dtype, "shape": tuple(value.shape)}
                    entries.append([key, {"t": f"/state/{name}/{key}"}])
                else:
                    entries.append([key, {"v": value}])
            state.append([name, {"d": entries}])
        head = self.header
        groups = [{"d": [[k, _plain(v)] for k, v in {**b["group"], "params": list(b["names"])}.items()]}
                  for b in self.trees[0]["buckets"]]
        skeleton = {"d": [["format", {"v": STATE_DICT_FORMAT}], ["dtype", {"v": head["dtype"]}],
                          ["zero1_size", {"v": head["zero1_size"]}], ["scaler", _plain(head["scaler"])],
                          ["skipped_steps", {"v": head["skipped_steps"]}], ["num_steps", {"v": head["num_steps"]}],
                          ["param_groups", {"l": groups, "tuple": False}], ["master", {"d": master}],
                          ["state", {"d": state}], ["partition_dim", _plain(head["partition_dim"])]]}
        return tensors, {"skeleton": json.dumps(skeleton), "aliases": "{}"}

    def gathered_tensor(self, path: str) -> torch.Tensor:
        """Tensor ``path`` (``/master/<name>`` or ``/state/<name>/<key>``) of the gathered view."""
        kind, rest = path.lstrip("/").split("/", 1)
        if kind == "master":
            name, key = rest, "master"
        else:
            name, key = rest.rsplit("/", 1)
        shape = self._shapes.get(name)
        if shape is None:
            raise CheckpointError(f"optimizer shards hold no parameter {name!r}")
        if key != "master":
            sharded, replicated = self.state_keys(name)
            if key in replicated:
                return replicated[key]
        return self.read(name, key, 0, math.prod(shape)).view(shape)

    def close(self) -> None:
        for r in self._readers:
            r.close()
        self._readers = []

    def __enter__(self) -> OptimizerShards:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
