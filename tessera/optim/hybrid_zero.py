"""HybridZeroOptimizer: fp32 master weights, fp32 gradient accumulation, ZeRO-1, global clipping.

Layout (``bucket``, ``buffers``): the parameters of every inner param group are split by storage dtype
into buckets of flat buffers padded to a multiple of the ZERO1 size ``d``: the parameters' storage, the
fp32 main grads (filled by post-accumulate-grad hooks, so accumulation and the DP reduction run in
fp32) and the fp32 master slice this ZERO1 rank updates (fp32 parameters are their own masters).

The inner torch optimizer is rebuilt on the master slices only, so it only ever sees fp32 tensors, and
its states are ``1/d`` of the bucket. Persistent bytes per low-precision parameter:
``2 (bf16 weight) + 4 (fp32 main grad) + (4 master + 8 Adam) / d``.

Per optimizer step (every rank of the job calls it):
1. prepare the grads: reduce the main grads over DP, bucket by bucket (sum; the 1/dp average is folded
   into the unscale factor): when ZeRO spans the DP group, reduce-scatter straight into the owning
   rank's shard; else all-reduce; launched during the last backward when asked (``buffers``), waited
   on here. inf/NaN anywhere -> every rank agrees (one flag over the global group) and skips the
   update (params, masters and states untouched), the scaler backs off;
2. clip: one global norm (``clipping``): each TP-replicated parameter counted on TP rank 0 only, squares
   summed over TP (and over ZeRO when the grads are shards); clip to ``clip_grad_norm`` (every dtype,
   0 disables);
3. update: unscale, inner step on the master slices (``master_policy``), copy masters into
   ``param_flat`` (rounded to the model dtype) and all-gather over ZERO1.

Every setting comes from the ``hybrid_zero_optimizer`` config section (``zero_cfg``, see ``settings``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tessera.config.dtypes import ModelDtype
from tessera.core.context import gpc
from tessera.core.job import Job, JobGroups
from tessera.optim.bucket import Bucket
from tessera.optim.buffers import GradientBuffers
from tessera.optim.clipping import GradNorm, clip_factor
from tessera.optim.groups import OptimizerGroups
from tessera.optim.master_policy import MasterPolicy, resolve_optimizer_dtype
from tessera.optim.params import ParamNames, param_name_map, trainable_params
from tessera.optim.settings import ZeroSettings
from tessera.optim.skips import StepRecord, TooManySkippedSteps
from tessera.optim.state_format import SHARD_FORMAT, STATE_DICT_FORMAT, ShardSource
from tessera.optim.step_observer import StepObserver
from tessera.parallel.attrs import partition_dim
from tessera.precision.plan import OptimizerDtypes, PrecisionPlan
from tessera.precision.scaler import BaseGradScaler, build_grad_scaler

__all__ = ["HybridZeroOptimizer", "TooManySkippedSteps"]


class HybridZeroOptimizer(torch.optim.Optimizer):
    """Mixed-precision ZeRO-1 wrapper around a torch optimizer (see the module docstring).

    Subclasses ``torch.optim.Optimizer`` only so that torch LR schedulers accept it; the real state
    lives in the wrapped optimizer, which is rebuilt in place on the fp32 master slices.
    ``param_names``: the unwrapped model (or names) the state is keyed by. ``job`` (the run description)
    gives the groups, the model precision and the seed; without one, the launched job's groups and seed
    (else a single process) and the parameters' own precision. Explicit ``dtype`` and groups take precedence.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        grad_scal_cfg: Mapping[str, Any] | None = None,
        zero_cfg: Mapping[str, Any] | None = None,
        *,
        job: Job | None = None,
        dtype: torch.dtype | str | None = None,
        tp_group: dist.ProcessGroup | None = None,
        dp_group: dist.ProcessGroup | None = None,
        zero1_group: dist.ProcessGroup | None = None,
        global_group: dist.ProcessGroup | None = None,
        param_names: ParamNames = None,
        grad_scaler: BaseGradScaler | None = None,
        seed: int | None = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, HybridZeroOptimizer):
            raise TypeError(f"HybridZeroOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if len(optimizer.state) > 0:
            raise ValueError("HybridZeroOptimizer: wrap a fresh optimizer (its state is not empty); "
                             "restore state through HybridZeroOptimizer.load_state_dict instead")
        self._optim = optimizer
        self._settings = ZeroSettings.from_config(zero_cfg)
        launched = job or gpc.job  # InternEvo-style code builds it after launch and expects the launched groups
        groups = launched.groups if launched is not None else JobGroups()
        self._groups = OptimizerGroups.resolve(
            *(given if given is not None else default for given, default in (
                (tp_group, groups.tp), (dp_group, groups.dp), (zero1_group, groups.zero1),
                (global_group, groups.world))))
        self._params = trainable_params(optimizer)
        # the precision: the caller's dtype, else the job passed, else the parameters' own (not the launched job's:
        # a model may be cast to another dtype than the launch config's)
        stated = (PrecisionPlan.of(dtype).model if dtype is not None
                  else job.precision.model if job is not None else None)
        self._model_dtype = resolve_optimizer_dtype(stated, self._params)
        if seed is None:  # the run's seed (stochastic rounding of bf16 masters)
            seed = launched.seed if launched is not None else 0
        # the section's dtypes through the precision plan's one resolver (``optimizer_dtypes``): the same function
        # that gave a launched job's plan its ``optimizer`` from the same keys
        self._dtypes = self._settings.dtypes(self._model_dtype)
        self._policy = MasterPolicy.from_dtypes(self._dtypes, optimizer, seed)
        self._scaler = grad_scaler if grad_scaler is not None else build_grad_scaler(grad_scal_cfg, self._model_dtype)
        self._grads = GradientBuffers(
            optimizer.param_groups, param_name_map(param_names, self._params), dp=self._groups.dp,
            zero1=self._groups.zero1, master_dtype=self._policy.master_dtype,
            reduce_dtype=self._settings.reduce_dtype, bucket_size=self._settings.reduce_bucket_size,
            fuse_wgrad=self._settings.fuse_wgrad_accumulation,
        )
        self._rebuild_inner()
        self._norm = GradNorm(self._grads, self._groups)
        self._record = StepRecord(self._settings.max_consecutive_skips)
        self._observer: StepObserver | None = None

    def _rebuild_inner(self) -> None:
        """The inner optimizer on the master slices: one inner group per bucket, its group's hyperparameters."""
        optimizer = self._optim
        optimizer.param_groups = []
        optimizer.state.clear()
        for hyper, bucket in zip(self._grads.hypers, self._grads.buckets):
            optimizer.add_param_group({**hyper, "params": [bucket.master]})

    # ------------------------------------------------------------------ read-only views
    @property
    def optim(self) -> torch.optim.Optimizer:
        """The wrapped torch optimizer (on the master slices)."""
        return self._optim

    @property
    def settings(self) -> ZeroSettings:
        return self._settings

    @property
    def model_dtype(self) -> ModelDtype:
        """The model dtype the optimizer works for (the run's ``Precision.model``)."""
        return self._model_dtype

    @property
    def policy(self) -> MasterPolicy:
        return self._policy

    @property
    def optimizer_dtypes(self) -> OptimizerDtypes:
        """The master, moment and reduction dtypes this optimizer keeps (the plan's ``OptimizerDtypes``)."""
        return self._dtypes

    @property
    def scaler(self) -> BaseGradScaler:
        return self._scaler

    @property
    def gradients(self) -> GradientBuffers:
        """The main-grad buffers, buckets, hooks and DP reduction."""
        return self._grads

    @property
    def buckets(self) -> list[Bucket]:
        return self._grads.buckets

    @property
    def params(self) -> list[nn.Parameter]:
        """The parameters this optimizer updates (trainable ones, param-group order)."""
        return list(self._params)

    @property
    def zero1_size(self) -> int:
        return self._groups.zero1.size

    @property
    def dp_size(self) -> int:
        return self._groups.dp.size

    @property
    def tp_size(self) -> int:
        return self._groups.tp.size

    @property
    def num_steps(self) -> int:
        return self._record.num_steps

    @property
    def skipped_steps(self) -> int:
        return self._record.skipped_steps

    @property
    def consecutive_skips(self) -> int:
        return self._record.consecutive_skips

    @property
    def scale_history(self) -> list[float]:
        """The loss scale of each recent step (a copy)."""
        return list(self._record.scale_history)

    @property
    def last_grad_norm(self) -> float | None:
        return self._record.last_grad_norm

    # ------------------------------------------------------------------ torch.optim.Optimizer surface
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's groups (setting ``group["lr"]`` here is what the inner step uses)."""
        return self._optim.param_groups

    @param_groups.setter
    def param_groups(self, value: Any) -> None:
        raise AttributeError("HybridZeroOptimizer.param_groups cannot be replaced")

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self._optim.defaults

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self._optim.state

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError("HybridZeroOptimizer: build the torch optimizer with all its groups first")

    def __repr__(self) -> str:
        return (f"HybridZeroOptimizer({type(self._optim).__name__}, dtype={self._model_dtype.name}, "
                f"zero1={self.zero1_size}, dp={self.dp_size}, tp={self.tp_size}, "
                f"clip={self._settings.clip_grad_norm})")

    # ------------------------------------------------------------------ training API
    @property
    def loss_scale(self) -> float:
        return self._scaler.scale

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, *, overlap_reduction: bool = False) -> None:
        """Backward of ``loss * loss_scale``; gradients land in the fp32 main-grad buffers.

        ``overlap_reduction=True`` says this is the last backward before ``step()`` (the last
        micro-batch): each bucket's DP reduction is launched asynchronously as soon as all its
        gradients are in, overlapping communication with the rest of backward (when
        ``overlap_sync_grad`` and DP > 1; ``step()`` waits for them and reduces whatever did not start).
        """
        scale = self._scaler.scale
        if overlap_reduction and self._settings.overlap_sync_grad and self.dp_size > 1:
            self._grads.arm()
        try:
            (loss if scale == 1.0 else loss * scale).backward(retain_graph=retain_graph)
        finally:
            self._grads.disarm()

    def zero_grad(self, set_to_none: bool = True) -> None:  # set_to_none unused: main grads are always zeroed
        self._grads.zero()  # also waits for reductions a backward launched that no step() consumed
        for p in self._params:
            p.grad = None

    def observe_next_step(self, observer: StepObserver | None) -> None:
        """Show ``observer`` the next ``step()``'s reduced grads and update (``step_observer``); None cancels."""
        self._observer = observer

    def get_main_grad(self, param: torch.Tensor) -> torch.Tensor:
        """The accumulated (still loss-scaled, not yet DP-reduced) main gradient of ``param``.

        A view into the buffer: writing to it counts as a gradient (the next ``zero_grad`` clears it)."""
        return self._grads.main_grad(param)

    @torch.no_grad()
    # returns (success, grad_norm) where torch's Optimizer.step returns the closure's loss
    def step(self, closure: Callable[[], Any] | None = None) -> tuple[bool, float]:  # type: ignore[override]
        """One update from the accumulated gradients; returns ``(success, grad_norm)``.

        ``grad_norm`` is the global L2 norm of the unscaled, DP-averaged gradients before clipping
        (``inf``/``nan`` on an overflowing step, which is skipped). Main grads are zeroed afterwards.
        """
        if closure is not None:
            raise NotImplementedError("HybridZeroOptimizer.step does not take a closure")
        scale = self._scaler.scale
        self._record.begin(scale)
        local = self._prepare_grads()
        if local is None:
            self._end_step(False, float("inf"))
            return False, float("inf")
        grad_norm, factor = self._clip(local, scale)
        self._update(factor)
        self._end_step(True, grad_norm)
        return True, grad_norm

    def _prepare_grads(self) -> torch.Tensor | None:
        """Finish the DP reduction; this rank's norms (or maxima) of it, None when any rank overflowed."""
        self._grads.finish()
        if self._observer is not None:
            self._observer.gradients(self.buckets, self._grads.reduce_scatter)
        local = self._norm.local()
        return None if self._norm.any_non_finite(local) else local

    def _clip(self, local: torch.Tensor, scale: float) -> tuple[float, float]:
        """The unscaled, DP-averaged global norm, and the factor that unscales, averages and clips."""
        dp = self.dp_size
        grad_norm = self._norm.norm(local) / (scale * dp)
        return grad_norm, (1.0 / (scale * dp)) * clip_factor(grad_norm, self._settings.clip_grad_norm)

    def _update(self, factor: float) -> None:
        """Scale this rank's grad shards by ``factor``, update the masters, publish them to the parameters."""
        grads = []
        for b in self.buckets:
            g = b.grad_shard
            grads.append(g.mul_(factor) if g.dtype == torch.float32 else g.float().mul_(factor))
        self._policy.update(self._optim, self.buckets, grads, self._observer)
        for b in self.buckets:
            b.publish_masters()

    def _end_step(self, success: bool, grad_norm: float) -> None:
        self._observer = None  # one step only
        counts = StepRecord.at_min_scale(self._scaler)  # before the scaler moves
        self._scaler.update(not success)
        self.zero_grad()
        self._record.end(success, grad_norm, counts, self._scaler)

    # ------------------------------------------------------------------ state (formats: state_format)
    def _partition_dims(self) -> dict[str, int | None]:
        return {n: partition_dim(p) for b in self.buckets for n, p in zip(b.names, b.params)}

    def _header(self, **extra: Any) -> dict[str, Any]:
        """What both state forms start with (``extra`` after the ZeRO size, as the formats list it)."""
        return {"dtype": self._model_dtype.name, "zero1_size": self.zero1_size, **extra,
                "scaler": self._scaler.state_dict(), "skipped_steps": self.skipped_steps, "num_steps": self.num_steps}

    def iter_full_masters(self) -> Iterator[tuple[str, nn.Parameter, torch.Tensor]]:
        """``(name, parameter, its fp32 master)`` for every parameter, TP-local and parameter-shaped (a copy),
        as ``state_dict()["master"]`` holds them, but one bucket at a time: one bucket's masters in memory, not
        the whole state. A collective over ZERO1 per bucket: every rank must run it to the end."""
        for b in self.buckets:
            yield from zip(b.names, b.params, b.full_masters())

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
        for b, group in zip(self.buckets, self._optim.param_groups):
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(b.names)})
            master.update(zip(b.names, b.full_masters()))
            inner = self._optim.state.get(b.master, {})
            per_param = b.full_states(inner)
            if inner:
                state.update(zip(b.names, per_param))
        return {"format": STATE_DICT_FORMAT, **self._header(), "param_groups": groups, "master": master,
                "state": state, "partition_dim": self._partition_dims()}

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
        for b, group in zip(self.buckets, self._optim.param_groups):
            missing = [n for n in b.names if n not in masters]
            if missing:
                raise KeyError(f"optimizer state dict has no master weight for {missing[:5]}")
            for n, p in zip(b.names, b.params):
                if tuple(masters[n].shape) != tuple(p.shape):
                    raise ValueError(
                        f"optimizer state dict: {n!r} has shape {tuple(masters[n].shape)}, this rank's parameter "
                        f"is {tuple(p.shape)} (reshard the tensor-parallel slices first)"
                    )
            b.load_full_masters([masters[n] for n in b.names])
            have = [n in states for n in b.names]
            if any(have) and not all(have):
                raise KeyError(f"optimizer state dict has state for only some parameters of a group "
                               f"(missing {[n for n, h in zip(b.names, have) if not h][:5]})")
            self._optim.state.pop(b.master, None)
            if all(have):
                self._optim.state[b.master] = b.shard_state_from_full([states[n] for n in b.names], group)
            saved = saved_groups.get(b.names[0])
            if saved is not None:
                group.update({k: v for k, v in saved.items() if k != "params"})
        self._restore_counters(state_dict)

    def shard_state_dict(self) -> dict[str, Any]:
        """This ZERO1 rank's part of the state: views of the live buffers (no collective, no copy).

        Layout::

            {"format": SHARD_FORMAT, "dtype": ..., "zero1_size": d, "zero1_rank": z, "scaler": {...},
             "skipped_steps": int, "num_steps": int, "partition_dim": {name: int | None},
             "buckets": [{"group": {<hyperparameters>}, "names": [...], "shapes": [[...]], "offsets": [...],
                          "lo": int, "hi": int,              # this shard = elements [lo, hi) of the bucket
                          "master": fp32 (hi - lo,), "state": {"exp_avg": (hi - lo,), ..., "step": 0-dim}}]}
        """
        buckets = [b.shard_record(group, self._optim.state.get(b.master, {}))
                   for b, group in zip(self.buckets, self._optim.param_groups)]
        return {"format": SHARD_FORMAT, **self._header(zero1_rank=self._groups.zero1.rank),
                "partition_dim": self._partition_dims(), "buckets": buckets}

    @torch.no_grad()
    def load_shards(self, source: ShardSource, *, publish: bool = True) -> None:
        """Fill this rank's masters and states from ``source``, reading only the element ranges this ZERO1
        rank owns, then rebuild the parameters (masters rounded to the model dtype, all-gathered over ZERO1).
        A collective over ZERO1 (every rank calls it); loads from saved shards of any DP/ZeRO layout.

        ``publish=False`` reads only (no collective) and leaves the rebuild to ``publish_parameters``, so a
        caller can let the ranks agree that every read succeeded first: a rank whose read failed would
        otherwise never join the all-gather the others wait in."""
        header = source.header
        if header.get("format") != SHARD_FORMAT:
            raise ValueError(f"not a HybridZeroOptimizer shard (format {header.get('format')!r}, "
                             f"expected {SHARD_FORMAT!r})")
        for b, group in zip(self.buckets, self._optim.param_groups):
            for n, p in zip(b.names, b.params):
                saved = source.shape(n)
                if saved is None:
                    raise KeyError(f"optimizer checkpoint has no master weight for {n!r}")
                if tuple(saved) != tuple(p.shape):
                    raise ValueError(f"optimizer checkpoint: {n!r} has shape {tuple(saved)}, this rank's parameter "
                                     f"is {tuple(p.shape)} (reshard the tensor-parallel slices first)")
            b.load_master_shard(source, publish=False)
            new_state = b.shard_state_from(source, group)
            self._optim.state.pop(b.master, None)
            if new_state is not None:
                self._optim.state[b.master] = new_state
            group.update(source.group(b.names[0]))
        self._restore_counters(header)
        if publish:
            self.publish_parameters()

    def publish_parameters(self) -> None:
        """Rebuild the parameters from the masters (rounded to the model dtype, all-gathered over ZERO1).
        A collective over ZERO1."""
        for b in self.buckets:
            b.publish_masters()

    def _restore_counters(self, saved: Mapping[str, Any]) -> None:
        self._scaler.load_state_dict(saved["scaler"])
        self._record.restore(saved.get("skipped_steps", 0), saved.get("num_steps", 0))

    # ------------------------------------------------------------------ introspection
    def memory_bytes(self) -> dict[str, int]:
        """Bytes of the tensors this process holds, by role, each storage counted once.

        weights: the parameters' storage; main_grads: main-grad buffers plus any live ``.grad``;
        masters: master slices that are not the parameters themselves; compensation: the Kahan buffers of
        bf16 masters; optimizer_states: the other state tensors (Adam moments). ``num_params``: parameters
        on this rank (TP-local).
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

        states = self._optim.state.values()
        out = {
            "weights": nbytes(self._params),
            "main_grads": nbytes([*self._grads.flat_buffers.values()]
                                 + [p.grad for p in self._params if p.grad is not None]),
            "masters": nbytes([b.master for b in self.buckets]),
            "compensation": nbytes(s["master_compensation"] for s in states if "master_compensation" in s),
            "optimizer_states": nbytes(v for s in states for v in s.values() if isinstance(v, torch.Tensor)),
        }
        out["num_params"] = sum(p.numel() for p in self._params)
        return out
