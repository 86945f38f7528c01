"""Causal self-attention with grouped KV heads, tensor-parallel over heads, packed-document aware.

Heads are split contiguously over the TP group: rank r holds query heads
``[r*Hq/tp, (r+1)*Hq/tp)`` and KV heads ``[r*Hkv/tp, (r+1)*Hkv/tp)``; since both counts divide by tp,
every local query head's KV head is local too.

Backends: the table ``BACKENDS``, in order of preference; each call takes the first that serves it and
accepts the q/k/v actually passed (an fp32-marked attention in a bf16 model gets fp32 tensors), and the
choice is logged once per backend and reason (the refusals of the ones before it):

1. ``flash_attn``: the package (``flash_attn_varlen_func`` with ``cu_seqlens``, ``flash_attn_func``
   otherwise) with ``use_flash_attn=True``, on CUDA, for fp16/bf16, when it really imports and the GPU and
   head dim suit it (``tessera.model.flash_probe``);
2. ``torch_varlen``: packed rows under the same conditions, without attention dropout, where this torch
   has its own varlen kernel (``tessera.model.torch_varlen``);
3. ``cpu_flash``: on the CPU without attention dropout, ``tessera.model.cpu_attention``: torch's CPU flash
   kernel with ``is_causal`` when every row is one document, run per document (grouped by length) for
   packed rows -- no ``[S, S]`` mask -- bf16/fp16 inputs computed in fp32 or in their own dtype by a
   measured rule (that module says which and why);
4. ``sdpa_causal``: ``F.scaled_dot_product_attention`` with ``is_causal=True`` when every row is one
   document (torch picks its flash / memory-efficient kernel on CUDA);
5. ``sdpa_mask``: SDPA with a block-diagonal causal boolean mask ``[B, 1, S, S]``, built once per forward
   and shared by all layers, for packed rows nothing else serves.

With grouped KV heads on CUDA, SDPA gets K/V expanded where its GQA support would fall to the math
kernel (see ``_sdpa``).

With a KV cache (generation), the same module forward runs on the new positions only and attends
over the cached keys/values (``attend_cached``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, NamedTuple

import torch
import torch.nn as nn
from einops import rearrange

from tessera.logs import log_once
from tessera.model import cpu_attention, flash_probe
from tessera.model import sdpa as lowp  # attend() calls lowp.scaled_dot_product_attention
from tessera.model.args import check_sizes
from tessera.model.documents import (
    AttentionPlan,
    KVCacheLike,
    check_cu_seqlens,
    check_cu_seqlens_shape,
    check_max_seqlen,
    plan_attention,
)
from tessera.model.forward_info import ForwardContext
from tessera.model.norm import RMSNorm
from tessera.model.recompute import keep_gemm_outputs
from tessera.model.rotary import apply_rotary
from tessera.model.torch_varlen import torch_varlen
from tessera.parallel.comm import group_size
from tessera.parallel.layers import ColumnParallelLinear, RowParallelLinear, column_parallel_linears, divide

__all__ = ["Attention", "AttentionPlan", "KVCacheLike", "plan_attention", "check_cu_seqlens",
           "check_cu_seqlens_shape", "check_max_seqlen",
           "attend", "attend_cached", "select_backend", "choose_backend", "AttentionBackend", "AttentionCall",
           "BACKENDS"]


# ---------------------------------------------------------------------------------------- the backends
class AttentionCall(NamedTuple):
    """What the choice of a backend reads: the q/k/v actually passed (an fp32-marked attention in a bf16 model
    gets fp32 tensors, which the flash kernels refuse) and the forward's plan."""

    device: torch.device
    dtype: torch.dtype
    head_dim: int | None  # None: not checked (a choice made before the tensors exist)
    seq_len: int  # 0 where unknown (read only by the CPU kernel's log line)
    packed: bool  # rows hold several documents
    dropout_p: float  # the attention dropout of this call (0 in eval)
    use_flash_attn: bool  # model.use_flash_attn

    @classmethod
    def of(cls, q: torch.Tensor, plan: AttentionPlan, dropout_p: float) -> AttentionCall:
        """The call ``attend(q, k, v, plan, dropout_p)`` makes, q ``[B, S, Hq, d]``."""
        return cls(q.device, q.dtype, q.shape[-1], q.shape[1], plan.packed, dropout_p, plan.use_flash_attn)


