"""Cross-entropy on vocab-sharded logits, in fp32 (fp64 for fp64 logits), without gathering the logits, and
the head's GEMM fused with it in chunks of tokens (``linear_cross_entropy``) so the logits never exist whole.

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

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake

from tessera.logs import log_once
from tessera.parallel.comm import all_reduce, group_rank, group_size
from tessera.parallel.gemm import fuses_wgrad, linear_grads, linear_no_autograd, wgrad_into_main
from tessera.parallel.wgrad import placeholder

__all__ = ["LossSpec", "linear_cross_entropy", "vocab_parallel_cross_entropy"]

_REDUCTIONS = ("mean", "sum", "none")


@dataclass(frozen=True)
class LossSpec:
    """How the loss reduces: ``ignore_index``, ``label_smoothing``, ``reduction`` ("mean" over labelled tokens,
    "sum", "none"), and ``chunk_tokens`` for the fused head and loss (tokens whose logits exist at once)."""

    ignore_index: int = -100
    label_smoothing: float = 0.0
    reduction: str = "mean"
    chunk_tokens: int = 1024
    compiled: bool = False  # the fused path's per-chunk math through torch.compile (``_ChunkKernels``)

    def __post_init__(self) -> None:
        if self.reduction not in _REDUCTIONS:
            raise ValueError(f"reduction={self.reduction!r}: must be one of {list(_REDUCTIONS)}")
        if not 0.0 <= self.label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing={self.label_smoothing} must be in [0, 1]")
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens={self.chunk_tokens} must be >= 1")


@dataclass
class _Rows:
    """One block of rows of the vocab-parallel loss: what the forward found, what the backward needs."""

    loss: torch.Tensor  # per row, fp32 (0 where ignored)
    lse: torch.Tensor  # log-sum-exp over the whole vocabulary, per row
    exp: torch.Tensor  # exp(logits - row max) of this rank's shard (the softmax once divided by sum_exp)
    sum_exp: torch.Tensor
    local_t: torch.Tensor  # the target's column in this shard (0 where another rank holds it)
    mine: torch.Tensor  # this rank's shard holds the target
    valid: torch.Tensor  # not ignore_index


def _rows_forward(x: torch.Tensor, t: torch.Tensor, group: Any, start: int, vocab: int, ignore_index: int,
                  label_smoothing: float) -> _Rows:
    """Cross-entropy of rows ``x`` (``[n, V/tp]``, fp32 or fp64, a new buffer this may overwrite) against ``t``:
    one MAX all-reduce, then one SUM all-reduce carrying the exp sums, target logits and (label smoothing)
    logit sums together."""
    v_local = x.shape[-1]
    row_max = x.max(dim=-1).values
    all_reduce(row_max, group, dist.ReduceOp.MAX)
    shifted = x.sub_(row_max.unsqueeze(-1))
    valid = t != ignore_index
    mine = valid & (t >= start) & (t < start + v_local)
    local_t = torch.where(mine, t - start, torch.zeros_like(t))
    picked = shifted.gather(1, local_t.unsqueeze(-1)).squeeze(-1) * mine
    logit_sum = shifted.sum(-1) if label_smoothing > 0 else None  # before exp_ overwrites shifted
    exp = shifted.exp_()
    parts = [exp.sum(-1), picked] + ([logit_sum] if logit_sum is not None else [])
    stacked = all_reduce(torch.stack(parts, dim=0), group)
    sum_exp, picked = stacked[0], stacked[1]
    lse = sum_exp.log()
    loss = lse - picked
    if label_smoothing > 0:
        loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - stacked[2] / vocab)
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    return _Rows(loss, lse + row_max, exp, sum_exp, local_t, mine, valid)


def _reduce(loss: torch.Tensor, valid: torch.Tensor, reduction: str, shape: torch.Size) -> tuple[torch.Tensor, Any]:
    count = valid.sum()
    if reduction == "mean":
        return loss.sum() / count.clamp(min=1), count
    if reduction == "sum":
        return loss.sum(), count
    return loss.view(shape), count


def _grad_rows(probs: torch.Tensor, local_t: torch.Tensor, mine: torch.Tensor, valid: torch.Tensor,
               label_smoothing: float, vocab: int, row_scale: torch.Tensor) -> torch.Tensor:
    """d loss / d logits of a block of rows, in place in ``probs`` (this shard's softmax): minus the smoothed
    one-hot target, times each row's incoming gradient (``row_scale``, 0 where ignored)."""
    grad = probs.sub_(label_smoothing / vocab) if label_smoothing > 0 else probs
    rows = torch.arange(grad.shape[0], device=grad.device)
    grad[rows, local_t] -= (1.0 - label_smoothing) * mine.to(grad.dtype)
    return grad.mul_((valid * row_scale).unsqueeze(-1))


def _row_scale(grad_out: torch.Tensor, reduction: str, count: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The incoming gradient of each row's loss (a scalar for "mean" and "sum", one per row for "none")."""
    if reduction == "mean":
        return (grad_out.to(dtype) / count.clamp(min=1)).expand(n)
    if reduction == "sum":
        return grad_out.to(dtype).expand(n)
    return grad_out.reshape(-1).to(dtype)


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
        compute = torch.promote_types(logits.dtype, torch.float32)  # fp32, or fp64 for fp64 logits
        x = logits.reshape(-1, v_local).to(compute, copy=True)  # a new buffer: the input is never modified
        rows = _rows_forward(x, target.reshape(-1), group, rank * v_local, v_local * tp, ignore_index, label_smoothing)
        probs = rows.exp.div_(rows.sum_exp.unsqueeze(-1))  # softmax of this rank's shard, kept for backward
        out, count = _reduce(rows.loss, rows.valid, reduction, target.shape)
        ctx.save_for_backward(probs, rows.local_t, rows.mine, rows.valid, count)
        ctx.label_smoothing = label_smoothing
        ctx.vocab = v_local * tp
        ctx.reduction = reduction
        ctx.logits_shape = logits.shape
        ctx.logits_dtype = logits.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        probs, local_t, mine, valid, count = ctx.saved_tensors
        scale = _row_scale(grad_out, ctx.reduction, count, probs.shape[0], probs.dtype)
        grad = _grad_rows(probs.clone(), local_t, mine, valid, ctx.label_smoothing, ctx.vocab, scale)
        return grad.view(ctx.logits_shape).to(ctx.logits_dtype), None, None, None, None, None


def _target_columns(t: torch.Tensor, valid: torch.Tensor, start: int,
                    v_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's target column in this vocab shard (0 where another rank holds it) and whether it is here."""
    mine = valid & (t >= start) & (t < start + v_local)
    return torch.where(mine, t - start, torch.zeros_like(t)), mine


def _row_max(logits: torch.Tensor, compute: torch.dtype) -> torch.Tensor:
    """Each row's largest logit of this shard, in ``compute``."""
    return logits.amax(dim=-1).to(compute)


def _row_sums(logits: torch.Tensor, row_max: torch.Tensor, local_t: torch.Tensor, mine: torch.Tensor,
              smoothing: bool) -> torch.Tensor:
    """``[sum exp(x - max), x[t] - max where this shard holds t (else 0), sum (x - max) if smoothing]`` of each row
    of this shard, stacked ``[2 or 3, rows]`` for one all-reduce over TP, in ``row_max``'s dtype."""
    picked = (logits.gather(1, local_t.unsqueeze(-1)).squeeze(-1).to(row_max.dtype) - row_max) * mine
    shifted = logits.to(row_max.dtype).sub_(row_max.unsqueeze(-1))  # overwrites fp32 logits, the caller's to give
    logit_sum = [shifted.sum(-1)] if smoothing else []
    return torch.stack([shifted.exp_().sum(-1), picked, *logit_sum], dim=0)


def _row_sums_pointwise(logits: torch.Tensor, row_max: torch.Tensor, local_t: torch.Tensor, mine: torch.Tensor,
                        smoothing: bool) -> torch.Tensor:
    """``_row_sums`` without writing into its operands: what the compiler takes. Fused, the in-place form saves
    nothing, and on fp32 logits (where ``.to`` is no copy) it writes into the compiled function's input, which
    torch 2.11's inductor got wrong: wrong sums, a wrong loss from the first step (``test_chunked_loss.py``)."""
    picked = (logits.gather(1, local_t.unsqueeze(-1)).squeeze(-1).to(row_max.dtype) - row_max) * mine
    shifted = logits.to(row_max.dtype) - row_max.unsqueeze(-1)
    logit_sum = [shifted.sum(-1)] if smoothing else []
    return torch.stack([shifted.exp().sum(-1), picked, *logit_sum], dim=0)


def _logits_grad(logits: torch.Tensor, lse: torch.Tensor, local_t: torch.Tensor, mine: torch.Tensor,
                 coef: torch.Tensor, label_smoothing: float, vocab: int) -> torch.Tensor:
    """d loss / d logits of a chunk in the logits' dtype: (softmax - smoothed one-hot target) times each row's
    incoming gradient ``coef`` (0 where ignored), computed in ``lse``'s dtype, in place (in the logits themselves
    when they have that dtype: a fresh GEMM output the caller gives away)."""
    probs = logits.to(lse.dtype).sub_(lse.unsqueeze(-1)).exp_()
    if label_smoothing > 0:
        probs.sub_(label_smoothing / vocab)
    rows = torch.arange(probs.shape[0], device=probs.device)
    probs[rows, local_t] -= (1.0 - label_smoothing) * mine.to(probs.dtype)
    return probs.mul_(coef.unsqueeze(-1)).to(logits.dtype)


def _logits_grad_pointwise(logits: torch.Tensor, lse: torch.Tensor, local_t: torch.Tensor, mine: torch.Tensor,
                           coef: torch.Tensor, label_smoothing: float, vocab: int) -> torch.Tensor:
    """``_logits_grad`` as one elementwise expression (the target column picked by a comparison, not written by
    an index): what the compiler turns into one kernel reading the logits once and writing the gradient once."""
    probs = (logits.to(lse.dtype) - lse.unsqueeze(-1)).exp()
    if label_smoothing > 0:
        probs = probs - label_smoothing / vocab
    cols = torch.arange(logits.shape[-1], device=logits.device)
    target = (cols.unsqueeze(0) == local_t.unsqueeze(-1)) & mine.unsqueeze(-1)
    probs = probs - target.to(probs.dtype) * (1.0 - label_smoothing)
    return (probs * coef.unsqueeze(-1)).to(logits.dtype)


@dataclass(frozen=True)
class _ChunkKernels:
    """The fused path's per-chunk math: plain torch ops (each a pass over the chunk's logits, fp32 copies in
    between), or the same functions through ``torch.compile``, where each is one kernel that reads the
    model-dtype logits once (``LossSpec.compiled``: train.py sets it with ``model.compile.enabled``)."""

    row_max: Any
    row_sums: Any
    logits_grad: Any


_EAGER = _ChunkKernels(_row_max, _row_sums, _logits_grad)


@functools.cache
def _compiled_kernels() -> _ChunkKernels:
    log_once("loss: the fused head's per-chunk softmax and its gradient run through torch.compile "
                     "(inductor), one pass over each chunk's logits")
    return _ChunkKernels(*(torch.compile(f, fullgraph=True, dynamic=False) for f in (_row_max, _row_sums_pointwise,
                                                                                     _logits_grad_pointwise)))


def chunk_kernels(compiled: bool, like: torch.Tensor | None = None) -> _ChunkKernels:
    """The compiled kernels when asked for, except on meta or fake tensors (a dry run stays eager, as
    compiled blocks do)."""
    if compiled and not (like is not None and (like.is_meta or is_fake(like))):
        return _compiled_kernels()
    return _EAGER


class _LinearCrossEntropy(torch.autograd.Function):
    """The head's GEMM and the vocab-parallel loss, ``chunk`` rows at a time: each chunk's logits are made,
    reduced to per-row losses and log-sum-exps, and freed; the backward makes them again from the saved
    input and weight and turns them into the input's and the weight's gradients chunk by chunk."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, group: Any,
                spec: LossSpec) -> torch.Tensor:
        tp, rank = group_size(group), group_rank(group)
        v_local = weight.shape[0]
        start, vocab = rank * v_local, v_local * tp
        compute = torch.promote_types(x.dtype, torch.float32)
        loss = torch.empty(x.shape[0], dtype=compute, device=x.device)
        lse = torch.empty_like(loss)
        valid = target != spec.ignore_index
        kernels = chunk_kernels(spec.compiled, x)
        smoothing = spec.label_smoothing > 0
        for a in range(0, x.shape[0], spec.chunk_tokens):
            b = min(a + spec.chunk_tokens, x.shape[0])
            logits = linear_no_autograd(x[a:b], weight)  # the model dtype: the kernels read it once each
            local_t, mine = _target_columns(target[a:b], valid[a:b], start, v_local)
            row_max = kernels.row_max(logits, compute)
            all_reduce(row_max, group, dist.ReduceOp.MAX)
            sums = kernels.row_sums(logits, row_max, local_t, mine, smoothing)
            sums = all_reduce(sums, group)  # exp sums, target logits (and logit sums) in one all-reduce
            shifted_lse = sums[0].log()
            lse[a:b] = shifted_lse + row_max
            rows_loss = shifted_lse - sums[1]
            if smoothing:
                rows_loss = ((1.0 - spec.label_smoothing) * rows_loss
                             + spec.label_smoothing * (shifted_lse - sums[2] / vocab))
            loss[a:b] = torch.where(valid[a:b], rows_loss, torch.zeros_like(rows_loss))
            del logits
        out, count = _reduce(loss, valid, spec.reduction, target.shape)
        ctx.save_for_backward(x, weight, target, lse, count)
        ctx.group, ctx.spec, ctx.start, ctx.vocab = group, spec, start, vocab
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, target, lse, count = ctx.saved_tensors
        spec: LossSpec = ctx.spec
        fused = ctx.needs_input_grad[1] and fuses_wgrad(x, weight)  # straight into the fp32 main gradient
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1] and not fused, False)
        gx = torch.empty_like(x) if needs[0] else None
        gw = torch.zeros(weight.shape, dtype=torch.promote_types(weight.dtype, torch.float32),
                         device=weight.device) if needs[1] else None
        scale = _row_scale(grad_out, spec.reduction, count, x.shape[0], lse.dtype)
        v_local = weight.shape[0]
        kernels = chunk_kernels(spec.compiled, x)
        for a in range(0, x.shape[0], spec.chunk_tokens):
            b = min(a + spec.chunk_tokens, x.shape[0])
            t = target[a:b]
            valid = t != spec.ignore_index
            local_t, mine = _target_columns(t, valid, ctx.start, v_local)
            logits = linear_no_autograd(x[a:b], weight)
            grad = kernels.logits_grad(logits, lse[a:b], local_t, mine, valid * scale[a:b], spec.label_smoothing,
                                       ctx.vocab)  # in the model dtype, as the GEMMs take it
            gx_c, gw_c, _ = linear_grads(grad, x[a:b], weight, False, needs)
            if gx is not None and gx_c is not None:
                gx[a:b] = gx_c
            if gw is not None and gw_c is not None:
                gw.add_(gw_c)
            if fused:
                wgrad_into_main(grad, x[a:b], weight)
            del logits, grad
        if fused:
            return gx, placeholder(weight), None, None, None
        return gx, None if gw is None else gw.to(weight.dtype), None, None, None


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, process_group: Any = None,
                         spec: LossSpec | None = None) -> torch.Tensor:
    """``vocab_parallel_cross_entropy(linear(x, weight), target)`` without the ``[tokens, V/tp]`` logits: ``x``
    ``[..., h]`` (this rank's full input of the head, replicated over TP), ``weight`` ``[V/tp, h]`` (the head's
    vocab shard), ``target`` ``[...]``. At most ``spec.chunk_tokens`` rows of fp32 logits exist at once,
    forward or backward; the backward makes them again (one more head GEMM per step) instead of keeping
    them. The gradient of ``x`` is this rank's part (the caller's region entry sums it over TP)."""
    spec = spec or LossSpec()
    if x.shape[:-1] != target.shape:
        raise ValueError(f"input shape {tuple(x.shape)} does not match target shape {tuple(target.shape)} "
                         "(expected input = target shape + [hidden])")
    out = _LinearCrossEntropy.apply(x.reshape(-1, x.shape[-1]), weight, target.reshape(-1), process_group, spec)
    return out.view(target.shape) if spec.reduction == "none" else out


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
