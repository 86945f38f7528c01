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

Threads: with a KV cache a decode step multiplies one token's vector by each weight, work too small to
split over threads for a small model (the threads only add synchronisation, and on a busy machine they
wait for each other's cores), so the default is one thread per ``PARAMS_PER_THREAD`` parameters, at
least one and at most the cores this process may use; ``--threads`` overrides it. The choice is logged.
"""

from __future__ import annotations

import argparse
import os
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

PARAMS_PER_THREAD = 25_000_000  # a decode step's weights per thread below which another thread costs more than it saves


def default_threads(num_params: int, cores: int) -> int:
    """Torch threads for sampling a model of ``num_params`` parameters on ``cores`` usable cores."""
    return max(1, min(cores, num_params // PARAMS_PER_THREAD))


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


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
    p.add_argument("--threads", type=positive_int, default=None,
                   help=f"torch CPU threads (default: one per {PARAMS_PER_THREAD // 10**6}M parameters, "
                        f"at least 1, at most the usable cores)")
    p.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the shards")
    a = p.parse_args(argv)
    caller_threads = torch.get_num_threads()
    try:
        return _generate(a)
    finally:  # main() may run inside another program (the tests): give its thread count back
        torch.set_num_threads(caller_threads)


def _generate(a: argparse.Namespace) -> int:
    if a.threads is not None:  # loading a large checkpoint uses them too
        torch.set_num_threads(a.threads)
    try:
        model, meta = load_for_inference(a.checkpoint, dtype=parse_dtype_name(a.dtype), verify=not a.no_verify)
        tokenizer, where = tokenizer_for_checkpoint(meta["checkpoint_path"], meta, a.tokenizer)
        if tokenizer is None:
            raise DataError(f"no tokenizer: {where}")
    except (CheckpointError, DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    num_params = sum(t.numel() for t in model.parameters())
    threads = a.threads or default_threads(num_params, usable_cores())
    torch.set_num_threads(threads)
    print(f"threads: {threads} ({'--threads' if a.threads else f'default for {num_params / 1e6:.2f}M parameters'})",
          file=sys.stderr)
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
