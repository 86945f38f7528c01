"""Run a command-line tool of ``tools/`` in this process, as tests do (saves a Python and torch start per call)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_tool(name: str, *args: str) -> str:
    """``tools/<name>``'s ``main(argv)`` with ``args``; its stdout. A non-zero exit raises AssertionError
    carrying the end of its stdout and stderr."""
    spec = importlib.util.spec_from_file_location(f"_tool_{name[:-3]}", os.path.join(ROOT, "tools", name))
    assert spec is not None and spec.loader is not None, f"no tool tools/{name}"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = module.main(list(args))
    assert code == 0, f"{name} {args} failed:\n{out.getvalue()[-2000:]}\n{err.getvalue()[-3000:]}"
    return out.getvalue()
