"""Sample text from a tessera checkpoint in one process, with a KV cache.

    python tools/generate.py ckpts/demo/step_1500 --prompt "def " --max-new-tokens 200
    python tools/generate.py ckpts/demo --prompt "import " --greedy
    python tools/generate.py CKPT --temperature 0.7 --top-p 0.95 --seed 3 [--top-k 40] [--no-kv-cache]

Any TP/DP layout is consolidated on the fly into a TP=1 model (fp32 optimizer masters when the
checkpoint has them). The tokenizer is the run's (``data.type='stdlib'``: the byte tokenizer; token
folders: theirs; an imported HF checkpoint: its tokenizer.json), or ``--tokenizer byte|PATH``. Ids
the tokenizer cannot produce (the demo's model has 258 outputs, the byte tokenizer 257 ids) are never
sampled. The same seed gives the same text; ``--no-kv-cache`` recomputes the whole window per token
(slow, the reference). The text (prompt + continuation) goes to stdout, everything else to stderr.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from tessera.checkpoint import CheckpointError, load_for_inference, parse_dtype_name, tokenizer_for_checkpoint
from tessera.cli_args import (
    nonnegative_float,
    nonnegative_int,
    positive_int,
    probability,
    random_seed,
)
from tessera.data.errors import DataError
from tessera.model.generation import generate_ids
from tessera.model.kv_cache import generate_ids_cached


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a step_<N> folder, or a save folder (its newest step)")
    p.add_argument("--prompt", default="def ")
    p.add_argument("--max-new-tokens", type=positive_int, default=200)
    p.add_argument("--temperature", type=nonnegative_float, default=0.8, help="0 is greedy")
    p.add_argument("--top-k", type=nonnegative_int, default=0, help="keep the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=probability, default=1.0, help="nucleus mass in (0, 1] (1: all)")
    p.add_argument("--seed", type=random_seed, default=0)
    p.add_argument("--greedy", action="store_true", help="always the most likely token (temperature 0)")
    p.add_argument("--no-kv-cache", action="store_true", help="recompute the full window for every token")
    p.add_argument("--tokenizer", default=None, help="'byte' or a tokenizer.json, instead of the run's")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="compute dtype")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    p.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the shards")
    a = p.parse_args(argv)
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    try:
        model, meta = load_for_inference(a.checkpoint, dtype=parse_dtype_name(a.dtype), verify=not a.no_verify)
        tokenizer, where = tokenizer_for_checkpoint(meta["checkpoint_path"], meta, a.tokenizer)
        if tokenizer is None:
            raise DataError(f"no tokenizer: {where}")
    except (CheckpointError, DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    prompt_ids = tokenizer.encode(a.prompt) or [tokenizer.eod_id]  # an empty prompt starts a new document
    max_len = meta["config"]["model"].get("max_position_embeddings")
    vocab = min(tokenizer.vocab_size, model.args.vocab_size)
    print(f"checkpoint {meta['checkpoint_path']} (step {meta.get('step')}), tokenizer from {where}, "
          f"{'full recompute' if a.no_kv_cache else 'KV cache'}", file=sys.stderr)
    fn = generate_ids if a.no_kv_cache else generate_ids_cached
    t0 = time.perf_counter()
    ids = fn(model, prompt_ids, a.max_new_tokens, temperature=0.0 if a.greedy else a.temperature, top_k=a.top_k,
             top_p=a.top_p, seed=a.seed, max_seq_len=max_len, vocab_size=vocab)
    dt = time.perf_counter() - t0
    print(tokenizer.decode(ids))
    print(f"{a.max_new_tokens} tokens in {dt:.2f}s ({a.max_new_tokens / max(dt, 1e-9):.1f} tokens/s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
