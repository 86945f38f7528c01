"""What one rank needs, summed from the closed forms: the run's memory check and the plan's memory column.

The persistent state of a rank -- weights, main grads, masters and optimizer states under the configured
optimizer precision, with ZeRO-1 sharding -- has a closed form (``tessera.memory.persistent``) over this rank's
parameters, counted exactly by building the model on the meta device with the run's TP size and fp32 marks
(``tessera.memory.census``). The activations of one micro-batch at their peak have another
(``tessera.memory.activations``, for checkpointing none / selective / full, eager or compiled blocks;
low-precision GEMMs add their operand copies, ``tessera.memory.extras.low_precision_gemm_bytes``; fractional
checkpointing is not covered and counts as zero). On CUDA two more terms count (``tessera.memory.extras``):
what SDPA keeps for packed rows and grouped KV heads when flash_attn does not run, and a stated allowance for
NCCL communicators and cuBLAS workspaces.

``plan_persistent_state`` sums them for the run's check at launch (``tessera.train.memory_check``, which
compares the sum with the memory available); ``closed_form_memory`` gives the same terms row by row for the
plan (``tessera.plan.report``), where each sits beside a traced figure from a dry run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tessera.config import Config, RunConfig, parallel_sizes
from tessera.core.layout import Layout
from tessera.memory.activations import activation_bytes
from tessera.memory.census import meta_census, param_counts
from tessera.memory.extras import communicators, low_precision_gemm_bytes, runtime_allowance, sdpa_extra_bytes
from tessera.memory.persistent import ROLES, closed_form_bytes
from tessera.model.args import ModelArgs
from tessera.model.compile import compiles_blocks
from tessera.model.flash_probe import flash_attn_available
from tessera.precision.plan import PrecisionPlan, run_config_of
from tessera.precision.routes import current_capability

__all__ = ["StatePlan", "plan_persistent_state", "headroom_of", "head_wgrad_fused", "blocks_compiled",
           "gpu_extras", "closed_form_memory"]


@dataclass(frozen=True)
class StatePlan:
    tp: int
    zero1: int
    params_per_rank: int
    bytes_per_rank: float  # weights + main grads + masters + optimizer states
    activation_bytes: float = 0.0  # one micro-batch's activations at their peak (closed form; 0 if not covered)
    checkpoint: Any = False
    attention_bytes: float = 0.0  # CUDA: SDPA's packed-row masks and expanded GQA K/V (memory.extras)
    runtime_bytes: float = 0.0  # CUDA: NCCL communicators + cuBLAS workspaces, a stated allowance
    communicators: int = 0  # NCCL communicators in runtime_bytes
    activation_kept: float = 0.0  # what the activations hold at the end of a forward (closed form's ``kept``)

    @property
    def need(self) -> float:
        return self.bytes_per_rank + self.activation_bytes + self.attention_bytes + self.runtime_bytes


def headroom_of(cfg: RunConfig | Mapping[str, Any]) -> float:
    """``memory.headroom`` of a config (its typed view: a plain dict is validated, defaults filled)."""
    return float(run_config_of(cfg).memory.headroom)


def head_wgrad_fused(cfg: RunConfig | Mapping[str, Any], device_type: str, precision: PrecisionPlan) -> bool:
    """Whether the fused head's backward adds its weight gradient straight into the fp32 main gradient
    (``tessera.parallel.wgrad``): the setting is on, main grads are fp32, and the device has an fp32-output
    GEMM for the head's operands (CUDA; on a CPU only fp32 ones are counted, the safe side)."""
    zero = run_config_of(cfg).hybrid_zero_optimizer
    fp32_grads = zero.reduce_dtype == "fp32"
    return zero.fuse_wgrad_accumulation and fp32_grads and (device_type != "cpu" or precision.dtype == torch.float32)


def blocks_compiled(cfg: RunConfig | Mapping[str, Any], device_type: str) -> bool:
    """Whether the run's blocks are compiled (``tessera.model.compile.compiles_blocks``): they keep fewer
    activations, and the fused head's chunk math is compiled with them."""
    run = run_config_of(cfg)
    hooks = bool(run.metrics.precision_every and run.metrics.precision_activations)
    return compiles_blocks(run.model.compile.enabled, device_type, hooks)


