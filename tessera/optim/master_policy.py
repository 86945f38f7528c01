"""Which dtypes HybridZeroOptimizer keeps: the model's precision, and the master / moment policy.

With ``torch.optim.AdamW`` as the inner optimizer (train.py's) every policy updates through
``lowp_adamw``'s fused AdamW: one pass over each flat master shard, with the state laid out as torch's
AdamW keeps it. Defaults are fp32 masters and fp32 Adam moments; ``master_dtype="bf16"`` or
``optimizer_state_dtype="bf16"`` keep the low-precision storage (AdamW arithmetic in fp32, rounded back),
with the ``master_compensation`` of the choice. Other inner optimizers run their own ``step()`` on
the fp32 master slices (low-precision storage is refused for them).
bf16 masters share the bf16 weights' storage: a separate bf16 copy would hold the same values (the
weights are the masters rounded to bf16), so it would cost 2 bytes per parameter for nothing.
Parameters kept fp32 by an fp32 mark keep fp32 masters.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from tessera.config.dtypes import ModelDtype
from tessera.logs import log_once
from tessera.optim.bucket import Bucket
from tessera.optim.lowp_adamw import COMPENSATIONS, Noise, adamw_step, element_noise, name_key
from tessera.optim.params import LOW_PRECISION
from tessera.optim.step_observer import StepObserver
from tessera.precision.plan import OptimizerDtypes, model_dtype_of

__all__ = ["MasterPolicy", "resolve_optimizer_dtype"]

def resolve_optimizer_dtype(stated: ModelDtype | None, params: list[nn.Parameter]) -> ModelDtype:
    """The model precision the optimizer works for: the ``stated`` one when given (checked against the
    parameters), else the parameters' low-precision dtype (fp32 when there is none)."""
    low = {p.dtype for p in params if p.dtype in LOW_PRECISION}
    if len(low) > 1:
        raise TypeError("HybridZeroOptimizer: parameters mix float16 and bfloat16")
    if stated is None:
        return model_dtype_of(next(iter(low)) if low else torch.float32)
    p = stated
    if p.is_low_precision and low and low != {p.dtype}:
        raise TypeError(f"HybridZeroOptimizer: dtype={p.name} but the parameters are {next(iter(low))}")
    if not p.is_low_precision and low:
        raise TypeError(
            f"HybridZeroOptimizer: dtype={p.name} but some parameters are {next(iter(low))}; "
            "pass the model's low-precision dtype"
        )
    if p.is_low_precision and not low:
        warnings.warn(
            f"HybridZeroOptimizer: dtype={p.name} but every parameter is fp32 "
            "(wrap the model in NaiveAMPModel before building the optimizer?)",
            stacklevel=4,
        )
    return p


@dataclass(frozen=True)
class MasterPolicy:
    """``master_dtype`` / ``master_compensation`` / ``optimizer_state_dtype`` and how a step applies them."""

    master_dtype: torch.dtype = torch.float32
    compensation: str = "none"
    state_dtype: torch.dtype = torch.float32
    seed: int = 0

    @classmethod
    def from_dtypes(cls, dtypes: OptimizerDtypes, optimizer: torch.optim.Optimizer, seed: int = 0) -> MasterPolicy:
        """The policy of the precision plan's optimizer dtypes, checked against the optimizer."""
        if dtypes.compensation not in COMPENSATIONS:
            raise ValueError(f"hybrid_zero_optimizer.master_compensation must be one of {list(COMPENSATIONS)}, "
                             f"got {dtypes.compensation!r}")
        policy = cls(dtypes.master, dtypes.compensation, dtypes.state, int(seed))
        if policy.custom and type(optimizer) is not torch.optim.AdamW:
            raise ValueError("low-precision masters / optimizer states are implemented for torch.optim.AdamW, "
                             f"not {type(optimizer).__name__}")
        return policy

    @property
    def custom(self) -> bool:
        """True when low-precision storage is asked for (masters or moments), which only the fused AdamW
        update of ``lowp_adamw`` implements."""
        return self.master_dtype != torch.float32 or self.state_dtype != torch.float32

    @staticmethod
    def fused(optim: torch.optim.Optimizer) -> bool:
        """Whether the update runs in ``lowp_adamw``'s fused AdamW: for ``torch.optim.AdamW`` without amsgrad,
        maximize or differentiable (the inner optimizer's own ``step`` otherwise)."""
        return type(optim) is torch.optim.AdamW and not any(
            g.get("amsgrad") or g.get("maximize") or g.get("differentiable") for g in optim.param_groups)

    def update(self, optim: torch.optim.Optimizer, buckets: list[Bucket], grads: list[torch.Tensor],
               observer: StepObserver | None = None) -> None:
        """Apply one update to every bucket's master shard from its unscaled, clipped fp32 grad shard;
        ``observer`` (precision telemetry) sees each chunk of the update."""
        if not self.fused(optim):
            log_once(f"optimizer update: {type(optim).__name__}.step() on the fp32 master shards (the fused "
                     "update covers torch.optim.AdamW without amsgrad / maximize / differentiable)")
            before = [b.master.detach().to(torch.float32, copy=True) for b in buckets] if observer is not None else []
            for b, g in zip(buckets, grads):
                b.master.grad = g
            optim.step()
            for i, b in enumerate(buckets):
                b.master.grad = None
                if observer is not None:  # a whole shard at once: this path keeps no chunks of its own
                    after = b.master.detach().float()
                    observer.update(i, 0, after.numel(), after - before[i], before[i], after == before[i])
            return
        log_once(f"optimizer update: fused AdamW kernel, {_short(self.master_dtype)} masters"
                 f"{'' if self.compensation == 'none' else ' + ' + self.compensation}, "
                 f"{_short(self.state_dtype)} moments")
        for i, (b, g, group) in enumerate(zip(buckets, grads, optim.param_groups)):
            state = optim.state[b.master]
            comp = self.compensation if b.master.dtype == torch.bfloat16 else "none"
            step = int(state["step"]) + 1 if "step" in state else 1
            noise = self._noise(b, step) if comp == "stochastic" else None
            adamw_step(b.master, g, state, group, compensation=comp, state_dtype=self.state_dtype, noise=noise,
                       observe=None if observer is None else functools.partial(observer.update, i))

    def _noise(self, b: Bucket, step: int) -> Noise:
        """Random bits for shard elements ``[start, stop)`` of bucket ``b``: per parameter element, layout-free
        (padding draws zeros)."""
        pieces = [(b.offsets[i] + a - b.lo, a, z, name_key(b.names[i])) for i, a, z in b.shard_pieces()]
        device = b.master.device

        def draw(start: int, stop: int) -> torch.Tensor:
            out = torch.empty(stop - start, dtype=torch.int32, device=device)
            filled = start  # pieces are in shard order; the gaps between them (padding) draw zeros
            for at, a, z, key in pieces:  # shard [at, at + z - a) holds elements [a, z) of the parameter
                lo, hi = max(start, at), min(stop, at + z - a)
                if lo < hi:
                    out[filled - start : lo - start].zero_()
                    element_noise(a + lo - at, a + hi - at, key, step, self.seed, device,
                                  out=out[lo - start : hi - start])
                    filled = hi
            out[filled - start :].zero_()
            return out

        return draw


def _short(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtype, str(dtype))
