"""The model's shape and options, read once from the config's ``model`` section.

``ModelArgs`` decouples the modules from the config object: ``build_model`` reads the section, the
modules take plain values. Field names are the config keys.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tessera.model.mlp import ffn_hidden_size

__all__ = ["ModelArgs"]


@dataclass
class ModelArgs:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    num_kv_attention_heads: int | None = None
    mlp_ratio: float = 8 / 3
    multiple_of: int = 256
    layer_norm_epsilon: float = 1e-5
    use_flash_attn: bool = True
    checkpoint: bool | float = False
    parallel_output: bool = True
    tie_word_embeddings: bool = False
    rope_base: float = 10000.0
    init_std: float = 0.02
    dropout: float = 0.0
    attn_dropout: float = 0.0
    bias: bool = False

    def __post_init__(self) -> None:
        if self.num_kv_attention_heads is None:
            self.num_kv_attention_heads = self.num_attention_heads

    @classmethod
    def from_config(cls, model_cfg: Any) -> "ModelArgs":
        """From the validated ``model`` section (attribute access or a mapping); other keys are ignored."""
        if isinstance(model_cfg, ModelArgs):
            return model_cfg
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if isinstance(model_cfg, Mapping):
                if f.name in model_cfg:
                    values[f.name] = model_cfg[f.name]
            elif hasattr(model_cfg, f.name):
                values[f.name] = getattr(model_cfg, f.name)
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.default is dataclasses.MISSING and f.name not in values]
        if missing:
            raise ValueError(f"model config is missing required keys: {missing}")
        return cls(**values)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def ffn_hidden_size(self) -> int:
        return ffn_hidden_size(self.hidden_size, self.mlp_ratio, self.multiple_of)

    @property
    def num_checkpoint_layers(self) -> int:
        """Layers run under activation checkpointing: all for True, none for False, else round(fraction*L)."""
        if isinstance(self.checkpoint, bool):
            return self.num_layers if self.checkpoint else 0
        return int(round(float(self.checkpoint) * self.num_layers))
