"""Tokenizers behind one small interface: a built-in byte-level one and a Hugging Face wrapper; and
every way of loading one (the one tokenizer module: data, checkpoints and tools import it).

Why a common interface: token files record which tokenizer made them (meta.json), the loader needs
``eod_id`` and per-token byte lengths (for bits per byte), and generation needs ``encode``/``decode``,
whatever the tokenizer is.

Loading: ``build_tokenizer`` from a name or file, ``load_tokenizer`` from a token folder's meta.json,
``run_tokenizer.tokenizer_for_checkpoint`` for a checkpoint. A checkpoint does not store its tokenizer; its config
does say where the data came from: ``data.type='stdlib'`` is always the byte tokenizer,
``data.type='tokens'`` names token folders whose meta.json describes (and, for HF tokenizers, holds a
copy of) the tokenizer, and synthetic data has none. A checkpoint imported from Hugging Face records
its tokenizer in its own meta.json.

For the byte tokenizer there is no upstream HF file, so ``byte_tokenizer_json`` builds an equivalent
one: a byte-level BPE with no merges whose vocabulary maps each byte to its own value as id, plus the
end-of-document token at 256 — ``AutoTokenizer`` then encodes text to exactly the ids tessera trained
on. ``write_hf_tokenizer_files`` writes the files ``AutoTokenizer.from_pretrained`` reads.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from tessera.data.errors import DataError
from tessera.data.sp_tokenizer import SentencePieceTokenizer

__all__ = ["AnyTokenizer", "BYTE_EOD_TOKEN", "ByteTokenizer", "HFTokenizer", "SentencePieceTokenizer", "Tokenizer",
           "build_tokenizer", "byte_tokenizer_json", "load_tokenizer", "write_hf_tokenizer_files"]

BYTE_EOD_TOKEN = "<|endoftext|>"  # the byte tokenizer's end of document in its Hugging Face files


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    vocab_size: int
    eod_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def token_byte_lengths(self) -> np.ndarray: ...

    def describe(self) -> dict[str, Any]: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255 are the bytes, 256 ends a document; ``vocab_size`` 257.

    Needs no files and no training, so the demo corpus and tests run anywhere, and bits per byte are
    exact (every byte token stands for exactly one source byte).
    """

    kind = "byte"
    vocab_size = 257
    eod_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        """Fast path for preparation: the UTF-8 bytes as a uint8 array (no Python list)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    encode_document = encode_array  # a training document's ids (the writer appends the EOD)

    def decode(self, ids: Sequence[int]) -> str:
        """Bytes back to text; EOD tokens are dropped and invalid UTF-8 becomes U+FFFD."""
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        if arr.size and (arr.min() < 0 or arr.max() > self.eod_id):
            bad = int(arr[(arr < 0) | (arr > self.eod_id)][0])
            raise DataError(f"byte tokenizer cannot decode token id {bad}: valid ids are 0..{self.eod_id}")
        return arr[arr < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def token_byte_lengths(self) -> np.ndarray:
        lengths = np.ones(self.vocab_size, dtype=np.int64)
        lengths[self.eod_id] = 0
        return lengths

    def describe(self) -> dict[str, Any]:
        return {"kind": "byte", "vocab_size": self.vocab_size, "eod_id": self.eod_id}


# Names under which tokenizers commonly spell their end-of-document token, most specific first.
_EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]", "<|im_end|>")


def _import_tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise DataError(
            "a Hugging Face tokenizer.json needs the 'tokenizers' package: pip install tessera[tokenizers]"
        ) from None
    return tokenizers


def _gpt2_unicode_to_byte() -> dict[str, int]:
    """Inverse of the GPT-2 byte-level alphabet (each byte is shown as one printable character)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (``tokenizers`` library) behind the tessera interface."""

    kind = "hf"
    folder_file = "tokenizer.json"  # its name when copied into a token folder

    def __init__(self, path: str | os.PathLike, eod_token: str | None = None):
        tokenizers = _import_tokenizers()
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise DataError(f"tokenizer file not found: {self.path}")
        try:
            self._tok = tokenizers.Tokenizer.from_file(self.path)
        except Exception as e:  # the library raises its own exception types
            raise DataError(f"cannot read tokenizer file {self.path}: {e}") from e
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.eod_token = eod_token or self._find_eod()
        eod = self._tok.token_to_id(self.eod_token)
        if eod is None:
            raise DataError(f"tokenizer {self.path} has no token {self.eod_token!r} to use as end of document")
        self.eod_id = int(eod)

    def _find_eod(self) -> str:
        for name in _EOD_CANDIDATES:
            if self._tok.token_to_id(name) is not None:
                return name
        raise DataError(
            f"tokenizer {self.path} has none of the usual end-of-document tokens {list(_EOD_CANDIDATES)}; "
            "name one with --eod-token"
        )

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_document(self, text: str) -> list[int]:
        """A training document's ids (no special tokens; the writer appends the EOD)."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Several documents at once (the library parallelizes this)."""
        return [list(e.ids) for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def token_byte_lengths(self) -> np.ndarray:
        """Source bytes per token, for bits per byte. Exact for byte-level BPE; an estimate otherwise.

        Special/added tokens count 0; ``<0xAB>`` byte-fallback tokens count 1; SentencePiece's "▁" is a
        space. Normalizers that rewrite text (lowercasing, NFKC) make any per-token count approximate.
        """
        spec = json.loads(self._tok.to_str())
        decoder = spec.get("decoder") or {}
        byte_level = decoder.get("type") == "ByteLevel"
        inverse = _gpt2_unicode_to_byte() if byte_level else {}
        special = {int(i) for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        lengths = np.zeros(self.vocab_size, dtype=np.int64)
        for token, i in self._tok.get_vocab(with_added_tokens=True).items():
            if i in special or i >= self.vocab_size:
                continue
            if byte_level and all(c in inverse for c in token):
                lengths[i] = len(token)
            elif len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
                lengths[i] = 1
            else:
                lengths[i] = len(token.replace("▁", " ").encode("utf-8"))
        return lengths

    def describe(self) -> dict[str, Any]:
        return {"kind": "hf", "vocab_size": self.vocab_size, "eod_id": self.eod_id, "eod_token": self.eod_token}


AnyTokenizer = ByteTokenizer | HFTokenizer | SentencePieceTokenizer


def _tokenizer_file(spec: str) -> str:
    """A tokenizer folder's own file (tokenizer.json, else tokenizer.model); a file path as it is."""
    if os.path.isdir(spec):
        for name in ("tokenizer.json", "tokenizer.model"):
            if os.path.isfile(os.path.join(spec, name)):
                return os.path.join(spec, name)
        raise DataError(f"tokenizer folder {spec} holds neither tokenizer.json nor tokenizer.model")
    return spec


def build_tokenizer(spec: str | os.PathLike, eod_token: str | None = None, add_bos: bool = False) -> AnyTokenizer:
    """``"byte"`` -> ByteTokenizer; a SentencePiece ``.model`` -> SentencePieceTokenizer; a ``tokenizer.json``
    -> HFTokenizer; a folder -> the tokenizer file in it. ``add_bos``: SentencePiece only (its model's BOS)."""
    spec = _tokenizer_file(os.fspath(spec))
    if spec == "byte":
        tok: AnyTokenizer = ByteTokenizer()
    elif spec.endswith(".model"):
        return SentencePieceTokenizer(spec, eod_token=eod_token, add_bos=add_bos)
    else:
        tok = HFTokenizer(spec, eod_token=eod_token)
    if add_bos:
        raise DataError(f"--add-bos is for SentencePiece models (their bos_id); {spec} is not one")
    return tok


def load_tokenizer(meta: Mapping[str, Any], folder: str | os.PathLike | None = None) -> AnyTokenizer:
    """Rebuild the tokenizer a token folder's meta.json records (a tokenizer file is copied next to it)."""
    desc = meta.get("tokenizer")
    if not isinstance(desc, Mapping) or "kind" not in desc:
        raise DataError(f"meta.json in {folder} has no tokenizer description")
    if desc["kind"] == "byte":
        return ByteTokenizer()
    if desc["kind"] not in ("hf", "sentencepiece"):
        raise DataError(f"meta.json in {folder}: unknown tokenizer kind {desc['kind']!r} "
                        "(expected 'byte', 'hf' or 'sentencepiece')")
    if folder is None:
        raise DataError(f"an {desc['kind']!r} tokenizer is stored next to meta.json; pass the folder to load_tokenizer")
    tok: HFTokenizer | SentencePieceTokenizer
    if desc["kind"] == "hf":
        tok = HFTokenizer(os.path.join(os.fspath(folder), desc.get("file", "tokenizer.json")), desc.get("eod_token"))
    else:
        tok = SentencePieceTokenizer(os.path.join(os.fspath(folder), desc.get("file", "tokenizer.model")),
                                     desc.get("eod_token"), bool(desc.get("add_bos", False)))
    if tok.vocab_size != desc.get("vocab_size") or tok.eod_id != desc.get("eod_id"):
        raise DataError(
            f"tokenizer in {folder} does not match meta.json: vocab {tok.vocab_size} vs {desc.get('vocab_size')}, "
            f"eod {tok.eod_id} vs {desc.get('eod_id')}"
        )
    return tok


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


def write_hf_tokenizer_files(tokenizer: AnyTokenizer, out_dir: str, model_max_length: int) -> list[str]:
    """``tokenizer.json`` (or a SentencePiece ``tokenizer.model``) + ``tokenizer_config.json`` for
    ``AutoTokenizer.from_pretrained(out_dir)``."""
    if isinstance(tokenizer, SentencePieceTokenizer):
        return _write_sentencepiece_files(tokenizer, out_dir, model_max_length)
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


def _write_sentencepiece_files(tokenizer: SentencePieceTokenizer, out_dir: str, model_max_length: int) -> list[str]:
    """A SentencePiece model as Llama's tokenizer class reads it (the model file itself, BOS as trained)."""
    with open(tokenizer.path, "rb") as src, open(os.path.join(out_dir, "tokenizer.model"), "wb") as dst:
        dst.write(src.read())
    config: dict[str, Any] = {"tokenizer_class": "LlamaTokenizer", "eos_token": tokenizer.eod_token,
                              "add_bos_token": tokenizer.add_bos, "add_eos_token": False,
                              "model_max_length": model_max_length, "clean_up_tokenization_spaces": False}
    if tokenizer.bos_id >= 0:
        config["bos_token"] = tokenizer.decode_piece(tokenizer.bos_id)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return ["tokenizer.model", "tokenizer_config.json"]
