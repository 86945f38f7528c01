"""Export a tessera checkpoint (any TP/DP layout) to a Hugging Face model folder.

    python tools/export_hf.py ckpts/demo/step_1500 hf_demo [--dtype fp32|bf16|fp16]

Writes ``config.json``, ``model.safetensors``, ``generation_config.json`` and, when the
run had a tokenizer, ``tokenizer.json`` + ``tokenizer_config.json``, so that
``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` and ``AutoTokenizer.from_pretrained(OUT)`` load
it. The family is the one the checkpoint was imported from when it can describe the model, else the
first of Llama, Mistral (a sliding window), Qwen2 (q/k/v-only biases), Qwen3 (q/k norms) that can
(``tessera.checkpoint.hf_config``). Weights come from the fp32 optimizer masters when the checkpoint has
them (exact), else from the model shards, one full tensor at a time. ``--dtype`` defaults to the run's
training dtype.

Tokenizer: the byte tokenizer (``data.type='stdlib'`` or byte token folders) is written as an
equivalent byte-level ``tokenizer.json`` (ids 0..255 = bytes, 256 = ``<|endoftext|>``); a run on HF
token folders copies their ``tokenizer.json``; synthetic data has none (``--tokenizer`` overrides).
The exported vocabulary is the model's (e.g. 258 for the demo: one row more than the tokenizer's 257
ids, which transformers accepts), or the HF size recorded by ``tools/import_hf.py``, or ``--vocab-size``.
"""

from __future__ import annotations

import argparse
import json
import sys

from tessera.checkpoint import CheckpointError, export_hf
from tessera.cli_args import positive_int
from tessera.data.errors import DataError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a step_<N> folder, or a save folder (its newest step is used)")
    p.add_argument("out", help="output folder (created)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None, help="default: the run's dtype")
    p.add_argument("--vocab-size", type=positive_int, default=None, help="keep only the first N embedding/head rows")
    p.add_argument("--tokenizer", default=None,
                   help="'byte', a tokenizer.json, or 'none' (no tokenizer files), instead of the run's")
    p.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the shards")
    p.add_argument("--overwrite", action="store_true", help="replace config.json/model.safetensors in OUT")
    a = p.parse_args(argv)
    try:
        summary = export_hf(a.checkpoint, a.out, dtype=a.dtype, vocab_size=a.vocab_size, tokenizer=a.tokenizer,
                            verify=not a.no_verify, overwrite=a.overwrite)
    except (CheckpointError, DataError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
