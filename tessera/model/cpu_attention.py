"""Causal attention on the CPU: which kernel, in which precision, and packed documents without a mask.

The rule, fixed per dtype and shape regime (chosen from measurements at one thread, BENCHMARKS.md), never
timed at run time:

- Every row one document: torch's CPU flash kernel with ``is_causal``: it skips the blocks above the
  diagonal and never holds the ``[S, S]`` scores. A block-causal kernel of batched GEMMs written in
  Python (``benchmarks/attention_kernels.py``) was slower, or within a few percent (grouped KV heads in
  fp32), at every measured shape, and keeps fp32 copies for backward.
- Packed rows (several documents per row): the same flash kernel run per document (``packed_attention``).
  Documents are grouped by length into buckets (lengths rounded up to 2^k or 3*2^(k-1), at most the
  row), each bucket gathered into a ``[docs, L]`` batch and run causally, the results scattered back.
  Padding sits after each document's last token, so causality alone keeps real tokens from seeing it;
  nothing attends across a document boundary because no two documents share a batch row. Memory is
  the gathered copies of q/k/v (about the tokens' own size), not the ``[B, 1, S, S]`` mask SDPA would
  need (converted to a float mask per layer and kept for backward); the compute is each document's own
  triangle, where the masked SDPA call (measured slower than the causal one at equal shapes) does not skip
  what lies above the diagonal or between documents.
- bf16/fp16 (``compute_dtype``): in fp32 on fp32 copies of q/k/v, the output and gradients rounded to the
  input dtype, when the CPU has no native instructions for the dtype (avx512_bf16/AMX for bf16,
  avx512_fp16/AMX for fp16; torch's kernels are reference loops there), and for short sequences (per
  document when packed: length x head_dim at most ``UPCAST_MAX_LEN_X_HEAD_DIM``), where the
  low-precision kernel's backward is the slower one; longer sequences run in the input dtype, where it is
  the faster. Both are exact attention with an fp32 softmax; fp32 is the more accurate, and it is kept
  where the two were within measurement noise. ``TESSERA_CPU_LOWP_MATMUL`` (``native`` / ``upcast``)
  forces one, as for the matmuls (``tessera.parallel.cpu_kernels``). The bound was measured on a CPU with
  avx512_bf16 and without AMX.

Attention dropout is not handled here (``tessera.model.attention`` keeps SDPA for it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tessera.parallel import cpu_kernels

__all__ = ["DocumentBucket", "document_buckets", "packed_attention", "causal_attention", "compute_dtype",
           "precision_rule", "UPCAST_MAX_LEN_X_HEAD_DIM"]

UPCAST_MAX_LEN_X_HEAD_DIM = 16384
_NATIVE = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _forced_or_missing(dtype: torch.dtype) -> tuple[torch.dtype | None, str]:
    """The dtype every sequence computes in (None: the sequence's length decides), and why. Follows the
    process-wide CPU kernel choice of ``cpu_kernels`` (made once, so compiled code reads it as a constant)."""
    if dtype not in _NATIVE:
        return dtype, f"{_name(dtype)}, as given"
    upcast, source = cpu_kernels.upcast_on_cpu(dtype), cpu_kernels.choice_source(dtype)
    if source in ("native", "upcast"):
        forced = torch.float32 if upcast else dtype
        return forced, f"{_name(forced)} (TESSERA_CPU_LOWP_MATMUL={source})"
    if upcast:
        return torch.float32, (f"float32 (this CPU has none of {'/'.join(_NATIVE[dtype])}: torch's {_name(dtype)} "
                               "kernels are slow there)")
    return None, ""


def compute_dtype(dtype: torch.dtype, length: int, head_dim: int) -> torch.dtype:
    """The dtype CPU attention computes in for ``dtype`` q/k/v over sequences of ``length`` tokens."""
    forced, _ = _forced_or_missing(dtype)
    if forced is not None:
        return forced
    return torch.float32 if length * head_dim <= UPCAST_MAX_LEN_X_HEAD_DIM else dtype


def precision_rule(dtype: torch.dtype, length: int | None, head_dim: int) -> str:
    """What ``compute_dtype`` does for ``dtype`` and why, for the log line (``length`` None: packed rows,
    whose documents' lengths vary)."""
    forced, why = _forced_or_missing(dtype)
    if forced is not None:
        return f"computed in {why}"
    short = (f"sequences of length x head_dim <= {UPCAST_MAX_LEN_X_HEAD_DIM} in float32, faster than "
             f"{_name(dtype)} there or as fast; longer ones in {_name(dtype)}, faster there")
    if length is None:
        return f"computed per document: {short}"
    return f"computed in {_name(compute_dtype(dtype, length, head_dim))} ({short})"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _bucket_length(length: int, seqlen: int) -> int:
    """``length`` rounded up to 2^k or 3 * 2^(k-1) (padding under half a document), at most ``seqlen``."""
    up = 1 << max(0, math.ceil(math.log2(length)))
    if up >= 4 and 3 * up // 4 >= length:
        up = 3 * up // 4
    return min(up, seqlen)


@dataclass(frozen=True)
class DocumentBucket:
    """``docs`` documents padded to ``length`` tokens: where each padded token is read from and written to.

    ``gather``: flat token index per padded position (a padding position repeats its document's last
    token); ``scatter``: the same for real positions, ``B * S`` (a discarded row) for padding; ``padding``:
    ``[docs, length, 1, 1]`` True at padding positions, None when there is none.
    """

    docs: int
    length: int
    gather: torch.Tensor
    scatter: torch.Tensor
    padding: torch.Tensor | None


def document_buckets(cu_seqlens: torch.Tensor, batch: int, seqlen: int) -> list[DocumentBucket]:
    """The documents of ``cu_seqlens`` (flattened over ``batch`` rows of ``seqlen``) grouped by padded length.

    Read on the host: called once per forward (``AttentionPlan.document_buckets``), shared by the layers.
    """
    bounds = cu_seqlens.detach().to("cpu", torch.int64)
    starts, lengths = bounds[:-1], bounds[1:] - bounds[:-1]
    padded = torch.tensor([_bucket_length(n, seqlen) for n in lengths.tolist()], dtype=torch.int64)
    buckets = []
    for length in sorted(set(padded.tolist())):
        chosen = padded == length
        first, count = starts[chosen].unsqueeze(1), lengths[chosen].unsqueeze(1)
        offset = torch.arange(length, dtype=torch.int64).unsqueeze(0)
        pad = offset >= count
        gather = first + torch.minimum(offset, count - 1)
        scatter = torch.where(pad, batch * seqlen, first + offset)
        buckets.append(DocumentBucket(int(chosen.sum()), length, gather.reshape(-1), scatter.reshape(-1),
                                      pad.view(-1, length, 1, 1) if bool(pad.any()) else None))
    return buckets


def _gather(x: torch.Tensor, bucket: DocumentBucket, dtype: torch.dtype) -> torch.Tensor:
    """Tokens ``[T, H, d]`` -> the bucket's ``[docs, H, length, d]`` (a transposed view of contiguous rows)."""
    g = x.index_select(0, bucket.gather).to(dtype)
    return g.view(bucket.docs, bucket.length, x.shape[1], x.shape[2]).transpose(1, 2)


def _scatter(dst: torch.Tensor, src: torch.Tensor, bucket: DocumentBucket) -> None:
    """Write the bucket's ``[docs, H, length, d]`` into tokens ``dst`` ``[T + 1, H, d]`` (padding to row T)."""
    rows = src.transpose(1, 2).reshape(-1, src.shape[1], src.shape[3])
    dst.index_copy_(0, bucket.scatter, rows.to(dst.dtype))


class _PackedFlash(torch.autograd.Function):
    """The CPU flash kernel over each bucket of documents; q/k/v/out ``[T, H, d]`` flat tokens."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                buckets: list[DocumentBucket], computes: list[torch.dtype]) -> torch.Tensor:
        out = q.new_empty(q.shape[0] + 1, q.shape[1], q.shape[2])
        lses = []
        for bucket, compute in zip(buckets, computes, strict=True):
            o, lse = _flash(_gather(q, bucket, compute), _gather(k, bucket, compute), _gather(v, bucket, compute),
                            0.0, True)
            _scatter(out, o, bucket)
            lses.append(lse)
        out = out[:-1]
        ctx.save_for_backward(q, k, v, out, *lses)
        ctx.buckets, ctx.computes = buckets, computes
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v, out, *lses = ctx.saved_tensors
        grad = grad.contiguous()
        dq = q.new_empty(q.shape[0] + 1, *q.shape[1:])
        dk = k.new_empty(k.shape[0] + 1, *k.shape[1:])
        dv = v.new_empty(v.shape[0] + 1, *v.shape[1:])
        for bucket, compute, lse in zip(ctx.buckets, ctx.computes, lses, strict=True):
            g = grad.index_select(0, bucket.gather).to(compute)
            if bucket.padding is not None:  # padding queries get no gradient (their outputs are dropped)
                g = g.view(bucket.docs, bucket.length, *grad.shape[1:]).masked_fill_(bucket.padding, 0)
            g = g.view(bucket.docs, bucket.length, *grad.shape[1:]).transpose(1, 2)
            grads = _flash_backward(g, _gather(q, bucket, compute), _gather(k, bucket, compute),
                                    _gather(v, bucket, compute), _gather(out, bucket, compute), lse, 0.0, True)
            for dst, src in zip((dq, dk, dv), grads, strict=True):
                _scatter(dst, src, bucket)
        return dq[:-1], dk[:-1], dv[:-1], None, None


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, buckets: list[DocumentBucket],
                     compute: torch.dtype | None = None) -> torch.Tensor:
    """Causal attention within documents: q ``[B, S, Hq, d]``, k/v ``[B, S, Hkv, d]`` -> ``[B, S, Hq, d]``,
    each bucket computed in ``compute_dtype`` of its length (``compute``: in that dtype for all)."""
    if torch.compiler.is_compiling():
        return outside_graphs()(q, k, v, buckets, compute)
    return _packed(q, k, v, buckets, compute)


def _packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, buckets: list[DocumentBucket],
            compute: torch.dtype | None) -> torch.Tensor:
    b, s, hq, d = q.shape
    computes = [compute or compute_dtype(q.dtype, bucket.length, d) for bucket in buckets]
    flat = [t.reshape(b * s, t.shape[2], d) for t in (q, k, v)]
    return _PackedFlash.apply(*flat, buckets, computes).view(b, s, hq, d)


_OUTSIDE_GRAPHS: list[Callable[..., torch.Tensor]] = []


def outside_graphs() -> Callable[..., torch.Tensor]:
    """The packed kernel as compiled code calls it: the buckets are host-side data of each batch, so one graph
    break under torch.compile, not a recompile per batch. Made on first use, not at import: wrapping it
    imports Dynamo (a second per process that never compiles); ``compile_blocks`` makes it before tracing."""
    if not _OUTSIDE_GRAPHS:
        _OUTSIDE_GRAPHS.append(torch.compiler.disable(_packed))
    return _OUTSIDE_GRAPHS[0]


class _CausalFlash(torch.autograd.Function):
    """The CPU flash kernel with ``is_causal`` on ``[B, H, S, d]`` views, in ``compute`` precision; keeps q/k/v
    and the output for backward in their own dtype (not the fp32 copies)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                compute: torch.dtype) -> torch.Tensor:
        out, lse = _flash(q.to(compute), k.to(compute), v.to(compute), 0.0, True)
        if out.dtype != q.dtype:  # no no-op ``.to``: see ``fused_ops._returned``
            out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.compute = compute
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        c = ctx.compute
        dq, dk, dv = _flash_backward(grad.to(c), q.to(c), k.to(c), v.to(c), out.to(c), lse, 0.0, True)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     compute: torch.dtype | None = None) -> torch.Tensor:
    """Causal attention, one document per row: layouts as ``packed_attention``; computed in ``compute_dtype``
    of the sequence length (``compute``: in that dtype)."""
    compute = compute or compute_dtype(q.dtype, q.shape[1], q.shape[-1])
    out = _CausalFlash.apply(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), compute)
    return out.transpose(1, 2)
