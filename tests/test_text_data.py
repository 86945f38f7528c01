"""``data.type='text'``: raw corpora tokenized when the run starts give the batches, losses and resume position of
``tools/prepare_data.py`` + ``data.type='tokens'``, and are refused as the tool refuses them.

The reference is the prepare step a user runs today: ``tools/prepare_data.py`` on the same file with the same
tokenizer and held-out rule, then the token-folder loader (its own tests check it against numpy and the texts).
Equality is bitwise (``torch.equal`` on every batch tensor, ``==`` on the losses in metrics.jsonl): the same
token ids through the same model in the same order leave no room for a tolerance.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from harness.failure import explain
from tessera.data import DataError, build_data
from tessera.data import text_corpus as text_corpus_module
from tests.test_corpus_readers import _jsonl_bytes, _prepare, _save_to_disk, _train_sp
from tests.test_data_format import ROOT

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
zstandard = pytest.importorskip("zstandard")

TINY = os.path.join(ROOT, "configs", "tiny.py")
# enough documents for a few hundred rows of 32 tokens, in sizes from a line to several rows
DOCS = [f"doc {i}: " + "naïve café — 日本語 🚀 " * (i % 4) + "the quick brown fox jumps. " * (i % 11)
        for i in range(160)]
SEQ, MICRO_BSZ, MICRO_NUM = 32, 2, 2
HANG_GUARD_S = 240  # a hang guard, not a speed requirement (a loaded 2-core machine)


def _write(folder, kind: str, docs=DOCS):
    """``docs`` as one input of ``kind``; returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "parquet":
        path = folder / "c.parquet"
        pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), path, row_group_size=37)
    elif kind == "jsonl":
        path = folder / "c.jsonl"
        path.write_bytes(_jsonl_bytes(docs))
    elif kind == "jsonl.zst":
        path = folder / "c.jsonl.zst"
        path.write_bytes(zstandard.ZstdCompressor(level=3).compress(_jsonl_bytes(docs)))
    elif kind == "save_to_disk":
        path = folder / "ds"
        _save_to_disk(path, docs, files=3)
    elif kind == "folder":  # mixed formats under one folder, read in sorted order
        path = folder / "mixed"
        (path / "b").mkdir(parents=True)
        (path / "a.jsonl").write_bytes(_jsonl_bytes(docs[:50]))
        pq.write_table(pa.table({"text": docs[50:120]}), path / "b" / "c.parquet")
        (path / "b" / "d.txt").write_text("\n".join(docs[120:]), encoding="utf-8")
    else:
        raise ValueError(kind)
    return path


def _data_cfg(**kw):
    return {"seq_len": SEQ, "micro_bsz": MICRO_BSZ, "micro_num": MICRO_NUM, "valid_micro_num": 4, **kw}


def _assert_same_batches(a, b, steps: int) -> None:
    for step in range(steps):
        for x, y in zip(a.train.next_step_batches(), b.train.next_step_batches(), strict=True):
            assert x.keys() == y.keys()
            for k in x:
                assert torch.equal(x[k], y[k]), f"step {step}: {k} differs"
    assert (a.valid is None) == (b.valid is None)
    if a.valid is not None:
        for x, y in zip(a.valid, b.valid, strict=True):
            for k in x:
                assert torch.equal(x[k], y[k]), f"valid: {k} differs"


# ---------------------------------------------------------------------------------------- the same batches
@pytest.mark.parametrize("kind", ["parquet", "jsonl.zst", "save_to_disk", "folder"])
def test_text_gives_the_batches_of_a_prepared_folder_bit_for_bit(tmp_path, kind):
    """Byte tokenizer, every 7th document held out, two DP ranks, more steps than an epoch (the second epoch's
    permutation too), tokenized on two worker processes where prepare_data used one."""
    src = _write(tmp_path / "in", kind)
    assert _prepare(tmp_path, [src], "--valid-every-nth", "7") == 0
    for rank in range(2):
        tokens = build_data(_data_cfg(type="tokens", train_folder=str(tmp_path / "out/train"),
                                      valid_folder=str(tmp_path / "out/valid")),
                            vocab_size=320, max_seq_len=SEQ, dp_rank=rank, dp_size=2, seed=7)
        text = build_data(_data_cfg(type="text", train_folder=str(src), cache_folder=str(tmp_path / "cache"),
                                    text={"valid_every_nth": 7, "workers": 2}),
                          vocab_size=320, max_seq_len=SEQ, dp_rank=rank, dp_size=2, seed=7)
        assert text.train.num_rows == tokens.train.num_rows
        steps = 2 + text.train.num_rows // text.train.rows_per_step  # into the second epoch
        _assert_same_batches(text, tokens, steps)
        assert text.info["type"] == "text" and text.info["text_inputs"] == str(src)


