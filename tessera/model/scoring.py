"""Log-likelihoods of token continuations, batched by length: what evaluation harnesses ask a model.

A multiple-choice question is scored by the log-probability of each answer after the question, and a
perplexity task by the log-probability of every token of a text in windows; both reduce to
``(context ids, continuation ids) -> (sum of log p(continuation | context), is it the greedy answer)``.
Requests are sorted longest first and run ``batch_size`` rows at a time, right-padded: attention is
causal, so tokens padded after a row change none of that row's logits, and similar lengths waste little.
Inference only, one document per row (no ``cu_seqlens``), on the model's own forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from tessera.model.generation import full_vocab_logits

__all__ = ["ScoreRequest", "continuation_logprobs", "scoring_window"]

ScoreRequest = tuple[Sequence[int], Sequence[int]]  # (context ids, at least one; continuation ids, at least one)


def scoring_window(context: Sequence[int], continuation: Sequence[int], max_length: int) -> list[int]:
    """The model input that scores ``continuation``: context + continuation without its last token, keeping
    only the last ``max_length`` positions (the oldest context is dropped first, as lm-evaluation-harness does)."""
    if not context or not continuation:
        raise ValueError(f"a scored request needs a context and a continuation (got {len(context)} and "
                         f"{len(continuation)} tokens)")
    if len(continuation) > max_length:
        raise ValueError(f"a continuation of {len(continuation)} tokens does not fit the model's "
                         f"{max_length} positions")
    return [*context, *continuation][-(max_length + 1):][:-1]


@torch.no_grad()
def continuation_logprobs(model: torch.nn.Module, requests: Sequence[ScoreRequest], *, max_length: int,
                          batch_size: int, tp_group: Any = None, device: torch.device | str = "cpu",
                          pad_id: int = 0) -> list[tuple[float, bool]]:
    """``(log p(continuation | context), whether greedy decoding gives exactly the continuation)`` per request,
    in the order given. Log-softmax in fp32 over the model's whole vocabulary (its output rows)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if model.training:
        raise RuntimeError("continuation_logprobs is for inference: call model.eval() first")
    windows = [scoring_window(ctx, cont, max_length) for ctx, cont in requests]
    order = sorted(range(len(requests)), key=lambda i: -len(windows[i]))
    out: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        width = len(windows[rows[0]])  # longest first: the first row sets the batch's width
        batch = torch.full((len(rows), width), pad_id, dtype=torch.long)
        for r, i in enumerate(rows):
            batch[r, : len(windows[i])] = torch.tensor(windows[i], dtype=torch.long)
        logits = full_vocab_logits(model, model(batch.to(device)), tp_group)
        logp = F.log_softmax(logits.float(), dim=-1).cpu()
        for r, i in enumerate(rows):
            cont = torch.tensor(requests[i][1], dtype=torch.long)
            end = len(windows[i])
            rows_logp = logp[r, end - len(cont):end]
            picked = rows_logp.gather(-1, cont[:, None]).squeeze(-1)
            out[i] = (float(picked.sum()), bool((rows_logp.argmax(dim=-1) == cont).all()))
    return out
