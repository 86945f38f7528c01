"""The block-format quantizers (MXFP8, NVFP4) against an independent implementation and against the spec.

- Bit for bit against torchao's reference quantizers (``torchao.prototype.mx_formats``: ``to_mx`` with its
  default FLOOR scale, ``MXTensor``, ``NVFP4Tensor`` with ``per_tensor_amax_to_scale``): elements, scales
  and dequantized values, on random tensors of several shapes and magnitudes and on the edges. Skipped
  when torchao is absent.
- Where torchao leaves a case undefined or departs from the spec, the spec's behaviour is asserted and the
  test says so: an MX block whose scale clamps to 2**-127 (torchao divides by 2**-126 there), an all-zero
  tensor in NVFP4 (torchao's per-tensor scale 0 gives NaN), the E2M1 codes of a NaN block (E2M1 has no NaN).
- The round trip's error bound, independent of torchao: every element is within half an element-format
  ulp at its block's scale, or saturated to the format's largest value.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from tessera.parallel import block_formats as bf

SHAPES = [(4, 32), (3, 5, 64), (64, 256)]
MAGNITUDES = [1e-30, 1e-3, 1.0, 1e3, 1e30]


# ------------------------------------------------------------------------------------------ helpers
@pytest.fixture(scope="module")
def ao():
    """torchao's reference quantizers (its prototype API), or a clean skip without torchao."""
    pytest.importorskip("torchao")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.prototype.mx_formats import mx_tensor, nvfp4_tensor
    return mx_tensor, nvfp4_tensor


def assert_bits_equal(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Same dtype and shape, NaN at the same places and the same bit pattern everywhere else (signed zeros too)."""
    assert ours.dtype == ref.dtype and ours.shape == ref.shape, (ours.dtype, ref.dtype, ours.shape, ref.shape)
    nan = torch.isnan(ours.float()) if ours.is_floating_point() else torch.zeros_like(ours, dtype=torch.bool)
    assert torch.equal(nan, torch.isnan(ref.float()) if ref.is_floating_point() else nan)
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[ours.element_size()]
    a, b = ours.view(bits)[~nan], ref.view(bits)[~nan]
    assert torch.equal(a, b), f"{int((a != b).sum())} of {a.numel()} differ; first: {ours[~nan][a != b][:4]} vs {ref[~nan][a != b][:4]}"


def ao_mx(ao, x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torchao's (scales, elements, dequantized) of ``x`` blocked along its last dim, FLOOR scales."""
    mx_tensor, _ = ao
    dtype = bf.MX_ELEMENTS[fmt].dtype
    scales, elements = mx_tensor.to_mx(x, dtype, 32)
    dq = mx_tensor.MXTensor.to_mx(x, dtype, 32).dequantize(torch.float32)
    return scales, elements, dq


def check_mx_against_torchao(ao, x: torch.Tensor, fmt: str) -> None:
    ours = bf.quantize_mx(x, fmt)
    scales, elements, dq = ao_mx(ao, x, fmt)
    assert_bits_equal(ours.scales, scales)
    assert_bits_equal(ours.elements, elements)
    assert_bits_equal(bf.dequantize(ours), dq)


def ao_nvfp4(ao, x: torch.Tensor, per_tensor_scale: torch.Tensor | None = None):
    """torchao's NVFP4Tensor of ``x`` with the per-tensor scale of its amax (or the one given)."""
    _, nvfp4_tensor = ao
    pts = nvfp4_tensor.per_tensor_amax_to_scale(x.abs().amax()) if per_tensor_scale is None else per_tensor_scale
    return nvfp4_tensor.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=pts)


def check_nvfp4_against_torchao(ao, x: torch.Tensor, per_tensor_scale: torch.Tensor | None = None) -> None:
    ours = bf.quantize_nvfp4(x, per_tensor_scale=per_tensor_scale)
    ref = ao_nvfp4(ao, x, per_tensor_scale)
    assert_bits_equal(ours.per_tensor_scale, ref.per_tensor_scale.float().reshape(()))
    assert_bits_equal(ours.scales, ref.scale)
    assert_bits_equal(ours.elements, ref.qdata.view(torch.uint8))
    assert_bits_equal(bf.dequantize(ours), ref.dequantize(torch.float32))


