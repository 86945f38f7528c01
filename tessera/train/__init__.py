"""Training: the precision wrapper, grad scalers, HybridZeroOptimizer, LR schedule, the step, metrics."""
