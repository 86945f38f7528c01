"""Messages logged once per process: a kernel, route or default chosen on first use says so once, not on
every call that makes the same choice again. Imports nothing from tessera, so every layer may use it.

The message text is the key: a choice logs one line per distinct text (each backend with its reason,
each dtype it ran for). Nothing is logged from code that ``torch.compile`` traces (a logger call would
break the graph there); the first eager call of the same code logs the choice.
"""

from __future__ import annotations

import logging

import torch

__all__ = ["log_once"]

logger = logging.getLogger("tessera")
_LOGGED: set[str] = set()  # the texts logged so far in this process


def log_once(message: str, level: int = logging.INFO) -> None:
    """Log ``message`` on the ``tessera`` logger the first time this process sees its text."""
    if torch.compiler.is_compiling() or message in _LOGGED:  # first: a traced read of the set would guard on it
        return
    _LOGGED.add(message)
    logger.log(level, message)

