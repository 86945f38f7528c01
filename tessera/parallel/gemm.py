"""The GEMM routes of a linear layer: every way ``y = x W^T + b`` and its two backward GEMMs can run, in one table.

A route (``GemmRoute``, the rows of ``ROUTES`` below) names its forward GEMM, its two backward GEMMs
(the input's gradient ``dx = g W``, the weight's ``dW = g^T x``), whether the weight's can be added
straight into an fp32 main gradient (``tessera.parallel.wgrad``), and whether sequence parallelism may
keep only the sequence chunk of its input. ``choose_route(device type, dtype, policy)`` picks the row;
the CPU's kernel choice behind it is made once per process (``tessera.parallel.cpu_kernels``), so a
(device, dtype, policy) always gets the same route, logged the first time.

==============  ===========================  =================================  ========================  ========
route           serves                       forward / backward GEMMs           sums                      adds into
                                                                                                          main grad
==============  ===========================  =================================  ========================  ========
native          every device and dtype the   torch's kernels in the operands'   the kernels'              yes
                other rows leave             dtype (``F.linear``; autograd's                              (where an
                                             backward unless fused)                                       fp32-output
                                                                                                          GEMM exists)
cpu-upcast      bf16/fp16 on a CPU without   fp32 GEMMs on upcast operands,     fp32, output rounded to   yes
                avx512_bf16/AMX (or          results rounded to the dtype       the dtype once
                TESSERA_CPU_LOWP_MATMUL)
fp8-emulated    policy ``fp8``, backend      operands quantized (e4m3 forward,  fp32, output rounded to   no
                ``emulated`` (or ``auto``    e5m2 gradients) and dequantized,   the dtype once
                without fp8 tensor cores)    then fp32 GEMMs (``fp8.quantize``)
fp8-scaled-mm   policy ``fp8``, backend      ``torch._scaled_mm`` on the same   fp32 in the kernel, times no
                ``scaled_mm`` (or ``auto``   fp8 operands and scales (second    the inverse scales,
                on CUDA sm_89+)              operand column-major)              rounded once
mxfp8-emulated  policy ``block``, recipe     operands in MXFP8 (E4M3, E8M0      fp32, output rounded to   no
                ``mxfp8``, any device        scale per 32) along each GEMM's    the dtype once
                                             reduction dim, dequantized
nvfp4-emulated  policy ``block``, recipe     operands in NVFP4 (E2M1, E4M3      fp32, output rounded to   no
                ``nvfp4``, any device        scale per 16, fp32 per tensor      the dtype once
                                             agreed over TP), as above
==============  ===========================  =================================  ========================  ========

A layer holds a ``GemmPolicy`` (what it asks for: the model's dtype, fp8 with a scaling recipe and a backend, or
a block format with its recipe) and a
``TpSplit`` (which dims TP splits: the fp8 scales agree over them) and calls ``linear``; it never looks
at the route. Code that writes its own backward (sequence parallelism's linears, the chunked head and
loss) uses ``linear_no_autograd`` and ``linear_grads``, the same route's GEMMs. A new number format is a
new policy value and a new row here (with its own three GEMMs); the layers do not change.

Every route runs through one autograd Function (``_RoutedLinear``), whose backward is ``linear_grads``.
The one exception is deliberate: the native route with no fusion possible is plain ``F.linear``, so
autograd's own backward runs, as it would without tessera.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tessera import hardware
from tessera.logs import log_once
from tessera.parallel import blockwise_fp8, wgrad
from tessera.parallel.block_formats import BLOCK_RECIPES, SCALE_ROUNDINGS, BlockStats
from tessera.parallel.cpu_kernels import upcast_on_cpu
from tessera.parallel.fp8 import E4M3, E5M2, RECIPES, Observe, quantize, scaled
from tessera.parallel.hadamard import rht
from tessera.parallel.quantizer_kernels import fake_quantize, fake_quantize_nvfp4_2d, fake_quantize_with_stats
from tessera.parallel.recipe_state import RecipeState, RecipeStream
from tessera.parallel.wgrad import fused_main_grad, placeholder

__all__ = ["BACKENDS", "BLOCK_FORMATS", "BlockObserve", "FORMATS", "GEMM_RECIPES", "KEEP_HIGH", "MODEL_DTYPE",
           "NO_OBSERVERS", "NO_SPLIT", "ROUTES", "SCALE_ROUNDINGS", "GemmObservers", "GemmPolicy", "GemmRoute",
           "RecipeState", "RecipeSwitches", "TpSplit", "add_route", "block_size", "choose_route", "fp8_linear",
           "fp8_tensor_cores", "fuses_wgrad", "gemm_recipes", "linear", "linear_grads", "linear_no_autograd",
           "pick_route", "policy_for", "route_for", "wgrad_into_main"]


# GemmPolicy.format: the operands' own dtype, fp8 (e4m3 / e5m2; recipe tensorwise or rowwise), a block-scaled
# format (recipe mxfp8 or nvfp4), or a recipe that an added row of the table serves (``add_route``)
FORMATS = ("model", "fp8", "block", "custom")
BLOCK_FORMATS = ("mxfp8", "nvfp4")  # the block format's recipes
FP8_ROW_RECIPES = ("rowwise_with_gw_hp", "blockwise")  # fp8 recipes with rows of their own (emulated)
ROWWISE_RECIPES = ("rowwise", "rowwise_with_gw_hp")  # fp8 with per-row/column scales in the forward and dgrad
GEMM_RECIPES = (*RECIPES, *BLOCK_FORMATS, *FP8_ROW_RECIPES)  # the built-in recipes model.low_precision.recipe may name
KEEP_HIGH = ("bf16", "none")  # a model.low_precision.rules recipe that keeps the module in the model's dtype
BACKENDS = ("auto", "scaled_mm", "emulated")  # how the fp8 format's GEMMs run (model.low_precision.backend)
BlockObserve = Callable[[torch.Tensor, BlockStats], None]  # (fp32 operand, its quantization's BlockStats)



@dataclass(frozen=True)
class GemmPolicy:
    """What one linear asks of its GEMMs; ``choose_route`` reads it with the device and the dtype.

    ``format``: ``"model"`` (the operands' own dtype), ``"fp8"`` (``recipe``: ``"tensorwise"`` or
    ``"rowwise"`` scaling; ``backend``: ``"auto"``, ``"scaled_mm"`` or ``"emulated"``) or ``"block"``
    (``recipe``: ``"mxfp8"`` or ``"nvfp4"``, emulated on every device) or ``"custom"`` (a recipe an added row
    serves, ``add_route``). ``state`` is the recipe's own state for this linear (``RecipeState``; None: the
    recipe has none; no part of the choice, nor of equality). The telemetry's observers are not the policy's:
    they sit in their own slot on the layer (``GemmObservers``) and reach the forward GEMM beside it.
    """

    format: str = "model"
    recipe: str | None = None
    backend: str = "auto"
    scale_rounding: str = "floor"  # mxfp8's E8M0 scales: "floor" (OCP) or "rceil" (round up: NVIDIA, torchao)
    weight_2d: bool = False  # nvfp4: 16x16 weight blocks, one quantized weight for the forward and dgrad GEMMs
    hadamard: bool = False  # nvfp4: a 16-point random Hadamard transform of the wgrad GEMM's operands
    stochastic: bool = False  # block formats: gradients rounded stochastically (RecipeState's stream)
    forward_high: bool = False  # the forward GEMM in the model's dtype (the backward stays in the recipe)
    state: RecipeState | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"GEMM format {self.format!r}: must be one of {list(FORMATS)}")
        if self.format == "fp8" and self.recipe not in RECIPES:
            raise ValueError(f"fp8 recipe must be one of {list(RECIPES)}, got {self.recipe!r}")
        if self.format == "block" and self.recipe not in BLOCK_FORMATS:
            raise ValueError(f"block recipe must be one of {list(BLOCK_FORMATS)}, got {self.recipe!r}")
        if self.format == "custom" and self.recipe not in _ROW_RECIPES:
            raise ValueError(f"recipe {self.recipe!r} has no row in the GEMM route table (gemm.add_route)")
        if self.format == "model" and self.recipe is not None:
            raise ValueError(f"recipe={self.recipe!r} is a setting of the fp8 format, not of {self.format!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"fp8 backend must be one of {list(BACKENDS)}, got {self.backend!r}")
        self._check_switches()
        if self.format == "block" and self.backend == "scaled_mm":
            raise ValueError(f"model.low_precision.backend='scaled_mm' runs the fp8 recipes (tensorwise, rowwise); "
                             f"model.low_precision.recipe={self.recipe!r} is a block format: {self.recipe} has no "
                             "scaled_mm route, block formats are emulated on every device: use backend 'auto' or "
                             "'emulated'")

    def _check_switches(self) -> None:
        problem = _switch_problem(self)
        if problem:
            raise ValueError(problem)


def policy_for(recipe: str | None, backend: str = "auto", switches: RecipeSwitches | None = None) -> GemmPolicy:
    """The policy of a ``model.low_precision`` recipe: None (the model's dtype), ``tensorwise``/``rowwise`` (fp8 with
    ``backend``), a block format (``mxfp8``/``nvfp4``, emulated: ``backend`` is not theirs to choose) or a recipe
    with a row of its own; ``switches``: the recipe switches, each applied where the recipe has it."""
    if recipe is None:
        return MODEL_DTYPE
    if recipe in BLOCK_FORMATS:
        policy = GemmPolicy("block", recipe)
    elif recipe in _ROW_RECIPES and recipe not in RECIPES:
        policy = GemmPolicy("custom", recipe)
    else:
        policy = GemmPolicy("fp8", recipe, backend)
    return policy if switches is None else switches.apply(policy)


@dataclass(frozen=True)
class RecipeSwitches:
    """The published recipes' switches over the bare formats (``model.low_precision``), each given to the recipes
    that have it: MXFP8's scale rounding; NVFP4's 2D weight blocks and Hadamard-transformed wgrad operands; the
    block formats' stochastic rounding of gradients."""

    scale_rounding: str = "floor"
    weight_2d: bool = False
    hadamard: bool = False
    stochastic: bool = False

    def apply(self, policy: GemmPolicy) -> GemmPolicy:
        """``policy`` with the switches its recipe has."""
        if policy.format != "block":
            return policy
        nvfp4 = policy.recipe == "nvfp4"
        return dataclasses.replace(policy, scale_rounding="floor" if nvfp4 else self.scale_rounding,
                                   weight_2d=nvfp4 and self.weight_2d, hadamard=nvfp4 and self.hadamard,
                                   stochastic=self.stochastic)


