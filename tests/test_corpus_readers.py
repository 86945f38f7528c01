"""tools/prepare_data.py on the formats corpora ship in: Parquet, .jsonl.gz, .jsonl.zst, save_to_disk folders,
SentencePiece models; binary and malformed files refused in one ``error:`` line; ``--workers`` output identity.

The references are independent of tessera's readers: the texts written here (read back by the test's
own byte arithmetic), ``sentencepiece.SentencePieceProcessor`` for the ids, and the token folder read
with plain numpy.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from harness.failure import explain
from tessera.data import SentencePieceTokenizer, load_tokenizer
from tests.test_data_format import ROOT, _prepare_module, read_raw

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
zstandard = pytest.importorskip("zstandard")
spm = pytest.importorskip("sentencepiece")

DOCS = [f"document {i}: " + "naïve café — 日本語 🚀 " * (i % 4) + "the quick brown fox. " * (i % 7) for i in range(40)]


def _train_sp(folder, vocab_size=400):
    """A tiny SentencePiece model (BOS 1, EOS 2, byte fallback: 256 byte pieces + the rest) trained on DOCS."""
    text = folder / "sp_train.txt"
    text.write_text("\n".join(DOCS * 3), encoding="utf-8")
    prefix = str(folder / "sp")
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=prefix, vocab_size=vocab_size, model_type="bpe",
                                   byte_fallback=True, character_coverage=1.0, minloglevel=2, num_threads=1)
    return folder / "sp.model"


def _jsonl_bytes(docs, key="text"):
    return "".join(json.dumps({key: d, "id": i}) + "\n" for i, d in enumerate(docs)).encode("utf-8")


def _prepare(tmp_path, inputs, *extra, out="out"):
    argv = ["--input", *map(str, inputs), "--output", str(tmp_path / out), "--quiet", "--workers", "1", *extra]
    return _prepare_module().main(argv)


def _byte_docs(folder):
    meta, tokens, index = read_raw(folder)
    return [tokens[index[k]:index[k + 1] - 1].astype(np.uint8).tobytes().decode("utf-8")
            for k in range(meta["num_documents"])]


def _save_to_disk(folder, docs, column="text", files=2):
    """A folder laid out as ``datasets.Dataset.save_to_disk`` writes it: Arrow *stream* files listed in
    state.json's ``_data_files``, and dataset_info.json (written by hand, not with ``datasets``)."""
    folder.mkdir(parents=True)
    per = -(-len(docs) // files)
    names = []
    for k in range(files):
        table = pa.table({column: docs[k * per:(k + 1) * per], "n": list(range(len(docs[k * per:(k + 1) * per])))})
        name = f"data-{k:05d}-of-{files:05d}.arrow"
        with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=7):
                writer.write_batch(batch)
        names.append(name)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names],
                                                   "_fingerprint": "0", "_format_type": None, "_split": "train"}))
    (folder / "dataset_info.json").write_text(json.dumps({"features": {column: {"dtype": "string",
                                                                                "_type": "Value"}}}))


# ------------------------------------------------------------------------------------------ formats
def test_parquet_gz_zst_and_save_to_disk_give_the_texts(tmp_path):
    table = pa.table({"id": list(range(len(DOCS))), "content": DOCS})
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=6)  # 7 row groups
    assert pq.ParquetFile(tmp_path / "a.parquet").metadata.num_row_groups == 7
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(_jsonl_bytes(DOCS, "content")))
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_jsonl_bytes(DOCS, "content")))
    _save_to_disk(tmp_path / "d_dataset", DOCS, column="content")
    for name in ("a.parquet", "b.jsonl.gz", "c.jsonl.zst", "d_dataset"):
        assert _prepare(tmp_path, [tmp_path / name], "--text-column", "content", out=f"out_{name}") == 0, name
        assert _byte_docs(tmp_path / f"out_{name}" / "train") == DOCS, name
    # a folder of them: found by the default patterns, the dataset folder included, in sorted order
    assert _prepare(tmp_path, [tmp_path], "--text-column", "content", "--pattern", "*.parquet", "*.jsonl.*") == 0
    assert _byte_docs(tmp_path / "out" / "train") == DOCS * 4


