#!/usr/bin/env python
"""Tokenize text into tessera token folders (``OUTPUT/train`` and ``OUTPUT/valid``).

Inputs are text files (one document each), .jsonl files (one document per line, its ``text`` field)
or folders, searched recursively for files matching ``--pattern``. Examples:

    python tools/prepare_data.py --input corpus/ --output data/mycorpus --valid-fraction 0.01
    python tools/prepare_data.py --input a.jsonl b.jsonl --output data/hf \
        --tokenizer path/to/tokenizer.json --valid-every-nth 100

Then train with ``data=dict(type="tokens", train_folder="data/mycorpus/train",
valid_folder="data/mycorpus/valid", ...)``.
"""

from __future__ import annotations

import argparse
import os
import sys

from tessera.cli_args import fraction, off_or_int_at_least
from tessera.data.errors import DataError
from tessera.data.prepare import DEFAULT_PATTERNS, iter_documents, list_input_files, prepare_corpus
from tessera.data.tokenizer import build_tokenizer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, metavar="PATH", help="text/.jsonl files or folders")
    p.add_argument("--output", required=True, metavar="FOLDER", help="gets train/ and valid/ sub-folders")
    p.add_argument("--tokenizer", default="byte", help="'byte' (default) or a path to a tokenizer.json")
    p.add_argument("--eod-token", default=None, help="end-of-document token of an HF tokenizer (default: guessed)")
    split = p.add_mutually_exclusive_group()
    split.add_argument("--valid-fraction", type=fraction, default=0.0,
                       help="hold out this fraction in [0, 1), evenly spread")
    split.add_argument("--valid-every-nth", type=off_or_int_at_least(2), default=0,
                       help="hold out every Nth document (N >= 2; 0: none)")
    p.add_argument("--pattern", nargs="+", default=list(DEFAULT_PATTERNS),
                   help=f"file name patterns searched in folders (default: {' '.join(DEFAULT_PATTERNS)})")
    p.add_argument("--jsonl-key", default="text", help="field holding the text in .jsonl lines")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        tokenizer = build_tokenizer(args.tokenizer, eod_token=args.eod_token)
        files = list_input_files(args.input, args.pattern)
        total = None if any(f.endswith(".jsonl") for f in files) else len(files)
        metas = prepare_corpus(
            iter_documents(files, args.jsonl_key), args.output, tokenizer,
            valid_fraction=args.valid_fraction, valid_every_nth=args.valid_every_nth,
            created_by="tools/prepare_data.py", total=total, progress=not args.quiet, overwrite=args.overwrite,
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