def _switch_problem(p: GemmPolicy) -> str | None:
    """Why a policy's switches do not fit its recipe (None: they do)."""
    if p.scale_rounding not in SCALE_ROUNDINGS:
        return f"scale rounding must be one of {list(SCALE_ROUNDINGS)}, got {p.scale_rounding!r}"
    if p.scale_rounding != "floor" and p.recipe != "mxfp8":
        return f"scale rounding {p.scale_rounding!r} is MXFP8's switch, not {p.recipe}'s"
    if (p.weight_2d or p.hadamard) and p.recipe != "nvfp4":
        return f"2D weight blocks and the Hadamard transform are NVFP4's switches, not {p.recipe}'s"
    if p.stochastic and p.format != "block":
        return f"stochastic rounding of gradients is a block format's switch, not {p.recipe}'s"
    if p.forward_high and p.format == "model":
        return "forward_high applies to a low-precision recipe"
    return None


def gemm_recipes() -> tuple[str, ...]:
    """Every recipe ``model.low_precision.recipe`` may name: the built-in ones and those of rows added since import."""
    return (*GEMM_RECIPES, *(r for r in _ROW_RECIPES if r not in GEMM_RECIPES))


def block_size(policy: GemmPolicy) -> int | None:
    """Elements per scale block along each GEMM's reduction dim, which a TP shard's features must be a multiple of
    (None: scales that need no such tiling)."""
    if policy.format == "block" and policy.recipe:
        return BLOCK_RECIPES[policy.recipe][1]
    return blockwise_fp8.TILE if policy.recipe == "blockwise" else None


