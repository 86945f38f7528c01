"""The low-precision recipes on top of the block formats (issue 60): MXFP8's RCEIL scale rounding (bit for bit
against torchao's ``ScaleCalculationMode.RCEIL``), NVFP4's 16x16 weight blocks, stochastic rounding of the
elements, and the random Hadamard transform of the weight-gradient GEMM's operands.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch

from tessera.parallel import block_formats as bf
from tessera.parallel import hadamard

F32_MAX = torch.finfo(torch.float32).max


# ------------------------------------------------------------------------------------------ helpers
@pytest.fixture(scope="module")
def ao_mx():
    """torchao's MX reference quantizer and its scale modes, or a clean skip without torchao."""
    pytest.importorskip("torchao")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.prototype.mx_formats import mx_tensor
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
    return mx_tensor, ScaleCalculationMode


def assert_bits_equal(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Same dtype and shape, NaN at the same places, the same bit pattern everywhere else (signed zeros too)."""
    assert ours.dtype == ref.dtype and ours.shape == ref.shape, (ours.dtype, ref.dtype, ours.shape, ref.shape)
    nan = torch.isnan(ours.float()) if ours.is_floating_point() else torch.zeros_like(ours, dtype=torch.bool)
    assert torch.equal(nan, torch.isnan(ref.float()) if ref.is_floating_point() else nan)
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[ours.element_size()]
    a, b = ours.view(bits)[~nan], ref.view(bits)[~nan]
    assert torch.equal(a, b), f"{int((a != b).sum())} of {a.numel()} differ: {ours[~nan][a != b][:4]} vs {ref[~nan][a != b][:4]}"


def blocks_of(rows: list[list[float]], block: int) -> torch.Tensor:
    """One block per row, each row padded to ``block`` by repeating its values."""
    return torch.tensor([(r * block)[:block] for r in rows], dtype=torch.float32)


def above(x: float, steps: int = 1) -> float:
    """``x`` moved ``steps`` fp32 ulps up."""
    t = torch.tensor(x, dtype=torch.float32)
    for _ in range(steps):
        t = torch.nextafter(t, torch.tensor(math.inf))
    return t.item()


# ------------------------------------------------------------------------------------------ 1. MXFP8 RCEIL
def check_rceil_against_torchao(ao_mx, x: torch.Tensor, fmt: str) -> None:
    mx_tensor, mode = ao_mx
    dtype = bf.MX_ELEMENTS[fmt].dtype
    scales, elements = mx_tensor.to_mx(x, dtype, 32, scaling_mode=mode.RCEIL)
    dq = mx_tensor.MXTensor.to_mx(x, dtype, 32, scaling_mode=mode.RCEIL).dequantize(torch.float32)
    ours = bf.quantize_mx(x, fmt, scale_rounding="rceil")
    assert_bits_equal(ours.scales, scales)
    assert_bits_equal(ours.elements, elements)
    assert_bits_equal(bf.dequantize(ours), dq)
    assert_bits_equal(bf.fake_quantize(x, "mxfp8" if fmt == "e4m3" else "mxfp8_e5m2", scale_rounding="rceil"), dq)


def rceil_edge_blocks(fmt: str) -> torch.Tensor:
    """One 32-element block per edge of RCEIL's arithmetic, ``ceil(log2(amax / max_elem))`` in fp32."""
    e = bf.MX_ELEMENTS[fmt]
    top = e.max
    rows = [
        [0.0],                                             # all zeros: log2(0) = -inf, code 0
        [0.0, -0.0, 1.0, -1.0],                            # signed zeros beside normals
        [top, 1.0, -3.0],                                  # amax / max = 1 exactly: code 127, nothing saturates
        [top * 2.0 ** 4, 5.0], [-top * 2.0 ** -60, 2.0 ** -70], [top * 2.0 ** 100, 1.0],  # exact powers of two
        [above(top * 2.0 ** 4), 1.0],                      # one ulp above: fp32 log2 rounds to 4, the scale stays 2**4
        [above(top * 2.0 ** 100, 3), 1.0],                 # a few ulps above a large power
        [above(top * 2.0 ** -60, 1 << 13), 1.0e-20],       # clearly above: the next power
        [above(top), 1.0],                                 # one ulp above 2**0: log2 is exact near 1, rounds up
        [torch.nextafter(torch.tensor(top * 2.0 ** 4), torch.tensor(0.0)).item(), 2.0],  # one ulp below
        [2.0 ** 5, -1.0, 0.5],                             # amax a power of two, not of the element max
        [2.0 ** (e.emax + 1) - 1, top, -(2.0 ** e.emax) * 1.9],  # FLOOR would saturate these, RCEIL does not
        [1.0, 1e-40, -1e-42, 2.0 ** -130],                 # fp32 subnormals beside a normal amax: flushed
        [1e-40, -3e-39, 1e-45],                            # only fp32 subnormals: amax / max underflows, code 0
        [top * 2.0 ** -127, 2.0 ** -140],                  # amax / max = 2**-127 exactly: code 0, encoded by 1
        [above(top * 2.0 ** -127, 1 << 10)],               # amax / max just above 2**-127: code 1
        [top * 2.0 ** -126, -(2.0 ** -130)],               # code 1, the elements multiplied by 2**126
        [F32_MAX, -F32_MAX / 3, 1.0],                      # the largest finite fp32
        [2.0 ** 127, 1.0], [1.5 * 2.0 ** 127, -(2.0 ** 126)],  # near the top of E8M0's range
        [float("inf"), 1.0, -2.0], [float("-inf"), 0.5],   # inf: code 254, elements times 2**-127
        [float("nan"), 1.0, -2.0],                         # NaN: code 255, the whole block NaN
        [1 + 2.0 ** -(e.mbits + 1), 1 + 3 * 2.0 ** -(e.mbits + 1), top],   # element ties, to even
        [-(1 + 2.0 ** -(e.mbits + 1)), 2.5 * 2.0 ** (e.emin - e.mbits), top],  # ties below the normals
    ]
    return blocks_of(rows, 32)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("shape", [(4, 32), (3, 5, 64), (64, 256)])
def test_rceil_random_tensors_equal_torchao_bit_for_bit(ao_mx, fmt, shape):
    g = torch.Generator().manual_seed(sum(shape) + len(fmt) + 60)
    for magnitude in [1e-38, 1e-30, 1e-3, 1.0, 1e3, 1e30, 1e36]:
        x = torch.randn(shape, generator=g) * magnitude
        x = x * torch.exp2(torch.randint(-8, 9, shape, generator=g).float())
        check_rceil_against_torchao(ao_mx, x, fmt)
        check_rceil_against_torchao(ao_mx, x.bfloat16(), fmt)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_rceil_edges_equal_torchao_bit_for_bit(ao_mx, fmt):
    x = rceil_edge_blocks(fmt)
    check_rceil_against_torchao(ao_mx, x, fmt)
    check_rceil_against_torchao(ao_mx, -x, fmt)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_rceil_codes_follow_the_arithmetic(fmt):
    """The edges read against RCEIL's rule, not only against torchao."""
    e = bf.MX_ELEMENTS[fmt]
    x = rceil_edge_blocks(fmt)
    q = bf.quantize_mx(x, fmt, scale_rounding="rceil")
    codes, dq = q.scales.view(torch.uint8).long().squeeze(1), bf.dequantize(q)
    assert codes[0] == 0 and (dq[0] == 0).all()
    assert torch.equal(torch.signbit(dq[1]), torch.signbit(x[1]))
    assert codes[2] == 127 and dq[2, 0] == e.max  # amax / max = 1: scale 1, the largest element exact
    assert codes[3:6].tolist() == [127 + 4, 127 - 60, 127 + 100]
    assert codes[6] == 127 + 4 and dq[6, 0] == e.max * 2.0 ** 4  # the fp32-log2 sliver: saturates by < 2**-17
    assert codes[7] == 127 + 100 and codes[8] == 127 - 59 and codes[9] == 128
    assert codes[10] == 127 + 4
    assert codes[12] == 128  # FLOOR: 127, and the block's amax would saturate
    assert codes[14] == 0 and (dq[14] == 0).all()  # subnormals only: code 0, encoded by 1, flushed
    assert codes[15] == 0 and (dq[15] == 0).all()  # scale exactly 2**-127: still code 0 (NVIDIA's rule)
    assert codes[16] == 1 and codes[17] == 1 and dq[17, 0] == e.max * 2.0 ** -126
    # fp32's max: the scale rounds up, the element rounds up to 2**(emax + 1), and element * scale = 2**128
    # overflows fp32 (as torchao's dequantize does); FLOOR would have saturated it to a finite max * 2**(127 - emax)
    assert codes[18] == 127 + math.ceil(128 - math.log2(e.max)) and dq[18, 0] == math.inf
    assert codes[19] == 127 + 127 - e.emax and dq[19, 0] == 2.0 ** 127
    assert codes[21] == 254 and dq[21, 0] == math.inf and (dq[21][x[21].isfinite()] == 0).all()
    assert codes[22] == 254 and dq[22, 0] == -math.inf
    assert codes[23] == 255 and torch.isnan(q.elements[23].float()).all() and torch.isnan(dq[23]).all()
    assert dq[24, 0] == 1.0 and dq[24, 1] == 1 + 2 * 2.0 ** -e.mbits


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_rceil_scale_is_the_ceiling_up_to_fp32_log2(fmt):
    """RCEIL's exact code is ``127 + ceil(log2(amax / max))``. torchao takes log2 in fp32, which (faithfully
    rounded: error < 1 ulp, and an ulp of |k| < 128 is at most 2**-17) returns the integer k for quotients
    up to 2**k * (1 + 2**-17), so the code is the exact one or one less, and then ``amax / scale <= max *
    (1 + 2**-16)`` (the quotient's own rounding included): the largest element is never cut by more than
    a hair, far under half an element ulp (E4M3: 16 at 448)."""
    e = bf.MX_ELEMENTS[fmt]
    g = torch.Generator().manual_seed(5)
    k = torch.randint(-100, 100, (4096, 1), generator=g).float()
    amax = e.max * torch.exp2(k) * (1 + torch.randint(0, 1 << 12, (4096, 1), generator=g).float() * 2.0 ** -23)
    x = torch.cat([amax, torch.rand(4096, 31, generator=g) * amax], dim=1)
    code = bf.quantize_mx(x, fmt, scale_rounding="rceil").scales.view(torch.uint8).long().squeeze(1)
    exact = 127 + torch.ceil(torch.log2(amax.double().squeeze(1) / e.max)).long()
    assert ((code == exact) | (code == exact - 1)).all()
    assert (code == exact - 1).any()  # the sliver exists (else this test would not need its bound)
    ratio = amax.double().squeeze(1) / torch.exp2(code.double() - 127)
    assert (ratio <= e.max * (1 + 2.0 ** -16)).all()


def test_floor_saturates_on_gaussian_data_and_rceil_does_not():
    """FLOOR's scale is ``2**(floor(log2 amax) - emax)``, so a block's amax scales to ``m * 2**emax`` with m the
    binary mantissa of amax in [1, 2): it saturates (exceeds 448 = 1.75 * 2**8) exactly when m > 1.75. For a
    block of 32 N(0,1) values amax has CDF erf(a / sqrt 2)**32, so the saturating share is
    p = sum_k P(1.75 * 2**k < amax < 2**(k+1)) (about 0.169); the count over n blocks is asserted within 5
    binomial standard deviations of n p. RCEIL's scale is at least amax / 448 (up to the fp32-log2 hair of
    ``test_rceil_scale_is_the_ceiling_up_to_fp32_log2``): no block's largest element loses anything."""
    n = 4096
    x = torch.randn(n, 32, generator=torch.Generator().manual_seed(17))
    amax = x.abs().amax(dim=1)

    def share(lo: float, hi: float) -> float:
        return math.erf(hi / math.sqrt(2)) ** 32 - math.erf(lo / math.sqrt(2)) ** 32

    p = sum(share(1.75 * 2.0 ** k, 2.0 ** (k + 1)) for k in range(-40, 8))
    assert 0.1 < p < 0.25
    for rounding, expect_some in (("floor", True), ("rceil", False)):
        q = bf.quantize_mx(x, "e4m3", scale_rounding=rounding)
        scale = torch.exp2(q.scales.view(torch.uint8).double().squeeze(1) - 127)
        saturated = amax.double() / scale > bf.E4M3.max
        if expect_some:
            mantissa, _ = torch.frexp(amax)  # in [0.5, 1): m = 2 * mantissa
            assert torch.equal(saturated, 2 * mantissa > 1.75)
            assert abs(int(saturated.sum()) - n * p) <= 5 * math.sqrt(n * p * (1 - p)) and saturated.any()
            assert bf.fake_quantize(x, "mxfp8").abs().amax(dim=1).eq(bf.E4M3.max * scale.float()).any()
        else:
            assert not saturated.any()
            top = bf.fake_quantize(x, "mxfp8", scale_rounding="rceil").abs().amax(dim=1).double()
            v = amax.double() / scale  # in (224, 448]: E4M3's ulp there is 2**(7 - 3) = 16 or 32
            half_ulp = 0.5 * torch.exp2(torch.floor(torch.log2(v)) - bf.E4M3.mbits)
            assert ((top - amax.double()).abs() <= half_ulp * scale).all()


def test_rceil_block_stats():
    x = blocks_of([[1.0], [float("inf"), 1.0], [float("nan")], [1e-40], [448 * 2.0 ** -127], [0.0]], 32)
    stats = bf.block_stats(x, "mxfp8", scale_rounding="rceil")
    assert stats.scale_saturated == pytest.approx(2 / 6)  # the inf and the NaN block
    assert stats.scale_underflow == pytest.approx(2 / 6)  # the two non-zero code-0 blocks (the zero block not)
    # flushed: the 1.0s of the inf block (times 2**-127), the two code-0 blocks
    assert stats.flushed_to_zero == pytest.approx((16 + 32 + 32) / x.numel())
    fq, same = bf.fake_quantize_with_stats(x, "mxfp8", scale_rounding="rceil")
    assert same == stats and torch.isnan(fq[2]).all()


def test_scale_rounding_default_is_floor_and_a_bad_value_is_a_value_error():
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(2)) * 30
    for recipe in ("mxfp8", "mxfp8_e5m2", "nvfp4"):
        assert_bits_equal(bf.fake_quantize(x, recipe), bf.fake_quantize(x, recipe, scale_rounding="floor"))
    assert_bits_equal(bf.fake_quantize(x, "nvfp4"), bf.fake_quantize(x, "nvfp4", scale_rounding="rceil"))
    assert not torch.equal(bf.fake_quantize(x, "mxfp8"), bf.fake_quantize(x, "mxfp8", scale_rounding="rceil"))
    for call in (lambda: bf.quantize_mx(x, scale_rounding="ceil"),
                 lambda: bf.fake_quantize(x, "mxfp8", scale_rounding="RCEIL"),
                 lambda: bf.fake_quantize_with_stats(x, "nvfp4", scale_rounding="even")):
        with pytest.raises(ValueError, match="MX scale rounding must be one of"):
            call()


