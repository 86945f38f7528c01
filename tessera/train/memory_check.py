"""Refuse a run that cannot fit, before anything is allocated.

The persistent state of a rank — weights, main grads, masters and optimizer states under the
configured optimizer precision, with ZeRO-1 sharding — has a closed form
(``precision_report.closed_form_bytes``) over this rank's parameters, counted exactly by building the
model on the meta device with the run's TP size and fp32 marks. The activations of one micro-batch
at their peak have another (``tessera.model.activations``, for checkpointing none / selective / full,
eager or compiled blocks; low-precision GEMMs add their operand copies, ``memory_extras
.low_precision_gemm_bytes``; fractional checkpointing is not covered and counts as zero). Both are checked against
a traced dry run by ``tools/plan.py`` and its tests. On CUDA two more terms count
(``tessera.train.memory_extras``): what SDPA keeps for packed rows and grouped KV heads when flash_attn
does not run, and a stated allowance for NCCL communicators and cuBLAS workspaces. The sum must fit in
``(1 - memory.headroom)`` of the memory available at launch: the CUDA context, kernels loaded on first
use and the allocator's fragmentation take the rest. Fast enough to run on every rank at launch; the
local ranks share a CPU's available memory; on CUDA each rank has its device's free memory.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tessera.config import check_model_sizes, parallel_sizes
from tessera.config.schema import DEFAULT_MEMORY_HEADROOM, default_of
from tessera.core.job import Job
from tessera.core.naive_amp import fp32_module_names, naive_amp_for
from tessera.model import build_model
from tessera.model.activations import activation_bytes
from tessera.model.args import ModelArgs
from tessera.model.compile import compiles_blocks
from tessera.model.flash_probe import flash_attn_available
from tessera.parallel import MetaGroup
from tessera.parallel.coordination import reduce_scalars
from tessera.precision.plan import PrecisionPlan
from tessera.precision.routes import current_capability
from tessera.train.memory_extras import communicators, low_precision_gemm_bytes, runtime_allowance, sdpa_extra_bytes
from tessera.train.precision_report import closed_form_bytes

__all__ = ["MetaCensus", "StatePlan", "meta_census", "param_counts", "plan_persistent_state", "available_bytes",
           "check_memory", "headroom_of"]

GIB = 2**30


@dataclass(frozen=True)
class StatePlan:
    tp: int
    zero1: int
    params_per_rank: int
    bytes_per_rank: float  # weights + main grads + masters + optimizer states
    activation_bytes: float = 0.0  # one micro-batch's activations at their peak (closed form; 0 if not covered)
    checkpoint: Any = False
    attention_bytes: float = 0.0  # CUDA: SDPA's packed-row masks and expanded GQA K/V (memory_extras)
    runtime_bytes: float = 0.0  # CUDA: NCCL communicators + cuBLAS workspaces, a stated allowance
    communicators: int = 0  # NCCL communicators in runtime_bytes
    activation_kept: float = 0.0  # what the activations hold at the end of a forward (closed form's ``kept``)

    @property
    def need(self) -> float:
        return self.bytes_per_rank + self.activation_bytes + self.attention_bytes + self.runtime_bytes


def headroom_of(cfg: Mapping[str, Any]) -> float:
    """``memory.headroom`` of a config (a partial dict without the section gets the default)."""
    return float((cfg.get("memory") or {}).get("headroom", DEFAULT_MEMORY_HEADROOM))


@dataclass(frozen=True)
class MetaCensus:
    """What a meta build of the decoder with the run's precision says about TP rank 0."""

    low_params: int  # parameters stored in the model dtype
    fp32_params: int  # parameters kept fp32 (fp32 marks, or an fp32/tf32 model)
    attention_dtypes: tuple[torch.dtype, ...]  # q/k/v dtype per layer: fp32 where a mark covers the attention


@functools.lru_cache(maxsize=32)
def _census_cached(model_json: str, tp: int, precision: PrecisionPlan) -> MetaCensus:
    model_cfg = json.loads(model_json)
    with torch.device("meta"):
        model = build_model(model_cfg, tp_group=MetaGroup(tp), seed=0, device="meta", tensor_rng=None)
    amp = naive_amp_for(model, precision, sync_buffer=False)  # the run's dtype and fp32 marks, resolved here
    params = {id(p): p for p in amp.parameters()}.values()
    fp32_names = fp32_module_names(amp)
    layers = ModelArgs.from_config(model_cfg).num_layers
    attention = tuple(torch.float32 if f"layers.{i}.attention" in fp32_names else precision.dtype
                      for i in range(layers))
    return MetaCensus(sum(p.numel() for p in params if p.dtype != torch.float32),
                      sum(p.numel() for p in params if p.dtype == torch.float32), attention)


