"""``tessera.config.precision``, kept importable as ``tessera.core.precision`` (the public API of DESIGN.md).

The module object is the same one, so names, state and monkeypatching agree under both paths.
"""

import sys

import tessera.config.precision as _moved

sys.modules[__name__] = _moved
