"""Tensor-parallel linear and embedding layers with TP-invariant initialization.

Sharding (every parameter is tagged with ``set_tensor_parallel_attrs``):

- ``ColumnParallelLinear``: weight ``[out/tp, in]`` and bias ``[out/tp]``, both sharded along dim 0;
- ``RowParallelLinear``: weight ``[out, in/tp]`` sharded along dim 1; bias ``[out]`` replicated, added
  once after the all-reduce;
- ``VocabParallelEmbedding``: weight ``[vocab/tp, dim]`` sharded along dim 0.

TP-invariant initialization: a parameter is cut into slices along its partition dim (dim 0 for a
replicated one) and slice ``i`` of the FULL tensor is drawn from its own CPU ``torch.Generator`` seeded
with ``derive_seed(seed, "init", name, i)``. A rank draws only its own slices, so the TP=N shards put
together are bitwise the TP=1 tensor, no rank ever holds a full copy, and neither the ambient torch RNG
nor the device's RNG is read or advanced. Values are drawn in fp32 on the CPU and then copied, so they
do not depend on the parameter's device or dtype (beyond the final cast).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from tessera.parallel.attrs import set_tensor_parallel_attrs
from tessera.parallel.comm import (
    copy_to_region,
    gather_from_region,
    group_rank,
    group_size,
    reduce_from_region,
    scatter_to_region,
)
from tessera.parallel.fp8 import Observe
from tessera.parallel.gemm import (
    MODEL_DTYPE,
    NO_OBSERVERS,
    BlockObserve,
    GemmObservers,
    GemmPolicy,
    RecipeState,
    TpSplit,
    linear,
    policy_for,
)
from tessera.parallel.seeds import derive_seed
from tessera.parallel.sequence import (
    gather_from_sequence_region,
    keeps_chunk_only,
    reduce_grad_over_group,
    reduce_scatter_to_sequence_region,
    sequence_parallel_linears,
)
from tessera.parallel.wgrad import mark_fusable

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "column_parallel_linears",
    "divide",
    "tp_invariant_normal_",
]

DEFAULT_INIT_SEED = 1024
_SLICES_PER_CHUNK = 256  # slices drawn into one fp32 CPU buffer before the copy into the parameter
_PARALLEL_MIN_NUMEL = 1 << 22  # draw big shards on several CPU threads (torch releases the GIL)


def divide(total: int, parts: int, what: str) -> int:
    """``total // parts``, or a ValueError naming both sizes when it does not divide."""
    if total % parts:
        raise ValueError(f"{what}={total} is not divisible by tensor-parallel size {parts}")
    return total // parts


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _fill_slices(view: torch.Tensor, first: int, stop: int, offset: int, std: float, base: int) -> None:
    """Draw slices ``first..stop`` of ``view`` (slice dim moved to 0), slice j from generator (base, offset+j)."""
    rest = view.shape[1:]
    per = math.prod(rest)
    for j0 in range(first, stop, _SLICES_PER_CHUNK):
        j1 = min(stop, j0 + _SLICES_PER_CHUNK)
        buf = torch.empty(j1 - j0, per, dtype=torch.float32)
        for j in range(j0, j1):
            gen = torch.Generator(device="cpu")
            gen.manual_seed(derive_seed(base, offset + j))
            buf[j - j0].normal_(0.0, std, generator=gen)
        view[j0:j1].copy_(buf.view(j1 - j0, *rest))


@torch.no_grad()
def tp_invariant_normal_(
    param: torch.Tensor,
    *,
    std: float,
    seed: int,
    name: str,
    partition_dim: int | None,
    tp_rank: int = 0,
) -> torch.Tensor:
    """Fill this rank's shard of ``param`` with N(0, std) so that the shards concatenate to the TP=1 tensor.

    ``name`` is the parameter's full dotted name: it (with ``seed``) decides the values. ``param`` is
    rank ``tp_rank``'s shard along ``partition_dim`` (None: a replicated tensor). Meta and fake tensors
    (shape-only builds and dry runs) are left alone.
    """
    if param.is_meta or is_fake(param) or param.numel() == 0:
        return param
    dim = 0 if partition_dim is None else partition_dim
    offset = tp_rank * param.shape[dim] if partition_dim is not None else 0
    view = param.detach().movedim(dim, 0)
    base = derive_seed(seed, "init", name)
    local = view.shape[0]
    workers = min(torch.get_num_threads(), 8, local)
    if param.numel() < _PARALLEL_MIN_NUMEL or workers <= 1:
        _fill_slices(view, 0, local, offset, std, base)
        return param
    bounds = [local * w // workers for w in range(workers + 1)]
    with ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(_fill_slices, view, bounds[w], bounds[w + 1], offset, std, base) for w in range(workers)]
        for f in futures:
            f.result()
    return param