def meta_census(model_cfg: Mapping[str, Any], tp: int, precision: PrecisionPlan) -> MetaCensus:
    """Parameters of TP rank 0 by dtype and each layer's attention dtype, counted on a meta build with the
    run's fp32 marks (cached: the search and the refusal's options ask for the same TP sizes again)."""
    return _census_cached(json.dumps(dict(model_cfg), sort_keys=True, default=str), tp, precision)


def param_counts(model_cfg: Mapping[str, Any], tp: int, precision: PrecisionPlan) -> tuple[int, int]:
    """(model-dtype, fp32) parameters of TP rank 0 (``meta_census``)."""
    census = meta_census(model_cfg, tp, precision)
    return census.low_params, census.fp32_params


def head_wgrad_fused(cfg: Mapping[str, Any], device_type: str, precision: PrecisionPlan) -> bool:
    """Whether the fused head's backward adds its weight gradient straight into the fp32 main gradient
    (``tessera.parallel.wgrad``): the setting is on, main grads are fp32, and the device has an fp32-output
    GEMM for the head's operands (CUDA; on a CPU only fp32 ones are counted, the safe side)."""
    zero = cfg.get("hybrid_zero_optimizer") or {}
    on = bool(zero.get("fuse_wgrad_accumulation", default_of("hybrid_zero_optimizer.fuse_wgrad_accumulation")))
    fp32_grads = zero.get("reduce_dtype", default_of("hybrid_zero_optimizer.reduce_dtype")) == "fp32"
    return on and fp32_grads and (device_type != "cpu" or precision.dtype == torch.float32)


def blocks_compiled(cfg: Mapping[str, Any], device_type: str) -> bool:
    """Whether the run's blocks are compiled (``tessera.model.compile.compiles_blocks``): they keep fewer
    activations, and the fused head's chunk math is compiled with them."""
    metrics = cfg.get("metrics") or {}
    compile_cfg = (cfg.get("model") or {}).get("compile") or {}
    setting = compile_cfg.get("enabled", default_of("model.compile.enabled"))
    hooks = bool(metrics.get("precision_every", default_of("metrics.precision_every"))
                 and metrics.get("precision_activations", default_of("metrics.precision_activations")))
    return compiles_blocks(setting, device_type, hooks)


def plan_persistent_state(cfg: Mapping[str, Any], world_size: int, tp: int, zero1: int,
                          checkpoint: Any = None, device_type: str = "cpu",
                          flash_installed: bool | None = None, precision: PrecisionPlan | None = None,
                          capability: tuple[int, int] | None = None) -> StatePlan:
    """Persistent bytes of TP rank 0 (the largest: it also holds its share of replicated norms), and the
    activation peak of one micro-batch (``checkpoint``: the config's ``model.checkpoint`` by default).
    On ``device_type`` "cuda" also SDPA's extra tensors (``flash_installed``: whether flash_attn runs
    there; None: whether it is installed here) and the communicator and workspace allowance.
    ``precision``: the run's (a launched Job's); None resolves the config's. ``capability``: the CUDA device's
    (the planner's ``--gpu``; None: this process's device), which decides the fp8 route (``precision.routes``)."""
    _, dp, zero1 = parallel_sizes(world_size, tp, zero1)
    precision = precision or PrecisionPlan.from_config(cfg)
    model_cfg = dict(cfg["model"])
    census = meta_census(model_cfg, tp, precision)
    low, fp32 = census.low_params, census.fp32_params
    per_param = closed_form_bytes(precision, zero1, low, fp32)
    checkpoint = model_cfg.get("checkpoint", False) if checkpoint is None else checkpoint
    data, mode = cfg.get("data") or {}, ((cfg.get("parallel") or {}).get("tensor") or {}).get("mode", "mtp")
    act = kept = 0.0
    compiled = blocks_compiled(cfg, device_type)
    if checkpoint in (False, True, "selective") and data:
        chunk = int((cfg.get("loss") or {}).get("chunk_tokens", default_of("loss.chunk_tokens")))
        forms = activation_bytes(model_cfg, data["micro_bsz"], data["seq_len"], tp, mode, checkpoint,
                                 precision.dtype, chunk, head_wgrad_fused(cfg, device_type, precision), compiled)
        capability = current_capability(device_type) if capability is None else capability
        act = forms["peak"] + low_precision_gemm_bytes(model_cfg, data, tp, precision.gemms, device_type, capability)
        kept = forms["kept"]
    attention = 0.0
    if device_type == "cuda" and data:
        flash = flash_attn_available() if flash_installed is None else flash_installed
        attention = sum(sdpa_extra_bytes({"model": model_cfg, "data": data}, tp, checkpoint, flash,
                                         list(census.attention_dtypes)).values())
    runtime = sum(runtime_allowance(world_size, tp, dp, zero1, device_type).values())
    comms = communicators(world_size, tp, dp, zero1) if device_type == "cuda" else 0
    return StatePlan(tp, zero1, low + fp32, per_param["total"] * (low + fp32), act, checkpoint, attention, runtime,
                     comms, kept)


