"""CPU attention kernels side by side: the measurements behind ``tessera.model.cpu_attention``'s rule.

    python -m benchmarks attention-kernels                      # every shape, bf16 and fp32, 1 thread
    python -m benchmarks attention-kernels --only demo --rounds 20
    python -m benchmarks attention-kernels --only s256 --packed --dtype bf16 --out ''

For each shape (batch, query / KV heads, sequence, head dim) and dtype, every candidate runs forward and
backward on the same q/k/v in interleaved rounds (``benchmarks.harness``); the table gives the fastest
round of each (the least disturbed), the bytes autograd keeps for backward
(distinct storages, q/k/v included), and, where the sequence allows an fp64 reference, the relative
error (Frobenius) of the output and of dq against ``softmax(QK^T/sqrt(d) + mask) V`` in fp64.

Candidates, one document per row: ``sdpa`` (torch's CPU flash kernel in the input dtype), ``sdpa fp32``
(on fp32 copies; autograd of the casts), ``tessera`` (``cpu_attention.causal_attention`` under its rule,
and forced to fp32 and to the input dtype: bf16 q/k/v and output kept for backward, cast in backward),
``blocked fp32`` (a block-causal kernel written below: batched GEMMs per query block over the keys up to
the diagonal, fp32 softmax, its own backward). Packed rows (documents of exponential lengths, mean S/4
or ``--mean-doc``): ``sdpa mask`` (the ``[B, 1, S, S]`` block-diagonal mask, in the input dtype and on
fp32 copies), ``tessera`` (``cpu_attention.packed_attention``: the flash kernel per document, in length
buckets, under its rule and forced to each precision), ``blocked fp32`` (the same blocked kernel with a
document mask, skipping the keys before each query block's earliest document).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks import harness
from tessera.cli_args import positive_float, positive_int
from tessera.model import cpu_attention
from tessera.model.rotary import document_ids

TITLE = "## 16. CPU attention kernels"

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Shape:
    name: str
    batch: int
    heads: int
    kv_heads: int
    seqlen: int
    head_dim: int


SHAPES = [
    Shape("s256", 8, 8, 8, 256, 64),
    Shape("s1024", 2, 8, 8, 1024, 64),  # batch cut to keep a round short at 1 thread
    Shape("s4096", 1, 8, 8, 4096, 64),
    Shape("demo", 16, 2, 2, 128, 32),  # configs/demo.py per TP rank at TP=2: 2 of its 4 heads of 32
    Shape("gqa", 8, 8, 2, 256, 64),
]
REFERENCE_MAX_SEQ = 1024  # the fp64 reference holds [B, H, S, S]


# ---------------------------------------------------------------------------- a block-causal kernel (candidate)
class _Blocked(torch.autograd.Function):
    """Query blocks ``[i0, i1)`` against keys ``[lo, i1)``, fp32; q/k/v ``[B*Hkv, S*g, d]`` head-major copies."""

    @staticmethod
    def forward(ctx, q, k, v, blocks, docs, shape):
        b, hkv, g, scale = shape
        out = torch.empty_like(q)
        for i0, i1, lo in blocks:
            p = _blocked_probs(q, k, i0, i1, lo, scale, docs, shape)
            out[:, i0 * g:i1 * g] = torch.bmm(p, v[:, lo:i1])
        ctx.save_for_backward(q, k, v, out)
        ctx.blocks, ctx.docs, ctx.shape = blocks, docs, shape
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out = ctx.saved_tensors
        b, hkv, g, scale = ctx.shape
        delta = (grad * out).sum(-1, keepdim=True)
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for i0, i1, lo in ctx.blocks:
            p = _blocked_probs(q, k, i0, i1, lo, scale, ctx.docs, ctx.shape)
            do = grad[:, i0 * g:i1 * g]
            dv[:, lo:i1] += torch.bmm(p.transpose(1, 2), do)
            ds = torch.bmm(do, v[:, lo:i1].transpose(1, 2)).sub_(delta[:, i0 * g:i1 * g]).mul_(p)
            dq[:, i0 * g:i1 * g] = torch.bmm(ds, k[:, lo:i1]).mul_(scale)
            dk[:, lo:i1] += torch.bmm(ds.transpose(1, 2), q[:, i0 * g:i1 * g]).mul_(scale)
        return dq, dk, dv, None, None, None


def _blocked_probs(q, k, i0, i1, lo, scale, docs, shape):
    b, hkv, g, _ = shape
    bq, e = i1 - i0, i1 - lo
    s = torch.bmm(q[:, i0 * g:i1 * g], k[:, lo:i1].transpose(1, 2)).mul_(scale)
    hidden = torch.arange(lo, i1).unsqueeze(0) > torch.arange(i0, i1).unsqueeze(1)
    if docs is not None:
        hidden = hidden | (docs[:, i0:i1].unsqueeze(2) != docs[:, lo:i1].unsqueeze(1))
        s.view(b, hkv, bq, g, e).masked_fill_(hidden.view(b, 1, bq, 1, e), float("-inf"))
    else:
        s.view(-1, bq, g, e).masked_fill_(hidden.view(1, bq, 1, e), float("-inf"))
    return torch.softmax(s, dim=-1)


def blocked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | None,
                      rows: int = 64) -> torch.Tensor:
    """The block-causal candidate on ``[B, S, H, d]`` tensors, computed in fp32."""
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv

    def heads(x: torch.Tensor, groups: int) -> torch.Tensor:
        return (x.float().view(b, s, x.shape[2] // groups, groups, d).permute(0, 2, 1, 3, 4)
                .reshape(b * (x.shape[2] // groups), s * groups, d))

    docs = None
    firsts = list(range(0, s, rows))
    starts = [0] * len(firsts)
    if cu_seqlens is not None:
        docs = document_ids(cu_seqlens, b, s)
        cu = cu_seqlens.long()
        row0 = torch.arange(b).unsqueeze(1) * s
        flat = row0 + torch.tensor(firsts).unsqueeze(0)
        starts = (cu[torch.searchsorted(cu, flat, right=True) - 1] - row0).min(dim=0).values.tolist()
    blocks = [(i0, min(i0 + rows, s), lo) for i0, lo in zip(firsts, starts, strict=True)]
    out = _Blocked.apply(heads(q, g), heads(k, 1), heads(v, 1), blocks, docs, (b, hkv, g, 1 / math.sqrt(d)))
    return out.view(b, hkv, s, g, d).permute(0, 2, 1, 3, 4).reshape(b, s, hq, d).to(q.dtype)


# ---------------------------------------------------------------------------- candidates and the reference
def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, fp32: bool) -> torch.Tensor:
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    if fp32:
        qt, kt, vt = qt.float(), kt.float(), vt.float()
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=mask is None,
                                         enable_gqa=qt.shape[1] != kt.shape[1])
    return out.transpose(1, 2).to(q.dtype)


def candidates(shape: Shape, dtype: torch.dtype, cu: torch.Tensor | None) -> dict[str, Kernel]:
    b, s, d = shape.batch, shape.seqlen, shape.head_dim
    low = dtype != torch.float32
    forced = [torch.float32, dtype] if low else []  # tessera's kernels forced to each precision, beside the rule
    if cu is None:
        rule = str(cpu_attention.compute_dtype(dtype, s, d)).removeprefix("torch.")
        kernels: dict[str, Kernel] = {"sdpa": lambda q, k, v: _sdpa(q, k, v, None, False)}
        if low:
            kernels["sdpa fp32"] = lambda q, k, v: _sdpa(q, k, v, None, True)
        kernels[f"tessera (rule: {rule})"] = lambda q, k, v: cpu_attention.causal_attention(q, k, v)
        for c in forced:
            kernels[f"tessera {str(c)[6:]}"] = lambda q, k, v, c=c: cpu_attention.causal_attention(q, k, v, c)
        kernels["blocked fp32"] = lambda q, k, v: blocked_attention(q, k, v, None)
        return kernels
    docs = document_ids(cu, b, s)
    mask = ((docs.unsqueeze(2) == docs.unsqueeze(1)) & torch.ones(s, s, dtype=torch.bool).tril()).unsqueeze(1)
    buckets = cpu_attention.document_buckets(cu, b, s)
    kernels = {"sdpa mask": lambda q, k, v: _sdpa(q, k, v, mask, False)}
    if low:
        kernels["sdpa mask fp32"] = lambda q, k, v: _sdpa(q, k, v, mask, True)
    kernels["tessera (rule)"] = lambda q, k, v: cpu_attention.packed_attention(q, k, v, buckets)
    for c in forced:
        kernels[f"tessera {str(c)[6:]}"] = lambda q, k, v, c=c: cpu_attention.packed_attention(q, k, v, buckets, c)
    kernels["blocked fp32"] = lambda q, k, v: blocked_attention(q, k, v, cu)
    return kernels


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor | None) -> torch.Tensor:
    """fp64 ``softmax(QK^T / sqrt(d) + causal/document mask) V`` with K/V repeated per query-head group."""
    b, s, hq, d = q.shape
    g = hq // k.shape[2]
    qt, kt, vt = (t.double().transpose(1, 2) for t in (q, k, v))
    kt, vt = kt.repeat_interleave(g, 1), vt.repeat_interleave(g, 1)
    allowed = torch.ones(s, s, dtype=torch.bool).tril()
    if cu is not None:
        docs = document_ids(cu, b, s)
        allowed = allowed & (docs.unsqueeze(2) == docs.unsqueeze(1)).unsqueeze(1)
    scores = (qt @ kt.transpose(-1, -2) / math.sqrt(d)).masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ vt).transpose(1, 2)


def packed_cu_seqlens(batch: int, seqlen: int, mean: float, seed: int = 0) -> torch.Tensor:
    """Documents of exponential lengths (at least 1) filling each row, cut at the row's end."""
    gen = torch.Generator().manual_seed(seed)
    cu = [0]
    for row in range(batch):
        pos = 0
        while pos < seqlen:
            pos = min(seqlen, pos + max(1, int(torch.empty(1).exponential_(1 / mean, generator=gen))))
            cu.append(row * seqlen + pos)
    return torch.tensor(cu, dtype=torch.int32)