MODEL_DTYPE = GemmPolicy()


@dataclass(frozen=True)
class TpSplit:
    """Which dims of a linear's operands are split over the TP ``group``: the input's features (row-parallel),
    the weight's output rows (column-parallel; its output gradient too), the weight's input columns
    (row-parallel). The fp8 route takes an amax over a split dim as a MAX over the group."""

    group: Any = None
    x_split_in: bool = False
    w_split_out: bool = False
    w_split_in: bool = False


NO_SPLIT = TpSplit()

# the three GEMMs of a route: forward (x, W, b) -> y; input gradient (g, x, W) -> dx; weight gradient of the
# 2-D operands (g, x, W) -> dW in W's dtype (when not added into the main gradient)
Forward = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", GemmPolicy, TpSplit, "GemmObservers"],
                   torch.Tensor]


@dataclass(frozen=True)
class GemmObservers:
    """What the precision telemetry watches in a linear's forward GEMM: ``observe`` the fp8 input's quantization
    (scale, quantized values), ``observe_blocks`` a block format's (``BlockStats``). A slot of the layer of its own,
    set for a measured step and cleared after; the routes hand them to the quantizers and decide nothing by them."""

    observe: Observe | None = None
    observe_blocks: BlockObserve | None = None


NO_OBSERVERS = GemmObservers()
Backward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, GemmPolicy, TpSplit], torch.Tensor]


@dataclass(frozen=True)
class GemmRoute:
    """One row of the table: how a linear's three GEMMs run, and what the rest of the code may do with them.

    ``fp32_gemms``: the GEMMs (and the bias gradient's sum) run in fp32 on upcast or dequantized operands,
    results rounded to the tensors' dtype; False: in the operands' own dtype. ``sequence_chunked``: each row
    block of ``dx`` needs only that block of ``g``, so sequence parallelism may keep the input's chunk and
    compute ``dx`` chunk by chunk; False: the route keeps the gathered input (``tessera.parallel.sequence``).
    ``copy_bytes``: bytes per operand element its quantized or upcast copies add inside one backward GEMM (the
    memory plan's figure, calibrated with ``tools/memory_phases.py``); ``hardware``: what it needs to run at
    speed. ``recipe``: the ``model.low_precision.recipe`` a row serves by name (block and added recipes);
    ``make_state``: builds that recipe's per-linear ``RecipeState`` from (the run's seed, the layer's name).
    """

    name: str
    serves: str
    forward: Forward
    grad_input: Backward
    grad_weight: Backward
    adds_into_main_grad: bool
    fp32_gemms: bool
    sequence_chunked: bool
    doc: str
    copy_bytes: int = 0
    hardware: str = "any device"
    recipe: str | None = None
    make_state: Callable[[int, str], RecipeState] | None = None


# ------------------------------------------------------------------ native: torch's kernels
def _native_forward(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, p: GemmPolicy,
                    s: TpSplit, o: GemmObservers = NO_OBSERVERS) -> torch.Tensor:
    return F.linear(x, w, b)


def _native_grad_input(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, p: GemmPolicy, s: TpSplit) -> torch.Tensor:
    return (g @ w).to(x.dtype)


def _native_grad_weight(g2: torch.Tensor, x2: torch.Tensor, w: torch.Tensor, p: GemmPolicy,
                        s: TpSplit) -> torch.Tensor:
    return (g2.t() @ x2).to(w.dtype)


# ------------------------------------------------------------------ cpu-upcast: fp32 GEMMs on bf16/fp16 operands
def _upcast_forward(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, p: GemmPolicy,
                    s: TpSplit, o: GemmObservers = NO_OBSERVERS) -> torch.Tensor:
    return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)


def _upcast_grad_input(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, p: GemmPolicy, s: TpSplit) -> torch.Tensor:
    return (g.float() @ w.float()).to(x.dtype)


def _upcast_grad_weight(g2: torch.Tensor, x2: torch.Tensor, w: torch.Tensor, p: GemmPolicy,
                        s: TpSplit) -> torch.Tensor:
    return _native_grad_weight(g2.float(), x2.float(), w, p, s)


# ------------------------------------------------------------------ fp8-emulated (see tessera.parallel.fp8)
# Each operand gets its scales along the dims its GEMM keeps (rowwise) or one scale (tensorwise); where the
# dims an amax runs over include one split over TP, the amax is agreed over the group (TP=N computes TP=1).
def _fp8_forward(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, p: GemmPolicy,
                 s: TpSplit, o: GemmObservers = NO_OBSERVERS) -> torch.Tensor:
    rowwise = p.recipe in ROWWISE_RECIPES
    k = 0 if rowwise else None
    # x @ W^T: x per token (amax over in), W per output channel (amax over in)
    xq = quantize(x.reshape(-1, x.shape[-1]), E4M3, k, s.group, reduce_sharded=s.x_split_in, observe=o.observe)
    wq = quantize(w, E4M3, k, s.group, reduce_sharded=s.w_split_in if rowwise else (s.w_split_in or s.w_split_out))
    y = xq @ wq.t()
    if b is not None:
        y = y + b.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


