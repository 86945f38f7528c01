"""Training: the one builder of the training stack (``builder``: decoder, ``tessera.core``'s precision
wrapper, ``tessera.optim``'s optimizer), the LR schedule, the step, metrics, stop requests, the memory check."""
