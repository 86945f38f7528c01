"""The fp8 quantizer of the GEMM routes: e4m3 activations and weights forward, e5m2 gradients backward, dynamic scaling.

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

Two routes of the GEMM table (``tessera.parallel.gemm``) use this quantizer. ``fp8-emulated``: operands
quantized and dequantized (exact in fp32) and multiplied by fp32 GEMMs, the same arithmetic on every
device, a CPU included, so fp8 numerics can be studied without an fp8 GPU (not faster than bf16).
``fp8-scaled-mm``: the fp8 values and their scales (``scaled``) go to ``torch._scaled_mm``, the
tensor-core kernel on GPUs with fp8 (sm_89+), which multiplies the fp8 values exactly, accumulates in
fp32 and applies the inverse scales to the sums. The two differ only in the fp32 summation order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tessera.parallel.quantizer_kernels import fused

__all__ = ["E4M3", "E5M2", "RECIPES", "Observe", "quantize", "scaled"]

RECIPES = ("tensorwise", "rowwise")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_EPS = 1e-12  # amax floor: an all-zero operand keeps a finite scale
Observe = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]  # (fp32 operand, scale, fp8 values)


def scaled(t: torch.Tensor, fmt: torch.dtype, keep_dim: int | None, group: Any = None,
           reduce_sharded: bool = False, observe: Observe | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` (2-D) cast to ``fmt`` with its scale(s): ``(q, scale)``, ``t ~ q / scale``; the operands of
    ``torch._scaled_mm`` (which takes ``1 / scale``). Arguments as ``quantize``."""
    t = t.float()
    q, scale = _from_amax(t, _amax(t, keep_dim, group, reduce_sharded), fmt)
    if observe is not None:
        observe(t, scale, q)
    return q, scale


def _amax(t: torch.Tensor, keep_dim: int | None, group: Any, reduce_sharded: bool) -> torch.Tensor:
    amax = t.abs().amax() if keep_dim is None else t.abs().amax(dim=1 - keep_dim, keepdim=True)
    if reduce_sharded and group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def _from_amax(t: torch.Tensor, amax: torch.Tensor, fmt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    scale = torch.finfo(fmt).max / amax.clamp_min(_EPS)
    return (t * scale).clamp(-torch.finfo(fmt).max, torch.finfo(fmt).max).to(fmt), scale


def _fake_from_amax(t: torch.Tensor, amax: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    q, scale = _from_amax(t, amax, fmt)
    return q.float() / scale


def quantize(t: torch.Tensor, fmt: torch.dtype, keep_dim: int | None, group: Any = None,
             reduce_sharded: bool = False, observe: Observe | None = None) -> torch.Tensor:
    """``t`` (2-D) rounded to ``fmt`` and back, in fp32.

    ``keep_dim``: None for one scale (tensorwise), else the dim that keeps one scale per index
    (rowwise). ``reduce_sharded``: the dims the amax runs over include one split over ``group``, so
    the amax is a MAX over the group. ``observe(t, scale, q)`` sees the fp32 operand, its scale(s) and
    the fp8 values (precision telemetry).
    """
    if observe is not None:
        q, scale = scaled(t, fmt, keep_dim, group, reduce_sharded, observe)
        return q.float() / scale
    # the amax (and its all-reduce) eagerly, the element-wise rest as one kernel where quantizer_kernels compiles
    t = t.float()
    result: torch.Tensor = fused(_fake_from_amax, t, _amax(t, keep_dim, group, reduce_sharded), fmt)
    return result
