"""Which parameters HybridZeroOptimizer manages, and the names their state is saved under.

Frozen parameters (``requires_grad=False``) are left alone: no buffers, no update, no state. Names
come from the caller (the unwrapped model, a mapping or pairs), so the optimizer needs no knowledge
of wrappers: checkpoints key the state by the model's own parameter names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["LOW_PRECISION", "ParamNames", "build_param_groups", "trainable_params", "param_name_map"]

LOW_PRECISION = (torch.float16, torch.bfloat16)

# a module (its named_parameters()), {Parameter: name} / {name: Parameter}, or (name, Parameter) pairs
ParamNames = nn.Module | Mapping[Any, Any] | Iterable[tuple[str, torch.Tensor]] | None


def trainable_params(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    """The trainable parameters of every param group, in order; each once, fp32/fp16/bf16, dense, one device."""
    params: list[nn.Parameter] = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if not params:
        raise ValueError("HybridZeroOptimizer: the optimizer has no trainable parameters")
    if len({id(p) for p in params}) != len(params):
        raise ValueError("HybridZeroOptimizer: a parameter appears in more than one param group")
    for p in params:
        if p.dtype not in (torch.float32, *LOW_PRECISION):
            raise TypeError(f"HybridZeroOptimizer: parameter of dtype {p.dtype}; expected fp32, fp16 or bf16")
        if p.is_sparse:
            raise TypeError("HybridZeroOptimizer: sparse parameters are not supported")
    if any(p.device != params[0].device for p in params):
        raise ValueError("HybridZeroOptimizer: all parameters must be on one device "
                         "(move the model before building the optimizer)")
    return params


def param_name_map(param_names: ParamNames, params: list[nn.Parameter]) -> dict[int, str]:
    """id(param) -> name from a Module, a {Parameter: name} mapping or (name, Parameter) pairs.

    A module's own ``named_parameters()`` are used as they are: pass the unwrapped model (a wrapper
    would add its prefix to every name)."""
    if param_names is None:
        return {id(p): f"param_{i}" for i, p in enumerate(params)}
    pairs: list[tuple[Any, Any]]  # checked below
    if isinstance(param_names, nn.Module):
        pairs = list(param_names.named_parameters())
    elif isinstance(param_names, Mapping):
        items = list(param_names.items())
        pairs = [(v, k) if isinstance(k, torch.Tensor) else (k, v) for k, v in items]
    else:
        pairs = list(param_names)
    out: dict[int, str] = {}
    for name, p in pairs:
        if not isinstance(name, str) or not isinstance(p, torch.Tensor):
            raise TypeError("param_names: expected a Module, {Parameter: name} or (name, Parameter) pairs")
        out[id(p)] = name
    missing = [i for i, p in enumerate(params) if id(p) not in out]
    if missing:
        raise ValueError(
            f"param_names: {len(missing)} optimized parameter(s) have no name (e.g. index {missing[0]} with "
            f"shape {tuple(params[missing[0]].shape)}); pass the unwrapped model's named_parameters()"
        )
    names = [out[id(p)] for p in params]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"param_names: duplicate names {dup[:5]}")
    return out


def build_param_groups(
    model: nn.Module, weight_decay: float, decay_norm_and_bias: bool = False
) -> list[dict[str, Any]]:
    """Two AdamW groups: decayed weights and (unless ``decay_norm_and_bias``) undecayed norms/biases.

    Norms are recognized by 1-D parameters or an owning module class containing "Norm"; biases by
    1-D shape or a name ending in "bias". Empty groups are left out. A wrapper (NaiveAMPModel) may be
    passed: its own modules hold no parameters.
    """
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    seen: set[int] = set()
    for _, module in model.named_modules():
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