def _fp8_grad_input(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, p: GemmPolicy, s: TpSplit) -> torch.Tensor:
    rowwise = p.recipe in ROWWISE_RECIPES
    # g @ W: g per token (amax over out; the column-parallel output gradient is split like W's rows),
    # W per input channel (amax over out)
    gq = quantize(g.reshape(-1, g.shape[-1]), E5M2, 0 if rowwise else None, s.group, reduce_sharded=s.w_split_out)
    w_cols = quantize(w, E4M3, 1 if rowwise else None, s.group,
                      reduce_sharded=s.w_split_out if rowwise else (s.w_split_in or s.w_split_out))
    return (gq @ w_cols).to(x.dtype).reshape(x.shape)


def _fp8_grad_weight(g2: torch.Tensor, x2: torch.Tensor, w: torch.Tensor, p: GemmPolicy, s: TpSplit) -> torch.Tensor:
    rowwise = p.recipe in ROWWISE_RECIPES
    # g^T @ x: g^T per output channel (amax over tokens), x per input channel (amax over tokens)
    gtq = quantize(g2, E5M2, 1 if rowwise else None, s.group, reduce_sharded=False if rowwise else s.w_split_out)
    x_cols = quantize(x2, E4M3, 1 if rowwise else None, s.group, reduce_sharded=False if rowwise else s.x_split_in)
    return (gtq.t() @ x_cols).to(w.dtype)


