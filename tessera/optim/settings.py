"""The ``hybrid_zero_optimizer`` config section, read once: the only way its values reach the optimizer.

Keys as in the config schema (``tessera.config.schema``), which validates a config file; this reads
the section a caller passes (a validated config's, or a partial dict in tests and tools), with
defaults for what is absent. Defaults keep a directly built optimizer unchanged by the config's own
defaults, except ``max_consecutive_skips``: None here (no limit), 20 in a config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tessera.config.dtypes import ModelDtype
from tessera.config.schema import DEFAULT_REDUCE_BUCKET_SIZE
from tessera.precision.plan import OptimizerDtypes, optimizer_dtypes

__all__ = ["ZeroSettings"]


@dataclass(frozen=True)
class ZeroSettings:
    """Clipping, gradient reduction, skip limit and master/moment policy of one HybridZeroOptimizer."""

    clip_grad_norm: float = 1.0  # 0 disables clipping
    reduce_dtype: str = "fp32"  # dtype of gradient accumulation and the DP reduction: "fp32" | "model"
    master_dtype: str = "fp32"  # "fp32" | "bf16" (checked by MasterPolicy)
    master_compensation: str = "none"  # "none" | "kahan" | "stochastic" (checked by MasterPolicy)
    optimizer_state_dtype: str = "fp32"  # "fp32" | "bf16" (checked by MasterPolicy)
    overlap_sync_grad: bool = True  # launch bucket reductions during the last backward
    reduce_bucket_size: int = DEFAULT_REDUCE_BUCKET_SIZE  # elements per gradient bucket
    max_consecutive_skips: int | None = None  # stop the run after more skips in a row (None: never)
    fuse_wgrad_accumulation: bool = True  # linears add weight gradients into the fp32 main grads in the GEMM

    @classmethod
    def from_config(cls, zero_cfg: Mapping[str, Any] | None) -> ZeroSettings:
        """Settings from the config section (unknown keys are an error: a typo must not fall back silently)."""
        raw = dict(zero_cfg or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"hybrid_zero_optimizer: unknown key(s) {unknown}; valid: {sorted(known)}")
        s = cls(**raw)
        s = dataclasses.replace(s, clip_grad_norm=float(s.clip_grad_norm), overlap_sync_grad=bool(s.overlap_sync_grad),
                                fuse_wgrad_accumulation=bool(s.fuse_wgrad_accumulation),
                                reduce_bucket_size=int(s.reduce_bucket_size))
        if s.clip_grad_norm < 0:
            raise ValueError(f"clip_grad_norm must be >= 0 (0 disables), got {s.clip_grad_norm}")
        if s.reduce_dtype not in ("fp32", "model"):
            raise ValueError(f"reduce_dtype must be 'fp32' or 'model', got {s.reduce_dtype!r}")
        if s.reduce_bucket_size < 1:
            raise ValueError(f"reduce_bucket_size must be >= 1 (elements), got {s.reduce_bucket_size}")
        return s

    def dtypes(self, model: ModelDtype) -> OptimizerDtypes:
        """The master / moment / reduction dtypes these settings ask for under ``model`` (the precision plan's one
        resolver, which also checks the rules between them and the model dtype)."""
        return optimizer_dtypes(self.master_dtype, self.optimizer_state_dtype, self.reduce_dtype,
                                self.master_compensation, model)
