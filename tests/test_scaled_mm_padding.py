"""``torch._scaled_mm`` wants its reduction dim and its second operand's columns in multiples of 16 (the CUDA
kernel refuses other shapes; the CPU reference kernel does not check): the fp8 route pads them with zeros. Checked
on CPU by the shapes the kernel is handed, and by the results against the same GEMMs unpadded."""

from __future__ import annotations

import pytest
import torch

from tessera.parallel import gemm

BF16_ULP = 2.0**-8  # one rounding of the output to bf16, relative


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("tokens,out_features", [(26, 48), (32, 40), (13, 24)])
def test_every_scaled_mm_call_gets_multiples_of_16_and_the_same_result(monkeypatch, recipe, tokens, out_features):
    real = torch._scaled_mm
    shapes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def kernel(a, b, scale_a, scale_b, bias=None, out_dtype=None):
        shapes.append((tuple(a.shape), tuple(b.shape)))
        return real(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype)

    g = torch.Generator().manual_seed(tokens * out_features)
    x = torch.randn(tokens, 64, generator=g).bfloat16().requires_grad_()
    w = torch.randn(out_features, 64, generator=g).bfloat16().requires_grad_()
    b = torch.randn(out_features, generator=g).bfloat16().requires_grad_()
    dy = torch.randn(tokens, out_features, generator=g).bfloat16()
    ref = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    monkeypatch.setattr(gemm, "SCALED_MM_MULTIPLE", 1)  # the reference: unpadded (the CPU kernel takes any shape)
    y_ref = gemm.linear(*ref, gemm.GemmPolicy("fp8", recipe, "scaled_mm"))
    (y_ref * dy).sum().backward()
    monkeypatch.setattr(torch, "_scaled_mm", kernel)
    monkeypatch.setattr(gemm, "SCALED_MM_MULTIPLE", 16)
    y = gemm.linear(x, w, b, gemm.GemmPolicy("fp8", recipe, "scaled_mm"))
    (y * dy).sum().backward()
    assert len(shapes) == 3 and all(a[1] % 16 == 0 and bb[0] % 16 == 0 and bb[1] % 16 == 0 for a, bb in shapes)
    assert any(a[1] != k for (a, _), k in zip(shapes, (64, out_features, tokens)))  # something was padded
    for got, want in zip((y, x.grad, w.grad, b.grad), (y_ref, ref[0].grad, ref[1].grad, ref[2].grad)):
        assert got.shape == want.shape
        assert bool(((got.float() - want.float()).abs() <= BF16_ULP * want.float().abs() + 1e-6).all())