# ------------------------------------------------------------------------------------------ 2. NVFP4 16x16 weights
def spread_weight(seed: int, shape: tuple[int, int]) -> torch.Tensor:
    """Random values spanning ~2**16 within a block and ~2**24 across blocks: saturated, flushed and clamped scales."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-8, 9, shape, generator=g).float())
    return x * torch.exp2(torch.randint(-12, 13, (shape[0] // 16, 1), generator=g).float()).repeat_interleave(16, 0)


E2M1_VALUES = torch.tensor([s * v for v in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0) for s in (1, -1)])


@pytest.mark.parametrize("shape", [(16, 16), (32, 48), (64, 128)])
def test_nvfp4_2d_of_the_transpose_is_the_transpose(shape):
    """The forward GEMM reduces over the weight's columns, the data-gradient GEMM over its rows: both see one
    quantized weight, whichever dim is called the reduction dim."""
    w = spread_weight(len(shape) + shape[1], shape)
    fq = bf.fake_quantize_nvfp4_2d(w)
    assert fq.dtype == torch.float32 and fq.shape == w.shape
    assert_bits_equal(bf.fake_quantize_nvfp4_2d(w.t()), fq.t())
    assert_bits_equal(bf.fake_quantize_nvfp4_2d(w.t().contiguous()), fq.t())
    assert_bits_equal(bf.fake_quantize_nvfp4_2d(w.bfloat16()), bf.fake_quantize_nvfp4_2d(w.bfloat16().float()))
    amax = torch.tensor(3.0 * w.abs().max().item())
    assert_bits_equal(bf.fake_quantize_nvfp4_2d(w.t(), amax), bf.fake_quantize_nvfp4_2d(w, amax).t())
    if shape[0] > 16:  # the 1x16 blocks along either dim do not give one weight: what 2D blocks are for
        assert not torch.equal(bf.fake_quantize(w, "nvfp4", dim=1), bf.fake_quantize(w, "nvfp4", dim=0))


def test_nvfp4_2d_has_one_e4m3_scale_per_16x16_block():
    """Each 16x16 block's values are E2M1 values times one decode scale, ``pts * s``, where ``s`` is the block's
    amax / 6 / pts, clamped to [2**-6, 448] and rounded to E4M3 (here by torch's float8 cast, not our code),
    and every element is its E2M1 round-to-nearest at that scale (within half an E2M1 ulp, or saturated)."""
    w = spread_weight(3, (64, 96))
    fq = bf.fake_quantize_nvfp4_2d(w)
    tiles = w.reshape(4, 16, 6, 16).transpose(1, 2).reshape(4, 6, 256)
    pts = w.abs().max() / (448 * 6)
    s = torch.clamp(tiles.abs().amax(-1) / 6 / pts, 2.0 ** -6, 448).to(torch.float8_e4m3fn).float()
    decode = (pts * s)[:, :, None, None].expand(4, 6, 16, 16).transpose(1, 2).reshape(64, 96)
    grid = torch.copysign(E2M1_VALUES[(fq[..., None] / decode[..., None] - E2M1_VALUES).abs().argmin(-1)], fq)
    assert_bits_equal(fq, grid * decode)  # one scale per block: every value is an E2M1 value times it
    v = w.abs() / decode
    half_ulp = torch.where(v < 2, 0.25, torch.where(v < 4, 0.5, 1.0))
    rounding = 4 * 2.0 ** -24 * (w.abs() + 6 * decode)  # the reciprocal encode, as tests/test_block_formats.py
    inside = v <= 6
    assert ((w - fq).abs()[inside] <= (half_ulp * decode + rounding)[inside]).all()
    assert ((fq.abs() - 6 * decode).abs()[~inside] <= rounding[~inside]).all()
    assert (s.unique().numel() > 10) and inside.float().mean() > 0.99


def test_nvfp4_2d_equals_1d_when_the_rows_of_each_block_are_equal():
    """A reference built from the 1-D quantizer: where all 16 rows of a block are equal, the 16x16 block's amax is
    each row's 1x16 block amax, so both give the same scales and elements, bit for bit."""
    base = spread_weight(8, (16, 128))[::4]  # 4 distinct rows
    w = base.repeat_interleave(16, dim=0)  # (64, 128): rows 16i..16i+15 equal
    assert_bits_equal(bf.fake_quantize_nvfp4_2d(w), bf.fake_quantize(w, "nvfp4", dim=1))
    amax = torch.tensor(7.0 * w.abs().max().item())
    assert_bits_equal(bf.fake_quantize_nvfp4_2d(w, amax), bf.fake_quantize(w, "nvfp4", dim=1, amax=amax))
    assert_bits_equal(bf.fake_quantize_nvfp4_2d(w.t()), bf.fake_quantize(w.t(), "nvfp4", dim=0))
    w[5, 3] = 4 * w[:16, :16].abs().max()  # one row differs: the block's shared scale follows it, the 1-D rows' do not
    assert not torch.equal(bf.fake_quantize_nvfp4_2d(w), bf.fake_quantize(w, "nvfp4", dim=1))


def test_nvfp4_2d_tp_shards_with_the_whole_amax_equal_the_whole_weight():
    """A column- or row-parallel shard whose dims are multiples of 16 holds whole blocks: with the whole weight's
    amax its quantization is its slice of the whole one (TP=2 equals TP=1)."""
    w = spread_weight(11, (64, 96))
    whole, amax = bf.fake_quantize_nvfp4_2d(w), w.abs().amax()
    assert_bits_equal(torch.cat([bf.fake_quantize_nvfp4_2d(w[:32], amax), bf.fake_quantize_nvfp4_2d(w[32:], amax)]),
                      whole)
    assert_bits_equal(torch.cat([bf.fake_quantize_nvfp4_2d(w[:, :48], amax),
                                 bf.fake_quantize_nvfp4_2d(w[:, 48:], amax)], dim=1), whole)


def test_nvfp4_2d_stats():
    w = torch.zeros(32, 32)
    w[:16, :16] = 6.0  # the tensor's amax: block scale 448
    w[16:, :16] = 1e-9  # a tiny block: its scale clamps up to 2**-6, every element flushes
    w[:16, 16:] = torch.tensor([6.0, 0.1] * 8)  # 0.1 flushes at decode scale 1
    fq, stats = bf.fake_quantize_nvfp4_2d_with_stats(w)
    assert_bits_equal(fq, bf.fake_quantize_nvfp4_2d(w))
    assert stats.scale_saturated == 0 and stats.scale_underflow == 1 / 4
    assert stats.flushed_to_zero == (256 + 128) / 1024
    w[0, 0] = float("nan")
    assert bf.fake_quantize_nvfp4_2d_with_stats(w)[1].scale_saturated == 1  # the per-tensor scale is NaN


@pytest.mark.parametrize("shape", [(24, 32), (32, 8), (32,), (2, 16, 16)])
def test_nvfp4_2d_needs_a_2d_tensor_of_multiples_of_16(shape):
    with pytest.raises(ValueError, match=f"multiples of 16, got shape {tuple(shape)}".replace("(", r"\(").replace(")", r"\)")):
        bf.fake_quantize_nvfp4_2d(torch.zeros(shape))


# ------------------------------------------------------------------------------------------ 3. stochastic rounding
MX_RECIPE = {"e4m3": "mxfp8", "e5m2": "mxfp8_e5m2"}


def grid_values(fmt: str) -> torch.Tensor:
    """Every finite value of an element format, sorted (fp64), enumerated from torch's dtypes, not our code."""
    if fmt == "e2m1":
        return torch.tensor(sorted({s * v for v in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0) for s in (1, -1)}),
                            dtype=torch.float64)
    dtype = bf.MX_ELEMENTS[fmt].dtype
    assert dtype is not None
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).double()
    return values[torch.isfinite(values)].unique()