def available_bytes(device: torch.device) -> tuple[float, str]:
    """Memory this rank may use: the GPU's free memory, or the host's available memory shared by the
    ranks of this node."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return float(free), f"free on {torch.cuda.get_device_name(device)}"
    per_node = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE", "1")
    digits = re.match(r"\d+", per_node)  # slurm: "8(x2)"
    local = int(digits.group(0)) if digits else 1
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if ":" in line}
    except OSError:  # not Linux: nothing to compare with
        return float("inf"), "unknown (no /proc/meminfo)"
    avail = info.get("MemAvailable", info.get("MemFree", 0))
    return avail / local, f"available host memory / {local} local rank(s)"


def _layouts_that_fit(cfg: Mapping[str, Any], world_size: int, limit: float, device_type: str,
                      precision: PrecisionPlan) -> list[StatePlan]:
    fits = []
    for tp in (t for t in range(1, world_size + 1) if world_size % t == 0):
        try:
            check_model_sizes(cfg["model"], tp)
        except ValueError:  # ConfigError included: heads / vocab / FFN do not split over tp
            continue
        dp = world_size // tp
        for zero1 in sorted({1, dp}):
            for checkpoint in ((False, "selective", True) if cfg["model"].get("checkpoint") is False else (None,)):
                plan = plan_persistent_state(cfg, world_size, tp, zero1, checkpoint, device_type,
                                             precision=precision)
                if plan.need <= limit:
                    fits.append(plan)
                    break  # the least recomputation that fits
    return fits


def check_memory(cfg: Mapping[str, Any], job: Job) -> str | None:
    """None when this rank's planned need fits in ``(1 - memory.headroom)`` of its available memory, else the
    message to stop with (same on all ranks: the verdict is agreed over the default group, on the device its
    backend serves). The layout, device and precision are the launched ``job``'s."""
    lay, device = job.layout, job.device
    plan = plan_persistent_state(cfg, lay.world_size, lay.tp_size, lay.zero1_size, device_type=device.type,
                                 precision=job.precision)
    avail, where = available_bytes(device)
    headroom = headroom_of(cfg)
    limit = avail * (1 - headroom)
    too_big = plan.need > limit
    options = _layouts_that_fit(cfg, lay.world_size, limit, device.type, job.precision) if too_big else []
    if dist.is_initialized():  # every rank stops together, or none does
        too_big = bool(reduce_scalars([int(too_big)], None, op=dist.ReduceOp.MAX, dtype=torch.int32)[0])
    if not too_big:
        return None
    return _refusal(cfg, plan, avail, where, headroom, options)


def _refusal(cfg: Mapping[str, Any], plan: StatePlan, avail: float, where: str, headroom: float,
             options: list[StatePlan]) -> str:
    hint = ("; layouts of these ranks that would fit: " + ", ".join(
        f"parallel.tensor.size={p.tp} parallel.zero1.size={p.zero1}"
        + (f" model.checkpoint={p.checkpoint!r}" if p.checkpoint != cfg["model"].get("checkpoint", False) else "")
        + f" ({p.need / GIB:.1f} GiB)" for p in options) if options
        else "; no TP x ZeRO-1 layout of these ranks fits: use more ranks or memory")
    act = (f" + activations {plan.activation_bytes / GIB:.1f} GiB at their peak (micro_bsz x seq_len, "
           f"model.checkpoint={plan.checkpoint!r})" if plan.activation_bytes else " (activations not estimated)")
    if plan.attention_bytes:
        act += f" + SDPA's packed-row masks and expanded GQA K/V {plan.attention_bytes / GIB:.1f} GiB (no flash_attn)"
    if plan.runtime_bytes:
        act += (f" + {plan.runtime_bytes / GIB:.1f} GiB allowed for {plan.communicators} NCCL communicator(s) and "
                "cuBLAS workspaces")
    return (f"training needs {plan.need / GIB:.1f} GiB per rank: the persistent training state "
            f"{plan.bytes_per_rank / GIB:.1f} GiB ({plan.params_per_rank:,} parameters on this rank, tp={plan.tp}, "
            f"zero1={plan.zero1}, weights + main grads + masters + optimizer states){act}; only "
            f"{avail * (1 - headroom) / GIB:.1f} GiB may be planned: {avail / GIB:.1f} GiB is available ({where}), "
            f"less memory.headroom={headroom:g} for the CUDA context and fragmentation{hint}. tools/plan.py --search "
            "ranks layouts; train.py --skip-memory-check starts anyway.")
