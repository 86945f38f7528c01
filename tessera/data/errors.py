"""The one exception type of the data pipeline.

A subclass of ValueError so callers that already catch bad values keep working; every message names
the file, folder or value at fault, because data problems surface far from where they were made.
"""

from __future__ import annotations


class DataError(ValueError):
    """Bad or inconsistent training data (missing folder, corrupt token file, id out of vocab, ...)."""