class _ParallelLinear(nn.Module):
    """What the column- and row-parallel linears share: the parameters, their TP tags and their TP-invariant init.

    ``shard_dim``: the weight dim split over TP (0: output features, 1: input features); the bias is
    sharded with the output features, so it is replicated when the input features are split.
    ``gemm_policy`` is what the layer's GEMMs are asked for (``tessera.parallel.gemm``: the route table picks
    how they run); ``fp8_recipe`` and ``fp8_observe`` read and set its fp8 part.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, process_group: Any, shard_dim: int, *,
                 init_std: float, init_seed: int | None, init_name: str | None,
                 device: torch.device | str | None, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.process_group = process_group
        self.tp_size = group_size(process_group)
        self.tp_rank = group_rank(process_group)
        self.in_features = in_features
        self.out_features = out_features
        self.shard_dim = shard_dim
        self.init_std = init_std
        self.gemm_policy: GemmPolicy = MODEL_DTYPE  # the training setup (model.low_precision) may ask for fp8
        self.gemm_observers: GemmObservers = NO_OBSERVERS  # the precision telemetry's slot
        split = self.tp_size > 1  # which operand dims TP splits (the fp8 route agrees on amaxes over them)
        self.tp_split = TpSplit(process_group, w_split_out=split) if shard_dim == 0 else \
            TpSplit(process_group, x_split_in=split, w_split_in=split)
        shape = [out_features, in_features]
        shape[shard_dim] = divide(shape[shard_dim], self.tp_size, ("out_features", "in_features")[shard_dim])
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(*shape, **factory))
        set_tensor_parallel_attrs(self.weight, shard_dim)
        mark_fusable(self.weight)
        if bias:
            self.bias = nn.Parameter(torch.empty(shape[0], **factory))
            set_tensor_parallel_attrs(self.bias, 0 if shard_dim == 0 else None)
        else:
            self.register_parameter("bias", None)
        if init_seed is not None:
            default_name = f"{type(self).__name__}({in_features},{out_features})"
            self.init_weights(init_seed, default_name if init_name is None else init_name)

    @property
    def fp8_recipe(self) -> str | None:
        """The low-precision recipe of the GEMMs (tensorwise/rowwise fp8, mxfp8, nvfp4; None: the model's
        dtype), as ``model.low_precision`` sets it."""
        return self.gemm_policy.recipe

    @fp8_recipe.setter
    def fp8_recipe(self, recipe: str | None) -> None:
        self.use_recipe(recipe, self.gemm_policy.backend)

    def use_policy(self, policy: GemmPolicy) -> None:
        """Ask the GEMMs for ``policy`` (its recipe, switches and state)."""
        self.gemm_policy = policy

    def use_recipe(self, recipe: str | None, backend: str = "auto", state: RecipeState | None = None) -> None:
        """Ask the GEMMs for ``recipe`` (``gemm.gemm_recipes()`` or None) on the fp8 ``backend``, with the recipe's
        own ``state`` for this layer (``RecipeState``: an RNG stream, signs...)."""
        self.gemm_policy = dataclasses.replace(policy_for(recipe, backend), state=state)

    @property
    def fp8_observe(self) -> Observe | None:
        """Sees the fp8 input's quantization (precision telemetry sets it for a step): the observers' slot."""
        return self.gemm_observers.observe

    @fp8_observe.setter
    def fp8_observe(self, observe: Observe | None) -> None:
        self.gemm_observers = dataclasses.replace(self.gemm_observers, observe=observe)

    @property
    def block_observe(self) -> BlockObserve | None:
        """Sees a block format's input quantization (precision telemetry sets it for a step)."""
        return self.gemm_observers.observe_blocks

    @block_observe.setter
    def block_observe(self, observe: BlockObserve | None) -> None:
        self.gemm_observers = dataclasses.replace(self.gemm_observers, observe_blocks=observe)

    def init_weights(self, seed: int, prefix: str = "") -> None:
        """TP-invariant init: weight ~ N(0, init_std) keyed by ``prefix.weight``; bias zero."""
        tp_invariant_normal_(self.weight, std=self.init_std, seed=seed, name=_join(prefix, "weight"),
                             partition_dim=self.shard_dim, tp_rank=self.tp_rank)
        if self.bias is not None and not self.bias.is_meta:
            with torch.no_grad():
                self.bias.zero_()


