"""DeepSeek-V3's blockwise fp8 (``tessera.parallel.blockwise_fp8``) against references written here in fp64.

- The scale: brute force over the powers of two (the largest ``2**e`` with ``amax * 2**e <= fmt_max``; 1 for a
  zero block), on blocks whose amax is exactly a power of two, exactly ``fmt_max * 2**-k``, one fp32 ulp either
  side, tiny (fp32's largest power of two caps the scale) and huge; and the DeepSeek / Transformer Engine rule
  (the fp32 quotient ``fmt_max / amax`` with its mantissa dropped) on every neighbour of the edges and 10**5 random
  amaxes: the same scales.
- The elements: a round-to-nearest-even onto the fp8 grid written in fp64 (no fp8 cast), per block by loops,
  the last block ragged (no padding in the reference): the quantizer's values bit for bit.
- The routes: forward and data gradient multiply the same quantized weight; each route equals the fp64 GEMM of the
  reference's operands within the bound of its arithmetic (derived at ``_gemm_bound``), and a wrong block shape
  breaks that bound; ``high_precision_grad_weight`` is the fp32 GEMM of the unquantized operands.
- TP: shards of whole 128-blocks (column- and row-parallel, simulated by slicing) quantize to the same bits as
  TP=1; a shard of 192 does not, and the routes refuse it.
- torchao 0.18's ``blockwise_fp8_training`` reference quantizers, where the two definitions agree (see
  ``test_torchao_agrees_where_its_scales_are_powers_of_two``).
"""

from __future__ import annotations

import ast
import importlib.util
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tessera.parallel.blockwise_fp8 import (
    ACT_BLOCK,
    TOKEN_BLOCK,
    WEIGHT_BLOCK,
    blockwise_forward,
    blockwise_grad_input,
    blockwise_grad_weight,
    blockwise_scales,
    forward_operands,
    grad_input_operands,
    grad_weight_operands,
    high_precision_grad_weight,
    quantize_blockwise,
    scaled_blockwise,
    weight_operand,
)
from tessera.parallel.fp8 import E4M3, E5M2, quantize
from tessera.parallel.gemm import NO_SPLIT, GemmPolicy, TpSplit

P = GemmPolicy()  # the routes read nothing from the policy
FP8 = {E4M3: (3, -6, 448.0), E5M2: (2, -14, 57344.0)}  # mantissa bits, smallest normal exponent, largest value
BF16_U = 2.0**-8  # bf16's unit roundoff (8 significant bits)
FP32_U = 2.0**-24


# ------------------------------------------------------------------------------------------ fp64 references
def ref_scale(amax: float, fmax: float) -> float:
    """The largest power of two ``s`` with ``amax * s <= fmax``, by trying them all from fp32's largest down;
    1 for a zero block. ``ldexp`` of a float64 is exact here."""
    if amax == 0:
        return 1.0
    return next(2.0**e for e in range(127, -200, -1) if math.ldexp(amax, e) <= fmax)


