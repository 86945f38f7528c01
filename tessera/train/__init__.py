"""Training: the precision wrapper, the optimizer built from the config (``tessera.optim`` holds the
optimizer itself), LR schedule, the step, metrics."""