# ------------------------------------------------------------------ fp8-scaled-mm: the emulation's operands, _scaled_mm
# The operands and scales of the emulation (``fp8.scaled``), handed to the fp8 kernel: it multiplies the fp8 values
# exactly, sums in fp32, multiplies the sums by the inverse scales and rounds once to ``out_dtype``. Its second
# operand is column-major (``_col_major``); rowwise scales are ``[M, 1]`` for the first and ``[1, N]`` for the second.
def _col_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` with the same shape and values, stored column-major (what ``_scaled_mm`` wants of ``b``)."""
    return t.t().contiguous().t()


SCALED_MM_MULTIPLE = 16  # torch._scaled_mm wants the reduction dim and the second operand's columns in multiples


def _zero_padded(t: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    """``t`` with zeros appended along ``dim`` up to a multiple (fp8 tensors too: concatenated, not ``F.pad``)."""
    short = -t.shape[dim] % multiple
    if not short:
        return t
    shape = list(t.shape)
    shape[dim] = short
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def _scaled_mm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
               out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``(a / a_scale) @ (b / b_scale) + bias`` on fp8 ``a`` (row-major) and ``b`` (column-major). A reduction dim
    (the tokens of the weight gradient) or an output width that is not a multiple of 16 is padded with zeros (the
    kernel refuses it otherwise): zeros add nothing to a sum, and padded output columns are cut off. Scales along a
    padded dim do not exist (rowwise scales run along the kept dims), so they need no padding, except ``b``'s
    per-column scales, padded with ones."""
    n = b.shape[1]
    a, b = _zero_padded(a, 1, SCALED_MM_MULTIPLE), _zero_padded(b, 0, SCALED_MM_MULTIPLE)
    if n % SCALED_MM_MULTIPLE:
        b = _col_major(_zero_padded(b.t().contiguous(), 0, SCALED_MM_MULTIPLE).t())
        if b_scale.dim() == 2 and b_scale.shape[1] == n:
            b_scale = torch.cat([b_scale, b_scale.new_ones(1, b.shape[1] - n)], dim=1)
        bias = None if bias is None else torch.cat([bias, bias.new_zeros(b.shape[1] - n)])
    y = torch._scaled_mm(a, b, a_scale.reciprocal().contiguous(), b_scale.reciprocal().contiguous(),
                         bias=None if bias is None else bias.to(out_dtype), out_dtype=out_dtype)
    return y[:, :n] if y.shape[1] != n else y


def _scaled_forward(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, p: GemmPolicy,
                    s: TpSplit, o: GemmObservers = NO_OBSERVERS) -> torch.Tensor:
    rowwise = p.recipe in ROWWISE_RECIPES
    k = 0 if rowwise else None
    xq, xs = scaled(x.reshape(-1, x.shape[-1]), E4M3, k, s.group, reduce_sharded=s.x_split_in, observe=o.observe)
    wq, ws = scaled(w, E4M3, k, s.group, reduce_sharded=s.w_split_in if rowwise else (s.w_split_in or s.w_split_out))
    y = _scaled_mm(xq, xs, wq.t(), ws.t() if rowwise else ws, x.dtype, b)  # wq row-major: wq.t() is column-major
    return y.reshape(*x.shape[:-1], w.shape[0])


def _scaled_grad_input(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, p: GemmPolicy,
                       s: TpSplit) -> torch.Tensor:
    rowwise = p.recipe in ROWWISE_RECIPES
    gq, gs = scaled(g.reshape(-1, g.shape[-1]), E5M2, 0 if rowwise else None, s.group, reduce_sharded=s.w_split_out)
    wq, ws = scaled(w, E4M3, 1 if rowwise else None, s.group,
                    reduce_sharded=s.w_split_out if rowwise else (s.w_split_in or s.w_split_out))
    return _scaled_mm(gq, gs, _col_major(wq), ws, x.dtype).reshape(x.shape)


def _scaled_grad_weight(g2: torch.Tensor, x2: torch.Tensor, w: torch.Tensor, p: GemmPolicy,
                        s: TpSplit) -> torch.Tensor:
    rowwise = p.recipe in ROWWISE_RECIPES
    gq, gs = scaled(g2, E5M2, 1 if rowwise else None, s.group, reduce_sharded=False if rowwise else s.w_split_out)
    xq, xs = scaled(x2, E4M3, 1 if rowwise else None, s.group, reduce_sharded=False if rowwise else s.x_split_in)
    return _scaled_mm(gq.t().contiguous(), gs.t() if rowwise else gs, _col_major(xq), xs, w.dtype)


# ------------------------------------------------------------------ mxfp8- / nvfp4-emulated: block formats
# Each operand is cut into blocks along its GEMM's reduction dim: forward x and W along the input features,
# dx = g W along the output features, dW = g^T x along the tokens. A block never straddles a TP shard (the
# layers refuse a shard the block does not divide: ``enable_fp8_linears``), so MXFP8 needs no collective;
# NVFP4's per-tensor scale comes from the whole tensor's amax, a MAX over TP where the tensor is split. The
# tokens (dW's reduction dim) are padded with zeros to whole blocks: a zero changes no block's amax.
# Gradients use the forward's element format (E4M3 for MXFP8, E2M1 for NVFP4), as torchao's MX training and
# NVIDIA's MXFP8/NVFP4 recipes do: the per-block scale gives the range E5M2's extra exponent bit would.
def _block(t: torch.Tensor, p: GemmPolicy, dim: int, s: TpSplit, split: bool,
           observe: BlockObserve | None = None, pad: bool = False, *, gradient: bool = False,
           rotate: bool = False) -> torch.Tensor:
    """2-D ``t`` rounded to the block recipe ``p.recipe`` along ``dim`` and back, in fp32. ``gradient``: an output
    gradient, rounded stochastically under ``p.stochastic``; ``rotate``: a weight-gradient operand, Hadamard-
    transformed along the tokens (``dim`` 0) under ``p.hadamard`` first, and then kept at its padded length (the
    transform mixes the padding's zeros into the rows: the other operand is padded and transformed alike, and the
    orthogonal transform leaves their product unchanged)."""
    assert p.recipe is not None
    t = t.float()
    n = t.shape[dim]
    block = BLOCK_RECIPES[p.recipe][1]
    if pad and n % block:
        t = F.pad(t, (0, 0, 0, block - n % block) if dim == 0 else (0, block - n % block))
    rotated = rotate and p.hadamard
    if rotated:
        t = rht(t, _stream(p).signs.to(t.device), 0)
    amax = None
    if p.recipe == "nvfp4":
        amax = t.abs().amax()
        if split and s.group is not None and dist.get_world_size(s.group) > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=s.group)
    noise = _gradient_noise(t, p, s) if gradient and p.stochastic else None
    if observe is not None:
        q, stats = fake_quantize_with_stats(t, p.recipe, dim, amax, scale_rounding=p.scale_rounding, generator=noise)
        observe(t, stats)
    else:
        q = fake_quantize(t, p.recipe, dim, amax, scale_rounding=p.scale_rounding, generator=noise)
    return q if rotated else q.narrow(dim, 0, n)


def _stream(p: GemmPolicy) -> RecipeStream:
    """The linear's recipe stream (stochastic rounding, Hadamard signs): given to it when the model was built."""
    if not isinstance(p.state, RecipeStream):
        raise ValueError(f"{p.recipe} with stochastic rounding or the Hadamard transform needs its RecipeStream "
                         "(tessera.precision.linears gives each linear one); got none")
    return p.state


def _gradient_noise(g: torch.Tensor, p: GemmPolicy, s: TpSplit) -> torch.Tensor:
    """The uniforms that round output gradient ``g`` (tokens x features) stochastically: the linear's next draw
    for the whole gradient, of which a column-parallel shard (features split over TP) keeps its columns, so TP=N
    rounds every element as TP=1 does."""
    tp = dist.get_world_size(s.group) if s.w_split_out and s.group is not None else 1
    whole = _stream(p).uniform((g.shape[0], g.shape[1] * tp), g.device)
    if tp == 1:
        return whole
    return whole.narrow(1, dist.get_rank(s.group) * g.shape[1], g.shape[1])


def _block_weight(w: torch.Tensor, p: GemmPolicy, dim: int, s: TpSplit) -> torch.Tensor:
    """The weight as a block GEMM multiplies it: blocked along ``dim`` (the GEMM's reduction dim), or, with NVFP4's
    2D weight blocks, in 16x16 blocks: then the forward and the data-gradient GEMM get the same tensor. Its
    per-tensor amax is agreed over TP where the weight is split, as the 1-D blocks' is."""
    if not p.weight_2d:
        return _block(w, p, dim, s, s.w_split_in or s.w_split_out)
    amax = w.float().abs().amax()
    if (s.w_split_in or s.w_split_out) and s.group is not None and dist.get_world_size(s.group) > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=s.group)
    return fake_quantize_nvfp4_2d(w.float(), amax)


def _block_forward(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, p: GemmPolicy,
                   s: TpSplit, o: GemmObservers = NO_OBSERVERS) -> torch.Tensor:
    xq = _block(x.reshape(-1, x.shape[-1]), p, 1, s, s.x_split_in, o.observe_blocks)
    y = xq @ _block_weight(w, p, 1, s).t()
    if b is not None:
        y = y + b.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


def _block_grad_input(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, p: GemmPolicy, s: TpSplit) -> torch.Tensor:
    gq = _block(g.reshape(-1, g.shape[-1]), p, 1, s, s.w_split_out, gradient=True)
    return (gq @ _block_weight(w, p, 0, s)).to(x.dtype).reshape(x.shape)


def _block_grad_weight(g2: torch.Tensor, x2: torch.Tensor, w: torch.Tensor, p: GemmPolicy,
                       s: TpSplit) -> torch.Tensor:
    gq = _block(g2, p, 0, s, s.w_split_out, pad=True, gradient=True, rotate=True)
    return (gq.t() @ _block(x2, p, 0, s, s.x_split_in, pad=True, rotate=True)).to(w.dtype)


# ------------------------------------------------------------------ the table
NATIVE = GemmRoute(
    "native", "every device and dtype the rows below leave", _native_forward, _native_grad_input,
    _native_grad_weight, adds_into_main_grad=True, fp32_gemms=False, sequence_chunked=True,
    doc="torch's own kernels in the operands' dtype (fp32 accumulation inside bf16 GPU GEMMs)", copy_bytes=0)
CPU_UPCAST = GemmRoute(
    "cpu-upcast", "bf16/fp16 on CPUs without avx512_bf16/AMX (TESSERA_CPU_LOWP_MATMUL=native|upcast|auto)",
    _upcast_forward, _upcast_grad_input, _upcast_grad_weight, adds_into_main_grad=True, fp32_gemms=True,
    sequence_chunked=True,
    doc="fp32 GEMMs on the upcast operands, each result rounded once: a bf16 GEMM's meaning, at fp32 GEMM speed",
    copy_bytes=0, hardware="a CPU (the choice of tessera.parallel.cpu_kernels)")
FP8_EMULATED = GemmRoute(
    "fp8-emulated", "policy format 'fp8' (recipe tensorwise or rowwise), any device", _fp8_forward,
    _fp8_grad_input, _fp8_grad_weight, adds_into_main_grad=False, fp32_gemms=True, sequence_chunked=False,
    doc="operands rounded to e4m3 (forward) / e5m2 (gradients) with current-amax scales agreed over TP, "
        "dequantized, multiplied by fp32 GEMMs", copy_bytes=4)
FP8_SCALED_MM = GemmRoute(
    "fp8-scaled-mm", "policy format 'fp8', backend 'scaled_mm', or 'auto' on CUDA sm_89+", _scaled_forward,
    _scaled_grad_input, _scaled_grad_weight, adds_into_main_grad=False, fp32_gemms=True, sequence_chunked=False,
    doc="the emulation's fp8 operands and scales through torch._scaled_mm (fp8 tensor cores): exact products, fp32 "
        "sums scaled once, output in the model dtype", copy_bytes=3,
    hardware=f"CUDA sm_{''.join(map(str, hardware.FP8_TENSOR_CORES_FROM))}+ (fp8 tensor cores); elsewhere a slow "
             "reference kernel")
MXFP8_EMULATED = GemmRoute(
    "mxfp8-emulated", "policy format 'block', recipe 'mxfp8', any device", _block_forward, _block_grad_input,
    _block_grad_weight, adds_into_main_grad=False, fp32_gemms=True, sequence_chunked=False,
    doc="operands rounded to MXFP8 (E4M3, one E8M0 scale per 32 along each GEMM's reduction dim; gradients E4M3 "
        "too), dequantized, multiplied by fp32 GEMMs", copy_bytes=12, recipe="mxfp8")
NVFP4_EMULATED = GemmRoute(
    "nvfp4-emulated", "policy format 'block', recipe 'nvfp4', any device", _block_forward, _block_grad_input,
    _block_grad_weight, adds_into_main_grad=False, fp32_gemms=True, sequence_chunked=False,
    doc="operands rounded to NVFP4 (E2M1, one E4M3 scale per 16 along each GEMM's reduction dim, an fp32 "
        "per-tensor scale agreed over TP), dequantized, multiplied by fp32 GEMMs", copy_bytes=12, recipe="nvfp4")
FP8_ROWWISE_GW_HP = GemmRoute(
    "fp8-rowwise-gw-hp-emulated", "recipe 'rowwise_with_gw_hp', any device", _fp8_forward, _fp8_grad_input,
    blockwise_fp8.high_precision_grad_weight, adds_into_main_grad=False, fp32_gemms=True, sequence_chunked=False,
    doc="the forward and data-gradient GEMMs as fp8 rowwise (emulated); the weight-gradient GEMM on the unquantized "
        "operands, fp32 sums, rounded once (torchao's rowwise_with_gw_hp, TE's fp8_wgrad=False)",
    copy_bytes=4, recipe="rowwise_with_gw_hp")
FP8_BLOCKWISE = GemmRoute(
    "fp8-blockwise-emulated", "recipe 'blockwise', any device", blockwise_fp8.blockwise_forward,
    blockwise_fp8.blockwise_grad_input, blockwise_fp8.blockwise_grad_weight, adds_into_main_grad=False,
    fp32_gemms=True, sequence_chunked=False,
    doc="DeepSeek-V3's blockwise fp8: e4m3 operands with power-of-two scales per 1x128 (activations, gradients; "
        "128 tokens for the weight gradient) and per 128x128 (weights, one quantized weight for forward and dgrad), "
        "dequantized, fp32 GEMMs", copy_bytes=4, recipe="blockwise")
ROUTES: dict[str, GemmRoute] = {r.name: r for r in (NATIVE, CPU_UPCAST, FP8_EMULATED, FP8_SCALED_MM,
                                                     MXFP8_EMULATED, NVFP4_EMULATED, FP8_ROWWISE_GW_HP,
                                                     FP8_BLOCKWISE)}
_ROW_RECIPES: dict[str, str] = {r.recipe: r.name for r in ROUTES.values() if r.recipe}  # recipe -> route name
_FP8_CORES: dict[str, bool] = {}  # device type -> whether its (current) device has fp8 tensor cores


def add_route(route: GemmRoute) -> None:
    """Add a row to the table: a new recipe is one route (its three GEMMs, and ``make_state`` when it owns
    state) and this call; ``model.low_precision.recipe`` may then name ``route.recipe``. The layers do not change."""
    if route.name in ROUTES or route.recipe is None or route.recipe in (*RECIPES, *_ROW_RECIPES, *KEEP_HIGH):
        raise ValueError(f"route {route.name!r} (recipe {route.recipe!r}): the name and a new recipe must be unique")
    ROUTES[route.name] = route
    _ROW_RECIPES[route.recipe] = route.name


def fp8_tensor_cores(device_type: str) -> bool:
    """Whether ``device_type``'s current device multiplies fp8 on tensor cores (the hardware table's rule on
    its compute capability). Asked once per process (traced code reads the cached answer)."""
    if device_type not in _FP8_CORES:
        _FP8_CORES[device_type] = device_type == "cuda" and torch.cuda.is_available() \
            and hardware.fp8_tensor_cores(torch.cuda.get_device_capability())
    return _FP8_CORES[device_type]


def _fp8_route(device_type: str, backend: str, cores: bool) -> tuple[GemmRoute, str]:
    """The fp8 format's route under ``backend`` on ``device_type`` (``cores``: it has fp8 tensor cores), and why."""
    if backend == "emulated":
        return FP8_EMULATED, "model.low_precision.backend='emulated'"
    if backend == "scaled_mm":
        why = "model.low_precision.backend='scaled_mm'"
        if not cores:
            why += (f"; {device_type} has no fp8 tensor cores: torch._scaled_mm runs a reference kernel there, "
                    "with tensorwise scales 100x and more slower than the emulation (BENCHMARKS.md section 19)")
        return FP8_SCALED_MM, why
    if cores:
        return FP8_SCALED_MM, f"model.low_precision.backend='auto': {device_type} has fp8 tensor cores (sm_89+)"
    return FP8_EMULATED, (f"model.low_precision.backend='auto': {device_type} has no fp8 tensor cores "
                          "(torch._scaled_mm needs CUDA sm_89+ to be fast)")


def pick_route(device_type: str, dtype: torch.dtype | None, policy: GemmPolicy,
               fp8_cores: bool) -> tuple[GemmRoute, str]:
    """The route (and why, for fp8) of a linear on ``device_type`` whose operands are ``dtype`` under ``policy``,
    where the device has fp8 tensor cores or not: the one rule the run (``choose_route``) and the memory plan
    (``tessera.precision.routes``) both ask. No logging, no device probe."""
    if policy.format == "fp8":
        return _fp8_route(device_type, policy.backend, fp8_cores)
    if policy.format in ("block", "custom"):
        assert policy.recipe is not None
        return ROUTES[_ROW_RECIPES[policy.recipe]], ""
    if device_type == "cpu" and dtype is not None and upcast_on_cpu(dtype):
        return CPU_UPCAST, ""
    return NATIVE, ""


def choose_route(device_type: str, dtype: torch.dtype | None, policy: GemmPolicy = MODEL_DTYPE) -> GemmRoute:
    """The route of a linear on ``device_type`` whose operands are ``dtype`` (None: the input's and the
    weight's differ, torch's kernels decide) under ``policy``; logged the first time, with why for fp8."""
    route, why = pick_route(device_type, dtype, policy, fp8_tensor_cores(device_type) if policy.format == "fp8"
                            else False)
    if not torch.compiler.is_compiling():  # traced code reads the route as a constant (warm-up logged it)
        what = policy.format if policy.recipe is None else f"{policy.format} {policy.recipe}"
        slow = route is FP8_SCALED_MM and not fp8_tensor_cores(device_type)
        log_once(f"GEMMs of {str(dtype).split('.')[-1]} linears on {device_type} (format {what}): route {route.name}: "
                 f"{route.doc}" + (f" ({why})" if why else ""), logging.WARNING if slow else logging.INFO)
    return route


def route_for(x: torch.Tensor, weight: torch.Tensor, policy: GemmPolicy = MODEL_DTYPE) -> GemmRoute:
    """``choose_route`` for the input ``x`` and the ``weight`` of one linear."""
    return choose_route(x.device.type, x.dtype if x.dtype == weight.dtype else None, policy)


# ------------------------------------------------------------------ the entry point and its autograd Function
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, policy: GemmPolicy = MODEL_DTYPE,
           split: TpSplit = NO_SPLIT, observers: GemmObservers = NO_OBSERVERS) -> torch.Tensor:
    """``x W^T + b`` through the route ``policy`` gets here (see the module docstring); ``observers`` see the
    forward's quantization."""
    route = route_for(x, weight, policy)
    if route is NATIVE and not (torch.is_grad_enabled() and _may_fuse(x, weight)):
        return F.linear(x, weight, bias)  # autograd's own backward
    return _RoutedLinear.apply(x, weight, bias, route.name, policy, split, observers)


def _forward_of(route: GemmRoute, x: torch.Tensor, weight: torch.Tensor, policy: GemmPolicy) -> Forward:
    """The forward GEMM a linear runs: its route's, or the model dtype's where the policy asks for a high-precision
    forward (the published NVFP4 recipe's last stretch of training)."""
    if policy.forward_high:
        return pick_route(x.device.type, x.dtype if x.dtype == weight.dtype else None, MODEL_DTYPE, False)[0].forward
    return route.forward


class _RoutedLinear(torch.autograd.Function):
    """``x W^T + b`` through one route's forward GEMM; saves ``x`` and ``W`` as given (so the low-precision
    tensors, not upcast copies); the backward is the route's two GEMMs (``linear_grads``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, route: str,
                policy: GemmPolicy, split: TpSplit, observers: GemmObservers) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.route, ctx.policy, ctx.split = route, policy, split
        return _forward_of(ROUTES[route], x, weight, policy)(x, weight, bias, policy, split, observers)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        grads = _grads(ROUTES[ctx.route], grad, x, weight, ctx.has_bias, tuple(ctx.needs_input_grad[:3]),
                       ctx.policy, ctx.split)
        return (*grads, None, None, None, None)


def linear_no_autograd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       policy: GemmPolicy = MODEL_DTYPE, split: TpSplit = NO_SPLIT,
                       observers: GemmObservers = NO_OBSERVERS) -> torch.Tensor:
    """The forward of :func:`linear` for code that writes its own backward (``linear_grads``)."""
    return _forward_of(route_for(x, weight, policy), x, weight, policy)(x, weight, bias, policy, split, observers)


def linear_grads(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, has_bias: bool,
                 needs: tuple[bool, bool, bool], policy: GemmPolicy = MODEL_DTYPE,
                 split: TpSplit = NO_SPLIT) -> tuple[torch.Tensor | None, ...]:
    """Gradients of ``x W^T + b`` w.r.t. (x, W, b) where ``needs`` says so, by the route's backward GEMMs. A
    weight gradient added into the fp32 main gradient comes back as a placeholder (``tessera.parallel.wgrad``)."""
    return _grads(route_for(x, weight, policy), grad, x, weight, has_bias, needs, policy, split)


def _grads(route: GemmRoute, grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, has_bias: bool,
           needs: tuple[bool, ...], policy: GemmPolicy, split: TpSplit) -> tuple[torch.Tensor | None, ...]:
    gx = gw = gb = None
    if needs[0]:
        gx = route.grad_input(grad, x, weight, policy, split)
    if needs[1]:
        gw = _weight_gradient(route, grad, x, weight, policy, split)
    if has_bias and needs[2]:
        g = grad.float() if route.fp32_gemms else grad
        gb = g.reshape(-1, g.shape[-1]).sum(0).to(weight.dtype)
    return gx, gw, gb


# ------------------------------------------------------------------ the weight gradient into the fp32 main gradient
def _operand_dtype(route: GemmRoute, x: torch.Tensor) -> torch.dtype:
    """The dtype of the operands the route's weight-gradient GEMM multiplies."""
    return torch.float32 if route.fp32_gemms else x.dtype


def _may_fuse(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the native route's weight gradient may go into the main gradient (now, or in traced code)."""
    return fused_main_grad(weight, x.dtype) is not None or _traced_fusion(weight)


def _traced_fusion(weight: torch.Tensor) -> bool:
    """Inside traced code: whether ``weight``'s gradient goes through ``tessera::weight_grad``."""
    return torch.compiler.is_compiling() and wgrad.compiled_weight_grad is not None \
        and wgrad.fused_in_compiled_code(weight)


def _add_into_main(route: GemmRoute, g2: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor) -> bool:
    """``weight.main_grad += g2^T x2`` on the route's operands when fusion applies now; False otherwise."""
    dtype = _operand_dtype(route, x2)
    main = fused_main_grad(weight, dtype) if route.adds_into_main_grad else None
    if main is None:
        return False
    wgrad.add_wgrad(main, weight, g2.to(dtype), x2.to(dtype))
    return True


def _weight_gradient(route: GemmRoute, grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                     policy: GemmPolicy, split: TpSplit) -> torch.Tensor:
    """What a backward hands autograd as ``W``'s gradient: the placeholder once it is in the fp32 main gradient,
    else the route's weight-gradient GEMM. Traced code calls ``tessera::weight_grad``, which decides at run time."""
    g2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
    if route.adds_into_main_grad and _traced_fusion(weight):
        dtype = _operand_dtype(route, x2)
        return wgrad.compiled_weight_grad(weight, g2.to(dtype), x2.to(dtype))
    if _add_into_main(route, g2, x2, weight):
        return placeholder(weight)
    return route.grad_weight(g2, x2, weight, policy, split)


def fuses_wgrad(x: torch.Tensor, weight: torch.Tensor, policy: GemmPolicy = MODEL_DTYPE) -> bool:
    """Whether the weight gradient of ``x W^T`` goes straight into the weight's fp32 main gradient."""
    route = route_for(x, weight, policy)
    return route.adds_into_main_grad and fused_main_grad(weight, _operand_dtype(route, x)) is not None


def wgrad_into_main(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                    policy: GemmPolicy = MODEL_DTYPE) -> bool:
    """Add the weight gradient of ``x W^T`` (``grad`` the output's) into the weight's main gradient in fp32
    when fusion applies; False otherwise (for code that writes its own backward: the chunked head)."""
    g2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
    return _add_into_main(route_for(x, weight, policy), g2, x2, weight)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: str, *, group: Any = None,
               x_split_in: bool = False, w_split_out: bool = False, w_split_in: bool = False,
               observe: Observe | None = None, backend: str = "auto",
               observe_blocks: BlockObserve | None = None, switches: RecipeSwitches | None = None,
               state: RecipeState | None = None) -> torch.Tensor:
    """``linear`` under the low-precision ``recipe`` (``gemm_recipes()``; fp8 ones on ``backend``; ``switches`` and
    the recipe's ``state`` as a layer would hold them) with the given TP split (``TpSplit``); ``observe`` /
    ``observe_blocks`` see the forward input's quantization."""
    split = TpSplit(group, x_split_in, w_split_out, w_split_in)
    policy = dataclasses.replace(policy_for(recipe, backend, switches), state=state)
    return linear(x, weight, bias, policy, split, GemmObservers(observe, observe_blocks))
