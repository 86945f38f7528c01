"""Which tokenizer a checkpoint's run used, and Hugging Face files for it.

A checkpoint does not store its tokenizer; its config does say where the data came from:
``data.type='stdlib'`` is always the byte tokenizer, ``data.type='tokens'`` names token folders
whose meta.json describes (and, for HF tokenizers, holds a copy of) the tokenizer, and synthetic data
has none. A checkpoint imported from Hugging Face records its tokenizer in its own meta.json.

For the byte tokenizer there is no upstream HF file, so ``byte_tokenizer_json`` builds an
equivalent one: a byte-level BPE with no merges whose vocabulary maps each byte to its own value as
id, plus the end-of-document token at 256 — ``AutoTokenizer`` then encodes text to exactly the ids
tessera trained on.
"""

from __future__ import annotations

import json
import os
from typing import Any

from tessera.data.errors import DataError
from tessera.data.token_file import find_shards
from tessera.data.tokenizer import (ByteTokenizer, HFTokenizer, _gpt2_unicode_to_byte, build_tokenizer,
                                    load_tokenizer)

__all__ = ["tokenizer_for_checkpoint", "byte_tokenizer_json", "write_hf_tokenizer_files", "BYTE_EOD_TOKEN"]

BYTE_EOD_TOKEN = "<|endoftext|>"


def tokenizer_for_checkpoint(path: str, meta: dict[str, Any], override: str | None = None
                             ) -> tuple[ByteTokenizer | HFTokenizer | None, str]:
    """``(tokenizer or None, where it came from / why there is none)`` for checkpoint folder ``path``.

    ``override``: ``"byte"`` or a ``tokenizer.json`` path, used as is.
    """
    if override:
        return build_tokenizer(override), f"--tokenizer {override}"
    if isinstance(meta.get("tokenizer"), dict):  # recorded by tools/import_hf.py, file inside the step folder
        return load_tokenizer({"tokenizer": meta["tokenizer"]}, path), f"{path}/meta.json"
    data = (meta.get("config") or {}).get("data") or {}
    kind = data.get("type")
    if kind == "stdlib":
        return ByteTokenizer(), "data.type='stdlib' (byte tokenizer)"
    if kind == "tokens":
        folder = data.get("train_folder")
        try:
            shard = find_shards(folder)[0]
            with open(os.path.join(shard, "meta.json"), encoding="utf-8") as f:
                return load_tokenizer(json.load(f), shard), f"data.train_folder={folder}"
        except (DataError, OSError, ValueError, TypeError) as e:
            return None, (f"the run's data.train_folder={folder!r} is not readable from here ({e}); "
                          "pass --tokenizer byte|PATH/tokenizer.json")
    return None, f"data.type={kind!r} has no tokenizer; pass --tokenizer byte|PATH/tokenizer.json"


def byte_tokenizer_json(eod_token: str = BYTE_EOD_TOKEN) -> str:
    """A Hugging Face ``tokenizer.json`` equivalent to ``ByteTokenizer`` (ids 0..255 = bytes, 256 = EOD)."""
    try:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        raise DataError("writing a tokenizer.json needs the 'tokenizers' package: pip install tessera[hf]") from None
    vocab = {char: byte for char, byte in _gpt2_unicode_to_byte().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # no regex split and no prefix space: the text's bytes map one to one onto tokens
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(eod_token, special=True, normalized=False)])
    if tok.token_to_id(eod_token) != ByteTokenizer.eod_id:
        raise RuntimeError("byte tokenizer.json: the end-of-document token did not land on id 256")
    return tok.to_str()


def write_hf_tokenizer_files(tokenizer: ByteTokenizer | HFTokenizer, out_dir: str, model_max_length: int) -> list[str]:
    """``tokenizer.json`` + ``tokenizer_config.json`` for ``AutoTokenizer.from_pretrained(out_dir)``."""
    tok_path = os.path.join(out_dir, "tokenizer.json")
    if isinstance(tokenizer, ByteTokenizer):
        with open(tok_path, "w", encoding="utf-8") as f:
            f.write(byte_tokenizer_json())
        eos = BYTE_EOD_TOKEN
    else:
        with open(tokenizer.path, "rb") as src, open(tok_path, "wb") as dst:
            dst.write(src.read())
        eos = tokenizer.eod_token
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "model_max_length": model_max_length,
              "clean_up_tokenization_spaces": False}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return ["tokenizer.json", "tokenizer_config.json"]
