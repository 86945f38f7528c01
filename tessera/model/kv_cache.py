"""Incremental decoding with a key/value cache.

``Transformer.forward`` recomputes the whole sequence each time, which is exact and simple but costs
O(T^2) projections to sample T tokens. With a ``KVCache`` passed to the model's own forward
(``model(ids, cache=cache)``), each layer keeps its keys and values, so a new token costs one row
of projections and one attention row. It is the same forward as training — the same module calls,
TP collectives, fp32-island casts and attention backends — run on the new positions only. Inference
only: no dropout, no activation checkpointing, one document per row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tessera.model.generation import full_vocab_logits, sample_next
from tessera.model.transformer import Transformer

__all__ = ["KVCache", "forward_with_cache", "generate_ids_cached"]


@dataclass
class KVCache:
    """Per-layer keys/values ``[B, capacity, Hkv_local, d]``; ``length`` positions are filled.

    Buffers are allocated on first use and grown by doubling, so appending is amortized O(1). One
    cache serves every layer: the model's forward carries it in its ``ForwardContext`` and each
    attention appends at its own layer index (``tessera.model.attention.KVCacheLike``); the model
    advances ``length`` after each forward.
    """

    length: int = 0
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``/``v`` ``[B, s, H, d]`` at positions ``length..length+s`` of ``layer``; return all so far."""
        s = k.shape[1]
        end = self.length + s
        if layer == len(self.keys):
            cap = max(end, 16)
            self.keys.append(k.new_empty(k.shape[0], cap, *k.shape[2:]))
            self.values.append(v.new_empty(v.shape[0], cap, *v.shape[2:]))
        elif end > self.keys[layer].shape[1]:
            cap = max(end, 2 * self.keys[layer].shape[1])
            for store in (self.keys, self.values):
                old = store[layer]
                new = old.new_empty(old.shape[0], cap, *old.shape[2:])
                new[:, : self.length] = old[:, : self.length]
                store[layer] = new
        self.keys[layer][:, self.length:end] = k
        self.values[layer][:, self.length:end] = v
        return self.keys[layer][:, :end], self.values[layer][:, :end]


@torch.no_grad()
def forward_with_cache(model: torch.nn.Module, input_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits for ``input_ids`` ``[B, s]`` continuing the sequences in ``cache`` (which is extended).

    Equals ``model(full_ids)[:, -s:]`` up to floating-point summation order. Logits are vocab-sharded
    exactly when the model's are (``parallel_output``).
    """
    if model.training:
        raise RuntimeError("forward_with_cache is for inference: call model.eval() first")
    return model(input_ids, cache=cache)


@torch.no_grad()
def generate_ids_cached(model: Transformer, prompt_ids: list[int], max_new_tokens: int, *, tp_group: Any = None,
                        device: torch.device | str = "cpu", temperature: float = 0.8, top_k: int = 0,
                        top_p: float = 1.0, seed: int = 0, max_seq_len: int | None = None,
                        vocab_size: int | None = None, stop: Callable[[list[int]], bool] | None = None
                        ) -> list[int]:
    """``tessera.model.generation.generate_ids`` with a KV cache: same arguments, same sampling stream.

    ``stop``, given the ids generated so far (the prompt excluded) after each new token, ends generation
    early when it returns True (an end-of-document id, an evaluation task's stop strings).

    Within ``max_seq_len`` it picks the same tokens as the full recomputation (greedy: exactly, barring
    float near-ties). Past ``max_seq_len`` the cache restarts from the last ``max_seq_len // 2`` tokens
    (positions beyond the trained length are never used), where the recomputation slides its window
    by one token each step instead.
    """
    if not prompt_ids:
        raise ValueError("generate_ids_cached needs at least one prompt token")
    was_training = model.training
    model.eval()
    generator = torch.Generator(device="cpu").manual_seed(seed)
    ids = list(prompt_ids)
    limit = max_seq_len or 0

    def run(new: list[int], cache: KVCache) -> torch.Tensor:
        logits = forward_with_cache(model, torch.tensor([new], dtype=torch.long, device=device), cache)[:, -1, :]
        logits = full_vocab_logits(model, logits, tp_group)
        return logits[..., :vocab_size] if vocab_size is not None else logits

    try:
        cache = KVCache()
        logits = run(ids[-limit:] if limit else ids, cache)
        for i in range(max_new_tokens):
            ids.append(int(sample_next(logits.float().cpu(), generator, temperature, top_k, top_p)[0]))
            if i == max_new_tokens - 1 or (stop is not None and stop(ids[len(prompt_ids):])):
                break
            if limit and cache.length + 1 > limit:
                cache = KVCache()
                logits = run(ids[-max(1, limit // 2):], cache)
            else:
                logits = run(ids[-1:], cache)
    finally:
        model.train(was_training)
    return ids
