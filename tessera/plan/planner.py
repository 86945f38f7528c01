"""Plans: one layout traced by a dry run beside its closed forms, and a search over layouts.

The search ranks layouts by the closed forms alone (they are checked against traced figures by the
tests and by every ``make_plan``), so it is fast enough to sweep; ``tools/plan.py --search`` then
traces the best layout that fits.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from tessera.config import Config, ConfigError, check_model_sizes
from tessera.memory.census import param_counts
from tessera.memory.estimate import gpu_extras, headroom_of
from tessera.model.flash_probe import flash_attn_available
from tessera.plan.report import Plan, _layout, closed_form_plan, gpu_spec, plan_notes, step_flops_per_rank
from tessera.precision.plan import PrecisionPlan

__all__ = ["make_plan", "search_layouts", "Candidate", "with_layout"]


def make_plan(cfg: Config, world: int, *, config_name: str = "config", gpu: str | None = None, mfu: float = 0.4,
              headroom: float | None = None, trace: bool = True, rank: int = 0, counts: tuple[int, int] | None = None,
              flash_attn: bool | None = None, memory_gib: float | None = None, memory_source: str = "given"
              ) -> Plan:
    """The plan of ``cfg`` on ``world`` ranks: closed forms, and (``trace``) one dry-run iteration.

    The verdict compares the peak with ``memory_gib`` per GPU (named by ``memory_source`` in the verdict) or,
    without it, the datasheet memory of ``gpu``; with neither there is no verdict (``Plan.fits`` is None).
    ``headroom``: the share of the GPU's memory left unplanned (None: the config's ``memory.headroom``).
    ``flash_attn``: whether flash_attn is installed on the planned GPU (None: whether it is here); without
    it, packed rows and grouped KV heads cost SDPA's masks and K/V copies, counted in both columns.
    """
    flash = flash_attn_available() if flash_attn is None else flash_attn
    lay, shape = _layout(cfg, world, rank)
    mem, comm, low, fp32 = closed_form_plan(cfg, lay, shape, counts, flash)
    extras = gpu_extras(cfg, lay, shape.micro_bsz, shape.seq_len, shape.checkpoint, shape.precision, flash)
    plan = Plan(config_name, lay, shape, low + fp32, closed_form=mem, comm_closed_form=comm,
                flops_per_rank=step_flops_per_rank(cfg, lay, shape), mfu=mfu,
                headroom=headroom_of(cfg) if headroom is None else headroom,
                notes=plan_notes(cfg, lay, flash, extras))
    if gpu:
        plan.gpu = gpu
        plan.gpu_memory, plan.peak_tflops = gpu_spec(gpu, shape.precision.name)
        plan.memory_source = f"{gpu} datasheet"
    if memory_gib is not None:
        plan.gpu_memory, plan.memory_source = memory_gib * 2**30, memory_source
    if trace:
        from tessera.plan.dry_run import dry_run

        t = dry_run(cfg, world, rank=rank)
        # SDPA's extras join the backward's peak (where the activations are); the allowance is there throughout
        attention, runtime = extras["sdpa_mask"] + extras["gqa_kv"], extras["nccl"] + extras["cublas"]
        plan.traced = {**{k: float(v) for k, v in t.persistent.items()}, "persistent": float(t.persistent_total),
                       "backward_extra": float(t.backward_extra), "optimizer_extra": float(t.optimizer_extra),
                       "comm_buffer": float(t.comm_buffer), "save_extra": float(t.save_extra), **extras,
                       "total_peak": float(max(t.backward_peak + attention, t.step_peak, t.save_peak) + runtime)}
        plan.comm_traced = {g: sum(v for k, v in kinds.items() if not k.endswith("_calls"))
                            for g, kinds in t.comm.items()}
    return plan


def with_layout(cfg: Config, **keys: Any) -> Config:
    """``cfg`` with layout keys replaced: tp, zero1, checkpoint, micro_bsz, micro_num."""
    d = copy.deepcopy(cfg.to_dict())
    for key, value in keys.items():
        section, name = {"tp": ("parallel", "tensor"), "zero1": ("parallel", "zero1"), "checkpoint": ("model", None),
                         "micro_bsz": ("data", None), "micro_num": ("data", None)}[key]
        if section == "parallel":
            d["parallel"][name]["size"] = value
        else:
            d[section][key] = value
    return Config.from_dict(d)


@dataclass
class Candidate:
    tp: int
    zero1: int
    checkpoint: Any
    micro_bsz: int
    micro_num: int
    peak: float
    step_time: float
    tokens_per_gpu_per_s: float

    def overrides(self) -> str:
        return (f"parallel.tensor.size={self.tp} parallel.zero1.size={self.zero1} "
                f"model.checkpoint={self.checkpoint!r} data.micro_bsz={self.micro_bsz} data.micro_num={self.micro_num}")


def search_layouts(cfg: Config, gpus: int, memory_gib: float, *, gpu: str = "h100", mfu: float = 0.4,
                   headroom: float | None = None, flash_attn: bool | None = None) -> list[Candidate]:
    """Layouts of ``gpus`` GPUs of ``memory_gib`` each that fit, best predicted throughput first.

    The global batch (rows per step) of the config on ``gpus`` GPUs is kept: ``micro_bsz * micro_num *
    (gpus / parallel.tensor.size)`` rows. Tried: every TP size that divides the GPUs and the model's
    heads / KV heads / FFN / vocab, ZeRO over 1 rank or all of DP, checkpointing none / selective / full,
    micro_bsz 1 to 16. Predicted time (``Plan.predicted_step_time``): FLOPs (with recomputation) at the
    GPU's peak x ``mfu``, plus the TP collectives and the ZeRO weight all-gather at link speed (the
    gradient reduction overlaps the backward). ``headroom`` and ``flash_attn`` as for ``make_plan``.
    """
    headroom = headroom_of(cfg) if headroom is None else headroom
    flash = flash_attn_available() if flash_attn is None else flash_attn
    rows = cfg.data.micro_bsz * cfg.data.micro_num * max(1, gpus // cfg.parallel.tensor.size)
    precision = PrecisionPlan.from_config(cfg)
    out: list[Candidate] = []
    for tp in [t for t in range(1, gpus + 1) if gpus % t == 0]:
        try:
            check_model_sizes(cfg.model, tp)
        except (ValueError, ConfigError):
            continue
        dp = gpus // tp
        counts = param_counts(cfg.model, tp, precision)
        if rows % dp:
            continue
        per_replica = rows // dp
        if cfg.parallel.tensor.mode == "msp" and cfg.data.seq_len % tp:
            continue
        for zero1 in sorted({1, dp}):
            for checkpoint in (False, "selective", True):
                for mb in (m for m in (1, 2, 4, 8, 16) if per_replica % m == 0):
                    c = with_layout(cfg, tp=tp, zero1=zero1, checkpoint=checkpoint, micro_bsz=mb,
                                    micro_num=per_replica // mb)
                    plan = make_plan(c, gpus, gpu=gpu, mfu=mfu, headroom=headroom, trace=False, counts=counts,
                                     flash_attn=flash)
                    peak = plan.closed_form.get("total_peak")
                    if peak is None or peak > memory_gib * 2**30 * (1 - headroom):
                        continue
                    time, tokens = plan.predicted_step_time, plan.tokens_per_gpu_per_s
                    assert time is not None and tokens is not None  # a named GPU: its peak gives a time
                    out.append(Candidate(tp, zero1, checkpoint, mb, per_replica // mb, peak, time, tokens))
    # best throughput; among equals the least memory
    out.sort(key=lambda c: (-round(c.tokens_per_gpu_per_s, 6), c.peak))
    return out
