"""Load any tessera checkpoint into one process (TP=1) for inference, consolidating on the fly."""

from __future__ import annotations

from typing import Any

import torch

from tessera.checkpoint.convert import load_consolidated_state
from tessera.checkpoint.source import CheckpointSource
from tessera.model import Transformer
from tessera.model.transformer import model_from_full_state

__all__ = ["load_for_inference"]


def load_for_inference(path: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                       verify: bool = True) -> tuple[Transformer, dict[str, Any]]:
    """``(model in eval mode, meta.json)`` for checkpoint ``path`` (a step folder or a save folder).

    The model is built on the meta device (no random init: a 7B model would spend minutes drawing
    weights it then overwrites) and takes the full tensors, fp32 masters preferred, cast to ``dtype``.
    """
    with CheckpointSource(path, verify=verify) as src:
        cfg = dict(src.model_cfg)
        state = load_consolidated_state(src, dtype)
        meta = dict(src.meta, checkpoint_path=src.path)
    return model_from_full_state(cfg, state, device=device), meta
