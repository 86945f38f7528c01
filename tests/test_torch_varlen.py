"""Packed rows on CUDA without flash_attn: torch's own varlen attention, chosen per call and called right.

No GPU here: the choice is checked with fake CUDA tensors (``harness.fake_cuda``) and flash_attn absent;
the real ``torch.nn.attention.varlen.varlen_attn`` op runs on them through its fake (shape) implementation,
which checks the arguments reach it in the form it takes. The adapter's numerics are checked on the CPU
with stand-ins of both calling conventions (torch 2.10's ``is_causal``, later releases' ``window_size`` and
``enable_gqa``) computing the per-document causal attention, against SDPA with the block-diagonal mask.
"""

from __future__ import annotations

import logging
import sys

import pytest
import torch
import torch.nn.functional as F

from harness.fake_cuda import fake_cuda_mode
from tessera import logs
from tessera.model import flash_probe, sdpa
from tessera.model.attention import attend, plan_attention, select_backend
from tessera.model.documents import AttentionPlan
from tessera.model.torch_varlen import adapt_varlen, torch_varlen

CUDA = torch.device("cuda")
CU = torch.tensor([0, 3, 8, 11, 16], dtype=torch.int32)  # two rows of 8 tokens, two documents each
B, S, HQ, HKV, D = 2, 8, 4, 2, 16


@pytest.fixture
def no_flash_attn(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # importing it raises ModuleNotFoundError
    monkeypatch.setattr(flash_probe, "_PROBE", None)


def _per_document_reference(q, k, v, cu):
    """Causal attention inside each document, one document at a time ([T, H, d]), GQA by SDPA's own path."""
    out = torch.empty_like(q)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qd, kd, vd = (t[a:b].transpose(0, 1) for t in (q, k, v))  # [H, s, d]
        out[a:b] = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True,
                                                  enable_gqa=qd.shape[0] != kd.shape[0]).transpose(0, 1)
    return out


def _stand_in(convention: str, seen: list[dict]):
    """A varlen_attn with ``convention``'s signature that records its arguments and computes the reference."""
    if convention == "is_causal":
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False):
            seen.append(dict(heads_k=key.shape[1], is_causal=is_causal, max_q=max_q, same_cu=cu_seq_q is cu_seq_k))
            assert is_causal
            return _per_document_reference(query, key, value, cu_seq_q)
    else:
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                        window_size=(-1, -1), enable_gqa=False):
            seen.append(dict(heads_k=key.shape[1], window_size=window_size, enable_gqa=enable_gqa, max_q=max_q))
            assert window_size == (-1, 0)  # causal: all before, none after
            return _per_document_reference(query, key, value, cu_seq_q)
    return varlen_attn


@pytest.mark.parametrize("convention", ["is_causal", "window_size"])
def test_both_calling_conventions_give_per_document_causal_attention(convention):
    seen: list[dict] = []
    kernel = adapt_varlen(_stand_in(convention, seen))
    assert kernel is not None and kernel.convention == convention
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B * S, HQ, D, generator=g)
    k, v = torch.randn(B * S, HKV, D, generator=g), torch.randn(B * S, HKV, D, generator=g)
    out = kernel.call(q, k, v, CU, 5)
    # independent reference: SDPA over each row with the block-diagonal causal mask, K/V heads expanded
    plan = AttentionPlan(B, S, CU.long(), True, 5)
    qb, kb, vb = (t.view(B, S, -1, D).transpose(1, 2) for t in (q, k, v))
    kb, vb = kb.repeat_interleave(HQ // HKV, dim=1), vb.repeat_interleave(HQ // HKV, dim=1)
    ref = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=plan.mask(torch.device("cpu")))
    torch.testing.assert_close(out.view(B, S, HQ, D), ref.transpose(1, 2), rtol=1e-5, atol=1e-6)
    # grouped K/V: passed as they are where the kernel takes enable_gqa, expanded where it does not
    assert seen[0]["heads_k"] == (HKV if convention == "window_size" else HQ) and seen[0]["max_q"] == 5
    if convention == "window_size":
        assert seen[0]["enable_gqa"] is True


def test_this_torch_offers_the_kernel_with_a_known_signature():
    kernel, why = torch_varlen()
    if torch.__version__ < "2.10":
        pytest.skip(f"torch {torch.__version__} predates torch.nn.attention.varlen")
    assert kernel is not None, why
    assert kernel.convention in ("window_size", "is_causal")


def test_a_signature_with_neither_convention_is_refused():
    assert adapt_varlen(lambda q, k, v, cu_q, cu_k, max_q, max_k: q) is None


@pytest.mark.parametrize("dtype,packed,dropout,use_flash,expected", [
    (torch.bfloat16, True, 0.0, True, "torch_varlen"),
    (torch.float16, True, 0.0, True, "torch_varlen"),
    (torch.bfloat16, False, 0.0, True, "sdpa"),  # one document a row: SDPA is_causal takes its flash kernel
    (torch.float32, True, 0.0, True, "sdpa"),  # an fp32-marked attention: the flash kernels refuse fp32
    (torch.bfloat16, True, 0.1, True, "sdpa"),  # no dropout in torch's varlen kernel
    (torch.bfloat16, True, 0.0, False, "sdpa"),  # model.use_flash_attn=False
])
def test_the_backend_for_packed_rows_without_flash_attn(no_flash_attn, dtype, packed, dropout, use_flash, expected):
    if torch_varlen()[0] is None:
        pytest.skip("this torch has no varlen attention")
    backend, why = select_backend(CUDA, dtype, use_flash, 64, packed=packed, dropout_p=dropout)
    assert backend == expected
    if expected == "torch_varlen":
        assert why == "the flash_attn package is not installed"
    if dropout:
        assert "no dropout" in why


def test_packed_rows_reach_torch_varlen_attn_with_the_boundaries_and_no_mask(no_flash_attn, monkeypatch, caplog):
    """The real op on fake CUDA tensors: [B*S, H, d] in, the int32 boundaries on the device, the longest document
    from the host; no SDPA call and no mask built. Logged once, naming the kernel."""
    if torch_varlen()[0] is None:
        pytest.skip("this torch has no varlen attention")
    sdpa_calls = []
    monkeypatch.setattr(sdpa, "scaled_dot_product_attention",
                        lambda *a, **k: sdpa_calls.append(k) or torch.empty_like(a[0]))
    monkeypatch.setattr(logs, "_LOGGED", set())
    plan = plan_attention(CU, B, S, use_flash_attn=True)
    assert plan.max_seqlen == 5
    with caplog.at_level(logging.INFO, logger="tessera"), fake_cuda_mode():
        q = torch.randn(B, S, HQ, D, dtype=torch.bfloat16, device=CUDA)
        k = torch.randn(B, S, HKV, D, dtype=torch.bfloat16, device=CUDA)
        out = attend(q, k, torch.randn_like(k), plan, 0.0)
        attend(q, k, torch.randn_like(k), plan, 0.0)
        assert tuple(out.shape) == (B, S, HQ, D) and out.device.type == "cuda"
        cu, max_seqlen = plan.varlen(CUDA)
        assert cu.dtype == torch.int32 and cu.device.type == "cuda" and max_seqlen == 5
    assert sdpa_calls == [] and plan._mask is None
    lines = [r.getMessage() for r in caplog.records if "torch varlen_attn" in r.getMessage()]
    assert len(lines) == 1 and "flash_attn not used: the flash_attn package is not installed" in lines[0]