def blocks_of(rows: list[list[float]], block: int) -> torch.Tensor:
    """One block per row, each row padded to ``block`` by repeating its values."""
    out = torch.tensor([(r * block)[:block] for r in rows], dtype=torch.float32)
    assert out.shape == (len(rows), block)
    return out


def mx_edge_blocks(fmt: str) -> torch.Tensor:
    """One 32-element block per edge case of the MX spec."""
    e = bf.MX_ELEMENTS[fmt]
    top = e.max
    f32_max = torch.finfo(torch.float32).max
    rows = [
        [0.0],                                            # an all-zero block: scale 2**-127, zeros
        [0.0, -0.0, 1.0, -1.0],                           # zeros and signed zeros beside normals
        [2.0 ** e.emax, 2.0 ** (e.emin - 1), 2.0 ** (e.emin - e.mbits), 5 * 2.0 ** (e.emin - e.mbits)],  # scale 1: element subnormals
        [1.0, 1e-40, -1e-42, 2.0 ** -130],                # fp32 subnormals beside a normal amax: flushed
        [2.0 ** 5, -1.0, 0.5],                            # amax a power of two
        [-(2.0 ** -3), 0.1, 0.01],                        # negative power-of-two amax
        [2.0 ** 5 - 2.0 ** -19, 1.0],                     # amax one fp32 step below a power of two
        [top * 2.0 ** -4, 1.0, -3.0],                     # the amax lands on the element maximum
        [2.0 ** (e.emax + 1) - 1, top, top + 1, -(2.0 ** e.emax) * 1.9],  # FLOOR: amax above the element max saturates
        [f32_max, -f32_max / 3, 1.0],                     # the largest finite fp32
        [float("inf"), 1.0, -2.0],                        # inf: read as exponent 128, it saturates
        [float("-inf"), 0.5],
        [float("nan"), 1.0, -2.0],                        # NaN: scale code 255
        [1 + 2.0 ** -(e.mbits + 1), 1 + 3 * 2.0 ** -(e.mbits + 1), 2.0 ** e.emax],  # ties: to even
        [-(1 + 2.0 ** -(e.mbits + 1)), 2.5 * 2.0 ** (e.emin - e.mbits), 2.0 ** e.emax],  # ties below normal
    ]
    return blocks_of(rows, 32)


