"""tessera.model.scoring: continuation log-likelihoods batched by length against one request at a time.

The reference scores each request alone, unpadded, from the model's full-sequence logits and torch's
log_softmax, so batching, right padding, sorting, left truncation and the greedy flag are what is checked.
Both sides are the same fp32 forward on rows of different widths (another GEMM blocking), so a log-prob
sum over k tokens differs by at most 2 * k * order_rtol(fp32, n, depth) * max|logit| (tests/tolerances.py).
"""

from __future__ import annotations

import pytest
import torch

from tessera.model import build_model
from tessera.model.scoring import continuation_logprobs, scoring_window
from tests.tolerances import order_rtol, transformer_depth

CFG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_kv_attention_heads=2, vocab_size=50,
           mlp_ratio=2.0, multiple_of=16, dtype="torch.float32", max_position_embeddings=16)


def test_batched_scores_equal_each_request_scored_alone():
    model = build_model(CFG, seed=0).eval()
    gen = torch.Generator().manual_seed(0)
    lengths = [(3, 2), (10, 5), (1, 1), (14, 4), (6, 3), (20, 2)]  # the last two exceed 16 positions: truncated
    requests = [(torch.randint(0, 50, (c,), generator=gen).tolist(), torch.randint(0, 50, (k,), generator=gen).tolist())
                for c, k in lengths]
    greedy_ctx = requests[1][0]
    with torch.no_grad():
        full = model(torch.tensor([greedy_ctx]))[0]
        cont = [int(full[-1].argmax())]
    requests.append((greedy_ctx, cont))  # a one-token continuation the model picks greedily
    got = continuation_logprobs(model, requests, max_length=16, batch_size=3)
    max_logit, want = 0.0, []
    with torch.no_grad():
        for ctx, cont in requests:
            window = ([*ctx, *cont])[-17:][:-1]
            logits = model(torch.tensor([window]))[0]
            max_logit = max(max_logit, logits.abs().max().item())
            logp = torch.log_softmax(logits[-len(cont):], dim=-1)
            target = torch.tensor(cont)
            want.append((logp.gather(-1, target[:, None]).sum().item(), bool((logp.argmax(-1) == target).all())))
    atol = order_rtol(torch.float32, 50, transformer_depth(2)) * max_logit
    for (lp, greedy), (lp_ref, greedy_ref), (_, cont) in zip(got, want, requests, strict=True):
        assert abs(lp - lp_ref) <= 2 * len(cont) * atol, (lp, lp_ref)
        assert greedy == greedy_ref
    assert got[-1][1] and not all(g for _, g in got)


def test_requests_that_cannot_be_scored_are_refused_naming_the_sizes():
    with pytest.raises(ValueError, match="a context and a continuation"):
        scoring_window([], [1], 8)
    with pytest.raises(ValueError, match="continuation of 9 tokens does not fit the model's 8 positions"):
        scoring_window([1], list(range(9)), 8)