def plan_persistent_state(cfg: RunConfig | Mapping[str, Any], world_size: int, tp: int, zero1: int,
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
    run = run_config_of(cfg)
    precision = precision or PrecisionPlan.from_run(run)
    model_cfg = run.model.as_dict()
    census = meta_census(model_cfg, tp, precision)
    low, fp32 = census.low_params, census.fp32_params
    per_param = closed_form_bytes(precision, zero1, low, fp32)
    checkpoint = run.model.checkpoint if checkpoint is None else checkpoint
    data, mode = run.data.as_dict(), run.parallel.tensor.mode
    act = kept = 0.0
    compiled = blocks_compiled(run, device_type)
    if checkpoint in (False, True, "selective"):
        forms = activation_bytes(model_cfg, run.data.micro_bsz, run.data.seq_len, tp, mode, checkpoint,
                                 precision.dtype, run.loss.chunk_tokens, head_wgrad_fused(run, device_type, precision),
                                 compiled)
        capability = current_capability(device_type) if capability is None else capability
        act = forms["peak"] + low_precision_gemm_bytes(model_cfg, data, tp, precision.gemms, device_type, capability)
        kept = forms["kept"]
    attention = 0.0
    if device_type == "cuda":
        flash = flash_attn_available() if flash_installed is None else flash_installed
        attention = sum(sdpa_extra_bytes({"model": model_cfg, "data": data}, tp, checkpoint, flash,
                                         list(census.attention_dtypes)).values())
    runtime = sum(runtime_allowance(world_size, tp, dp, zero1, device_type).values())
    comms = communicators(world_size, tp, dp, zero1) if device_type == "cuda" else 0
    return StatePlan(tp, zero1, low + fp32, per_param["total"] * (low + fp32), act, checkpoint, attention, runtime,
                     comms, kept)


def gpu_extras(cfg: Config, lay: Layout, micro_bsz: int, seq_len: int, checkpoint: Any, precision: PrecisionPlan,
               flash_installed: bool) -> dict[str, float]:
    """What a GPU rank of layout ``lay`` holds beyond the traced tensors (``tessera.memory.extras``): SDPA's
    packed-row masks and expanded GQA K/V at the activation peak (``sdpa_mask``, ``gqa_kv``; none where
    flash_attn runs every layer), and the allowance for NCCL communicators and cuBLAS workspaces (``nccl``,
    ``cublas``)."""
    data = {"micro_bsz": micro_bsz, "seq_len": seq_len, "pack_sample_into_one": cfg.data.pack_sample_into_one}
    dtypes = list(meta_census(cfg.model, lay.tp_size, precision).attention_dtypes)
    sdpa = sdpa_extra_bytes({"model": cfg.model, "data": data}, lay.tp_size, checkpoint, flash_installed, dtypes)
    runtime = runtime_allowance(lay.world_size, lay.tp_size, lay.dp_size, lay.zero1_size, "cuda")
    return {"sdpa_mask": sdpa["mask"], "gqa_kv": sdpa["gqa"], **runtime}


def closed_form_memory(cfg: Config, lay: Layout, micro_bsz: int, seq_len: int, checkpoint: Any, mode: str,
                       precision: PrecisionPlan, counts: tuple[int, int] | None = None,
                       flash_installed: bool = False) -> tuple[dict[str, float], int, int]:
    """(memory closed forms by row of the plan, model-dtype params, fp32 params) of TP rank 0 of ``lay`` on a GPU:
    the persistent state by role, the GPU extras (``gpu_extras``) and, where the activations have a closed form
    (no low-precision GEMMs), the backward's peak, the loss's fp32 logits, the largest collective's buffer and the
    total peak. ``counts``: the parameter counts when known (they depend on the model and the TP size only);
    ``flash_installed``: whether flash_attn runs on the planned GPU (else SDPA's extras count)."""
    low, fp32 = counts or param_counts(cfg.model, lay.tp_size, precision)
    n = low + fp32
    per = closed_form_bytes(precision, lay.zero1_size, low, fp32)
    mem = {role: per[role] * n for role in ROLES}
    mem["persistent"] = per["total"] * n
    extras = gpu_extras(cfg, lay, micro_bsz, seq_len, checkpoint, precision, flash_installed)
    mem.update(extras)
    tp = lay.tp_size
    if checkpoint in (False, True, "selective") and not precision.gemms.enabled:
        chunk = cfg.loss.chunk_tokens
        act = activation_bytes(cfg.model, micro_bsz, seq_len, tp, mode, checkpoint,
                               precision.dtype, chunk, head_wgrad_fused(cfg, "cuda", precision))
        v_t = ModelArgs.from_config(cfg.model).vocab_size // tp
        a_h = ModelArgs.from_config(cfg.model).hidden_size
        act_e = precision.dtype.itemsize
        mem["backward_extra"] = act["peak"]
        tokens = micro_bsz * seq_len  # the fp32 logits alive at once: all, or one fused chunk's
        mem["loss"] = 4.0 * min(tokens, chunk or tokens) * v_t
        # TP collectives work on the [micro_bsz x seq, hidden] activations in the model dtype: mtp's
        # all-reduce in place, msp's gather / reduce-scatter on the full tensor in chunks plus this rank's
        # chunk; the gradient reductions and ZeRO's weight gathers work in place in the persistent buffers
        full = float(micro_bsz * seq_len * a_h * act_e)
        mem["comm_buffer"] = 0.0 if tp == 1 else full * (1 + 1 / tp) if mode == "msp" else full
        mem["save_extra"] = 0.0  # views of the live buffers; copies go to host memory
        mem["total_peak"] = mem["persistent"] + act["peak"] + sum(extras.values())
    return mem, low, fp32
