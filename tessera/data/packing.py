"""Cut token streams into fixed-length training rows and assemble micro-batches.

Each stream (a token file shard, or the synthetic generator) is one long sequence in which every
document is followed by its EOD token. Row ``r`` of a stream is tokens ``[r*L, r*L+L)``; its labels
are the next tokens, so documents longer than a row simply continue in the next row. Rows never
span two streams; the last row of a stream is padded. Building a batch costs a few numpy operations
per row (a slice of the memory map and a binary search in the document index), no per-token loop.

Context rows (``context=c > 0``, validation only): consecutive rows of a stream overlap by ``c``
tokens. Row ``r`` reads tokens ``[r*(L-c), r*(L-c)+L)``; in every row but a stream's first, the first
``c`` positions carry no label, so each token is still scored exactly once, but never with less than
``c`` tokens of its own document before it (where the document has them). A row that starts cold
sees the first bytes of a row with no context at all, which is not how the model reads a file.

Batch format (a dict of tensors, ``B = micro_bsz``, ``L = seq_len``):

- ``input_ids`` [B, L] int64; padding is the EOD id.
- ``labels`` [B, L] int64: the next token, or -100 where there is none to learn: at each document's
  EOD (the next token belongs to another document) and on padding. The token before EOD has label
  EOD, so the model learns to end documents.
- ``cu_seqlens`` [S+1] int32 over the flattened B*L tokens (flash-attn varlen): segment starts,
  from 0 to B*L. Segments start at every row start, every document start inside a row, and where a
  row's padding starts. With ``pack_sample_into_one`` only the row boundaries.
- ``position_ids`` [B, L] int64: 0, 1, ... from each segment start (so a document continued from the
  previous row restarts at 0, matching what attention can see); 0..L-1 with ``pack_sample_into_one``.
- ``sample_ids`` [B] int64: the global row indices (-1 for an all-padding row).
- ``num_bytes``: 0-d int64 tensor, source bytes of the tokens that are labels (for bits per byte).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from tessera.data.errors import DataError

IGNORE_INDEX = -100


class TokenStream(Protocol):
    """A sequence of token ids where each document ends with ``eod_id``."""

    num_tokens: int
    eod_id: int

    def read(self, start: int, stop: int) -> np.ndarray: ...

    def doc_starts_in(self, start: int, stop: int) -> np.ndarray: ...


class PackedRows:
    """The rows of one or more streams, addressed by a global row index."""

    def __init__(self, streams: Sequence[TokenStream], seq_len: int, byte_lengths: np.ndarray,
                 pack_sample_into_one: bool = False, context: int = 0):
        if not streams:
            raise DataError("no token streams to pack")
        if seq_len < 1:
            raise DataError(f"seq_len={seq_len} must be >= 1")
        if not 0 <= context < seq_len:
            raise DataError(f"context={context} (data.valid_context_len) must be >= 0 and below "
                            f"data.seq_len={seq_len}")
        self.streams = list(streams)
        self.seq_len = seq_len
        self.context = context
        self.stride = seq_len - context  # tokens scored per row after a stream's first row
        self.pack_sample_into_one = pack_sample_into_one
        self.byte_lengths = np.asarray(byte_lengths, dtype=np.int64)
        self.pad_id = int(self.streams[0].eod_id)
        rows = [1 + -(-max(0, int(s.num_tokens) - seq_len) // self.stride) if s.num_tokens else 0 for s in self.streams]
        self.row_offsets = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
        self.num_rows = int(self.row_offsets[-1])
        self.tokens_per_row = seq_len

    def _row(self, r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(input ids, labels, segment starts within the row) of global row ``r``; -1 is padding."""
        L = self.seq_len
        inp = np.full(L, self.pad_id, dtype=np.int64)
        lab = np.full(L, IGNORE_INDEX, dtype=np.int64)
        if r < 0:
            return inp, lab, np.zeros(1, dtype=np.int64)
        if r >= self.num_rows:
            raise DataError(f"row {r} out of range: the data has {self.num_rows} rows")
        k = int(np.searchsorted(self.row_offsets, r, side="right")) - 1
        stream = self.streams[k]
        a = (r - int(self.row_offsets[k])) * self.stride
        n = min(L, int(stream.num_tokens) - a)
        toks = stream.read(a, a + n + 1)
        inp[:n] = toks[:n]
        m = toks.size - 1  # labels available (n, or n-1 at the end of the stream)
        lab[:m] = toks[1:m + 1]
        if getattr(stream, "signed", False):  # InternEvo's data: a negative id is input, never a label
            inp[:n] = np.abs(inp[:n])
            lab[:m][lab[:m] <= 0] = IGNORE_INDEX
        starts = stream.doc_starts_in(a, a + n) - a  # in (0, n]
        lab[starts - 1] = IGNORE_INDEX  # the EOD of each document that ends in this row
        if a > 0:
            lab[:self.context] = IGNORE_INDEX  # scored by the previous row; context here
        if self.pack_sample_into_one:
            seg = np.zeros(1, dtype=np.int64)
        else:
            seg = np.concatenate([[0], starts[starts < n], [n] if n < L else []]).astype(np.int64)
        return inp, lab, seg

    def batch(self, row_ids: Sequence[int] | np.ndarray) -> dict[str, torch.Tensor]:
        """The micro-batch made of the given global rows (see the module docstring for the format)."""
        row_ids = np.asarray(row_ids, dtype=np.int64).reshape(-1)
        B, L = row_ids.size, self.seq_len
        inputs = np.empty((B, L), dtype=np.int64)
        labels = np.empty((B, L), dtype=np.int64)
        positions = np.empty((B, L), dtype=np.int64)
        cu = []
        for b, r in enumerate(row_ids):
            inputs[b], labels[b], seg = self._row(int(r))
            lengths = np.diff(np.append(seg, L))
            positions[b] = np.arange(L) - np.repeat(seg, lengths)
            cu.append(seg + b * L)
        cu.append(np.array([B * L]))
        valid = labels[labels != IGNORE_INDEX]
        return {
            "input_ids": torch.from_numpy(inputs),
            "labels": torch.from_numpy(labels),
            "cu_seqlens": torch.from_numpy(np.concatenate(cu).astype(np.int32)),
            "position_ids": torch.from_numpy(positions),
            "sample_ids": torch.from_numpy(row_ids.copy()),
            "num_bytes": torch.tensor(int(self.byte_lengths[valid].sum()), dtype=torch.int64),
        }
