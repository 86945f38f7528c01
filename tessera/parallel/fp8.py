"""fp8 linears: e4m3 activations and weights in forward, e5m2 gradients in backward, dynamic scaling.

Every GEMM ``A @ B`` of a linear layer (forward ``x @ W^T``, backward ``g @ W`` and ``g^T @ x``) runs
on operands rounded to fp8: each operand is scaled so that its amax lands on the format's largest
value, cast to fp8 (round to nearest, saturating), and the product is accumulated in fp32, which is
what an fp8 tensor-core GEMM computes. The scales come from the current amax (no history):

- ``tensorwise``: one scale per operand;
- ``rowwise``: one scale per row of ``A`` and per column of ``B``, i.e. along the dims the GEMM keeps,
  never along the one it sums over.

Tensor parallelism: when the dim an amax reduces over is split across the TP group (a sharded
weight, the row-parallel input, the column-parallel output gradient), the amax is a MAX all-reduce
over the group, so every rank scales as the unsharded tensor would: TP=N computes what TP=1 computes.

The cast is emulated: operands are quantized and dequantized (exact in fp32) and multiplied by fp32
GEMMs. This is the same arithmetic on every device, a CPU included, so fp8 numerics can be studied
without an fp8 GPU; it is not faster than bf16 (the tensor-core kernel, ``torch._scaled_mm``, is
not used).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["RECIPES", "Observe", "fp8_linear", "quantize"]

RECIPES = ("tensorwise", "rowwise")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_EPS = 1e-12  # amax floor: an all-zero operand keeps a finite scale
Observe = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]  # (fp32 operand, scale, fp8 values)


def quantize(t: torch.Tensor, fmt: torch.dtype, keep_dim: int | None, group: Any = None,
             reduce_sharded: bool = False, observe: Observe | None = None) -> torch.Tensor:
    """``t`` (2-D) rounded to ``fmt`` and back, in fp32.

    ``keep_dim``: None for one scale (tensorwise), else the dim that keeps one scale per index
    (rowwise). ``reduce_sharded``: the dims the amax runs over include one split over ``group``, so
    the amax is a MAX over the group. ``observe(t, scale, q)`` sees the fp32 operand, its scale(s) and
    the fp8 values (precision telemetry).
    """
    t = t.float()
    amax = t.abs().amax() if keep_dim is None else t.abs().amax(dim=1 - keep_dim, keepdim=True)
    if reduce_sharded and group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    scale = torch.finfo(fmt).max / amax.clamp_min(_EPS)
    q = (t * scale).clamp(-torch.finfo(fmt).max, torch.finfo(fmt).max).to(fmt)
    if observe is not None:
        observe(t, scale, q)
    return q.float() / scale


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rowwise: bool,
                group: Any, x_split_in: bool, w_split_out: bool, w_split_in: bool,
                observe: Observe | None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        ctx.save_for_backward(x2, weight)
        ctx.meta = (rowwise, group, x_split_in, w_split_out, w_split_in, shape, bias is not None, x.dtype)
        k = 0 if rowwise else None
        # forward x @ W^T: x per token (amax over in), W per output channel (amax over in)
        xq = quantize(x2, E4M3, k, group, reduce_sharded=x_split_in, observe=observe)
        wq = quantize(weight, E4M3, k, group, reduce_sharded=w_split_in if rowwise else (w_split_in or w_split_out))
        y = xq @ wq.t()
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype).reshape(*shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x2, weight = ctx.saved_tensors
        rowwise, group, x_split_in, w_split_out, w_split_in, shape, has_bias, dtype = ctx.meta
        g = grad.reshape(-1, grad.shape[-1])
        g_split_out = w_split_out  # the column-parallel output (and its gradient) is split like W's rows
        tw = None
        # grad_x = g @ W: g per token (amax over out), W per input channel (amax over out)
        gq = quantize(g, E5M2, 0 if rowwise else tw, group, reduce_sharded=g_split_out)
        w_cols = quantize(weight, E4M3, 1 if rowwise else tw, group,
                          reduce_sharded=w_split_out if rowwise else (w_split_in or w_split_out))
        grad_x = (gq @ w_cols).to(dtype).reshape(shape)
        # grad_W = g^T @ x: g^T per output channel (amax over tokens), x per input channel (amax over tokens)
        gtq = quantize(g, E5M2, 1 if rowwise else tw, group, reduce_sharded=False if rowwise else g_split_out)
        x_cols = quantize(x2, E4M3, 1 if rowwise else tw, group, reduce_sharded=False if rowwise else x_split_in)
        grad_w = (gtq.t() @ x_cols).to(weight.dtype)
        grad_b = g.float().sum(0).to(weight.dtype) if has_bias else None
        return grad_x, grad_w, grad_b, None, None, None, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: str, *, group: Any = None,
               x_split_in: bool = False, w_split_out: bool = False, w_split_in: bool = False,
               observe: Observe | None = None) -> torch.Tensor:
    """``x @ weight^T + bias`` with fp8 operands (see the module docstring). The flags say which dims
    are split over ``group``: the input's features (row-parallel), the weight's output rows
    (column-parallel; its output gradient too) or the weight's input columns (row-parallel).
    ``observe`` sees the forward input's quantization (``quantize``)."""
    if recipe not in RECIPES:
        raise ValueError(f"fp8 recipe must be one of {list(RECIPES)}, got {recipe!r}")
    return _Fp8Linear.apply(x, weight, bias, recipe == "rowwise", group, x_split_in, w_split_out, w_split_in,
                            observe)
