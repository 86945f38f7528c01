"""Attention backend chosen per call from the tensors it gets (flash_attn, SDPA, GQA expansion), on fake CUDA tensors.

flash_attn is not installed here, so a stand-in module records what reaches it; the SDPA route is
observed by wrapping ``tessera.model.sdpa.scaled_dot_product_attention``. Numerics of the K/V
expansion are checked on the CPU against SDPA's own grouped-query path.
"""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from harness.fake_cuda import fake_cuda_mode
from tessera import logs
from tessera.model import attention, flash_probe
from tessera.model import sdpa as sdpa_module
from tessera.model.attention import _sdpa, attend, plan_attention, select_backend
from tests.tolerances import allclose_tols, order_rtol

CUDA = torch.device("cuda")


@pytest.fixture
def calls(monkeypatch):
    """Pretend flash_attn is installed; record every flash_attn and SDPA call with its tensors."""
    seen: list[tuple[str, torch.Tensor, torch.Tensor, dict]] = []

    def flash(q, k, v, *args, **kwargs):
        seen.append(("flash_attn", q, k, kwargs))
        return torch.empty_like(q)

    def varlen(q, k, v, *args, **kwargs):
        seen.append(("flash_attn_varlen", q, k, kwargs))
        return torch.empty_like(q)

    def sdpa(q, k, v, **kwargs):
        seen.append(("sdpa", q, k, kwargs))
        return torch.empty_like(q)

    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_func=flash,
                                                                         flash_attn_varlen_func=varlen))
    monkeypatch.setattr(flash_probe, "_PROBE", None)  # probed again: finds the stand-in above
    monkeypatch.setattr(flash_probe, "_CAPABILITY", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(sdpa_module, "scaled_dot_product_attention", sdpa)
    return seen


def _qkv(dtype: torch.dtype, device: torch.device, hq: int = 4, hkv: int = 2):
    b, s, d = 2, 8, 16
    return (torch.randn(b, s, hq, d, dtype=dtype, device=device), torch.randn(b, s, hkv, d, dtype=dtype, device=device),
            torch.randn(b, s, hkv, d, dtype=dtype, device=device))


def test_backend_follows_the_tensors_passed_not_the_model_dtype(calls):
    """One plan (made for a bf16 model) serves a bf16 layer and an fp32-marked layer: flash_attn gets
    only the bf16 call, the fp32 island goes to SDPA."""
    plan = plan_attention(None, 2, 8, use_flash_attn=True)
    with fake_cuda_mode():
        attend(*_qkv(torch.bfloat16, CUDA), plan, 0.0)
        attend(*_qkv(torch.float32, CUDA), plan, 0.0)
    assert [(c[0], c[1].dtype) for c in calls] == [("flash_attn", torch.bfloat16), ("sdpa", torch.float32)]


def test_packed_rows_use_varlen_flash_or_a_mask(calls):
    cu = torch.tensor([0, 3, 8, 16], dtype=torch.int32)  # row 0 holds two documents
    plan = plan_attention(cu, 2, 8, use_flash_attn=True)
    with fake_cuda_mode():
        out = attend(*_qkv(torch.float16, CUDA), plan, 0.0)
        attend(*_qkv(torch.float32, CUDA), plan, 0.0)
    assert [c[0] for c in calls] == ["flash_attn_varlen", "sdpa"]
    # varlen takes the B*S tokens flattened, [total, H, d]; the result is [B, S, H, d] again
    assert tuple(calls[0][1].shape) == (16, 4, 16) and tuple(out.shape) == (2, 8, 4, 16)
    mask = calls[1][3]["attn_mask"]
    assert tuple(mask.shape) == (2, 1, 8, 8) and mask.dtype == torch.bool


@pytest.mark.parametrize("dtype,packed,expanded", [
    (torch.bfloat16, False, False),  # SDPA's flash kernel takes GQA: keep 2 KV heads
    (torch.bfloat16, True, True),  # boolean mask: flash kernel refuses it -> expand
    (torch.float32, False, True),  # fp32: flash kernel refuses it -> expand
])
def test_gqa_is_expanded_on_cuda_where_sdpa_would_fall_to_math(calls, dtype, packed, expanded):
    cu = torch.tensor([0, 3, 8, 16], dtype=torch.int32) if packed else None
    plan = plan_attention(cu, 2, 8, use_flash_attn=False)
    with fake_cuda_mode():
        attend(*_qkv(dtype, CUDA), plan, 0.0)
    (_, q, k, kwargs), = calls
    assert k.shape[1] == (4 if expanded else 2)  # [B, H, S, d] at the SDPA call
    assert kwargs["enable_gqa"] is (not expanded)


def test_cpu_sdpa_keeps_the_grouped_query_path(calls):
    """On the CPU, SDPA (used there only with attention dropout) gets the grouped K/V heads, not expanded."""
    plan = plan_attention(torch.tensor([0, 3, 8, 16], dtype=torch.int32), 2, 8, use_flash_attn=True)
    attend(*_qkv(torch.float32, torch.device("cpu")), plan, 0.1)
    (name, _, k, kwargs), = calls
    assert name == "sdpa" and k.shape[1] == 2 and kwargs["enable_gqa"] is True


def test_expanded_kv_equals_grouped_query_attention():
    """The expansion is only a layout change: same result as SDPA's grouped path (CPU, fp32)."""
    torch.manual_seed(0)
    q, k, v = (t.transpose(1, 2) for t in _qkv(torch.float32, torch.device("cpu"), hq=6, hkv=2))
    mask = torch.ones(8, 8, dtype=torch.bool).tril().view(1, 1, 8, 8).expand(2, 1, 8, 8)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    expanded = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), attn_mask=mask)
    # two orders of the same attention: sums over head_dim 16 and 8 keys, five chained steps (scores, max/exp,
    # sum, normalize, probs @ v); elementwise, atol = rtol x the largest output
    tol = allclose_tols(order_rtol(torch.float32, 16, 5), float(ref.abs().max()))  # rtol 7.5e-7
    torch.testing.assert_close(expanded, ref, **tol)
    torch.testing.assert_close(_sdpa(q, k, v, mask, False, 0.0), ref, **tol)


