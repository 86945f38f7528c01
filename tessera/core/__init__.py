"""The import paths of DESIGN.md's public API: ``tessera.core.config``, ``.context``, ``.precision``,
``.naive_amp``, ``.grad_scaler`` and ``.optimizer`` re-export the contract names from where the code
lives (``tessera.config``, ``tessera.dist``, ``tessera.train``, ``tessera.optim``). New code imports from
the real modules; nothing inside tessera imports this package.
"""
