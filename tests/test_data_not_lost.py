"""Nothing lost in data preparation: a compressed shard cut short (an interrupted download) is refused naming
the file whatever else is in the input, every frame of a multi-frame .zst is read, and a disk that fills
while ``tools/prepare_data.py`` writes ends in one ``error:`` line with no complete-looking output folder.

References: the texts written here (read back from the token folder with plain numpy), and the bytes of a
real compressed file with bytes cut off its end.
"""

from __future__ import annotations

import errno
import gzip
import io
import os
import subprocess
import sys

import pytest

from harness.failure import explain
from tessera import files as tessera_files
from tessera.data import token_file
from tests.test_corpus_readers import DOCS, _byte_docs, _jsonl_bytes, _prepare
from tests.test_data_format import ROOT

zstandard = pytest.importorskip("zstandard")

# Many documents, so a compressed file spans several zstd blocks / deflate blocks and a cut can land
# anywhere: inside the data, inside the last block, or in the checksum / trailer.
MANY = [f"{i}: {d}" for i, d in enumerate(DOCS * 50)]


def _compressed(kind: str, data: bytes) -> bytes:
    if kind == "zst":
        return zstandard.ZstdCompressor(level=3).compress(data)
    return gzip.compress(data)


def _error_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


def _left_behind(tmp_path, name="out") -> list[str]:
    """Anything the preparation left next to its output: the folder itself or a temporary sibling."""
    return sorted(p.name for p in tmp_path.iterdir() if p.name == name or p.name.startswith(f"{name}."))


@pytest.mark.parametrize("kind", ["zst", "gz"])
@pytest.mark.parametrize("cut", ["half", "last 4 bytes"])
@pytest.mark.parametrize("bad_first", [False, True])
def test_a_cut_short_shard_beside_a_good_one_is_refused_naming_it(tmp_path, capsys, kind, cut, bad_first):
    whole = _compressed(kind, _jsonl_bytes(MANY))
    kept = len(whole) // 2 if cut == "half" else len(whole) - 4  # the last 4: zstd's checksum, gzip's size
    bad = tmp_path / f"cut.jsonl.{kind}"
    bad.write_bytes(whole[:kept])
    good = tmp_path / f"good.jsonl.{kind}"
    good.write_bytes(whole)
    inputs = [bad, good] if bad_first else [good, bad]
    assert _prepare(tmp_path, inputs) == 2
    lines = _error_lines(capsys)
    assert len(lines) == 1 and str(bad) in lines[0] and "truncated" in lines[0], lines
    assert _left_behind(tmp_path) == []
    # the same file alone: named too, never "no training documents"
    assert _prepare(tmp_path, [bad]) == 2
    lines = _error_lines(capsys)
    assert len(lines) == 1 and str(bad) in lines[0] and "no training documents" not in lines[0], lines


def test_a_cut_short_shard_found_in_a_folder_fails_the_command(tmp_path):
    """The command line, with the shards found by searching a folder: a non-zero exit naming the file."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    whole = _compressed("zst", _jsonl_bytes(DOCS))  # one zstd block: cut short, zstandard's reader gives no bytes
    (corpus / "a.jsonl.zst").write_bytes(whole)
    (corpus / "b.jsonl.zst").write_bytes(whole[:-4])
    (corpus / "c.txt").write_text("a good text file", encoding="utf-8")
    proc = subprocess.run([sys.executable, f"{ROOT}/tools/prepare_data.py", "--input", str(corpus),
                           "--output", str(tmp_path / "out"), "--quiet", "--workers", "1"],
                          capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 2, explain(proc)
    assert proc.stderr.startswith("error: ") and len(proc.stderr.strip().splitlines()) == 1, explain(proc)
    assert str(corpus / "b.jsonl.zst") in proc.stderr, explain(proc)
    assert _left_behind(tmp_path) == []


def test_every_frame_of_a_multi_frame_zst_is_read(tmp_path):
    """Concatenated frames (``cat a.zst b.zst``, pzstd's output) with a skippable frame between them: every
    document of every frame arrives, in order."""
    first, second = MANY[:700], MANY[700:]
    skippable = b"\x50\x2a\x4d\x18" + (3).to_bytes(4, "little") + b"abc"
    data = _compressed("zst", _jsonl_bytes(first)) + skippable + _compressed("zst", _jsonl_bytes(second))
    (tmp_path / "multi.jsonl.zst").write_bytes(data)
    assert _prepare(tmp_path, [tmp_path / "multi.jsonl.zst"]) == 0
    assert _byte_docs(tmp_path / "out" / "train") == first + second


class _FullDisk:
    """``open`` for the writers' modules: files opened for writing accept ``budget`` bytes in all, then
    raise ``OSError(ENOSPC)`` naming the file, as a full disk does."""

    def __init__(self, budget: int):
        self.budget = budget

    def __call__(self, path, mode="r", *args, **kwargs):
        f = open(path, mode, *args, **kwargs)
        if not any(c in mode for c in "wax+"):
            return f
        outer = self
        real_write = f.write

        def write(data):
            if len(data) > outer.budget:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(path))
            outer.budget -= len(data)
            return real_write(data)

        class Full(io.IOBase):  # the file object with a write that runs out of space
            def __getattr__(self, name):
                return write if name == "write" else getattr(f, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                f.close()

        return Full()


@pytest.mark.parametrize("stage", ["first token", "mid tokens", "sources.json", "meta.json"])
def test_a_full_disk_is_one_error_line_and_no_complete_looking_output(tmp_path, capsys, monkeypatch, stage):
    (tmp_path / "a.jsonl").write_bytes(_jsonl_bytes(MANY[:400]))
    assert _prepare(tmp_path, [tmp_path / "a.jsonl"], out="old") == 0  # an earlier complete preparation
    old = {p.name: p.read_bytes() for p in (tmp_path / "old" / "train").iterdir()}
    tokens, sources = len(old["tokens.bin"]), len(old["sources.json"])
    budget = {"first token": 0, "mid tokens": tokens // 2, "sources.json": tokens, "meta.json": tokens + sources}
    failing_file = {"first token": "tokens.bin", "mid tokens": "tokens.bin"}.get(stage, stage)
    full = _FullDisk(0)
    monkeypatch.setattr(token_file, "open", full, raising=False)
    monkeypatch.setattr(tessera_files, "open", full, raising=False)
    for out, extra in (("out", ()), ("old", ("--overwrite",))):
        full.budget = budget[stage]
        assert _prepare(tmp_path, [tmp_path / "a.jsonl"], *extra, out=out) == 2
        lines = _error_lines(capsys)
        assert len(lines) == 1, lines
        assert str(tmp_path / out) in lines[0] and os.strerror(errno.ENOSPC) in lines[0], lines
        assert failing_file in lines[0], lines
    assert _left_behind(tmp_path) == []
    # the --overwrite that failed kept the earlier folder whole
    assert _left_behind(tmp_path, "old") == ["old"]
    assert {p.name: p.read_bytes() for p in (tmp_path / "old" / "train").iterdir()} == old
