"""argparse ``type=`` callables that check a numeric flag's range, for the scripts under ``tools/``.

Config keys are validated when a config loads; command-line flags deserve the same, or
``--max-new-tokens -4`` runs, exits 0 and reports a negative token count. Each callable parses
the text and raises ``argparse.ArgumentTypeError`` naming the value and the allowed range, so argparse
prints ``error: argument --max-new-tokens: -4 is not a positive integer (must be >= 1)`` and exits
with status 2 before anything expensive (a checkpoint load, a spawned process) has started.

Floats must be finite: ``nan`` compares false with every bound and ``inf`` makes no sense as a
temperature or a fraction, so neither slips through. Stdlib only, so a tool can import it before torch.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = [
    "fraction",
    "nonnegative_float",
    "nonnegative_int",
    "off_or_int_at_least",
    "positive_float",
    "positive_int",
    "probability",
    "random_seed",
]

SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed overflows above this


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number")
    return value


def off_or_int_at_least(minimum: int) -> Callable[[str], int]:
    """0 (the feature is off) or an integer ``>= minimum``: for options where 1 is meaningless, like
    "hold out every Nth document" (every 1st would hold out everything)."""

    def parse(text: str) -> int:
        value = _int(text)
        if value != 0 and value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is not valid (must be 0 = off, or >= {minimum})")
        return value

    return parse


def positive_int(text: str) -> int:
    """An integer >= 1: token counts, thread counts, TP/DP/ZeRO sizes, lengths."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer (must be >= 1)")
    return value


def nonnegative_int(text: str) -> int:
    """An integer >= 0: options where 0 means "off" (e.g. top-k 0 keeps the whole vocabulary)."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is not a non-negative integer (must be >= 0)")
    return value


def random_seed(text: str) -> int:
    """A random seed in [0, 2**64 - 1], the range ``torch.Generator.manual_seed`` takes without wrapping."""
    value = _int(text)
    if not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"{value} is not a valid seed (must be in [0, 2**64 - 1])")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = _float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number (must be > 0)")
    return value


def nonnegative_float(text: str) -> float:
    """A finite number >= 0: e.g. a sampling temperature, where 0 means greedy."""
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is not a non-negative number (must be >= 0)")
    return value


def probability(text: str) -> float:
    """A number in (0, 1]: top-p nucleus mass (1 keeps everything; 0 would keep nothing)."""
    value = _float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text} is not in (0, 1]")
    return value


def fraction(text: str) -> float:
    """A number in [0, 1): a share held out of something (0 holds out nothing; 1 would leave nothing)."""
    value = _float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not in [0, 1)")
    return value
