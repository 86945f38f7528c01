"""Every shell command the README and docs/ show runs as shown: a docs page cannot promise a command that errors.

The commands are the fenced ``bash``, ``sh`` and ``console`` blocks of README.md and docs/*.md (in a
``console`` block only the ``$ `` lines). An HTML comment on the line before a block says how to run it:

- ``<!-- docs-check: skip REASON -->``: not run; the reason is required (a GPU, minutes of training,
  placeholder paths, an install).
- ``<!-- docs-check: overrides KEY=VALUE ... -->``: every ``train.py`` command of the block runs with these
  config overrides appended (the last value of a key wins), e.g. ``data.total_steps=12`` to shrink a run
  whose output only needs a few steps.
- ``<!-- docs-check: slow -->``: run, but only in the slow tests (more than ~20 s on 2 cores).

Markers stack, one a line (``slow`` above ``overrides``). A block with no marker runs as written. Each block runs with ``bash -euo pipefail`` in a fresh folder that
links the repository's code folders and copies its pages, so what a command writes (``runs/``, ``ckpts/``,
``data_cache/``, BENCHMARKS.md) stays there; a block fails when any of its commands exits non-zero.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGS = ("bash", "sh", "console")
LINKED = ("tessera", "configs", "tools", "benchmarks", "harness", "tests", "examples", "train.py",
          "pyproject.toml", "setup.py", "pytest.ini")  # code, read only; pages are copied
COPIED = ("README.md", "BENCHMARKS.md", "docs")
BLOCK_TIMEOUT_S = 600  # a hang guard: a block of a few train.py runs takes minutes on a loaded 2-core machine
MARKER = re.compile(r"^<!--\s*docs-check:\s*(skip|overrides|slow)\b(.*?)-->\s*$")
FENCE = re.compile(r"^```(\w*)\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced shell block of a page: where it is, its commands, and how its marker says to run it."""

    page: str
    line: int  # 1-based line of the opening fence
    commands: tuple[str, ...]  # logical commands, continuation lines joined
    skip: str | None = None  # the reason, when marked skip
    overrides: tuple[str, ...] = ()
    slow: bool = False

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def _logical_lines(lines: list[str], console: bool) -> list[str]:
    """Join backslash continuations; drop comments and blank lines; in a console block keep only ``$`` lines."""
    out: list[str] = []
    pending = ""
    taking = not console
    for raw in lines:
        text = raw.rstrip()
        if not pending:
            if console:
                taking = text.startswith("$ ")
                text = text[2:] if taking else text
            if not taking or not text.strip() or text.lstrip().startswith("#"):
                continue
        if text.endswith("\\"):
            pending += text[:-1] + " "
            continue
        out.append(pending + text)
        pending = ""
    if pending:
        raise ValueError(f"a command ends in a line continuation: {pending!r}")
    return out


def _marker(line: str, where: str) -> dict:
    found = MARKER.match(line.strip())
    if not found:
        if "docs-check" in line:
            raise ValueError(f"{where}: unknown docs-check marker {line.strip()!r} (skip REASON | overrides K=V ... | slow)")
        return {}
    kind, rest = found.group(1), found.group(2).strip()
    if kind == "skip":
        if not rest:
            raise ValueError(f"{where}: 'docs-check: skip' needs a reason")
        return {"skip": rest}
    if kind == "overrides":
        words = rest.split()
        if not words or not all("=" in w for w in words):
            raise ValueError(f"{where}: 'docs-check: overrides' takes KEY=VALUE words, got {rest!r}")
        return {"overrides": tuple(words)}
    return {"slow": True}


def extract_blocks(path: Path, root: Path = ROOT) -> list[Block]:
    """The fenced shell blocks of one Markdown page, with the marker (if any) on the line above each."""
    lines = path.read_text(encoding="utf-8").splitlines()
    page = str(path.relative_to(root)) if path.is_relative_to(root) else str(path)
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise ValueError(f"{page}:{i + 1}: a fenced block that never closes")
        lang = fence.group(1)
        if lang in SHELL_LANGS:
            marker: dict = {}
            j = i - 1
            while j >= 0 and "docs-check" in lines[j]:  # markers stack: slow over overrides, say
                marker.update(_marker(lines[j], f"{page}:{j + 1}"))
                j -= 1
            commands = _logical_lines(lines[i + 1:end], console=lang == "console")
            blocks.append(Block(page, i + 1, tuple(commands), **marker))
        i = end + 1
    return blocks


def with_overrides(command: str, overrides: tuple[str, ...]) -> str:
    """The command with the overrides appended when it runs train.py (quoted for the shell)."""
    if not overrides or "train.py" not in command:
        return command
    return command + " " + " ".join("'" + o.replace("'", "'\\''") + "'" for o in overrides)


