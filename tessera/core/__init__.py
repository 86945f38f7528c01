"""Compatibility paths of the public API (``tessera.core.config``, ``.context``, ``.precision``,
``.naive_amp``, ``.grad_scaler``, ``.optimizer``): each is the moved module itself. New code imports
from ``tessera.config``, ``tessera.dist`` and ``tessera.train``; nothing inside tessera imports this.
"""
