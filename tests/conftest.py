"""Shared pytest setup: CUDA-marked tests are skipped where no GPU exists; the cases of ``tests/quick_run.py``
are marked slow, and its quick-only cases are skipped when the slow tests run; one thread per process; the
block quantizers run eagerly (``TESSERA_QUANTIZER=eager``, inherited by the processes the tests spawn) unless
a test asks for them compiled: compiling them in every process would cost minutes, and
``tests/test_quantizer_kernels.py`` checks the compiled kernels bitwise against the eager ops.

The repository root (``train.py``, ``benchmarks/``, ``tests``) is importable through pytest.ini's
``pythonpath = .``; processes the tests spawn inherit that ``sys.path``.
"""

import os

import pytest
import torch

from tests.quick_run import QUICK_ONLY, SLOW_IN_QUICK_RUN

torch.set_num_threads(1)
os.environ.setdefault("TESSERA_QUANTIZER", "eager")


def pytest_collection_modifyitems(config, items):
    slow = pytest.mark.slow
    for item in items:  # covered in the quick run by a faster case (tests/quick_run.py)
        if item.nodeid in SLOW_IN_QUICK_RUN:
            item.add_marker(slow)
    if "not slow" not in (config.option.markexpr or ""):  # the slow tests run: they check what these check
        for item in items:
            if item.nodeid in QUICK_ONLY:
                item.add_marker(pytest.mark.skip(reason=f"quick-run case; checked by {QUICK_ONLY[item.nodeid]}"))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
