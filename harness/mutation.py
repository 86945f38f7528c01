"""The mutation pass: break one promise at a time in tessera/ and check that a fast test notices.

Run it before a release, not in CI (each mutant is a pytest run of its own; the whole pass takes
minutes on 2 cores, and it says whether the *tests* are good, not whether the code is)::

    python -m harness.mutation [--only NAME ...] [--report docs/mutation-report.md] [--timeout 300]
                               [--equivalent] [--no-baseline] [--list]

For each mutant of ``harness/mutants.py`` it copies the repository's files (tracked and untracked,
not ignored: the working tree as it is) into a fresh temporary folder, replaces the mutant's original
snippet in its file (which must occur there exactly once: a snippet that drifted from the code is an
error, so the list cannot rot silently), and runs ``python -m pytest -q -x -p no:cacheprovider <tests>``
in that copy with ``PYTHONPATH`` set to it (so the tests and their spawned ranks import the mutated
code, not an installed tessera), bounded by a per-mutant time limit. Outcomes:

    killed    pytest failed (exit code 1): a test caught the broken promise
    survived  pytest passed: no listed test notices; a test is missing (or the mutant is equivalent)
    error     the snippet is not found exactly once, a timeout, or any other pytest exit code

First, unless ``--no-baseline``, the listed tests run once on the unmutated copy: a failing baseline
would make every mutant look killed. ``--equivalent`` also runs the mutants listed as equivalent
(expected to survive; one that is killed means its stated reason is wrong). The markdown report (date,
commit, machine, each mutant's outcome, killing test and seconds) goes to ``--report``. The exit code
is 1 when a non-equivalent mutant survived or anything errored, else 0.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

from harness.distributed import descendants
from harness.mutants import EQUIVALENT, MUTANTS, Mutant

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TIMEOUT_S = 300.0
_FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)


@dataclass
class Outcome:
    """What one pytest run of one mutant gave."""

    mutant: Mutant
    status: str  # killed | survived | error
    seconds: float
    killer: str = ""  # the first failing test id (killed), or why it errored
    equivalent: bool = False

    @property
    def ok(self) -> bool:
        """Whether this outcome is the one the list expects."""
        return self.status == ("survived" if self.equivalent else "killed")


def apply_mutant(text: str, mutant: Mutant) -> str:
    """``text`` with the mutant's snippet replaced; ValueError unless the snippet occurs exactly once."""
    count = text.count(mutant.original)
    if count != 1:
        raise ValueError(f"mutant {mutant.name}: the original snippet occurs {count} times in {mutant.path} "
                         "(expected exactly once: update harness/mutants.py to the code)")
    return text.replace(mutant.original, mutant.replacement)


def check_snippets(mutants: Sequence[Mutant], root: str = ROOT) -> list[str]:
    """Problems with the list against the code at ``root``: snippets not found exactly once, files or test
    files that do not exist, duplicate names. Empty when the list is sound."""
    problems, seen = [], set()
    for m in mutants:
        if m.name in seen:
            problems.append(f"{m.name}: duplicate name")
        seen.add(m.name)
        path = os.path.join(root, m.path)
        if not m.path.startswith("tessera/") or not os.path.isfile(path):
            problems.append(f"{m.name}: {m.path} is not a file under tessera/")
            continue
        if m.original == m.replacement:
            problems.append(f"{m.name}: the replacement equals the original")
        if not m.tests:  # pytest without arguments would run the whole suite
            problems.append(f"{m.name}: no tests listed")
        with open(path, encoding="utf-8") as f:
            try:
                apply_mutant(f.read(), m)
            except ValueError as e:
                problems.append(str(e))
        for test in m.tests:
            if not os.path.isfile(os.path.join(root, test.split("::")[0])):
                problems.append(f"{m.name}: test file {test.split('::')[0]} does not exist")
    return problems


