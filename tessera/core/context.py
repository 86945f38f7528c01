"""``tessera.dist``, kept importable as ``tessera.core.context`` (the public API of DESIGN.md).

The module object is the same one, so names, state and monkeypatching agree under both paths.
"""

import sys

import tessera.dist as _moved

sys.modules[__name__] = _moved