def test_dataset_dict_folder_reads_the_named_split(tmp_path):
    root = tmp_path / "dd"
    _save_to_disk(root / "train", DOCS[:10])
    _save_to_disk(root / "test", DOCS[10:13], files=1)
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    assert _prepare(tmp_path, [root]) == 0
    assert _byte_docs(tmp_path / "out" / "train") == DOCS[:10]
    assert _prepare(tmp_path, [root], "--hf-split", "test", out="o2") == 0
    assert _byte_docs(tmp_path / "o2" / "train") == DOCS[10:13]


# ------------------------------------------------------------------------------------------ bad input
def _error_line(capsys, tmp_path, inputs, *extra):
    assert _prepare(tmp_path, inputs, *extra) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1, err
    assert not (tmp_path / "out").exists()
    return err[0]


def test_binary_files_are_refused_naming_them(tmp_path, capsys):
    pq.write_table(pa.table({"text": ["x"]}), tmp_path / "t.parquet")
    cases = {
        "renamed.txt": (tmp_path / "t.parquet").read_bytes(),  # Parquet named .txt: never one text document
        "data.zst.txt": zstandard.ZstdCompressor().compress(b'{"text": "x"}\n'),
        "blob.bin": bytes(range(256)) * 4,
        "image.md": b"\x89PNG\r\n\x1a\n" + bytes(100),
        "fake.parquet": b"hello, not parquet",
        "fake.jsonl.gz": b'{"text": "not compressed"}\n',
        "latin1.txt": "café".encode("latin-1"),
    }
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        line = _error_line(capsys, tmp_path, [tmp_path / name])
        assert str(tmp_path / name) in line, (name, line)
    assert "*.parquet" in _error_line(capsys, tmp_path, [tmp_path / "renamed.txt"])
    assert "not UTF-8" in _error_line(capsys, tmp_path, [tmp_path / "latin1.txt"])


def test_bad_records_name_file_and_row(tmp_path, capsys):
    pq.write_table(pa.table({"text": ["a", "b", None, "d"]}), tmp_path / "null.parquet", row_group_size=2)
    assert f"{tmp_path / 'null.parquet'}: row 2" in _error_line(capsys, tmp_path, [tmp_path / "null.parquet"])
    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "col.parquet")
    line = _error_line(capsys, tmp_path, [tmp_path / "col.parquet"])
    assert "no column 'text'" in line and "body" in line and "--text-column" in line
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "int.parquet")
    assert "not text" in _error_line(capsys, tmp_path, [tmp_path / "int.parquet"])
    lines = _jsonl_bytes(DOCS[:3]) + b"{broken\n"
    (tmp_path / "bad.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    assert f"{tmp_path / 'bad.jsonl.zst'}:4: not valid JSON" in _error_line(capsys, tmp_path,
                                                                            [tmp_path / "bad.jsonl.zst"])
    (tmp_path / "field.jsonl").write_bytes(b'{"text": "ok"}\n{"content": "x", "id": 7}\n')
    line = _error_line(capsys, tmp_path, [tmp_path / "field.jsonl"])
    assert f"{tmp_path / 'field.jsonl'}:2: no field 'text'; its fields: 'content', 'id'" in line, line
    assert "--text-column" in line
    (tmp_path / "num.jsonl").write_bytes(b'{"text": 3}\n')
    assert "field 'text' holds int, not a string; its fields: 'text'" in _error_line(capsys, tmp_path,
                                                                                    [tmp_path / "num.jsonl"])
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(_jsonl_bytes(DOCS))[:200])
    line = _error_line(capsys, tmp_path, [tmp_path / "cut.jsonl.gz"])
    assert str(tmp_path / "cut.jsonl.gz") in line and "truncated" in line
    (tmp_path / "u.jsonl.gz").write_bytes(gzip.compress(b'{"text": "ok"}\n{"text": "caf\xe9"}\n'))
    assert f"{tmp_path / 'u.jsonl.gz'}:2: not UTF-8" in _error_line(capsys, tmp_path, [tmp_path / "u.jsonl.gz"])
    _save_to_disk(tmp_path / "ds", ["a", "b"], files=1)
    (tmp_path / "ds" / "state.json").write_text(json.dumps({"_data_files": [{"filename": "gone.arrow"}]}))
    assert "gone.arrow" in _error_line(capsys, tmp_path, [tmp_path / "ds"])


