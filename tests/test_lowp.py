"""Low-precision CPU matmuls computed as fp32 GEMMs on bf16/fp16 operands: same meaning as a bf16 GEMM.

Reference: the exact product of the low-precision values (fp64), rounded once to the output dtype.
torch's own bf16 kernel must land as close to that reference as ours does.
"""

import pytest
import torch

from tessera.parallel import lowp


@pytest.fixture(autouse=True)
def _fresh_choice():
    """Each test sets TESSERA_CPU_LOWP_MATMUL itself (``_use``); the process's choice is made again after it."""
    lowp.forget_cpu_kernels()
    yield
    lowp.forget_cpu_kernels()


def _use(monkeypatch, choice: str) -> None:
    monkeypatch.setenv("TESSERA_CPU_LOWP_MATMUL", choice)
    lowp.forget_cpu_kernels()


def _ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of the low-precision spacing at b."""
    spacing = torch.finfo(a.dtype).eps * b.float().abs().clamp_min(torch.finfo(a.dtype).tiny)
    return (a.float() - b.float()).abs() / spacing


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_upcast_linear_matches_exact_product_rounded(monkeypatch, dtype):
    _use(monkeypatch, "upcast")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 48, generator=g).to(dtype).requires_grad_()
    w = torch.randn(32, 48, generator=g).to(dtype).requires_grad_()
    b = torch.randn(32, generator=g).to(dtype).requires_grad_()
    y = lowp.linear(x, w, b)
    assert y.dtype == dtype
    exact = (x.double() @ w.double().t() + b.double()).to(dtype)
    assert _ulp_distance(y, exact).max() <= 1.0

    gy = torch.randn(y.shape, generator=g).to(dtype)
    y.backward(gy)
    gx_exact = (gy.double() @ w.double()).to(dtype)
    gw_exact = (gy.double().reshape(-1, 32).t() @ x.double().reshape(-1, 48)).to(dtype)
    gb_exact = gy.double().reshape(-1, 32).sum(0).to(dtype)
    for got, want in ((x.grad, gx_exact), (w.grad, gw_exact), (b.grad, gb_exact)):
        assert got.dtype == dtype
        assert _ulp_distance(got, want).max() <= 1.0

    # torch's own kernel computes the same function (within the same rounding)
    _use(monkeypatch, "native")
    y_native = lowp.linear(x.detach(), w.detach(), b.detach())
    assert _ulp_distance(y_native, exact).max() <= 1.0


def test_fp32_is_untouched(monkeypatch):
    _use(monkeypatch, "upcast")
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    assert torch.equal(lowp.linear(x, w), torch.nn.functional.linear(x, w))


def test_upcast_attention_close_to_fp64(monkeypatch):
    _use(monkeypatch, "upcast")
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 16, 8, generator=g).to(torch.bfloat16) for _ in range(3))
    out = lowp.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    assert out.dtype == torch.bfloat16
    assert (out.double() - ref).abs().max() <= 2 * torch.finfo(torch.bfloat16).eps * ref.abs().max()


def test_choice_is_made_once_per_process(monkeypatch):
    """After the first use the choice is a constant (what torch.compile traces): a later change of the
    variable is not read until ``forget_cpu_kernels``; a bad value is refused by name."""
    _use(monkeypatch, "upcast")
    assert lowp.decide_cpu_kernels() == {torch.bfloat16: True, torch.float16: True}
    monkeypatch.setenv("TESSERA_CPU_LOWP_MATMUL", "native")
    assert lowp.upcast_on_cpu(torch.bfloat16)
    lowp.forget_cpu_kernels()
    assert not lowp.upcast_on_cpu(torch.bfloat16)
    _use(monkeypatch, "fast")
    with pytest.raises(ValueError, match="TESSERA_CPU_LOWP_MATMUL='fast'"):
        lowp.upcast_on_cpu(torch.bfloat16)