def neighbours(v: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest grid value <= v and the smallest >= v (v inside the grid's range, fp64)."""
    grid = grid_values(fmt)
    hi = torch.searchsorted(grid, v, right=False).clamp(max=len(grid) - 1)
    lo = (torch.searchsorted(grid, v, right=True) - 1).clamp(min=0)
    return grid[lo], grid[hi]


def anchored(values: list[float], anchor: float, block: int, rows: int) -> torch.Tensor:
    """``rows`` copies of blocks holding ``anchor`` (which fixes the block scale at 1) and then the test values."""
    per_block = block - 1
    assert len(values) <= per_block
    row = [anchor] + (values * per_block)[:per_block]
    return torch.tensor([row] * rows, dtype=torch.float32)


SR_CASES = [
    # (recipe, element format, anchor giving scale 1, values: between neighbours, subnormal steps, on the grid)
    ("nvfp4", "e2m1", 6.0, [0.2, -0.3, 1.3, 1.75, -2.9, 4.5, 5.99, 3.0, -0.01, -6.0]),
    ("mxfp8", "e4m3", 448.0, [1.03, -0.0123, 300.0, 447.0, 0.001, 2.0 ** -10, -5.3, 416.0]),
    ("mxfp8_e5m2", "e5m2", 57344.0, [1.1, -50000.0, 3e-6, 0.3, -7.7, 2.0 ** -16]),
]


@pytest.mark.parametrize("scale_rounding", ["floor", "rceil"])
@pytest.mark.parametrize("recipe,fmt,anchor,values", SR_CASES)
def test_stochastic_rounding_is_unbiased(recipe, fmt, anchor, values, scale_rounding):
    """With the block scale fixed at 1 (an anchor at the element maximum; NVFP4 with the amax 6 * 448, so the
    per-tensor scale is 1), an element v between grid neighbours lo < hi rounds up with probability
    p = (v - lo) / (hi - lo): each draw is lo + (hi - lo) * Bernoulli(p), so the mean of n draws has standard
    deviation (hi - lo) * sqrt(p (1 - p) / n). The mean is asserted within 5 of them (and exactly v where p is
    0, on the grid)."""
    block = 16 if recipe == "nvfp4" else 32
    x = anchored(values, anchor, block, rows=4000)
    amax = torch.tensor(6.0 * 448) if recipe == "nvfp4" else None
    g = torch.Generator().manual_seed(1234)
    fq = bf.fake_quantize(x, recipe, amax=amax, scale_rounding=scale_rounding, generator=g).double()
    assert (fq[:, 0] == anchor).all()
    top = float(grid_values(fmt).max())
    for j, v in enumerate(values):
        draws = fq[:, 1:][:, [k for k in range(block - 1) if k % len(values) == j]].flatten()
        v32 = torch.tensor(v, dtype=torch.float32).double().clamp(-top, top)
        lo, hi = neighbours(v32, fmt)
        n = draws.numel()
        if lo == hi:
            assert (draws == v32).all(), (v, draws.unique())
            continue
        p = float((v32 - lo) / (hi - lo))
        sd = float(hi - lo) * math.sqrt(p * (1 - p) / n)
        assert abs(float(draws.mean()) - float(v32)) <= 5 * sd, (v, float(draws.mean()), 5 * sd)
        assert ((draws == lo) | (draws == hi)).all()


@pytest.mark.parametrize("recipe,fmt", [("mxfp8", "e4m3"), ("mxfp8_e5m2", "e5m2")])
@pytest.mark.parametrize("scale_rounding", ["floor", "rceil"])
def test_stochastic_rounding_never_passes_a_neighbour(recipe, fmt, scale_rounding):
    """On data spanning many binades (saturation, subnormals and flushes included) every element lands on one
    of the two grid values around its scaled value (power-of-two MX scales make scaled values exact), with the
    sign of round-to-nearest (zeros included); the scales are round-to-nearest's."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(64, 256, generator=g) * torch.exp2(torch.randint(-14, 15, (64, 256), generator=g).float())
    rtn = bf.quantize_mx(x, fmt, scale_rounding=scale_rounding)
    sr = bf.quantize_mx(x, fmt, scale_rounding=scale_rounding, generator=torch.Generator().manual_seed(3))
    assert_bits_equal(sr.scales, rtn.scales)
    scale = torch.exp2(rtn.scales.view(torch.uint8).double() - 127).repeat_interleave(32, dim=-1)
    top = float(grid_values(fmt).max())
    v = (x.double() / scale).clamp(-top, top)
    lo, hi = neighbours(v, fmt)
    got = sr.elements.double()
    assert ((got == lo) | (got == hi)).all()
    assert torch.equal(torch.signbit(got), torch.signbit(rtn.elements.double()))
    assert (got != rtn.elements.double()).float().mean() > 0.05  # it is not round-to-nearest
    assert_bits_equal(bf.dequantize(sr), bf.fake_quantize(x, recipe, scale_rounding=scale_rounding,
                                                         generator=torch.Generator().manual_seed(3)))


def e2m1_values(q: bf.NVFP4Quantized) -> torch.Tensor:
    """The E2M1 element values of an NVFP4 tensor (its scales replaced by 1)."""
    ones = torch.ones_like(q.scales, dtype=torch.float32).to(torch.float8_e4m3fn)
    return bf.dequantize(dataclasses.replace(q, scales=ones, per_tensor_scale=torch.tensor(1.0)))


def test_stochastic_rounding_nvfp4_neighbours_and_scales():
    """The per-tensor scale 2**-8 and an anchor 6.3 in every block give every block the scale 6.3 / 6 * 256 =
    268.8, rounded to E4M3's 256, so the element encode factor (1 / pts) / 256 is exactly 1: the scaled values
    are the inputs, those past 6 saturated."""
    g = torch.Generator().manual_seed(21)
    x = torch.rand(512, 16, generator=g) * 12.6 - 6.3
    x[:, 0] = 6.3
    x[::7, 1:] *= 2.0 ** -6  # some blocks of small values beside the anchor
    pts = torch.tensor(2.0 ** -8)
    sr = bf.quantize_nvfp4(x, per_tensor_scale=pts, generator=g)
    rtn = bf.quantize_nvfp4(x, per_tensor_scale=pts)
    assert_bits_equal(sr.scales, rtn.scales)
    assert (sr.scales.float() == 256).all()
    got, nearest = e2m1_values(sr).double(), e2m1_values(rtn).double()
    lo, hi = neighbours(x.double().clamp(-6, 6), "e2m1")
    assert ((got == lo) | (got == hi)).all()
    assert torch.equal(torch.signbit(got), torch.signbit(nearest))
    assert (got != nearest).float().mean() > 0.05 and (x.abs() > 6).float().mean() > 0.03


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8_e5m2", "nvfp4"])
def test_stochastic_rounding_repeats_with_the_generator_state(recipe):
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(4)) * 5
    a = bf.fake_quantize(x, recipe, dim=0, generator=torch.Generator().manual_seed(7))
    b = bf.fake_quantize(x, recipe, dim=0, generator=torch.Generator().manual_seed(7))
    assert_bits_equal(a, b)
    g = torch.Generator().manual_seed(7)
    state = g.get_state()
    first, second = bf.fake_quantize(x, recipe, dim=0, generator=g), bf.fake_quantize(x, recipe, dim=0, generator=g)
    assert_bits_equal(first, a) and not torch.equal(first, second)  # the generator advances
    g.set_state(state)
    assert_bits_equal(bf.fake_quantize_with_stats(x, recipe, dim=0, generator=g)[0], a)
    assert not torch.equal(a, bf.fake_quantize(x, recipe, dim=0, generator=torch.Generator().manual_seed(8)))


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8_e5m2", "nvfp4"])
def test_without_a_generator_rounding_is_to_nearest_as_before(recipe):
    """``generator=None`` is the round-to-nearest path that tests/test_block_formats.py holds to torchao bit for bit."""
    x = spread_weight(6, (64, 96))
    fmt = {"mxfp8": "e4m3", "mxfp8_e5m2": "e5m2"}.get(recipe)
    stored = bf.quantize_nvfp4(x) if fmt is None else bf.quantize_mx(x, fmt)
    assert_bits_equal(bf.fake_quantize(x, recipe, generator=None), bf.dequantize(stored))
    stored_none = bf.quantize_nvfp4(x, generator=None) if fmt is None else bf.quantize_mx(x, fmt, generator=None)
    assert_bits_equal(bf.dequantize(stored_none), bf.dequantize(stored))
    assert_bits_equal(bf.round_to_grid(x, bf.E4M3, None), bf.round_to_grid(x, bf.E4M3))


# ------------------------------------------------------------------------------------------ 4. random Hadamard transform
U64 = 2.0 ** -53  # fp64's unit roundoff


def gamma(k: int) -> float:
    """Higham's gamma_k = k u / (1 - k u): the relative bound of k roundings in a row (a sum of k + 1 terms)."""
    return k * U64 / (1 - k * U64)


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16, 32, 64])
def test_hadamard_matrix_is_orthonormal_sylvester(n):
    """Q^T Q = I for Q = H diag(s), in fp64. For n a power of 4 the entries are +-2**-k exactly and so is every
    product and sum: Q^T Q is the identity exactly; otherwise 1/sqrt(n) carries one fp32 rounding (2**-24
    relative), so Q^T Q is within n * 2 * 2**-24 of it."""
    h = hadamard.hadamard_matrix(n)
    assert h.dtype == torch.float32 and h.shape == (n, n) and torch.equal(h, h.t())
    i = torch.arange(n)
    popcount = torch.tensor([[bin(int(a) & int(b)).count("1") for b in i] for a in i])
    assert torch.equal(torch.sign(h), (1 - 2 * (popcount % 2)).float())  # Sylvester's sign pattern
    q = h.double() @ torch.diag(hadamard.random_signs(n, n).double())
    if math.log(n, 4).is_integer():
        assert torch.equal(q.t() @ q, torch.eye(n, dtype=torch.float64))
    else:
        assert ((q.t() @ q - torch.eye(n, dtype=torch.float64)).abs() <= n * 2 * 2.0 ** -24).all()