def ref_round(v: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """fp64 ``v`` (within range) rounded to nearest, ties to even, onto ``fmt``'s grid: the ulp at ``|v|`` is
    ``2**(floor(log2|v|) - mantissa bits)``, constant below the smallest normal (subnormals)."""
    bits, emin, fmax = FP8[fmt]
    assert bool((v.abs() <= fmax).all()), "a power-of-two scale keeps every element in range"
    _, e = torch.frexp(v.abs())  # |v| = m 2**e, m in [0.5, 1): floor(log2|v|) = e - 1
    ulp = torch.ldexp(torch.ones_like(v), (e - 1).clamp(min=emin) - bits)
    return torch.round(v / ulp) * ulp


def ref_quantize(t: torch.Tensor, fmt: torch.dtype, block: tuple[int, int]) -> torch.Tensor:
    """``t`` quantized block by block in fp64, the last blocks ragged: the quantizer's meaning, written plainly."""
    t64, out = t.double(), torch.empty(t.shape, dtype=torch.float64)
    fmax = FP8[fmt][2]
    for i in range(0, t.shape[0], block[0]):
        for j in range(0, t.shape[1], block[1]):
            blk = t64[i:i + block[0], j:j + block[1]]
            s = ref_scale(float(blk.abs().max()), fmax)
            out[i:i + block[0], j:j + block[1]] = ref_round(blk * s, fmt) / s
    return out


def te_scale(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    """DeepSeek-V3's / Transformer Engine's power-of-two scale: ``fmax / amax`` in fp32 (inf -> fp32's max, zero
    amax -> 1) with its mantissa bits dropped."""
    q = torch.where(amax == 0, torch.ones_like(amax), torch.tensor(fmax, dtype=torch.float32) / amax)
    q = torch.where(torch.isinf(q), torch.tensor(torch.finfo(torch.float32).max), q)
    return (q.view(torch.int32) & 0x7F800000).view(torch.float32)


def with_block_amax(shape: tuple[int, int], block: tuple[int, int], amaxes: torch.Tensor,
                    seed: int = 0) -> torch.Tensor:
    """fp32 random normal ``shape`` whose blocks have exactly ``amaxes`` (one per block) as their amax."""
    t = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    tiles = t.reshape(shape[0] // block[0], block[0], shape[1] // block[1], block[1])
    amax = tiles.abs().amax(dim=(1, 3), keepdim=True)
    tiles = tiles / amax * amaxes.reshape(amax.shape)  # the argmax reads 1 * target exactly, the rest at most that
    return tiles.reshape(shape)


def edge_amaxes(fmax: float) -> torch.Tensor:
    """Amaxes at the edges of the rule: 0, powers of two, ``fmax * 2**-k`` and their fp32 neighbours, the
    tiny ones (the cap at 2**127) and the huge ones."""
    exact = [fmax * 2.0**-k for k in (-20, -1, 0, 1, 3, 10, 40)] + [2.0**k for k in (-60, -20, -1, 0, 1, 8, 100)]
    t = torch.tensor(exact, dtype=torch.float32)
    inf = torch.full_like(t, math.inf)
    extra = torch.tensor([0.0, 1e-37, 1e-40, 2.0**-149, 3e38, torch.finfo(torch.float32).max, 1.5, 0.3])
    return torch.cat([t, torch.nextafter(t, inf), torch.nextafter(t, -inf), extra])


# ------------------------------------------------------------------------------------------ the scale
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_scale_is_the_largest_power_of_two_keeping_the_block_in_range(fmt):
    fmax = FP8[fmt][2]
    amaxes = edge_amaxes(fmax)
    t = with_block_amax((len(amaxes), 256), (1, 256), amaxes)
    t[amaxes == 0] = 0.0
    scales = blockwise_scales(t, fmt, ACT_BLOCK)  # two 1 x 128 blocks per row: the amax sits in one of them
    amax = t.abs().reshape(len(amaxes), 2, 128).amax(dim=2)
    ref = torch.tensor([[ref_scale(float(a), fmax) for a in row] for row in amax], dtype=torch.float64)
    assert torch.equal(scales.double(), ref)
    mant, _ = torch.frexp(scales)
    assert bool((mant == 0.5).all()), "every scale is a power of two"
    a64, s64 = amax.double(), scales.double()
    assert bool((a64 * s64 <= fmax).all()), "within range"
    capped = s64 == 2.0**127
    largest = (a64 * s64 * 2 > fmax) | (a64 == 0) | capped
    assert bool(largest.all()), "no larger power of two keeps the block in range"
    assert bool((s64[a64 == 0] == 1).all()) and bool(capped.any()), "zero blocks read 1; the cap is exercised"


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_the_exact_rule_equals_the_fp32_quotient_with_its_mantissa_dropped(fmt):
    """The module says its exact exponent arithmetic is DeepSeek's / TE's rule for every finite fp32 amax;
    checked on every ulp neighbour of ``fmax * 2**-k`` and of ``2**k`` and on 10**5 random amaxes."""
    fmax = FP8[fmt][2]
    g = torch.Generator().manual_seed(1)
    edges = torch.tensor([fmax * 2.0**-k for k in range(-100, 140)] + [2.0**k for k in range(-149, 128)])
    edges = edges[torch.isfinite(edges) & (edges > 0)]
    near = [edges]
    for direction in (math.inf, -math.inf):
        t = edges
        for _ in range(3):
            t = torch.nextafter(t, torch.full_like(t, direction))
            near.append(t)
    random = torch.exp2(torch.empty(100_000).uniform_(-140, 127, generator=g)) * torch.rand(100_000, generator=g)
    amax = torch.cat([*near, random, torch.tensor([0.0])])
    amax = amax[torch.isfinite(amax)].reshape(-1, 1)
    assert torch.equal(blockwise_scales(amax, fmt, (1, 1)), te_scale(amax, fmax))


# ------------------------------------------------------------------------------------------ the elements
def awkward(shape: tuple[int, int], seed: int = 0) -> torch.Tensor:
    """Heavy-tailed fp32 data with an outlier, a zero region and magnitudes from 1e-6 to 1e4."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-20, 14, shape, generator=g).float())
    t[0, 3] = 3.0e4
    t[-5:, :140] = 0.0  # whole zero blocks (and partly zero ones) in every block shape
    return t


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("block", [ACT_BLOCK, WEIGHT_BLOCK, TOKEN_BLOCK])
def test_quantize_equals_the_fp64_reference_bit_for_bit(fmt, block):
    t = awkward((260, 300))  # neither dim a whole number of blocks: padded, then cut back
    ours = quantize_blockwise(t, fmt, block)
    assert ours.dtype == torch.float32 and ours.shape == t.shape
    assert torch.equal(ours, ref_quantize(t, fmt, block).float())
    q, scales = scaled_blockwise(t, fmt, block)
    assert q.dtype == fmt and q.shape == t.shape and torch.equal(scales, blockwise_scales(t, fmt, block))
    per_element = scales.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:260, :300]
    assert torch.equal(q.float() / per_element, ours), "the dequantized values are the fp8 values over their scale"
    b16 = t.bfloat16()
    assert torch.equal(quantize_blockwise(b16, fmt, block), ref_quantize(b16, fmt, block).float())


def test_a_block_holding_inf_or_nan_reads_nan_and_the_others_are_untouched():
    t = awkward((4, 384))
    t[1, 130], t[2, 5] = math.inf, math.nan
    ours = quantize_blockwise(t, E4M3, ACT_BLOCK)
    bad = torch.zeros(4, 384, dtype=torch.bool)
    bad[1, 128:256], bad[2, :128] = True, True
    assert bool(ours[bad].isnan().all()), "the overflow reaches the loss scaler's check (no saturation to 448)"
    clean = t.clone()
    clean[bad] = 0.0
    assert torch.equal(ours[~bad], quantize_blockwise(clean, E4M3, ACT_BLOCK)[~bad])


# ------------------------------------------------------------------------------------------ the routes
def operands(seed: int = 0, tokens: tuple[int, int] = (2, 100), n_in: int = 300, n_out: int = 260) -> dict:
    """bf16 x, W, b, g of a linear (the token count and both widths ragged against 128), with outlier channels and
    tokens: scales of ``2**U(-6, 6)`` per feature (and ``2**U(-4, 4)`` per token). With power-of-two scales an
    element in fp8's normal range rounds the same whatever its block's scale, so only a range like this, wider than
    fp8's normal range within a block, shows which block shape a quantizer used."""
    g = torch.Generator().manual_seed(seed)

    def spread(n: int, bits: float = 6.0) -> torch.Tensor:
        return torch.exp2(torch.empty(n).uniform_(-bits, bits, generator=g))

    n_tok = tokens[0] * tokens[1]
    x = torch.randn(n_tok, n_in, generator=g) * spread(n_in) * spread(n_tok, 4).unsqueeze(1)
    w = torch.randn(n_out, n_in, generator=g) * 0.05 * spread(n_out).unsqueeze(1) * spread(n_in)
    dy = torch.randn(n_tok, n_out, generator=g) * 1e-3 * spread(n_out) * spread(n_tok, 4).unsqueeze(1)
    return {"x": x.reshape(*tokens, n_in).bfloat16(), "w": w.bfloat16(),
            "b": torch.randn(n_out, generator=g).bfloat16(), "g": dy.reshape(*tokens, n_out).bfloat16()}


def test_forward_and_data_gradient_multiply_the_same_quantized_weight():
    o = operands()
    x2, g2, w = o["x"].reshape(-1, 300), o["g"].reshape(-1, 260), o["w"]
    xq, w_fwd = forward_operands(x2, w)
    gq, w_dgrad = grad_input_operands(g2, w)
    assert torch.equal(w_fwd, w_dgrad) and torch.equal(w_fwd, weight_operand(w))
    # a 128 x 128 block is the same block of W^T: quantizing W^T gives the transpose of quantizing W
    assert torch.equal(quantize_blockwise(w.t(), E4M3, WEIGHT_BLOCK), w_fwd.t())
    # ... which 1 x 128 blocks are not (a 1-D block weight per GEMM): here ~3% of the elements differ (those pushed
    # below fp8's normal range in one orientation only), so the bitwise checks below can fail
    along_in, along_out = quantize_blockwise(w, E4M3, ACT_BLOCK), quantize_blockwise(w.t(), E4M3, ACT_BLOCK).t()
    assert (along_in != along_out).float().mean() > 0.01
    # the routes multiply exactly that weight
    assert torch.equal(blockwise_forward(o["x"], w, None, P, NO_SPLIT),
                       (xq @ w_fwd.t()).bfloat16().reshape(2, 100, 260))
    assert torch.equal(blockwise_grad_input(o["g"], o["x"], w, P, NO_SPLIT),
                       (gq @ w_fwd).bfloat16().reshape(2, 100, 300))


def gemm_bound(ref: torch.Tensor, abs_sum: torch.Tensor, k: int) -> torch.Tensor:
    """How far a route's output may lie from the fp64 GEMM ``ref`` of the same dequantized operands.

    The products of two dequantized fp8 values (4 significant bits each, times powers of two) are exact in fp32;
    summing ``k`` of them (any order, any blocking) and adding the bias in fp32 errs by at most
    ``gamma_(k+1) * abs_sum`` with ``gamma_n = n u / (1 - n u) ~ n 2**-24`` and ``abs_sum = sum |a||b| + |bias|``;
    rounding that to bf16 adds at most ``2**-8`` of its magnitude. So
    ``|out - ref| <= 2**-8 |ref| + (1 + 2**-8) gamma_(k+1) abs_sum``; 1.01 covers both ``1 + ...`` factors."""
    return BF16_U * ref.abs() + 1.01 * (k + 1) * FP32_U * abs_sum


def check_route(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """``out`` (bf16) against the fp64 ``a @ b (+ bias)`` within ``gemm_bound``."""
    ref, abs_sum = a @ b, a.abs() @ b.abs()
    if bias is not None:
        ref, abs_sum = ref + bias.double(), abs_sum + bias.double().abs()
    err = (out.double().reshape(ref.shape) - ref).abs()
    bound = gemm_bound(ref, abs_sum, a.shape[1])
    assert bool((err <= bound).all()), f"worst excess {float((err - bound).max()):.3g}"


def test_the_routes_equal_the_fp64_reference_within_the_output_rounding():
    o = operands()
    x2, g2, w, b = o["x"].reshape(-1, 300), o["g"].reshape(-1, 260), o["w"], o["b"]
    xq, wq = ref_quantize(x2, E4M3, (1, 128)), ref_quantize(w, E4M3, (128, 128))
    check_route(blockwise_forward(o["x"], w, b, P, NO_SPLIT), xq, wq.t(), b)
    check_route(blockwise_grad_input(o["g"], o["x"], w, P, NO_SPLIT), ref_quantize(g2, E4M3, (1, 128)), wq)
    dw = blockwise_grad_weight(g2, x2, w, P, NO_SPLIT)
    assert dw.dtype == w.dtype
    check_route(dw, ref_quantize(g2.t(), E4M3, (1, 128)), ref_quantize(x2, E4M3, (128, 1)))
    # the bound is tight enough to catch a wrong block: W in 1 x 128 blocks instead of 128 x 128
    wrong = (x2.float() @ quantize_blockwise(w, E4M3, ACT_BLOCK).t() + b.float()).bfloat16()
    with pytest.raises(AssertionError, match="worst excess"):
        check_route(wrong, xq, wq.t(), b)


def test_high_precision_weight_gradient_is_the_fp32_gemm_of_the_unquantized_operands():
    o = operands(seed=3)
    x2, g2, w = o["x"].reshape(-1, 300), o["g"].reshape(-1, 260), o["w"]
    dw = high_precision_grad_weight(g2, x2, w, P, NO_SPLIT)
    assert dw.dtype == torch.bfloat16 and torch.equal(dw, (g2.float().t() @ x2.float()).bfloat16())
    # bf16 operands have 8 significant bits: their products are exact in fp32, so the same bound holds
    check_route(dw, g2.double().t(), x2.double())
    # and it sees no fp8: rowwise fp8 operands (the recipe's other GEMMs) break the bound
    fp8_dw = (quantize(g2, E5M2, 1).t() @ quantize(x2, E4M3, 1)).bfloat16()
    with pytest.raises(AssertionError, match="worst excess"):
        check_route(fp8_dw, g2.double().t(), x2.double())
    assert high_precision_grad_weight(g2, x2, w.float(), P, NO_SPLIT).dtype == torch.float32, "W's dtype"


# ------------------------------------------------------------------------------------------ tensor parallelism
def halves(n: int) -> list[slice]:
    return [slice(0, n // 2), slice(n // 2, n)]


def test_column_parallel_shards_quantize_as_tp1():
    """W's rows (and g's features) in two shards of 256: every operand bit for bit the TP=1 operand's slice, and
    each shard's output (a slice of y and dW, a partial sum of dx) the fp64 product of those slices within
    ``gemm_bound``."""
    o = operands(n_out=512)
    x2, g2, w, b = o["x"].reshape(-1, 300), o["g"].reshape(-1, 512), o["w"], o["b"]
    split = TpSplit(w_split_out=True)
    full_x, full_w = forward_operands(x2, w)
    full_g = grad_input_operands(g2, w)[0]
    full_gt, full_xt = grad_weight_operands(g2, x2)
    for rows in halves(512):
        assert torch.equal(weight_operand(w[rows]), full_w[rows])
        assert torch.equal(grad_input_operands(g2[:, rows], w[rows])[0], full_g[:, rows])
        gq, xq = grad_weight_operands(g2[:, rows], x2)
        assert torch.equal(gq, full_gt[:, rows]) and torch.equal(xq, full_xt)
        check_route(blockwise_forward(o["x"], w[rows], b[rows], P, split), full_x.double(),
                    full_w[rows].t().double(), b[rows])
        check_route(blockwise_grad_input(o["g"][..., rows], o["x"], w[rows], P, split),
                    full_g[:, rows].double(), full_w[rows].double())
        check_route(blockwise_grad_weight(g2[:, rows], x2, w[rows], P, split),
                    full_gt[:, rows].t().double(), full_xt.double())


def test_row_parallel_shards_quantize_as_tp1():
    """W's columns and x's features in two shards of 256: the operands bit for bit TP=1's slices, each partial
    output the fp64 product of those slices (their sum is TP=1's product) within ``gemm_bound``."""
    o = operands(n_in=512)
    x2, g2, w = o["x"].reshape(-1, 512), o["g"].reshape(-1, 260), o["w"]
    split = TpSplit(x_split_in=True, w_split_in=True)
    full_x, full_w = forward_operands(x2, w)
    full_g = grad_input_operands(g2, w)[0]
    full_gt, full_xt = grad_weight_operands(g2, x2)
    for cols in halves(512):
        xq, wq = forward_operands(x2[:, cols], w[:, cols])
        assert torch.equal(xq, full_x[:, cols]) and torch.equal(wq, full_w[:, cols])
        assert torch.equal(grad_input_operands(g2, w[:, cols])[0], full_g)
        gq, xq_t = grad_weight_operands(g2, x2[:, cols])
        assert torch.equal(gq, full_gt) and torch.equal(xq_t, full_xt[:, cols])
        check_route(blockwise_forward(o["x"][..., cols], w[:, cols], None, P, split), full_x[:, cols].double(),
                    full_w[:, cols].t().double())
        check_route(blockwise_grad_input(o["g"], o["x"][..., cols], w[:, cols], P, split), full_g.double(),
                    full_w[:, cols].double())
        check_route(blockwise_grad_weight(g2, x2[:, cols], w[:, cols], P, split), full_gt.t().double(),
                    full_xt[:, cols].double())


def test_a_shard_that_is_not_whole_blocks_differs_and_is_refused():
    o = operands(n_out=384)
    w = o["w"].clone()
    w[200, 0] = 10.0  # an outlier in the TP=1 block of rows 128..255, outside a 192-row shard's last block
    assert not torch.equal(weight_operand(w[:192]), weight_operand(w)[:192])
    with pytest.raises(ValueError, match="not a multiple of 128"):
        blockwise_forward(o["x"], w[:192], None, P, TpSplit(w_split_out=True))
    with pytest.raises(ValueError, match="not a multiple of 128"):
        blockwise_grad_input(o["g"][..., :192], o["x"], w[:192], P, TpSplit(w_split_out=True))
    with pytest.raises(ValueError, match="row-parallel"):
        blockwise_forward(o["x"][..., :150], w[:, :150], None, P, TpSplit(x_split_in=True, w_split_in=True))
    assert blockwise_forward(o["x"], w[:192], None, P, NO_SPLIT).shape == (2, 100, 192), "unsplit: padded"


# ------------------------------------------------------------------------------------------ torchao
TORCHAO_REFS = ("torch_blockwise_scale_act_quant_lhs", "torch_blockwise_scale_act_quant_rhs",
                "torch_blockwise_scale_weight_quant")


@pytest.fixture(scope="module")
def torchao_refs() -> dict[str, Callable[..., Any]]:
    """torchao's pure-torch blockwise quantizers, read from its source. ``kernels.py`` imports triton at the top
    (absent on CPU machines), so the three functions and the constants they use are compiled alone."""
    spec = importlib.util.find_spec("torchao")
    if spec is None or spec.origin is None:
        pytest.skip("torchao is not installed")
    path = Path(spec.origin).parent / "prototype" / "blockwise_fp8_training" / "kernels.py"
    if not path.exists():
        pytest.skip(f"this torchao has no {path.name} in prototype/blockwise_fp8_training")
    tree = ast.parse(path.read_text())
    keep = [n for n in tree.body if (isinstance(n, ast.FunctionDef) and n.name in TORCHAO_REFS)
            or (isinstance(n, ast.Assign) and any(getattr(t, "id", "") in ("EPS", "FP8_E4M3_DTYPES")
                                                  for t in n.targets))]
    namespace: dict[str, Any] = {"torch": torch, "Tuple": tuple, "e4m3_dtype": E4M3}
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(path), "exec"), namespace)
    missing = [n for n in TORCHAO_REFS if n not in namespace]
    if missing:
        pytest.skip(f"torchao's reference quantizers changed: {missing} not found")
    return namespace


def torchao_dequantized(refs: dict, t: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's (fp8 values, per-element scale) of ``t`` in ``block``s: its scale is the reciprocal it returns."""
    name = {ACT_BLOCK: TORCHAO_REFS[0], TOKEN_BLOCK: TORCHAO_REFS[1], WEIGHT_BLOCK: TORCHAO_REFS[2]}[block]
    q, inv = refs[name](t.contiguous(), 128, E4M3)
    inv = inv.reshape(t.shape[0] // block[0], t.shape[1] // block[1])
    return q, inv.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)


@pytest.mark.parametrize("block", [ACT_BLOCK, WEIGHT_BLOCK, TOKEN_BLOCK])
def test_torchao_agrees_where_its_scales_are_powers_of_two(torchao_refs, block):
    """torchao 0.18's reference (``torch_blockwise_scale_*``, the numerics of its triton kernels) takes the scale
    ``fp8_max / amax`` itself, computed in fp64 and rounded to fp32, with no power-of-two option; it clamps the
    amax at 1e-12 (a zero block gets scale 4.48e14, not 1: the same zeros), clamps the scaled values to the
    format's range (ours need no clamp) and needs whole blocks (no padding). The definitions agree when
    ``fp8_max / amax`` is a power of two: on such blocks, and zero blocks, the fp8 bytes and the dequantized
    values are the same bit for bit. Elsewhere torchao's scale is larger than ours by less than 2x (it fills the
    range; ours rounds down to a power of two), and the values differ."""
    shape = (256, 384)
    n_blocks = (shape[0] // block[0]) * (shape[1] // block[1])
    k = torch.randint(-12, 12, (n_blocks,), generator=torch.Generator().manual_seed(2))
    t = with_block_amax(shape, block, 448.0 * torch.exp2(k.float()))
    t[:block[0], :block[1]] = 0.0  # one zero block
    q_ao, inv = torchao_dequantized(torchao_refs, t, block)
    q, _ = scaled_blockwise(t, E4M3, block)
    assert torch.equal(q.view(torch.uint8), q_ao.view(torch.uint8))
    assert torch.equal(q_ao.float() * inv, quantize_blockwise(t, E4M3, block))
    # generic data: torchao's scale in [ours, 2 * ours], not a power of two, other values
    t = awkward(shape)
    _, inv = torchao_dequantized(torchao_refs, t, block)
    ours = blockwise_scales(t, E4M3, block).repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    theirs = 1 / inv.double()
    live = ours != 1  # not a zero block (awkward data has no other block scaled by exactly 1)
    assert bool(live.any()) and bool((theirs >= ours).all()) and bool((theirs[live] <= 2 * ours[live]).all())
    assert bool((torch.frexp(theirs[live])[0] != 0.5).any()), "torchao's scales are not powers of two"
    q_ao, inv = torchao_dequantized(torchao_refs, t, block)
    assert not torch.equal(q_ao.float() * inv, quantize_blockwise(t, E4M3, block))
