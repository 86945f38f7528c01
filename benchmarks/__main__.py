"""``python -m benchmarks [flags]`` / ``python -m benchmarks <measurement> [flags]`` (see ``benchmarks.cli``)."""

import sys

from benchmarks.cli import main

if __name__ == "__main__":  # spawned workers re-import nothing from here (multiprocessing skips package __main__)
    sys.exit(main())
