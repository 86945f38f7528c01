"""HybridZeroOptimizer's state in two forms, both loadable into any DP / ZeRO layout.

- ``optimizer_state_dict``: full TP-local tensors keyed by parameter name (masters and Adam moments
  gathered over ZERO1); a collective, and a full copy of the state on every rank.
- ``optimizer_shard_state``: only this ZERO1 rank's shard, as the flat per-bucket slices it updates,
  with the names, shapes and offsets that say which elements of which parameter each slice holds.
  No collective, no copy: what training checkpoints write, one file per ZeRO rank. It is loaded back
  through ``load_optimizer_shards`` from any source that can read element ranges of a parameter.

``self`` below is the HybridZeroOptimizer.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Protocol

import torch

from tessera.parallel.attrs import partition_dim

__all__ = ["STATE_DICT_FORMAT", "SHARD_FORMAT", "ShardSource", "optimizer_state_dict", "load_optimizer_state_dict",
           "optimizer_shard_state", "load_optimizer_shards", "optimizer_memory_bytes"]

STATE_DICT_FORMAT = "tessera.hybrid_zero_optimizer/1"
SHARD_FORMAT = "tessera.hybrid_zero_optimizer.shard/1"


class ShardSource(Protocol):
    """Saved optimizer state read by parameter name and element range (``checkpoint.optim_shards``)."""

    def shape(self, name: str) -> tuple[int, ...] | None: ...
    def read(self, name: str, key: str, start: int, stop: int) -> torch.Tensor: ...
    def state_keys(self, name: str) -> tuple[list[str], dict[str, Any]]: ...
    def group(self, name: str) -> dict[str, Any]: ...
    @property
    def header(self) -> dict[str, Any]: ...


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
                    flat = b.full_from([states[n][key] for n in b.names], value.dtype)  # as saved (fp32 / bf16)
                    new_state[key] = flat[b.lo : b.hi].clone()
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


def optimizer_shard_state(self: Any) -> dict[str, Any]:
    """This ZERO1 rank's part of the state: views of the live buffers (no collective, no copy).

    Layout::

        {"format": SHARD_FORMAT, "dtype": ..., "zero1_size": d, "zero1_rank": z, "scaler": {...},
         "skipped_steps": int, "num_steps": int, "partition_dim": {name: int | None},
         "buckets": [{"group": {<hyperparameters>}, "names": [...], "shapes": [[...]], "offsets": [...],
                      "lo": int, "hi": int,              # this shard = elements [lo, hi) of the bucket
                      "master": fp32 (hi - lo,), "state": {"exp_avg": (hi - lo,), ..., "step": 0-dim}}]}
    """
    buckets = []
    for b, group in zip(self._buckets, self.optim.param_groups):
        buckets.append({
            "group": {k: v for k, v in group.items() if k != "params"},
            "names": list(b.names), "shapes": [list(p.shape) for p in b.params], "offsets": list(b.offsets),
            "lo": b.lo, "hi": b.hi, "master": b.master.detach(),
            "state": {k: (v.detach() if isinstance(v, torch.Tensor) else v)
                      for k, v in self.optim.state.get(b.master, {}).items()},
        })
    return {
        "format": SHARD_FORMAT, "dtype": self.precision.name, "zero1_size": self._zero1.size,
        "zero1_rank": self._zero1.rank, "scaler": self.scaler.state_dict(), "skipped_steps": self.skipped_steps,
        "num_steps": self.num_steps,
        "partition_dim": {n: partition_dim(p) for b in self._buckets for n, p in zip(b.names, b.params)},
        "buckets": buckets,
    }


@torch.no_grad()
def load_optimizer_shards(self: Any, source: ShardSource) -> None:
    """Fill this rank's masters and states from ``source``, reading only the element ranges this ZERO1
    rank owns, then rebuild the parameters (masters rounded to the model dtype, all-gathered over ZERO1).
    A collective over ZERO1 (every rank calls it)."""
    header = source.header
    if header.get("format") != SHARD_FORMAT:
        raise ValueError(f"not a HybridZeroOptimizer shard (format {header.get('format')!r}, expected {SHARD_FORMAT!r})")
    for b, group in zip(self._buckets, self.optim.param_groups):
        for n, p in zip(b.names, b.params):
            saved = source.shape(n)
            if saved is None:
                raise KeyError(f"optimizer checkpoint has no master weight for {n!r}")
            if tuple(saved) != tuple(p.shape):
                raise ValueError(f"optimizer checkpoint: {n!r} has shape {tuple(saved)}, this rank's parameter is "
                                 f"{tuple(p.shape)} (reshard the tensor-parallel slices first)")
        pieces = b.shard_pieces()  # (parameter index, start, stop): param-local ranges this rank owns
        for i, a, z in pieces:
            at = b.offsets[i] + a - b.lo
            b.master[at : at + z - a].copy_(source.read(b.names[i], "master", a, z))
        if not b.own_masters:
            b.param_flat[b.lo : b.hi].copy_(b.master)
        self._zero1.all_gather_flat(b.param_flat)
        sharded, replicated = source.state_keys(b.names[0])
        self.optim.state.pop(b.master, None)
        if sharded or replicated:
            new_state: dict[str, Any] = {}
            for key in sharded:
                flat = None
                for i, a, z in pieces:
                    at = b.offsets[i] + a - b.lo
                    piece = source.read(b.names[i], key, a, z)
                    if flat is None:  # the dtype it was saved in (fp32 or bf16 moments)
                        flat = torch.zeros(b.shard, dtype=piece.dtype, device=b.master.device)
                    flat[at : at + z - a].copy_(piece)
                new_state[key] = flat if flat is not None else torch.zeros_like(b.master)
            for key, value in replicated.items():
                if isinstance(value, torch.Tensor):
                    # torch keeps "step" on the CPU unless the group is capturable / fused
                    on_device = key != "step" or group.get("capturable") or group.get("fused")
                    value = value.detach().clone().to(b.master.device if on_device else value.device)
                new_state[key] = value
            self.optim.state[b.master] = new_state
        for k, v in source.group(b.names[0]).items():
            group[k] = v
    self.scaler.load_state_dict(header["scaler"])
    self.skipped_steps = int(header.get("skipped_steps", 0))
    self.num_steps = int(header.get("num_steps", 0))
    self.consecutive_skips = 0


def optimizer_memory_bytes(self: Any) -> dict[str, int]:
    """Bytes of the tensors this process holds, by role, each storage counted once.

    weights: the parameters' storage; main_grads: main-grad buffers plus any live ``.grad``;
    masters: master slices that are not the parameters themselves; compensation: the Kahan buffers of
    bf16 masters; optimizer_states: the other state tensors (Adam moments). ``num_params``: parameters on this rank (TP-local).
    """
    seen: set[tuple[int, str]] = set()

    def nbytes(tensors: Iterable[torch.Tensor]) -> int:
        total = 0
        for t in tensors:
            st = t.untyped_storage()
            key = (st._cdata, str(t.device))  # identity, not address: meta tensors (dry runs) have none
            if key in seen or st.nbytes() == 0:
                continue
            seen.add(key)
            total += st.nbytes()
        return total

    out = {
        "weights": nbytes(self._params),
        "main_grads": nbytes([*self._grad_buffers.values()] + [p.grad for p in self._params if p.grad is not None]),
        "masters": nbytes([b.master for b in self._buckets]),
        "compensation": nbytes(s["master_compensation"] for s in self.optim.state.values()
                               if "master_compensation" in s),
        "optimizer_states": nbytes(
            v for s in self.optim.state.values() for v in s.values() if isinstance(v, torch.Tensor)
        ),
    }
    out["num_params"] = sum(p.numel() for p in self._params)
    return out
