"""Cross-entropy on vocab-sharded logits, in fp32 (fp64 for fp64 logits), without gathering the logits.

Each rank holds logits for vocabulary rows ``[rank*V/tp, (rank+1)*V/tp)``. The log-sum-exp needs a
global max (one MAX all-reduce) and global sums; the target logit lives on exactly one rank. The three
sums (exp, target logit, plain logit sum for label smoothing) travel in ONE all-reduce.

Semantics match ``F.cross_entropy(logits, target, ignore_index=..., label_smoothing=eps)``:
``loss_i = (1-eps) * (lse_i - x_i[t_i]) + eps * (lse_i - mean_j x_ij)``; ignored tokens contribute
nothing; ``"mean"`` divides by the number of non-ignored tokens. One deliberate difference: when every
token is ignored, ``"mean"`` returns 0 (with zero gradients) instead of NaN, so an all-padding
micro-batch cannot poison a training step. Targets outside ``[0, V)`` other than ``ignore_index`` are
not checked (that would cost a device sync) and are treated as matching no class.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tessera.parallel.comm import all_reduce, group_rank, group_size

__all__ = ["vocab_parallel_cross_entropy"]

_REDUCTIONS = ("mean", "sum", "none")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,
        target: torch.Tensor,
        group: Any,
        ignore_index: int,
        label_smoothing: float,
        reduction: str,
    ) -> torch.Tensor:
        tp, rank = group_size(group), group_rank(group)
        v_local = logits.shape[-1]
        vocab = v_local * tp
        start = rank * v_local
        compute = torch.promote_types(logits.dtype, torch.float32)  # fp32, or fp64 for fp64 logits
        x = logits.reshape(-1, v_local).to(compute)
        t = target.reshape(-1)

        row_max = x.max(dim=-1).values
        all_reduce(row_max, group, dist.ReduceOp.MAX)
        shifted = x - row_max.unsqueeze(-1)  # a new buffer: the input is never modified

        valid = t != ignore_index
        mine = valid & (t >= start) & (t < start + v_local)
        local_t = torch.where(mine, t - start, torch.zeros_like(t))
        picked = shifted.gather(1, local_t.unsqueeze(-1)).squeeze(-1) * mine

        logit_sum = shifted.sum(-1) if label_smoothing > 0 else None  # before exp_ overwrites shifted
        probs = shifted.exp_()
        parts = [probs.sum(-1), picked] + ([logit_sum] if logit_sum is not None else [])
        stacked = all_reduce(torch.stack(parts, dim=0), group)
        sum_exp, picked = stacked[0], stacked[1]
        lse = sum_exp.log()
        loss = lse - picked
        if label_smoothing > 0:
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - stacked[2] / vocab)
        loss = torch.where(valid, loss, torch.zeros_like(loss))
        probs.div_(sum_exp.unsqueeze(-1))  # softmax of this rank's shard, kept for backward

        count = valid.sum()
        ctx.save_for_backward(probs, local_t, mine, valid, count)
        ctx.label_smoothing = label_smoothing
        ctx.vocab = vocab
        ctx.reduction = reduction
        ctx.logits_shape = logits.shape
        ctx.logits_dtype = logits.dtype
        if reduction == "mean":
            return loss.sum() / count.clamp(min=1)
        if reduction == "sum":
            return loss.sum()
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        probs, local_t, mine, valid, count = ctx.saved_tensors
        eps = ctx.label_smoothing
        grad = probs - eps / ctx.vocab if eps > 0 else probs.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_t] -= (1.0 - eps) * mine.to(grad.dtype)
        if ctx.reduction == "mean":
            scale = grad_out.to(grad.dtype) / count.clamp(min=1)
            grad.mul_(valid.unsqueeze(-1) * scale)
        elif ctx.reduction == "sum":
            grad.mul_(valid.unsqueeze(-1) * grad_out.to(grad.dtype))
        else:
            grad.mul_((valid * grad_out.reshape(-1).to(grad.dtype)).unsqueeze(-1))
        return grad.view(ctx.logits_shape).to(ctx.logits_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor,
    target: torch.Tensor,
    process_group: Any = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of vocab-sharded ``logits_shard`` ``[..., V/tp]`` against ``target`` ``[...]``, in fp32.

    ``reduction``: ``"mean"`` over non-ignored tokens (training), ``"sum"`` of per-token nats
    (validation: add up, divide by the token count yourself), or ``"none"`` (per-token, shaped like
    ``target``). The result is fp32 for fp16/bf16/fp32 logits (fp64 for fp64); the gradient has the
    logits' dtype.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}: must be one of {list(_REDUCTIONS)}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1]")
    if logits_shard.shape[:-1] != target.shape:
        raise ValueError(
            f"logits shape {tuple(logits_shard.shape)} does not match target shape {tuple(target.shape)} "
            "(expected logits = target shape + [vocab shard])"
        )
    return _VocabParallelCrossEntropy.apply(
        logits_shard, target, process_group, ignore_index, float(label_smoothing), reduction
    )