def _saved_bytes(fn: Kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, int]:
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(q, k, v)
    return out, sum(storages.values())


def measure(shape: Shape, dtype: torch.dtype, packed: bool, rounds: int, mean_doc: float | None = None
            ) -> dict[str, Any]:
    """Every candidate's fastest forward and backward, kept bytes and errors against the fp64 reference."""
    torch.manual_seed(0)
    b, s, d = shape.batch, shape.seqlen, shape.head_dim
    q = torch.randn(b, s, shape.heads, d).to(dtype)
    k, v = (torch.randn(b, s, shape.kv_heads, d).to(dtype) for _ in range(2))
    go = torch.randn(b, s, shape.heads, d).to(dtype)
    mean = mean_doc if mean_doc is not None else s / 4
    cu = packed_cu_seqlens(b, s, mean) if packed else None
    ref = ref_dq = None
    if s <= REFERENCE_MAX_SEQ:
        q64 = q.double().requires_grad_()
        ref = reference(q64, k, v, cu)
        (ref_dq,) = torch.autograd.grad(ref, q64, go.double())
        ref = ref.detach()

    def step(fn: Kernel) -> dict[str, Any]:
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        t0 = time.perf_counter()
        out, nbytes = _saved_bytes(fn, qq, kk, vv)
        t1 = time.perf_counter()
        out.backward(go)
        row: dict[str, Any] = {"fwd": t1 - t0, "bwd": time.perf_counter() - t1, "saved": nbytes}
        if ref is not None and ref_dq is not None and qq.grad is not None:
            row["err"] = [float((out.detach().double() - ref).norm() / ref.norm()),
                          float((qq.grad.double() - ref_dq).norm() / ref_dq.norm())]
        return row

    kernels = candidates(shape, dtype, cu)
    timed = harness.interleave([harness.Variant(n, lambda fn=fn: step(fn)) for n, fn in kernels.items()], rounds,
                               quiet=True)
    layout = f"packed, {cu.numel() - 1} documents (mean length {mean:g})" if cu is not None else "one document per row"
    return {"title": f"{shape.name}: B={b} H={shape.heads}/{shape.kv_heads} S={s} d={d} {str(dtype)[6:]}, {layout}",
            "kernels": {n: {"fwd": min(r["fwd"] for r in t.values), "bwd": min(r["bwd"] for r in t.values),
                            "saved": t.warmup[0]["saved"], "err": t.warmup[0].get("err")} for n, t in timed.items()}}


