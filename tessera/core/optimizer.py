"""``tessera.train.optimizer``, kept importable as ``tessera.core.optimizer`` (the public API of DESIGN.md).

The module object is the same one, so names, state and monkeypatching agree under both paths.
"""

import sys

import tessera.train.optimizer as _moved

sys.modules[__name__] = _moved