def test_a_sentencepiece_tokenizer_and_a_separate_valid_input(tmp_path):
    """``data.text.tokenizer`` a SentencePiece model with BOS, and ``data.valid_folder`` a raw file of its own:
    the batches of two prepare_data runs (one per input); the checkpoint's tokenizer is found from the config."""
    pytest.importorskip("sentencepiece")
    model = _train_sp(tmp_path)
    train_src, valid_src = _write(tmp_path / "train", "jsonl"), _write(tmp_path / "valid", "parquet", DOCS[:30])
    tok = ["--tokenizer", str(model), "--add-bos"]
    assert _prepare(tmp_path, [train_src], *tok, out="t") == 0
    assert _prepare(tmp_path, [valid_src], *tok, out="v") == 0
    kw = {"vocab_size": 448, "max_seq_len": SEQ, "seed": 3}
    tokens = build_data(_data_cfg(type="tokens", train_folder=str(tmp_path / "t/train"),
                                  valid_folder=str(tmp_path / "v/train")), **kw)
    text_cfg = {"tokenizer": str(model), "add_bos": True}
    text = build_data(_data_cfg(type="text", train_folder=str(train_src), valid_folder=str(valid_src),
                                cache_folder=str(tmp_path / "cache"), text=text_cfg), **kw)
    _assert_same_batches(text, tokens, 12)
    from tessera.data.run_tokenizer import tokenizer_for_checkpoint

    tok_found, where = tokenizer_for_checkpoint(str(tmp_path), {"config": {"data": {"type": "text", "text": text_cfg}}})
    assert where == f"data.text.tokenizer={model}"
    assert tok_found is not None and tok_found.encode(DOCS[5]) == tokens.tokenizer.encode(DOCS[5])


def test_a_hugging_face_tokenizer_json_on_two_workers(tmp_path):
    """``data.text.tokenizer`` a ``tokenizer.json`` (the byte-level one tessera exports, loaded by the
    ``tokenizers`` library), tokenized on two processes: the batches of prepare_data.py with the same file."""
    pytest.importorskip("tokenizers")
    from tessera.data.tokenizer import byte_tokenizer_json

    tok_file = tmp_path / "tokenizer.json"
    tok_file.write_text(byte_tokenizer_json(), encoding="utf-8")
    src = _write(tmp_path / "in", "jsonl.zst")
    assert _prepare(tmp_path, [src], "--tokenizer", str(tok_file), "--valid-fraction", "0.05") == 0
    kw = {"vocab_size": 320, "max_seq_len": SEQ, "seed": 11}
    tokens = build_data(_data_cfg(type="tokens", train_folder=str(tmp_path / "out/train"),
                                  valid_folder=str(tmp_path / "out/valid")), **kw)
    text = build_data(_data_cfg(type="text", train_folder=str(src), cache_folder=str(tmp_path / "cache"),
                                text={"tokenizer": str(tok_file), "valid_fraction": 0.05, "workers": 2}), **kw)
    assert type(text.tokenizer).__name__ == "HFTokenizer"
    _assert_same_batches(text, tokens, 20)


# ------------------------------------------------------------------------------------------------- the cache
def test_the_cache_is_reused_and_a_changed_input_is_tokenized_again(tmp_path, monkeypatch):
    src = _write(tmp_path / "in", "jsonl")
    cfg = _data_cfg(type="text", train_folder=str(src), cache_folder=str(tmp_path / "cache"))
    first = build_data(cfg, vocab_size=320, max_seq_len=SEQ)
    assert len(os.listdir(tmp_path / "cache")) == 1

    def no_tokenizing(*a, **k):
        raise AssertionError("tokenized again although the cache holds these inputs")

    monkeypatch.setattr(text_corpus_module, "prepare_corpus", no_tokenizing)
    again = build_data(cfg, vocab_size=320, max_seq_len=SEQ)
    _assert_same_batches(again, first, 3)
    monkeypatch.undo()
    src.write_bytes(_jsonl_bytes(DOCS[:100]))  # a changed corpus: another key, another folder
    changed = build_data(cfg, vocab_size=320, max_seq_len=SEQ)
    assert len(os.listdir(tmp_path / "cache")) == 2
    assert changed.train.num_rows < first.train.num_rows
    other_rule = build_data({**cfg, "text": {"valid_fraction": 0.1}}, vocab_size=320, max_seq_len=SEQ)
    assert len(os.listdir(tmp_path / "cache")) == 3 and other_rule.valid is not None


