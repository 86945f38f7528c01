"""Compatibility paths of the public API (``tessera.core.config``, ``.context``, ``.precision``,
``.naive_amp``, ``.grad_scaler``, ``.optimizer``): ``.optimizer`` and ``.grad_scaler`` re-export the
documented names from ``tessera.optim``; the others are the moved module itself. New code imports from
``tessera.config``, ``tessera.dist``, ``tessera.optim`` and ``tessera.train``; nothing inside tessera
imports this.
"""
