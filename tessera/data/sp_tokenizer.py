"""A SentencePiece ``.model`` (InternLM's, Llama 2's, Mistral's tokenizers) behind tessera's tokenizer interface.

The ids are exactly what ``sentencepiece.SentencePieceProcessor.encode`` gives; the end of document is
the model's own EOS (``eos_id``) unless ``eod_token`` names another piece, and BOS is the model's
``bos_id``, prepended to each document only when asked (``add_bos``), as Llama-style pretraining does.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from tessera.data.errors import DataError
from tessera.data.formats import require

__all__ = ["SentencePieceTokenizer"]


class SentencePieceTokenizer:
    """``sentencepiece`` model file -> ids; picklable (workers rebuild it from the model bytes)."""

    kind = "sentencepiece"
    folder_file = "tokenizer.model"  # its name when copied into a token folder

    def __init__(self, path: str | os.PathLike, eod_token: str | None = None, add_bos: bool = False):
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise DataError(f"tokenizer file not found: {self.path}")
        self.eod_token_arg, self.add_bos = eod_token, add_bos
        self._sp = self._load()
        self.vocab_size = int(self._sp.get_piece_size())
        if eod_token is not None:
            eod = int(self._sp.piece_to_id(eod_token))
            if eod == self._sp.unk_id() and eod_token != self._sp.id_to_piece(eod):
                raise DataError(f"tokenizer {self.path} has no piece {eod_token!r} to use as end of document")
        else:
            eod = int(self._sp.eos_id())
            if eod < 0:
                raise DataError(f"tokenizer {self.path} defines no EOS piece; name one with --eod-token")
        self.eod_id = eod
        self.eod_token = self._sp.id_to_piece(eod)
        self.bos_id = int(self._sp.bos_id())
        if add_bos and self.bos_id < 0:
            raise DataError(f"tokenizer {self.path} defines no BOS piece, so --add-bos cannot prepend one")

    def _load(self) -> Any:
        spm: Any = require("sentencepiece", "a SentencePiece .model tokenizer")
        sp = spm.SentencePieceProcessor()
        try:
            sp.Load(self.path)
        except (OSError, RuntimeError) as e:
            raise DataError(f"cannot read SentencePiece model {self.path}: {e}") from None
        return sp

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_sp"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._sp = self._load()

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text))

    def encode_document(self, text: str) -> list[int]:
        """A training document's ids: BOS first when ``add_bos`` (the EOD is appended by the writer)."""
        ids = self._sp.encode(text)
        return [self.bos_id, *ids] if self.add_bos else ids

    def decode_piece(self, i: int) -> str:
        return str(self._sp.id_to_piece(int(i)))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._sp.decode([int(i) for i in ids if not self._sp.is_control(int(i))]))

    def token_byte_lengths(self) -> np.ndarray:
        """Source bytes per piece (for bits per byte): control/unknown 0, ``<0xAB>`` byte pieces 1, "▁" a space."""
        lengths = np.zeros(self.vocab_size, dtype=np.int64)
        for i in range(self.vocab_size):
            if self._sp.is_control(i) or self._sp.is_unknown(i):
                continue
            piece = self._sp.id_to_piece(i)
            if self._sp.is_byte(i):
                lengths[i] = 1
            else:
                lengths[i] = len(piece.replace("▁", " ").encode("utf-8"))
        return lengths

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "vocab_size": self.vocab_size, "eod_id": self.eod_id, "eod_token": self.eod_token,
                "bos_id": self.bos_id, "add_bos": self.add_bos}
