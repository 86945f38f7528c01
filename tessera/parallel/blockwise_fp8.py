"""DeepSeek-V3's blockwise fp8, and the high-precision weight gradient of ``rowwise_with_gw_hp``: route functions.

Blockwise fp8 (DeepSeek-V3, arXiv 2412.19437 §3.3; Transformer Engine's ``Float8BlockScaling`` with power-of-two
scales; torchao's ``blockwise_fp8_training``) gives every block of an operand its own scale, so an outlier pushes
only its own block's small elements below fp8's normal range (with a power-of-two scale, an element that stays in the
normal range rounds the same whatever its scale: the block shape decides which elements fall below it):

- activations and gradients: blocks of ``1 x 128`` (``ACT_BLOCK``), one token by 128 consecutive features along the
  GEMM's reduction dim;
- weights: blocks of ``128 x 128`` (``WEIGHT_BLOCK``). A square block is the same block in ``W`` and ``W^T``, so the
  forward (``x W^T``, reduction over the inputs) and the data gradient (``g W``, over the outputs) multiply *the
  same* quantized weight (``weight_operand``);
- the weight gradient ``dW = g^T x`` sums over tokens: ``g^T`` and ``x`` are quantized per 128 tokens of one
  feature (``TOKEN_BLOCK``, ``128 x 1`` on the ``[tokens, features]`` operands).

The scale of a block is the largest power of two ``2**e`` with ``amax * 2**e <= fmt_max``, i.e.
``2**floor(log2(fmt_max / amax))``, computed exactly from the exponents of ``amax`` and ``fmt_max`` (``_scales``).
That equals DeepSeek's and Transformer Engine's rule (the fp32 quotient ``fmt_max / amax`` with its mantissa bits
dropped) for every finite fp32 ``amax``: the quotient could round up across a power of two ``2**k`` only for an
``amax`` less than ``2**-24`` (relative) above ``fmt_max * 2**-k``, and no fp32 number lies there (``fmt_max *
2**-k`` is one, the next is ``2**-23`` above). A zero block gets scale 1; ``e`` is capped at 127 (the largest fp32
power of two, as TE's infinite quotient becomes fp32's max). Scaling by a power of two is exact and keeps
``|t * scale| <= fmt_max``, so the elements are rounded to nearest (ties to even) with no clamp: nothing saturates.
A block holding inf or NaN reads NaN throughout (its scale is NaN): an overflow reaches the loss scaler's
check, where a saturating cast would turn it into ``fmt_max``. Dims that are not whole blocks are padded with zeros
(a zero changes no block's amax) and cut back.

Tensor parallelism: a block never straddles a TP shard when every split dim's shard is a multiple of 128 (the
caller, ``tessera.precision.linears``, refuses other sizes; ``_check_shards`` says so here too), so each rank's
blocks are the unsharded tensor's blocks and no scale needs a collective: TP=N quantizes what TP=1 quantizes.
The weight gradient's ``128 x 1`` blocks lie within one feature; they run along the tokens, which these functions
must see whole (the row keeps the gathered input, ``sequence_chunked=False``, as the other fp8 rows do), or one
block's tokens would come from two sequence-parallel chunks.

The route functions have the signatures of ``tessera.parallel.gemm``'s rows: ``blockwise_forward``,
``blockwise_grad_input``, ``blockwise_grad_weight`` (emulated like the other block formats: dequantized operands,
fp32 GEMMs, the bias added in fp32, each output rounded once to the operands' dtype), and
``high_precision_grad_weight``, the weight gradient of ``rowwise_with_gw_hp`` (torchao/torchtitan; TE's
``fp8_wgrad=False``): ``g^T x`` on the unquantized operands, fp32 sums, rounded once to the weight's dtype.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from tessera.parallel.fp8 import E4M3

# the route functions take gemm's GemmPolicy and TpSplit, typed ``Any`` here: gemm imports this module for its
# table, and the layering allows no import back, not even for types

__all__ = ["ACT_BLOCK", "TILE", "TOKEN_BLOCK", "WEIGHT_BLOCK", "blockwise_forward", "blockwise_grad_input",
           "blockwise_grad_weight", "blockwise_scales", "forward_operands", "grad_input_operands",
           "grad_weight_operands", "high_precision_grad_weight", "quantize_blockwise", "scaled_blockwise",
           "weight_operand"]

TILE = 128
ACT_BLOCK = (1, TILE)  # activations and gradients: one token, 128 features along the reduction dim
WEIGHT_BLOCK = (TILE, TILE)  # weights: the same blocks in W and W^T
TOKEN_BLOCK = (TILE, 1)  # the weight gradient's operands: 128 tokens of one feature
_FP32_MAX_EXP = 127  # the largest power of two fp32 holds: 2**127


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """``2.0**e`` in fp32 for integer ``e`` in [-126, 127], built from its bits (exact; no ``exp2`` rounding)."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def _scales(amax: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """Per-block scale: the largest ``2**e`` with ``amax * 2**e <= fmt``'s max; 1 for a zero block, NaN for a
    non-finite one. With ``amax = m * 2**a`` and ``fmt_max = fm * 2**f`` (``m, fm`` in [0.5, 1)), ``e = f - a``,
    less one when ``m > fm``: integer arithmetic on exact exponents, no quotient to round."""
    fm, f = math.frexp(torch.finfo(fmt).max)
    m, a = torch.frexp(amax)
    e = (f - a - (m > fm).to(torch.int32)).clamp(-126, _FP32_MAX_EXP)
    scale = torch.where(amax > 0, _pow2(e), torch.ones_like(amax))
    return torch.where(torch.isfinite(amax), scale, torch.full_like(amax, torch.nan))


def _tiles(t: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """2-D ``t`` in fp32, zero-padded to whole blocks, as ``[rows / br, br, cols / bc, bc]``."""
    br, bc = block
    rows, cols = t.shape
    t = F.pad(t.float(), (0, -cols % bc, 0, -rows % br))
    return t.reshape(t.shape[0] // br, br, t.shape[1] // bc, bc)


def blockwise_scales(t: torch.Tensor, fmt: torch.dtype, block: tuple[int, int]) -> torch.Tensor:
    """The power-of-two scale of each ``block`` of 2-D ``t``: ``[ceil(rows / br), ceil(cols / bc)]``, fp32."""
    amax = _tiles(t, block).abs().amax(dim=(1, 3))
    return _scales(amax, fmt)


def _quantized_tiles(t: torch.Tensor, fmt: torch.dtype,
                     block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``t``'s tiles (``_tiles``) cast to ``fmt`` and their scales ``[rows / br, 1, cols / bc, 1]``. No clamp:
    a power-of-two scale keeps every element within range, and multiplying by it is exact."""
    tiles = _tiles(t, block)
    scales = _scales(tiles.abs().amax(dim=(1, 3), keepdim=True), fmt)
    return (tiles * scales).to(fmt), scales


