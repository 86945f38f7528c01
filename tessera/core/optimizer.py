"""``tessera.core.optimizer``: the documented path (DESIGN.md) of HybridZeroOptimizer, which lives in
``tessera.optim.hybrid_zero``."""

from tessera.optim.hybrid_zero import HybridZeroOptimizer, TooManySkippedSteps

__all__ = ["HybridZeroOptimizer", "TooManySkippedSteps"]
