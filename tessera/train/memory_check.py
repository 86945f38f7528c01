"""Refuse a run that cannot fit, before anything is allocated.

The need of a rank is the memory model's (``tessera.memory``): ``plan_persistent_state`` sums the closed forms
of the persistent training state, one micro-batch's activations at their peak and, on CUDA, SDPA's extra tensors
and the allowance for NCCL communicators and cuBLAS workspaces, for the launched job's layout, device and
precision. Both closed forms are checked against a traced dry run by ``tools/plan.py`` and its tests. The sum
must fit in ``(1 - memory.headroom)`` of the memory available at launch: the CUDA context, kernels loaded on
first use and the allocator's fragmentation take the rest. Fast enough to run on every rank at launch; the
local ranks share a CPU's available memory; on CUDA each rank has its device's free memory.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from tessera.config import check_model_sizes
from tessera.core.job import Job
from tessera.memory.estimate import StatePlan, headroom_of, plan_persistent_state
from tessera.parallel.coordination import reduce_scalars
from tessera.precision.plan import PrecisionPlan

__all__ = ["available_bytes", "check_memory"]

GIB = 2**30


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