def markdown(res: dict[str, Any]) -> list[str]:
    lines = [f"Reproduce: {harness.provenance(res)}. {res['threads']} thread(s); per kernel the fastest of "
             f"{res['rounds']} interleaved rounds (forward, backward), the bytes autograd keeps for backward, and the "
             "relative error against an fp64 reference where the sequence allows one."]
    for table in res["tables"]:
        lines += ["", table["title"], "",
                  "| kernel | forward ms | backward ms | total ms | kept for backward MiB | rel. error out | "
                  "rel. error dq |", "|---|---:|---:|---:|---:|---:|---:|"]
        for name, r in table["kernels"].items():
            errs = f"{r['err'][0]:.1e} | {r['err'][1]:.1e}" if r["err"] else "- | -"
            ms = [r["fwd"] * 1e3, r["bwd"] * 1e3, (r["fwd"] + r["bwd"]) * 1e3]
            lines.append(f"| {name} | " + " | ".join(f"{x:.1f}" for x in ms) + f" | {r['saved'] / 2**20:.1f} | "
                         f"{errs} |")
    return lines


def main(argv: Sequence[str] | None = None, prog: str = "python -m benchmarks attention-kernels") -> int:
    ap = harness.parser(prog, __doc__)
    ap.add_argument("--only", nargs="*", choices=[s.name for s in SHAPES], default=None, help="shapes to measure")
    ap.add_argument("--dtype", nargs="*", choices=["bf16", "fp32"], default=["bf16", "fp32"])
    layout = ap.add_mutually_exclusive_group()
    layout.add_argument("--packed", action="store_true", help="packed rows only")
    layout.add_argument("--causal", action="store_true", help="one document per row only")
    ap.add_argument("--mean-doc", type=positive_float, default=None,
                    help="mean document length of packed rows (default S/4)")
    ap.add_argument("--rounds", type=positive_int, default=3, help="timed rounds (after one warm-up)")
    ap.add_argument("--threads", type=positive_int, default=1)
    args = ap.parse_args(argv)

    def run() -> dict[str, Any]:
        torch.set_num_threads(args.threads)
        dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
        tables = [measure(shape, dtypes[dt], packed, args.rounds, args.mean_doc)
                  for shape in SHAPES if args.only is None or shape.name in args.only for dt in args.dtype
                  for packed in (False, True) if not (packed and args.causal) and not (not packed and args.packed)]
        return {"threads": args.threads, "rounds": args.rounds, "tables": tables}

    return harness.publish(args, argv, prog, "attention-kernels", TITLE, run, markdown)


if __name__ == "__main__":
    sys.exit(main())