Run = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionPlan, float], torch.Tensor]


class AttentionBackend(NamedTuple):
    """One way to compute ``attend``. ``serves``: the calls it is built for (packed rows, one-document rows,
    CPU tensors); ``refuses``: why it cannot take one of those here (None: it takes it), which the log line
    gives as the reason a later backend runs; ``run(q, k, v, plan, dropout_p)``; ``describe``: what runs,
    for the log line."""

    name: str
    serves: Callable[[AttentionCall], bool]
    refuses: Callable[[AttentionCall], str | None]
    run: Run
    describe: Callable[[AttentionCall], str]


_HALF = (torch.float16, torch.bfloat16)


def _flash_kernels_refuse(call: AttentionCall) -> str | None:
    """What both flash kernels (the flash_attn package, torch's varlen kernel) need: enabled, CUDA, fp16/bf16."""
    if not call.use_flash_attn:
        return "disabled by model.use_flash_attn=False"
    if call.device.type != "cuda":
        return f"the device is {call.device.type}, not cuda"
    if call.dtype not in _HALF:
        return f"q/k/v are {call.dtype}, flash_attn needs float16/bfloat16"
    return None


def _flash_attn_refuses(call: AttentionCall) -> str | None:
    """The package when it really imports and the GPU and head dim suit it (``tessera.model.flash_probe``)."""
    return _flash_kernels_refuse(call) or flash_probe.flash_attn_unusable(call.device, call.head_dim) or None


def _torch_varlen_refuses(call: AttentionCall) -> str | None:
    why = _flash_kernels_refuse(call)
    if why:
        return why
    kernel, why_not = torch_varlen()
    if kernel is None:
        return why_not
    if call.dropout_p > 0:
        return f"torch's varlen attention has no dropout (model.attn_drop_rate={call.dropout_p})"
    return None


def _cpu_kernel_refuses(call: AttentionCall) -> str | None:
    if call.dropout_p > 0:
        return f"tessera's CPU kernels have no attention dropout (model.attn_drop_rate={call.dropout_p})"
    return None


