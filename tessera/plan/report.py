"""The memory and time plan of one layout: traced figures from a dry run beside their closed forms.

Closed forms: memory from the memory model (``tessera.memory.estimate.closed_form_memory``: persistent state
per parameter, activations of one micro-batch), ring bytes of each collective, FLOPs per token
(``tessera.model.flops``). Both columns add what a GPU run holds beyond them, from the config
(``tessera.memory.extras``): SDPA's packed-row masks and expanded GQA K/V when flash_attn does not
run, and the allowance for NCCL communicators and cuBLAS workspaces. Step time is the FLOPs of one rank
divided by the GPU's datasheet peak at a stated MFU: a planning figure, not a measurement.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from tessera.config import Config
from tessera.config.schema import DEFAULT_MEMORY_HEADROOM
from tessera.core.layout import Layout
from tessera.hardware import GPU_BY_PLAN_NAME, GPUS_PER_NODE, INTER_NODE_BYTES_S, NVLINK_BYTES_S
from tessera.hardware import GPUS as HARDWARE
from tessera.memory.estimate import closed_form_memory
from tessera.memory.extras import MATMUL_STREAMS, MATMUL_WORKSPACE_BYTES, NCCL_COMMUNICATOR_BYTES, communicators
from tessera.model import flops_per_token
from tessera.model.args import ModelArgs
from tessera.parallel.sequence import TENSOR_MODES
from tessera.plan.tracker import ring_bytes
from tessera.precision.plan import PrecisionPlan
from tessera.train.metrics import gpu_peak_tflops

__all__ = ["GPUS", "StepShape", "Plan", "closed_form_plan", "step_flops_per_rank", "gpu_spec", "gpu_for_device_name",
           "plan_notes"]

GIB = 2**30

# --gpu name -> (memory in GiB as sold, the device name torch.cuda.get_device_name reports): the hardware table's
# rows that have a plan name (``tessera.hardware``)
GPUS: dict[str, tuple[float, str]] = {plan: (float(HARDWARE[name].memory_gib or 0.0), name)
                                      for plan, name in GPU_BY_PLAN_NAME.items()}


def gpu_for_device_name(device_name: str) -> str | None:
    """The ``GPUS`` key of a CUDA device name (``torch.cuda.get_device_name``), matched exactly, or None."""
    return next((key for key, (_, name) in GPUS.items() if name == device_name.strip()), None)


def gpu_spec(name: str, precision_name: str) -> tuple[float, float]:
    """(memory bytes, peak TFLOP/s at the model's precision) of a GPU of ``GPUS``."""
    key = name.lower()
    if key not in GPUS:
        raise ValueError(f"--gpu {name!r}: unknown; choose one of {', '.join(GPUS)}")
    mem_gib, device_name = GPUS[key]
    return mem_gib * GIB, float(gpu_peak_tflops(device_name, precision_name) or 0.0)


@dataclass(frozen=True)
class StepShape:
    """What a rank runs in one step beside its place in the rank layout (``tessera.core.layout.Layout``): the
    batch, the recomputation and the tensor-parallel mode."""

    micro_bsz: int
    micro_num: int
    seq_len: int
    checkpoint: Any
    mode: str
    precision: PrecisionPlan


def _layout(cfg: Config, world: int, rank: int = 0) -> tuple[Layout, StepShape]:
    """The rank layout of rank ``rank`` of ``cfg`` on ``world`` ranks, and its step shape."""
    lay = Layout.of(world, cfg.parallel.tensor.size, cfg.parallel.zero1.size, rank)
    return lay, StepShape(cfg.data.micro_bsz, cfg.data.micro_num, cfg.data.seq_len, cfg.model.checkpoint,
                          cfg.parallel.tensor.mode, PrecisionPlan.from_config(cfg))


def step_flops_per_rank(cfg: Config, lay: Layout, shape: StepShape) -> float:
    """Training FLOPs of one rank in one step, recomputation included (full: one more forward;
    selective: the attention core's forward again)."""
    tokens = shape.micro_bsz * shape.micro_num * shape.seq_len  # one DP replica's tokens, split over its TP ranks
    per_token = flops_per_token(cfg.model, shape.seq_len)
    a = ModelArgs.from_config(cfg.model)
    if shape.checkpoint is True:
        per_token += per_token / 3
    elif shape.checkpoint == "selective":
        per_token += 2 * 2 * shape.seq_len * a.num_attention_heads * a.head_dim * a.num_layers
    return per_token * tokens / lay.tp_size


# units of one all-gather or reduce-scatter of the [T, h] activations over TP (ring: (tp-1)/tp * T*h*E
# bytes; an all-reduce is two) per layer, by tensor mode and checkpointing. mtp: two all-reduces forward (after
# attention and MLP), two backward; msp: those become all-gather / reduce-scatter pairs, and backward
# re-gathers the two sequence chunks the column-parallel GEMMs kept. Recomputation repeats what it re-runs:
# selective re-runs the norms (under msp with their gathers), full re-runs the layer up to its last saved
# tensor (torch's non-reentrant checkpoint stops there, before the MLP's reduction).
_TP_UNITS_PER_LAYER = {("mtp", False): 8, ("mtp", "selective"): 8, ("mtp", True): 10,
                       ("msp", False): 10, ("msp", "selective"): 12, ("msp", True): 13}
# per micro-batch outside the layers: the embedding's reduction and the head input's gradient (msp:
# also the head's sequence gather, and its re-gather in backward unless the head is fused with the loss)
_TP_UNITS_OUTSIDE = {"mtp": 4, "msp": 5}


def comm_closed_form(cfg: Config, lay: Layout, shape: StepShape, low_params: int, fp32_params: int
                     ) -> dict[str, float]:
    """Bytes one rank sends per step, per group, for the large collectives (ring algorithms).

    TENSOR: ``_TP_UNITS_PER_LAYER`` and ``_TP_UNITS_OUTSIDE`` per micro-batch. ZERO1: the gradients
    reduce-scattered into the shards and the updated weights all-gathered. DATA: with ZeRO over fewer
    ranks than DP, the shards' all-reduce over the replicas.
    """
    a = ModelArgs.from_config(cfg.model)
    model = shape.precision.model
    e = model.dtype.itemsize
    t, d = lay.tp_size, lay.zero1_size
    T = shape.micro_bsz * shape.seq_len
    out: dict[str, float] = {}
    checkpoint = shape.checkpoint if shape.checkpoint in (False, True, "selective") else None
    if t > 1 and checkpoint is not None:
        mode = shape.mode if shape.mode in TENSOR_MODES else "mtp"
        # the fused head and loss keep the head's gathered input (msp): no re-gather in its backward
        outside = _TP_UNITS_OUTSIDE[mode] - (1 if mode == "msp" and cfg.loss.chunk_tokens else 0)
        units = a.num_layers * _TP_UNITS_PER_LAYER[(mode, checkpoint)] + outside
        out["TENSOR"] = shape.micro_num * units * ring_bytes("all_gather", T * a.hidden_size * e, t)
    low_w = e if model.is_low_precision else 4
    grad_bytes = (shape.precision.optimizer.reduce.itemsize if model.is_low_precision else 4) * low_params \
        + 4 * fp32_params
    weight_bytes = low_w * low_params + 4 * fp32_params
    if d > 1:
        gather = ring_bytes("all_gather", weight_bytes, d)  # after the step: not overlapped
        out["ZERO1"] = ring_bytes("reduce_scatter", grad_bytes, d) + gather
        out["ZERO1 weights all-gather"] = gather
    if lay.dp_size > d:  # replicas of a ZeRO group: an all-reduce of the shard over them
        out["DATA"] = ring_bytes("all_reduce", grad_bytes / d, lay.dp_size // d)
    return out


@dataclass
class Plan:
    """Per-rank memory (traced and closed form), communication and time of one layout."""

    config: str
    layout: Layout  # the rank this plan is about
    shape: StepShape
    params_per_rank: int
    traced: dict[str, float] = field(default_factory=dict)
    closed_form: dict[str, float] = field(default_factory=dict)
    comm_traced: dict[str, float] = field(default_factory=dict)
    comm_closed_form: dict[str, float] = field(default_factory=dict)
    flops_per_rank: float = 0.0
    gpu: str | None = None
    gpu_memory: float = 0.0  # bytes per GPU the plan is compared against (0: none, no verdict)
    memory_source: str = ""  # where ``gpu_memory`` came from, for the verdict ("h100 datasheet", "--gpu-memory")
    peak_tflops: float = 0.0
    mfu: float = 0.4
    headroom: float = DEFAULT_MEMORY_HEADROOM  # memory.headroom: the share of the GPU's memory left unplanned
    notes: list[str] = field(default_factory=list)  # how the plan was made (the attention path it assumed)

    @property
    def step_time(self) -> float | None:
        return self.flops_per_rank / (self.peak_tflops * 1e12 * self.mfu) if self.peak_tflops else None

    @property
    def tp_comm_time(self) -> float:
        """The TP collectives, on the critical path (not overlapped): their bytes at NVLink speed, or at
        the inter-node speed when a TP group spans nodes."""
        bw = NVLINK_BYTES_S if self.layout.tp_size <= GPUS_PER_NODE else INTER_NODE_BYTES_S
        return self.comm_closed_form.get("TENSOR", 0.0) / bw

    @property
    def zero_gather_time(self) -> float:
        """The ZeRO all-gather of the updated weights, after the step (the gradient reduction overlaps
        the backward): its bytes at NVLink speed, or at the inter-node speed when the job spans nodes."""
        bw = NVLINK_BYTES_S if self.layout.world_size <= GPUS_PER_NODE else INTER_NODE_BYTES_S
        return self.comm_closed_form.get("ZERO1 weights all-gather", 0.0) / bw

    @property
    def predicted_step_time(self) -> float | None:
        """Compute at the stated MFU plus the communication that does not overlap it."""
        return self.step_time + self.tp_comm_time + self.zero_gather_time if self.step_time else None

    @property
    def tokens_per_gpu_per_s(self) -> float | None:
        shape = self.shape
        t = self.predicted_step_time
        return shape.micro_bsz * shape.micro_num * shape.seq_len / self.layout.tp_size / t if t else None

    @property
    def peak(self) -> float:
        return self.traced.get("total_peak", self.closed_form.get("total_peak", 0.0))

    @property
    def fits(self) -> bool | None:
        return self.peak <= self.usable_memory if self.gpu_memory else None

    @property
    def usable_memory(self) -> float:
        """The bytes the peak may reach: the GPU's memory less the headroom."""
        return self.gpu_memory * (1 - self.headroom)

    def verdict(self) -> str | None:
        """One line, fits or does not fit, with the figures it compared; None without a memory to compare to."""
        if not self.gpu_memory:
            return None
        relation = "within" if self.fits else "exceeds"
        return (f"{'fits' if self.fits else 'does NOT fit'}: peak {self.peak / GIB:.2f} GiB per rank {relation} "
                f"{self.usable_memory / GIB:.2f} GiB usable of {self.gpu_memory / GIB:g} GiB per GPU "
                f"({self.memory_source or 'given'}; {self.headroom:.0%} kept free for the CUDA context and "
                "allocator fragmentation)")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(step_time_s=self.step_time, tp_comm_time_s=self.tp_comm_time,
                   zero_gather_time_s=self.zero_gather_time, predicted_step_time_s=self.predicted_step_time,
                   tokens_per_gpu_per_s=self.tokens_per_gpu_per_s, fits=self.fits,
                   peak_bytes=self.peak, verdict=self.verdict())
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, default=str)

    def format(self) -> str:
        lay, shape = self.layout, self.shape
        g = lambda b: f"{b / GIB:9.2f}" if b is not None else "        -"  # noqa: E731
        lines = [f"plan for {self.config}: world {lay.world_size} = tp {lay.tp_size} x dp {lay.dp_size}, zero1 "
                 f"{lay.zero1_size}, tensor mode {shape.mode}, checkpoint {shape.checkpoint!r}, micro_bsz "
                 f"{shape.micro_bsz} x micro_num {shape.micro_num} x seq {shape.seq_len}; {self.params_per_rank:,} "
                 f"parameters on rank {lay.global_rank}",
                 "", f"{'memory per rank (GiB)':<44}{'traced':>9}{'closed form':>13}"]
        rows = [("weights", "weights"), ("main grads", "main_grads"), ("master weights", "masters"),
                ("master compensation (Kahan)", "compensation"),
                ("optimizer states (Adam moments)", "optimizer_states"),
                ("= persistent state", "persistent"),
                ("activations + backward working set (peak)", "backward_extra"),
                ("  of which the loss's fp32 softmax", "loss"),
                ("  of which the largest collective's buffer", "comm_buffer"),
                ("optimizer step temporaries (peak)", "optimizer_extra"),
                ("extra during a checkpoint save", "save_extra"),
                ("SDPA packed-row masks (config, not traced)", "sdpa_mask"),
                ("SDPA's expanded GQA K/V (config, not traced)", "gqa_kv"),
                ("NCCL communicators (allowance)", "nccl"), ("cuBLAS workspaces (allowance)", "cublas"),
                ("= total peak", "total_peak")]
        for label, key in rows:
            if key in self.traced or key in self.closed_form:
                lines.append(f"{label:<44}{g(self.traced.get(key))}{g(self.closed_form.get(key)):>13}")
        lines += ["", f"{'communication per step and rank (GiB sent)':<44}{'traced':>9}{'closed form':>13}"]
        for name in sorted(set(self.comm_traced) | set(self.comm_closed_form)):
            lines.append(f"{name:<44}{g(self.comm_traced.get(name))}{g(self.comm_closed_form.get(name)):>13}")
        lines += ["", f"FLOPs per step and rank: {self.flops_per_rank / 1e12:.1f} TFLOP"]
        if self.gpu and self.step_time:
            link = lambda spans: "inter-node 50" if spans else "NVLink 450"  # noqa: E731
            lines.append(f"step time on {self.gpu}: compute {self.step_time:.2f} s at {self.peak_tflops:.0f} TFLOP/s "
                         f"datasheet peak x MFU {self.mfu:.0%}, + TP collectives {self.tp_comm_time:.2f} s "
                         f"({link(self.layout.tp_size > GPUS_PER_NODE)} GB/s, not overlapped) + ZeRO weight "
                         f"all-gather {self.zero_gather_time:.2f} s "
                         f"({link(self.layout.world_size > GPUS_PER_NODE)} GB/s) = "
                         f"{self.predicted_step_time:.2f} s, {self.tokens_per_gpu_per_s:,.0f} tokens/s per GPU")
        lines += self.notes
        lines.append("planned, not measured: traced = live tensor bytes of one dry-run iteration on meta tensors")
        verdict = self.verdict()
        if verdict:  # last, where a reader (and a script's tail) finds it
            lines.append(verdict)
        return "\n".join(lines)


def plan_notes(cfg: Config, lay: Layout, flash_installed: bool, extras: dict[str, float]) -> list[str]:
    """What the plan assumed about the attention path and the runtime's buffers, for the report."""
    if extras["sdpa_mask"] or extras["gqa_kv"]:
        why = ("model.use_flash_attn=False" if not cfg.model.use_flash_attn else
               "flash_attn is not installed here; --flash-attn plans GPUs where it is" if not flash_installed
               else "fp32 q/k/v, which flash_attn refuses")
        attention = f"attention through SDPA ({why}): its packed-row masks and expanded GQA K/V are counted"
    else:
        attention = ("attention: nothing beyond the traced tensors (flash_attn, torch's varlen kernel for packed "
                     "rows, or SDPA without mask or K/V expansion)")
    n = communicators(lay.world_size, lay.tp_size, lay.dp_size, lay.zero1_size)
    return [attention, f"allowance: {n} NCCL communicator(s) x {NCCL_COMMUNICATOR_BYTES / GIB:g} GiB and cuBLAS "
            f"workspaces ({MATMUL_STREAMS} stream x {MATMUL_WORKSPACE_BYTES / 2**20:g} MiB); see "
            "tessera.memory.extras"]


def closed_form_plan(cfg: Config, lay: Layout, shape: StepShape, counts: tuple[int, int] | None = None,
                     flash_installed: bool = False) -> tuple[dict[str, float], dict[str, float], int, int]:
    """(memory closed forms, communication closed forms, model-dtype params, fp32 params) of TP rank 0;
    ``counts``: the parameter counts when known (they depend on the model and the TP size only);
    ``flash_installed``: whether flash_attn runs on the planned GPU (else SDPA's extras count)."""
    mem, low, fp32 = closed_form_memory(cfg, lay, shape.micro_bsz, shape.seq_len, shape.checkpoint, shape.mode,
                                        shape.precision, counts, flash_installed)
    return mem, comm_closed_form(cfg, lay, shape, low, fp32), low, fp32
