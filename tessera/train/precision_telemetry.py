"""Per-module precision telemetry: where the low-precision formats lose information, in the step that ran.

Every ``metrics.precision_every`` steps the trainer measures, per row (``metrics.precision_group``: each
module owning parameters, each layer, or each kind of module across layers), the quantities of
``MEASURES``: gradient underflow, zeros, overflow and amax against the dtype's range; the update's size
against the weight's and the updates the master storage drops (or a low-precision weight would drop);
the module outputs' amax against their dtype's maximum; for fp8 linears the scale and the saturated and
flushed elements of their input; for block-format linears (mxfp8, nvfp4) the share of their input's scale
blocks that saturate or underflow and of its elements flushed to zero. The optimizer shows this object
its reduced gradients and each chunk of its update (``tessera.optim.step_observer``); forward hooks watch
the module outputs, and fp8 and block-format linears call back from their quantization. Hooks exist only
during a measured step.

Counting over the job (one element is counted exactly once, wherever it lives): a gradient or update
element is counted by the ZeRO rank that owns its shard, in the first ZeRO group of its DP group only
(the others are DP replicas); a TP-replicated parameter on TP rank 0 only, a TP-sharded one on every TP
rank (its slices). Activations differ over DP (other data): every DP rank counts, TP-replicated inputs
on TP rank 0 only, maxima over everyone. Every rank packs its counters into one float64 vector, ONE
all-gather over the job on the training device brings every rank's vector to every rank, which sums
the counts and takes the maxima, and ONE host read gives the figures. When the telemetry is off, none
of this exists (the builder creates no telemetry object).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from tessera.optim.bucket import Bucket
from tessera.optim.groups import GroupComm
from tessera.optim.hybrid_zero import HybridZeroOptimizer
from tessera.parallel.attrs import is_tensor_parallel
from tessera.parallel.block_formats import BLOCK_RECIPES, BlockStats
from tessera.parallel.comm import to_host
from tessera.parallel.layers import ColumnParallelLinear, RowParallelLinear

__all__ = ["MEASURES", "Measure", "PrecisionTelemetry", "group_name"]


@dataclass(frozen=True)
class Measure:
    """One figure per row and measured step; ``log_scale``: plotted as log10; ``higher_is_worse``: the tool's
    ranking of the worst rows."""

    name: str
    log_scale: bool
    higher_is_worse: bool
    doc: str


MEASURES: dict[str, Measure] = {m.name: m for m in (
    Measure("grad_underflow", False, True,
            "of the non-zero gradient elements, the fraction below the smallest normal number of the parameter's "
            "dtype (zero or subnormal there): 0 < |g| < finfo.tiny"),
    Measure("grad_zero", False, True, "fraction of the gradient elements that are exactly zero"),
    Measure("grad_overflow", False, True,
            "fraction of the gradient elements that are inf/NaN or beyond the parameter dtype's largest value"),
    Measure("grad_amax_ratio", True, True, "largest |gradient| / the parameter dtype's largest value"),
    Measure("update_rms_ratio", True, True, "RMS of the update / RMS of the weight it was applied to"),
    Measure("update_lost", False, True,
            "of the non-zero updates, the fraction the master storage dropped: the stored master (and its Kahan "
            "compensation) kept its old bits"),
    Measure("update_below_half_ulp", False, True,
            "of the non-zero updates, the fraction below half an ulp of the weight in the parameter's dtype (bf16 "
            "for a bf16 model): what bf16 masters without compensation would drop"),
    Measure("act_amax_ratio", True, True,
            "largest |output| of the module / the largest value of the dtype the output leaves in"),
    Measure("fp8_scale", True, False, "the e4m3 scale of the fp8 linear's input (the smallest over rows and ranks)"),
    Measure("fp8_saturated", False, True, "fraction of the fp8 input elements at the format's largest magnitude"),
    Measure("fp8_underflow", False, True, "of the non-zero fp8 input elements, the fraction that became zero"),
    Measure("block_saturated", False, True,
            "of the scale blocks of a block-format linear's input (mxfp8, nvfp4), the fraction whose scale is above "
            "the scale format's range or not finite"),
    Measure("block_underflow", False, True,
            "of the scale blocks of a block-format linear's input, the fraction of non-zero blocks whose scale is "
            "below the scale format's range (clamped up: small elements lose bits)"),
    Measure("block_flushed", False, True,
            "of a block-format linear's input elements, the fraction that are non-zero and quantize to zero"),
)}

# summed counters per row, then maxima per row (the packed vector is [rows x _SUMS] + [rows x _MAXES])
_SUMS = ("g_n", "g_nonzero", "g_under", "g_over", "u_nonzero", "u_lost", "u_sub", "u_sq", "w_sq",
         "f_n", "f_nonzero", "f_sat", "f_under", "b_n", "b_sat", "b_under", "e_n", "e_flushed")
_MAXES = ("g_amax", "a_amax", "f_inv_scale")
S = {k: i for i, k in enumerate(_SUMS)}
M = {k: i for i, k in enumerate(_MAXES)}
_PIECE = 1 << 22  # elements per gradient reduction: bounds the temporaries on a logged step
_UNSEEN = -1.0  # a maximum nobody reported (every real one is >= 0 or NaN)


def group_name(module: str, group_by: str) -> str:
    """The row a module belongs to: itself, its layer (``layers.3``) or its kind across layers
    (``layers.*.attention.wq``); parameters of the model itself are ``(model)``."""
    if not module:
        return "(model)"
    parts = module.split(".")
    if group_by == "layer":
        return ".".join(parts[:2] if len(parts) > 1 and parts[1].isdigit() else parts[:1])
    if group_by == "kind":
        return ".".join("*" if p.isdigit() else p for p in parts)
    return module


class _Segment(NamedTuple):
    """Master-shard elements ``[start, stop)`` of one parameter, counted on this rank, in row ``row``."""

    start: int
    stop: int
    row: int
    dtype: torch.dtype


def _rank(group: Any) -> int:
    return dist.get_rank(group) if group is not None else 0


class PrecisionTelemetry:
    """Measures one training step in ``every`` (see the module docstring); the trainer drives it:
    ``due`` -> ``begin`` -> forward/backward/``step`` -> ``detach`` -> ``finish``."""

    def __init__(self, model: nn.Module, optimizer: HybridZeroOptimizer, *, every: int, group_by: str = "module",
                 activations: bool = True, tp_group: Any = None, dp_group: Any = None, world_group: Any = None,
                 device: torch.device | str = "cpu") -> None:
        if every < 1:
            raise ValueError(f"metrics.precision_every must be >= 1 to build the telemetry, got {every}")
        self.every, self.group_by, self.optimizer = every, group_by, optimizer
        self.device = torch.device(device)
        owners = [n for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))]
        self.rows: list[str] = list(dict.fromkeys(group_name(n, group_by) for n in owners))
        row_of = {n: self.rows.index(group_name(n, group_by)) for n in owners}
        self._modules = [(m, row_of[n]) for n, m in model.named_modules() if n in row_of] if activations else []
        strays = [n for b in optimizer.buckets for n in b.names if n.rpartition(".")[0] not in row_of]
        if strays:
            raise ValueError(f"PrecisionTelemetry: the optimizer's parameter {strays[0]!r} belongs to no module of the "
                             "model given; pass the model whose parameter names the optimizer uses (the unwrapped one)")
        tp_rank = _rank(tp_group)
        self._dp = optimizer.dp_size
        replica = _rank(dp_group) // optimizer.zero1_size > 0  # not the first ZeRO group of its DP group
        self._tp_first = tp_rank == 0
        self._segments = [self._bucket_segments(b, row_of, replica, tp_rank) for b in optimizer.buckets]
        if world_group is None and dist.is_initialized() and dist.get_world_size() > 1:
            world_group = dist.group.WORLD
        self._world = GroupComm.of(world_group, "world group") if world_group is not None else None
        self._hooks: list[Any] = []
        self._sum: torch.Tensor | None = None  # the counters, allocated at the first measured step
        self._max: torch.Tensor | None = None
        self._host = [[0.0] * len(_SUMS) for _ in self.rows]
        self._scale = 1.0
        self._skipped_before = 0

    @staticmethod
    def _bucket_segments(b: Bucket, row_of: dict[str, int], replica: bool, tp_rank: int) -> list[_Segment]:
        """The pieces of this rank's shard of ``b`` it counts (none on a DP replica)."""
        out = []
        for i, a, z in b.shard_pieces():
            p = b.params[i]
            if replica or not (is_tensor_parallel(p) or tp_rank == 0):
                continue
            start = b.offsets[i] + a - b.lo
            out.append(_Segment(start, start + z - a, row_of[b.names[i].rpartition(".")[0]], p.dtype))
        return out

    # ------------------------------------------------------------------ the step
    def due(self, step: int) -> bool:
        """Whether optimizer step ``step`` (counted from 1) is measured."""
        return step % self.every == 0

    def begin(self) -> None:
        """Arm the optimizer's observer and the forward hooks for the next training step."""
        rows = len(self.rows)
        if self._sum is None:
            self._sum = torch.zeros(rows, len(_SUMS), dtype=torch.float64, device=self.device)
            self._max = torch.empty(rows, len(_MAXES), dtype=torch.float64, device=self.device)
        assert self._max is not None
        self._sum.zero_()
        self._max.fill_(_UNSEEN)
        self._host = [[0.0] * len(_SUMS) for _ in range(rows)]
        for segments in self._segments:
            for seg in segments:
                self._host[seg.row][S["g_n"]] += seg.stop - seg.start
        self._scale = self.optimizer.loss_scale
        self._skipped_before = self.optimizer.skipped_steps
        self.optimizer.observe_next_step(self)
        for module, row in self._modules:
            self._hooks.append(module.register_forward_hook(self._output_hook(row)))
            recipe = getattr(module, "fp8_recipe", None)
            if recipe in BLOCK_RECIPES:
                module.block_observe = self._block_observer(module, row, BLOCK_RECIPES[recipe][1])
            elif recipe is not None:
                module.fp8_observe = self._fp8_observer(module, row)

    def detach(self) -> None:
        """Remove the hooks (after the step, or when it raised); no collective."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for module, _ in self._modules:
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                module.fp8_observe = None
                module.block_observe = None
        self.optimizer.observe_next_step(None)

    def finish(self) -> dict[str, Any]:
        """The measured step's figures, reduced over the job: one all-gather and one host read (every rank
        calls it). ``{"group_by", "loss_scale", "skipped_steps", "step_skipped", "elements": {row: parameter
        elements, each counted once over the job}, "measures": {name: {row: value}}}``; a row is missing from
        a measure that has nothing to say about it."""
        assert self._sum is not None and self._max is not None, "finish() without begin()"
        host = torch.tensor(self._host, dtype=torch.float64, device=self.device)
        packed = torch.cat([(self._sum + host).flatten(), self._max.flatten()])
        n_sum = self._sum.numel()
        if self._world is not None and self._world.size > 1:
            every = self._world.gather_full(packed).view(self._world.size, -1)
            packed = torch.cat([every[:, :n_sum].sum(0), every[:, n_sum:].amax(0)])
        values = to_host(packed)
        sums = [values[r * len(_SUMS) : (r + 1) * len(_SUMS)] for r in range(len(self.rows))]
        maxes = [values[n_sum + r * len(_MAXES) : n_sum + (r + 1) * len(_MAXES)] for r in range(len(self.rows))]
        measures: dict[str, dict[str, float]] = {name: {} for name in MEASURES}
        for row, s, m in zip(self.rows, sums, maxes):
            for name, value in _figures(s, m).items():
                measures[name][row] = value
        skipped = self.optimizer.skipped_steps
        return {"group_by": self.group_by, "loss_scale": self._scale, "skipped_steps": skipped,
                "step_skipped": skipped > self._skipped_before,
                "elements": {row: int(s[S["g_n"]]) for row, s in zip(self.rows, sums)},
                "measures": {k: v for k, v in measures.items() if v}}

    # ------------------------------------------------------------------ StepObserver (called by the optimizer)
    @torch.no_grad()
    def gradients(self, buckets: Sequence[Bucket], reduce_scattered: bool) -> None:
        """Count this rank's segments of the DP-reduced main grads, as one rank's backward held them (the
        DP sum over ``dp``), against the thresholds of each parameter's dtype."""
        assert self._sum is not None and self._max is not None
        dp = self._dp
        for b, segments in zip(buckets, self._segments):
            for seg in segments:
                info = torch.finfo(seg.dtype)
                for a in range(seg.start, seg.stop, _PIECE):
                    g = b.grad_flat[b.lo + a : b.lo + min(a + _PIECE, seg.stop)]
                    mag = g.abs()
                    nonzero = mag > 0
                    counts = torch.stack([nonzero.sum(), (nonzero & (mag < info.tiny * dp)).sum(),
                                          (~torch.isfinite(mag) | (mag > info.max * dp)).sum()])
                    self._sum[seg.row, S["g_nonzero"] : S["g_over"] + 1] += counts
                    amax = mag.max().double() / (info.max * dp)
                    self._max[seg.row, M["g_amax"]] = torch.maximum(self._max[seg.row, M["g_amax"]], amax)

    @torch.no_grad()
    def update(self, bucket: int, start: int, stop: int, update: torch.Tensor, before: torch.Tensor,
               unchanged: torch.Tensor) -> None:
        """Count the elements of this update chunk that lie in segments this rank counts."""
        assert self._sum is not None
        for seg in self._segments[bucket]:
            a, z = max(seg.start, start), min(seg.stop, stop)
            if a >= z:
                continue
            u, w, kept = update[a - start : z - start], before[a - start : z - start], unchanged[a - start : z - start]
            moved = u != 0
            low = w.to(seg.dtype)  # the weight as the parameter's dtype holds it
            below = moved & ((low.float() + u).to(seg.dtype) == low)
            counts = torch.stack([moved.sum(), (moved & kept).sum(), below.sum()]).double()
            self._sum[seg.row, S["u_nonzero"] : S["u_sub"] + 1] += counts
            self._sum[seg.row, S["u_sq"]] += torch.linalg.vector_norm(u, dtype=torch.float64).square()
            self._sum[seg.row, S["w_sq"]] += torch.linalg.vector_norm(w, dtype=torch.float64).square()

    # ------------------------------------------------------------------ forward hooks
    def _output_hook(self, row: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            t = output[0] if isinstance(output, (tuple, list)) and output else output
            if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.numel() == 0:
                return
            assert self._max is not None
            lo, hi = torch.aminmax(t.detach())
            ratio = torch.maximum(lo.abs(), hi.abs()).double() / torch.finfo(t.dtype).max
            self._max[row, M["a_amax"]] = torch.maximum(self._max[row, M["a_amax"]], ratio)

        return hook

    def _fp8_observer(self, module: nn.Module, row: int) -> Any:
        """The fp8 input's scale(s) and counts; a TP-split input (row-parallel) is counted on every TP rank,
        a replicated one on TP rank 0."""
        counted = self._tp_first or (isinstance(module, RowParallelLinear) and module.tp_size > 1)

        def observe(t: torch.Tensor, scale: torch.Tensor, q: torch.Tensor) -> None:
            assert self._sum is not None and self._max is not None
            inv = scale.reciprocal().max().double()
            self._max[row, M["f_inv_scale"]] = torch.maximum(self._max[row, M["f_inv_scale"]], inv)
            if not counted:
                return
            self._host[row][S["f_n"]] += t.numel()
            qf, nonzero = q.float(), t != 0
            counts = torch.stack([nonzero.sum(), (qf.abs() >= torch.finfo(q.dtype).max).sum(),
                                  (nonzero & (qf == 0)).sum()])
            self._sum[row, S["f_nonzero"] : S["f_under"] + 1] += counts

        return observe

    def _block_observer(self, module: nn.Module, row: int, block: int) -> Any:
        """A block format's input: its blocks' scale saturation and underflow and its flushed elements, counted
        as the fp8 input's are (a TP-split input on every TP rank, a replicated one on TP rank 0)."""
        counted = self._tp_first or (isinstance(module, RowParallelLinear) and module.tp_size > 1)

        def observe(t: torch.Tensor, stats: BlockStats) -> None:
            assert self._sum is not None
            if not counted:
                return
            blocks, n = t.numel() // block, t.numel()
            self._host[row][S["b_n"]] += blocks
            self._host[row][S["e_n"]] += n
            self._sum[row, S["b_sat"]] += stats.scale_saturated.double() * blocks
            self._sum[row, S["b_under"]] += stats.scale_underflow.double() * blocks
            self._sum[row, S["e_flushed"]] += stats.flushed_to_zero.double() * n

        return observe


def _figures(s: Sequence[float], m: Sequence[float]) -> dict[str, float]:
    """One row's measures from its reduced counters (a measure without data is left out)."""
    out: dict[str, float] = {}

    def frac(num: str, den: str, name: str) -> None:
        if s[S[den]] > 0:
            out[name] = s[S[num]] / s[S[den]]

    def seen(key: str) -> float | None:
        v = m[M[key]]
        return v if math.isnan(v) or v >= 0 else None

    if s[S["g_n"]] > 0:
        frac("g_under", "g_nonzero", "grad_underflow")
        out["grad_zero"] = 1.0 - s[S["g_nonzero"]] / s[S["g_n"]]
        frac("g_over", "g_n", "grad_overflow")
        amax = seen("g_amax")
        if amax is not None:
            out["grad_amax_ratio"] = amax
    if s[S["w_sq"]] > 0:
        out["update_rms_ratio"] = math.sqrt(s[S["u_sq"]] / s[S["w_sq"]])
    frac("u_lost", "u_nonzero", "update_lost")
    frac("u_sub", "u_nonzero", "update_below_half_ulp")
    act = seen("a_amax")
    if act is not None:
        out["act_amax_ratio"] = act
    inv = seen("f_inv_scale")
    if inv is not None:
        out["fp8_scale"] = 1.0 / inv if inv > 0 else math.inf
        frac("f_sat", "f_n", "fp8_saturated")
        frac("f_under", "f_nonzero", "fp8_underflow")
    frac("b_sat", "b_n", "block_saturated")
    frac("b_under", "b_n", "block_underflow")
    frac("e_flushed", "e_n", "block_flushed")
    return out
