"""Tolerances for tests that compare two computation orders, derived from a rounding-error model.

Many tests compare one computation against another that is the same in exact arithmetic but rounds in
another order: TP=N against TP=1, msp against mtp, ZeRO against plain AdamW, chunked against full, a
bf16 model against its fp32 reference. The difference they may show is rounding, and its size follows
from three things: the unit roundoff ``u`` of the dtype the rounding happens in, the length ``n`` of the
reductions (sums) involved, and how many chained reductions (layers, forward and backward) and optimizer
steps carry it. The functions here turn those into a tolerance, so that a test states its bound next to
its assertion instead of a number read off one CPU.

The model
---------
A float operation returns ``(exact)(1 + d)`` with ``|d| <= u`` (2^-24 fp32, 2^-8 bf16, 2^-11 fp16,
2^-53 fp64). A sum of ``n`` terms, in any order, is then within

* ``gamma_n * sum|terms|`` of the exact sum, ``gamma_n = n*u / (1 - n*u)``, in the worst case
  (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., sec. 3.1), and
* ``lam * sqrt(n) * u`` (to first order) under the probabilistic model of Higham & Mary (2019, *A New
  Approach to Probabilistic Rounding Error Analysis*, SIAM J. Sci. Comput. 41(5)), which treats the
  ``d``'s as independent and of zero mean; the bound holds with probability >= 1 - 2 exp(-lam^2 / 2).

**We use the probabilistic form, with lam = 1, applied to norm-wise relative errors**, because

1. the tests compare norm-wise errors ``||a - b|| / ||b||`` over hundreds or thousands of elements (or
   loss-like averages). A norm is a root-mean-square: it concentrates at the RMS of the element errors,
   so the question is the RMS, not the worst element. For independent zero-mean ``d`` (variance
   <= u^2 / 3) the first-order error of a length-n sum has RMS <= u * sqrt(sum_k s_k^2 / 3) over its
   partial sums ``s_k``; for terms of random sign (randomly initialised models) ``E s_k^2 = (k/n) s_n^2``
   and that is ``u * sqrt(n / 6) * |s_n|``. ``sqrt(n) * u`` relative to the result leaves a factor ~2.4
   for cancellation and O(1) gains of the layers the error then passes through;
2. the worst case is reached only when all ``n`` roundings have the same sign and full size, which no
   GEMM on real data does; it is ``sqrt(n)`` times looser per reduction, the looseness compounds over
   layers, and the resulting tolerances (hundreds of times above any measured difference) would let
   real regressions through;
3. it assumes nothing about the summation order, so it holds on every CPU kind. Kernels sum in SIMD
   lanes (AVX2: 8 fp32 lanes, AVX-512: 16), in AMX tiles or pairwise, i.e. in shorter rounding chains
   than the sequential sum the bound is written for: AVX2, AVX-512 and AMX builds all sit below it, and
   switching between them (``ATEN_CPU_CAPABILITY=avx2|avx512|default``, ``MKL_ENABLE_INSTRUCTIONS``)
   only moves the measured error inside it.

Composition. Two orders each carry an independent error of that size: their difference is ``sqrt(2)``
times one. A compared tensor that comes out of ``depth`` chained reductions (each layer's projections,
attention and norms, forward then backward) carries one such error from each; independent errors add
in quadrature, so the bound grows like ``sqrt(depth)``. Once two computations differ at all, every later
rounding sees different inputs and rounds independently, so all reductions downstream of the first
difference count, not only those whose order the two computations change. Altogether::

    order_rtol(dtype, n, depth) = sqrt(2 * n * depth) * u       (two orders)
    precision_rtol(dtype, n, depth) = sqrt(n * depth) * u        (one computation against an exact one)

``n`` is the longest reduction *held in* ``dtype``. A bf16 GEMM accumulates in fp32 on CPU (and in fp32
on tensor cores): its bf16 error is the one rounding of its output, ``n = 1``, and the fp32 sum inside is
negligible against it; an all-reduce of bf16 partials over ``tp`` ranks is a bf16 sum, ``n = tp``.

Optimizer steps. The weights after Adam steps inherit each step's gradient difference (``adam_rtol``):
Adam's steps are ~``lr`` per element whatever the gradient's scale, so a weight comparison after ``k``
steps scales with ``sum(lr) / weight RMS``. Adam divides by ``sqrt(v) + eps``, which turns the rounding
difference of a gradient element near zero into a full-size step difference (``adam_window_gain``); where
gradients have elements near ``eps`` that, not the reductions, dominates weight comparisons. Plain SGD
moves the weights apart by ``lr`` times the gradients' difference (``sgd_rtol``). Logits, losses and
gradients after a step also carry the weights' difference: to first order a relative change of a weight
matrix moves what passes through it by as much, and the parameters' shares add in quadrature.

Casts to a coarse format (fp8). Two orders that feed a cast slightly different values (relative ``e``)
round an element to neighbouring fp8 values whenever it lies within ``e`` of a rounding midpoint, which
happens with probability ~``e / u_fp8`` per element: rarely (fp32 differences of 1e-7 against
u = 2^-4 or 2^-3), but over 1e5 cast elements a few times per run, and each such *flip* moves an element
by a whole fp8 ulp. ``fp8_flip_rtol`` bounds that; no sqrt(n) * u model covers it. ``requantize_rtol``
covers every cast input moving by a low-precision ulp (kernel fusion), ``cast_rtol`` weights rounded to
bf16 from fp32 masters that differ (many flips, a few, or none to be expected).

Losses. A mean cross-entropy loss moves much less than its logits (``mean_loss_rtol``): the per-token
changes are not aligned with the loss's gradient, and average over the tokens unless they come from
something every token shares (weights rounded to bf16).

Elementwise checks (``allclose``-style) use ``atol = rtol * scale``: a rounding difference is absolute,
of the size of the tensor's typical element, not of each element (an element that cancels to near zero
has the same absolute error as its neighbours); see ``allclose_tols``. Where an elementwise check sees
only a handful of roundings (an all-reduce over a few ranks, one AdamW update, a rotation), the worst
case ``gamma`` is not loose and is used instead; a single element at the end of a long chain (an amax)
gets ``element_order_rtol``, three standard deviations of its own rounding difference.

Verification (this module's bounds, on an AMX Xeon): every changed test passes with ATen's kernels at
their default and with ``ATEN_CPU_CAPABILITY=avx2`` / ``avx512``; the numbers measured there are quoted
next to each bound in the tests. ``MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2`` lowers the GEMMs
too (ATEN_CPU_CAPABILITY alone does not). Inductor's cache key does not include ATEN_CPU_CAPABILITY: give
each capability its own ``TORCHINDUCTOR_CACHE_DIR`` or kernels compiled for another one come back (NaN).
"""

