"""``tessera.train.grad_scaler``, kept importable as ``tessera.core.grad_scaler`` (the public API of DESIGN.md).

The module object is the same one, so names, state and monkeypatching agree under both paths.
"""

import sys

import tessera.train.grad_scaler as _moved

sys.modules[__name__] = _moved