# ------------------------------------------------------------------------------------------ MX vs torchao
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("shape", SHAPES)
def test_mx_random_tensors_equal_torchao_bit_for_bit(ao, fmt, shape):
    g = torch.Generator().manual_seed(sum(shape) + len(fmt))
    for magnitude in MAGNITUDES:
        x = torch.randn(shape, generator=g) * magnitude
        x = x * torch.exp2(torch.randint(-8, 9, shape, generator=g).float())  # a spread inside each block
        check_mx_against_torchao(ao, x, fmt)
        check_mx_against_torchao(ao, x.bfloat16(), fmt)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_mx_edges_equal_torchao_bit_for_bit(ao, fmt):
    check_mx_against_torchao(ao, mx_edge_blocks(fmt), fmt)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_mx_edge_cases_follow_the_spec(fmt):
    """The edges read against the spec's rules, not only against torchao."""
    e = bf.MX_ELEMENTS[fmt]
    x = mx_edge_blocks(fmt)
    q = bf.quantize_mx(x, fmt)
    codes, dq = q.scales.view(torch.uint8).long(), bf.dequantize(q)
    assert codes[0] == 0 and torch.equal(dq[0], x[0])  # all-zero block: the smallest scale, exact zeros
    assert torch.equal(torch.signbit(dq[1]), torch.signbit(x[1]))
    assert codes[2] == 127 and torch.equal(dq[2], x[2])  # element subnormals on the grid are exact
    assert (dq[3][x[3] != 1.0] == 0).all() and torch.equal(torch.signbit(dq[3]), torch.signbit(x[3]))  # flushed
    assert codes[4] == 127 + 5 - e.emax and dq[4, 0] == 2.0 ** 5  # scale = 2**(floor(log2 amax) - emax)
    assert codes[6] == 127 + 4 - e.emax  # just below 2**5: floor(log2) is 4
    assert codes[8] == 127 and dq[8, 0].abs() == e.max and dq[8, 2] == e.max  # saturated to the element max
    assert torch.isfinite(dq[9]).all() and dq[9, 0] == e.max * 2.0 ** (127 - e.emax)  # fp32 max saturates
    # inf: scale 2**(128 - emax), the element saturates, and max * scale overflows fp32 back to inf
    assert codes[10] == 127 + 128 - e.emax and dq[10, 0] == math.inf and dq[10, 1] == 0
    assert dq[11, 0] == -math.inf
    assert codes[12] == 255 and torch.isnan(dq[12]).all()  # a NaN makes the whole block NaN
    assert dq[13, 0] == 1.0 and dq[13, 1] == 1 + 2 * 2.0 ** -e.mbits  # ties round to the even neighbour
    assert dq[14, 0] == -1.0 and dq[14, 1] == 2 * 2.0 ** (e.emin - e.mbits)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_mx_scale_clamped_to_two_to_the_minus_127_divides_by_it(ao, fmt):
    """Spec, not torchao: blocks of amax below 2**(emax - 127) take the scale 2**-127 and are divided by it.

    torchao's ``to_mx`` divides such blocks by 2**-126 (a Triton subnormal workaround, in its comments) and
    its dequantize multiplies by 2**-127, a factor 2 off; only the scale codes are compared with it here.
    """
    e = bf.MX_ELEMENTS[fmt]
    x = blocks_of([[2.0 ** -125, -(2.0 ** -127), 3e-39, 1e-45], [2.0 ** (e.emax - 128), 2.0 ** -140]], 32)
    q = bf.quantize_mx(x, fmt)
    assert (q.scales.view(torch.uint8) == 0).all()
    assert torch.equal(q.elements.float(), bf.round_to_grid(x * 2.0 ** 127, e))
    assert torch.equal(bf.dequantize(q), bf.round_to_grid(x * 2.0 ** 127, e) * 2.0 ** -127)
    assert bf.dequantize(q)[0, 0] == 2.0 ** -125
    scales, _, _ = ao_mx(ao, x, fmt)
    assert_bits_equal(q.scales, scales)


@pytest.mark.parametrize("dim", [0, 1, -3])
def test_mx_along_any_dim_equals_the_last_dim_of_the_moved_tensor(ao, dim):
    x = torch.randn(32, 64, 4, generator=torch.Generator().manual_seed(dim % 3))
    q = bf.quantize_mx(x, "e4m3", dim=dim)
    moved = x.movedim(dim, -1).contiguous()
    scales, elements, dq = ao_mx(ao, moved, "e4m3")
    assert q.dim == dim % 3 and q.scales.shape[dim] == x.shape[dim] // 32
    assert_bits_equal(q.scales.movedim(dim, -1), scales)
    assert_bits_equal(q.elements.movedim(dim, -1), elements)
    assert_bits_equal(bf.dequantize(q).movedim(dim, -1), dq)


# ------------------------------------------------------------------------------------------ NVFP4 vs torchao
@pytest.mark.parametrize("shape", SHAPES)
def test_nvfp4_random_tensors_equal_torchao_bit_for_bit(ao, shape):
    g = torch.Generator().manual_seed(sum(shape))
    for magnitude in MAGNITUDES:
        x = torch.randn(shape, generator=g) * magnitude
        x = x * torch.exp2(torch.randint(-12, 13, shape, generator=g).float())
        check_nvfp4_against_torchao(ao, x)
        check_nvfp4_against_torchao(ao, x.bfloat16())
        check_nvfp4_against_torchao(ao, x, torch.tensor(0.37 * magnitude))  # a calibrated scale


