"""CPU attention kernels (tessera.model.cpu_attention) against a plain softmax attention written here.

The reference is ``softmax(Q K^T / sqrt(d) + causal/document mask) V`` in fp64 with K/V repeated per
query-head group; outputs and q/k/v gradients are compared for one-document rows, packed rows (documents
of length 1, a document spanning a whole row, many short ones), grouped KV heads and bf16 inputs. Also:
documents never see each other (perturbing one leaves the others bitwise unchanged), the packed kernel
keeps nothing of size S^2 for backward, the precision rule per dtype and length (per bucket when packed),
the log lines, and dynamo tracing.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tessera import logs
from tessera.model import cpu_attention
from tessera.model.attention import attend, plan_attention
from tests.tolerances import allclose_tols, precision_rtol

F32, BF16 = torch.float32, torch.bfloat16


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """fp64 causal attention within documents on ``[B, S, H, d]`` tensors (differentiable)."""
    b, s, hq, d = q.shape
    groups = hq // k.shape[2]
    qt, kt, vt = (t.double().transpose(1, 2) for t in (q, k, v))
    kt, vt = kt.repeat_interleave(groups, dim=1), vt.repeat_interleave(groups, dim=1)
    allowed = torch.ones(s, s, dtype=torch.bool).tril()
    if cu_seqlens is not None:
        doc = torch.zeros(b * s, dtype=torch.long)
        doc[cu_seqlens[1:-1].long()] = 1
        doc = doc.cumsum(0).view(b, s)  # document index of each token
        allowed = allowed & (doc.unsqueeze(2) == doc.unsqueeze(1)).unsqueeze(1)
    scores = (qt @ kt.transpose(-1, -2) / math.sqrt(d)).masked_fill(~allowed, float("-inf"))
    return (scores.softmax(dim=-1) @ vt).transpose(1, 2)


def _qkv(b: int, s: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(b, s, h, d, generator=g) * scale).to(dtype).requires_grad_()
                 for h, scale in ((hq, 2.0), (hkv, 1.0), (hkv, 1.0)))


# rows of 24 tokens: row 0 holds documents of 1, 1, 5, 17 tokens; row 1 one document spanning the row; row 2 many
PACKED = torch.tensor([0, 1, 2, 7, 24, 48, 50, 51, 60, 61, 72], dtype=torch.int32)
LAYOUTS = {"one document per row": None, "packed": PACKED}


# Against the fp64 reference, one computation's rounding (tests/tolerances.py, precision_rtol). fp32: sums
# over head_dim (16) and over the keys (<= 24 here), five chained steps forward (scores, max/exp, sum,
# normalize, probs @ v) and ten with backward; measured 2.7e-7 (elementwise, of the largest output), 3.1e-7
# (gradients). bf16: whatever runs inside, bf16 values are rounded at most at the scores, the
# probabilities and the output forward (n = 1: fp32 accumulation), twice that backward; measured 3.0e-3 and
# 5.0e-3. Elementwise checks take atol = rtol x the largest reference element (allclose_tols).
FP32_OUT_RTOL = precision_rtol(torch.float32, 24, 5)  # 6.5e-7
FP32_GRAD_RTOL = precision_rtol(torch.float32, 24, 10)  # 9.3e-7
BF16_OUT_RTOL = precision_rtol(torch.bfloat16, 1, 3)  # 6.8e-3
BF16_GRAD_RTOL = precision_rtol(torch.bfloat16, 1, 6)  # 9.6e-3


def _check(q, k, v, cu, out, rtol: float, grad_tol: float) -> None:
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    ref = reference(q, k, v, cu)
    torch.testing.assert_close(out.double(), ref, **allclose_tols(rtol, float(ref.abs().max())))
    grads = torch.autograd.grad(out, (q, k, v), go.to(out.dtype))
    ref_grads = torch.autograd.grad(ref, (q, k, v), go)
    for name, g, r in zip("qkv", grads, ref_grads, strict=True):
        assert g.dtype == q.dtype and g.shape == r.shape, name
        err = float((g.double() - r.double()).norm() / r.double().norm())
        assert err < grad_tol, (name, err)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (4, 1)])
def test_fp32_matches_the_reference(layout, hq, hkv):
    cu = LAYOUTS[layout]
    q, k, v = _qkv(3, 24, hq, hkv, 16, torch.float32)
    out = attend(q, k, v, plan_attention(cu, 3, 24, use_flash_attn=True), 0.0)
    assert out.shape == q.shape and out.dtype == torch.float32
    _check(q, k, v, cu, out, FP32_OUT_RTOL, FP32_GRAD_RTOL)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bf16_matches_the_reference_within_bf16_rounding(layout, monkeypatch):
    """bf16 in and out; whatever precision the rule picks inside, the result is the attention of the bf16
    inputs rounded once (out: half a bf16 ulp of relative error per element, here 1.5e-3 in norm)."""
    cu = LAYOUTS[layout]
    q, k, v = _qkv(3, 24, 4, 2, 16, torch.bfloat16)
    for choice in ("upcast", "native"):
        monkeypatch.setenv("TESSERA_CPU_LOWP_MATMUL", choice)
        cpu_attention.cpu_kernels.forget_cpu_kernels()  # the choice is made once per process
        out = attend(q, k, v, plan_attention(cu, 3, 24, use_flash_attn=True), 0.0)
        assert out.dtype == torch.bfloat16
        _check(q, k, v, cu, out, BF16_OUT_RTOL, BF16_GRAD_RTOL)


def test_packed_documents_never_see_each_other():
    """Changing every q/k/v of one document leaves the other documents' outputs bitwise unchanged, and a loss
    on one document has exactly zero gradient on the others' q/k/v."""
    q, k, v = _qkv(3, 24, 4, 2, 16, torch.float32)
    plan = plan_attention(PACKED, 3, 24, use_flash_attn=False)
    out = attend(q, k, v, plan, 0.0).detach()
    doc = slice(2, 7)  # row 0's third document
    q2, k2, v2 = (t.detach().clone() for t in (q, k, v))
    for t in (q2, k2, v2):
        t[0, doc] = torch.randn(t[0, doc].shape)
    out2 = attend(q2, k2, v2, plan, 0.0)
    others = torch.ones(3, 24, dtype=torch.bool)
    others[0, doc] = False
    assert torch.equal(out2[others], out[others]) and not torch.equal(out2[0, doc], out[0, doc])
    loss = attend(q, k, v, plan, 0.0)[0, doc].sum()
    for g in torch.autograd.grad(loss, (q, k, v)):
        assert torch.count_nonzero(g[others]) == 0 and torch.count_nonzero(g[0, doc]) > 0


