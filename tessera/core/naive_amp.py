"""``tessera.train.naive_amp``, kept importable as ``tessera.core.naive_amp`` (the public API of DESIGN.md).

The module object is the same one, so names, state and monkeypatching agree under both paths.
"""

import sys

import tessera.train.naive_amp as _moved

sys.modules[__name__] = _moved
