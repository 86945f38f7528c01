"""Training: the precision wrapper, the one builder of the training stack (``builder``; the optimizer
itself lives in ``tessera.optim``), the LR schedule, the step, metrics, stop requests, the memory check."""
