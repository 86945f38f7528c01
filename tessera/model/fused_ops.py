"""RMSNorm, rotary and the SwiGLU product as autograd Functions with hand-written backward.

Why: written as eager compositions, each of these is a chain of small elementwise ops, every one a pass
over memory and an allocation, many with their own tensors saved for autograd (the fp32 copy of a bf16
input and the normalized product, ``silu(gate)``, the ``rotate_half`` concatenation). Here each op makes
few passes, works in place on its own temporaries and saves only what its backward cannot cheaply
recompute:

- ``rms_norm``: saves the input (in its own dtype) and the per-row ``rstd``.
- ``rotary``: saves nothing per call (the half-width cos/sin of a forward are shared by every layer);
  the halves are rotated in place as views, no ``torch.cat``, no ``rotate_half`` temporary.
- ``swiglu``: ``silu(gate) * up`` saves gate and up; backward recomputes ``silu``.

Numerics: RMSNorm and rotary compute in fp32 (fp64 for fp64 inputs) and round once to the input dtype,
gradients included, as the eager formulas did. The SwiGLU product runs torch's kernels in the inputs'
dtype, as autograd ran ``F.silu(gate) * up`` (a bf16 kernel computes in fp32 and rounds its own result,
so ``silu(gate)`` is rounded before the product): rounding once there needs fp32 copies of gate and up,
which cost more than the op itself on a CPU, where mixed-dtype arithmetic copies its operands. On CPUs
mixed-dtype ops are avoided for that reason: each cast is one explicit copy that is then reused in
place. Nothing reads a tensor's values in Python (no ``.item()``, no data-dependent branch): the
Functions run on meta tensors and trace under ``torch.compile``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["rms_norm", "rotary", "swiglu", "compute_dtype"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype these ops compute in: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _returned(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``, as a Function's forward returns it. Eagerly ``t`` itself where it has that dtype already;
    traced by ``torch.compile``, always a new tensor. Why: a forward that returns a tensor it also wrote in place
    (``y.mul_(...)`` then ``y``) gets its gradient routed to the wrong output under torch 2.11's Dynamo, and the
    inputs' gradients come back zero (pytorch/pytorch#180642, fixed in 2.12; ``tests/test_traced_function_outputs.py``).
    Inductor fuses the copy into the kernel that computes ``t``."""
    if t.dtype == dtype and torch.compiler.is_compiling():
        return t.clone()
    return t.to(dtype)


# ------------------------------------------------------------------------------------------ RMSNorm
class _RMSNorm(torch.autograd.Function):
    """``y = x * rstd * w`` with ``rstd = 1 / sqrt(mean(x^2) + eps)`` over the last dim."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        compute = compute_dtype(x.dtype)
        y = x.to(compute, copy=True)  # for bf16/fp16 the one upcast; then normalized and scaled in place
        rstd = torch.linalg.vecdot(y, y).div_(x.shape[-1]).add_(eps).rsqrt_().unsqueeze(-1)
        y.mul_(rstd).mul_(weight)
        ctx.save_for_backward(x, weight, rstd)
        return _returned(y, x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight, rstd = ctx.saved_tensors
        d, compute = x.shape[-1], rstd.dtype
        xhat = x.to(compute, copy=True).mul_(rstd)  # the normalized input, recomputed
        g = grad.to(compute)  # a copy for bf16/fp16 only: never written
        gx_hat = torch.mul(g, xhat)  # g * xhat: its column sums are the weight gradient
        grad_w = gx_hat.reshape(-1, d).sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            # dx = rstd * (g w - xhat * mean(g w xhat)); mean(g w xhat) = (g * xhat) @ w / d, a matrix-vector product
            mean = torch.mv(gx_hat.reshape(-1, d), weight.to(compute)).div_(d).view(rstd.shape)
            gw = torch.mul(g, weight, out=gx_hat)  # reuses g * xhat's memory
            grad_x = gw.addcmul_(xhat, mean, value=-1).mul_(rstd).to(x.dtype)
        return grad_x, grad_w, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in fp32 (fp64 for fp64 inputs), returned in ``x``'s dtype."""
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: weight of shape {tuple(weight.shape)} does not match the last dim of an "
                         f"input of shape {tuple(x.shape)}")
    return _RMSNorm.apply(x, weight, eps)


# ------------------------------------------------------------------------------------------ rotary
def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    """``[x1, x2] -> [x1 cos - s x2 sin, x2 cos + s x1 sin]`` with ``s = sign`` over the last dim's halves,
    computed in fp32 and rounded once into ``x``'s dtype (``sign=-1`` is the transpose: the backward)."""
    half = x.shape[-1] // 2
    out = x.to(compute_dtype(x.dtype), copy=True)  # rotated in place: the halves are views, no concatenation
    x1, x2 = out[..., :half], out[..., half:]
    x2_sin = x2 * sin  # the one temporary: half of x, the old x2 needed after x2 is overwritten
    x2.mul_(cos).addcmul_(x1, sin, value=sign)
    x1.mul_(cos).sub_(x2_sin, alpha=sign)
    return _returned(out, x.dtype)


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)  # shared by every layer of the forward: no per-call memory
        return _rotate(x, cos, sin, 1.0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, -1.0), None, None


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[..., d]`` by half-width angles ``cos``/``sin`` ``[..., d/2]`` (broadcast over ``x``'s
    leading dims), pairing dim ``i`` with ``i + d/2``; no gradient flows to the angles."""
    if x.shape[-1] != 2 * cos.shape[-1] or cos.shape != sin.shape:
        raise ValueError(f"rotary: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must both have half the "
                         f"last dim of x {tuple(x.shape)}")
    return _Rotary.apply(x, cos.detach(), sin.detach())


# ------------------------------------------------------------------------------------------ SwiGLU
class _SwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` in the inputs' dtype, op by op as autograd would run it (each of torch's bf16/fp16
    kernels computes in fp32 and rounds its result): the same numbers, less memory and fewer allocations."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        if torch.compiler.is_compiling():
            return F.silu(gate) * up  # out of place when traced: see ``_returned``
        return F.silu(gate).mul_(up)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        gate, up = ctx.saved_tensors
        grad_gate = grad_up = None
        if ctx.needs_input_grad[0]:
            # grad * up * sigmoid(gate) * (1 + gate * (1 - sigmoid(gate))): torch's one kernel, in place
            gu = grad * up
            grad_gate = torch.ops.aten.silu_backward.grad_input(gu, gate, grad_input=gu)
        if ctx.needs_input_grad[1]:
            grad_up = F.silu(gate).mul_(grad)  # silu recomputed, not saved
        return grad_gate, grad_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (gate and up of one shape and dtype), in their dtype; see the module docstring."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} must "
                         "have one shape and one dtype")
    return _SwiGLU.apply(gate, up)
