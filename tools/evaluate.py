"""Evaluate a tessera checkpoint with lm-evaluation-harness, straight from its shards (no export step).

    python tools/evaluate.py ckpts/demo/step_2000 --tasks lambada_openai,hellaswag
    python tools/evaluate.py CKPT --tasks my_task --include-path my_tasks/ [--limit 100] [--num-fewshot 0]
    python tools/evaluate.py CKPT --tasks ... [--batch-size 16] [--dtype bf16] [--output results.json --log-samples]

Needs the ``eval`` extra (``pip install 'tessera[eval]'``: lm-eval). The checkpoint (any TP/DP layout) is
consolidated into one TP=1 model exactly as ``tools/generate.py`` loads it (fp32 optimizer masters when the
checkpoint has them), with the run's tokenizer or ``--tokenizer``, and wrapped as an lm-eval ``LM``
(``tessera.train.lm_eval_adapter``, which train.py's ``eval`` section uses on the live model too: docs/evaluation.md):

- log-likelihood (multiple choice, cloze): requests sorted by length, longest first, ``--batch-size`` rows a
  forward, right-padded (``tessera.model.scoring``); log-softmax in fp32 over the model's whole vocabulary;
- rolling log-likelihood (perplexity): the text cut into the same windows lm-eval's Hugging Face backend
  cuts (``--max-length`` tokens, the end-of-document id first), scored through the same batches;
- generation: one request at a time through the KV cache of ``tools/generate.py``
  (``tessera.model.kv_cache.generate_ids_cached``), stopping at the end-of-document id or a stop string.

The end-of-document id conditions an empty context and is the end-of-text token, as the exported Hugging
Face model's ``eos_token_id`` is, so the scores equal lm-eval's ``hf`` backend on ``tools/export_hf.py``'s
output up to floating-point summation order (tests/test_evaluate.py); a context of only whitespace, which that
backend refuses, is refused here too, naming the task (docs/evaluation.md). Hub datasets download as lm-eval
downloads them; set ``HF_DATASETS_OFFLINE=1`` and use ``--include-path`` for local tasks offline. The
results table goes to stdout, everything else to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from tessera.checkpoint import CheckpointError, load_for_inference, parse_dtype_name, tokenizer_for_checkpoint
from tessera.cli_args import nonnegative_int, positive_int, random_seed
from tessera.data.errors import DataError
from tessera.train.lm_eval_adapter import (
    EvalSetupError,
    evaluate_tasks,
    import_lm_eval,
    include_path_problem,
    model_max_length,
    task_manager,
    tessera_lm_class,
    tokenizer_problem,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a step_<N> folder, or a save folder (its newest step)")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task or group names")
    p.add_argument("--include-path", default=None, help="a folder of extra lm-eval task YAML files")
    p.add_argument("--num-fewshot", type=nonnegative_int, default=None, help="examples before each question")
    p.add_argument("--limit", type=positive_int, default=None, help="at most this many documents per task")
    p.add_argument("--batch-size", type=positive_int, default=16, help="rows per forward when scoring")
    p.add_argument("--max-length", type=positive_int, default=None,
                   help="positions per forward (default: the model's max_position_embeddings)")
    p.add_argument("--max-gen-toks", type=positive_int, default=256, help="tokens generated when a task names none")
    p.add_argument("--seed", type=random_seed, default=0, help="sampling seed (tasks that sample) and lm-eval's")
    p.add_argument("--tokenizer", default=None, help="'byte' or a tokenizer.json, instead of the run's")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="compute dtype")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--output", default=None, help="write lm-eval's results as JSON to this file")
    p.add_argument("--log-samples", action="store_true", help="include every document's requests in --output")
    p.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the shards")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    caller_threads = torch.get_num_threads()
    try:
        return _evaluate(a)
    except (EvalSetupError, CheckpointError, DataError, ValueError, KeyError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:  # main() may run inside another program (the tests): give its thread count back
        torch.set_num_threads(caller_threads)


def _evaluate(a: argparse.Namespace) -> int:
    folder_problem = include_path_problem(a.include_path, "--include-path ")
    if folder_problem:
        raise EvalSetupError(folder_problem)
    lm_eval = import_lm_eval("tools/evaluate.py")
    from lm_eval.utils import make_table

    tasks = [t for t in a.tasks.split(",") if t]  # checked before a large checkpoint is read
    manager = task_manager(tasks, a.include_path, tasks_key="--tasks", include_key="--include-path FOLDER")
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    model, meta = load_for_inference(a.checkpoint, dtype=parse_dtype_name(a.dtype), verify=not a.no_verify)
    vocab_size = int(meta["config"]["model"]["vocab_size"])
    tokenizer, where = tokenizer_for_checkpoint(meta["checkpoint_path"], meta, a.tokenizer, max_ids=vocab_size)
    if tokenizer is None:
        raise DataError(f"no tokenizer: {where}")
    too_large = tokenizer_problem(tokenizer, where, vocab_size)
    if too_large:
        raise EvalSetupError(too_large)
    max_length = a.max_length or model_max_length(meta["config"]["model"])
    print(f"checkpoint {meta['checkpoint_path']} (step {meta.get('step')}), tokenizer from {where}, "
          f"{max_length} positions, batch {a.batch_size}, generation with the KV cache", file=sys.stderr)
    lm = tessera_lm_class(lm_eval)(model, tokenizer, max_length=max_length, batch_size=a.batch_size, seed=a.seed,
                                   max_gen_toks=a.max_gen_toks)
    results = evaluate_tasks(lm_eval, lm, tasks, manager, num_fewshot=a.num_fewshot, limit=a.limit, seed=a.seed,
                             log_samples=a.log_samples)
    print(make_table(results))
    if a.output:
        with open(a.output, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2, default=str)
        print(f"results written to {a.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