def nvfp4_edge_blocks() -> torch.Tensor:
    rows = [
        [0.0],                                    # an all-zero block beside others: the smallest E4M3 scale
        [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, -5.0, -0.0],  # ties of E2M1 at block scale 1
        [6.0, 0.1, 1e-40, -1e-3, 0.24],           # flushed to zero, fp32 subnormals
        [2.0 ** 3, 1.0, -0.5],                    # amax a power of two
        [-(2.0 ** 12), 3.0, 7.0],                 # the tensor's amax: block scale 448
        [1e-6, -3e-7],                            # a tiny block: its scale clamps up to E4M3's smallest normal
        [torch.finfo(torch.float32).max / 2**20, 1.0],  # large but finite
    ]
    return blocks_of(rows, 16)


def test_nvfp4_edges_equal_torchao_bit_for_bit(ao):
    x = nvfp4_edge_blocks()
    check_nvfp4_against_torchao(ao, x)
    check_nvfp4_against_torchao(ao, x, torch.tensor(1.0))  # block scale 1 for row 1: the ties land exactly
    check_nvfp4_against_torchao(ao, x, torch.tensor(1e-3))  # block scales saturate at 448


def test_nvfp4_ties_round_to_even_and_saturate():
    x = nvfp4_edge_blocks()
    dq = bf.dequantize(bf.quantize_nvfp4(x, per_tensor_scale=torch.tensor(1.0)))
    assert dq[1, :12].tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -2.0, -4.0, -0.0]
    assert torch.equal(torch.signbit(dq[1, :12]), torch.signbit(x[1, :12]))
    assert dq[4, 0] == -6.0 * 448 and dq[4, 1] == 0  # the scale 4096 / 6 clamps to 448: 4096 saturates
    assert bf.quantize_nvfp4(x, per_tensor_scale=torch.tensor(1.0)).scales.float()[4] == 448.0


def test_nvfp4_inf_and_nan(ao):
    """With the tensor's own per-tensor scale, an inf or NaN makes it inf or NaN: every value is NaN, as in
    torchao. With a calibrated scale, an inf saturates its block and a NaN makes its block's scale NaN;
    E2M1 has no NaN, so the codes of a NaN block are compared on the spec's terms (any code: the scale decides)."""
    x = nvfp4_edge_blocks()
    x[3, 1], x[5, 0] = float("inf"), float("nan")
    for pts in (None, torch.tensor(1.0)):
        ours = bf.quantize_nvfp4(x, per_tensor_scale=pts)
        ref = ao_nvfp4(ao, x, pts)
        assert_bits_equal(bf.dequantize(ours), ref.dequantize(torch.float32))
        assert torch.equal(torch.isnan(ours.scales.float()), torch.isnan(ref.scale.float()))
        finite_blocks = ~torch.isnan(ours.scales.float()).repeat_interleave(8, dim=-1)
        assert_bits_equal(ours.elements[finite_blocks], ref.qdata.view(torch.uint8)[finite_blocks])
    dq = bf.dequantize(bf.quantize_nvfp4(x, per_tensor_scale=torch.tensor(1.0)))
    assert dq[3, 1] == 6.0 * 448 and torch.isnan(dq[5]).all() and torch.isfinite(dq[torch.arange(7) != 5]).all()
    assert torch.isnan(bf.dequantize(bf.quantize_nvfp4(x))).all()


def test_nvfp4_all_zero_tensor_quantizes_to_zeros():
    """Spec, not torchao: zeros encode as zeros. torchao's per-tensor scale of amax 0 is 0, and 0 / 0 makes its
    block scales NaN; ours is 1.0 for an all-zero tensor."""
    q = bf.quantize_nvfp4(torch.zeros(2, 32))
    assert q.per_tensor_scale == 1.0 and torch.equal(bf.dequantize(q), torch.zeros(2, 32))
    assert (q.elements == 0).all() and (q.scales.float() == bf.E4M3_TINY).all()


