"""InternEvo's packing of tokenized data: each micro-batch is one pack of ``micro_bsz x seq_len`` tokens.

As InternEvo's packed datasets do, each ``.bin`` file is packed on its own: its documents are shuffled
with a fixed seed (``numpy.random.RandomState(1024)``), laid back to back, and cut into
``num_tokens // (micro_bsz * seq_len)`` packs (the tail is dropped); the packs of all files, in file
order, are the rows the sampler draws from. Inside a pack:

- ``pack_sample_into_one=False`` (InternEvo's ``PackedDatasetWithCut``): every document fragment is its
  own attention segment, split further every ``seq_len`` tokens from the fragment's start; positions
  restart per segment; the last token of a document has no label, and a fragment cut at the pack's
  end is labelled with the next token of its document;
- ``pack_sample_into_one=True`` (``PackedDatasetWithoutCuSeqlen``): the segments are the ``micro_bsz``
  rows of ``seq_len`` whatever the documents; positions ``0..seq_len-1``; every fragment's last token,
  a cut one included, has no label.

Then InternEvo's collation: input ids are ``abs(id)`` and a label that is ``<= 0`` is ignored (negative
ids mark prompt tokens of SFT data; 0 is padding). A micro-batch is ``[1, micro_bsz * seq_len]``, as
InternEvo feeds its model: segments may cross the ``seq_len`` boundaries, which a ``[micro_bsz,
seq_len]`` layout could not hold.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tessera.data.errors import DataError
from tessera.data.internevo_files import InternEvoFile
from tessera.data.packing import IGNORE_INDEX

__all__ = ["InternEvoPacks", "SHUFFLE_SEED"]

SHUFFLE_SEED = 1024  # InternEvo's DEFAULT_SEED of its packed datasets: fixed, whatever the run's seed


class _PackedFile:
    """One file's shuffled document order and the cumulative lengths along it."""

    def __init__(self, file: InternEvoFile, packed_length: int):
        self.file = file
        self.order = np.arange(file.num_documents)
        np.random.RandomState(SHUFFLE_SEED).shuffle(self.order)
        lengths = file.lengths[self.order]
        self.ends = np.cumsum(lengths).astype(np.int64)
        self.begins = self.ends - lengths
        self.num_packs = int(self.ends[-1] // packed_length) if lengths.size else 0

    def fragments(self, start: int, stop: int) -> list[tuple[np.ndarray, bool, int]]:
        """(tokens, ends its document, next token) of each document piece in ``[start, stop)``."""
        first = int(np.searchsorted(self.ends, start, side="right"))
        last = int(np.searchsorted(self.begins, stop, side="left"))
        out = []
        for k in range(first, last):
            b, e = int(self.begins[k]), int(self.ends[k])
            if e == b:
                continue
            doc = self.file.document(int(self.order[k]))
            lo, hi = max(start, b) - b, min(stop, e) - b
            out.append((doc[lo:hi], hi == e - b, int(doc[hi]) if hi < e - b else IGNORE_INDEX))
        return out


class InternEvoPacks:
    """The packs of InternEvo ``.bin`` files, addressed by a global index (the sampler's rows)."""

    def __init__(self, files: Sequence[InternEvoFile], seq_len: int, micro_bsz: int, pack_sample_into_one: bool):
        self.seq_len, self.micro_bsz, self.pack_one = seq_len, micro_bsz, pack_sample_into_one
        self.packed_length = self.tokens_per_row = seq_len * micro_bsz
        self.files = [_PackedFile(f, self.packed_length) for f in files]
        self.row_offsets = np.concatenate([[0], np.cumsum([p.num_packs for p in self.files])]).astype(np.int64)
        self.num_rows = int(self.row_offsets[-1])
        if self.num_rows == 0:
            raise DataError(f"no .bin file holds micro_bsz x seq_len = {self.packed_length} tokens (InternEvo packs "
                            "each file on its own and drops its tail): use a smaller data.seq_len or data.micro_bsz")

    def pack(self, r: int) -> dict[str, np.ndarray]:
        """Pack ``r`` as InternEvo's dataset returns it: tokens, labels, cu_seqlens, indexes (position ids)."""
        if not 0 <= r < self.num_rows:
            raise DataError(f"pack {r} out of range: the data has {self.num_rows} packs")
        k = int(np.searchsorted(self.row_offsets, r, side="right")) - 1
        start = (r - int(self.row_offsets[k])) * self.packed_length
        tokens, labels, seg = [], [], [0]
        for piece, ends_doc, following in self.files[k].fragments(start, start + self.packed_length):
            tokens.append(piece)
            last = IGNORE_INDEX if ends_doc or self.pack_one else following
            labels.append(np.append(piece[1:], last))
            if not self.pack_one:
                full, rest = divmod(piece.size, self.seq_len)
                base = seg[-1]
                seg += [base + self.seq_len * (j + 1) for j in range(full)]
                if rest:
                    seg.append(seg[-1] + rest)
        if self.pack_one:
            seg = list(range(0, self.packed_length + 1, self.seq_len))
        cu = np.asarray(seg, dtype=np.int64)
        positions = np.arange(self.packed_length) - np.repeat(cu[:-1], np.diff(cu))
        return {"tokens": np.concatenate(tokens), "labels": np.concatenate(labels), "cu_seqlens": cu,
                "indexes": positions}

    def batch(self, row_ids: Sequence[int] | np.ndarray) -> dict[str, torch.Tensor]:
        """One micro-batch per pack id: ``input_ids`` ``[n, micro_bsz * seq_len]`` (n = 1 in training)."""
        row_ids = np.asarray(row_ids, dtype=np.int64).reshape(-1)
        packs = [self.pack(int(r)) for r in row_ids]
        P = self.packed_length
        labels = np.stack([p["labels"] for p in packs])
        labels[labels <= 0] = IGNORE_INDEX  # InternEvo's collation: 0 (padding) and prompt ids are not learnt
        return {
            "input_ids": torch.from_numpy(np.abs(np.stack([p["tokens"] for p in packs]))),
            "labels": torch.from_numpy(labels),
            "cu_seqlens": torch.from_numpy(np.concatenate([p["cu_seqlens"][:-1] + i * P for i, p in enumerate(packs)]
                                                          + [np.array([len(packs) * P])]).astype(np.int32)),
            "position_ids": torch.from_numpy(np.stack([p["indexes"] for p in packs])),
            "sample_ids": torch.from_numpy(row_ids.copy()),
            "num_bytes": torch.tensor(0, dtype=torch.int64),  # InternEvo's data records no source bytes
        }