class ColumnParallelLinear(_ParallelLinear):
    """``y = x W^T + b`` with the output features split over the TP group (weight ``[out/tp, in]``).

    The input is replicated on every rank (its gradient is all-reduced backward); the output stays
    sharded along the last dim unless ``gather_output``. ``init_seed=None`` leaves the parameters
    uninitialized for a caller that runs ``init_weights(seed, prefix)`` itself (``build_model`` does, with
    each layer's full dotted name). ``init_name=None`` names the layer by class and full shape, so two
    standalone layers of the same class and shape get the same weights unless given distinct names.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        gather_output: bool = False,
        process_group: Any = None,
        *,
        init_std: float = 0.02,
        init_seed: int | None = DEFAULT_INIT_SEED,
        init_name: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, process_group, 0, init_std=init_std, init_seed=init_seed,
                         init_name=init_name, device=device, dtype=dtype)
        self.gather_output = gather_output
        self.out_features_per_rank = self.weight.shape[0]

    def forward(self, x: torch.Tensor, *, input_is_copied: bool = False,
                sequence_parallel: bool = False) -> torch.Tensor:
        """``input_is_copied=True``: the caller already ran ``copy_to_region`` on ``x`` (shared by several
        layers, e.g. wq/wk/wv, so the backward needs one all-reduce instead of one per layer; see
        ``column_parallel_linears``). ``sequence_parallel=True``: ``x`` is this rank's sequence chunk
        (msp), all-gathered here (``tessera.parallel.sequence``)."""
        if sequence_parallel and self.tp_size > 1:
            if input_is_copied:
                raise ValueError("input_is_copied and sequence_parallel exclude each other: a sequence-parallel "
                                 "input is a chunk, gathered by the layer (column_parallel_linears shares it)")
            if keeps_chunk_only(x, [self.weight], [self.gemm_policy]):
                y = sequence_parallel_linears(x, [self.weight], [self.bias], self.process_group,
                                              policies=[self.gemm_policy])[0]
            else:  # the GEMM route keeps the gathered input for its backward (fp8)
                y = self._gemm(gather_from_sequence_region(x, self.process_group))
        else:
            if not input_is_copied:
                x = copy_to_region(x, self.process_group)
            y = self._gemm(x)
        return gather_from_region(y, self.process_group) if self.gather_output else y

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.gemm_policy, self.tp_split, self.gemm_observers)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"({self.out_features_per_rank} per rank, tp={self.tp_size}), bias={self.bias is not None}, "
                f"gather_output={self.gather_output}")


class RowParallelLinear(_ParallelLinear):
    """``y = x W^T + b`` with the input features split over the TP group (weight ``[out, in/tp]``).

    Each rank multiplies its input shard, the partial sums are all-reduced, then the replicated bias is
    added once. With ``input_is_parallel=False`` the replicated input is split here first.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        input_is_parallel: bool = True,
        process_group: Any = None,
        *,
        init_std: float = 0.02,
        init_seed: int | None = DEFAULT_INIT_SEED,
        init_name: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, process_group, 1, init_std=init_std, init_seed=init_seed,
                         init_name=init_name, device=device, dtype=dtype)
        self.input_is_parallel = input_is_parallel
        self.in_features_per_rank = self.weight.shape[1]

    def forward(self, x: torch.Tensor, *, sequence_parallel: bool = False) -> torch.Tensor:
        """``sequence_parallel=True`` (msp): reduce-scatter the partial sums into sequence chunks instead of
        all-reducing them; the replicated bias, added to a chunk, gets its gradient summed over TP."""
        if not self.input_is_parallel:
            x = scatter_to_region(x, self.process_group)
        if self.tp_size == 1:
            return self._gemm(x, self.bias)
        if sequence_parallel:
            y = reduce_scatter_to_sequence_region(self._gemm(x), self.process_group)
            return y if self.bias is None else y + reduce_grad_over_group(self.bias, self.process_group)
        y = reduce_from_region(self._gemm(x), self.process_group)
        return y if self.bias is None else y + self.bias

    def _gemm(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return linear(x, self.weight, bias, self.gemm_policy, self.tp_split, self.gemm_observers)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} ({self.in_features_per_rank} per rank, tp={self.tp_size}), "
                f"out_features={self.out_features}, bias={self.bias is not None}, "
                f"input_is_parallel={self.input_is_parallel}")


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split over the TP group (weight ``[vocab/tp, dim]``).

    Each rank looks up the ids in its vocabulary range, zeros the rest, and the all-reduce assembles
    the full embedding on every rank.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        process_group: Any = None,
        *,
        init_std: float = 0.02,
        init_seed: int | None = DEFAULT_INIT_SEED,
        init_name: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.process_group = process_group
        self.tp_size = group_size(process_group)
        self.tp_rank = group_rank(process_group)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_per_rank = divide(num_embeddings, self.tp_size, "num_embeddings (vocab size)")
        self.vocab_start = self.tp_rank * self.num_embeddings_per_rank
        self.vocab_end = self.vocab_start + self.num_embeddings_per_rank
        self.init_std = init_std
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_rank, embedding_dim, device=device, dtype=dtype)
        )
        set_tensor_parallel_attrs(self.weight, 0)
        if init_seed is not None:
            self.init_weights(init_seed, self._default_name() if init_name is None else init_name)

    def _default_name(self) -> str:
        return f"VocabParallelEmbedding({self.num_embeddings},{self.embedding_dim})"

    def init_weights(self, seed: int, prefix: str = "") -> None:
        """TP-invariant init: weight ~ N(0, init_std) keyed by ``prefix.weight``."""
        tp_invariant_normal_(self.weight, std=self.init_std, seed=seed, name=_join(prefix, "weight"),
                             partition_dim=0, tp_rank=self.tp_rank)

    def forward(self, input_ids: torch.Tensor, *, sequence_parallel: bool = False) -> torch.Tensor:
        """``sequence_parallel=True`` (msp): the partial lookups are reduce-scattered into sequence chunks
        (``input_ids`` ``[..., seq]`` -> ``[..., seq/tp, dim]``) instead of all-reduced."""
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if sequence_parallel:
            return reduce_scatter_to_sequence_region(out, self.process_group)
        return reduce_from_region(out, self.process_group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} "
                f"(rows {self.vocab_start}..{self.vocab_end - 1} on this rank, tp={self.tp_size})")


