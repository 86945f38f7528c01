"""Benchmark tessera's training step side by side with plain PyTorch and write BENCHMARKS.md.

    python tools/bench.py [--quick] [--out BENCHMARKS.md] [--json results.json] [--threads N]
                          [--config configs/demo.py] [key.sub=value ...]
    python tools/bench.py --only-gpu --out BENCHMARKS_GPU.md      # the GPU section alone (needs CUDA)
    python tools/bench.py --render results.json --out BENCHMARKS.md  # re-render a saved run (no measuring)
    python tools/bench.py --help                                   # every flag

The benchmarks live in the top-level ``benchmarks/`` folder, which is not part of the installed package,
and their measurement functions run in spawned worker processes that import them by module path. So
this script runs ``python -m benchmarks <flags>`` with the repository root on that process's
``PYTHONPATH`` (replacing this process: same pid, signals and exit status), rather than editing
``sys.path``. ``main(argv)`` runs the benchmarks in the calling process instead; that needs
``benchmarks`` importable there, as under pytest (``pythonpath = .`` in pytest.ini).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv: Sequence[str] | None = None) -> int:
    """``benchmarks.cli.main`` in this process (``benchmarks`` must be importable); returns the exit status."""
    from benchmarks.cli import main as bench_main

    return bench_main(argv, prog="bench.py")


def exec_as_module(argv: Sequence[str]) -> None:
    """Replace this process with ``python -m benchmarks <argv>``, the repository root first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    # -P (Python >= 3.11): do not put the working directory first on sys.path, so a folder named
    # ``benchmarks`` in the directory the command is started from cannot shadow this repository's
    flags = ["-P"] if sys.version_info >= (3, 11) else []
    os.execve(sys.executable, [sys.executable, *flags, "-m", "benchmarks", *argv], env)


if __name__ == "__main__":
    exec_as_module(sys.argv[1:])
