"""lm-evaluation-harness over a TP=1 tessera model: the ``LM`` class, the task check and one evaluation.

Shared by ``tools/evaluate.py`` (a checkpoint's consolidated model) and train.py's ``eval`` section
(``tessera.train.live_eval``: the live run's model, consolidated on rank 0), so both score alike. lm-eval is
the ``eval`` extra: it is imported only when asked for (``import_lm_eval``), and this module imports without it.

``TesseraLM`` (``tessera_lm_class``) answers lm-eval's three request kinds:

- log-likelihood (multiple choice, cloze): requests sorted by length, longest first, ``batch_size`` rows a
  forward, right-padded (``tessera.model.scoring``); log-softmax in fp32 over the model's whole vocabulary;
- rolling log-likelihood (perplexity): the text cut into the same windows lm-eval's Hugging Face backend
  cuts (``max_length`` tokens, the end-of-document id first), scored through the same batches;
- generation: one request at a time through the KV cache (``tessera.model.kv_cache.generate_ids_cached``),
  stopping at the end-of-document id or a stop string.

The end-of-document id conditions an empty context and is the end-of-text token, as the exported Hugging
Face model's ``eos_token_id`` is (tests/test_evaluate.py checks the scores against lm-eval's ``hf`` backend). A
context of only whitespace reaches the model empty (lm-eval moves trailing whitespace into the continuation) and
is refused, naming the task, as that backend refuses it (``unconditioned_request``, docs/evaluation.md).
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tessera.data.tokenizer import AnyTokenizer
from tessera.model.kv_cache import generate_ids_cached
from tessera.model.scoring import continuation_logprobs
from tessera.model.transformer import Transformer

__all__ = ["EvalSetupError", "import_lm_eval", "include_path_problem", "model_max_length", "task_manager",
           "tessera_lm_class", "tokenizer_problem", "unconditioned_request", "generate_text", "evaluate_tasks",
           "scores_of"]

EXTRA = "pip install 'tessera[eval]' (the lm-eval package)"


class EvalSetupError(Exception):
    """A missing package or a task lm-eval cannot find: one ``error:`` line, no traceback. ``every_rank``: every
    rank of a launched job raises it together (after an agreement), so each reports before any exits."""

    def __init__(self, message: str, every_rank: bool = False) -> None:
        super().__init__(message)
        self.every_rank = every_rank


def import_lm_eval(who: str) -> Any:
    """The ``lm_eval`` module, or ``EvalSetupError`` saying that ``who`` needs the extra that installs it."""
    try:
        return importlib.import_module("lm_eval")
    except ImportError:
        raise EvalSetupError(f"{who} needs lm-evaluation-harness: {EXTRA}") from None


def model_max_length(model_cfg: Mapping[str, Any]) -> int:
    """Positions the model was trained for (``max_position_embeddings``), capped by a sliding window."""
    length = int(model_cfg["max_position_embeddings"])
    window = model_cfg.get("sliding_window")
    return min(length, int(window)) if window else length


def include_path_problem(include_path: str | None, include_key: str) -> str | None:
    """Why the folder of local tasks cannot be used, naming it as the caller's user gave it (``include_key``:
    ``--include-path `` or ``eval.include_path=``), or None. lm-eval itself skips a missing folder without a
    word and then reports only that it knows no such task."""
    if include_path and not os.path.isdir(include_path):
        return f"{include_key}{include_path}: not a folder"
    return None


def tokenizer_problem(tokenizer: AnyTokenizer, where: str, vocab_size: int) -> str | None:
    """Why the model cannot be evaluated with ``tokenizer`` (from ``where``), or None: every id, the
    end-of-document id that pads and conditions an empty context included, must have a row of the embedding."""
    if tokenizer.vocab_size > vocab_size:
        return f"the tokenizer ({where}) has {tokenizer.vocab_size} ids, more than model.vocab_size={vocab_size} embeds"
    return None


def task_manager(tasks: Sequence[str], include_path: str | None, *, tasks_key: str, include_key: str) -> Any:
    """An ``lm_eval.tasks.TaskManager`` that knows every name of ``tasks`` (lm-eval imported), else
    ``EvalSetupError`` naming the unknown ones under ``tasks_key`` (and ``include_key`` when no folder of local
    tasks was given). When every name is a task of ``include_path`` itself, lm-eval's own few thousand task
    files are not indexed (seconds of a launch); the tasks are the same ones either way."""
    from lm_eval.tasks import TaskManager

    if include_path and tasks:
        local = TaskManager(include_path=include_path, include_defaults=False)
        groups = set(local.all_groups) | set(local.all_tags)
        if all(t in local.all_tasks and t not in groups for t in tasks):
            return local
    manager = TaskManager(include_path=include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown or not tasks:
        raise EvalSetupError(f"{tasks_key}: lm-eval knows no task {', '.join(unknown) or '(none given)'}"
                             + ("" if include_path else f" (a local task needs {include_key})"))
    return manager


def tessera_lm_class(lm_eval: Any) -> type:
    """``TesseraLM``, an ``lm_eval.api.model.TemplateLM`` over a TP=1 tessera model (built once lm-eval is
    importable, so that this module imports without it). Its forwards run on the model's device."""
    from lm_eval.api.model import TemplateLM
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    class TesseraLM(TemplateLM):
        """A TP=1 tessera model and its tokenizer, answering lm-eval's three request kinds."""

        def __init__(self, model: Transformer, tokenizer: AnyTokenizer, *, max_length: int, batch_size: int,
                     seed: int = 0, max_gen_toks: int = 256):
            super().__init__()
            self.model, self.tok = model, tokenizer
            self._max_length, self.batch_size, self.seed, self.max_gen_toks = max_length, batch_size, seed, max_gen_toks
            self.sample_vocab = min(tokenizer.vocab_size, model.args.vocab_size)  # never sample an undecodable id
            self.on = next(model.parameters()).device

        @property
        def eot_token_id(self) -> int:
            return int(self.tok.eod_id)

        @property
        def max_length(self) -> int:
            return self._max_length

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
            return list(self.tok.encode(string))

        def loglikelihood(self, requests: Sequence[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
            """lm-eval's own (an empty context conditioned on the end-of-document id), after refusing, with the
            task's name, the requests its ``hf`` backend refuses too (``unconditioned_request``)."""
            for req in requests:
                problem = unconditioned_request(self, req.args[0])
                if problem:
                    raise ValueError(f"task {req.task_name}, document {req.doc_id}: {problem}")
            answers: list[tuple[float, bool]] = super().loglikelihood(requests, disable_tqdm=disable_tqdm)
            return answers

        def _loglikelihood_tokens(self, requests: Sequence[tuple[Any, list[int], list[int]]],
                                  disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
            answers = self._score([(ctx, cont) for _, ctx, cont in requests])
            for (key, _, _), answer in zip(requests, answers, strict=True):
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, answer)
            return answers

        def _score(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[tuple[float, bool]]:
            return continuation_logprobs(self.model, pairs, max_length=self.max_length, batch_size=self.batch_size,
                                         pad_id=self.eot_token_id, device=self.on)

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
            text = generate_text(self, context, gen_kwargs)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            return text

    return TesseraLM


def unconditioned_request(lm: Any, context: str) -> str | None:
    """Why a log-likelihood request with this ``context`` has nothing to condition on, or None.

    lm-eval moves a context's trailing whitespace into the continuation, so a context of only whitespace
    reaches the model as an empty one; only a context that is empty from the start gets the end-of-document
    id in its place. lm-eval's ``hf`` backend refuses the first kind (an assertion in 0.4.13), so it is
    refused here too, as one line, rather than scored in a way no reference backend scores it."""
    stripped = context.rstrip()
    if not context or lm.tok_encode(stripped):
        return None
    return (f"a context of only whitespace ({context!r}) leaves no token to condition on once lm-eval moves its "
            "trailing whitespace into the continuation (lm-eval's hf backend refuses it too); make the task's "
            "doc_to_text give an empty context (scored after the end-of-document id) or put the whitespace in "
            "its target_delimiter")


def generate_text(lm: Any, context: str, gen_kwargs: dict[str, Any]) -> str:
    """``TesseraLM``'s answer to one ``generate_until`` request: ``context`` continued through the KV cache until
    the end-of-document id, a stop string or ``max_gen_toks`` tokens (greedy unless the task samples); the text
    before the first stop string."""
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

    kwargs = dict(normalize_gen_kwargs(gen_kwargs, lm.max_gen_toks))
    until = handle_stop_sequences(kwargs.pop("until", None), eos=None)
    max_new = int(kwargs.pop("max_gen_toks"))
    if max_new >= lm.max_length:
        raise ValueError(f"max_gen_toks={max_new} leaves no room for a context in {lm.max_length} positions")
    prompt = lm.tok_encode(context)[-(lm.max_length - max_new):] or [lm.eot_token_id]
    eod = lm.eot_token_id

    def stop(new: list[int]) -> bool:
        return new[-1] == eod or any(s and s in lm.tok.decode(new) for s in until)

    temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
    ids = generate_ids_cached(lm.model, prompt, max_new, temperature=temperature,
                              top_k=int(kwargs.get("top_k") or 0), top_p=float(kwargs.get("top_p") or 1.0),
                              seed=lm.seed, max_seq_len=lm.max_length, vocab_size=lm.sample_vocab, stop=stop,
                              device=lm.on)
    new = ids[len(prompt):]
    new = new[: new.index(eod)] if eod in new else new
    return str(postprocess_generated_text(lm.tok.decode(new), until, None))


def evaluate_tasks(lm_eval: Any, lm: Any, tasks: Sequence[str], manager: Any, *, num_fewshot: int | None,
                   limit: int | None, seed: int, log_samples: bool = False) -> dict[str, Any]:
    """lm-eval's ``simple_evaluate`` of ``lm`` on ``tasks``, every seed of it ``seed`` (Python, NumPy and torch's
    global generators are reseeded: a caller that trains on keeps its own states). Its log at warnings only."""
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    results = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, num_fewshot=num_fewshot,
                                      limit=limit, log_samples=log_samples, random_seed=seed, numpy_random_seed=seed,
                                      torch_random_seed=seed, fewshot_random_seed=seed)
    if results is None:  # only the non-zero ranks of a distributed lm-eval get None; a TesseraLM is one rank
        raise RuntimeError("lm-eval returned no results")
    return dict(results)


def scores_of(results: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """``{task: {metric: value}}``: the numbers of lm-eval's ``results`` section (tasks and groups). A metric
    ``name,filter`` is ``name`` under the ``none`` filter, else ``name/filter``; text (an alias, "N/A") is left
    out."""
    out: dict[str, dict[str, float]] = {}
    for task, metrics in results.get("results", {}).items():
        row: dict[str, float] = {}
        for key, value in metrics.items():
            if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)):
                continue
            name, _, filt = str(key).partition(",")
            row[name if filt in ("", "none") else f"{name}/{filt}"] = float(value)
        out[str(task)] = row
    return out
