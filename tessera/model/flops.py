"""Closed-form parameter count and training FLOPs per token, from the config alone.

``flops_per_token`` counts MODEL FLOPs of one training step per token (what MFU is defined on):
forward = 2 * (weights used in matmuls, the output head included, the embedding lookup not) plus
attention ``2 * 2 * seq_len * hidden`` per layer (scores QK^T and the weighted sum AV, over the full
seq_len x seq_len square: no causal halving by default, as in the PaLM / Megatron MFU formulas;
``causal=True`` halves it); training = 3 x forward (backward = 2 x forward). Recomputation by
activation checkpointing is not counted, and elementwise work (norms, rotary, softmax) is ignored.
"""

from __future__ import annotations

from typing import Any

from tessera.model.args import ModelArgs

__all__ = ["count_parameters", "matmul_parameters", "flops_per_token"]


def _layer_matmul_parameters(a: ModelArgs) -> int:
    q = a.num_attention_heads * a.head_dim
    kv = a.num_kv_attention_heads * a.head_dim
    attention = a.hidden_size * (q + 2 * kv) + q * a.hidden_size
    mlp = 3 * a.hidden_size * a.ffn_hidden_size
    return attention + mlp


def _layer_other_parameters(a: ModelArgs) -> int:
    q = a.num_attention_heads * a.head_dim
    kv = a.num_kv_attention_heads * a.head_dim
    norms = 2 * a.hidden_size + (2 * a.head_dim if a.qk_norm else 0)
    qkv_biases = q + 2 * kv if a.attention_qkv_bias else 0
    out_bias = a.hidden_size if a.bias else 0  # wo
    mlp_biases = 2 * a.ffn_hidden_size + a.hidden_size if a.feed_forward_bias else 0  # w1, w3, w2
    return norms + qkv_biases + out_bias + mlp_biases


def count_parameters(model_cfg: Any) -> int:
    """Number of parameters of the full (TP=1) model, counting tied embeddings once."""
    a = ModelArgs.from_config(model_cfg)
    embeddings = a.vocab_size * a.hidden_size * (1 if a.tie_word_embeddings else 2)
    per_layer = _layer_matmul_parameters(a) + _layer_other_parameters(a)
    return embeddings + a.num_layers * per_layer + a.hidden_size  # + final norm


def matmul_parameters(model_cfg: Any) -> int:
    """Weights multiplied per token: all projections plus the output head (tied or not), no embedding."""
    a = ModelArgs.from_config(model_cfg)
    return a.num_layers * _layer_matmul_parameters(a) + a.vocab_size * a.hidden_size


def flops_per_token(model_cfg: Any, seq_len: int, *, causal: bool = False) -> float:
    """Training (forward + backward) FLOPs per token at ``seq_len``; see the module docstring."""
    a = ModelArgs.from_config(model_cfg)
    attention: float = 2 * 2 * seq_len * a.num_attention_heads * a.head_dim * a.num_layers
    if causal:
        attention /= 2
    forward = 2 * matmul_parameters(a) + attention
    return 3.0 * forward
