"""Tensor-parallel resharding: which stored tensor is split along which dim, and the one routine that
moves a tensor's shards from one TP size to another.

Model weights are identical across DP and optimizer states are saved gathered over ZeRO, keyed by
parameter name, so only the TP size changes what a rank holds. A TP-sharded tensor is the
concatenation of its shards along its parameter's ``partition_dim``; a replicated one is the same on
every rank. The partition dims come from the parameters' own tags: of the live model when training
loads, of the model rebuilt on the meta device from meta.json's config offline (``param_layout``).
A stored tensor belongs to the parameter named by a component of its path (``/state/<name>/exp_avg``)
and is sharded like it when it has the parameter's rank (a 0-dim Adam ``step`` is replicated).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tessera.checkpoint.errors import CheckpointError
from tessera.model import build_model
from tessera.model.args import ModelArgs, check_tensor_parallel_sizes
from tessera.parallel import MetaGroup, partition_dim

__all__ = ["reshard", "reshard_tree", "sharded_dim", "model_param_dims", "ParamLayout", "param_layout"]

ParamDims = Mapping[str, tuple[int | None, int]]  # parameter name -> (partition dim or None, ndim)


def reshard(shards: Sequence[torch.Tensor], dim: int | None, new_size: int, *, name: str = "tensor"
            ) -> list[torch.Tensor]:
    """The ``new_size`` TP shards (views) of the tensor whose shards, in rank order, are ``shards``.

    Sharded along ``dim``: concatenated along it, then split into ``new_size`` equal parts; one shard
    in splits a full tensor, ``new_size=1`` puts one together. Replicated (``dim`` None): ``shards[0]``
    for every new rank.
    """
    if dim is None:
        return [shards[0]] * new_size
    full = torch.cat(list(shards), dim=dim) if len(shards) > 1 else shards[0]
    if full.shape[dim] % new_size:
        raise CheckpointError(f"{name}: size {full.shape[dim]} along dim {dim} does not split over "
                              f"tensor-parallel size {new_size}")
    return list(full.chunk(new_size, dim=dim)) if new_size > 1 else [full]


def sharded_dim(key_path: str, ndim: int, params: ParamDims) -> int | None:
    """Partition dim of the tensor stored at ``key_path`` (None: replicated)."""
    for part in key_path.split("/"):
        if part in params:
            dim, param_ndim = params[part]
            return dim if ndim == param_ndim else None
    return None


def model_param_dims(model: torch.nn.Module) -> dict[str, tuple[int | None, int]]:
    # remove_duplicate=False: a tied output head (same tensor as the embedding) must be resharded too
    return {name: (partition_dim(p), p.dim()) for name, p in model.named_parameters(remove_duplicate=False)}


def reshard_tree(trees: Sequence[Any], params: ParamDims, new_rank: int, new_size: int) -> Any:
    """One TP rank's state at ``new_size`` from every old rank's state tree (same structure each)."""
    def merge(nodes: Sequence[Any], key_path: str) -> Any:
        first = nodes[0]
        if isinstance(first, torch.Tensor):
            dim = sharded_dim(key_path, first.dim(), params)
            piece = reshard(nodes, dim, new_size, name=key_path)[new_rank]
            return piece if dim is None else piece.clone()  # drop the concatenated tensor
        if isinstance(first, dict):
            return {k: merge([n[k] for n in nodes], f"{key_path}/{k}") for k in first}
        if isinstance(first, (list, tuple)):
            return type(first)(merge([n[i] for n in nodes], f"{key_path}/{i}") for i in range(len(first)))
        return first

    return merge(trees, "")


@dataclass
class ParamLayout:
    """A model config's parameters at a TP size: names, TP-local shapes, partition dims, tied aliases."""

    state_keys: list[str]  # model.state_dict() order (tied weights appear under both names)
    shapes: dict[str, tuple[int, ...]]  # TP-local shape per state key
    dims: dict[str, int | None]  # partition dim per state key (None: replicated)
    aliases: dict[str, str]  # state key -> the key it shares storage with (tied output -> embedding)
    param_dims: dict[str, tuple[int | None, int]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.param_dims = {k: (self.dims[k], len(self.shapes[k])) for k in self.state_keys}

    def dim_of_path(self, path: str, ndim: int) -> int | None:
        """Partition dim of the tensor stored at ``path`` (e.g. ``/state/<name>/exp_avg``)."""
        return sharded_dim(path, ndim, self.param_dims)


def param_layout(model_cfg: Mapping[str, Any], tp_size: int) -> ParamLayout:
    """Build the model on the meta device (no memory) to learn its parameters' names, shapes and TP tags."""
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