from __future__ import annotations

import math

import torch

_UNIT_ROUNDOFF = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.bfloat16: 2.0**-8,
    torch.float16: 2.0**-11,
    torch.float8_e4m3fn: 2.0**-4,
    torch.float8_e5m2: 2.0**-3,
}
_NAMES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "tf32": "tf32"}
TF32_UNIT_ROUNDOFF = 2.0**-11  # 10 explicit mantissa bits, as fp16; products only, sums stay fp32

# Chained reductions one pre-norm transformer layer puts on a value's path, forward: attention norm,
# q/k/v projection, scores q.k, softmax sum, probs @ v, wo, ffn norm, w1/w3 projection, w2.
REDUCTIONS_PER_LAYER = 9
# and the head: final norm, output projection, cross entropy's log-sum-exp
REDUCTIONS_HEAD = 3


def unit_roundoff(dtype: torch.dtype | str) -> float:
    """u of ``dtype`` (a torch dtype, ``"torch.bfloat16"`` or a precision name: fp32, tf32, bf16, fp16)."""
    if isinstance(dtype, str):
        dtype = _NAMES.get(dtype) or getattr(torch, dtype.removeprefix("torch."))
    if dtype == "tf32":
        return TF32_UNIT_ROUNDOFF
    return _UNIT_ROUNDOFF[dtype]


def gamma(n: int, dtype: torch.dtype | str) -> float:
    """Worst-case relative error bound of a length-n sum, ``n*u / (1 - n*u)`` (for exactness arguments)."""
    nu = n * unit_roundoff(dtype)
    assert nu < 1, (n, dtype)
    return nu / (1 - nu)


def transformer_depth(num_layers: int, backward: bool = False) -> int:
    """Chained reductions from the input to the logits (forward) or to the weight gradients (backward).

    Backward doubles the count: every forward reduction has a backward GEMM or sum mirroring it, and a
    weight gradient is one more sum, over the tokens, at the end of that path.
    """
    forward = REDUCTIONS_PER_LAYER * num_layers + REDUCTIONS_HEAD
    return 2 * forward if backward else forward


def precision_rtol(dtype: torch.dtype | str, n: int = 1, depth: int = 1) -> float:
    """Norm-wise relative error of one computation in ``dtype`` against an exact (or much finer) one:
    ``sqrt(n * depth) * u``; ``depth`` chained reductions of length <= ``n`` held in ``dtype``."""
    return math.sqrt(n * depth) * unit_roundoff(dtype)


