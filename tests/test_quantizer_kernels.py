"""The compiled block quantizers (``tessera.parallel.quantizer_kernels``) against the eager ops of
``block_formats`` and ``hadamard``, bit for bit: every recipe, orientation and switch, on operands whose blocks
sit at the edges of the scale formats (zero blocks, blocks a power of two apart, amaxes just above a power of
two, blocks whose scale underflows or saturates, a NaN block); and the emulated GEMM route with NVIDIA's NVFP4
recipe, whose outputs and gradients must not change when its quantizers are compiled. The bit constructions
that replaced ``ldexp`` are checked exhaustively against it."""

from __future__ import annotations

import logging

import pytest
import torch

from tessera import logs
from tessera.parallel import block_formats as bf
from tessera.parallel import fp8, hadamard
from tessera.parallel import quantizer_kernels as qk
from tessera.parallel.gemm import RecipeSwitches, fp8_linear
from tessera.parallel.recipe_state import RecipeStream


def _need_a_compiler() -> None:
    if qk._compiler("cpu") is None:
        pytest.skip("no C++ compiler: the quantizers cannot be compiled here")


@pytest.fixture
def compiled(monkeypatch):
    """The quantizers compiled; a function recompiled past dynamo's limit fails instead of running eagerly (which
    would pass these comparisons without testing a compiled kernel)."""
    _need_a_compiler()
    monkeypatch.setenv(qk.ENV, "compiled")
    qk.forget_quantizer_kernels()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        yield
    qk.forget_quantizer_kernels()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, with NaN in the same places (a NaN's sign and payload are not defined by the arithmetic:
    vectorized and scalar code may set them differently)."""
    if a.shape != b.shape or not torch.equal(torch.isnan(a), torch.isnan(b)):
        return False
    keep = ~torch.isnan(a)
    return torch.equal(_bits(a)[keep], _bits(b)[keep])


def _edge_operand(rows: int = 64, cols: int = 96, seed: int = 0) -> torch.Tensor:
    """Rows of random data over a wide range, and rows built to hit each edge of the block formats."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp(torch.randn(rows, 1, generator=g) * 4)
    x[0] = 0.0  # all-zero blocks
    x[1] = torch.ldexp(torch.ones(cols), torch.arange(cols).float() % 40 - 20)  # exact powers of two
    x[2] = x[1] * (1 + 2.0**-23)  # just above a power of two: RCEIL's log2 edge
    x[3] = torch.randn(cols, generator=g) * 1e-40  # subnormal inputs: scales at the bottom of E8M0 / E4M3
    x[4] = torch.randn(cols, generator=g) * 3e38  # near fp32's top: scales saturate
    x[5, :32] = torch.randn(32, generator=g) * 2.0**-130  # one block underflows the E8M0 range
    x[6, 5] = float("nan")  # a NaN block
    x[7, ::2] = 0.0  # half-zero blocks
    return x


def _finite(x: torch.Tensor) -> torch.Tensor:
    """NVFP4's per-tensor scale comes from the whole operand: a NaN or an fp32-top row would make every block
    NaN or flush everything, so NVFP4 gets the operand without those rows."""
    return torch.cat([x[:4], x[5:6], x[7:]])


def test_pow2_and_grid_step_are_ldexps_values_for_every_exponent():
    e = torch.arange(-149, 128, dtype=torch.int32)
    assert _same(bf._pow2(e), torch.ldexp(torch.ones(e.shape), e.float()))
    # every fp32 exponent field, zero, subnormals, inf and NaN: the step the old ldexp formula gave
    v = torch.cat([torch.ldexp(torch.tensor([1.0, 1.5, -1.75]).repeat(254), torch.arange(-126, 128).repeat_interleave(3)
                               .float()), torch.tensor([0.0, -0.0, 1e-42, -3e-39, float("nan")])])
    for fmt in (bf.E2M1, bf.E4M3, bf.E5M2):
        vc = torch.clamp(v, -fmt.max, fmt.max)
        old = torch.ldexp(torch.ones(vc.shape), (torch.clamp(bf._exponent(vc), min=fmt.emin) - fmt.mbits).float())
        assert _same(bf._grid_step(vc, fmt), old), fmt


ROW_CASES = [(recipe, dim, rounding, noisy)
             for recipe, roundings in (("nvfp4", ("floor",)), ("mxfp8", ("floor", "rceil")))
             for rounding in roundings for dim in (1, 0) for noisy in (False, True)]


