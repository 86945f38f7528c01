"""``train.py`` with file operations refused by the "operating system" — for tests/test_io_faults.py only.

Run it exactly like train.py (``torchrun ... tests/io_fault_train.py --config ... key=value``). Production
code stays free of fault switches: the refusal is a monkeypatch applied before ``train.run()``, standing in
for what a root-owned test machine cannot produce (a permission denied on read) or only produces with a
mount (a disk full).

  TESSERA_REFUSE="RANKS:ERRNO:WHERE:FRAGMENT"  on the ranks in RANKS ("*" = every rank, else "0,1"),
      calls of WHERE whose path contains FRAGMENT raise ``OSError(ERRNO, strerror, path)``. WHERE is
      ``memmap`` (numpy.memmap: how token files are read), ``open`` (builtins.open for writing: how token
      files are prepared) or ``metrics`` (a line written to metrics.jsonl, from the Nth line of this
      process on: FRAGMENT is N).
"""

from __future__ import annotations

import builtins
import importlib.util
import os
import sys

import numpy as np

from tessera.train import metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_train_script():
    """The repository's train.py as module ``train`` (a script at the root, loaded from its path)."""
    spec = importlib.util.spec_from_file_location("train", os.path.join(ROOT, "train.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["train"] = module
    spec.loader.exec_module(module)
    return module


def _refuse(code: int, path: str) -> None:
    raise OSError(code, os.strerror(code), path)


def _install(ranks: str, code: int, where: str, fragment: str) -> None:
    if ranks != "*" and os.environ.get("RANK", "0") not in ranks.split(","):
        return
    if where == "memmap":
        real = np.memmap

        def memmap(filename, *args, **kwargs):
            if fragment in os.fspath(filename):
                _refuse(code, os.fspath(filename))
            return real(filename, *args, **kwargs)

        np.memmap = memmap
    elif where == "open":
        real_open = builtins.open

        def refusing_open(file, mode="r", *args, **kwargs):
            if isinstance(file, (str, os.PathLike)) and fragment in os.fspath(file) and set(mode) & set("wax+"):
                _refuse(code, os.fspath(file))
            return real_open(file, mode, *args, **kwargs)

        builtins.open = refusing_open
    elif where == "metrics":
        real_record = metrics.MetricsWriter._record
        lines = {"n": 0}

        def record(self, values):
            lines["n"] += 1
            if lines["n"] >= int(fragment):
                _refuse(code, os.path.join(self.log_dir, "metrics.jsonl"))
            real_record(self, values)

        metrics.MetricsWriter._record = record
    else:
        raise SystemExit(f"io_fault_train: unknown WHERE {where!r}")


if os.environ.get("TESSERA_REFUSE"):
    ranks_, errno_, where_, fragment_ = os.environ["TESSERA_REFUSE"].split(":", 3)
    _install(ranks_, int(errno_), where_, fragment_)
_load_train_script().run()