def order_rtol(dtype: torch.dtype | str, n: int = 1, depth: int = 1) -> float:
    """Norm-wise relative difference of two evaluation orders of the same computation in ``dtype``:
    ``sqrt(2 * n * depth) * u`` (two independent errors of ``precision_rtol`` each)."""
    return math.sqrt(2.0) * precision_rtol(dtype, n, depth)


def element_order_rtol(dtype: torch.dtype | str, n: int = 1, depth: int = 1, sigmas: float = 3.0) -> float:
    """One element's relative difference between two orders (an amax, a single logit), not a norm.

    A norm averages over many elements; one element does not: its first-order error is a sum of
    ``n * depth`` rounding errors per order, each uniform on ``[-u, u]`` (variance u^2 / 3), so the
    difference of two orders has RMS ``u * sqrt(2 n depth / 3)``; ``sigmas`` of it (3: a handful of
    such elements checked, each beyond it with probability ~0.3%).
    """
    return sigmas * math.sqrt(2.0 * n * depth / 3.0) * unit_roundoff(dtype)


def adam_rtol(grad_rtol: float, *, lrs, weight_rms: float, gain: float = 1.0) -> float:
    """Norm-wise relative weight difference after Adam(W) steps with learning rates ``lrs`` (one per step),
    when each step's gradients differ by ``grad_rtol`` (norm-wise, rounding-like).

    Adam's step on an element is ``lr * m / (sqrt(v) + eps)``: of size ~``lr`` whatever the gradient's
    scale, and, for elements with ``|g| >> eps``, a relative change of the gradient changes it relatively
    by no more (``gain = 1``). The weights, of RMS ``weight_rms``, then move apart by at most
    ``lr / weight_rms * gain * grad_rtol`` per step; the steps add (a difference persists in the weights
    and in Adam's moments)::

        adam_rtol = sum(lrs) / weight_rms * gain * grad_rtol

    Elements within ``eps`` of zero amplify: see ``adam_window_gain``.
    """
    return sum(lrs) / weight_rms * gain * grad_rtol


def sgd_rtol(weight_rtol: float, grad_rtol: float, *, lr: float, weight_norm: float, grad_norm: float,
             new_weight_norm: float) -> float:
    """Relative weight difference after one SGD step ``w' = w - lr * g``, from the weights' difference
    before it (``weight_rtol`` of ``||w||``) and the gradients' (``grad_rtol``, norm-wise): the absolute
    differences add, ``weight_rtol * ||w|| + lr * grad_rtol * ||g||``, over ``||w'||``; plus the step's
    own two roundings (``order_rtol(fp32, 1, 2)``)."""
    return ((weight_rtol * weight_norm + lr * grad_rtol * grad_norm) / new_weight_norm
            + order_rtol(torch.float32, 1, 2))


def adam_window_gain(grad_rms: float, eps: float, grad_min: float = 0.0) -> float:
    """Adam's amplification of a rounding difference by gradient elements within ``eps`` of zero.

    Such an element's step ``lr * g / (|g| + eps)`` has slope ``1 / eps``: a rounding difference of
    ``delta`` (absolute, about ``grad_rtol * grad_rms`` on every element, small ones included) becomes a
    step difference of up to ``lr * delta / eps``, i.e. ``grad_rms / eps`` times the relative one. If the
    gradient's elements have a bounded density near zero (~``1 / grad_rms``, as for a normal
    distribution), a fraction ~``eps / grad_rms`` of them is in that window; in the norm that gives
    ``sqrt(1 + grad_rms / eps)``. ``grad_rms`` can be bounded from the configuration: clipping leaves a
    parameter's gradient a norm of at most ``clip_grad_norm``, so ``grad_rms <= clip / sqrt(numel)``.

    Where the reference run's gradients are at hand, ``grad_min`` (their smallest magnitude over the
    run, before clipping: clipping by c <= 1 widens the window to eps / c and only lowers the gain) caps
    the window: no element gets nearer to zero than that, so ``grad_min`` replaces ``eps`` when larger;
    the differences compared are rounding-sized, so no CPU kind moves an element from there into it.

    The measured effect is heavy-tailed (it hinges on whether one element happens to sit within ``eps``
    of zero): on the msp-vs-mtp TP=4 test (eps 1e-6) the weights after 3 steps differed by 1e-6 .. 1.2e-4
    across 20 seeds and CPU capabilities while the gradients differed by ~3e-7.
    """
    return math.sqrt(1.0 + grad_rms / max(eps, grad_min))


