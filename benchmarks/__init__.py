"""Benchmarks of tessera's training step, outside the installed package.

Run them with ``python tools/bench.py`` (which runs ``python -m benchmarks`` with the repository root on
``PYTHONPATH``); ``benchmarks.cli`` holds the command line, ``benchmarks.runner`` the measurements,
``benchmarks.report`` the markdown and ``benchmarks.plain`` the plain-PyTorch reference step. The
measurement functions run in spawned worker processes, which import them by module path: spawned
children start with the parent's ``sys.path``, so ``benchmarks`` must be importable in the parent.
"""
