"""The GEMM route table (``tessera.parallel.gemm``): which route a linear gets, and that each computes its meaning.

Low-precision CPU matmuls computed as fp32 GEMMs on bf16/fp16 operands (the ``cpu-upcast`` route) mean what a
bf16 GEMM means. Reference: the exact product of the low-precision values (fp64), rounded once to the output
dtype. torch's own bf16 kernel must land as close to that reference as ours does.
"""

import logging

import pytest
import torch

from tessera import logs
from tessera.model import sdpa
from tessera.parallel import cpu_kernels, gemm
from tessera.parallel.layers import ColumnParallelLinear


@pytest.fixture(autouse=True)
def _fresh_choice():
    """Each test sets TESSERA_CPU_LOWP_MATMUL itself (``_use``); the process's choice is made again after it."""
    cpu_kernels.forget_cpu_kernels()
    yield
    cpu_kernels.forget_cpu_kernels()


def _use(monkeypatch, choice: str) -> None:
    monkeypatch.setenv("TESSERA_CPU_LOWP_MATMUL", choice)
    cpu_kernels.forget_cpu_kernels()


def _ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of the low-precision spacing at b."""
    spacing = torch.finfo(a.dtype).eps * b.float().abs().clamp_min(torch.finfo(a.dtype).tiny)
    return (a.float() - b.float()).abs() / spacing


def _through_linear(x, w, b, gy):
    """The layers' entry point: forward, then autograd's backward (``_RoutedLinear``)."""
    y = gemm.linear(x, w, b)
    y.backward(gy)
    return y, x.grad, w.grad, b.grad


def _through_parts(x, w, b, gy):
    """What code with its own backward calls (sequence parallelism, the chunked head): the same route's GEMMs."""
    y = gemm.linear_no_autograd(x, w, b)
    return (y, *gemm.linear_grads(gy, x, w, True, (True, True, True)))


@pytest.mark.parametrize("entry", [_through_linear, _through_parts], ids=["linear", "parts"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_upcast_linear_matches_exact_product_rounded(monkeypatch, dtype, entry):
    _use(monkeypatch, "upcast")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 48, generator=g).to(dtype).requires_grad_()
    w = torch.randn(32, 48, generator=g).to(dtype).requires_grad_()
    b = torch.randn(32, generator=g).to(dtype).requires_grad_()
    gy = torch.randn(3, 5, 32, generator=g).to(dtype)
    assert gemm.route_for(x, w) is gemm.ROUTES["cpu-upcast"]
    y, gx, gw, gb = entry(x, w, b, gy)
    assert y.dtype == dtype
    exact = (x.double() @ w.double().t() + b.double()).to(dtype)
    assert _ulp_distance(y, exact).max() <= 1.0

    gx_exact = (gy.double() @ w.double()).to(dtype)
    gw_exact = (gy.double().reshape(-1, 32).t() @ x.double().reshape(-1, 48)).to(dtype)
    gb_exact = gy.double().reshape(-1, 32).sum(0).to(dtype)
    for got, want in ((gx, gx_exact), (gw, gw_exact), (gb, gb_exact)):
        assert got.dtype == dtype
        assert _ulp_distance(got, want).max() <= 1.0

    # torch's own kernel computes the same function (within the same rounding)
    _use(monkeypatch, "native")
    assert gemm.route_for(x, w) is gemm.ROUTES["native"]
    y_native = gemm.linear(x.detach(), w.detach(), b.detach())
    assert _ulp_distance(y_native, exact).max() <= 1.0


def test_fp32_is_untouched(monkeypatch):
    _use(monkeypatch, "upcast")
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    assert torch.equal(gemm.linear(x, w), torch.nn.functional.linear(x, w))


def test_upcast_attention_close_to_fp64(monkeypatch):
    _use(monkeypatch, "upcast")
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 16, 8, generator=g).to(torch.bfloat16) for _ in range(3))
    out = sdpa.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    assert out.dtype == torch.bfloat16
    assert (out.double() - ref).abs().max() <= 2 * torch.finfo(torch.bfloat16).eps * ref.abs().max()