@pytest.mark.parametrize("recipe,dim,rounding,noisy", ROW_CASES)
def test_compiled_block_quantizers_equal_the_eager_ones_bitwise(compiled, recipe, dim, rounding, noisy):
    x = _edge_operand()
    if recipe == "nvfp4":
        x = _finite(x)
    x = x if dim == 1 else x.t().contiguous()[:, :48]  # blocks along the rows of a (96, 48) operand
    noise = torch.rand(x.shape, generator=torch.Generator().manual_seed(1)) if noisy else None
    amax = x.abs().amax() * 2 if recipe == "nvfp4" else None  # a TP group's amax, above this shard's
    for amax_given in (None, amax) if recipe == "nvfp4" else (None,):
        eager = bf.fake_quantize(x, recipe, dim, amax_given, rounding, noise)
        assert _same(qk.fake_quantize(x, recipe, dim, amax_given, rounding, noise), eager)
        q, stats = qk.fake_quantize_with_stats(x.to(torch.bfloat16), recipe, dim, amax_given, rounding, noise)
        q_ref, stats_ref = bf.fake_quantize_with_stats(x.to(torch.bfloat16), recipe, dim, amax_given, rounding, noise)
        assert _same(q, q_ref)
        assert all(torch.equal(a, b) for a, b in zip(stats, stats_ref, strict=True))


def test_compiled_2d_weight_blocks_equal_the_eager_ones_bitwise(compiled):
    w = _finite(_edge_operand(rows=72, cols=64, seed=2))[:64]
    for amax in (None, w.abs().amax() * 4):
        assert _same(qk.fake_quantize_nvfp4_2d(w, amax), bf.fake_quantize_nvfp4_2d(w, amax))
        q, stats = qk.fake_quantize_nvfp4_2d_with_stats(w, amax)
        q_ref, stats_ref = bf.fake_quantize_nvfp4_2d_with_stats(w, amax)
        assert _same(q, q_ref) and all(torch.equal(a, b) for a, b in zip(stats, stats_ref, strict=True))


def _eager_then_compiled(monkeypatch, fn):
    _need_a_compiler()
    results = []
    for choice in ("eager", "compiled"):
        monkeypatch.setenv(qk.ENV, choice)
        qk.forget_quantizer_kernels()
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            results.append(fn())
    qk.forget_quantizer_kernels()
    return results


@pytest.mark.parametrize("fmt", [fp8.E4M3, fp8.E5M2])
def test_compiled_fp8_quantizers_equal_the_eager_ones_bitwise(monkeypatch, fmt):
    """fp8 tensorwise and rowwise: the scale from the amax, the saturating cast and the way back in fp32."""
    x = _edge_operand(rows=256, cols=256)
    for keep_dim in (None, 0, 1):
        eager, fused = _eager_then_compiled(monkeypatch, lambda: fp8.quantize(x, fmt, keep_dim))
        assert _same(eager, fused), keep_dim


def test_the_hadamard_transform_is_the_sylvester_matrix_product_and_its_butterflies_are_fixed():
    """rht along either dim against ``H diag(signs)`` in fp64 (exact for these inputs: sums of 16 multiples of
    2**-k well inside fp64's precision), and, in fp32, bitwise the butterfly of the reference order
    (stage h: (a + b, a - b) at distance h, then one scaling by 1/4), written out here on the last dim."""
    signs = hadamard.random_signs(3)
    h = hadamard.hadamard_matrix(16).double() * signs.double()
    x = torch.randint(-64, 64, (48, 32), generator=torch.Generator().manual_seed(0)).double() / 8
    assert torch.equal(hadamard.rht(x, signs, 0), (h @ x.reshape(3, 16, 32)).reshape(48, 32))
    assert torch.equal(hadamard.rht(x, signs, 1), (x.reshape(48, 2, 16) @ h.t()).reshape(48, 32))
    y = torch.randn(48, 32, generator=torch.Generator().manual_seed(1))
    blocks = y.t().reshape(32, 3, 16) * signs
    for stage in (1, 2, 4, 8):
        pairs = blocks.reshape(32, 3, 16 // (2 * stage), 2, stage)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        blocks = torch.stack([a + b, a - b], dim=-2).reshape(32, 3, 16)
    expected = (blocks * 0.25).reshape(32, 48).t()
    assert _same(hadamard.rht(y, signs, 0), expected)
    assert _same(hadamard.rht(y.t().contiguous(), signs, 1), expected.t())


def test_the_nvfp4_route_with_nvidias_recipe_is_unchanged_by_compiled_quantizers(monkeypatch):
    """fp8_linear's outputs and both gradients (2D weights, Hadamard wgrad over 40 tokens padded to 48,
    stochastic gradients from the linear's stream), TP=1, with the quantizers eager and then compiled."""
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(40, 64, generator=g) * torch.linspace(0.1, 3, 64)).to(torch.bfloat16)
    w = (torch.randn(96, 64, generator=g) * 0.2).to(torch.bfloat16)
    dy = (torch.randn(40, 96, generator=g) * 1e-3).to(torch.bfloat16)
    switches = RecipeSwitches(weight_2d=True, hadamard=True, stochastic=True)
    _need_a_compiler()

    def run(choice: str) -> tuple[torch.Tensor, ...]:
        monkeypatch.setenv(qk.ENV, choice)
        qk.forget_quantizer_kernels()
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fp8_linear(xr, wr, None, "nvfp4", switches=switches, state=RecipeStream(7, "lin"))
        y.backward(dy)
        return y.detach(), xr.grad, wr.grad

    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        eager, fused = run("eager"), run("compiled")
    qk.forget_quantizer_kernels()
    assert all(_same(a.float(), b.float()) for a, b in zip(eager, fused, strict=True))