def test_nvfp4_along_dim_zero_equals_the_moved_tensor(ao):
    x = torch.randn(48, 6, generator=torch.Generator().manual_seed(3))
    q = bf.quantize_nvfp4(x, dim=0)
    ref = ao_nvfp4(ao, x.t().contiguous())
    assert q.elements.shape == (24, 6) and q.scales.shape == (3, 6)
    assert_bits_equal(q.elements.t(), ref.qdata.view(torch.uint8))
    assert_bits_equal(q.scales.t(), ref.scale)
    assert_bits_equal(bf.dequantize(q).t(), ref.dequantize(torch.float32))


# ------------------------------------------------------------------------------------------ the error bound
def spread_tensor(seed: int, shape=(16, 128)) -> torch.Tensor:
    """Random values spanning ~2**40 within a tensor and ~2**16 within a block: saturation, subnormals, flushes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-8, 9, shape, generator=g).float())
    return x * torch.exp2(torch.randint(-12, 13, (shape[0], 1), generator=g).float())


def half_ulp(v: torch.Tensor, e: bf.ElementFormat) -> torch.Tensor:
    """Half the spacing of ``e``'s grid around magnitude ``v`` (frexp: v = m * 2**k with m in [0.5, 1))."""
    _, k = torch.frexp(v)
    binade = torch.clamp(k.float() - 1, min=e.emin)  # floor(log2 v), subnormals share the smallest normal's
    return 0.5 * torch.exp2(binade - e.mbits)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_mx_round_trip_within_half_an_ulp_at_the_block_scale(fmt):
    """|x - dq(q(x))| <= half an ulp of the element format at the block's scale, exactly (power-of-two scales
    are exact), for every element that does not saturate; a saturated one reads the largest value."""
    e = bf.MX_ELEMENTS[fmt]
    for seed in range(3):
        x = spread_tensor(seed)
        q = bf.quantize_mx(x, fmt)
        scale = torch.exp2(q.scales.view(torch.uint8).float() - 127).repeat_interleave(32, dim=-1)
        v, err = x.abs() / scale, (x - bf.dequantize(q)).abs()
        amax = x.abs().reshape(16, -1, 32).amax(-1).repeat_interleave(32, dim=-1)
        assert ((amax / scale >= 2.0 ** e.emax) & (amax / scale < 2.0 ** (e.emax + 1))).all()  # FLOOR's scale
        inside = v <= e.max
        assert (err[inside] <= half_ulp(v[inside], e) * scale[inside]).all()
        assert torch.equal(bf.dequantize(q)[~inside].abs(), e.max * scale[~inside])
        assert inside.float().mean() > 0.99


def test_nvfp4_round_trip_within_half_an_ulp_at_the_block_scale():
    """The same bound for NVFP4 at the block's decode scale (per-tensor times E4M3 block scale), plus four fp32
    roundings (the reciprocal, its quotient, the element product, the decode product), each <= 2**-24
    relative, since NVFP4 encodes with a reciprocal rather than by dividing by the decode scale."""
    for seed in range(3):
        x = spread_tensor(seed)
        q = bf.quantize_nvfp4(x)
        decode = (q.per_tensor_scale * q.scales.float()).repeat_interleave(16, dim=-1)
        v, err = x.abs() / decode, (x - bf.dequantize(q)).abs()
        rounding = 4 * 2.0 ** -24 * (x.abs() + bf.E2M1.max * decode)
        inside = v <= bf.E2M1.max
        assert (err[inside] <= half_ulp(v[inside], bf.E2M1) * decode[inside] + rounding[inside]).all()
        assert ((bf.dequantize(q)[~inside].abs() - bf.E2M1.max * decode[~inside]).abs() <= rounding[~inside]).all()
        assert q.scales.float().max() == 448.0  # the block holding the tensor's amax gets E4M3's largest scale


