"""HybridZeroOptimizer: fp32 master weights, fp32 gradient accumulation, ZeRO-1, global clipping.

Layout. The parameters of every inner param group are split by storage dtype (low precision vs fp32)
into *buckets*. A bucket owns three flat buffers, each padded to a multiple of the ZERO1 size ``d``:

- ``param_flat`` (model dtype): the parameters' ``.data`` are rebound to views of it, so the updated
  shards can be all-gathered in place and the model keeps its Parameter objects;
- ``grad_flat`` (fp32 by default): ``register_post_accumulate_grad_hook`` adds each micro-batch's
  ``.grad`` into it and frees the ``.grad``, so accumulation and the DP all-reduce run in fp32;
- ``master`` (fp32, ``1/d`` of the bucket): the slice this ZERO1 rank updates. For an fp32 bucket
  the master *is* a view of ``param_flat`` (fp32 parameters are their own masters, no copy).

The inner torch optimizer is rebuilt on the master slices only, so it only ever sees fp32 tensors, and
its states are ``1/d`` of the bucket. Persistent bytes per low-precision parameter:
``2 (bf16 weight) + 4 (fp32 main grad) + (4 master + 8 Adam) / d``.

Per optimizer step (every rank of the job calls it):
1. all-reduce the main grads over DP (sum; the 1/dp average is folded into the unscale factor);
2. per-parameter fp32 norms; inf/NaN anywhere -> every rank agrees (all-reduce over the global
   group) and skips the update (params, masters and states untouched), the scaler backs off;
3. global norm: squares summed over the TP group, each TP-replicated parameter counted once (on TP
   rank 0 only; the tags come from ``tessera.parallel.attrs``);
4. unscale, clip to ``clip_grad_norm`` (every dtype, 0 disables), inner step on the master slices,
   copy masters into ``param_flat`` (rounded to the model dtype) and all-gather over ZERO1.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from tessera.dist.context import ParallelMode, gpc
from tessera.train.grad_scaler import BaseGradScaler, build_grad_scaler
from tessera.config.precision import Precision, resolve_precision
from tessera.parallel.attrs import is_tensor_parallel, partition_dim
from tessera.parallel.comm import all_reduce as comm_all_reduce
from tessera.parallel.comm import to_host

__all__ = [
    "HybridZeroOptimizer",
    "TooManySkippedSteps",
    "build_param_groups",
    "build_optimizer",
    "STATE_DICT_FORMAT",
]

STATE_DICT_FORMAT = "tessera.hybrid_zero_optimizer/1"
_LOW = (torch.float16, torch.bfloat16)


class TooManySkippedSteps(RuntimeError):
    """Raised by ``step()`` when more than ``max_consecutive_skips`` steps in a row overflow (a diverged run);
    with a dynamic (fp16) scaler only overflows at its ``min_scale`` count."""


# ---------------------------------------------------------------------- communication
@dataclass
class _Comm:
    """A process group with its size and this process's rank (size 1 = no communication)."""

    group: Any
    size: int
    rank: int

    @classmethod
    def of(cls, group: Any, what: str) -> "_Comm":
        if group is None:
            return cls(None, 1, 0)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(f"HybridZeroOptimizer: {what} was given but torch.distributed is not initialized")
        size = dist.get_world_size(group)
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError(f"HybridZeroOptimizer: this process is not a member of the {what}")
        return cls(group if size > 1 else None, size, rank)

    def all_reduce(self, t: torch.Tensor, op: Any = None) -> torch.Tensor:
        if self.size > 1:  # through tessera's comm so a fast node-local route (shared memory) applies
            comm_all_reduce(t, self.group, op or dist.ReduceOp.SUM)
        return t

    def all_gather_flat(self, flat: torch.Tensor) -> None:
        """Every rank holds its own 1/size slice of ``flat``; afterwards every rank holds all of it."""
        if self.size == 1:
            return
        chunks = list(flat.chunk(self.size))
        dist.all_gather(chunks, chunks[self.rank].clone(), group=self.group)

    def gather_full(self, shard: torch.Tensor) -> torch.Tensor:
        """Concatenate the 1-D ``shard`` of every rank (rank order)."""
        if self.size == 1:
            return shard.detach().clone()
        out = torch.empty(shard.numel() * self.size, dtype=shard.dtype, device=shard.device)
        dist.all_gather(list(out.chunk(self.size)), shard.detach().contiguous(), group=self.group)
        return out


