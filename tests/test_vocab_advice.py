"""Byte-level data names the vocabulary it needs: prepare_data.py prints it, and a too-small model.vocab_size
is refused with the size to use (the tokenizer's ids rounded up so every power-of-two TP size up to 64 divides it).
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from tessera.data.errors import DataError
from tessera.data.token_file import open_token_folder
from tessera.data.vocab import VOCAB_MULTIPLE, padded_vocab_size, vocab_advice

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_padded_size_is_the_smallest_multiple_that_holds_the_ids():
    assert [padded_vocab_size(n) for n in (1, 64, 65, 257, 32000, 50257)] == [64, 64, 128, 320, 32000, 50304]
    for n in (257, 50257, 128256):
        p = padded_vocab_size(n)
        assert p >= n > p - VOCAB_MULTIPLE and all(p % tp == 0 for tp in (1, 2, 4, 8, 16, 32, 64))
    assert vocab_advice(257).startswith("model.vocab_size=320 ")
    assert vocab_advice(32000).startswith("model.vocab_size=32000 ")
    with pytest.raises(ValueError):
        padded_vocab_size(0)


def test_prepare_prints_the_size_and_a_small_model_vocab_is_refused_naming_it(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("_prepare_tool", os.path.join(ROOT, "tools", "prepare_data.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    (tmp_path / "a.txt").write_text("hello bytes\n" * 20)
    assert tool.main(["--input", str(tmp_path / "a.txt"), "--output", str(tmp_path / "out"), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "vocabulary: 257 ids; train with model.vocab_size=320 " in out
    assert "valid: none held out" in out and not (tmp_path / "out" / "valid").exists()
    with pytest.raises(DataError, match=r"vocab_size 256; the data was made with a vocab of 257 .*"
                                        r"use model\.vocab_size=320 "):
        open_token_folder(str(tmp_path / "out" / "train"), 256)
    assert open_token_folder(str(tmp_path / "out" / "train"), 320)  # the advised size opens
