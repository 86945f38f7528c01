"""``python -m benchmarks [flags]``: the same as ``python tools/bench.py [flags]`` (see ``benchmarks.cli``)."""

import sys

from benchmarks.cli import main

if __name__ == "__main__":  # spawned workers re-import nothing from here (multiprocessing skips package __main__)
    sys.exit(main())