def test_document_buckets_cover_every_token_once():
    buckets = cpu_attention.document_buckets(PACKED, 3, 24)
    lengths = (PACKED[1:] - PACKED[:-1]).tolist()
    assert sum(b.docs for b in buckets) == len(lengths)
    real = torch.cat([b.scatter[b.scatter < 72] for b in buckets])
    assert torch.equal(real.sort().values, torch.arange(72))  # each token written exactly once
    for b in buckets:
        pad = torch.zeros(b.docs, b.length, dtype=torch.bool) if b.padding is None else b.padding.view(b.docs, -1)
        counts = (~pad).sum(1)  # each document's real length, at most its bucket's, under 1.5x padded
        assert bool((counts <= b.length).all()) and bool((b.length < 1.5 * counts).all() or b.length <= 2)
        # padding reads a real token of its own document (its last one) and is written to the discarded row 72
        assert bool((b.scatter.view(b.docs, -1)[pad] == 72).all())
        assert bool((b.gather.view(b.docs, -1)[pad] < 72).all())


def _saved_numels(fn) -> list[int]:
    sizes: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sizes


def test_packed_rows_keep_no_mask_for_backward():
    """SDPA with the block-diagonal mask keeps a [B, 1, S, S] mask per call for backward; the per-document
    kernel keeps only tensors of the tokens' size (q/k/v/out) and the log-sum-exps."""
    b, s = 2, 64
    cu = torch.tensor([0, 10, 40, 64, 100, 128], dtype=torch.int32)
    q, k, v = _qkv(b, s, 2, 2, 8, torch.float32)
    tokens = b * s * 2 * 8
    kernel = _saved_numels(lambda: attend(q, k, v, plan_attention(cu, b, s, use_flash_attn=False), 0.0))
    sdpa = _saved_numels(lambda: attend(q, k, v, plan_attention(cu, b, s, use_flash_attn=False), 0.1))  # SDPA + mask
    assert max(kernel) <= tokens and max(sdpa) >= b * s * s


