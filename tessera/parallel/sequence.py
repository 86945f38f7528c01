"""Sequence parallelism (``parallel.tensor.mode="msp"``): the activations between a row-parallel output
and the next column-parallel input -- norms, residual adds, dropout -- live as contiguous sequence
chunks, one per TP rank, instead of as a full copy on every rank (Megatron's ``--sequence-parallel``).

Rank ``r`` of a group of ``t`` holds tokens ``[r*S/t, (r+1)*S/t)`` of the sequence dim (dim -2 of a
``[batch, seq, hidden]`` activation). The conjugate pairs that replace mtp's all-reduces:

=================================  ==============================  ==============================
function                           forward                         backward
=================================  ==============================  ==============================
gather_from_sequence_region        all-gather along the sequence   reduce-scatter (sum)
reduce_scatter_to_sequence_region  reduce-scatter (sum)            all-gather
sequence_parallel_linears          all-gather, then x W_i^T + b_i  re-gather, reduce-scatter dx
reduce_grad_over_group             identity                        all-reduce (sum) of the grad
=================================  ==============================  ==============================

``sequence_parallel_linears`` keeps only this rank's chunk of the input for backward and gathers it
again there (Megatron does the same): keeping the gathered input would make every column-parallel
layer hold the full activation again, which is what sequence parallelism exists to avoid.

A TP-replicated parameter used on a sequence chunk (norm weights, a row-parallel bias) gets a partial
gradient on each rank; ``reduce_grad_over_group`` sums it inside autograd, so the gradient the
optimizer sees is complete and identical on every TP rank, as in mtp -- no optimizer knowledge needed.

Every collective runs on the tensor's own device and dtype (never a copy to the CPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from tessera.parallel.comm import (
    MetaGroup,
    all_reduce,
    copy_to_region,
    fast_collectives_for,
    gather_tensor,
    group_rank,
    group_size,
)
from tessera.parallel.gemm import MODEL_DTYPE, GemmPolicy, TpSplit, linear, linear_grads, linear_no_autograd, route_for

__all__ = [
    "TENSOR_MODES",
    "SEQUENCE_DIM",
    "sequence_chunk",
    "all_gather_sequence",
    "reduce_scatter_sequence",
    "gather_from_sequence_region",
    "reduce_scatter_to_sequence_region",
    "sequence_parallel_linears",
    "keeps_chunk_only",
    "reduce_grad_over_group",
    "sequence_dropout",
]

# parallel.tensor.mode's values, defined here, the lowest layer that needs them (model and config import it):
# "mtp" keeps activations replicated over TP between layers, "msp" shards them along the sequence (this module)
TENSOR_MODES = ("mtp", "msp")
SEQUENCE_DIM = -2  # activations are [..., seq, features]


# torch >= 2.9 names it reduce_scatter_single (reduce_scatter_tensor is deprecated there)
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _chunk_len(length: int, size: int) -> int:
    if length % size:
        raise ValueError(f"sequence length {length} is not divisible by tensor-parallel size {size} "
                         "(sequence parallelism splits the sequence evenly over the TP ranks)")
    return length // size


def sequence_chunk(x: torch.Tensor, group: Any, dim: int = SEQUENCE_DIM) -> torch.Tensor:
    """This rank's contiguous chunk of ``x`` along ``dim`` (a copy, so the full tensor can be freed)."""
    size = group_size(group)
    if size == 1:
        return x
    n = _chunk_len(x.shape[dim], size)
    return x.narrow(dim, group_rank(group) * n, n).clone(memory_format=torch.contiguous_format)


def all_gather_sequence(x: torch.Tensor, group: Any, dim: int = SEQUENCE_DIM) -> torch.Tensor:
    """The ranks' chunks concatenated along ``dim`` in rank order (no autograd)."""
    return gather_tensor(x, dim % x.dim(), group)


