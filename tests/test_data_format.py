"""Token file format, tokenizers, prepare_data, bad-input errors and the stdlib demo corpus.

Files written by the code under test are read back here with plain numpy/json/hashlib, not through
the reader, so the format itself is what is checked.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
import sysconfig

import numpy as np
import pytest

from tessera.data import ByteTokenizer, DataError, HFTokenizer, build_data, load_tokenizer, prepare_stdlib_corpus
from tessera.data.stdlib_corpus import cache_key

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = {
    "a.txt": "Hello, world!\nSecond line.\n",
    "b.md": "# Título\n\nnaïve café — 日本語 🚀\n",
    "sub/c.txt": "x" * 300,
    "sub/deeper/d.txt": "def f(x):\r\n    return x  # CRLF kept\r\n",
    "e.txt": "",
    "f.txt": "last",
    "skip.bin": "not matched by the patterns",
}


def _prepare_module():
    spec = importlib.util.spec_from_file_location("prepare_data_tool", os.path.join(ROOT, "tools", "prepare_data.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write_texts(folder) -> list[str]:
    """Write TEXTS under folder; return the matched ones in sorted relative-path order."""
    for name, text in TEXTS.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text.encode("utf-8"))
    return sorted(n for n in TEXTS if n.endswith((".txt", ".md")))


def read_raw(folder) -> tuple[dict, np.ndarray, np.ndarray]:
    meta = json.loads((folder / "meta.json").read_text())
    tokens = np.fromfile(folder / "tokens.bin", dtype="<" + {"uint16": "u2", "uint32": "u4"}[meta["dtype"]])
    index = np.fromfile(folder / "docs.idx", dtype="<i8")
    return meta, tokens, index


def test_round_trip_byte_tokenizer(tmp_path):
    names = write_texts(tmp_path / "in")
    rc = _prepare_module().main(["--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"),
                                 "--valid-every-nth", "3", "--quiet"])
    assert rc == 0
    valid_names = names[2::3]
    train_names = [n for n in names if n not in valid_names]
    for split, expected in (("train", train_names), ("valid", valid_names)):
        meta, tokens, index = read_raw(tmp_path / "out" / split)
        texts = [TEXTS[n].encode("utf-8") for n in expected]
        assert meta["tokenizer"]["kind"] == "byte" and meta["vocab_size"] == 257 and meta["dtype"] == "uint16"
        assert meta["num_documents"] == len(texts)
        assert meta["num_tokens"] == tokens.size == sum(len(t) + 1 for t in texts)
        assert meta["num_bytes"] == sum(len(t) for t in texts)
        for name in ("tokens.bin", "docs.idx"):
            data = (tmp_path / "out" / split / name).read_bytes()
            assert meta["files"][name] == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        assert index.tolist() == np.cumsum([0] + [len(t) + 1 for t in texts]).tolist()
        tok = load_tokenizer(meta)
        for i, text in enumerate(texts):
            doc = tokens[index[i]:index[i + 1]]
            assert doc[-1] == 256
            assert doc[:-1].astype(np.uint8).tobytes() == text
            assert tok.decode(doc.tolist()) == text.decode("utf-8")
        sources = json.loads((tmp_path / "out" / split / "sources.json").read_text())
        assert [os.path.relpath(s, tmp_path / "in") for s in sources] == expected


def test_jsonl_input_and_valid_fraction(tmp_path):
    lines = [{"text": f"document number {i} " + "é" * i} for i in range(10)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert _prepare_module().main(["--input", str(tmp_path / "d.jsonl"), "--output", str(tmp_path / "out"),
                                   "--valid-fraction", "0.2", "--quiet"]) == 0
    # floor((i+1)*0.2) steps up at i = 4 and 9
    for split, ids in (("train", [0, 1, 2, 3, 5, 6, 7, 8]), ("valid", [4, 9])):
        meta, tokens, index = read_raw(tmp_path / "out" / split)
        got = [tokens[index[k]:index[k + 1] - 1].astype(np.uint8).tobytes().decode() for k in range(len(ids))]
        assert got == [lines[i]["text"] for i in ids]
    # the output exists now: preparing again without --overwrite is refused, naming the folder
    assert _prepare_module().main(["--input", str(tmp_path / "d.jsonl"), "--output", str(tmp_path / "out"),
                                   "--quiet"]) == 2


def test_byte_tokenizer_contract():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.eod_id) == (257, 256)
    text = "aé🚀"
    assert tok.encode(text) == list(text.encode("utf-8"))
    assert tok.decode(tok.encode(text) + [256]) == text
    assert tok.decode([0xE6, 0x97]) == "\ufffd"  # truncated UTF-8 does not raise
    lengths = tok.token_byte_lengths()
    assert lengths.shape == (257,) and lengths[:256].tolist() == [1] * 256 and lengths[256] == 0
    with pytest.raises(DataError, match="300"):
        tok.decode([300])


@pytest.fixture
def hf_tokenizer_file(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    t = tokenizers.Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t.train_from_iterator(list(TEXTS.values()) * 5, trainer)
    path = tmp_path / "tokenizer.json"
    t.save(str(path))
    return path


def test_round_trip_hf_tokenizer(tmp_path, hf_tokenizer_file):
    names = write_texts(tmp_path / "in")
    rc = _prepare_module().main(["--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"),
                                 "--tokenizer", str(hf_tokenizer_file), "--quiet"])
    assert rc == 0
    assert not (tmp_path / "out" / "valid").exists()  # nothing held out
    meta, tokens, index = read_raw(tmp_path / "out" / "train")
    assert meta["tokenizer"]["kind"] == "hf" and (tmp_path / "out" / "train" / "tokenizer.json").is_file()
    tok = load_tokenizer(meta, tmp_path / "out" / "train")
    assert isinstance(tok, HFTokenizer) and tok.eod_id == meta["eod_id"]
    lengths = tok.token_byte_lengths()
    for i, name in enumerate(names):
        doc = tokens[index[i]:index[i + 1]].tolist()
        assert doc[-1] == tok.eod_id
        assert tok.decode(doc) == TEXTS[name]
        assert int(lengths[doc].sum()) == len(TEXTS[name].encode("utf-8"))  # byte-level BPE: exact


def test_hf_tokenizer_without_library_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import now raises ImportError
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(DataError, match=r"pip install tessera\[tokenizers\]"):
        HFTokenizer(tmp_path / "tokenizer.json")


# ------------------------------------------------------------------------------------------ bad input
@pytest.fixture
def prepared(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "t.txt").write_text("abc hello zzz " * 20)
    assert _prepare_module().main(["--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"), "--quiet"]) == 0
    return tmp_path / "out" / "train"


def _build(folder, vocab_size=257, seq_len=16, max_seq_len=64):
    return build_data({"type": "tokens", "train_folder": str(folder), "seq_len": seq_len},
                      vocab_size=vocab_size, max_seq_len=max_seq_len)


def test_missing_folder(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(DataError, match=str(missing)):
        _build(missing)


def test_empty_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=f"{tmp_path / 'empty'}.*no token files"):
        _build(tmp_path / "empty")


def test_truncated_token_file(prepared):
    path = prepared / "tokens.bin"
    data = path.read_bytes()
    path.write_bytes(data[:-6])
    with pytest.raises(DataError, match=f"{path}.*truncated.*{len(data) - 6}.*{len(data)}"):
        _build(prepared)


def test_index_inconsistent_with_tokens(prepared):
    index = np.fromfile(prepared / "docs.idx", dtype="<i8")
    index[-1] -= 3
    index.tofile(prepared / "docs.idx")
    with pytest.raises(DataError, match=str(prepared / "docs.idx")):
        _build(prepared)


def test_token_id_beyond_model_vocab(prepared):
    raw = (prepared.parent.parent / "in" / "t.txt").read_bytes()
    first_bad = next(b for b in raw if b >= 100)  # 'a'=97 passes, 'b'... 'h'=104 is the first >= 100
    pos = raw.index(first_bad)
    with pytest.raises(DataError) as e:
        _build(prepared, vocab_size=100)
    msg = str(e.value)
    assert str(prepared / "tokens.bin") in msg and f"token id {first_bad} at position {pos}" in msg and "100" in msg


def test_seq_len_beyond_model(prepared):
    with pytest.raises(DataError, match=r"seq_len=128.*max_seq_len=64"):
        _build(prepared, seq_len=128, max_seq_len=64)


def test_data_error_is_value_error():
    assert issubclass(DataError, ValueError)


# ------------------------------------------------------------------------------------------ stdlib
def test_stdlib_corpus(tmp_path):
    calls = []
    folder = prepare_stdlib_corpus(tmp_path, barrier=lambda: calls.append(1))
    assert calls == [1] and os.path.basename(folder) == cache_key()
    assert f"py{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}" in folder
    root = os.path.realpath(sysconfig.get_paths()["stdlib"])
    train = json.loads(open(os.path.join(folder, "train", "sources.json")).read())
    valid = json.loads(open(os.path.join(folder, "valid", "sources.json")).read())
    everything = sorted(train + valid)
    assert len(everything) == len(set(everything)) > 300
    assert valid == everything[19::20]  # every 20th file, sorted by path
    assert train == [p for i, p in enumerate(everything) if (i + 1) % 20]
    assert "os.py" in everything and "json/__init__.py" in everything
    assert not any("site-packages" in p or "__pycache__" in p for p in everything)
    assert any(p.startswith("test/") for p in everything)  # the stdlib's own test suites are source too
    # content: every valid document is exactly its file's bytes
    meta, tokens, index = read_raw(tmp_path / os.path.basename(folder) / "valid")
    for i, rel in enumerate(valid):
        with open(os.path.join(root, rel), "rb") as f:
            # invalid UTF-8 (a few deliberate test files) is replaced, as documented
            assert tokens[index[i]:index[i + 1] - 1].astype(np.uint8).tobytes() == \
                f.read().decode("utf-8", errors="replace").encode("utf-8")
    # cached: a second call (another rank, is_main False) does not rewrite anything
    stamp = os.stat(os.path.join(folder, "train", "meta.json")).st_mtime_ns
    assert prepare_stdlib_corpus(tmp_path, is_main=False, barrier=lambda: None) == folder
    assert os.stat(os.path.join(folder, "train", "meta.json")).st_mtime_ns == stamp
    assert not [n for n in os.listdir(tmp_path) if ".tmp" in n]  # no temporary left behind
    # build_data uses it with the byte tokenizer
    bundle = build_data({"type": "stdlib", "cache_folder": str(tmp_path), "seq_len": 64}, vocab_size=258,
                        max_seq_len=64)
    assert isinstance(bundle.tokenizer, ByteTokenizer) and bundle.valid is not None


def test_stdlib_cache_keyed_and_waiters_do_not_prepare(tmp_path):
    assert cache_key("/some/other/python/lib") != cache_key()
    assert cache_key(max_files=40) != cache_key()
    # a non-main rank whose main rank never prepared fails clearly instead of reading garbage
    with pytest.raises(DataError, match="cache_folder"):
        prepare_stdlib_corpus(tmp_path / "c", is_main=False, barrier=lambda: None, max_files=40)
    assert not (tmp_path / "c").exists() or not os.listdir(tmp_path / "c")
