"""HybridZeroOptimizer's state dict: layout-independent on save, resliced for this rank on load.

Saved: full TP-local tensors keyed by parameter name (masters and Adam moments gathered over ZERO1),
so a checkpoint loads into any DP / ZeRO size; the checkpoint package reshards TP on top of that.
``self`` below is the HybridZeroOptimizer (these are its ``state_dict`` / ``load_state_dict``).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from tessera.parallel.attrs import partition_dim

__all__ = ["STATE_DICT_FORMAT", "optimizer_state_dict", "load_optimizer_state_dict"]

STATE_DICT_FORMAT = "tessera.hybrid_zero_optimizer/1"


def optimizer_state_dict(self: Any) -> dict[str, Any]:
    """Layout-independent state: full TP-local tensors keyed by parameter name.

    A collective over the ZERO1 group (every rank must call it). Layout::

        {"format": STATE_DICT_FORMAT, "dtype": "bfloat16", "zero1_size": d,
         "scaler": {...}, "skipped_steps": int, "num_steps": int,
         "param_groups": [{<hyperparameters>, "params": [names]}, ...],   # inner groups
         "master": {name: fp32 tensor, parameter shape},
         "state": {name: {"exp_avg": tensor (param shape), "exp_avg_sq": ..., "step": 0-dim}},
         "partition_dim": {name: int | None}}                               # TP tags
    """
    master: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, Any]] = {}
    groups = []
    for b, group in zip(self._buckets, self.optim.param_groups):
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(b.names)})
        full = b.param_flat.float() if b.own_masters else self._zero1.gather_full(b.master)
        for name, t in zip(b.names, b.split(full)):
            master[name] = t
        inner = self.optim.state.get(b.master, {})
        per_param: list[dict[str, Any]] = [{} for _ in b.params]
        for key, value in inner.items():
            if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == b.shard:
                for d, t in zip(per_param, b.split(self._zero1.gather_full(value))):
                    d[key] = t
            else:
                for d in per_param:
                    d[key] = value.detach().clone() if isinstance(value, torch.Tensor) else value
        if inner:
            state.update(zip(b.names, per_param))
    return {
        "format": STATE_DICT_FORMAT,
        "dtype": self.precision.name,
        "zero1_size": self._zero1.size,
        "scaler": self.scaler.state_dict(),
        "skipped_steps": self.skipped_steps,
        "num_steps": self.num_steps,
        "param_groups": groups,
        "master": master,
        "state": state,
        "partition_dim": {n: partition_dim(p) for b in self._buckets for n, p in zip(b.names, b.params)},
    }

@torch.no_grad()
def load_optimizer_state_dict(self: Any, state_dict: Mapping[str, Any]) -> None:
    """Load a ``state_dict()`` saved under any DP/ZeRO layout with the same TP-local shapes.

    Sets the masters, the optimizer state (sliced for this ZERO1 rank), the scaler, the counters,
    the inner groups' hyperparameters, and the parameters themselves (= masters in the model dtype).
    """
    if state_dict.get("format") != STATE_DICT_FORMAT:
        raise ValueError(f"not a HybridZeroOptimizer state dict (format {state_dict.get('format')!r}, "
                         f"expected {STATE_DICT_FORMAT!r})")
    masters, states = state_dict["master"], state_dict["state"]
    saved_groups = {n: g for g in state_dict.get("param_groups", []) for n in g["params"]}
    for b, group in zip(self._buckets, self.optim.param_groups):
        missing = [n for n in b.names if n not in masters]
        if missing:
            raise KeyError(f"optimizer state dict has no master weight for {missing[:5]}")
        for n, p in zip(b.names, b.params):
            if tuple(masters[n].shape) != tuple(p.shape):
                raise ValueError(
                    f"optimizer state dict: {n!r} has shape {tuple(masters[n].shape)}, this rank's parameter "
                    f"is {tuple(p.shape)} (reshard the tensor-parallel slices first)"
                )
        full = b.full_from([masters[n] for n in b.names], torch.float32)
        b.param_flat.copy_(full)
        if not b.own_masters:
            b.master.copy_(full[b.lo : b.hi])
        have = [n in states for n in b.names]
        if any(have) and not all(have):
            raise KeyError(f"optimizer state dict has state for only some parameters of a group "
                           f"(missing {[n for n, h in zip(b.names, have) if not h][:5]})")
        self.optim.state.pop(b.master, None)
        if all(have):
            first = states[b.names[0]]
            new_state: dict[str, Any] = {}
            for key, value in first.items():
                if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(b.params[0].shape) and (
                    value.dim() > 0 or b.params[0].dim() == 0
                ) and key != "step":
                    flat = b.full_from([states[n][key] for n in b.names], torch.float32)
                    new_state[key] = flat[b.lo : b.hi].clone().to(b.master.dtype)
                elif isinstance(value, torch.Tensor):
                    # torch keeps "step" on the CPU unless the group is capturable / fused
                    on_device = key != "step" or group.get("capturable") or group.get("fused")
                    new_state[key] = value.detach().clone().to(b.master.device if on_device else value.device)
                else:
                    new_state[key] = value
            self.optim.state[b.master] = new_state
        saved = saved_groups.get(b.names[0])
        if saved is not None:
            for k, v in saved.items():
                if k != "params":
                    group[k] = v
    self.scaler.load_state_dict(state_dict["scaler"])
    self.skipped_steps = int(state_dict.get("skipped_steps", 0))
    self.num_steps = int(state_dict.get("num_steps", 0))
    self.consecutive_skips = 0