def column_parallel_linears(x: torch.Tensor, layers: Sequence[ColumnParallelLinear], *,
                            sequence_parallel: bool = False) -> list[torch.Tensor]:
    """Several column-parallel layers on one input (q/k/v, gate/up), entering the TP region once.

    mtp: one ``copy_to_region``, so backward all-reduces the summed input gradient once, not once per
    layer. msp (``x`` is this rank's sequence chunk): one all-gather forward, one reduce-scatter backward,
    and only the chunk is kept for backward (``sequence_parallel_linears``).
    """
    group = layers[0].process_group
    if any(layer.process_group is not group or layer.gather_output for layer in layers):
        raise ValueError("column_parallel_linears: the layers must share one process group and keep their "
                         "outputs sharded (gather_output=False)")
    if sequence_parallel and group_size(group) > 1:
        weights, policies = [m.weight for m in layers], [m.gemm_policy for m in layers]
        if not keeps_chunk_only(x, weights, policies):  # a GEMM route keeps the gathered input itself (fp8)
            x = gather_from_sequence_region(x, group)
            return [layer(x, input_is_copied=True) for layer in layers]
        return sequence_parallel_linears(x, weights, [m.bias for m in layers], group, policies=policies)
    x = copy_to_region(x, group)
    return [layer(x, input_is_copied=True) for layer in layers]
