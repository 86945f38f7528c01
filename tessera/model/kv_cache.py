"""Incremental decoding with a key/value cache, reusing a ``Transformer``'s own submodules.

``Transformer.forward`` recomputes the whole sequence each time, which is exact and simple but costs
O(T^2) projections to sample T tokens. Here each layer's keys and values are kept, so a new token
costs one row of projections and one attention row. Rather than adding a cache argument to the
training forward (and risking its behaviour), this module walks the same modules in the same order
— embedding, per layer ``attention_norm`` -> ``wq/wk/wv`` -> rotary -> attention -> ``wo`` ->
residual -> ``ffn_norm`` -> ``feed_forward`` -> residual, then ``norm`` and ``output`` — so every weight,
TP collective (the column/row-parallel layers communicate themselves) and dtype behaviour is the
model's. Inference only: no dropout, no activation checkpointing, one document per row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from tessera.model.generation import full_vocab_logits, sample_next
from tessera.model.rotary import apply_rotary, rotary_cos_sin
from tessera.model.transformer import Transformer

__all__ = ["KVCache", "forward_with_cache", "generate_ids_cached"]


@dataclass
class KVCache:
    """Per-layer keys/values ``[B, capacity, Hkv_local, d]``; ``length`` positions are filled.

    Buffers are allocated on first use and grown by doubling, so appending is amortized O(1).
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


def _attend_cached(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int) -> torch.Tensor:
    """q ``[B, s, Hq, d]`` at positions ``past..past+s`` over k/v ``[B, past+s, Hkv, d]``, causally."""
    s, total = q.shape[1], k.shape[1]
    mask = None
    causal = False
    if s > 1:
        if past == 0:
            causal = True
        else:  # query i (absolute past+i) sees keys 0..past+i
            qpos = torch.arange(past, past + s, device=q.device).unsqueeze(1)
            mask = torch.arange(total, device=q.device).unsqueeze(0) <= qpos
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=causal,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


@torch.no_grad()
def forward_with_cache(model: Transformer, input_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits for ``input_ids`` ``[B, s]`` continuing the sequences in ``cache`` (which is extended).

    Equals ``model(full_ids)[:, -s:]`` up to floating-point summation order. Logits are vocab-sharded
    exactly when the model's are (``parallel_output``).
    """
    if model.training:
        raise RuntimeError("forward_with_cache is for inference: call model.eval() first")
    b, s = input_ids.shape
    past = cache.length
    h = model.embedding(input_ids)
    positions = torch.arange(past, past + s, device=h.device).expand(b, s)
    cos, sin = rotary_cos_sin(positions, model.args.head_dim, model.args.rope_base)
    for i, layer in enumerate(model.layers):
        attn = layer.attention
        x = layer.attention_norm(h)
        q = attn.wq(x).view(b, s, attn.num_heads_per_rank, attn.head_dim)
        k = attn.wk(x).view(b, s, attn.num_kv_heads_per_rank, attn.head_dim)
        v = attn.wv(x).view(b, s, attn.num_kv_heads_per_rank, attn.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k_all, v_all = cache.append(i, k, v)
        out = _attend_cached(q, k_all, v_all, past)
        h = h + attn.wo(out.reshape(b, s, attn.num_heads_per_rank * attn.head_dim))
        h = h + layer.feed_forward(layer.ffn_norm(h))
    cache.length = past + s
    return model.output(model.norm(h))


@torch.no_grad()
def generate_ids_cached(model: Transformer, prompt_ids: list[int], max_new_tokens: int, *, tp_group: Any = None,
                        device: torch.device | str = "cpu", temperature: float = 0.8, top_k: int = 0,
                        top_p: float = 1.0, seed: int = 0, max_seq_len: int | None = None,
                        vocab_size: int | None = None) -> list[int]:
    """``tessera.model.generation.generate_ids`` with a KV cache: same arguments, same sampling stream.

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
            if i == max_new_tokens - 1:
                break
            if limit and cache.length + 1 > limit:
                cache = KVCache()
                logits = run(ids[-max(1, limit // 2):], cache)
            else:
                logits = run(ids[-1:], cache)
    finally:
        model.train(was_training)
    return ids