# ---------------------------------------------------------------------------- the flash_attn probe
BROKEN = {  # what a wheel built for another torch / CUDA raises when its compiled extension loads
    "ImportError": "raise ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi')",
    "OSError": "raise OSError('libcudart.so.11.0: cannot open shared object file: No such file or directory')",
    "RuntimeError": "raise RuntimeError('CUDA error: no kernel image is available for execution on the device')",
}


@pytest.fixture
def probe(monkeypatch):
    """A fresh probe (forgotten again afterwards); SDPA recorded; a GPU of compute capability 9.0."""
    monkeypatch.setattr(flash_probe, "_PROBE", None)
    monkeypatch.setattr(flash_probe, "_CAPABILITY", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(logs, "_LOGGED", set())
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    seen: list[str] = []
    monkeypatch.setattr(sdpa_module, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: seen.append("sdpa") or torch.empty_like(q))
    return seen


@pytest.mark.parametrize("error", BROKEN)
def test_a_broken_flash_attn_falls_back_to_sdpa_with_one_line(probe, error, tmp_path, monkeypatch, caplog):
    """The package is found on the path (find_spec would say 'installed') but its import fails: SDPA runs
    (one document a row; packed rows take torch's varlen kernel, tests/test_torch_varlen.py), one log line
    says why, and the import is tried once however many calls follow."""
    package = tmp_path / "flash_attn"
    package.mkdir()
    (package / "__init__.py").write_text(f"open({str(tmp_path / 'imports')!r}, 'a').write('x')\n{BROKEN[error]}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    plan = plan_attention(None, 2, 8, use_flash_attn=True)
    with caplog.at_level(logging.INFO, logger="tessera"), fake_cuda_mode():
        for _ in range(3):
            attend(*_qkv(torch.bfloat16, CUDA), plan, 0.0)
    assert probe == ["sdpa"] * 3
    assert (tmp_path / "imports").read_text() == "x"  # imported once
    lines = [r.getMessage() for r in caplog.records if "attention backend" in r.getMessage()]
    assert len(lines) == 1 and f"flash_attn not used: importing flash_attn failed ({error}: " in lines[0]


def _stand_in(monkeypatch, seen):
    module = types.ModuleType("flash_attn")
    module.__version__ = "2.7.4"
    module.flash_attn_func = lambda q, *a, **kw: seen.append("flash_attn") or torch.empty_like(q)
    module.flash_attn_varlen_func = lambda q, *a, **kw: seen.append("flash_attn_varlen") or torch.empty_like(q)
    monkeypatch.setitem(sys.modules, "flash_attn", module)


@pytest.mark.parametrize("capability,head_dim,dtype,why", [
    ((9, 0), 64, torch.bfloat16, None),
    ((8, 0), 256, torch.float16, None),
    ((7, 5), 64, torch.float16, "compute capability is 7.5"),
    ((9, 0), 264, torch.bfloat16, "head_dim 264"),
    ((9, 0), 20, torch.bfloat16, "head_dim 20"),
    ((9, 0), 64, torch.float32, "q/k/v are torch.float32"),
])
def test_flash_attn_only_where_the_gpu_head_dim_and_dtype_suit_it(probe, monkeypatch, capability, head_dim, dtype,
                                                                  why, caplog):
    _stand_in(monkeypatch, probe)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    q = torch.randn(2, 8, 4, head_dim, dtype=dtype)
    with caplog.at_level(logging.INFO, logger="tessera"), fake_cuda_mode():
        for _ in range(2):
            attend(q.to(CUDA), q[:, :, :2].to(CUDA), q[:, :, :2].to(CUDA), plan_attention(None, 2, 8, True), 0.0)
    lines = [r.getMessage() for r in caplog.records if "attention backend" in r.getMessage()]
    assert len(lines) == 1
    if why is None:
        assert probe == ["flash_attn"] * 2 and "flash_attn 2.7.4" in lines[0]
    else:
        assert probe == ["sdpa"] * 2 and why in lines[0].split("flash_attn not used: ")[1]


def test_flash_attn_not_installed(probe, monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import raises ModuleNotFoundError for flash_attn itself
    with fake_cuda_mode():
        assert select_backend(CUDA, torch.bfloat16, True, 64) == ("sdpa", "the flash_attn package is not installed")
    assert select_backend(torch.device("cpu"), torch.bfloat16, True, 64) == ("sdpa", "the device is cpu, not cuda")


# ------------------------------------------------------------------------------------------ the table
BF16, FP32 = torch.bfloat16, torch.float32
NO_CPU_DROPOUT = "tessera's CPU kernels have no attention dropout (model.attn_drop_rate=0.1)"


def test_the_table_lists_the_backends_in_designs_order():
    """DESIGN.md (Model): the flash kernels, the CPU per-document kernel, SDPA is_causal, the SDPA mask last."""
    assert [b.name for b in attention.BACKENDS] == ["flash_attn", "torch_varlen", "cpu_flash", "sdpa_causal",
                                                    "sdpa_mask"]


@pytest.mark.parametrize("device,dtype,packed,dropout,use_flash,expected,reasons", [
    ("cpu", BF16, False, 0.0, True, "cpu_flash", ["the device is cpu, not cuda"]),
    ("cpu", BF16, True, 0.0, True, "cpu_flash", ["the device is cpu, not cuda"]),  # varlen's same refusal: once
    ("cpu", BF16, True, 0.1, True, "sdpa_mask", ["the device is cpu, not cuda", NO_CPU_DROPOUT]),
    ("cpu", FP32, False, 0.1, False, "sdpa_causal", ["disabled by model.use_flash_attn=False", NO_CPU_DROPOUT]),
    ("cuda", BF16, True, 0.0, False, "sdpa_mask", ["disabled by model.use_flash_attn=False"]),  # nor torch varlen
    ("cuda", FP32, True, 0.0, True, "sdpa_mask", ["q/k/v are torch.float32, flash_attn needs float16/bfloat16"]),
    ("cuda", BF16, False, 0.0, True, "sdpa_causal", ["the flash_attn package is not installed"]),
    ("cuda", BF16, False, 0.1, True, "sdpa_causal", ["the flash_attn package is not installed"]),
])
def test_each_call_takes_the_first_backend_that_serves_and_accepts_it(monkeypatch, device, dtype, packed, dropout,
                                                                       use_flash, expected, reasons):
    """The refusals of the backends before the chosen one that serve such calls, each once and in table order,
    are the reason logged; backends that do not serve the call (torch varlen for one-document rows, the CPU
    kernel on CUDA) add none."""
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # not installed
    monkeypatch.setattr(flash_probe, "_PROBE", None)
    call = attention.AttentionCall(torch.device(device), dtype, 64, 8, packed, dropout, use_flash)
    backend, why = attention.choose_backend(call)
    assert (backend.name, why.split("; ")) == (expected, reasons)
    legacy = expected if expected in ("flash_attn", "torch_varlen") else "sdpa"
    assert select_backend(call.device, dtype, use_flash, 64, packed=packed, dropout_p=dropout) == (legacy, why)


def test_packed_bf16_rows_on_cuda_without_flash_attn_take_torch_varlen_where_this_torch_has_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setattr(flash_probe, "_PROBE", None)
    backend, why = attention.choose_backend(attention.AttentionCall(CUDA, BF16, 64, 8, True, 0.0, True))
    kernel, why_not = attention.torch_varlen()
    if kernel is not None:
        assert (backend.name, why) == ("torch_varlen", "the flash_attn package is not installed")
    else:
        assert (backend.name, why) == ("sdpa_mask", f"the flash_attn package is not installed; {why_not}")