def repository_files(root: str = ROOT) -> list[str]:
    """The working tree's files that git tracks or would track (untracked, not ignored), relative paths."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         check=True, capture_output=True, text=True).stdout
    return sorted({p for p in out.split("\0") if p and os.path.isfile(os.path.join(root, p))})


def make_copy(dest: str, files: Sequence[str], root: str = ROOT) -> None:
    """Copy ``files`` (relative to ``root``) into ``dest``, keeping the layout."""
    for rel in files:
        target = os.path.join(dest, rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(os.path.join(root, rel), target)


def _kill_tree(proc: subprocess.Popen) -> None:
    """End pytest and everything below it (spawned gloo ranks): its own session, and any that left it."""
    below = descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.communicate()


def run_pytest(copy: str, tests: Sequence[str], timeout: float) -> tuple[int, str, float]:
    """``pytest -q -x`` on ``tests`` inside ``copy``: (exit code, output, seconds); exit code 124 on a timeout."""
    if not tests:  # pytest without arguments would run the whole suite (testpaths)
        raise ValueError("no tests to run")
    env = dict(os.environ, PYTHONPATH=copy, PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        out, code = "", 124
    return code, out, time.monotonic() - start


def run_mutant(mutant: Mutant, files: Sequence[str], timeout: float, equivalent: bool = False) -> Outcome:
    """Copy the tree, apply ``mutant``, run its tests: the outcome."""
    with tempfile.TemporaryDirectory(prefix=f"tessera_mutant_{mutant.name}_") as copy:
        make_copy(copy, files)
        path = os.path.join(copy, mutant.path)
        try:
            with open(path, encoding="utf-8") as f:
                mutated = apply_mutant(f.read(), mutant)
        except ValueError as e:
            return Outcome(mutant, "error", 0.0, str(e), equivalent)
        with open(path, "w", encoding="utf-8") as f:
            f.write(mutated)
        code, out, seconds = run_pytest(copy, mutant.tests, timeout)
    if code == 0:
        return Outcome(mutant, "survived", seconds, "", equivalent)
    if code == 1:
        failed = _FAILED.search(out)
        return Outcome(mutant, "killed", seconds, failed.group(1) if failed else "(a test failed)", equivalent)
    why = f"timed out after {timeout:.0f} s" if code == 124 else f"pytest exit code {code}: {_tail(out)}"
    return Outcome(mutant, "error", seconds, why, equivalent)


def _tail(text: str, lines: int = 3) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


def baseline(mutants: Sequence[Mutant], files: Sequence[str], timeout: float) -> tuple[bool, str, float]:
    """The union of the mutants' tests on the unmutated copy: (passed, why not, seconds)."""
    tests = list(dict.fromkeys(t for m in mutants for t in m.tests))
    with tempfile.TemporaryDirectory(prefix="tessera_mutant_baseline_") as copy:
        make_copy(copy, files)
        code, out, seconds = run_pytest(copy, tests, timeout * max(1, len(tests)))
    return code == 0, "" if code == 0 else f"exit code {code}: {_tail(out, 8)}", seconds


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def machine() -> str:
    """CPU model, core count and torch version: what the timings were taken on."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:  # pragma: no cover - the repository needs torch
        torch_version = "?"
    return f"{cpu}, {os.cpu_count()} logical CPUs, Python {platform.python_version()}, torch {torch_version}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _code(snippet: str) -> str:
    """A snippet in one table cell: whitespace runs collapsed, in backticks."""
    return f"`{_cell(' '.join(snippet.split())).replace('`', '')}`" if snippet.strip() else "(removed)"


def write_report(path: str, outcomes: Sequence[Outcome], wall: float, base: tuple[bool, str, float] | None,
                 ran_equivalent: bool) -> None:
    """The markdown report: when, on what, and each mutant's outcome."""
    dirty = " (with uncommitted changes)" if _git("status", "--porcelain", "--untracked-files=no") else ""
    main = [o for o in outcomes if not o.equivalent]
    counts = {s: sum(o.status == s for o in main) for s in ("killed", "survived", "error")}
    lines = [
        "# Mutation report",
        "",
        "Generated by `python -m harness.mutation` (see [testing](testing.md#mutation-pass)); do not edit by hand.",
        "",
        f"- date: {datetime.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}",
        f"- commit: `{_git('rev-parse', '--short=12', 'HEAD')}`{dirty}",
        f"- machine: {machine()}",
        f"- mutants: {len(main)}: {counts['killed']} killed, {counts['survived']} survived, {counts['error']} errors",
        f"- wall time: {wall:.0f} s"
        + (f" (baseline run of the listed tests: {base[2]:.0f} s)" if base is not None else ""),
        "",
        "| mutant | file | change | status | killed by | s | what a user would notice |",
        "| --- | --- | --- | --- | --- | ---: | --- |",
    ]
    for o in main:
        m = o.mutant
        lines.append(f"| {m.name} | `{m.path}` | {_code(m.original)} -> {_code(m.replacement)} | {o.status} "
                     f"| {_cell(o.killer)} | {o.seconds:.1f} | {_cell(m.notice)} |")
    lines += ["", "## Equivalent mutants", "",
              "Listed with the reason each changes nothing a user could notice; "
              + ("run against the listed tests (expected: survived)." if ran_equivalent
                 else "not run (their snippets are checked to exist)."),
              "", "| mutant | file | change | status | why equivalent |", "| --- | --- | --- | --- | --- |"]
    runs = {o.mutant.name: o for o in outcomes if o.equivalent}
    for m in EQUIVALENT:
        o = runs.get(m.name)
        status = "not run" if o is None else o.status + ("" if o.ok else " (unexpected)")
        lines.append(f"| {m.name} | `{m.path}` | {_code(m.original)} -> {_code(m.replacement)} | {status} "
                     f"| {_cell(m.notice)} |")
    lines.append("")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.mutation", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutants (names as listed)")
    parser.add_argument("--report", default=None, help="write the markdown report here (e.g. docs/mutation-report.md)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per mutant")
    parser.add_argument("--equivalent", action="store_true", help="also run the equivalent mutants")
    parser.add_argument("--no-baseline", action="store_true", help="skip the run of the tests on unmutated code")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = parser.parse_args(argv)

    problems = check_snippets([*MUTANTS, *EQUIVALENT])
    if problems:
        print("the mutant list does not match the code:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 2
    chosen = [(m, False) for m in MUTANTS] + ([(m, True) for m in EQUIVALENT] if args.equivalent else [])
    if args.only:
        known = {m.name for m in (*MUTANTS, *EQUIVALENT)}
        unknown = sorted(set(args.only) - known)
        if unknown:
            print(f"unknown mutants: {unknown}", file=sys.stderr)
            return 2
        chosen = [(m, eq) for m, eq in [(m, False) for m in MUTANTS] + [(m, True) for m in EQUIVALENT]
                  if m.name in args.only]
    if args.list:
        for m, eq in chosen:
            print(f"{m.name:40s} {'(equivalent) ' if eq else ''}{m.path}  -> {' '.join(m.tests)}")
        return 0

    files = repository_files()
    start = time.monotonic()
    base = None
    if not args.no_baseline:
        base = baseline([m for m, _ in chosen], files, args.timeout)
        print(f"baseline: {'passed' if base[0] else 'FAILED ' + base[1]} ({base[2]:.0f} s)", flush=True)
        if not base[0]:
            return 2
    outcomes = []
    for i, (m, eq) in enumerate(chosen, 1):
        o = run_mutant(m, files, args.timeout, eq)
        outcomes.append(o)
        flag = "" if o.ok else "  <-- " + ("expected to survive" if eq else "NOT KILLED" if o.status == "survived"
                                           else "ERROR")
        print(f"[{i}/{len(chosen)}] {m.name}: {o.status} {o.killer} ({o.seconds:.0f} s){flag}", flush=True)
    wall = time.monotonic() - start
    if args.report:
        write_report(args.report, outcomes, wall, base, args.equivalent)
        print(f"report: {args.report}")
    bad = [o.mutant.name for o in outcomes if not o.ok and (not o.equivalent or o.status == "error")]
    print(f"done in {wall:.0f} s; " + (f"not as expected: {bad}" if bad else "every mutant as expected"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