def test_the_choice_is_read_once_logged_once_and_refuses_what_it_cannot_do(monkeypatch, caplog):
    monkeypatch.setattr(logs, "_LOGGED", set())  # this process may have logged the choice in an earlier test
    monkeypatch.setenv(qk.ENV, "sometimes")
    qk.forget_quantizer_kernels()
    with pytest.raises(ValueError, match="TESSERA_QUANTIZER='sometimes'"):
        qk.compiled_quantizers("cpu")
    monkeypatch.setenv(qk.ENV, "compiled")
    with pytest.raises(RuntimeError, match="nothing compiles kernels for meta tensors"):
        qk.compiled_quantizers("meta")
    monkeypatch.setenv(qk.ENV, "auto")
    qk.forget_quantizer_kernels()
    assert qk.compiled_quantizers("meta") is False  # auto: eager where nothing compiles
    monkeypatch.setenv(qk.ENV, "eager")
    qk.forget_quantizer_kernels()
    calls = []
    monkeypatch.setattr(qk, "_compiled", lambda fn: calls.append(fn))
    with caplog.at_level(logging.INFO, logger="tessera"):
        x = _edge_operand()[8:40]
        assert _same(qk.fake_quantize(x, "mxfp8", 1), bf.fake_quantize(x, "mxfp8", 1))
        monkeypatch.setenv(qk.ENV, "compiled")  # read once: the process keeps its choice
        qk.fake_quantize(x, "mxfp8", 0)
    assert calls == []
    assert [r.getMessage() for r in caplog.records if "block quantizers" in r.getMessage()] == [
        "block quantizers on cpu: torch's eager ops (TESSERA_QUANTIZER=eager)"]
    qk.forget_quantizer_kernels()


def test_bad_operands_get_block_formats_errors_before_anything_compiles(compiled):
    with pytest.raises(ValueError, match="block size 32 does not divide size 48 of dim 1"):
        qk.fake_quantize(torch.zeros(4, 48), "mxfp8", 1)
    with pytest.raises(ValueError, match="block recipe must be one of"):
        qk.fake_quantize(torch.zeros(4, 64), "fp4", 1)
    with pytest.raises(ValueError, match="MX scale rounding must be one of"):
        qk.fake_quantize(torch.zeros(4, 64), "mxfp8", 1, scale_rounding="up")
    with pytest.raises(ValueError, match="both dims multiples of 16"):
        qk.fake_quantize_nvfp4_2d(torch.zeros(24, 32))


def test_more_variants_of_one_quantizer_than_dynamos_default_limit_all_run_compiled(compiled):
    """fp8's fused quantizer in 12 variants (2 formats x 3 scale layouts x 2 input dtypes), as a process running
    several recipes meets them: past dynamo's default limit of 8 graphs a function would run eagerly with only a
    warning; under the quantizers' own limit (``RECOMPILE_LIMIT``) each compiles (the fixture fails on a hit)."""
    x = _edge_operand(rows=32, cols=32, seed=3)[8:]
    assert qk.RECOMPILE_LIMIT >= 12
    for dtype in (torch.float32, torch.bfloat16):
        for fmt in (fp8.E4M3, fp8.E5M2):
            for keep_dim in (None, 0, 1):
                fp8.quantize(x.to(dtype), fmt, keep_dim)
