"""Peak resident memory of one script, measured in a fresh process of its own.

A test process must not judge a child's memory from the counters it shares with the rest of the session
(the peak over every child reaped so far depends on which tests ran before). ``run_measured`` starts a new
interpreter that imports ``preload`` (the libraries the script stands on: their size is the baseline, not
the script's), reads its resident set size then (the baseline), runs the script as ``__main__`` with its
arguments, and reads its own peak RSS. The parent gets both numbers through a file, so the script's stdout
and stderr stay its own.

Between the imports and the script the peak is reset to the current RSS (Linux's ``/proc/self/clear_refs``;
the peak is then ``VmHWM``): an import that briefly held more than it keeps (how much depends on the
environment, e.g. an inductor cache directory set by an earlier test) belongs to neither the baseline nor the
script. So ``growth_bytes`` is what the script added on top of its imports. Without ``/proc`` the baseline
falls back to the peak so far (``getrusage``), and a growth can only look larger.
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import runpy
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# ru_maxrss is in KiB on Linux, in bytes on macOS
_RSS_UNIT = 1 if sys.platform == "darwin" else 1024


def own_peak_rss_bytes() -> int:
    """This process's peak resident set size so far (its own, not its children's): ``VmHWM`` of
    ``/proc/self/status`` (which ``_reset_peak`` can reset), else ``getrusage``'s (which nothing resets)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * _RSS_UNIT


def own_rss_bytes() -> int:
    """This process's resident set size now (``/proc/self/statm``), or its peak so far without ``/proc``."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return own_peak_rss_bytes()


@dataclass
class ScriptMemory:
    """One measured run: the script's exit status and output, the fresh process's RSS when the script started
    (after ``preload``) and its peak RSS when the script had ended."""

    returncode: int
    stdout: str
    stderr: str
    baseline_bytes: int
    peak_bytes: int

    @property
    def growth_bytes(self) -> int:
        """How far the process's peak rose above the RSS the script started from."""
        return self.peak_bytes - self.baseline_bytes


def run_measured(script: str, args: Sequence[str] = (), *, preload: Sequence[str] = ("torch",), timeout: float,
                 cwd: str | None = None) -> ScriptMemory:
    """Run ``script`` (a path) with ``args`` in a fresh interpreter and measure its peak RSS.

    ``timeout``: a hang guard (``subprocess.TimeoutExpired`` past it), not a speed requirement. The child
    finds this repository's packages first (its root leads ``PYTHONPATH``), as the test process does.
    Raises ``RuntimeError`` when the child ends without a measurement (killed, or it could not start).
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [env.get("PYTHONPATH")])])
    with tempfile.TemporaryDirectory(prefix="tessera_rss_") as tmp:
        result = os.path.join(tmp, "rss.json")
        proc = subprocess.run([sys.executable, "-c", _CHILD, result, ",".join(preload), script, *args],
                              capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
        if not os.path.exists(result):
            raise RuntimeError(f"{script} ended without a memory measurement (exit {proc.returncode}):\n"
                               f"{proc.stderr[-3000:]}")
        with open(result) as f:
            rss = json.load(f)
    return ScriptMemory(proc.returncode, proc.stdout, proc.stderr, rss["baseline"], rss["peak"])


def _reset_peak() -> None:
    """Reset this process's peak RSS to its current RSS (Linux: ``/proc/self/clear_refs``, value 5); where that
    is not possible the peak so far stays, which can only make a growth look larger."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


_CHILD = "import sys; from harness.peak_rss import _child; sys.exit(_child(*sys.argv[1:4], sys.argv[4:]))"


def _child(result: str, preload: str, script: str, args: list[str]) -> int:
    for name in filter(None, preload.split(",")):
        importlib.import_module(name)
    _reset_peak()  # the imports' own transient peak is not the script's
    baseline = own_rss_bytes()
    sys.argv = [script, *args]
    code: object = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code
    finally:  # an exception still leaves the figures (and its traceback on stderr)
        with open(result, "w") as f:
            json.dump({"baseline": baseline, "peak": own_peak_rss_bytes()}, f)
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1