def test_choice_is_made_once_per_process(monkeypatch):
    """After the first use the choice is a constant (what torch.compile traces): a later change of the
    variable is not read until ``forget_cpu_kernels``; a bad value is refused by name."""
    _use(monkeypatch, "upcast")
    assert cpu_kernels.decide_cpu_kernels() == {torch.bfloat16: True, torch.float16: True}
    monkeypatch.setenv("TESSERA_CPU_LOWP_MATMUL", "native")
    assert cpu_kernels.upcast_on_cpu(torch.bfloat16)
    cpu_kernels.forget_cpu_kernels()
    assert not cpu_kernels.upcast_on_cpu(torch.bfloat16)
    _use(monkeypatch, "fast")
    with pytest.raises(ValueError, match="TESSERA_CPU_LOWP_MATMUL='fast'"):
        cpu_kernels.upcast_on_cpu(torch.bfloat16)


def test_the_table_picks_one_route_per_device_dtype_and_policy(monkeypatch, caplog):
    """Every row is reachable, the choice follows (device, dtype, policy) only, and each choice is logged once."""
    _use(monkeypatch, "upcast")
    fp8 = gemm.GemmPolicy("fp8", "rowwise")
    monkeypatch.setattr(logs, "_LOGGED", set())
    with caplog.at_level(logging.INFO, logger="tessera"):
        for _ in range(2):
            assert gemm.choose_route("cpu", torch.bfloat16).name == "cpu-upcast"
            assert gemm.choose_route("cpu", torch.float32).name == "native"
            assert gemm.choose_route("cuda", torch.bfloat16).name == "native"  # the CPU's choice is the CPU's
            assert gemm.choose_route("cpu", None).name == "native"  # input and weight of two dtypes
            assert gemm.choose_route("cpu", torch.bfloat16, fp8).name == "fp8-emulated"
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("GEMMs of")]
    assert len(lines) == 5 and "route cpu-upcast" in lines[0] and "format fp8 rowwise" in lines[4]
    assert set(gemm.ROUTES) == {"native", "cpu-upcast", "fp8-emulated", "fp8-scaled-mm", "mxfp8-emulated",
                                "nvfp4-emulated", "fp8-rowwise-gw-hp-emulated", "fp8-blockwise-emulated"}
    assert [r.adds_into_main_grad for r in gemm.ROUTES.values()] == [True, True, False, False, False, False, False,
                                                                      False]


def test_a_bad_policy_is_refused_by_name():
    with pytest.raises(ValueError, match="fp8 recipe must be one of"):
        gemm.GemmPolicy("fp8", "blockwise")
    with pytest.raises(ValueError, match="GEMM format 'nvfp4'"):
        gemm.GemmPolicy("nvfp4")
    with pytest.raises(ValueError, match="recipe='rowwise' is a setting of the fp8 format"):
        gemm.GemmPolicy("model", "rowwise")


def test_a_layer_holds_its_policy_and_fp8_recipe_sets_it(monkeypatch):
    """``fp8_recipe`` (what ``model.fp8`` and the tests set) is the policy's fp8 part; the observer survives it;
    the layer's GEMM is then the fp8 route's (the quantize-dequantize reference lives in tests/test_fp8.py)."""
    _use(monkeypatch, "native")
    layer = ColumnParallelLinear(16, 8, bias=False, init_seed=1).to(torch.bfloat16)
    x = torch.randn(4, 16).to(torch.bfloat16)
    assert layer.gemm_policy == gemm.MODEL_DTYPE and layer.fp8_recipe is None
    seen = []
    layer.fp8_observe = lambda t, scale, q: seen.append(scale)
    layer.fp8_recipe = "tensorwise"
    assert layer.gemm_policy == gemm.GemmPolicy("fp8", "tensorwise") and layer.fp8_observe is not None
    assert torch.equal(layer(x), gemm.fp8_linear(x, layer.weight, None, "tensorwise")) and len(seen) == 1
    layer.fp8_recipe = None
    assert layer.gemm_policy == gemm.MODEL_DTYPE
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight))
