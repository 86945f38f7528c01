"""The pre-norm decoder (``Transformer``) and ``build_model``.

Module names are a contract (fp32 marking by fnmatch patterns, Hugging Face export)::

    embedding                          VocabParallelEmbedding
    layers.{i}.attention_norm          RMSNorm
    layers.{i}.attention.{wq,wk,wv}    ColumnParallelLinear
    layers.{i}.attention.wo            RowParallelLinear
    layers.{i}.ffn_norm                RMSNorm
    layers.{i}.feed_forward.{w1,w3}    ColumnParallelLinear (w1 gate, w3 up)
    layers.{i}.feed_forward.w2         RowParallelLinear (down)
    norm                               RMSNorm
    output                             ColumnParallelLinear (vocab-sharded head)

Initialization (TP-invariant, see ``tessera.parallel.layers``): every weight ~ N(0, init_std) except the
residual-branch output projections ``wo`` and ``w2``, which use ``init_std / sqrt(2 * num_layers)`` so
the residual stream's variance does not grow with depth; biases 0, norms 1. The values are a function
of (seed, parameter name) only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from tessera.model.args import ModelArgs, check_tensor_parallel_sizes
from tessera.model.attention import Attention
from tessera.model.documents import KVCacheLike, check_max_seqlen, plan_attention
from tessera.model.forward_info import ForwardContext
from tessera.model.mlp import FeedForward
from tessera.model.norm import RMSNorm
from tessera.model.recompute import full_checkpoint, selective_checkpoint
from tessera.model.rotary import positions_from_cu_seqlens, rotary_cos_sin
from tessera.parallel.comm import copy_to_region, group_size
from tessera.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from tessera.parallel.loss import LossSpec, linear_cross_entropy, vocab_parallel_cross_entropy
from tessera.parallel.sequence import TENSOR_MODES, gather_from_sequence_region, sequence_dropout

__all__ = ["DecoderLayer", "Transformer", "build_model", "check_tensor_parallel_sizes", "logits_are_vocab_sharded",
           "model_from_full_state"]

TensorRNG = Callable[[], AbstractContextManager[Any]]
_INIT_MODULES = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, RMSNorm)


class DecoderLayer(nn.Module):
    """``h = x + drop(attention(attention_norm(x)))``; ``out = h + drop(feed_forward(ffn_norm(h)))``.

    Everything but ``x`` comes from the forward's ``ForwardContext``: with ``ctx.sequence_parallel``
    (msp) ``x``, ``h`` and ``out`` are this rank's sequence chunks and the attention and MLP gather the
    full sequence themselves; with ``ctx.selective`` each half runs under the selective checkpoint of
    ``tessera.model.recompute``. ``layer_index``: this layer's slot in a KV cache.
    """

    def __init__(
        self,
        args: ModelArgs,
        process_group: Any = None,
        *,
        layer_index: int = 0,
        tensor_rng: TensorRNG | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        out_std = args.init_std / math.sqrt(2 * args.num_layers)
        self.dropout = args.dropout
        self.process_group = process_group
        norm = dict(process_group=process_group, device=device)
        self.attention_norm = RMSNorm(args.hidden_size, args.layer_norm_epsilon, **norm)
        self.attention = Attention(
            args.hidden_size, args.num_attention_heads, args.num_kv_attention_heads, process_group,
            bias=args.bias, qkv_bias=args.attention_qkv_bias, head_dim=args.head_dim, qk_norm=args.qk_norm,
            norm_eps=args.layer_norm_epsilon, attn_dropout=args.attn_dropout, init_std=args.init_std,
            out_init_std=out_std, tensor_rng=tensor_rng, layer_index=layer_index, device=device,
        )
        self.ffn_norm = RMSNorm(args.hidden_size, args.layer_norm_epsilon, **norm)
        self.feed_forward = FeedForward(
            args.hidden_size, args.ffn_hidden_size, process_group,
            bias=args.feed_forward_bias, init_std=args.init_std, out_init_std=out_std, device=device,
        )

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if ctx.selective:
            h = selective_checkpoint(self._attention_block, x, ctx.replaying())
            return selective_checkpoint(self._mlp_block, h, ctx)
        h = self._attention_block(x, ctx)
        return self._mlp_block(h, ctx)

    def _attention_block(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        sp = ctx.sequence_parallel
        return x + self._drop(self.attention(self.attention_norm(x, sequence_parallel=sp), ctx), sp)

    def _mlp_block(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        sp = ctx.sequence_parallel
        return h + self._drop(self.feed_forward(self.ffn_norm(h, sequence_parallel=sp), sequence_parallel=sp), sp)

    def _drop(self, x: torch.Tensor, sp: bool) -> torch.Tensor:
        # residual dropout draws from the ambient stream, identical on all TP ranks; under sequence parallelism
        # each rank keeps its chunk of the full-sequence mask (the same mask as mtp)
        if not (self.training and self.dropout > 0):
            return x
        if sp:
            return sequence_dropout(x, self.dropout, self.process_group)
        return F.dropout(x, self.dropout, training=True)


class Transformer(nn.Module):
    """Decoder-only LM: ``model(input_ids, cu_seqlens=None, position_ids=None) -> logits``.

    Logits are ``[B, S, V/tp]`` with ``parallel_output`` (feed them to ``vocab_parallel_cross_entropy``),
    else gathered to ``[B, S, V]``. ``cu_seqlens`` (1-D int, over the flattened ``B*S`` tokens, first 0,
    last ``B*S``, every row boundary included) marks packed documents: attention stays inside a
    document and, unless ``position_ids`` is given, positions restart at 0 per document. ``max_seqlen``,
    the longest document, comes with a ``cu_seqlens`` on the GPU (checked on the host before the copy,
    ``tessera.train.batch``): boundaries on the device are never read back.

    ``cache`` (a ``tessera.model.kv_cache.KVCache``, inference only) continues cached sequences: the
    ids are the next positions, keys/values are appended to the cache. Generation thus runs through
    the same module calls as training, so fp32 marks and their casts apply to it alike.

    ``tensor_mode="msp"`` (sequence parallelism, ``tessera.parallel.sequence``): between the row-parallel
    outputs and the next column-parallel inputs (embedding output, norms, residual adds, dropout) each TP
    rank holds a contiguous chunk of ``seq_len / tp`` tokens; attention, rotary and ``cu_seqlens`` act
    inside the TP region on the full sequence, and the head gathers it, so logits, loss and gradients
    are mtp's (parameters too: a checkpoint loads across modes). It applies to forwards that record an
    autograd graph without a KV cache -- where it saves memory, the activations kept for backward.
    Forwards without autograd (validation under no_grad, generation, KV-cache decoding) run the mtp
    dataflow, the same numbers for any sequence length; a recorded forward whose length does not split
    over tp is an error.

    ``head_dtype``: the dtype the head computes in and returns its logits in (the fused head: computes in),
    handed down once by the precision wrapper (``tessera.core.naive_amp.NaiveAMPModel``: fp32 for an
    fp32-marked head, else the model dtype); None, a model used without it: the hidden state's dtype.
    """

    def __init__(
        self,
        args: ModelArgs,
        process_group: Any = None,
        *,
        seed: int = 1024,
        device: torch.device | str | None = None,
        tensor_rng: TensorRNG | None = None,
        tensor_mode: str = "mtp",
    ) -> None:
        super().__init__()
        if tensor_mode not in TENSOR_MODES:
            raise ValueError(f"tensor_mode={tensor_mode!r}: must be one of {list(TENSOR_MODES)}")
        self.args = args
        self.process_group = process_group
        self.tp_size = group_size(process_group)
        check_tensor_parallel_sizes(args, self.tp_size)  # the rules the config checks too, before any group
        self.tensor_mode = tensor_mode
        self.num_checkpoint_layers = args.num_checkpoint_layers
        self.selective_checkpoint = args.selective_checkpoint
        self.embedding = VocabParallelEmbedding(
            args.vocab_size, args.hidden_size, process_group, init_std=args.init_std, init_seed=None, device=device
        )
        self.layers = nn.ModuleList(
            DecoderLayer(args, process_group, layer_index=i, tensor_rng=tensor_rng, device=device)
            for i in range(args.num_layers)
        )
        self.norm = RMSNorm(args.hidden_size, args.layer_norm_epsilon, process_group=process_group, device=device)
        self.output = ColumnParallelLinear(
            args.hidden_size, args.vocab_size, bias=False, gather_output=not args.parallel_output,
            process_group=process_group, init_std=args.init_std, init_seed=None, device=device,
        )
        if args.tie_word_embeddings:
            self.output.weight = self.embedding.weight
        self.head_dtype: torch.dtype | None = None
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """(Re)initialize every parameter from ``seed`` and its dotted name (TP-invariant); no-op on meta."""
        for name, module in self.named_modules():
            if module is self.output and self.args.tie_word_embeddings:
                continue  # shares the embedding's weight, initialized under the name embedding.weight
            if isinstance(module, _INIT_MODULES):
                module.init_weights(seed, name)

    def forward(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: KVCacheLike | None = None,
        max_seqlen: int | None = None,
        labels: torch.Tensor | None = None,
        loss: LossSpec | None = None,
    ) -> torch.Tensor:
        """Logits (vocab-sharded with ``parallel_output``), or, given ``labels``, the loss against them
        (``loss``: its reduction; the head and the loss fused in chunks of tokens, ``head_loss``)."""
        batch, seqlen = input_ids.shape
        past = 0
        if cache is not None:
            if self.training or cu_seqlens is not None:
                raise ValueError("a KV cache is for inference on one document per row: call model.eval() "
                                 "and pass no cu_seqlens")
            past = cache.length
        window = self.args.sliding_window
        if window is not None and past + seqlen > window:
            raise ValueError(f"sequence of {past + seqlen} positions exceeds model.sliding_window={window}: tessera's "
                             "attention is full causal, which equals a sliding window only up to its length")
        if cu_seqlens is not None:  # a device cu_seqlens comes with max_seqlen from the host: never read back
            max_seqlen = check_max_seqlen(cu_seqlens, batch, seqlen, max_seqlen)
        sp = self.sequence_parallel_forward(cache)
        if sp and seqlen % self.tp_size:
            raise ValueError(f"sequence parallelism (tensor mode 'msp') splits the sequence over the "
                             f"{self.tp_size} tensor-parallel ranks: sequence length {seqlen} is not divisible by it")
        h = self.embedding(input_ids, sequence_parallel=sp)
        if position_ids is None:
            if cu_seqlens is not None:
                position_ids = positions_from_cu_seqlens(cu_seqlens.to(h.device), batch, seqlen)
            else:
                position_ids = torch.arange(past, past + seqlen, device=h.device).expand(batch, seqlen)
        cos, sin = rotary_cos_sin(position_ids.to(h.device), self.args.head_dim, self.args.rope_base,
                                  self.args.rope_scaling)
        recompute = self.training and torch.is_grad_enabled()
        plan = plan_attention(cu_seqlens, batch, seqlen, self.args.use_flash_attn, max_seqlen)
        ctx = ForwardContext(cos, sin, plan,
                             sequence_parallel=sp, selective=recompute and self.selective_checkpoint, cache=cache)
        for i, layer in enumerate(self.layers):
            if recompute and i < self.num_checkpoint_layers:  # full and selective exclude each other (ModelArgs)
                h = full_checkpoint(layer, h, ctx.replaying())
            else:
                h = layer(h, ctx)
        if cache is not None:
            cache.length = past + seqlen
        h = self.norm(h, sequence_parallel=sp)
        if labels is not None:
            return self.head_loss(h, labels, loss or LossSpec(), sequence_parallel=sp)
        return self.output(self._head_input(h), sequence_parallel=sp)

    def head_loss(self, h: torch.Tensor, labels: torch.Tensor, spec: LossSpec, *,
                  sequence_parallel: bool = False) -> torch.Tensor:
        """The head and the vocab-parallel loss of the final hidden states ``h`` against ``labels``, fused in
        chunks of ``spec.chunk_tokens`` tokens: the ``[tokens, vocab]`` logits never exist at once. The head
        computes in ``head_dtype`` (fp32 when it is fp32-marked), as its module would; with
        ``parallel_output=False`` the loss is the same, computed on the vocab shards. An fp8 or biased head
        runs unfused (its module, then ``vocab_parallel_cross_entropy``)."""
        head, group = self.output, self.process_group
        if head.fp8_recipe is not None or head.bias is not None:
            logits = head(self._head_input(h), sequence_parallel=sequence_parallel)
            return vocab_parallel_cross_entropy(
                logits, labels, group if self.args.parallel_output else None, ignore_index=spec.ignore_index,
                label_smoothing=spec.label_smoothing, reduction=spec.reduction)
        if sequence_parallel and self.tp_size > 1:
            x = gather_from_sequence_region(h, group)  # the full sequence; backward: reduce-scatter
        else:
            x = copy_to_region(h, group)  # replicated; backward: the TP all-reduce of the input gradient
        return linear_cross_entropy(self._head_input(x), head.weight, labels, group, spec)

    def _head_input(self, h: torch.Tensor) -> torch.Tensor:
        """``h`` in the dtype the head computes in (``head_dtype``; None: as it comes)."""
        return h if self.head_dtype is None else h.to(self.head_dtype)

    def sequence_parallel_forward(self, cache: KVCacheLike | None = None) -> bool:
        """Whether a forward now runs sequence-parallel: msp over more than one rank, recording autograd,
        without a KV cache (see the class docstring)."""
        return self.tensor_mode == "msp" and self.tp_size > 1 and cache is None and torch.is_grad_enabled()


def logits_are_vocab_sharded(model: nn.Module) -> bool:
    """Whether ``model``'s logits are a vocab shard per TP rank (``parallel_output=True``, the default).

    With ``parallel_output=False`` the head gathers them: the loss must then not reduce over TP and
    sampling must not gather again. Looks through a wrapper that keeps the decoder as ``.model``.
    """
    inner = getattr(model, "model", model)
    return bool(getattr(getattr(inner, "args", None), "parallel_output", True))


def build_model(
    model_cfg: Any,
    tp_group: Any = None,
    *,
    seed: int = 1024,
    device: torch.device | str = "cpu",
    tensor_rng: TensorRNG | None = None,
    tensor_mode: str = "mtp",
) -> Transformer:
    """Build the decoder from the config's ``model`` section, fp32, sharded over ``tp_group`` (None: no TP).

    Every input is an argument, so one call builds one model whatever was launched or imported before: a
    launched job's caller passes its pieces (``tessera.train.builder`` passes the job's TENSOR group, seed,
    device and tensor mode, and ``gpc``'s TENSOR RNG stream as ``tensor_rng``). ``tensor_mode`` "msp" is
    sequence parallelism (see ``Transformer``). Pass ``tessera.parallel.MetaGroup(tp)`` with
    ``device="meta"`` to get TP shard shapes without any process group or allocation.
    """
    return Transformer(ModelArgs.from_config(model_cfg), tp_group, seed=seed, device=device, tensor_rng=tensor_rng,
                       tensor_mode=tensor_mode)


def model_from_full_state(model_cfg: Any, state: Mapping[str, torch.Tensor], *,
                          device: torch.device | str = "cpu") -> Transformer:
    """A TP=1 decoder in eval mode holding ``state``: full tensors under every ``state_dict`` key (a tied head's
    key may share the embedding's tensor), taken as they are (their dtype; no copy where already on ``device``).

    Built on the meta device, so no weight is drawn only to be overwritten (minutes for a 7B model); activation
    checkpointing is off (inference). The one way a consolidated model is made: ``load_for_inference`` (a
    checkpoint's shards) and train.py's ``eval`` section (the live run's gathered masters) both call it.
    """
    cfg = {**dict(model_cfg), "checkpoint": False}
    model = build_model(cfg, tp_group=None, device="meta")
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.get("tie_word_embeddings"):
        model.output.weight = model.embedding.weight  # assign=True replaced both; share one again
    model.to(device)
    model.eval()
    return model
