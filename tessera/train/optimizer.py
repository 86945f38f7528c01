"""HybridZeroOptimizer: fp32 master weights, fp32 gradient accumulation, ZeRO-1, global clipping.

Layout (``grad_buffer``): the parameters of every inner param group are split by storage dtype into
buckets of flat buffers padded to a multiple of the ZERO1 size ``d``: the parameters' storage, the
fp32 main grads (filled by post-accumulate-grad hooks, so accumulation and the DP reduction run in
fp32) and the fp32 master slice this ZERO1 rank updates (fp32 parameters are their own masters).

The inner torch optimizer is rebuilt on the master slices only, so it only ever sees fp32 tensors, and
its states are ``1/d`` of the bucket. Persistent bytes per low-precision parameter:
``2 (bf16 weight) + 4 (fp32 main grad) + (4 master + 8 Adam) / d``.

Per optimizer step (every rank of the job calls it; norms and clipping are in ``grad_norm``):
1. reduce the main grads over DP, bucket by bucket (sum; the 1/dp average is folded into the unscale
   factor): when ZeRO spans the DP group, reduce-scatter straight into the owning rank's shard; else
   all-reduce; launched during the last backward when asked (``grad_reduction``), waited on here;
2. inf/NaN anywhere -> every rank agrees (one flag over the global group) and skips the update
   (params, masters and states untouched), the scaler backs off;
3. one global norm: each TP-replicated parameter counted on TP rank 0 only (tags from
   ``tessera.parallel.attrs``), squares summed over TP (and over ZeRO when the grads are shards);
4. unscale, clip to ``clip_grad_norm`` (every dtype, 0 disables), inner step on the master slices,
   copy masters into ``param_flat`` (rounded to the model dtype) and all-gather over ZERO1.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import torch
from torch import nn

from tessera.config import ConfigError, resolve_zero1_size
from tessera.config.schema import DEFAULT_REDUCE_BUCKET_SIZE
from tessera.dist.context import ParallelMode, gpc
from tessera.parallel.attrs import is_tensor_parallel
from tessera.train.grad_buffer import Bucket, GroupComm, param_name_map, split_reversed
from tessera.train.grad_reduction import GradReduction
from tessera.train.optimizer_precision import MasterPolicy, resolve_optimizer_dtype
from tessera.train.grad_norm import any_rank_non_finite, clip_factor, global_norm, param_norms
from tessera.train.grad_scaler import BaseGradScaler, build_grad_scaler
from tessera.train.naive_amp import unwrap_model
from tessera.train.optimizer_state import (STATE_DICT_FORMAT, ShardSource, load_optimizer_shards,
                                          load_optimizer_state_dict, optimizer_memory_bytes, optimizer_shard_state,
                                          optimizer_state_dict)

__all__ = [
    "HybridZeroOptimizer",
    "TooManySkippedSteps",
    "build_param_groups",
    "build_optimizer",
    "STATE_DICT_FORMAT",
]

_LOW = (torch.float16, torch.bfloat16)
_SCALE_HISTORY = 1024  # loss scales of the last steps kept in ``scale_history``


class TooManySkippedSteps(RuntimeError):
    """Raised by ``step()`` when more than ``max_consecutive_skips`` steps in a row overflow (a diverged run);
    with a dynamic (fp16) scaler only overflows at its ``min_scale`` count."""


def _default_group(mode: ParallelMode) -> Any:
    return gpc.get_group(mode) if gpc.is_initialized(mode) else None


# ---------------------------------------------------------------------- the optimizer
class HybridZeroOptimizer(torch.optim.Optimizer):
    """Mixed-precision ZeRO-1 wrapper around a torch optimizer (see the module docstring).

    Subclasses ``torch.optim.Optimizer`` only so that torch LR schedulers accept it; the real state
    lives in the wrapped optimizer, which is rebuilt in place on the fp32 master slices.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        grad_scal_cfg: Mapping[str, Any] | None = None,
        zero_cfg: Mapping[str, Any] | None = None,
        *,
        clip_grad_norm: float | None = None,
        reduce_dtype: str | None = None,
        dtype: torch.dtype | str | None = None,
        tp_group: Any = None,
        dp_group: Any = None,
        zero1_group: Any = None,
        global_group: Any = None,
        param_names: Any = None,
        grad_scaler: BaseGradScaler | None = None,
        max_consecutive_skips: int | None = None,
        seed: int = 0,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, HybridZeroOptimizer):
            raise TypeError(f"HybridZeroOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if len(optimizer.state) > 0:
            raise ValueError("HybridZeroOptimizer: wrap a fresh optimizer (its state is not empty); "
                             "restore state through HybridZeroOptimizer.load_state_dict instead")
        zero_cfg = dict(zero_cfg or {})
        self.optim = optimizer
        if clip_grad_norm is None:
            clip_grad_norm = zero_cfg.get("clip_grad_norm", 1.0)
        self.clip_grad_norm = float(clip_grad_norm)
        if self.clip_grad_norm < 0:
            raise ValueError(f"clip_grad_norm must be >= 0 (0 disables), got {self.clip_grad_norm}")
        self.reduce_dtype = reduce_dtype if reduce_dtype is not None else zero_cfg.get("reduce_dtype", "fp32")
        if self.reduce_dtype not in ("fp32", "model"):
            raise ValueError(f"reduce_dtype must be 'fp32' or 'model', got {self.reduce_dtype!r}")
        self.max_consecutive_skips = (
            max_consecutive_skips if max_consecutive_skips is not None else zero_cfg.get("max_consecutive_skips")
        )
        self.overlap_sync_grad = bool(zero_cfg.get("overlap_sync_grad", True))
        self.reduce_bucket_size = int(zero_cfg.get("reduce_bucket_size", DEFAULT_REDUCE_BUCKET_SIZE))
        if self.reduce_bucket_size < 1:
            raise ValueError(f"reduce_bucket_size must be >= 1 (elements), got {self.reduce_bucket_size}")

        # groups: explicit > gpc's > single process
        self._tp = GroupComm.of(tp_group if tp_group is not None else _default_group(ParallelMode.TENSOR), "tp_group")
        self._dp = GroupComm.of(dp_group if dp_group is not None else _default_group(ParallelMode.DATA), "dp_group")
        self._zero1 = GroupComm.of(
            zero1_group if zero1_group is not None else _default_group(ParallelMode.ZERO1), "zero1_group"
        )
        gg = global_group if global_group is not None else _default_group(ParallelMode.GLOBAL)
        self._global = GroupComm.of(gg, "global_group") if gg is not None else None
        try:
            resolve_zero1_size(self._dp.size, self._zero1.size)
        except ConfigError as e:
            raise ValueError(f"HybridZeroOptimizer: the ZERO1 group (size {self._zero1.size}) must split the DP "
                             f"group (size {self._dp.size}): {e}; pass dp_group as well as zero1_group") from None

        # frozen parameters (requires_grad=False) are left alone: no buffers, no update, no state
        params: list[nn.Parameter] = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        if not params:
            raise ValueError("HybridZeroOptimizer: the optimizer has no trainable parameters")
        if len({id(p) for p in params}) != len(params):
            raise ValueError("HybridZeroOptimizer: a parameter appears in more than one param group")
        for p in params:
            if p.dtype not in (torch.float32, *_LOW):
                raise TypeError(f"HybridZeroOptimizer: parameter of dtype {p.dtype}; expected fp32, fp16 or bf16")
            if p.is_sparse:
                raise TypeError("HybridZeroOptimizer: sparse parameters are not supported")
        self.precision = resolve_optimizer_dtype(dtype, params)
        self.policy = MasterPolicy.from_config(zero_cfg, self.precision, optimizer, seed)
        self.scaler = grad_scaler if grad_scaler is not None else build_grad_scaler(grad_scal_cfg, self.precision)
        names = param_name_map(param_names, params)

        # rebuild the inner optimizer on master slices: one inner group per (group, storage dtype)
        # buckets of at most reduce_bucket_size elements, filled in reverse parameter order (the order
        # backward completes gradients in), so each bucket's DP reduction can start during backward
        specs: list[tuple[dict[str, Any], list[nn.Parameter], torch.dtype]] = []
        for group in optimizer.param_groups:
            hyper = {k: v for k, v in group.items() if k != "params"}
            for want_low in (True, False):
                plist = [p for p in group["params"] if p.requires_grad and (p.dtype in _LOW) == want_low]
                if plist:
                    low = plist[0].dtype in _LOW
                    grad_dtype = plist[0].dtype if low and self.reduce_dtype == "model" else torch.float32
                    specs += [(hyper, chunk, grad_dtype) for chunk in split_reversed(plist, self.reduce_bucket_size)]
        # one main-grad buffer per dtype, so the DP all-reduce is one collective per dtype
        d = self._zero1.size
        sizes: dict[torch.dtype, int] = {}
        for _, plist, gdt in specs:
            sizes[gdt] = sizes.get(gdt, 0) + Bucket.shard_size(sum(p.numel() for p in plist), d) * d
        device = params[0].device
        if any(p.device != device for p in params):
            raise ValueError("HybridZeroOptimizer: all parameters must be on one device "
                             "(move the model before building the optimizer)")
        self._grad_buffers = {gdt: torch.zeros(n, dtype=gdt, device=device) for gdt, n in sizes.items()}
        used = dict.fromkeys(sizes, 0)
        self._buckets: list[Bucket] = []
        new_groups: list[dict[str, Any]] = []
        for hyper, plist, gdt in specs:
            n = Bucket.shard_size(sum(p.numel() for p in plist), d) * d
            view = self._grad_buffers[gdt][used[gdt] : used[gdt] + n]
            used[gdt] += n
            bucket = Bucket(plist, [names[id(p)] for p in plist], view, self._zero1, self.policy.master_dtype)
            self._buckets.append(bucket)
            new_groups.append({**hyper, "params": [bucket.master]})
        optimizer.param_groups = []
        optimizer.state.clear()
        for g in new_groups:
            optimizer.add_param_group(g)

        self._params = params
        self._grads_clean = True  # main-grad buffers known to be zero (zero_grad can skip the memset)
        self._hooks = [self._register_hook(p, view, i) for i, b in enumerate(self._buckets)
                       for p, view in zip(b.params, b.grad_views)]
        # TP-replicated parameters enter the global norm on TP rank 0 only
        self._count_mask = torch.tensor(
            [is_tensor_parallel(p) or self._tp.rank == 0 for b in self._buckets for p in b.params],
            dtype=torch.float64, device=device,
        )
        # ZeRO over the whole DP group: the grads are reduce-scattered into the shards (grad_reduction)
        self._reduction = GradReduction(self._buckets, self._grad_buffers, self._dp, self._zero1)
        self._reduce_scatter = self._reduction.reduce_scatter
        counted = {id(p): is_tensor_parallel(p) or self._tp.rank == 0 for p in params}
        self._shards = [b.grad_flat[b.lo : b.hi] for b in self._buckets]
        self._shard_views = [b.grad_flat[a:z] for b in self._buckets
                             for a, z in b.shard_segments([counted[id(p)] for p in b.params])]
        self.skipped_steps = 0
        self.num_steps = 0
        self.consecutive_skips = 0
        self.scale_history: list[float] = []
        self.last_grad_norm: float | None = None

    # ------------------------------------------------------------------ construction helpers
    def _register_hook(self, p: nn.Parameter, view: torch.Tensor, bucket: int) -> Any:
        def accumulate(param: torch.Tensor) -> None:
            grad = param.grad
            if grad is None:
                return
            if grad.is_sparse:
                raise TypeError("HybridZeroOptimizer: sparse gradients are not supported")
            self._reduction.check_open(bucket)
            view.add_(grad)
            param.grad = None
            self._grads_clean = False
            self._reduction.arrived(bucket)

        return p.register_post_accumulate_grad_hook(accumulate)

    # ------------------------------------------------------------------ torch.optim.Optimizer surface
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The inner optimizer's groups (setting ``group["lr"]`` here is what the inner step uses)."""
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, value: Any) -> None:
        raise AttributeError("HybridZeroOptimizer.param_groups cannot be replaced")

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optim.defaults

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optim.state

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError("HybridZeroOptimizer: build the torch optimizer with all its groups first")

    def __repr__(self) -> str:
        return (f"HybridZeroOptimizer({type(self.optim).__name__}, dtype={self.precision.name}, "
                f"zero1={self._zero1.size}, dp={self._dp.size}, tp={self._tp.size}, clip={self.clip_grad_norm})")

    # ------------------------------------------------------------------ training API
    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, *, overlap_reduction: bool = False) -> None:
        """Backward of ``loss * loss_scale``; gradients land in the fp32 main-grad buffers.

        ``overlap_reduction=True`` says this is the last backward before ``step()`` (the last
        micro-batch): each bucket's DP reduction is launched asynchronously as soon as all its
        gradients are in, overlapping communication with the rest of backward (when
        ``overlap_sync_grad`` and DP > 1; ``step()`` waits for them and reduces whatever did not start).
        """
        scale = self.scaler.scale
        if overlap_reduction and self.overlap_sync_grad and self._dp.size > 1:
            self._reduction.arm()
        try:
            (loss if scale == 1.0 else loss * scale).backward(retain_graph=retain_graph)
        finally:
            self._reduction.disarm()

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: ARG002 - main grads are always zeroed
        self._reduction.cancel()  # reductions launched by a backward that no step() followed
        if not self._grads_clean:
            for buf in self._grad_buffers.values():
                buf.zero_()
            self._grads_clean = True
        for p in self._params:
            p.grad = None

    def get_main_grad(self, param: torch.Tensor) -> torch.Tensor:
        """The accumulated (still loss-scaled, not yet DP-reduced) main gradient of ``param``.

        A view into the buffer: writing to it counts as a gradient (the next ``zero_grad`` clears it)."""
        self._grads_clean = False
        for b in self._buckets:
            for p, view in zip(b.params, b.grad_views):
                if p is param:
                    return view
        raise KeyError("get_main_grad: the parameter is not managed by this optimizer")

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> tuple[bool, float]:
        """One update from the accumulated gradients; returns ``(success, grad_norm)``.

        ``grad_norm`` is the global L2 norm of the unscaled, DP-averaged gradients before clipping
        (``inf``/``nan`` on an overflowing step, which is skipped). Main grads are zeroed afterwards.
        """
        if closure is not None:
            raise NotImplementedError("HybridZeroOptimizer.step does not take a closure")
        scale = self.scaler.scale
        self.scale_history.append(scale)
        del self.scale_history[:-_SCALE_HISTORY]  # the recent window only: it is read by tests and reports
        self.num_steps += 1
        self._grads_clean = False  # reduced / unscaled in place below; _after_step zeroes them
        self._reduction.finish()
        if self._reduce_scatter:
            maxima = torch.stack([s.abs().amax() for s in self._shards])
            found_inf = any_rank_non_finite(maxima, self._global, self._tp, self._dp)
        else:
            all_norms = param_norms([v for b in self._buckets for v in b.grad_views])
            found_inf = any_rank_non_finite(all_norms, self._global, self._tp, self._dp)

        if found_inf:
            self._after_step(success=False)
            self.last_grad_norm = float("inf")
            return False, float("inf")

        if self._reduce_scatter:
            shard_norms = param_norms(self._shard_views) if self._shard_views else maxima.new_zeros(0)
            grad_norm = global_norm(shard_norms, None, self._tp, self._zero1) / (scale * self._dp.size)
        else:
            grad_norm = global_norm(all_norms, self._count_mask, self._tp) / (scale * self._dp.size)
        factor = (1.0 / (scale * self._dp.size)) * clip_factor(grad_norm, self.clip_grad_norm)
        grads = []
        for b in self._buckets:
            g = b.grad_flat[b.lo : b.hi]
            grads.append(g.mul_(factor) if g.dtype == torch.float32 else g.float().mul_(factor))
        self.policy.update(self.optim, self._buckets, grads)
        for b in self._buckets:
            if not b.own_masters:
                b.param_flat[b.lo : b.hi].copy_(b.master)
            self._zero1.all_gather_flat(b.param_flat)
        self._after_step(success=True)
        self.last_grad_norm = grad_norm
        return True, grad_norm

    def _after_step(self, success: bool) -> None:
        # fp16: overflows while the dynamic scale can still back off are the scaler doing its job; only
        # skips at its minimum count towards max_consecutive_skips. A constant scale is always "at the
        # minimum", so bf16/fp32 count every skip.
        at_min_scale = self.scaler.scale <= getattr(self.scaler, "min_scale", math.inf)
        self.scaler.update(not success)
        self.zero_grad()
        if success:
            self.consecutive_skips = 0
            return
        self.skipped_steps += 1
        if not at_min_scale:
            return
        self.consecutive_skips += 1
        if self.max_consecutive_skips and self.consecutive_skips > self.max_consecutive_skips:
            floor = " at the minimum loss scale" if hasattr(self.scaler, "min_scale") else ""
            raise TooManySkippedSteps(
                f"{self.consecutive_skips} optimizer steps in a row had inf/NaN gradients{floor} "
                f"(loss scale now {self.scaler.scale:g}); the run has diverged "
                "(hybrid_zero_optimizer.max_consecutive_skips)"
            )

    # ------------------------------------------------------------------ state (see optimizer_state)
    def state_dict(self) -> dict[str, Any]:
        """Layout-independent state (a collective over ZERO1): ``optimizer_state.optimizer_state_dict``."""
        return optimizer_state_dict(self)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a ``state_dict()`` saved under any DP/ZeRO layout with the same TP-local shapes."""
        load_optimizer_state_dict(self, state_dict)

    def shard_state_dict(self) -> dict[str, Any]:
        """This ZERO1 rank's shard only (no collective, no copy): ``optimizer_state.optimizer_shard_state``."""
        return optimizer_shard_state(self)

    def load_shards(self, source: ShardSource) -> None:
        """Load from saved shards of any DP/ZeRO layout, reading only this rank's element ranges."""
        load_optimizer_shards(self, source)

    # ------------------------------------------------------------------ introspection
    def memory_bytes(self) -> dict[str, int]:
        """Bytes of the tensors this process holds, by role: ``optimizer_state.optimizer_memory_bytes``."""
        return optimizer_memory_bytes(self)

    @property
    def zero1_size(self) -> int:
        return self._zero1.size


# ---------------------------------------------------------------------- param groups / config
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

    ``model`` is the NaiveAMPModel (already cast). ``groups``: tp_group, dp_group, zero1_group,
    global_group (default: gpc's).
    """
    adam = cfg["adam"]
    param_groups = build_param_groups(model, adam["weight_decay"], adam.get("decay_norm_and_bias", False))
    inner = torch.optim.AdamW(
        param_groups, lr=adam["lr"], betas=(adam["adam_beta1"], adam["adam_beta2"]), eps=adam["adam_eps"],
        weight_decay=adam["weight_decay"],
    )
    return HybridZeroOptimizer(
        inner, grad_scal_cfg=cfg.get("grad_scaler"), zero_cfg=cfg.get("hybrid_zero_optimizer"),
        dtype=cfg["model"]["dtype"], param_names=model, seed=int(cfg.get("seed") or 0), **groups,
    )
