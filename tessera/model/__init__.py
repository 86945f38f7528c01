"""The decoder: RMSNorm, rotary embeddings, grouped-KV attention, SwiGLU MLP, ``Transformer``, ``build_model``."""

from tessera.model.args import ModelArgs
from tessera.model.attention import Attention
from tessera.model.flops import count_parameters, flops_per_token, matmul_parameters
from tessera.model.mlp import FeedForward, ffn_hidden_size
from tessera.model.norm import RMSNorm
from tessera.model.rotary import apply_rotary, positions_from_cu_seqlens, rotary_cos_sin
from tessera.model.transformer import DecoderLayer, Transformer, build_model

__all__ = [
    "ModelArgs",
    "Attention",
    "FeedForward",
    "DecoderLayer",
    "RMSNorm",
    "Transformer",
    "build_model",
    "count_parameters",
    "flops_per_token",
    "matmul_parameters",
    "ffn_hidden_size",
    "apply_rotary",
    "rotary_cos_sin",
    "positions_from_cu_seqlens",
]