# ----------------------------------------------------------------------------------------- refusals
def _tool_error(tmp_path, src, capsys) -> str:
    assert _prepare(tmp_path, [src], out="refused") == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1
    return lines[0][len("error: "):]


@pytest.mark.parametrize("fault", ["bad JSON line", "missing field", "null row", "cut-short zst"])
def test_a_bad_record_is_refused_with_the_tools_message(tmp_path, capsys, fault):
    if fault == "bad JSON line":
        src = tmp_path / "c.jsonl"
        src.write_bytes(_jsonl_bytes(DOCS[:9]) + b'{"text": "unterminated\n' + _jsonl_bytes(DOCS[:3]))
    elif fault == "missing field":
        src = tmp_path / "c.jsonl"
        src.write_bytes(_jsonl_bytes(DOCS[:4]) + b'{"body": "x", "id": 4}\n')
    elif fault == "null row":
        src = tmp_path / "c.parquet"
        pq.write_table(pa.table({"text": DOCS[:20] + [None] + DOCS[:5]}), src)
    else:
        whole = zstandard.ZstdCompressor(level=3).compress(_jsonl_bytes(DOCS * 5))
        src = tmp_path / "c.jsonl.zst"
        src.write_bytes(whole[:len(whole) // 2])
    expected = _tool_error(tmp_path, src, capsys)
    assert str(src) in expected
    with pytest.raises(DataError) as e:
        build_data(_data_cfg(type="text", train_folder=str(src), cache_folder=str(tmp_path / "cache")),
                   vocab_size=320, max_seq_len=SEQ)
    assert str(e.value) == expected.replace("--text-column", "data.text.text_column")  # each names its own setting
    assert [p for p in os.listdir(tmp_path / "cache")] == []  # nothing that looks tokenized is left


def _text_error(tmp_path, src, **text) -> str:
    """build_data's (train.py's) refusal of ``src`` as data.type='text'."""
    with pytest.raises(DataError) as e:
        build_data(_data_cfg(type="text", train_folder=str(src), cache_folder=str(tmp_path / "cache"), text=text),
                   vocab_size=320, max_seq_len=SEQ)
    return str(e.value)


def test_a_missing_column_or_split_names_the_config_key_that_sets_it_not_the_tools_flag(tmp_path):
    """train.py has no --text-column or --hf-split: its hints name data.text's keys (the tool's name its flags)."""
    pq.write_table(pa.table({"body": DOCS[:5]}), tmp_path / "body.parquet")
    assert _text_error(tmp_path, tmp_path / "body.parquet") == (
        f"{tmp_path / 'body.parquet'}: no column 'text' (columns: ['body']); name the text column with "
        "data.text.text_column")
    (tmp_path / "body.jsonl").write_bytes(_jsonl_bytes(DOCS[:3], "body"))
    assert _text_error(tmp_path, tmp_path / "body.jsonl") == (
        f"{tmp_path / 'body.jsonl'}:1: no field 'text'; its fields: 'body', 'id' (name the text field with "
        "data.text.text_column)")
    _save_to_disk(tmp_path / "dd" / "train", DOCS[:5])  # a DatasetDict folder with one split, "train"
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    assert _text_error(tmp_path, tmp_path / "dd", hf_split="test") == (
        f"{tmp_path / 'dd' / 'dataset_dict.json'}: no split 'test' (splits: ['train']); choose one with "
        "data.text.hf_split")


@pytest.mark.parametrize("overrides, message", [
    (["data.text.tokenizer=x"], "data.text.tokenizer='x' applies only to data.type='text' (this run reads "
                                "data.type='synthetic')"),
    (["data.type=text"], "data.train_folder is required when data.type='text'"),
    (["data.type=text", "data.train_folder=a", "data.text.valid_every_nth=3", "data.text.valid_fraction=0.1"],
     "give one rule for holding out validation documents"),
    (["data.type=text", "data.train_folder=a", "data.valid_folder=b", "data.text.valid_fraction=0.1"],
     "validate on one or the other"),
    (["data.type=text", "data.train_folder=a", "data.text.valid_every_nth=1"], "must be 0 (none) or >= 2, got 1"),
])
def test_the_config_refuses_text_keys_that_would_be_ignored_or_contradict(overrides, message):
    from tessera.config import Config, ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        Config.from_file(TINY, overrides)


# ------------------------------------------------------------------------------------- train.py end to end
def _train(tmp_path, name: str, *overrides: str, ok: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    args = [sys.executable, os.path.join(ROOT, "train.py"), "--config", TINY, "metrics.progress_bar=False",
            "metrics.tensorboard=False", "model.vocab_size=320", f"data.seq_len={SEQ}", f"data.micro_bsz={MICRO_BSZ}",
            "data.total_steps=6", "data.valid_every=3", "data.valid_micro_num=2", "generate.max_new_tokens=0",
            f"log_folder='{tmp_path / 'logs'}'", f"job_name='{name}'", *overrides]
    proc = subprocess.run(args, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    if ok:
        assert proc.returncode == 0, explain(proc)
    return proc


def _losses(tmp_path, name: str) -> dict[tuple[str, int], float]:
    with open(tmp_path / "logs" / name / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    return {(r["kind"], r["step"]): r["loss"] for r in rows if r["kind"] in ("train", "valid")}


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_train_py_on_a_raw_file_has_the_losses_of_the_prepared_folder(tmp_path, kind):
    src = _write(tmp_path / "in", kind)
    assert _prepare(tmp_path, [src], "--valid-every-nth", "10") == 0
    _train(tmp_path, "tokens", "data.type='tokens'", f"data.train_folder='{tmp_path / 'out/train'}'",
           f"data.valid_folder='{tmp_path / 'out/valid'}'")
    proc = _train(tmp_path, "text", "data.type='text'", f"data.train_folder='{src}'",
                  f"data.cache_folder='{tmp_path / 'cache'}'", "data.text.valid_every_nth=10")
    assert "data.type='text': tokenizing data.train_folder=" in proc.stderr + proc.stdout
    want, got = _losses(tmp_path, "tokens"), _losses(tmp_path, "text")
    assert sorted(got) == sorted(want) and len(want) == 8  # 6 train steps, valid at 3 and 6
    assert got == want


def test_a_resumed_text_run_continues_with_the_losses_of_the_uninterrupted_run(tmp_path):
    """Saved at steps 3 and 6; the step-6 checkpoint and the token cache removed, the run started again: it
    resumes at step 3, tokenizes the file again, and steps 4-6 (and their validation) equal the first run's."""
    src = _write(tmp_path / "in", "parquet")
    run = ("data.type='text'", f"data.train_folder='{src}'", f"data.cache_folder='{tmp_path / 'cache'}'",
           "data.text.valid_every_nth=10", "ckpt.enable_save_ckpt=True", f"ckpt.save_ckpt_folder='{tmp_path / 'ck'}'",
           "ckpt.checkpoint_every=3", "ckpt.auto_resume=True")
    _train(tmp_path, "whole", *run)
    shutil.rmtree(tmp_path / "ck" / "step_6")
    shutil.rmtree(tmp_path / "cache")
    _train(tmp_path, "resumed", *run)
    whole, resumed = _losses(tmp_path, "whole"), _losses(tmp_path, "resumed")
    assert sorted(resumed) == [("train", 4), ("train", 5), ("train", 6), ("valid", 6)]
    assert resumed == {k: whole[k] for k in resumed}


def test_train_py_refuses_a_cut_short_zst_with_one_error_line_naming_it(tmp_path, capsys):
    """A folder holding one .jsonl.zst cut short (an interrupted download): the run stops before any step with the
    line prepare_data.py prints for the same input."""
    whole = zstandard.ZstdCompressor(level=3).compress(_jsonl_bytes(DOCS * 5))
    src = tmp_path / "in" / "c.jsonl.zst"
    src.parent.mkdir()
    src.write_bytes(whole[:len(whole) * 2 // 3])
    expected = _tool_error(tmp_path, tmp_path / "in", capsys)
    proc = _train(tmp_path, "cut", "data.type='text'", f"data.train_folder='{tmp_path / 'in'}'",
                  f"data.cache_folder='{tmp_path / 'cache'}'", ok=False)
    assert proc.returncode != 0
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "error:" in line]
    assert len(errors) == 1, explain(proc)
    assert errors[0].endswith(f"error: {expected}") and str(src) in errors[0], errors[0]
    assert "Traceback" not in proc.stderr and "step 1 |" not in proc.stdout + proc.stderr


def test_a_bad_record_stops_both_ranks_under_torchrun_each_with_the_line(tmp_path, capsys):
    """Rank 0 tokenizes while rank 1 waits in the agreement: both print the tool's line for the bad record and
    exit non-zero before any step."""
    from harness.distributed import run_torchrun

    src = tmp_path / "c.jsonl"
    src.write_bytes(_jsonl_bytes(DOCS[:30]) + b"[1, 2]\n")
    expected = _tool_error(tmp_path, src, capsys)
    args = [os.path.join(ROOT, "train.py"), "--config", TINY, "metrics.progress_bar=False", "model.vocab_size=320",
            "data.type='text'", f"data.train_folder='{src}'", f"data.cache_folder='{tmp_path / 'cache'}'",
            f"log_folder='{tmp_path / 'logs'}'", "data.total_steps=2"]
    proc = run_torchrun(args, 2, timeout=HANG_GUARD_S, cwd=str(tmp_path))
    assert proc.returncode not in (0, 124), explain(proc)  # 124: still running at HANG_GUARD_S (a hang)
    reports = sorted(line for line in proc.stderr.splitlines() if line.startswith("[rank ") and "] error:" in line)
    # each rank's line says which rank read the bad record (rank 0: it tokenizes for both)
    assert reports == [f"[rank {r}] error: rank 0: {expected}" for r in (0, 1)], explain(proc)


SLOW_TOKENIZING = '''
import importlib.util, os, sys, time
from tessera.data import text_corpus
real = text_corpus.prepare_corpus
def slow(*a, **k):  # tokenizing that outlasts dist.timeout_s
    time.sleep(float(os.environ["TEST_TOKENIZE_DELAY_S"]))
    return real(*a, **k)
text_corpus.prepare_corpus = slow
spec = importlib.util.spec_from_file_location("train", os.environ["TEST_TRAIN_PY"])
train = importlib.util.module_from_spec(spec)
sys.modules["train"] = train
spec.loader.exec_module(train)
train.run()
'''


@pytest.mark.slow  # ~35 s: 15 s of delay on purpose, two torchrun processes
def test_tokenizing_longer_than_the_collective_timeout_does_not_time_out_the_waiting_rank(tmp_path):
    """Rank 0 tokenizes for 3x ``dist.timeout_s`` (a delay put in front of it) while rank 1 waits: the ranks meet
    every few seconds instead of in one long collective, so both train. (With the ranks meeting only once rank
    0 is done, this run stops with gloo's "Timed out waiting 5000ms".)"""
    from harness.distributed import run_torchrun

    src = _write(tmp_path / "in", "jsonl")
    script = tmp_path / "slow_tokenizing_train.py"
    script.write_text(SLOW_TOKENIZING)
    args = [str(script), "--config", TINY, "metrics.progress_bar=False", "model.vocab_size=320", "data.type='text'",
            f"data.train_folder='{src}'", f"data.cache_folder='{tmp_path / 'cache'}'", "dist.timeout_s=5",
            f"log_folder='{tmp_path / 'logs'}'", "job_name='slow'", "data.total_steps=2", "generate.max_new_tokens=0"]
    proc = run_torchrun(args, 2, timeout=HANG_GUARD_S, cwd=str(tmp_path),
                        env={"TEST_TOKENIZE_DELAY_S": "15", "TEST_TRAIN_PY": os.path.join(ROOT, "train.py"),
                             "PYTHONPATH": ROOT})
    assert proc.returncode == 0, explain(proc)
    assert sorted(k for k in _losses(tmp_path, "slow") if k[0] == "train") == [("train", 1), ("train", 2)]