def test_random_signs_are_plus_minus_one_and_follow_the_seed():
    s = hadamard.random_signs(3)
    assert s.dtype == torch.float32 and s.shape == (16,) and set(s.tolist()) == {1.0, -1.0}
    assert torch.equal(s, hadamard.random_signs(3)) and not torch.equal(s, hadamard.random_signs(4))
    assert hadamard.random_signs(3, 64).shape == (64,)


def rht_bound(g: torch.Tensor, x: torch.Tensor, n: int) -> torch.Tensor:
    """|fl(rht(g)^T rht(x)) - fl(g^T x)| elementwise, from the arithmetic in fp64 (n a power of 4: Q's entries
    and the final 1/sqrt(n) exact). Each transformed element is a depth-log2(n) tree of +-sums of its block's n
    elements, so it is within gamma_{log2 n} * a of exact, with a = (1/sqrt n) sum_block |.| (a >= |exact|).
    The GEMM over T terms adds gamma_T |~g|^T |~x|, with |~.| <= (1 + gamma_{log2 n}) a. The exact transformed
    product equals g^T x (Q^T Q = I exactly), whose fp64 GEMM is within gamma_T |g|^T |x|."""
    k, t = int(math.log2(n)), g.shape[0]

    def a(m: torch.Tensor) -> torch.Tensor:
        return (m.abs().reshape(t // n, n, -1).sum(1, keepdim=True) / math.sqrt(n)).expand(-1, n, -1).reshape(t, -1)

    ag, ax = a(g), a(x)
    first = (gamma(t) * (1 + gamma(k)) ** 2 + 2 * gamma(k) + gamma(k) ** 2) * (ag.t() @ ax)
    return (first + gamma(t) * (g.abs().t() @ x.abs())) * (1 + 1e-9)  # the bound's own fp64 evaluation


@pytest.mark.parametrize("n,tokens", [(16, 16), (16, 256), (4, 64), (64, 128)])
def test_rht_of_both_wgrad_operands_leaves_the_product_unchanged(n, tokens):
    """g [T, out], x [T, in], transformed along the tokens: rht(g).T @ rht(x) equals g.T @ x to fp64 rounding
    (``rht_bound``); with another sign vector for one operand it does not, by many orders of magnitude."""
    gen = torch.Generator().manual_seed(n + tokens)
    g = torch.randn(tokens, 24, generator=gen, dtype=torch.float64)
    x = torch.randn(tokens, 40, generator=gen, dtype=torch.float64) * torch.exp2(
        torch.randint(-6, 7, (tokens, 40), generator=gen).double())  # outliers
    s, other = hadamard.random_signs(1, n), hadamard.random_signs(2, n)
    assert not torch.equal(s, other)
    plain, bound = g.t() @ x, rht_bound(g, x, n)
    gq, xq = hadamard.rht(g, s, 0), hadamard.rht(x, s, 0)
    assert gq.dtype == torch.float64 and gq.shape == g.shape
    assert ((gq.t() @ xq - plain).abs() <= bound).all()
    assert ((gq.t() @ hadamard.rht(x, other, 0) - plain).abs() > 1e6 * bound).any()
    assert not torch.allclose(gq, g)  # the transform did something


def test_rht_is_h_diag_s_on_each_block():
    """The butterflies against the explicit matrix: block b of the output is Q applied to block b of the input."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(48, 5, generator=gen, dtype=torch.float64)
    s = hadamard.random_signs(7)
    q = hadamard.hadamard_matrix(16).double() @ torch.diag(s.double())
    expected = torch.cat([q @ x[16 * b:16 * (b + 1)] for b in range(3)])
    assert torch.allclose(hadamard.rht(x, s, 0), expected, rtol=0, atol=1e-14)
    assert torch.equal(hadamard.rht(x.t(), s, 1), hadamard.rht(x, s, 0).t())
    assert torch.equal(hadamard.rht(x.reshape(3, 16, 5), s, -2).reshape(48, 5), hadamard.rht(x, s, 0))


def test_rht_dtype_and_shards():
    """In the input's dtype promoted to fp32; a shard of the other dims (tensor parallelism shards the features,
    the blocks lie along the tokens) transforms to the slice of the whole, bit for bit."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 96, generator=gen)
    s = hadamard.random_signs(0)
    assert hadamard.rht(x.bfloat16(), s, 0).dtype == torch.float32
    assert hadamard.rht(x.half(), s, 0).dtype == torch.float32
    assert hadamard.rht(x, s, 0).dtype == torch.float32 and hadamard.rht(x.double(), s, 0).dtype == torch.float64
    assert torch.equal(hadamard.rht(x.bfloat16(), s, 0), hadamard.rht(x.bfloat16().float(), s, 0))
    whole = hadamard.rht(x, s, 0)
    assert torch.equal(torch.cat([hadamard.rht(x[:, :48], s, 0), hadamard.rht(x[:, 48:], s, 0)], dim=1), whole)
    assert torch.equal(hadamard.rht(x[:, 5:6], s, 0), whole[:, 5:6])


def test_rht_spreads_a_block_outlier():
    """Why the recipe uses it: a block of one outlier among small values has amax / rms = sqrt(16) = 4; after the
    transform every element is +-outlier / 4 (give or take the small values), amax / rms = 1."""
    x = torch.full((16, 1), 1e-3, dtype=torch.float64)
    x[3] = 100.0
    y = hadamard.rht(x, hadamard.random_signs(0), 0)
    assert y.abs().max() < 100.0 / 4 + 1e-2 and y.abs().min() > 100.0 / 4 - 1e-2


def test_rht_checks_its_arguments():
    s = hadamard.random_signs(0)
    with pytest.raises(ValueError, match="the Hadamard block 16 does not divide size 40 of dim 0"):
        hadamard.rht(torch.zeros(40, 8), s, 0)
    with pytest.raises(ValueError, match="does not divide size 24 of dim 1"):
        hadamard.rht(torch.zeros(32, 24), s, -1)
    with pytest.raises(ValueError, match="must be a power of two"):
        hadamard.rht(torch.zeros(24, 8), torch.ones(12), 0)
    with pytest.raises(ValueError, match="must be a power of two"):
        hadamard.hadamard_matrix(12)
    with pytest.raises(ValueError, match="signs must be a vector"):
        hadamard.rht(torch.zeros(16, 16), torch.ones(4, 4), 0)
