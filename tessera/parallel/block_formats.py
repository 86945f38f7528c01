"""Block-scaled low-precision formats, MXFP8 and NVFP4, computed in fp32 arithmetic on any device.

A block format stores a tensor as small elements plus one scale per ``block`` consecutive elements
along one dim (a GEMM's reduction dim, so every product of the sum shares its operands' scales):

- **MXFP8** (OCP Microscaling Formats v1.0): E4M3 elements (E5M2 for gradients), one E8M0 scale (a
  bare power of two, ``2**(code - 127)``, code 255 = NaN) per 32 elements. The scale is the largest
  power of two not above the block's amax, divided by the element format's largest power of two:
  ``2**(floor(log2(amax)) - emax_elem)``, clamped to E8M0's range [2**-127, 2**127]. The scaled
  elements are clamped to the element format's largest finite value and rounded to nearest, ties to
  even. Because the scale rounds down, a block's amax can scale to at most ``2**(emax_elem + 1)``
  (E4M3: 512 > 448): the few elements above the element maximum saturate.
  ``scale_rounding="rceil"`` is NVIDIA's rule instead (cuBLAS's and Transformer Engine's MXFP8, torchao's
  ``ScaleCalculationMode.RCEIL``; NVIDIA's MXFP8 paper, arXiv 2506.08027, reports that FLOOR's saturation can
  make training diverge): the scale is ``amax / max_elem`` rounded up to a power of two, so the amax never
  scales past the element maximum, at the cost of up to one binade of resolution for the small elements.
  FLOOR stays the default (OCP's rule, and today's results); see ``_mx_blocks_rceil`` for its edges.
- **NVFP4** (NVIDIA): E2M1 elements (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) packed two per
  byte, one E4M3 scale per 16 elements and one fp32 scale per tensor. The per-tensor scale is
  ``amax / (448 * 6)``, so the largest block scale lands on E4M3's largest value; each block's scale
  is ``block_amax / 6`` divided by it, clamped to [E4M3's smallest normal, 448] and rounded to E4M3.
  NVIDIA's training recipe (arXiv 2509.25149; Transformer Engine's ``NVFP4BlockScaling``) quantizes weights in
  16x16 blocks instead (``fake_quantize_nvfp4_2d``): the forward GEMM reduces over a weight's inputs and the
  data-gradient GEMM over its outputs, and 1x16 blocks along each would give the two GEMMs different
  quantized weights; a 16x16 block serves both, so they multiply one weight (the chain rule holds for it).

Both formats can round their elements stochastically (``generator=``): up or down to a grid neighbour with
probabilities that make the expected value exact, so gradients' rounding errors average out over many steps
instead of biasing them (NVIDIA's NVFP4 recipe rounds gradients so, and activations and weights to nearest).
The scales are computed as without it, and values past the element maximum still saturate.

The arithmetic (operation order included) is the one torchao's reference quantizers use, so the two
agree bit for bit (tests/test_block_formats.py; RCEIL in tests/test_block_recipes.py, torchao's eager
arithmetic and its edges included), with two deliberate, spec-following differences for FLOOR and NVFP4:
an MX block whose scale clamps to 2**-127 is divided by 2**-127 (torchao divides by 2**-126 there, a
workaround for Triton's subnormals, and then dequantizes with 2**-127: a factor-2 round-trip error),
and an all-zero tensor gets the NVFP4 per-tensor scale 1.0 (amax / (448 * 6) = 0 would make every
scale 0 / 0 = NaN). Pure tensor functions: no autograd, no process group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = ["BLOCK_RECIPES", "E2M1", "E4M3", "E5M2", "MX_ELEMENTS", "BlockStats", "ElementFormat", "MXQuantized",
           "NVFP4Quantized", "SCALE_ROUNDINGS", "block_stats", "check_blocks", "check_tiles_2d", "dequantize",
           "fake_quantize",
           "fake_quantize_nvfp4_2d", "fake_quantize_nvfp4_2d_with_stats", "fake_quantize_with_stats",
           "nvfp4_per_tensor_scale", "quantize_mx", "quantize_nvfp4", "round_to_grid"]


@dataclass(frozen=True)
class ElementFormat:
    """A small float format: ``mbits`` mantissa bits, normal exponents ``emin..emax``, largest value ``max``."""

    name: str
    mbits: int
    emin: int  # exponent of the smallest normal; below it the spacing stays 2**(emin - mbits) (subnormals)
    emax: int  # exponent of the largest normal: the scale divides the block's power of two by 2**emax
    max: float  # largest finite value: scaled elements saturate here
    dtype: torch.dtype | None  # torch's storage dtype; None for E2M1 (packed 4-bit codes)


E4M3 = ElementFormat("e4m3", 3, -6, 8, 448.0, torch.float8_e4m3fn)
E5M2 = ElementFormat("e5m2", 2, -14, 15, 57344.0, torch.float8_e5m2)
E2M1 = ElementFormat("e2m1", 1, 0, 2, 6.0, None)
MX_ELEMENTS = {f.name: f for f in (E4M3, E5M2)}

E8M0_BIAS, E8M0_NAN = 127, 255  # E8M0 codes 0..254 are 2**-127..2**127, 255 is NaN; no zero, no inf
MX_BLOCK, NVFP4_BLOCK = 32, 16
E4M3_TINY = 2.0 ** E4M3.emin  # an NVFP4 block scale never goes below E4M3's smallest normal
# an NVFP4 block scale saturates (or underflows) where E4M3 rounding alone would not have reached the bound:
# beyond half an E4M3 step past 448 (or below 2**-6 minus half a subnormal step)
_E4M3_SATURATES = E4M3.max + 2.0 ** (E4M3.emax - E4M3.mbits - 1)
_E4M3_UNDERFLOWS = E4M3_TINY - 2.0 ** (E4M3.emin - E4M3.mbits - 1)
_E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitude of code c (sign in bit 3) is _E2M1_GRID[c]

# recipe name -> (element format, block size): what ``fake_quantize`` emulates
BLOCK_RECIPES: dict[str, tuple[ElementFormat, int]] = {
    "mxfp8": (E4M3, MX_BLOCK), "mxfp8_e5m2": (E5M2, MX_BLOCK), "nvfp4": (E2M1, NVFP4_BLOCK)}


@dataclass(frozen=True)
class MXQuantized:
    """An MX tensor: ``elements`` (fp8, the input's shape) and ``scales`` (E8M0, ``dim`` divided by ``block``)."""

    elements: torch.Tensor
    scales: torch.Tensor  # torch.float8_e8m0fnu
    fmt: ElementFormat
    block: int
    dim: int  # non-negative


@dataclass(frozen=True)
class NVFP4Quantized:
    """An NVFP4 tensor: E2M1 codes packed along ``dim`` (element ``2i`` in the low nibble), E4M3 block scales,
    and the fp32 per-tensor scale; a block's decode scale is ``per_tensor_scale * scales``."""

    elements: torch.Tensor  # uint8, ``dim`` halved
    scales: torch.Tensor  # torch.float8_e4m3fn, ``dim`` divided by ``block``
    per_tensor_scale: torch.Tensor  # fp32, 0-dim
    block: int
    dim: int


class BlockStats(NamedTuple):
    """Telemetry of one quantization, each a 0-dim fp32 share in [0, 1] (a tensor: reading it is the caller's sync).

    ``scale_saturated``: blocks whose ideal scale is above the scale format's range or not finite (an inf or
    NaN in the block, or an NVFP4 per-tensor scale too small for the block). ``scale_underflow``: non-zero
    blocks whose ideal scale is below the scale format's range (clamped up: small elements lose bits; with RCEIL,
    at or below 2**-127, where NVIDIA's encoding by 1 flushes the whole block).
    ``flushed_to_zero``: non-zero elements that quantize to zero.
    """

    scale_saturated: torch.Tensor
    scale_underflow: torch.Tensor
    flushed_to_zero: torch.Tensor


class _Blocks(NamedTuple):
    """The work of one quantization, in blocks ``(..., n_blocks, block)`` along the last dim."""

    grid: torch.Tensor  # fp32 element values on the element grid (before the scale)
    decode: torch.Tensor  # fp32 per-block factor, ``(..., n_blocks, 1)``: value = grid * decode
    saturated: torch.Tensor  # bool per block
    underflow: torch.Tensor  # bool per block


def _exponent(x: torch.Tensor) -> torch.Tensor:
    """The unbiased exponent field of fp32 ``x`` (int32): floor(log2|x|) for normals, -127 for zero and
    subnormals, 128 for inf and NaN."""
    return torch.bitwise_and(torch.bitwise_right_shift(x.view(torch.int32), 23), 0xFF) - 127


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """``2.0**e`` in fp32 for integer ``e`` in [-149, 127], written as its bits (exact by construction, and a few
    integer operations where ``ldexp`` computes a ``pow``): the biased exponent for a normal, a single mantissa
    bit for a subnormal (``e`` below -126)."""
    e = e.to(torch.int32)
    normal = torch.bitwise_left_shift(torch.clamp(e + 127, min=1), 23)
    subnormal = torch.bitwise_left_shift(torch.ones_like(e), torch.clamp(e + 149, 0, 22))
    return torch.where(e >= -126, normal, subnormal).view(torch.float32)


Randomness = torch.Generator | torch.Tensor | None  # stochastic rounding: a generator, or the uniforms themselves


def round_to_grid(v: torch.Tensor, fmt: ElementFormat, generator: Randomness = None) -> torch.Tensor:
    """fp32 ``v`` saturated to ``fmt``'s largest value and rounded to nearest (ties to even) on its grid, or,
    with ``generator``, stochastically (see ``_round_stochastic``).

    The grid spacing in ``[2**e, 2**(e+1))`` is ``2**(e - mbits)``, and ``2**(emin - mbits)`` below the
    smallest normal (subnormals); dividing by a power of two is exact, so ``round`` decides alone. NaN stays NaN.
    """
    v = torch.clamp(v, -fmt.max, fmt.max)
    ulp = _grid_step(v, fmt)
    if generator is not None:
        return _round_stochastic(v, ulp, generator)
    return torch.round(v / ulp) * ulp


def _grid_step(v: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """The grid spacing of ``fmt`` at fp32 ``v``, ``2**(max(exponent(v), emin) - mbits)``, built from ``v``'s
    exponent bits: the step is always a normal fp32 number for the element formats here (its biased exponent
    ``max(biased, emin + 127) - mbits`` lies in [1, 254]), so shifting that exponent into place is the value."""
    biased = torch.bitwise_and(torch.bitwise_right_shift(v.view(torch.int32), 23), 0xFF)
    return torch.bitwise_left_shift(torch.clamp(biased, min=fmt.emin + 127) - fmt.mbits, 23).view(torch.float32)


def _round_stochastic(v: torch.Tensor, ulp: torch.Tensor, generator: torch.Generator | torch.Tensor) -> torch.Tensor:
    """``v`` rounded to one of its two grid neighbours ``floor(v / ulp) * ulp`` and the next, up with probability
    equal to the distance from the lower one in ulps: unbiased, ``E[result] = v`` (what gradients need: the
    rounding errors of many small updates average out instead of adding up). ``v / ulp`` and its fractional
    part are exact (at most 2**(mbits + 1) in magnitude, fp32 has 24 bits); compared with ``torch.rand``'s
    uniforms (multiples of 2**-24 on a CPU) the probability is exact wherever ``|v|`` is at least half the
    grid's smallest step, and within 2**-24 below that. One uniform per element, drawn from ``generator`` (on
    ``v``'s device); the sign of a zero result is ``v``'s, as round-to-nearest gives it."""
    q = v / ulp
    low = torch.floor(q)
    uniform = generator if isinstance(generator, torch.Tensor) else torch.rand(
        v.shape, generator=generator, device=v.device, dtype=torch.float32)
    up = uniform < (q - low)
    return torch.copysign((low + up.to(torch.float32)) * ulp, v)


def _split_blocks(t: torch.Tensor, block: int, dim: int) -> torch.Tensor:
    """``t`` in fp32 with ``dim`` moved last and cut into ``(..., n_blocks, block)``; a ValueError naming the
    sizes when ``block`` does not divide ``dim``."""
    check_blocks(t, block, dim)
    x = t.float().movedim(dim, -1)
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def check_blocks(t: torch.Tensor, block: int, dim: int) -> None:
    """A ValueError naming the sizes unless ``t`` is floating point and ``block`` divides its size along ``dim``."""
    if not t.is_floating_point():
        raise ValueError(f"block formats quantize floating-point tensors, got {t.dtype}")
    n = t.shape[dim]
    if block < 1 or n % block:
        raise ValueError(f"block size {block} does not divide size {n} of dim {dim % t.dim()} "
                         f"(shape {tuple(t.shape)})")


def _join_blocks(xb: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of ``_split_blocks``'s reshape: blocks merged into the last dim, moved back to ``dim``."""
    return xb.reshape(*xb.shape[:-2], -1).movedim(-1, dim)


SCALE_ROUNDINGS = ("floor", "rceil")  # how an MX block's E8M0 scale is rounded (see the module docstring)


def _check_scale_rounding(scale_rounding: str) -> None:
    if scale_rounding not in SCALE_ROUNDINGS:
        raise ValueError(f"MX scale rounding must be one of {list(SCALE_ROUNDINGS)}, got {scale_rounding!r}")


def _mx_blocks(xb: torch.Tensor, fmt: ElementFormat, scale_rounding: str = "floor",
               generator: Randomness = None) -> tuple[_Blocks, torch.Tensor]:
    """MX quantization of fp32 blocks: the blocks' work and their E8M0 codes (uint8, ``(..., n_blocks)``)."""
    if scale_rounding == "rceil":
        return _mx_blocks_rceil(xb, fmt, generator)
    amax = xb.abs().amax(dim=-1, keepdim=True)  # NaN when the block holds a NaN
    ideal = _exponent(amax) - fmt.emax  # floor(log2(amax)) - emax_elem
    exp = torch.clamp(ideal, -E8M0_BIAS, E8M0_BIAS)
    nan = torch.isnan(amax)
    codes = torch.where(nan, E8M0_NAN, exp + E8M0_BIAS).to(torch.uint8)
    scale = _pow2(exp)
    # a NaN block divides by inf: the NaN stays where it was, the other elements read 0 (the scale is NaN anyway)
    grid = round_to_grid(xb / torch.where(nan, torch.inf, scale), fmt, generator)
    decode = torch.where(nan, torch.nan, scale)
    nonzero = amax > 0
    saturated = ((ideal > E8M0_BIAS) | ~torch.isfinite(amax)).squeeze(-1)
    underflow = (nonzero & (ideal < -E8M0_BIAS)).squeeze(-1)
    return _Blocks(grid, decode, saturated, underflow), codes.squeeze(-1)


def _mx_blocks_rceil(xb: torch.Tensor, fmt: ElementFormat,
                     generator: Randomness = None) -> tuple[_Blocks, torch.Tensor]:
    """``_mx_blocks`` with RCEIL scales: the E8M0 code rounds ``amax / max_elem`` up to a power of two.

    The exponent is ``ceil(log2(amax / max_elem))`` computed in fp32 (torchao's arithmetic, so the codes
    agree bit for bit): where the quotient lies a few fp32 ulps above a power of two, fp32 ``log2`` rounds to
    the integer and the scale stays at that power (the hardware's exact round-up takes the next one); the
    block's largest element then exceeds the element maximum by under 2**-17 of it and saturates to it, well
    within half an element ulp. Special codes as NVIDIA's kernels set them: NaN -> 255, inf -> 254 (elements
    multiplied by 2**-127), and code 0 multiplies by 1 (Transformer Engine's reciprocal of code 0), so a
    non-zero block whose scale would be 2**-127 or less flushes to zero.
    """
    amax = xb.abs().amax(dim=-1, keepdim=True)
    ideal = torch.ceil(torch.log2(amax / fmt.max))  # float: -inf for a zero block, NaN / inf pass through
    nan, inf = torch.isnan(amax), torch.isinf(amax)
    biased = torch.clamp(ideal, -E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS
    codes = torch.where(nan, E8M0_NAN, torch.where(inf, E8M0_NAN - 1, biased)).to(torch.uint8)
    icodes = codes.to(torch.int32)
    encode = torch.where(icodes == 0, 1.0, _pow2(E8M0_BIAS - icodes))  # code 254 (inf) gives 2**-127
    encode = torch.where(nan, torch.nan, encode)  # a NaN block reads NaN everywhere
    grid = round_to_grid(xb * encode, fmt, generator)
    decode = torch.where(nan, torch.nan, _pow2(icodes - E8M0_BIAS))
    saturated = (~torch.isfinite(amax)).squeeze(-1)  # a finite amax / max_elem never needs more than 2**127
    underflow = ((amax > 0) & (ideal <= -E8M0_BIAS)).squeeze(-1)  # code 0: encoded by 1, flushed
    return _Blocks(grid, decode, saturated, underflow), codes.squeeze(-1)


def nvfp4_per_tensor_scale(amax: torch.Tensor) -> torch.Tensor:
    """NVFP4's fp32 per-tensor scale for a tensor of absolute maximum ``amax``: ``amax / (448 * 6)``, so the
    block holding the amax gets E4M3's largest scale; 1.0 for an all-zero tensor (any positive scale encodes
    zeros exactly; 0 would make every block scale 0 / 0)."""
    amax = amax.to(torch.float32)
    return torch.where(amax == 0, 1.0, amax / (E4M3.max * E2M1.max))


def _nvfp4_blocks(xb: torch.Tensor, per_tensor_scale: torch.Tensor,
                  generator: Randomness = None) -> tuple[_Blocks, torch.Tensor]:
    """NVFP4 quantization of fp32 blocks: the blocks' work and their E4M3 block scales (fp32 values). The
    scales always round to nearest; ``generator`` rounds the elements stochastically."""
    amax = xb.abs().amax(dim=-1, keepdim=True)
    ideal = amax / E2M1.max / per_tensor_scale  # the block scale relative to the per-tensor one, before E4M3
    scales = round_to_grid(torch.clamp(ideal, min=E4M3_TINY, max=E4M3.max), E4M3)
    encode = (1.0 / per_tensor_scale) / scales  # one reciprocal per block, then one product per element
    grid = round_to_grid(xb * encode, E2M1, generator)
    decode = per_tensor_scale * scales
    saturated = ((ideal >= _E4M3_SATURATES) | ~torch.isfinite(ideal)).squeeze(-1)
    underflow = ((amax > 0) & (ideal < _E4M3_UNDERFLOWS)).squeeze(-1)
    return _Blocks(grid, decode, saturated, underflow), scales.squeeze(-1)


def _encode_e2m1(grid: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8 in 0..15) of values on the E2M1 grid: sign in bit 3, the magnitude's index in bits
    0-2. E2M1 has no NaN: a NaN (only ever in a block whose scale is NaN) gets code 0."""
    mag = torch.nan_to_num(grid.abs(), nan=0.0)
    e = torch.clamp(_exponent(mag), min=0).float()  # 0, 1 or 2 for the normals 1..6
    index = torch.where(mag < 1, 2 * mag, 2 * e + 2 * mag / torch.exp2(e))  # 1.5 -> 3, 4 -> 6, 6 -> 7
    return (index.to(torch.uint8) + torch.signbit(grid).to(torch.uint8) * 8).to(torch.uint8)


def _decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(_E2M1_GRID, device=codes.device)
    mag = table[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pairs along the last dim in one byte each, the even element in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)


def quantize_mx(t: torch.Tensor, fmt: str = "e4m3", block: int = MX_BLOCK, dim: int = -1,
                scale_rounding: str = "floor", generator: Randomness = None) -> MXQuantized:
    """``t`` in an MX format along ``dim``: ``fmt`` is ``"e4m3"`` or ``"e5m2"``, one E8M0 scale per ``block``,
    rounded as ``scale_rounding`` says (``"floor"``: OCP's rule; ``"rceil"``: NVIDIA's round-up). ``generator``:
    the elements rounded stochastically with its random numbers (see ``fake_quantize``)."""
    if fmt not in MX_ELEMENTS:
        raise ValueError(f"MX element format must be one of {list(MX_ELEMENTS)}, got {fmt!r}")
    _check_scale_rounding(scale_rounding)
    element = MX_ELEMENTS[fmt]
    dim = dim % t.dim()
    blocks, codes = _mx_blocks(_split_blocks(t, block, dim), element, scale_rounding, generator)
    assert element.dtype is not None
    return MXQuantized(_join_blocks(blocks.grid, dim).to(element.dtype),
                       codes.movedim(-1, dim).view(torch.float8_e8m0fnu), element, block, dim)


def quantize_nvfp4(t: torch.Tensor, block: int = NVFP4_BLOCK, dim: int = -1,
                   per_tensor_scale: torch.Tensor | None = None,
                   generator: Randomness = None) -> NVFP4Quantized:
    """``t`` in NVFP4 along ``dim``. ``per_tensor_scale``: a calibrated fp32 scale; by default
    ``nvfp4_per_tensor_scale`` of ``t``'s amax. ``block`` must be even (two codes a byte). ``generator``: the
    elements rounded stochastically with its random numbers (see ``fake_quantize``)."""
    if block % 2:
        raise ValueError(f"NVFP4 block size {block} must be even: two E2M1 codes share a byte")
    dim = dim % t.dim()
    xb = _split_blocks(t, block, dim)
    if per_tensor_scale is None:
        per_tensor_scale = nvfp4_per_tensor_scale(xb.abs().amax())
    pts = per_tensor_scale.to(device=xb.device, dtype=torch.float32).reshape(())
    blocks, scales = _nvfp4_blocks(xb, pts, generator)
    codes = _pack_nibbles(_encode_e2m1(_join_blocks(blocks.grid, -1)))
    return NVFP4Quantized(codes.movedim(-1, dim), scales.to(torch.float8_e4m3fn).movedim(-1, dim), pts, block, dim)


def dequantize(q: MXQuantized | NVFP4Quantized) -> torch.Tensor:
    """The fp32 values a quantized tensor stands for (exact: element times its block's decode scale)."""
    if isinstance(q, MXQuantized):
        codes = q.scales.view(torch.uint8).movedim(q.dim, -1).unsqueeze(-1)
        decode = torch.where(codes == E8M0_NAN, torch.nan, _pow2(codes.to(torch.int32) - E8M0_BIAS))
        elements = _split_blocks(q.elements, q.block, q.dim)
    else:
        decode = (q.per_tensor_scale * q.scales.float()).movedim(q.dim, -1).unsqueeze(-1)
        values = _decode_e2m1(_unpack_nibbles(q.elements.movedim(q.dim, -1)))
        elements = values.reshape(*values.shape[:-1], -1, q.block)
    return _join_blocks(elements * decode, q.dim)


def _recipe_blocks(t: torch.Tensor, recipe: str, dim: int, amax: torch.Tensor | None = None,
                   scale_rounding: str = "floor",
                   generator: Randomness = None) -> tuple[_Blocks, torch.Tensor]:
    if recipe not in BLOCK_RECIPES:
        raise ValueError(f"block recipe must be one of {list(BLOCK_RECIPES)}, got {recipe!r}")
    _check_scale_rounding(scale_rounding)
    element, block = BLOCK_RECIPES[recipe]
    xb = _split_blocks(t, block, dim)
    if isinstance(generator, torch.Tensor):  # uniforms laid out as t: into the blocks' layout too
        generator = _split_blocks(generator, block, dim)
    if element is E2M1:
        amax = xb.abs().amax() if amax is None else amax.to(device=xb.device, dtype=torch.float32).reshape(())
        return _nvfp4_blocks(xb, nvfp4_per_tensor_scale(amax), generator)[0], xb
    return _mx_blocks(xb, element, scale_rounding, generator)[0], xb


def fake_quantize_with_stats(t: torch.Tensor, recipe: str, dim: int = -1, amax: torch.Tensor | None = None,
                             scale_rounding: str = "floor",
                             generator: Randomness = None) -> tuple[torch.Tensor, BlockStats]:
    """``fake_quantize``'s values and the quantization's ``BlockStats``, from one pass."""
    blocks, xb = _recipe_blocks(t, recipe, dim, amax, scale_rounding, generator)
    return _join_blocks(blocks.grid * blocks.decode, dim), _stats(blocks, xb)


def fake_quantize(t: torch.Tensor, recipe: str, dim: int = -1, amax: torch.Tensor | None = None,
                  scale_rounding: str = "floor", generator: Randomness = None) -> torch.Tensor:
    """``t`` rounded to a block recipe of ``BLOCK_RECIPES`` along ``dim`` and back, in fp32: the operand an
    emulated block-scaled GEMM multiplies (equal to ``dequantize`` of the stored form). ``amax``: NVFP4's
    per-tensor scale from this amax instead of ``t``'s own (the whole tensor's, when ``t`` is a TP shard).
    ``scale_rounding``: the MX recipes' E8M0 scale rounding, ``"floor"`` or ``"rceil"`` (NVFP4 ignores it).
    ``generator``: the scaled elements rounded stochastically (unbiased) instead of to nearest, one
    ``torch.rand`` draw from it per element, in the order of ``t`` with ``dim`` moved last (a generator on
    ``t``'s device), or the uniforms themselves, a tensor shaped like ``t`` (a TP shard's slice of the whole
    tensor's draw, so TP=N rounds as TP=1); the scales are computed as without it, saturation is unchanged."""
    blocks, _ = _recipe_blocks(t, recipe, dim, amax, scale_rounding, generator)
    return _join_blocks(blocks.grid * blocks.decode, dim)


def _tiles_2d(w: torch.Tensor, tile: int) -> torch.Tensor:
    """2-D ``w`` in fp32 cut into ``tile`` x ``tile`` blocks, each flattened: ``(rows / tile, cols / tile, tile**2)``;
    a ValueError naming the shape unless both dims are multiples of ``tile``."""
    check_tiles_2d(w, tile)
    r, c = w.shape[0] // tile, w.shape[1] // tile
    return w.float().reshape(r, tile, c, tile).transpose(1, 2).reshape(r, c, tile * tile)


def check_tiles_2d(w: torch.Tensor, tile: int) -> None:
    """A ValueError naming the shape unless ``w`` is a floating-point matrix with both dims multiples of ``tile``."""
    if w.dim() != 2 or w.shape[0] % tile or w.shape[1] % tile:
        raise ValueError(f"2D block quantization needs a 2-D tensor with both dims multiples of {tile}, "
                         f"got shape {tuple(w.shape)}")
    if not w.is_floating_point():
        raise ValueError(f"block formats quantize floating-point tensors, got {w.dtype}")


def _untile_2d(xb: torch.Tensor, tile: int) -> torch.Tensor:
    """Inverse of ``_tiles_2d``."""
    r, c = xb.shape[:2]
    return xb.reshape(r, c, tile, tile).transpose(1, 2).reshape(r * tile, c * tile)


def _nvfp4_2d(w: torch.Tensor, amax: torch.Tensor | None) -> tuple[_Blocks, torch.Tensor]:
    xb = _tiles_2d(w, NVFP4_BLOCK)
    amax = xb.abs().amax() if amax is None else amax.to(device=xb.device, dtype=torch.float32).reshape(())
    return _nvfp4_blocks(xb, nvfp4_per_tensor_scale(amax))[0], xb


def fake_quantize_nvfp4_2d(w: torch.Tensor, amax: torch.Tensor | None = None) -> torch.Tensor:
    """2-D weight ``w`` in NVFP4 with one E4M3 scale per 16x16 block (and the fp32 per-tensor scale) and back,
    in fp32: NVIDIA's weight recipe, so the forward GEMM (reducing over ``w``'s columns) and the data-gradient
    GEMM (over its rows) multiply the same quantized weight, which 1x16 blocks along each reduction dim do
    not give. ``fake_quantize_nvfp4_2d(w.T) == fake_quantize_nvfp4_2d(w).T`` bitwise. ``amax``: the per-tensor
    scale from this amax (the whole weight's, when ``w`` is a TP shard; the blocks never cross a shard whose
    dims are multiples of 16). Both dims must be multiples of 16."""
    blocks, _ = _nvfp4_2d(w, amax)
    return _untile_2d(blocks.grid * blocks.decode, NVFP4_BLOCK)


def fake_quantize_nvfp4_2d_with_stats(w: torch.Tensor,
                                      amax: torch.Tensor | None = None) -> tuple[torch.Tensor, BlockStats]:
    """``fake_quantize_nvfp4_2d``'s values and the quantization's ``BlockStats`` (blocks of 16x16), from one pass."""
    blocks, xb = _nvfp4_2d(w, amax)
    return _untile_2d(blocks.grid * blocks.decode, NVFP4_BLOCK), _stats(blocks, xb)


def _stats(blocks: _Blocks, xb: torch.Tensor) -> BlockStats:
    flushed = (blocks.grid == 0) & (xb != 0) & ~torch.isnan(xb)
    return BlockStats(blocks.saturated.float().mean(), blocks.underflow.float().mean(), flushed.float().mean())


def block_stats(t: torch.Tensor, recipe: str, dim: int = -1, scale_rounding: str = "floor") -> BlockStats:
    """The telemetry of quantizing ``t`` with ``recipe`` along ``dim`` (see ``BlockStats``)."""
    return fake_quantize_with_stats(t, recipe, dim, scale_rounding=scale_rounding)[1]
