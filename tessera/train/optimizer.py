"""The optimizer of a training run, built from the config: AdamW param groups wrapped in a HybridZeroOptimizer.

The optimizer itself lives in ``tessera.optim``; this is the training stack's side of it (it knows the
NaiveAMPModel wrapper, the optimizer does not).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from tessera.optim.hybrid_zero import HybridZeroOptimizer
from tessera.train.naive_amp import unwrap_model

__all__ = ["build_param_groups", "build_optimizer"]


def build_param_groups(
    model: nn.Module, weight_decay: float, decay_norm_and_bias: bool = False
) -> list[dict[str, Any]]:
    """Two AdamW groups: decayed weights and (unless ``decay_norm_and_bias``) undecayed norms/biases.

    Norms are recognized by 1-D parameters or an owning module class containing "Norm"; biases by
    1-D shape or a name ending in "bias". Empty groups are left out.
    """
    model = unwrap_model(model)
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    seen: set[int] = set()
    for mod_name, module in model.named_modules():
        is_norm = "norm" in type(module).__name__.lower()
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            skip = is_norm or p.dim() <= 1 or name.endswith("bias")
            (no_decay if skip and not decay_norm_and_bias else decay).append(p)
    groups = []
    if decay:
        groups.append({"params": decay, "weight_decay": float(weight_decay), "name": "decay"})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0, "name": "no_decay"})
    return groups


def build_optimizer(model: nn.Module, cfg: Mapping[str, Any], **groups: Any) -> HybridZeroOptimizer:
    """AdamW from the config's ``adam`` section wrapped in a HybridZeroOptimizer.

    ``model`` is the NaiveAMPModel (already cast); the optimizer's state is keyed by the unwrapped
    model's parameter names. ``groups``: tp_group, dp_group, zero1_group, global_group (default: gpc's).
    """
    adam = cfg["adam"]
    param_groups = build_param_groups(model, adam["weight_decay"], adam.get("decay_norm_and_bias", False))
    inner = torch.optim.AdamW(
        param_groups, lr=adam["lr"], betas=(adam["adam_beta1"], adam["adam_beta2"]), eps=adam["adam_eps"],
        weight_decay=adam["weight_decay"],
    )
    return HybridZeroOptimizer(
        inner, grad_scal_cfg=cfg.get("grad_scaler"), zero_cfg=cfg.get("hybrid_zero_optimizer"),
        dtype=cfg["model"]["dtype"], param_names=unwrap_model(model), seed=int(cfg.get("seed") or 0), **groups,
    )