def test_the_command_line_prints_one_error_line(tmp_path):
    (tmp_path / "blob.dat").write_bytes(b"\x00\x01\x02" * 50)
    proc = subprocess.run([sys.executable, f"{ROOT}/tools/prepare_data.py", "--input", str(tmp_path / "blob.dat"),
                           "--output", str(tmp_path / "out"), "--quiet"], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 2 and proc.stdout == "", explain(proc)
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and proc.stderr.startswith("error: ")
    assert str(tmp_path / "blob.dat") in proc.stderr and "NUL" in proc.stderr


# ------------------------------------------------------------------------------------------ SentencePiece
def test_sentencepiece_ids_equal_the_sentencepiece_package(tmp_path):
    model = _train_sp(tmp_path)
    ref = spm.SentencePieceProcessor(model_file=str(model))
    assert (ref.bos_id(), ref.eos_id()) == (1, 2)
    pq.write_table(pa.table({"text": DOCS}), tmp_path / "a.parquet", row_group_size=16)
    assert _prepare(tmp_path, [tmp_path / "a.parquet"], "--tokenizer", str(model), "--valid-every-nth", "5") == 0
    for split, docs in (("train", [d for i, d in enumerate(DOCS) if (i + 1) % 5]), ("valid", DOCS[4::5])):
        meta, tokens, index = read_raw(tmp_path / "out" / split)
        assert meta["tokenizer"]["kind"] == "sentencepiece" and meta["eod_id"] == ref.eos_id()
        assert meta["vocab_size"] == ref.get_piece_size()
        got = [tokens[index[k]:index[k + 1]].tolist() for k in range(len(docs))]
        assert got == [ref.encode(d) + [ref.eos_id()] for d in docs]
        folder = tmp_path / "out" / split
        assert (folder / "tokenizer.model").read_bytes() == model.read_bytes()
        tok = load_tokenizer(meta, folder)
        assert isinstance(tok, SentencePieceTokenizer) and tok.decode(got[0]) == ref.decode(got[0][:-1])
    # --add-bos: the model's own BOS starts each document
    assert _prepare(tmp_path, [tmp_path / "a.parquet"], "--tokenizer", str(model), "--add-bos", out="bos") == 0
    meta, tokens, index = read_raw(tmp_path / "bos" / "train")
    assert tokens[index[3]:index[4]].tolist() == [ref.bos_id()] + ref.encode(DOCS[3]) + [ref.eos_id()]
    lengths = load_tokenizer(meta, tmp_path / "bos" / "train").token_byte_lengths()
    assert lengths[ref.bos_id()] == lengths[ref.eos_id()] == 0 and lengths.sum() > 0


def test_a_model_without_eos_needs_eod_token(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("\n".join(DOCS), encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(tmp_path / "noeos"), vocab_size=60,
                                   eos_id=-1, hard_vocab_limit=False, minloglevel=2, num_threads=1)
    (tmp_path / "d.txt").write_text("hello")
    line = _error_line(capsys, tmp_path, [tmp_path / "d.txt"], "--tokenizer", str(tmp_path / "noeos.model"))
    assert "noeos.model" in line and "--eod-token" in line
    assert _prepare(tmp_path, [tmp_path / "d.txt"], "--tokenizer", str(tmp_path / "noeos.model"),
                    "--eod-token", "<unk>") == 0


# ------------------------------------------------------------------------------------------ workers
def test_workers_give_the_same_bytes(tmp_path):
    model = _train_sp(tmp_path)
    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_jsonl_bytes(DOCS * 20)))
    digests = []
    for workers in ("1", "3"):
        out = f"w{workers}"
        assert _prepare(tmp_path, [tmp_path / "a.jsonl.zst"], "--tokenizer", str(model), "--workers", workers,
                        "--valid-every-nth", "7", out=out) == 0
        digests.append([hashlib.sha256((tmp_path / out / s / f).read_bytes()).hexdigest()
                        for s in ("train", "valid") for f in ("tokens.bin", "docs.idx", "sources.json")])
    assert digests[0] == digests[1]
