"""Low-precision (bf16/fp16) matmuls on CPUs without native bf16/fp16 GEMM instructions.

What a bf16 GEMM means on a GPU tensor core: bf16 operands, exact products, fp32 accumulation, the
result rounded to bf16. On a CPU without avx512_bf16/AMX, torch's bf16 kernels are reference loops,
far slower than its fp32 GEMMs (BENCHMARKS.md and docs/cpu-kernels.md have the figures).
Upcasting the bf16 operands to fp32 and running the fp32 GEMM computes the same thing -- products of
bf16 values are exact in fp32, accumulation is fp32, the output is rounded to bf16 -- so we do that,
keeping bf16 tensors as the saved activations. The choice is made once per process per dtype (on first
use, or by ``decide_cpu_kernels`` before ``torch.compile`` traces a model, so the traced code sees a
constant, not an environment read) and logged. ``TESSERA_CPU_LOWP_MATMUL=native`` forces torch's own
kernels (for benchmarks), ``=upcast`` forces ours; ``forget_cpu_kernels`` lets a process that changes the
variable (benchmarks, tests) have it read again.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import torch
import torch.nn.functional as F

from tessera.parallel import wgrad
from tessera.parallel.wgrad import add_wgrad, fused_main_grad, placeholder

logger = logging.getLogger("tessera")

_NATIVE_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}
_UPCAST: dict[torch.dtype, bool] = {}  # the choice per dtype, made once (upcast_on_cpu)
_SOURCE: dict[torch.dtype, str] = {}  # what made it: "auto" (the CPU's flags), "native" or "upcast" (the variable)


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _decide(dtype: torch.dtype) -> bool:
    choice = os.environ.get("TESSERA_CPU_LOWP_MATMUL", "auto")
    if choice not in ("auto", "native", "upcast"):
        raise ValueError(f"TESSERA_CPU_LOWP_MATMUL={choice!r}: must be 'auto', 'native' or 'upcast'")
    if choice == "native":
        upcast = False
    elif choice == "upcast":
        upcast = True
    else:
        upcast = not any(flag in _cpu_flags() for flag in _NATIVE_FLAGS[dtype])
    how = ("fp32 GEMMs on upcast operands, fp32 accumulation, output rounded to " + str(dtype).split(".")[-1]
           if upcast else "torch's native kernels")
    why = f"TESSERA_CPU_LOWP_MATMUL={choice}" if choice != "auto" else (
        f"this CPU has {'none' if upcast else 'one'} of {'/'.join(_NATIVE_FLAGS[dtype])}")
    logger.info("CPU %s matmuls (and SDPA attention: KV cache, dropout): %s (%s)", str(dtype).split(".")[-1], how, why)
    return upcast


def upcast_on_cpu(dtype: torch.dtype) -> bool:
    """True when ``dtype`` matmuls on this CPU should run as fp32 GEMMs on upcast operands (decided on first
    use for each dtype, then a dict lookup that ``torch.compile`` reads as a constant)."""
    if dtype not in _NATIVE_FLAGS:
        return False
    if dtype not in _UPCAST:
        _UPCAST[dtype] = _decide(dtype)
        _SOURCE[dtype] = os.environ.get("TESSERA_CPU_LOWP_MATMUL", "auto")
    return _UPCAST[dtype]


def choice_source(dtype: torch.dtype) -> str:
    """``"auto"`` when this CPU's flags made the choice for ``dtype``, else the forcing variable's value."""
    upcast_on_cpu(dtype)
    return _SOURCE.get(dtype, "auto")


def decide_cpu_kernels() -> dict[torch.dtype, bool]:
    """Make (and log) the choice for every low-precision dtype now, e.g. before compiling a model."""
    return {dtype: upcast_on_cpu(dtype) for dtype in _NATIVE_FLAGS}


def forget_cpu_kernels() -> None:
    """Drop the choices made so far: the next use reads ``TESSERA_CPU_LOWP_MATMUL`` again. Code compiled
    before keeps the choice it was traced with."""
    _UPCAST.clear()
    _SOURCE.clear()


def needs_upcast(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in _NATIVE_FLAGS and upcast_on_cpu(x.dtype)


class _UpcastLinear(torch.autograd.Function):
    """``x W^T + b`` in fp32 on low-precision operands; saves the low-precision tensors only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        g = grad.float()
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = (g @ weight.float()).to(x.dtype)
        if ctx.needs_input_grad[1]:
            gw = weight_gradient(grad, x, weight)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g.reshape(-1, g.shape[-1]).sum(0).to(weight.dtype)
        return gx, gw, gb


class _FusedWgradLinear(torch.autograd.Function):
    """``x W^T + b`` whose backward adds the weight gradient into the weight's fp32 main gradient
    (``tessera.parallel.wgrad``) instead of handing autograd a low-precision one."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        return linear_grads(grad, x, weight, ctx.has_bias, tuple(ctx.needs_input_grad))


def fuses_wgrad(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the weight gradient of ``x W^T`` goes straight into the weight's fp32 main gradient."""
    upcast = needs_upcast(x) and x.dtype == weight.dtype
    return fused_main_grad(weight, torch.float32 if upcast else x.dtype) is not None


