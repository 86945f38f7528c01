"""The tokenizer a checkpoint was trained with: recorded by an import, the run's byte corpus, the tokenizer
stored in the run's token folders, or the one its raw text was tokenized with (``data.text.tokenizer``);
``tools/generate.py`` and the Hugging Face export ask for it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from tessera.data.errors import DataError
from tessera.data.text_corpus import text_tokenizer
from tessera.data.token_file import find_shards
from tessera.data.tokenizer import AnyTokenizer, ByteTokenizer, build_tokenizer, load_tokenizer

__all__ = ["tokenizer_choices", "tokenizer_for_checkpoint"]


def tokenizer_choices(how: str, max_ids: int | None = None) -> str:
    """What to pass when a run has no tokenizer. ``max_ids``: the most ids the caller can use (an evaluation:
    the model's vocabulary, which must embed the end-of-document id too), named so that the advice is not
    followed by a second error; the byte tokenizer is offered only where it fits."""
    files = "PATH/tokenizer.json|PATH/tokenizer.model"
    if max_ids is None:
        return f"pass {how}byte|{files}"
    byte = ByteTokenizer.vocab_size
    if max_ids < byte:
        return (f"pass {how}{files} of at most {max_ids} ids (model.vocab_size={max_ids}; {how}byte has {byte} ids "
                f"and needs model.vocab_size >= {byte})")
    return f"pass {how}byte|{files} (at most {max_ids} ids: model.vocab_size={max_ids})"


def tokenizer_for_checkpoint(path: str, meta: Mapping[str, Any], override: str | None = None, *,
                             how: str = "--tokenizer ", max_ids: int | None = None) -> tuple[AnyTokenizer | None, str]:
    """``(tokenizer or None, where it came from / why there is none)`` for checkpoint folder ``path``
    whose meta.json is ``meta``. ``override``: ``"byte"``, a ``tokenizer.json`` or a SentencePiece ``.model``
    path, used as is. ``how``: how the caller's user gives ``override`` (a flag, or a config key and ``=``), for
    the texts; ``max_ids``: the most ids the caller can use, named in the advice (``tokenizer_choices``)."""
    choices = tokenizer_choices(how, max_ids)
    if override:
        return build_tokenizer(override), f"{how}{override}"
    if isinstance(meta.get("tokenizer"), dict):  # recorded by tools/import_hf.py, file inside the step folder
        return load_tokenizer({"tokenizer": meta["tokenizer"]}, path), f"{path}/meta.json"
    data = (meta.get("config") or {}).get("data") or {}
    kind = data.get("type")
    if kind == "stdlib":
        return ByteTokenizer(), "data.type='stdlib' (byte tokenizer)"
    if kind == "tokens":
        folder = data.get("train_folder")
        try:
            shard = find_shards(folder)[0]  # type: ignore[arg-type]  # None: the TypeError is reported below
            with open(os.path.join(shard, "meta.json"), encoding="utf-8") as f:
                return load_tokenizer(json.load(f), shard), f"data.train_folder={folder}"
        except (DataError, OSError, ValueError, TypeError) as e:
            return None, (f"the run's data.train_folder={folder!r} is not readable from here ({e}); "
                          + choices)
    if kind == "text":
        spec = (data.get("text") or {}).get("tokenizer", "byte")
        try:
            return text_tokenizer({"eod_token": None, "add_bos": False, **data["text"]}), f"data.text.tokenizer={spec}"
        except (DataError, OSError, KeyError, TypeError) as e:
            return None, (f"the run's data.text.tokenizer={spec!r} is not readable from here ({e}); "
                          + choices)
    return None, f"data.type={kind!r} has no tokenizer; {choices}"
