"""Evaluate a tessera checkpoint with lm-evaluation-harness, straight from its shards (no export step).

    python tools/evaluate.py ckpts/demo/step_2000 --tasks lambada_openai,hellaswag
    python tools/evaluate.py CKPT --tasks my_task --include-path my_tasks/ [--limit 100] [--num-fewshot 0]
    python tools/evaluate.py CKPT --tasks ... [--batch-size 16] [--dtype bf16] [--output results.json --log-samples]

Needs the ``eval`` extra (``pip install 'tessera[eval]'``: lm-eval). The checkpoint (any TP/DP layout) is
consolidated into one TP=1 model exactly as ``tools/generate.py`` loads it (fp32 optimizer masters when the
checkpoint has them), with the run's tokenizer or ``--tokenizer``, and wrapped as an lm-eval ``LM``:

- log-likelihood (multiple choice, cloze): requests sorted by length, longest first, ``--batch-size`` rows a
  forward, right-padded (``tessera.model.scoring``); log-softmax in fp32 over the model's whole vocabulary;
- rolling log-likelihood (perplexity): the text cut into the same windows lm-eval's Hugging Face backend
  cuts (``--max-length`` tokens, the end-of-document id first), scored through the same batches;
- generation: one request at a time through the KV cache of ``tools/generate.py``
  (``tessera.model.kv_cache.generate_ids_cached``), stopping at the end-of-document id or a stop string.

The end-of-document id conditions an empty context and is the end-of-text token, as the exported Hugging
Face model's ``eos_token_id`` is, so the scores equal lm-eval's ``hf`` backend on ``tools/export_hf.py``'s
output up to floating-point summation order (tests/test_evaluate.py). Hub datasets download as lm-eval
downloads them; set ``HF_DATASETS_OFFLINE=1`` and use ``--include-path`` for local tasks offline. The
results table goes to stdout, everything else to stderr.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

import torch

from tessera.checkpoint import CheckpointError, load_for_inference, parse_dtype_name, tokenizer_for_checkpoint
from tessera.cli_args import nonnegative_int, positive_int, random_seed
from tessera.data.errors import DataError
from tessera.data.tokenizer import AnyTokenizer
from tessera.model.kv_cache import generate_ids_cached
from tessera.model.scoring import continuation_logprobs
from tessera.model.transformer import Transformer

MISSING_EXTRA = "tools/evaluate.py needs lm-evaluation-harness: pip install 'tessera[eval]' (the lm-eval package)"


class EvalSetupError(Exception):
    """A missing package or a task lm-eval cannot find: one ``error:`` line, no traceback."""


def import_lm_eval() -> Any:
    """The ``lm_eval`` module, or ``EvalSetupError`` naming the extra that installs it."""
    try:
        return importlib.import_module("lm_eval")
    except ImportError:
        raise EvalSetupError(MISSING_EXTRA) from None


def model_max_length(model_cfg: dict[str, Any]) -> int:
    """Positions the model was trained for (``max_position_embeddings``), capped by a sliding window."""
    length = int(model_cfg["max_position_embeddings"])
    window = model_cfg.get("sliding_window")
    return min(length, int(window)) if window else length


def tessera_lm_class(lm_eval: Any) -> type:
    """``TesseraLM``, an ``lm_eval.api.model.TemplateLM`` over a loaded tessera model (built once lm-eval is
    importable, so that this file imports without it)."""
    from lm_eval.api.model import TemplateLM
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    class TesseraLM(TemplateLM):
        """A TP=1 tessera model and its tokenizer, answering lm-eval's three request kinds."""

        def __init__(self, model: Transformer, tokenizer: AnyTokenizer, *, max_length: int, batch_size: int,
                     seed: int = 0, max_gen_toks: int = 256):
            super().__init__()
            self.model, self.tok = model, tokenizer
            self._max_length, self.batch_size, self.seed, self.max_gen_toks = max_length, batch_size, seed, max_gen_toks
            self.sample_vocab = min(tokenizer.vocab_size, model.args.vocab_size)  # never sample an undecodable id

        @property
        def eot_token_id(self) -> int:
            return int(self.tok.eod_id)

        @property
        def max_length(self) -> int:
            return self._max_length

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
            return list(self.tok.encode(string))

        def _loglikelihood_tokens(self, requests: Sequence[tuple[Any, list[int], list[int]]],
                                  disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
            answers = self._score([(ctx, cont) for _, ctx, cont in requests])
            for (key, _, _), answer in zip(requests, answers, strict=True):
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, answer)
            return answers

        def _score(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[tuple[float, bool]]:
            return continuation_logprobs(self.model, pairs, max_length=self.max_length, batch_size=self.batch_size,
                                         pad_id=self.eot_token_id)

        def loglikelihood_rolling(self, requests: Sequence[Any], disable_tqdm: bool = False) -> list[float]:
            """Every token of each text scored in disjoint windows of ``max_length``; all windows batched together."""
            owners: list[int] = []
            windows: list[tuple[list[int], list[int]]] = []
            for i, req in enumerate(requests):
                for window in get_rolling_token_windows(token_list=self.tok_encode(req.args[0]),
                                                        prefix_token=self.prefix_token_id,
                                                        max_seq_len=self.max_length, context_len=1):
                    windows.append(make_disjoint_window(window))
                    owners.append(i)
            totals = [0.0] * len(requests)
            for i, (logp, _) in zip(owners, self._score(windows), strict=True):
                totals[i] += logp
            for req, total in zip(requests, totals, strict=True):
                self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
            return totals

        def generate_until(self, requests: Sequence[Any], disable_tqdm: bool = False) -> list[str]:
            """Each context continued through the KV cache until the end-of-document id, a stop string or
            ``max_gen_toks`` tokens; the text before the first stop string."""
            return [self._generate_one(*req.args) for req in requests]

        def _generate_one(self, context: str, gen_kwargs: dict[str, Any]) -> str:
            kwargs = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
            until = handle_stop_sequences(kwargs.pop("until", None), eos=None)
            max_new = int(kwargs.pop("max_gen_toks"))
            if max_new >= self.max_length:
                raise ValueError(f"max_gen_toks={max_new} leaves no room for a context in {self.max_length} positions")
            prompt = self.tok_encode(context)[-(self.max_length - max_new):] or [self.eot_token_id]
            eod = self.eot_token_id

            def stop(new: list[int]) -> bool:
                return new[-1] == eod or any(s and s in self.tok.decode(new) for s in until)

            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
            ids = generate_ids_cached(self.model, prompt, max_new, temperature=temperature,
                                      top_k=int(kwargs.get("top_k") or 0), top_p=float(kwargs.get("top_p") or 1.0),
                                      seed=self.seed, max_seq_len=self.max_length, vocab_size=self.sample_vocab,
                                      stop=stop)
            new = ids[len(prompt):]
            new = new[: new.index(eod)] if eod in new else new
            text = str(postprocess_generated_text(self.tok.decode(new), until, None))
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            return text

    return TesseraLM


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
    lm_eval = import_lm_eval()
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import make_table

    manager = TaskManager(include_path=a.include_path)  # tasks checked before a large checkpoint is read
    tasks = [t for t in a.tasks.split(",") if t]
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown or not tasks:
        raise EvalSetupError(f"--tasks: lm-eval knows no task {', '.join(unknown) or '(none given)'}"
                             + ("" if a.include_path else " (a local task needs --include-path FOLDER)"))
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    model, meta = load_for_inference(a.checkpoint, dtype=parse_dtype_name(a.dtype), verify=not a.no_verify)
    tokenizer, where = tokenizer_for_checkpoint(meta["checkpoint_path"], meta, a.tokenizer)
    if tokenizer is None:
        raise DataError(f"no tokenizer: {where}")
    max_length = a.max_length or model_max_length(meta["config"]["model"])
    print(f"checkpoint {meta['checkpoint_path']} (step {meta.get('step')}), tokenizer from {where}, "
          f"{max_length} positions, batch {a.batch_size}, generation with the KV cache", file=sys.stderr)
    lm = tessera_lm_class(lm_eval)(model, tokenizer, max_length=max_length, batch_size=a.batch_size, seed=a.seed,
                                   max_gen_toks=a.max_gen_toks)
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    results = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, num_fewshot=a.num_fewshot,
                                      limit=a.limit, log_samples=a.log_samples, random_seed=a.seed,
                                      numpy_random_seed=a.seed, torch_random_seed=a.seed, fewshot_random_seed=a.seed)
    print(make_table(results))
    if a.output:
        with open(a.output, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2, default=str)
        print(f"results written to {a.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