def _tokens(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[B, S, H, d]`` -> ``[B*S, H, d]``: the layout of the varlen kernels."""
    q_, k_, v_ = (rearrange(t, "b s h d -> (b s) h d") for t in (q, k, v))
    return q_, k_, v_


def _run_flash_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan,
                    dropout_p: float) -> torch.Tensor:
    kernels = flash_probe.load_flash_attn()[0]
    assert kernels is not None  # chosen only when it imports
    if not plan.packed:
        return kernels.func(q, k, v, dropout_p=dropout_p, causal=True)
    cu, max_seqlen = plan.varlen(q.device)
    out = kernels.varlen_func(*_tokens(q, k, v), cu, cu, max_seqlen, max_seqlen, dropout_p=dropout_p, causal=True)
    return rearrange(out, "(b s) h d -> b s h d", b=q.shape[0])


def _run_torch_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan,
                      dropout_p: float) -> torch.Tensor:
    varlen = torch_varlen()[0]
    assert varlen is not None  # chosen only where this torch has it
    cu, max_seqlen = plan.varlen(q.device)
    return rearrange(varlen.call(*_tokens(q, k, v), cu, max_seqlen), "(b s) h d -> b s h d", b=q.shape[0])


def _run_cpu_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan,
                    dropout_p: float) -> torch.Tensor:
    if plan.packed:
        return cpu_attention.packed_attention(q, k, v, plan.document_buckets())
    return cpu_attention.causal_attention(q, k, v)


def _run_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan,
              dropout_p: float) -> torch.Tensor:
    """``is_causal`` for one document a row (torch takes its flash kernel on CUDA), else the plan's
    block-diagonal causal mask ``[B, 1, S, S]``, built once per forward and shared by all layers."""
    mask = plan.mask(q.device) if plan.packed else None
    q, k, v = (rearrange(t, "b s h d -> b h s d") for t in (q, k, v))
    return rearrange(_sdpa(q, k, v, mask, mask is None, dropout_p), "b h s d -> b s h d")


def _describe_flash_attn(call: AttentionCall) -> str:
    return f"{flash_probe.load_flash_attn()[1]} (flash_attn_varlen_func for packed rows, flash_attn_func otherwise)"


def _describe_torch_varlen(call: AttentionCall) -> str:
    varlen = torch_varlen()[0]
    convention = varlen.convention if varlen is not None else "?"
    return f"torch varlen_attn (FlashAttention-2 in torch {torch.__version__}, causal by {convention}) for packed rows"


def _describe_cpu_kernel(call: AttentionCall) -> str:
    assert call.head_dim is not None  # described for a call with its tensors only
    kernel = "run per document, grouped by length (packed rows)" if call.packed else "is_causal (one document per row)"
    rule = cpu_attention.precision_rule(call.dtype, None if call.packed else call.seq_len, call.head_dim)
    return f"CPU flash kernel {kernel} for {str(call.dtype).removeprefix('torch.')} q/k/v, {rule}"


def _describe_sdpa(call: AttentionCall) -> str:
    how = "a block-diagonal causal mask (packed rows)" if call.packed else "is_causal (one document per row)"
    return f"torch scaled_dot_product_attention with {how} on {call.device.type} for {call.dtype}"


FLASH_ATTN, TORCH_VARLEN, CPU_KERNEL = "flash_attn", "torch_varlen", "cpu_flash"
SDPA_CAUSAL, SDPA_MASK = "sdpa_causal", "sdpa_mask"
# in order of preference (DESIGN.md, Model): the flash kernels, then on the CPU tessera's per-document kernel,
# then SDPA: is_causal (its flash kernel on CUDA) for one-document rows, the block-diagonal mask where nothing
# else serves packed rows. The two SDPA entries take every call they serve: every call finds a backend.
BACKENDS: tuple[AttentionBackend, ...] = (
    AttentionBackend(FLASH_ATTN, lambda c: True, _flash_attn_refuses, _run_flash_attn, _describe_flash_attn),
    AttentionBackend(TORCH_VARLEN, lambda c: c.packed, _torch_varlen_refuses, _run_torch_varlen,
                     _describe_torch_varlen),
    AttentionBackend(CPU_KERNEL, lambda c: c.device.type == "cpu", _cpu_kernel_refuses, _run_cpu_kernel,
                     _describe_cpu_kernel),
    AttentionBackend(SDPA_CAUSAL, lambda c: not c.packed, lambda c: None, _run_sdpa, _describe_sdpa),
    AttentionBackend(SDPA_MASK, lambda c: c.packed, lambda c: None, _run_sdpa, _describe_sdpa),
)


def choose_backend(call: AttentionCall) -> tuple[AttentionBackend, str]:
    """The first of ``BACKENDS`` that serves ``call`` and takes it, and why the ones before it that serve such
    calls refused it (each distinct reason once, "; "-joined; "" when none refused)."""
    refusals: list[str] = []
    for backend in BACKENDS:
        if not backend.serves(call):
            continue
        why = backend.refuses(call)
        if why is None:
            return backend, "; ".join(refusals)
        if why not in refusals:  # the flash kernels refuse for one shared reason (disabled, device, dtype)
            refusals.append(why)
    raise RuntimeError(f"no attention backend takes {call}")  # the SDPA entries take every call they serve


def select_backend(device: torch.device, dtype: torch.dtype, use_flash_attn: bool, head_dim: int | None = None,
                   *, packed: bool = False, dropout_p: float = 0.0) -> tuple[str, str]:
    """The flash kernels' verdict on a call described without its tensors (what the plan prepares before a
    forward): ``("flash_attn", "")``, ``("torch_varlen", why flash_attn was not used)`` or ``("sdpa", why
    neither was)``, where "sdpa" means torch's SDPA or, on the CPU, tessera's kernel (``choose_backend``
    says which). ``head_dim`` None skips its check."""
    backend, why = choose_backend(AttentionCall(device, dtype, head_dim, 0, packed, dropout_p, use_flash_attn))
    return (backend.name if backend.name in (FLASH_ATTN, TORCH_VARLEN) else "sdpa"), why


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
          dropout_p: float) -> torch.Tensor:
    """SDPA on ``[B, H, S, d]`` with grouped KV heads; the one call of torch's SDPA in this module.

    On CUDA, SDPA honours ``enable_gqa`` only in its flash kernel, which takes neither a boolean mask
    nor fp32: in those cases the grouped call would fall to the math kernel (O(S^2) memory), so K/V
    are expanded to the query heads first and the memory-efficient kernel runs instead.
    """
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and q.device.type == "cuda" and (mask is not None or q.dtype not in _HALF):
        why = "a packed-document mask" if mask is not None else f"{q.dtype} q/k/v"
        log_once(f"attention: K/V heads expanded {groups}x for SDPA on cuda ({why}: its GQA-capable flash "
                 "kernel does not take it, the memory-efficient kernel needs equal head counts)")
        # torch, not einops.repeat: KV-cache decoding runs this per token, where einops' Python overhead per call
        # is a measurable share of a step on short caches
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        groups = 1
    return lowp.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                             enable_gqa=groups > 1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan, dropout_p: float) -> torch.Tensor:
    """Causal attention within documents: q ``[B, S, Hq, d]``, k/v ``[B, S, Hkv, d]`` -> ``[B, S, Hq, d]``.

    The backend is chosen here, from the tensors passed, and logged once per distinct choice and reason.
    """
    call = AttentionCall.of(q, plan, dropout_p)
    backend, why = choose_backend(call)
    log_once(f"attention backend: {backend.describe(call)}" + (f"; flash_attn not used: {why}" if why else ""))
    return backend.run(q, k, v, plan, dropout_p)


def attend_cached(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int) -> torch.Tensor:
    """q ``[B, s, Hq, d]`` at positions ``past..past+s`` over cached k/v ``[B, past+s, Hkv, d]``, causally."""
    s, total = q.shape[1], k.shape[1]
    mask = None
    if s > 1 and past > 0:  # query i (absolute past+i) sees keys 0..past+i
        qpos = torch.arange(past, past + s, device=q.device).unsqueeze(1)
        mask = (torch.arange(total, device=q.device).unsqueeze(0) <= qpos).view(1, 1, s, total)
    # torch transposes, not einops (as in ``attend``): this runs per decoded token and layer, where einops' Python
    # overhead per call is a measurable share of the step
    out = _sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, s > 1 and past == 0, 0.0)
    return out.transpose(1, 2)


class Attention(nn.Module):
    """Multi-head attention with grouped KV heads: ``wq``/``wk``/``wv`` column-parallel, ``wo`` row-parallel.

    ``head_dim`` (default ``hidden_size / num_heads``) may differ from it: the projections then map
    ``hidden_size`` to ``heads x head_dim`` and back. ``bias`` puts biases on all four projections,
    ``qkv_bias`` (default: ``bias``) on q/k/v alone. ``qk_norm`` adds RMSNorms over ``head_dim``
    (``q_norm``, ``k_norm``: one weight shared by all heads) to queries and keys before rotary; each TP
    rank sees only its heads, so their weight gradients are summed over the TP group.

    ``tensor_rng``: a factory of context managers that switch to the per-TP-rank RNG stream for the
    attention-probability dropout (sharded heads need different masks per rank). ``layer_index``: where
    this layer's keys/values go in a KV cache shared by all layers (``ForwardContext.cache``).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        process_group: Any = None,
        *,
        bias: bool = False,
        qkv_bias: bool | None = None,
        head_dim: int | None = None,
        qk_norm: bool = False,
        norm_eps: float = 1e-5,
        attn_dropout: float = 0.0,
        init_std: float = 0.02,
        out_init_std: float | None = None,
        tensor_rng: Callable[[], AbstractContextManager[Any]] | None = None,
        layer_index: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        tp = group_size(process_group)
        check_sizes(hidden_size=hidden_size, num_attention_heads=num_heads, num_kv_attention_heads=num_kv_heads, tp=tp,
                    head_dim=head_dim)
        self.process_group = process_group
        self.head_dim = hidden_size // num_heads if head_dim is None else head_dim
        self.num_heads_per_rank = divide(num_heads, tp, "num_attention_heads")
        self.num_kv_heads_per_rank = divide(num_kv_heads, tp, "num_kv_attention_heads")
        self.attn_dropout = attn_dropout
        self.tensor_rng = tensor_rng
        self.layer_index = layer_index
        kw = dict(process_group=process_group, init_seed=None, device=device, dtype=dtype)
        q_dim, kv_dim = num_heads * self.head_dim, num_kv_heads * self.head_dim
        in_bias = bias if qkv_bias is None else qkv_bias
        self.wq = ColumnParallelLinear(hidden_size, q_dim, in_bias, init_std=init_std, **kw)
        self.wk = ColumnParallelLinear(hidden_size, kv_dim, in_bias, init_std=init_std, **kw)
        self.wv = ColumnParallelLinear(hidden_size, kv_dim, in_bias, init_std=init_std, **kw)
        out_std = init_std if out_init_std is None else out_init_std
        self.wo = RowParallelLinear(q_dim, hidden_size, bias, init_std=out_std, **kw)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if qk_norm:
            norm = dict(process_group=process_group, device=device, dtype=dtype)
            self.q_norm = RMSNorm(self.head_dim, norm_eps, **norm)
            self.k_norm = RMSNorm(self.head_dim, norm_eps, **norm)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Under ``ctx.sequence_parallel`` ``x`` is this rank's sequence chunk (msp): the projections gather the
        full sequence, attention runs on it, and ``wo`` reduce-scatters back into chunks."""
        sp = ctx.sequence_parallel
        with keep_gemm_outputs():  # entering the TP region once for q, k and v (one gradient collective)
            q, k, v = column_parallel_linears(x, [self.wq, self.wk, self.wv], sequence_parallel=sp)
        # torch views, not einops: KV-cache decoding runs this per token and layer, where einops' Python overhead
        # per call is a measurable share of the step
        b, s = q.shape[:2]  # the full sequence, also under sequence parallelism
        q = q.view(b, s, self.num_heads_per_rank, self.head_dim)
        k = k.view(b, s, self.num_kv_heads_per_rank, self.head_dim)
        v = v.view(b, s, self.num_kv_heads_per_rank, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # this rank's heads: partial weight gradients
            q, k = self.q_norm(q, sharded_heads=True), self.k_norm(k, sharded_heads=True)
        q, k = apply_rotary(q, ctx.cos, ctx.sin), apply_rotary(k, ctx.cos, ctx.sin)
        p = self.attn_dropout if self.training else 0.0
        if ctx.cache is not None:
            past = ctx.cache.length
            k, v = ctx.cache.append(self.layer_index, k, v)
            out = attend_cached(q, k, v, past)
        elif p == 0.0 or self.tensor_rng is None:
            out = attend(q, k, v, ctx.plan, p)
        else:
            with self.tensor_rng():
                if ctx.rng_replay is None:
                    out = attend(q, k, v, ctx.plan, p)
                else:
                    out = ctx.rng_replay.run(lambda: attend(q, k, v, ctx.plan, p), q.device)
        return self.wo(out.reshape(b, s, self.num_heads_per_rank * self.head_dim), sequence_parallel=sp)
