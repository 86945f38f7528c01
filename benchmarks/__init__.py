"""Benchmarks of tessera's training step (``python tools/bench.py``): see ``benchmarks.runner``.

Kept inside the package (not only under ``tools/``) so spawned worker processes can import the
measurement functions by module path, and tests can run the bench in a tiny mode.
"""
