"""The trainer's single entry point: ``build_data`` -> train iterator, valid iterable, tokenizer.

Leaf code: no global state is read. The caller passes the data config, the model limits, its DP
coordinates, the seed and (for the stdlib demo corpus) a barrier callable.

Train: each optimizer step consumes the next ``G = dp_size * micro_bsz * micro_num`` rows of the
global sequence (see sampler.py). Viewed as ``[micro_num, dp_size, micro_bsz]``, rank ``r`` takes
``[:, r, :]``: micro-batch ``m`` of all ranks together is one contiguous piece of the sequence.

There are no loader worker processes (no ``data.num_workers`` key): a micro-batch is a few slices of a
memory map, far cheaper than a training step, so workers would only add start-up time and state to resume.

Valid: up to ``valid_micro_num`` micro-batches of ``valid_micro_bsz`` rows (default ``micro_bsz``) per
rank, rows spread evenly over the valid set, the same on every call; consecutive rows overlap by
``valid_context_len`` unscored context tokens (see packing.py); slots beyond the end of a tiny
valid set are all-padding rows (``sample_ids`` -1, no labels) so every rank runs the same number of
micro-batches (collectives stay matched).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tessera.config import ConfigError, check_data, validate_section
from tessera.data.errors import DataError
from tessera.data.internevo_files import InternEvoFile, is_internevo_folder, open_internevo_folder
from tessera.data.internevo_packing import InternEvoPacks
from tessera.data.packing import PackedRows, TokenStream
from tessera.data.sampler import GlobalRowSampler
from tessera.data.stdlib_corpus import prepare_stdlib_corpus
from tessera.data.synthetic import SyntheticStream
from tessera.data.text_corpus import text_corpus_folders
from tessera.data.token_file import open_token_folder
from tessera.data.tokenizer import AnyTokenizer

Batch = dict[str, torch.Tensor]
SYNTHETIC_TRAIN_ROWS = 1 << 16
SYNTHETIC_VALID_ROWS = 1 << 10


class TrainLoader:
    """Endless, resumable micro-batches for one DP rank, one optimizer step at a time. ``micro_bsz``: rows
    the sampler draws per micro-batch (1 for InternEvo's packs, each a whole micro-batch)."""

    def __init__(self, rows: PackedRows | InternEvoPacks, sampler: GlobalRowSampler, micro_bsz: int, micro_num: int,
                 dp_rank: int, dp_size: int):
        self.rows = rows
        self.sampler = sampler
        self.micro_bsz, self.micro_num = micro_bsz, micro_num
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.rows_per_step = dp_size * micro_bsz * micro_num

    @property
    def num_rows(self) -> int:
        return self.rows.num_rows

    @property
    def tokens_per_step(self) -> int:
        """Tokens (padding included) all DP ranks consume per optimizer step."""
        return self.rows_per_step * self.rows.tokens_per_row

    @property
    def consumed_rows(self) -> int:
        return self.sampler.consumed_rows

    def next_step_rows(self) -> np.ndarray:
        """This rank's rows of the next step as [micro_num, micro_bsz]; advances the position."""
        step = self.sampler.take(self.rows_per_step)
        return step.reshape(self.micro_num, self.dp_size, self.micro_bsz)[:, self.dp_rank, :]

    def next_step_batches(self) -> list[Batch]:
        """The ``micro_num`` micro-batches of this rank for the next optimizer step."""
        return [self.rows.batch(r) for r in self.next_step_rows()]

    def __iter__(self) -> Iterator[list[Batch]]:
        while True:
            yield self.next_step_batches()

    def state_dict(self) -> dict[str, Any]:
        """The sampler position (plain ints, identical on every rank); see GlobalRowSampler."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.sampler.load_state_dict(state)


class ValidLoader:
    """A finite, repeatable set of validation micro-batches for one DP rank."""

    def __init__(self, rows: PackedRows, micro_bsz: int, max_micro_num: int, dp_rank: int, dp_size: int):
        self.rows = rows
        per_step = dp_size * micro_bsz
        n_mb = min(max_micro_num, -(-rows.num_rows // per_step))
        slots = n_mb * per_step
        if slots <= rows.num_rows:
            ids = (np.arange(slots, dtype=np.int64) * rows.num_rows) // slots
        else:
            ids = np.concatenate([np.arange(rows.num_rows), np.full(slots - rows.num_rows, -1)]).astype(np.int64)
        self.row_ids = ids.reshape(n_mb, dp_size, micro_bsz)[:, dp_rank, :]

    def __len__(self) -> int:
        return len(self.row_ids)

    def __iter__(self) -> Iterator[Batch]:
        for r in self.row_ids:
            yield self.rows.batch(r)


@dataclass
class DataBundle:
    """What the trainer gets: ``train`` (TrainLoader), ``valid`` (ValidLoader or None), ``tokenizer``
    (None for synthetic data), and ``info`` (counts for logging)."""

    train: TrainLoader
    valid: ValidLoader | None
    tokenizer: AnyTokenizer | None
    info: dict[str, Any] = field(default_factory=dict)


def _data_settings(data_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The data section checked by the config's own rules, defaults filled (tests may pass a partial dict)."""
    try:
        settings = validate_section("data", data_cfg)
        check_data(settings)
    except ConfigError as e:
        raise DataError(str(e)) from None
    return settings


def _tokenizer_id(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The parts of a tokenizer description that decide the token ids (not where it was copied from)."""
    return {k: v for k, v in meta["tokenizer"].items() if k not in ("source_path", "file")}


def build_data(
    data_cfg: Mapping[str, Any],
    *,
    vocab_size: int,
    max_seq_len: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    seed: int = 1024,
    barrier: Callable[[], None] | None = None,
    is_main: bool | None = None,
    progress: bool = False,
) -> DataBundle:
    """Build the train/valid loaders described by the ``data`` config section.

    ``vocab_size``: the model's (token ids must be below it). ``max_seq_len``: the longest sequence
    the model supports (``model.max_position_embeddings``). ``barrier``/``is_main`` (default: DP rank
    0) only matter for ``type="stdlib"`` and ``type="text"``, which tokenize their corpus on first use.
    """
    c = _data_settings(data_cfg)
    L, B, M = c["seq_len"], c["micro_bsz"], c["micro_num"]
    if L > max_seq_len:
        raise DataError(f"data.seq_len={L} is larger than the model supports: max_seq_len={max_seq_len} "
                        "(model.max_position_embeddings)")
    if not (dp_size >= 1 and 0 <= dp_rank < dp_size):
        raise DataError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
    pack_one = c["pack_sample_into_one"]
    tokenizer: AnyTokenizer | None = None
    train_streams: Sequence[TokenStream]
    valid_streams: Sequence[TokenStream] | None
    folders = _folders(c, dp_rank, is_main, barrier, progress)
    if folders is None:
        doc_len = max(2, 3 * L // 4)
        synthetic = SyntheticStream(-(-SYNTHETIC_TRAIN_ROWS * L // doc_len), doc_len, vocab_size, seed)
        train_streams = [synthetic]
        valid_streams = [SyntheticStream(-(-SYNTHETIC_VALID_ROWS * L // doc_len), doc_len, vocab_size, seed + 1)]
        byte_lengths = synthetic.byte_lengths()
        source = "synthetic"
    else:
        train_folder, valid_folder = folders
        if is_internevo_folder(train_folder):
            return _internevo_data(c, train_folder, valid_folder, vocab_size, dp_rank, dp_size, seed)
        if c["min_length"] or c["min_length_dict"]:
            raise DataError(f"data.min_length / min_length_dict filter InternEvo's tokenized folders; {train_folder} "
                            "is a tessera token folder (leave short documents out when preparing it)")
        train_shards = open_token_folder(train_folder, vocab_size)
        valid_shards = open_token_folder(valid_folder, vocab_size) if valid_folder else None
        if valid_shards and _tokenizer_id(valid_shards[0].meta) != _tokenizer_id(train_shards[0].meta):
            raise DataError(f"{valid_folder} and {train_folder} were made with different tokenizers: "
                            f"{_tokenizer_id(valid_shards[0].meta)} vs {_tokenizer_id(train_shards[0].meta)}")
        tokenizer = train_shards[0].tokenizer()
        byte_lengths = tokenizer.token_byte_lengths()
        source = train_folder
        train_streams, valid_streams = train_shards, valid_shards
    rows = PackedRows(train_streams, L, byte_lengths, pack_one)
    train = TrainLoader(rows, GlobalRowSampler(rows.num_rows, seed), B, M, dp_rank, dp_size)
    valid = _valid_loader(c, valid_streams, byte_lengths, dp_rank, dp_size)
    return _bundle(c, train, valid, tokenizer, source, int(sum(s.num_tokens for s in train_streams)))


def _folders(c: Mapping[str, Any], dp_rank: int, is_main: bool | None, barrier: Callable[[], None] | None,
             progress: bool) -> tuple[str, str | None] | None:
    """(train folder, valid folder) of ``tokens`` data, and of ``stdlib`` and ``text`` data (tokenized here into
    ``cache_folder`` when missing); None for synthetic."""
    if c["type"] == "synthetic":
        return None
    if c["type"] == "stdlib":
        folder = prepare_stdlib_corpus(c["cache_folder"], is_main=dp_rank == 0 if is_main is None else is_main,
                                       barrier=barrier, progress=progress)
        return f"{folder}/train", f"{folder}/valid"
    if c["type"] == "text":
        return text_corpus_folders(c, is_main=dp_rank == 0 if is_main is None else is_main, barrier=barrier,
                                   progress=progress)
    return c["train_folder"], c["valid_folder"]  # "tokens" (the config's rules: a train_folder is set)


def _valid_loader(c: Mapping[str, Any], streams: Sequence[TokenStream] | None, byte_lengths: np.ndarray,
                  dp_rank: int, dp_size: int) -> ValidLoader | None:
    if not streams:
        return None
    rows = PackedRows(streams, c["seq_len"], byte_lengths, c["pack_sample_into_one"], context=c["valid_context_len"])
    return ValidLoader(rows, c["valid_micro_bsz"] or c["micro_bsz"], c["valid_micro_num"], dp_rank, dp_size)


def _internevo_data(c: Mapping[str, Any], train_folder: str, valid_folder: str | None, vocab_size: int,
                    dp_rank: int, dp_size: int, seed: int) -> DataBundle:
    """InternEvo's tokenized folders: training packs as InternEvo packs them (one pack per micro-batch),
    validation rows as tessera cuts them (InternEvo's own validation pads each document to a row)."""
    def files(folder: str) -> list[InternEvoFile]:
        return open_internevo_folder(folder, c["min_length"], c["min_length_dict"], vocab_size)

    train_files = files(train_folder)
    packs = InternEvoPacks(train_files, c["seq_len"], c["micro_bsz"], c["pack_sample_into_one"])
    train = TrainLoader(packs, GlobalRowSampler(packs.num_rows, seed), 1, c["micro_num"], dp_rank, dp_size)
    if valid_folder and not is_internevo_folder(valid_folder):
        raise DataError(f"data.train_folder {train_folder} holds InternEvo data but data.valid_folder {valid_folder} "
                        "does not: give both in one format")
    valid = _valid_loader(c, files(valid_folder) if valid_folder else None, np.zeros(vocab_size, np.int64),
                          dp_rank, dp_size)
    return _bundle(c, train, valid, None, train_folder, int(sum(f.num_tokens for f in train_files)))


def _bundle(c: Mapping[str, Any], train: TrainLoader, valid: ValidLoader | None, tokenizer: AnyTokenizer | None,
            source: str, train_tokens: int) -> DataBundle:
    info = {
        "type": c["type"],
        "source": source,
        "train_rows": train.num_rows,
        "train_tokens": train_tokens,
        "valid_rows": valid.rows.num_rows if valid else 0,
        "tokens_per_step": train.tokens_per_step,
    }
    if c["type"] == "text":  # source is the token folder tokenized from these
        info["text_inputs"] = c["train_folder"]
    return DataBundle(train=train, valid=valid, tokenizer=tokenizer, info=info)