def _default_group(mode: ParallelMode) -> Any:
    return gpc.get_group(mode) if gpc.is_initialized(mode) else None


# ---------------------------------------------------------------------- buckets
class _Bucket:
    """Parameters of one inner param group and one storage dtype, in flat padded buffers."""

    def __init__(self, params: list[nn.Parameter], names: list[str], grad_flat: torch.Tensor, zero1: _Comm) -> None:
        self.params = params
        self.names = names
        self.dtype = params[0].dtype
        self.own_masters = self.dtype == torch.float32
        self.numels = [p.numel() for p in params]
        self.offsets = [0]
        for n in self.numels[:-1]:
            self.offsets.append(self.offsets[-1] + n)
        self.numel = sum(self.numels)
        self.shard = self.shard_size(self.numel, zero1.size)
        self.padded = self.shard * zero1.size
        if grad_flat.numel() != self.padded:
            raise AssertionError("internal: main-grad slice of the wrong size")
        self.lo, self.hi = zero1.rank * self.shard, (zero1.rank + 1) * self.shard
        device = params[0].device
        with torch.no_grad():
            self.param_flat = torch.zeros(self.padded, dtype=self.dtype, device=device)
            for p, off, n in zip(params, self.offsets, self.numels):
                self.param_flat[off : off + n].copy_(p.data.reshape(-1))
                p.data = self.param_flat[off : off + n].view(p.shape)
            self.grad_flat = grad_flat  # a slice of one buffer shared by all buckets of its dtype
            self.grad_views = [self.grad_flat[off : off + n].view(p.shape) for p, off, n in
                               zip(params, self.offsets, self.numels)]
            if self.own_masters:
                self.master = self.param_flat[self.lo : self.hi].detach()
            else:
                self.master = self.param_flat[self.lo : self.hi].detach().float()

    @staticmethod
    def shard_size(numel: int, d: int) -> int:
        return max(1, math.ceil(numel / d))

    def full_from(self, tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """A padded flat buffer built from per-parameter tensors (used when loading)."""
        flat = torch.zeros(self.padded, dtype=dtype, device=self.param_flat.device)
        for t, off, n in zip(tensors, self.offsets, self.numels):
            flat[off : off + n].copy_(t.reshape(-1))
        return flat

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter tensors (parameter shapes) cut out of a padded flat buffer."""
        return [flat[off : off + n].view(p.shape).clone() for p, off, n in zip(self.params, self.offsets, self.numels)]


def _name_map(param_names: Any, params: list[nn.Parameter]) -> dict[int, str]:
    """id(param) -> name from a Module, a {Parameter: name} mapping or (name, Parameter) pairs."""
    if param_names is None:
        return {id(p): f"param_{i}" for i, p in enumerate(params)}
    if isinstance(param_names, nn.Module):
        from tessera.train.naive_amp import unwrap_model

        pairs = list(unwrap_model(param_names).named_parameters())
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

        # groups: explicit > gpc's > single process
        self._tp = _Comm.of(tp_group if tp_group is not None else _default_group(ParallelMode.TENSOR), "tp_group")
        self._dp = _Comm.of(dp_group if dp_group is not None else _default_group(ParallelMode.DATA), "dp_group")
        self._zero1 = _Comm.of(
            zero1_group if zero1_group is not None else _default_group(ParallelMode.ZERO1), "zero1_group"
        )
        gg = global_group if global_group is not None else _default_group(ParallelMode.GLOBAL)
        self._global = _Comm.of(gg, "global_group") if gg is not None else None
        if self._zero1.size > self._dp.size or self._dp.size % self._zero1.size:
            raise ValueError(
                f"HybridZeroOptimizer: the ZERO1 group (size {self._zero1.size}) must split the DP group "
                f"(size {self._dp.size}); pass dp_group as well as zero1_group"
            )

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
        self.precision = self._resolve_dtype(dtype, params)
        self.scaler = grad_scaler if grad_scaler is not None else build_grad_scaler(grad_scal_cfg, self.precision)
        names = _name_map(param_names, params)

        # rebuild the inner optimizer on master slices: one inner group per (group, storage dtype)
        specs: list[tuple[dict[str, Any], list[nn.Parameter], torch.dtype]] = []
        for group in optimizer.param_groups:
            hyper = {k: v for k, v in group.items() if k != "params"}
            for want_low in (True, False):
                plist = [p for p in group["params"] if p.requires_grad and (p.dtype in _LOW) == want_low]
                if plist:
                    low = plist[0].dtype in _LOW
                    grad_dtype = plist[0].dtype if low and self.reduce_dtype == "model" else torch.float32
                    specs.append((hyper, plist, grad_dtype))
        # one main-grad buffer per dtype, so the DP all-reduce is one collective per dtype
        d = self._zero1.size
        sizes: dict[torch.dtype, int] = {}
        for _, plist, gdt in specs:
            sizes[gdt] = sizes.get(gdt, 0) + _Bucket.shard_size(sum(p.numel() for p in plist), d) * d
        device = params[0].device
        if any(p.device != device for p in params):
            raise ValueError("HybridZeroOptimizer: all parameters must be on one device "
                             "(move the model before building the optimizer)")
        self._grad_buffers = {gdt: torch.zeros(n, dtype=gdt, device=device) for gdt, n in sizes.items()}
        used = dict.fromkeys(sizes, 0)
        self._buckets: list[_Bucket] = []
        new_groups: list[dict[str, Any]] = []
        for hyper, plist, gdt in specs:
            n = _Bucket.shard_size(sum(p.numel() for p in plist), d) * d
            view = self._grad_buffers[gdt][used[gdt] : used[gdt] + n]
            used[gdt] += n
            bucket = _Bucket(plist, [names[id(p)] for p in plist], view, self._zero1)
            self._buckets.append(bucket)
            new_groups.append({**hyper, "params": [bucket.master]})
        optimizer.param_groups = []
        optimizer.state.clear()
        for g in new_groups:
            optimizer.add_param_group(g)

        self._params = params
        self._grads_clean = True  # main-grad buffers known to be zero (zero_grad can skip the memset)
        self._hooks = [self._register_hook(p, view) for b in self._buckets for p, view in zip(b.params, b.grad_views)]
        # TP-replicated parameters enter the global norm on TP rank 0 only
        self._count_mask = torch.tensor(
            [is_tensor_parallel(p) or self._tp.rank == 0 for b in self._buckets for p in b.params],
            dtype=torch.float64, device=device,
        )
        self.skipped_steps = 0
        self.num_steps = 0
        self.consecutive_skips = 0
        self.scale_history: list[float] = []
        self.last_grad_norm: float | None = None

    # ------------------------------------------------------------------ construction helpers
    @staticmethod
    def _resolve_dtype(dtype: Any, params: list[nn.Parameter]) -> Precision:
        low = {p.dtype for p in params if p.dtype in _LOW}
        if len(low) > 1:
            raise TypeError("HybridZeroOptimizer: parameters mix float16 and bfloat16")
        if dtype is None:
            return resolve_precision(next(iter(low)) if low else torch.float32)
        p = resolve_precision(dtype)
        if p.is_low_precision and low and low != {p.dtype}:
            raise TypeError(f"HybridZeroOptimizer: dtype={p.name} but the parameters are {next(iter(low))}")
        if not p.is_low_precision and low:
            raise TypeError(
                f"HybridZeroOptimizer: dtype={p.name} but some parameters are {next(iter(low))}; "
                "pass the model's low-precision dtype"
            )
        if p.is_low_precision and not low:
            warnings.warn(
                f"HybridZeroOptimizer: dtype={p.name} but every parameter is fp32 "
                "(wrap the model in NaiveAMPModel before building the optimizer?)",
                stacklevel=3,
            )
        return p

    def _register_hook(self, p: nn.Parameter, view: torch.Tensor) -> Any:
        def accumulate(param: torch.Tensor) -> None:
            grad = param.grad
            if grad is None:
                return
            if grad.is_sparse:
                raise TypeError("HybridZeroOptimizer: sparse gradients are not supported")
            view.add_(grad)
            param.grad = None
            self._grads_clean = False

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

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Backward of ``loss * loss_scale``; gradients land in the fp32 main-grad buffers."""
        scale = self.scaler.scale
        (loss if scale == 1.0 else loss * scale).backward(retain_graph=retain_graph)

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: ARG002 - main grads are always zeroed
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

    def _param_norms(self) -> torch.Tensor:
        """fp32 L2 norm of every parameter's main grad, in bucket order."""
        views = [v for b in self._buckets for v in b.grad_views]
        if hasattr(torch, "_foreach_norm"):
            try:
                return torch.stack(torch._foreach_norm(views, 2, dtype=torch.float32))
            except (TypeError, RuntimeError):  # an older signature without dtype
                pass
        return torch.stack([torch.linalg.vector_norm(v, dtype=torch.float32) for v in views])

    def _agree_any(self, flag: torch.Tensor) -> bool:
        """True on every rank when ``flag`` is set on any rank."""
        if self._global is not None:
            self._global.all_reduce(flag, dist.ReduceOp.MAX)
        else:  # TP then DP reaches every rank of a tp x dp layout
            self._tp.all_reduce(flag, dist.ReduceOp.MAX)
            self._dp.all_reduce(flag, dist.ReduceOp.MAX)
        return to_host(flag)[0] > 0

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
        self.num_steps += 1
        self._grads_clean = False  # reduced / unscaled in place below; _after_step zeroes them
        for buf in self._grad_buffers.values():
            self._dp.all_reduce(buf)

        all_norms = self._param_norms()
        found_inf = self._agree_any((~torch.isfinite(all_norms).all()).to(torch.float32).reshape(1))

        if found_inf:
            self._after_step(success=False)
            self.last_grad_norm = float("inf")
            return False, float("inf")

        # a 0/1 weight rather than a boolean index: no data-dependent shape, so no device sync
        sq = torch.stack([(all_norms.double().square() * self._count_mask).sum()])
        self._tp.all_reduce(sq)
        grad_norm = math.sqrt(to_host(sq)[0]) / (scale * self._dp.size)

        factor = 1.0 / (scale * self._dp.size)
        if self.clip_grad_norm > 0:
            clip_coef = self.clip_grad_norm / (grad_norm + 1e-6)
            if clip_coef < 1.0:
                factor *= clip_coef
        for b in self._buckets:
            g = b.grad_flat[b.lo : b.hi]
            g = g.mul_(factor) if g.dtype == torch.float32 else g.float().mul_(factor)
            b.master.grad = g
        self.optim.step()
        for b in self._buckets:
            b.master.grad = None
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

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
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
    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
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

    # ------------------------------------------------------------------ introspection
    def memory_bytes(self) -> dict[str, int]:
        """Bytes of the tensors this process holds, by role, each storage counted once.

        weights: the parameters' storage; main_grads: main-grad buffers plus any live ``.grad``;
        masters: fp32 master slices that are not the parameters themselves; optimizer_states: the
        inner optimizer's state tensors. ``num_params``: parameters on this rank (TP-local).
        """
        seen: set[tuple[int, str]] = set()

        def nbytes(tensors: Iterable[torch.Tensor]) -> int:
            total = 0
            for t in tensors:
                st = t.untyped_storage()
                key = (st.data_ptr(), str(t.device))
                if key in seen or st.nbytes() == 0:
                    continue
                seen.add(key)
                total += st.nbytes()
            return total

        out = {
            "weights": nbytes(self._params),
            "main_grads": nbytes([*self._grad_buffers.values()] + [p.grad for p in self._params if p.grad is not None]),
            "masters": nbytes([b.master for b in self._buckets]),
            "optimizer_states": nbytes(
                v for s in self.optim.state.values() for v in s.values() if isinstance(v, torch.Tensor)
            ),
        }
        out["num_params"] = sum(p.numel() for p in self._params)
        return out

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
    from tessera.train.naive_amp import unwrap_model

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
        dtype=cfg["model"]["dtype"], param_names=model, **groups,
    )