def reduce_scatter_sequence(x: torch.Tensor, group: Any, dim: int = SEQUENCE_DIM) -> torch.Tensor:
    """Sum ``x`` over ``group`` and keep this rank's chunk along ``dim`` (no autograd; ``x`` is not modified)."""
    size = group_size(group)
    if size == 1:
        return x
    n = _chunk_len(x.shape[dim], size)
    d = dim % x.dim()
    return _reduce_scatter_stacked(x.unflatten(d, (size, n)).movedim(d, 0).contiguous(), group)


def _reduce_scatter_stacked(stacked: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum over ``group`` of ``stacked[rank]``: ``stacked`` holds one chunk per rank (rank order) along dim 0.

    The tensor form of the collective, which ``torch.compile`` traces as a functional collective. Where
    ``group`` has a fast all-reduce route (the node-local shared-memory one on CPU), the sum goes
    through it and this rank's chunk is cut afterwards: one route for mtp and msp alike.
    """
    if isinstance(group, MetaGroup):
        if not stacked.is_meta:
            raise RuntimeError(f"a collective was called on a real tensor with {group}")
        return stacked[group.rank].clone()
    fast = fast_collectives_for(group)
    if fast is not None and fast.supports(stacked, dist.ReduceOp.SUM):
        return all_reduce(stacked, group)[group_rank(group)].clone()
    if torch.compiler.is_compiling():  # out of place when traced, as comm._all_reduce_copy says why
        return funcol.reduce_scatter_tensor(stacked.flatten(0, 1), "sum", 0, group)
    out = torch.empty_like(stacked[0])
    _reduce_scatter_tensor(out, stacked.flatten(0, 1), group=group)  # dim 0 = ranks x the chunk's dim 0
    return out


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return all_gather_sequence(x, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return reduce_scatter_sequence(grad, ctx.group, ctx.dim), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return reduce_scatter_sequence(x, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_gather_sequence(grad.contiguous(), ctx.group, ctx.dim), None, None


def gather_from_sequence_region(x: torch.Tensor, group: Any, dim: int = SEQUENCE_DIM) -> torch.Tensor:
    """Enter a TP region from sequence chunks: all-gather forward, reduce-scatter of the gradient backward
    (each rank's gradient of the full input is partial: its heads/vocab shard only)."""
    return x if group_size(group) == 1 else _GatherFromSequence.apply(x, group, dim)


def reduce_scatter_to_sequence_region(x: torch.Tensor, group: Any, dim: int = SEQUENCE_DIM) -> torch.Tensor:
    """Leave a TP region by summing partial results into sequence chunks: reduce-scatter forward,
    all-gather of the gradient backward."""
    return x if group_size(group) == 1 else _ReduceScatterToSequence.apply(x, group, dim)


class _SequenceParallelLinears(torch.autograd.Function):
    """``[gather(x) W_i^T + b_i for i]``, saving the chunk ``x`` (not the gathered input) for backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any, dim: int, policies: tuple[GemmPolicy, ...],
                *params: torch.Tensor | None):
        count = len(policies)
        weights = [w for w in params[:count] if w is not None]  # weights are never None; biases may be
        biases = params[count:]
        split = TpSplit(group, w_split_out=True)  # column-parallel weights
        full = all_gather_sequence(x, group, dim)
        outs = tuple(linear_no_autograd(full, w, b, p, split) for w, b, p in zip(weights, biases, policies))
        ctx.save_for_backward(x, *weights)
        ctx.group, ctx.dim, ctx.policies, ctx.split = group, dim, policies, split
        ctx.has_bias = [b is not None for b in biases]
        return outs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        x, *weights = ctx.saved_tensors
        count, needs, policies, split = len(ctx.policies), ctx.needs_input_grad, ctx.policies, ctx.split
        full = all_gather_sequence(x, ctx.group, ctx.dim)  # gathered again: only the chunk was kept
        grad_w: list[torch.Tensor | None] = []
        grad_b: list[torch.Tensor | None] = []
        for i, (g, w) in enumerate(zip(grads, weights)):  # weight grads first: then the gathered input can go
            _, gw, gb = linear_grads(g, full, w, ctx.has_bias[i], (False, needs[4 + i], needs[4 + count + i]),
                                     policies[i], split)
            grad_w.append(gw)
            grad_b.append(gb)
        del full
        grad_x = None
        if needs[0]:  # the input gradient, computed chunk by chunk into the reduce-scatter's input
            n = x.shape[ctx.dim]
            stacked = x.new_empty((group_size(ctx.group), *x.shape))  # the reduce-scatter's input, rank r at [r]
            for r in range(stacked.shape[0]):
                for i, (g, w) in enumerate(zip(grads, weights)):
                    gx = linear_grads(g.narrow(ctx.dim, r * n, n), x, w, False, (True, False, False), policies[i],
                                      split)[0]
                    assert gx is not None  # the input gradient was asked for
                    if i == 0:
                        stacked[r].copy_(gx)
                    else:
                        stacked[r].add_(gx)
            grad_x = _reduce_scatter_stacked(stacked, ctx.group)
        return (grad_x, None, None, None, *grad_w, *grad_b)


def keeps_chunk_only(x: torch.Tensor, weights: Sequence[torch.Tensor], policies: Sequence[GemmPolicy]) -> bool:
    """Whether the GEMM routes of these column-parallel weights let msp keep only the sequence chunk ``x`` for
    backward (``GemmRoute.sequence_chunked``); else the caller gathers ``x`` and the layers keep it themselves."""
    return all(route_for(x, w, p).sequence_chunked for w, p in zip(weights, policies))


def sequence_parallel_linears(x: torch.Tensor, weights: Sequence[torch.Tensor],
                              biases: Sequence[torch.Tensor | None], group: Any,
                              dim: int = SEQUENCE_DIM,
                              policies: Sequence[GemmPolicy] | None = None) -> list[torch.Tensor]:
    """Column-parallel linears (weights ``[out_i/t, in]``) on the sequence chunk ``x``: one all-gather
    forward; backward re-gathers ``x``, sums the input gradients and reduce-scatters them once. ``policies``:
    each layer's ``GemmPolicy`` (default: the model's dtype); their routes must keep the chunk only
    (``keeps_chunk_only``)."""
    if len(weights) != len(biases):
        raise ValueError(f"{len(weights)} weights but {len(biases)} biases (use None for a layer without bias)")
    chosen = tuple(policies) if policies is not None else (MODEL_DTYPE,) * len(weights)
    if group_size(group) == 1:
        return [linear(x, w, b, p) for w, b, p in zip(weights, biases, chosen)]
    if not keeps_chunk_only(x, weights, chosen):
        raise ValueError("sequence_parallel_linears: a GEMM route here keeps the gathered input (fp8): gather "
                         "with gather_from_sequence_region and run the layers on it")
    return list(_SequenceParallelLinears.apply(x, group, dim, chosen, *weights, *biases))


def reduce_grad_over_group(t: torch.Tensor, group: Any) -> torch.Tensor:
    """Use a TP-replicated tensor on a sequence chunk: identity forward, its gradient summed over ``group``
    backward (each rank's chunk contributes part of it)."""
    return copy_to_region(t, group)


def sequence_dropout(x: torch.Tensor, p: float, group: Any, dim: int = SEQUENCE_DIM) -> torch.Tensor:
    """Dropout of the chunk ``x`` with the mask mtp would draw for the full sequence, cut to this chunk.

    The mask is drawn from the ambient generator (identical on every TP rank, as dropout outside TP
    regions must be) for the full shape, then this rank's chunk is kept: chunks never share a mask, and
    on the CPU the result is bitwise mtp's ``F.dropout`` (same draws, same order). The full mask is
    transient; only the chunk is kept for backward.
    """
    size = group_size(group)
    if p == 0.0 or size == 1:
        return F.dropout(x, p, training=True) if p > 0.0 else x
    if p == 1.0:  # as F.dropout: nothing drawn
        return x * torch.zeros((), dtype=x.dtype, device=x.device)
    shape = list(x.shape)
    shape[dim] *= size
    noise = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(1 - p)
    noise = sequence_chunk(noise, group, dim).div_(1 - p)
    return x * noise
