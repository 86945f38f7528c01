"""What a test prints when a subprocess (train.py, torchrun, a tool) failed: its first error, not its last warnings.

Why: a failing run's stderr ends with whatever was logged last (config notes, other ranks' warnings, torchrun's
own ``ChildFailedError`` report), so the tail of stderr often hides the line that says what went wrong. The
first error is found in this order: tessera's own ``error:`` line, the exception line closing the first Python
traceback, then the first line that names an error or a signal. The message shows that line, a few lines of
context around it, and a short tail of both streams.
"""

from __future__ import annotations

import re
import subprocess
from typing import Any

__all__ = ["explain", "first_error"]

_TESSERA_ERROR = re.compile(r"(^|\] )error: ")
_EXCEPTION_LINE = re.compile(r"^\s*([A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Failure|Timeout)\b.*)$")
_ANY_ERROR = re.compile(r"error|exception|traceback|signal|killed|timed out|segmentation", re.IGNORECASE)


def _first_error_index(lines: list[str]) -> int | None:
    for i, line in enumerate(lines):
        if _TESSERA_ERROR.search(line):
            return i
    for i, line in enumerate(lines):
        if line.lstrip().startswith("Traceback (most recent call last)"):
            for j in range(i + 1, len(lines)):
                if _EXCEPTION_LINE.match(lines[j]) and not lines[j].startswith((" ", "\t")):
                    return j
            return i
    for i, line in enumerate(lines):
        if _ANY_ERROR.search(line):
            return i
    return None


def first_error(text: str) -> str | None:
    """The first line of ``text`` that says what failed (see the module docstring), or None."""
    lines = text.splitlines()
    i = _first_error_index(lines)
    return None if i is None else lines[i].strip()


def explain(proc: subprocess.CompletedProcess[str] | subprocess.CompletedProcess[bytes] | Any, *, context: int = 12,
            tail: int = 1500) -> str:
    """A failure message for ``proc`` (a ``CompletedProcess``, or any object with ``stdout``, ``stderr`` and
    ``returncode`` or ``rc``): its exit code, its first error line with context, and the streams' tails."""
    def text(stream: str | bytes | None) -> str:
        return stream.decode(errors="replace") if isinstance(stream, bytes) else (stream or "")

    err, out = text(proc.stderr), text(proc.stdout)
    parts = [f"exit code {getattr(proc, 'returncode', getattr(proc, 'rc', None))}"]
    for name, stream in (("stderr", err), ("stdout", out)):
        lines = stream.splitlines()
        i = _first_error_index(lines)
        if i is not None:
            parts.append(f"first error ({name}): {lines[i].strip()}")
            lo = max(0, i - context)
            parts.append(f"--- {name} around it ---\n" + "\n".join(lines[lo:i + context + 1]))
            break
    else:
        parts.append("first error: none found in stderr or stdout")
    parts.append(f"--- stderr tail ---\n{err[-tail:]}")
    if out:
        parts.append(f"--- stdout tail ---\n{out[-tail // 2:]}")
    return "\n".join(parts)
