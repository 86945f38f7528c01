"""AdamW arithmetic in fp32 on low-precision storage: bf16 master weights and/or bf16 moments.

Why: with bf16 masters an update smaller than half a bf16 ulp of the weight is rounded away, so a
small learning rate stalls training. Two remedies, chosen by ``master_compensation``:

- ``kahan``: a bf16 compensation buffer ``c`` keeps what rounding the weight lost. The weight is
  read as ``w + c`` in fp32, updated, then split again into ``w = bf16(value)`` and
  ``c = bf16(value - w)``. The pair holds about 16 significant bits, and the lost part is carried
  forward instead of dropped.
- ``stochastic``: the updated fp32 value is rounded up or down at random, with probabilities that
  make the rounding unbiased. The random bits are a hash of (seed, step, parameter name, element
  index), so a replicated element rounds the same way on every TP/DP rank and in every ZeRO layout,
  and a resumed run draws the same bits (the step is checkpointed).

The moments are computed in fp32 and stored in ``optimizer_state_dtype``, rounded to nearest.
The update itself is torch's AdamW: decoupled weight decay, bias-corrected moments, eps outside the sqrt.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["adamw_step", "stochastic_round_bf16", "element_noise", "name_key", "COMPENSATIONS"]

COMPENSATIONS = ("none", "kahan", "stochastic")
_M1, _M2 = 0x7FEB352D, 0x2C1B3C6D  # multipliers < 2**31: products of 32-bit values fit in int64
_LOW16 = -65536  # int32 mask 0xFFFF0000: the bits a bf16 keeps of an fp32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (values in [0, 2**32) held in int64)."""
    x = x ^ (x >> 16)
    x = (x * _M1) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * _M2) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _mix32_int(x: int) -> int:
    """``_mix32`` of one Python integer (no device work)."""
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * _M1) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * _M2) & 0xFFFFFFFF
    return x ^ (x >> 16)


def name_key(name: str) -> int:
    """A stable 32-bit key of a parameter name (the same on every rank and in every layout)."""
    return zlib.crc32(name.encode())


def element_noise(start: int, stop: int, param_key: int, step: int, seed: int, device: Any) -> torch.Tensor:
    """16 random bits (int32 in [0, 65536)) for elements ``[start, stop)`` of one parameter at ``step``."""
    x = torch.arange(start, stop, dtype=torch.int64, device=device)
    x = _mix32((x + param_key) & 0xFFFFFFFF)
    x = _mix32(x ^ _mix32_int(step))
    x = _mix32(x ^ _mix32_int(seed))
    return (x & 0xFFFF).to(torch.int32)


def stochastic_round_bf16(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` rounded to bf16 up or down with probability proportional to the distance (unbiased):
    add 16 random bits below the bf16 mantissa, then truncate."""
    bits = x.contiguous().view(torch.int32)
    return ((bits + noise) & _LOW16).view(torch.float32).to(torch.bfloat16)


def adamw_step(master: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], hyper: Mapping[str, Any], *,
               compensation: str, state_dtype: torch.dtype, noise: Any = None) -> None:
    """One AdamW update of the flat ``master`` shard (fp32 or bf16) from the fp32 ``grad``, in place.

    ``state`` holds ``step`` (0-dim fp32), ``exp_avg`` / ``exp_avg_sq`` (``state_dtype``) and, for
    Kahan, ``master_compensation`` (bf16); missing entries start at zero. ``noise()`` returns the
    random bits of stochastic rounding for the whole shard.
    """
    if hyper.get("amsgrad") or hyper.get("maximize"):
        raise ValueError("low-precision masters / optimizer states support AdamW without amsgrad or maximize")
    lr, wd, eps = float(hyper["lr"]), float(hyper["weight_decay"]), float(hyper["eps"])
    beta1, beta2 = (float(b) for b in hyper["betas"])
    if "step" not in state:
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(master, dtype=state_dtype)
        state["exp_avg_sq"] = torch.zeros_like(master, dtype=state_dtype)
    if compensation == "kahan" and "master_compensation" not in state:
        state["master_compensation"] = torch.zeros_like(master, dtype=torch.bfloat16)
    state["step"] += 1
    step = float(state["step"])

    w = master.float()
    if compensation == "kahan":
        w = w.add_(state["master_compensation"].float())
    m, v = state["exp_avg"].float(), state["exp_avg_sq"].float()
    w.mul_(1 - lr * wd)
    m.lerp_(grad, 1 - beta1)
    v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (v.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
    w.addcdiv_(m, denom, value=-lr / (1 - beta1**step))
    state["exp_avg"].copy_(m)
    state["exp_avg_sq"].copy_(v)
    if master.dtype == torch.float32 or compensation == "none":
        master.copy_(w)
    elif compensation == "kahan":
        master.copy_(w)  # round to nearest
        state["master_compensation"].copy_(w.sub_(master.float()))
    elif compensation == "stochastic":
        master.copy_(stochastic_round_bf16(w, noise()))
    else:
        raise ValueError(f"master_compensation must be one of {list(COMPENSATIONS)}, got {compensation!r}")