# a flipped element is a random one: larger than 3x its tensor's RMS with probability ~0.3% (normal-like)
CAST_CREST = 3.0


def fp8_flip_rtol(fmt: torch.dtype, numel: int, flips: int = 1) -> float:
    """Norm-wise change of a ``numel``-element tensor cast to ``fmt`` when ``flips`` of its elements round to
    the neighbouring fp8 value in one of two computations: each moves by one ulp, ``2 u`` of itself, and is
    at most ``CAST_CREST`` times the tensor's RMS (and at most its norm): ``2 * u * CAST_CREST * sqrt(flips / numel)``.

    Downstream quantities (logits, gradients) see that change with a gain of at most ~1: a flip enters
    one row of one GEMM in a residual branch (measured: 1/40 of it reaches the logits), so the bound is
    applied to the compared quantity directly.
    """
    crest = min(CAST_CREST, math.sqrt(numel))  # one element is at most the whole norm
    return 2 * unit_roundoff(fmt) * crest * math.sqrt(flips / numel)


def requantize_rtol(fmt: torch.dtype, upstream_rtol: float) -> float:
    """Norm-wise change of a tensor cast to ``fmt`` when every element's input moves by up to
    ``upstream_rtol`` of itself (e.g. one bf16 ulp, when fusion rounds upstream values differently).

    An element lies within that distance of a rounding midpoint with probability ``upstream_rtol / u``
    (the distance to the nearest midpoint is uniform over ``[0, u |x|]``), and then moves by ``2 u |x|``;
    in the norm: ``2 * sqrt(u * upstream_rtol)``. For ``upstream_rtol << u`` only a few elements flip
    and ``fp8_flip_rtol`` is the bound to use.
    """
    return 2 * math.sqrt(unit_roundoff(fmt) * min(upstream_rtol, unit_roundoff(fmt)))


# a rounding flip nobody should expect: below this expected count per comparison, the cast adds nothing
FLIP_MISS = 1e-2


def cast_rtol(dtype: torch.dtype, upstream_rtol: float, numel: int) -> float:
    """Norm-wise difference of two tensors rounded to ``dtype`` from values that differ by ``upstream_rtol``
    (relative, per element; e.g. two fp32 masters rounded to bf16 weights).

    ``upstream_rtol >= u``: every element rounds on its own, ``order_rtol(dtype)``. Smaller: an element
    rounds differently only within ``upstream_rtol`` of a midpoint; ``numel * upstream_rtol / u`` of them
    are expected to. Below ``FLIP_MISS`` none is (probability about that count): 0. Otherwise the larger
    of ``requantize_rtol`` (many flips) and one flip of a large element (``fp8_flip_rtol``, any format).
    """
    u = unit_roundoff(dtype)
    if upstream_rtol >= u:
        return order_rtol(dtype)
    if numel * upstream_rtol / u < FLIP_MISS:
        return 0.0
    return max(requantize_rtol(dtype, upstream_rtol), fp8_flip_rtol(dtype, numel))


def mean_loss_rtol(logits_rtol: float, *, logits_norm: float, loss: float, tokens: int, vocab: int,
                   shared: bool = False) -> float:
    """Relative change of a mean cross-entropy loss when its logits move by ``logits_rtol`` (norm-wise).

    To first order ``d loss = (1/T) sum_t <softmax(z_t) - onehot_t, dz_t>``, and the gradient has norm at
    most sqrt(2) per token. A rounding (or flip) change ``dz`` is not aligned with it: each token's product
    is ~``sqrt(2) ||dz_t|| / sqrt(V)``. Where the change comes from the activations, token by token, the
    ``T`` products are independent and add in quadrature: ``|d loss| <= sqrt(2 / V) * ||dz|| / T``. Where it
    comes from something every token shares (``shared``: weights rounded to bf16) they may add coherently:
    ``sqrt(2 / V) * ||dz|| / sqrt(T)`` (Cauchy-Schwarz over the tokens). Relative to the loss::

        sqrt(2 / V) * logits_rtol * ||z|| / (T or sqrt(T)) / |loss|
    """
    per_token = math.sqrt(tokens) if shared else tokens
    return math.sqrt(2.0 / vocab) * logits_rtol * logits_norm / (per_token * abs(loss))


def allclose_tols(rtol: float, scale: float) -> dict[str, float]:
    """``rtol``/``atol`` for ``torch.allclose``-style checks from a norm-wise ``rtol``: rounding differences
    are absolute, of the size of the tensor's typical element (``scale``, e.g. its RMS or max), so
    ``atol = rtol * scale`` and elements that cancel to near zero are not held to a relative bound."""
    return {"rtol": rtol, "atol": rtol * scale}
