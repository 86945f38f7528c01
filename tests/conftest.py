"""Shared pytest setup: CUDA-marked tests are skipped where no GPU exists; one thread per process.

The repository root (``train.py``, ``benchmarks/``, ``tests``) is importable through pytest.ini's
``pythonpath = .``; processes the tests spawn inherit that ``sys.path``.
"""

import pytest
import torch

torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
