"""``tessera.config``, kept importable as ``tessera.core.config`` (the public API of DESIGN.md).

The module object is the same one, so names, state and monkeypatching agree under both paths.
"""

import sys

import tessera.config as _moved

sys.modules[__name__] = _moved