def wgrad_into_main(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Add the weight gradient of ``x W^T`` (``grad`` the output's) into the weight's main gradient in fp32
    when fusion applies (upcast operands on CPUs without native low-precision kernels); False otherwise."""
    upcast = needs_upcast(x) and x.dtype == weight.dtype
    main = fused_main_grad(weight, torch.float32 if upcast else x.dtype)
    if main is None:
        return False
    g2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
    add_wgrad(main, weight, g2.float() if upcast else g2, x2.float() if upcast else x2)
    return True


def _weight_gradient_now(g2: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``g2^T @ x2`` for autograd: added into ``weight``'s fp32 main gradient when fusion applies (then the
    placeholder is returned), else computed as the unfused backward computes it (upcast where needed)."""
    if wgrad_into_main(g2, x2, weight):
        return placeholder(weight)
    upcast = needs_upcast(x2) and x2.dtype == weight.dtype
    if upcast:
        g2, x2 = g2.float(), x2.float()
    return (g2.t() @ x2).to(weight.dtype)


def _weight_grad_op(weight: torch.Tensor, grad: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    """``tessera::weight_grad``: the weight gradient in compiled code, the fusion decided when it runs."""
    return _weight_gradient_now(grad, input, wgrad.resolve(weight)).contiguous()


def _weight_grad_shape(weight: torch.Tensor, grad: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(weight, memory_format=torch.contiguous_format)


_weight_grad: Any = None  # the operator, where this torch can tag it (wgrad.COMPILED_FUSION)
if wgrad.COMPILED_FUSION:
    _weight_grad = torch.library.custom_op("tessera::weight_grad", _weight_grad_op, mutates_args=(),
                                           tags=(torch.Tag.cudagraph_unsafe,))
    _weight_grad.register_fake(_weight_grad_shape)


def _traced_fusion(weight: torch.Tensor) -> bool:
    """Inside traced code: whether ``weight``'s gradient goes through ``tessera::weight_grad``."""
    return torch.compiler.is_compiling() and _weight_grad is not None and wgrad.fused_in_compiled_code(weight)


def weight_gradient(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The gradient of ``x W^T`` w.r.t. ``W`` that a backward hands autograd (``grad`` the output's): the
    placeholder once it is in the fp32 main gradient (``tessera.parallel.wgrad``), else the gradient itself.
    Traced code calls the ``tessera::weight_grad`` operator, which makes that choice when it runs."""
    g2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
    if _traced_fusion(weight):
        return _weight_grad(weight, g2, x2)
    return _weight_gradient_now(g2, x2, weight)


def linear_no_autograd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The forward of :func:`linear` for code that writes its own backward (``linear_grads``)."""
    if needs_upcast(x) and x.dtype == weight.dtype:
        y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        return y.to(x.dtype)
    return F.linear(x, weight, bias)


def linear_grads(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, has_bias: bool,
                 needs: tuple[bool, bool, bool]) -> tuple[torch.Tensor | None, ...]:
    """Gradients of ``x W^T + b`` w.r.t. (x, W, b) where ``needs`` says so; low precision on such CPUs in
    fp32 as :class:`_UpcastLinear` does, else in the tensors' own dtype (as autograd's own backward). A weight
    gradient fused into the main gradient (``wgrad_into_main``) comes back as a placeholder."""
    upcast = needs_upcast(x) and x.dtype == weight.dtype
    g = grad.float() if upcast else grad
    w = weight.float() if upcast else weight
    gx = gw = gb = None
    if needs[0]:
        gx = (g @ w).to(x.dtype)
    if needs[1]:
        gw = weight_gradient(grad, x, weight)
    if has_bias and needs[2]:
        gb = g.reshape(-1, g.shape[-1]).sum(0).to(weight.dtype)
    return gx, gw, gb


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, with bf16/fp16 on CPUs lacking native kernels computed as described above."""
    if needs_upcast(x) and x.dtype == weight.dtype:
        return _UpcastLinear.apply(x, weight, bias)
    if torch.is_grad_enabled() and (fused_main_grad(weight, x.dtype) is not None or _traced_fusion(weight)):
        return _FusedWgradLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


def scaled_dot_product_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """SDPA; low precision on such CPUs runs in fp32 on the low-precision inputs (as flash kernels
    accumulate in fp32) and returns the input dtype."""
    if q.is_meta:
        return _flash_shapes(q, k, v, **kwargs)
    if needs_upcast(q):
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kwargs).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


def _flash_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                  dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                  enable_gqa: bool = False) -> torch.Tensor:
    """SDPA on meta tensors (dry runs) through a flash kernel's shape function.

    On meta, SDPA would pick its math kernel, which materializes the [S, S] scores and saves them for
    backward; the GPU (flash_attn, SDPA's flash / memory-efficient kernels) and the CPU flash kernel
    keep only the output and the fp32 log-sum-exp. The CPU flash operator's meta function has exactly
    that footprint, takes grouped KV heads and a mask, and has a backward.
    """
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    return out