def test_precision_rule_per_dtype_and_length(monkeypatch):
    rule = cpu_attention.compute_dtype
    monkeypatch.delenv("TESSERA_CPU_LOWP_MATMUL", raising=False)
    cpu_attention.cpu_kernels.forget_cpu_kernels()  # the choice is made once per process
    monkeypatch.setattr(cpu_attention.cpu_kernels, "_cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    cpu_attention.cpu_kernels.forget_cpu_kernels()  # the choice is made once per process
    # bf16 with native instructions: short sequences in fp32 (length x head_dim <= 16384)
    assert rule(torch.bfloat16, 128, 128) == rule(torch.bfloat16, 256, 64) == rule(torch.bfloat16, 1, 256) == F32
    assert rule(torch.bfloat16, 257, 64) == rule(torch.bfloat16, 129, 128) == rule(torch.bfloat16, 4096, 64) == BF16
    assert rule(torch.float16, 4096, 64) == F32  # no avx512_fp16/amx_fp16: fp16 always in fp32
    assert rule(torch.float32, 4096, 64) == F32
    monkeypatch.setattr(cpu_attention.cpu_kernels, "_cpu_flags", lambda: frozenset({"avx2"}))
    cpu_attention.cpu_kernels.forget_cpu_kernels()  # the choice is made once per process
    assert rule(torch.bfloat16, 4096, 64) == F32
    monkeypatch.setattr(cpu_attention.cpu_kernels, "_cpu_flags", lambda: frozenset({"amx_bf16", "amx_fp16"}))
    cpu_attention.cpu_kernels.forget_cpu_kernels()  # the choice is made once per process
    assert rule(torch.bfloat16, 4096, 64) == BF16 and rule(torch.float16, 4096, 64) == torch.float16
    assert rule(torch.bfloat16, 64, 64) == F32
    monkeypatch.setenv("TESSERA_CPU_LOWP_MATMUL", "upcast")
    cpu_attention.cpu_kernels.forget_cpu_kernels()  # the choice is made once per process
    assert rule(torch.bfloat16, 4096, 64) == F32
    monkeypatch.setenv("TESSERA_CPU_LOWP_MATMUL", "native")
    cpu_attention.cpu_kernels.forget_cpu_kernels()  # the choice is made once per process
    assert rule(torch.bfloat16, 64, 64) == BF16


class _FlashCalls(TorchDispatchMode):
    """(dtype, sequence length) of every CPU flash forward call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
            self.calls.append((args[0].dtype, args[0].shape[2]))
        return func(*args, **(kwargs or {}))


def test_bf16_short_documents_in_fp32_long_ones_in_bf16(monkeypatch, caplog):
    """One packed batch, documents of 3, 20, 297 and 320 tokens (head_dim 64): the short ones' buckets run in fp32,
    the long one in bf16; the result matches the reference either way; one log line states the rule."""
    monkeypatch.delenv("TESSERA_CPU_LOWP_MATMUL", raising=False)
    cpu_attention.cpu_kernels.forget_cpu_kernels()  # the choice is made once per process
    monkeypatch.setattr(cpu_attention.cpu_kernels, "_cpu_flags", lambda: frozenset({"avx512_bf16"}))
    cpu_attention.cpu_kernels.forget_cpu_kernels()  # the choice is made once per process
    monkeypatch.setattr(logs, "_LOGGED", set())
    cu = torch.tensor([0, 3, 23, 320, 640], dtype=torch.int32)  # row 1: one document spanning the row
    q, k, v = _qkv(2, 320, 2, 1, 64, torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="tessera"), _FlashCalls() as seen:
        for _ in range(2):
            out = attend(q, k, v, plan_attention(cu, 2, 320, use_flash_attn=False), 0.0)
    assert set(seen.calls) == {(F32, 3), (F32, 24), (BF16, 320)}  # buckets of 3, 20 (to 24), 297 and 320 (to 320)
    _check(q, k, v, cu, out, BF16_OUT_RTOL, BF16_GRAD_RTOL)
    lines = [r.getMessage() for r in caplog.records if "attention backend" in r.getMessage()]
    assert len(lines) == 1 and "per document" in lines[0] and "length x head_dim <= 16384 in float32" in lines[0]


def test_one_log_line_per_choice(monkeypatch, caplog):
    monkeypatch.delenv("TESSERA_CPU_LOWP_MATMUL", raising=False)
    cpu_attention.cpu_kernels.forget_cpu_kernels()  # the choice is made once per process
    monkeypatch.setattr(cpu_attention.cpu_kernels, "_cpu_flags", lambda: frozenset({"avx2"}))
    cpu_attention.cpu_kernels.forget_cpu_kernels()  # the choice is made once per process
    monkeypatch.setattr(logs, "_LOGGED", set())
    q, k, v = _qkv(3, 24, 4, 2, 16, torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="tessera"):
        for _ in range(2):
            for cu in (None, PACKED):
                attend(q, k, v, plan_attention(cu, 3, 24, use_flash_attn=False), 0.0)
    lines = [r.getMessage() for r in caplog.records if "attention backend" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "is_causal (one document per row)" in lines[0] and "per document" in lines[1]
    assert all("bfloat16 q/k/v, computed in float32 (this CPU has none of avx512_bf16/amx_bf16" in ln for ln in lines)


def test_one_document_rows_trace_into_one_graph():
    """The kernel of one-document rows traces without a graph break (per-block torch.compile), same numbers."""
    q, k, v = _qkv(2, 16, 4, 2, 8, torch.float32)
    plan = plan_attention(None, 2, 16, use_flash_attn=False)

    def f(q, k, v):
        return attend(q, k, v, plan, 0.0)

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="eager", fullgraph=True)
    out = compiled(q, k, v)
    torch.testing.assert_close(out, f(q, k, v), rtol=0, atol=0)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    for g, r in zip(grads, torch.autograd.grad(f(q, k, v).sum(), (q, k, v)), strict=True):
        torch.testing.assert_close(g, r, rtol=0, atol=0)


@pytest.fixture(autouse=True)
def _fresh_cpu_kernel_choice():
    """Tests change the CPU flags and TESSERA_CPU_LOWP_MATMUL: each starts and ends with no choice made."""
    cpu_attention.cpu_kernels.forget_cpu_kernels()
    yield
    cpu_attention.cpu_kernels.forget_cpu_kernels()
