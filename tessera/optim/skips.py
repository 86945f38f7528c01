"""Step bookkeeping of HybridZeroOptimizer: counts, recent loss scales, and the diverged-run stop.

A skipped step (inf/NaN gradients) is normal under fp16 while the dynamic loss scale can still back
off: that is the scaler doing its job. Only skips at its minimum scale count towards
``max_consecutive_skips``; a constant scale is always "at the minimum", so bf16/fp32 count every skip.
"""

from __future__ import annotations

import math

from tessera.precision.scaler import BaseGradScaler

__all__ = ["TooManySkippedSteps", "StepRecord", "SCALE_HISTORY"]

SCALE_HISTORY = 1024  # loss scales of the last steps kept in ``scale_history``


class TooManySkippedSteps(RuntimeError):
    """Raised by ``step()`` when more than ``max_consecutive_skips`` steps in a row overflow (a diverged run);
    with a dynamic (fp16) scaler only overflows at its ``min_scale`` count."""


class StepRecord:
    """Steps taken and skipped, the loss scale of each recent step, and the consecutive-skip limit."""

    def __init__(self, max_consecutive_skips: int | None) -> None:
        self.max_consecutive_skips = max_consecutive_skips
        self.num_steps = 0
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.scale_history: list[float] = []  # the recent window only: it is read by tests and reports
        self.last_grad_norm: float | None = None

    def begin(self, scale: float) -> None:
        """A step starts under loss scale ``scale``."""
        self.scale_history.append(scale)
        del self.scale_history[:-SCALE_HISTORY]
        self.num_steps += 1

    @staticmethod
    def at_min_scale(scaler: BaseGradScaler) -> bool:
        """Whether a skip now counts towards the limit (read before the scaler updates)."""
        return scaler.scale <= getattr(scaler, "min_scale", math.inf)

    def end(self, success: bool, grad_norm: float, counts: bool, scaler: BaseGradScaler) -> None:
        """Record the step's outcome; ``counts``: a skip counts towards the limit. Raises
        TooManySkippedSteps once more than ``max_consecutive_skips`` counted skips come in a row."""
        if success:
            self.consecutive_skips = 0
            self.last_grad_norm = grad_norm
            return
        self.skipped_steps += 1
        self.last_grad_norm = grad_norm
        if not counts:
            return
        self.consecutive_skips += 1
        if self.max_consecutive_skips and self.consecutive_skips > self.max_consecutive_skips:
            floor = " at the minimum loss scale" if hasattr(scaler, "min_scale") else ""
            raise TooManySkippedSteps(
                f"{self.consecutive_skips} optimizer steps in a row had inf/NaN gradients{floor} "
                f"(loss scale now {scaler.scale:g}); the run has diverged "
                "(hybrid_zero_optimizer.max_consecutive_skips)"
            )

    def restore(self, skipped_steps: int, num_steps: int) -> None:
        """Counters from a checkpoint; the consecutive count restarts."""
        self.skipped_steps = int(skipped_steps)
        self.num_steps = int(num_steps)
        self.consecutive_skips = 0
