"""The import paths of DESIGN.md's public API: ``tessera.core.config``, ``.context``, ``.precision`` and
``.naive_amp`` re-export the contract names from where the code lives (``tessera.config``,
``tessera.dist``, ``tessera.train``); ``.grad_scaler`` and ``.optimizer`` are aliases of their modules.
New code imports from the real modules; nothing inside tessera imports this package.
"""
