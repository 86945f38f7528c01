"""``from tessera.core.precision import parse_dtype``: the DESIGN.md path of the dtype parser.

Re-export of ``tessera.config.precision``, where the precision names live; patch it there.
"""

from tessera.config.precision import parse_dtype

__all__ = ["parse_dtype"]