def _untiled(tiles: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Tiles back to a 2-D tensor of ``shape`` (the padding cut off)."""
    return tiles.reshape(tiles.shape[0] * tiles.shape[1], -1)[: shape[0], : shape[1]]


def scaled_blockwise(t: torch.Tensor, fmt: torch.dtype,
                     block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """2-D ``t`` cast to ``fmt`` per ``block``: ``(q, scales)``, ``q`` of ``t``'s shape, ``t ~ q / scale`` of its
    block; ``scales`` as ``blockwise_scales`` (the operands a blockwise-scaled fp8 GEMM kernel would take)."""
    q, scales = _quantized_tiles(t, fmt, block)
    return _untiled(q, t.shape), scales.reshape(q.shape[0], q.shape[2])


def quantize_blockwise(t: torch.Tensor, fmt: torch.dtype, block: tuple[int, int]) -> torch.Tensor:
    """2-D ``t`` rounded to ``fmt`` with one power-of-two scale per ``block`` and back, in fp32 (exact: the
    fp8 values times powers of two). Eager under every ``TESSERA_QUANTIZER``: compiled (``quantizer_kernels``),
    its padded 128-row tiles ran slower than torch's kernels in 3 of 4 sizes (BENCHMARKS.md section 19)."""
    q, scales = _quantized_tiles(t, fmt, block)
    return _untiled(q.float() / scales, t.shape)


# ------------------------------------------------------------------ the operands of the three GEMMs
def weight_operand(w: torch.Tensor) -> torch.Tensor:
    """W in 128 x 128 blocks: the one quantized weight the forward and the data gradient both multiply."""
    return quantize_blockwise(w, E4M3, WEIGHT_BLOCK)


def forward_operands(x2: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x W^T``'s operands: ``x`` ([tokens, in]) per token and 128 inputs, W in 128 x 128 blocks."""
    return quantize_blockwise(x2, E4M3, ACT_BLOCK), weight_operand(w)


def grad_input_operands(g2: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``g W``'s operands: ``g`` ([tokens, out]) per token and 128 outputs (e4m3, as DeepSeek-V3: the block
    scale gives the range e5m2 would), and the forward's quantized W."""
    return quantize_blockwise(g2, E4M3, ACT_BLOCK), weight_operand(w)


def grad_weight_operands(g2: torch.Tensor, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``g^T x``'s operands, ``g`` and ``x`` as [tokens, features], per 128 tokens of one feature (the sum's dim)."""
    return quantize_blockwise(g2, E4M3, TOKEN_BLOCK), quantize_blockwise(x2, E4M3, TOKEN_BLOCK)


def _check_shards(w: torch.Tensor, s: Any) -> None:
    """Refuse a TP shard that is not whole blocks: its blocks would not be the unsharded tensor's."""
    for split, dim, what in ((s.w_split_out, 0, "output rows (column-parallel)"),
                             (s.w_split_in or s.x_split_in, 1, "input features (row-parallel)")):
        if split and w.shape[dim] % TILE:
            raise ValueError(f"blockwise fp8: a TP shard of {w.shape[dim]} {what} is not a multiple of {TILE}: "
                             "its 128-wide blocks would straddle shards")


# ------------------------------------------------------------------ the route functions (gemm.py's signatures)
def blockwise_forward(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, p: Any,
                      s: Any, o: Any = None) -> torch.Tensor:
    """``y = Q(x, 1x128) Q(W, 128x128)^T + b``: fp32 GEMM and bias, rounded once to ``x``'s dtype."""
    _check_shards(w, s)
    xq, wq = forward_operands(x.reshape(-1, x.shape[-1]), w)
    y = xq @ wq.t()
    if b is not None:
        y = y + b.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


def blockwise_grad_input(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, p: Any,
                         s: Any) -> torch.Tensor:
    """``dx = Q(g, 1x128) Q(W, 128x128)``: the forward's quantized weight; fp32 GEMM rounded once."""
    _check_shards(w, s)
    gq, wq = grad_input_operands(g.reshape(-1, g.shape[-1]), w)
    return (gq @ wq).to(x.dtype).reshape(x.shape)


def blockwise_grad_weight(g2: torch.Tensor, x2: torch.Tensor, w: torch.Tensor, p: Any,
                          s: Any) -> torch.Tensor:
    """``dW = Q(g^T, 1x128 along tokens) Q(x, 128 tokens x 1)``: fp32 GEMM rounded once to W's dtype."""
    gq, xq = grad_weight_operands(g2, x2)
    return (gq.t() @ xq).to(w.dtype)


def high_precision_grad_weight(g2: torch.Tensor, x2: torch.Tensor, w: torch.Tensor, p: Any,
                               s: Any) -> torch.Tensor:
    """``rowwise_with_gw_hp``'s ``dW = g^T x``: the operands as given (no fp8), fp32 sums, rounded once to W's
    dtype: what a bf16 GEMM with fp32 accumulation computes. Needs no TP agreement: nothing is scaled."""
    return (g2.float().t() @ x2.float()).to(w.dtype)