def make_sandbox(folder: Path, root: Path = ROOT) -> Path:
    """A working folder that sees the repository's code (linked) and its own copies of the pages."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in LINKED:
        if (root / name).exists():
            (folder / name).symlink_to(root / name)
    for name in COPIED:
        src = root / name
        if src.is_dir():
            shutil.copytree(src, folder / name)
        elif src.exists():
            shutil.copy2(src, folder / name)
    return folder


def run_block(block: Block, cwd: Path) -> subprocess.CompletedProcess:
    """Run the block's commands in one ``bash -euo pipefail`` under ``cwd``; its output comes back combined."""
    script = "\n".join(with_overrides(c, block.overrides) for c in block.commands)
    env = dict(os.environ, PYTHONPATH=str(cwd), MPLBACKEND="Agg")
    return subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=BLOCK_TIMEOUT_S)


def _failure(block: Block, result: subprocess.CompletedProcess) -> str:
    tail = "\n".join(result.stdout.splitlines()[-25:])
    return (f"error: the shell block at {block.name} exits {result.returncode}; its commands:\n"
            + "\n".join(block.commands) + f"\n--- last lines of its output ---\n{tail}")


def _all_blocks() -> list[Block]:
    return [b for page in PAGES for b in extract_blocks(page)]


def _params():
    for block in _all_blocks():
        marks = []
        if block.skip:
            marks.append(pytest.mark.skip(reason=f"docs-check: {block.skip}"))
        elif block.slow:
            marks.append(pytest.mark.slow)
        yield pytest.param(block, id=block.name, marks=marks)


@pytest.mark.parametrize("block", list(_params()))
def test_docs_shell_block_runs(block: Block, tmp_path: Path):
    result = run_block(block, make_sandbox(tmp_path / "repo"))
    assert result.returncode == 0, _failure(block, result)


# --------------------------------------------------------------------------- the checker itself, on its own pages
def test_every_page_has_shell_blocks_found_and_each_skip_has_a_reason():
    blocks = _all_blocks()
    assert any(b.page == "README.md" for b in blocks)
    assert all(b.commands for b in blocks), [b.name for b in blocks if not b.commands]
    assert any(not b.skip for b in blocks)  # the check checks something


def test_a_wrong_command_in_a_page_fails_and_markers_are_read(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text(
        "# a page\n\n```bash\n# a comment\npython train.py --config configs/tiny.py \\\n"
        "    --no-such-flag data.total_steps=1\n```\n\n"
        "<!-- docs-check: skip needs a GPU -->\n```bash\nnvidia-smi\n```\n\n"
        "<!-- docs-check: slow -->\n<!-- docs-check: overrides data.total_steps=1 model.vocab_size=300 -->\n```sh\n"
        "python -c \"import sys; print(sys.argv[1:])\" train.py a=1\n```\n\n"
        "```console\n$ echo one\none\n$ false\n```\n\n```python\nraise SystemExit(1)\n```\n",
        encoding="utf-8")
    wrong, skipped, overridden, console = extract_blocks(page, tmp_path)
    assert wrong.commands == ("python train.py --config configs/tiny.py      --no-such-flag data.total_steps=1",)
    assert skipped.skip == "needs a GPU"
    assert overridden.slow and not wrong.slow and not wrong.overrides
    assert console.commands == ("echo one", "false")
    sandbox = make_sandbox(tmp_path / "repo")
    bad = run_block(wrong, sandbox)
    assert bad.returncode != 0 and "--no-such-flag" in bad.stdout
    assert "error: the shell block at" in _failure(wrong, bad)
    out = run_block(overridden, sandbox)
    assert out.returncode == 0
    assert "['train.py', 'a=1', 'data.total_steps=1', 'model.vocab_size=300']" in out.stdout
    assert run_block(console, sandbox).returncode != 0  # `false` fails the block, `set -e`


def test_a_bad_marker_is_refused(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text("<!-- docs-check: skip -->\n```bash\necho\n```\n", encoding="utf-8")
    with pytest.raises(ValueError, match="needs a reason"):
        extract_blocks(page, tmp_path)
    page.write_text("<!-- docs-check: skp typo -->\n```bash\necho\n```\n", encoding="utf-8")
    with pytest.raises(ValueError, match="unknown docs-check marker"):
        extract_blocks(page, tmp_path)


def test_a_page_the_sandbox_copies_is_not_the_repository_s(tmp_path: Path):
    sandbox = make_sandbox(tmp_path / "repo")
    assert not (sandbox / "BENCHMARKS.md").is_symlink() and not (sandbox / "docs").is_symlink()
    assert (sandbox / "BENCHMARKS.md").read_bytes() == (ROOT / "BENCHMARKS.md").read_bytes()
