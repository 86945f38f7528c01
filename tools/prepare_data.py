#!/usr/bin/env python
"""Tokenize text into tessera token folders (``OUTPUT/train``, and ``OUTPUT/valid`` when a split is asked for).

Inputs: UTF-8 text files (one document each); JSON lines, plain, gzip or zstd (.jsonl, .jsonl.gz,
.jsonl.zst: one document per line, its ``--text-column`` field); Parquet files (one per row of the
``--text-column`` column, row groups streamed); Hugging Face ``datasets`` folders written by
``save_to_disk``; or folders, searched recursively for files matching ``--pattern``. A file of any
other format (or text that is not UTF-8) is an error naming it. Examples:

    python tools/prepare_data.py --input corpus/ --output data/mycorpus --valid-fraction 0.01
    python tools/prepare_data.py --input fineweb/*.parquet --output data/fw \
        --tokenizer path/to/tokenizer.json --valid-every-nth 100
    python tools/prepare_data.py --input c4.jsonl.zst --output data/c4 --tokenizer tokenizer.model --add-bos

Tokenizers: ``byte``, a Hugging Face ``tokenizer.json``, a SentencePiece ``.model``, or a folder
holding one of them. Tokenizing runs on ``--workers`` processes (default: every core); the output is
the same bytes whatever their number.

Then train with ``data=dict(type="tokens", train_folder="data/mycorpus/train",
valid_folder="data/mycorpus/valid", ...)`` and the ``model.vocab_size`` the last lines print (the
tokenizer's ids, rounded up to a multiple of 64 so tensor parallelism can split it: 320 for bytes).
"""

from __future__ import annotations

import argparse
import os
import sys

from tessera.cli_args import fraction, off_or_int_at_least, positive_int
from tessera.data.errors import DataError
from tessera.data.prepare import prepare_corpus
from tessera.data.readers import DEFAULT_PATTERNS, input_size, iter_documents, list_input_files
from tessera.data.tokenize_pool import default_workers
from tessera.data.tokenizer import build_tokenizer
from tessera.data.vocab import vocab_advice


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, metavar="PATH",
                   help="text, .jsonl[.gz|.zst], .parquet files, save_to_disk folders, or folders of them")
    p.add_argument("--output", required=True, metavar="FOLDER",
                   help="gets a train/ sub-folder, and valid/ with --valid-fraction or --valid-every-nth")
    p.add_argument("--tokenizer", default="byte",
                   help="'byte' (default), a tokenizer.json, a SentencePiece .model, or a folder holding one")
    p.add_argument("--eod-token", default=None,
                   help="end-of-document token (default: a SentencePiece model's EOS; guessed for tokenizer.json)")
    p.add_argument("--add-bos", action="store_true", help="start each document with the SentencePiece model's BOS")
    split = p.add_mutually_exclusive_group()
    split.add_argument("--valid-fraction", type=fraction, default=0.0,
                       help="hold out this fraction in [0, 1), evenly spread")
    split.add_argument("--valid-every-nth", type=off_or_int_at_least(2), default=0,
                       help="hold out every Nth document (N >= 2; 0: none)")
    p.add_argument("--pattern", nargs="+", default=list(DEFAULT_PATTERNS),
                   help=f"file name patterns searched in folders (default: {' '.join(DEFAULT_PATTERNS)})")
    p.add_argument("--text-column", "--jsonl-key", dest="text_column", default="text",
                   help="the JSON field / Parquet or datasets column holding the text (default: text)")
    p.add_argument("--hf-split", default="train", help="the split of a DatasetDict folder (default: train)")
    p.add_argument("--workers", type=positive_int, default=default_workers(),
                   help="tokenizer processes (default: every core, here %(default)s)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        tokenizer = build_tokenizer(args.tokenizer, eod_token=args.eod_token, add_bos=args.add_bos)
        files = list_input_files(args.input, args.pattern)
        metas = prepare_corpus(
            iter_documents(files, args.text_column, hf_split=args.hf_split), args.output, tokenizer,
            valid_fraction=args.valid_fraction, valid_every_nth=args.valid_every_nth,
            created_by="tools/prepare_data.py", total_bytes=sum(map(input_size, files)), progress=not args.quiet,
            overwrite=args.overwrite, workers=args.workers,
        )
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for split in ("train", "valid"):
        m = metas.get(split)
        if m:
            print(f"{split}: {m['num_documents']} documents, {m['num_tokens']} tokens, {m['num_bytes']} bytes "
                  f"-> {os.path.join(args.output, split)}")
    if not metas.get("valid"):
        print("valid: none held out (use --valid-fraction or --valid-every-nth)")
    print(f"vocabulary: {tokenizer.vocab_size} ids; train with {vocab_advice(tokenizer.vocab_size)}")
    st = metas["stats"]
    print(f"tokenized {st['documents']} documents, {st['text_bytes'] / 1e6:.1f} MB of text in {st['seconds']:.1f} s: "
          f"{st['text_mb_per_s']:.2f} MB/s on {st['workers']} worker{'s' * (st['workers'] > 1)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
