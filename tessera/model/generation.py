"""Sampling from a (tensor-parallel) decoder: temperature, top-k, top-p.

Every TP rank runs the forward pass (the layers communicate) and gathers the vocab-sharded logits;
the sampling generator is seeded identically everywhere, so all ranks pick the same next token
without a broadcast.
"""

from __future__ import annotations

from typing import Any

import torch

from tessera.model.transformer import logits_are_vocab_sharded
from tessera.parallel.comm import gather_tensor


def sample_next(logits: torch.Tensor, generator: torch.Generator, temperature: float = 1.0, top_k: int = 0,
                top_p: float = 1.0) -> torch.Tensor:
    """Next token ids ``[B]`` from full-vocabulary logits ``[B, V]``; temperature 0 is greedy."""
    logits = logits.float()
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens ranked above it already cover top_p of the mass
        drop = probs.cumsum(dim=-1) - probs > top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def full_vocab_logits(model: torch.nn.Module, logits: torch.Tensor, tp_group: Any) -> torch.Tensor:
    """Gather vocab-sharded logits over ``tp_group``; logits of a ``parallel_output=False`` model are whole."""
    return gather_tensor(logits.contiguous(), -1, tp_group) if logits_are_vocab_sharded(model) else logits


@torch.no_grad()
def generate_ids(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int, *, tp_group: Any = None,
                 device: torch.device | str = "cpu", temperature: float = 0.8, top_k: int = 0, top_p: float = 1.0,
                 seed: int = 0, max_seq_len: int | None = None, vocab_size: int | None = None) -> list[int]:
    """Autoregressive sampling by full recomputation (simple and exact; see tools/generate.py for a KV cache)."""
    was_training = model.training
    model.eval()
    generator = torch.Generator(device="cpu").manual_seed(seed)
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        window = ids[-max_seq_len:] if max_seq_len else ids
        x = torch.tensor([window], dtype=torch.long, device=device)
        logits = model(x)[:, -1, :]
        logits = full_vocab_logits(model, logits, tp_group)
        if vocab_size is not None:
            logits = logits[..., :vocab_size]
        ids.append(int(sample_next(logits.cpu(), generator, temperature, top_k, top_p)[0]))
    model.train(was_training)
    return ids