# ------------------------------------------------------------------------------------------ fake_quantize, stats
@pytest.mark.parametrize("recipe,dim", [("mxfp8", -1), ("mxfp8_e5m2", 0), ("nvfp4", -1), ("nvfp4", 0)])
def test_fake_quantize_equals_dequantize_of_the_stored_form(recipe, dim):
    x = spread_tensor(7, (64, 96))
    fq = bf.fake_quantize(x, recipe, dim)
    stored = bf.quantize_nvfp4(x, dim=dim) if recipe == "nvfp4" else bf.quantize_mx(
        x, "e5m2" if recipe.endswith("e5m2") else "e4m3", dim=dim)
    assert fq.dtype == torch.float32 and fq.shape == x.shape
    assert_bits_equal(fq, bf.dequantize(stored))
    assert_bits_equal(bf.fake_quantize(x.bfloat16(), recipe, dim), bf.fake_quantize(x.bfloat16().float(), recipe, dim))


def test_mx_block_stats_count_saturated_underflowing_blocks_and_flushed_elements():
    x = blocks_of([[1.0, 2.0 ** -20], [float("inf"), 1.0], [2.0 ** -130], [0.0], [float("nan")], [3.0]], 32)
    x[0, 2:] = 1.0  # block 0: one element (2**-20 at scale 2**-8, E4M3's smallest step 2**-17) flushes
    stats = bf.block_stats(x, "mxfp8")
    assert stats.scale_saturated == pytest.approx(2 / 6)  # the inf block and the NaN block
    assert stats.scale_underflow == pytest.approx(1 / 6)  # 2**-130: exponent -138 clamps to -127 (zero blocks do not count)
    # flushed: 2**-20 in block 0, the finite 1.0s in the inf block (scale 2**120), nothing in the NaN block
    assert stats.flushed_to_zero == pytest.approx((1 + 16) / x.numel())
    fq, same = bf.fake_quantize_with_stats(x, "mxfp8")
    assert same == stats and torch.isnan(fq[4]).all()


def test_nvfp4_block_stats():
    x = blocks_of([[6.0, 0.2], [1e-9, 1e-10], [0.0], [3.0, 0.01]], 16)
    stats = bf.block_stats(x, "nvfp4")
    # per-tensor scale 6 / 2688: block scales 448 (not saturated: E4M3's max itself), 7.5e-8 (below 2**-6:
    # underflows), none for the zero block (not counted), 224
    assert stats.scale_saturated == 0 and stats.scale_underflow == 1 / 4
    # decode scales 1, 2**-6 / 448 and 0.5: 0.2 (< 0.25), all of block 1, and 0.01 flush: 8 + 16 + 8 of 64
    assert stats.flushed_to_zero == 32 / 64
    q = bf.fake_quantize(x, "nvfp4")
    assert torch.equal(q == 0, (x == 0) | (x == 0.2) | (x.abs() < 0.02))
    x[1, 0] = float("nan")  # the per-tensor scale is NaN: no block scale is finite
    assert bf.block_stats(x, "nvfp4").scale_saturated == 1


def test_a_block_that_does_not_divide_the_dim_is_a_value_error_naming_the_size():
    with pytest.raises(ValueError, match="block size 32 does not divide size 48 of dim 1"):
        bf.quantize_mx(torch.zeros(4, 48))
    with pytest.raises(ValueError, match="block size 16 does not divide size 40 of dim 0"):
        bf.quantize_nvfp4(torch.zeros(40, 16), dim=0)
    with pytest.raises(ValueError, match="block size 32 does not divide size 16"):
        bf.fake_quantize(torch.zeros(16, 64), "mxfp8", dim=0)
    with pytest.raises(ValueError, match="block recipe must be one of"):
        bf.fake_quantize(torch.zeros(4, 32), "mxfp4")
    with pytest.raises(ValueError, match="MX element format must be one of"):
        bf.quantize_mx(torch.zeros(4, 32), "e2m1")
