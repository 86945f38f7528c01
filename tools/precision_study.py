"""Train the demo under each precision policy and write the comparison into BENCHMARKS.md.

    python tools/precision_study.py [--only NAME ...] [--render] [--workdir DIR] [key.sub=value ...]

Runs ``python -m benchmarks.precision_study`` with the repository root on PYTHONPATH (the benchmarks
folder is not part of the installed package), replacing this process.
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

if __name__ == "__main__":
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    os.execve(sys.executable, [sys.executable, "-P", "-m", "benchmarks.precision_study", *sys.argv[1:]], env)
