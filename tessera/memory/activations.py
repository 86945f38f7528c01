"""Closed-form activation memory per TP rank of one micro-batch's forward + backward, by tensor mode
(mtp / msp) and checkpointing (none / "selective" / full), counted from what tessera's layers keep.

Why a closed form: it says what sequence parallelism and recomputation buy before a run, and
``python -m benchmarks activations`` checks it against live tensor bytes measured during a real step.

Notation: T = micro_bsz * seq_len tokens; s_r = T / tp under msp (each rank's sequence chunk), T under
mtp; h hidden; q = heads * head_dim, k = kv_heads * head_dim; f the SwiGLU width; V vocab; x_t = x/tp;
E bytes of the activation dtype (norm statistics and rotary angles are fp32).

Kept per layer (bytes), Megatron-paper style but matched to tessera's layer (``tessera.model.fused_ops``):

- none: ``2E s_r h`` (each RMSNorm keeps its input, in the activation dtype) ``+ 2E s_r h`` (the norm
  outputs the column-parallel GEMMs keep -- only the chunk under msp, re-gathered in backward)
  ``+ E T (2 q_t + 2 k_t)`` (q, k after rotary, v, attention output) ``+ 3E T f_t`` (gate, up, their
  SwiGLU product; silu(gate) is recomputed) ``+ 8 s_r + 4 B Hq_t S`` (norm statistics, attention
  log-sum-exp) ``+ 2E s_r h`` with residual dropout (masks) ``+ E T (q_t + k_t) + 4 T (Hq_t + Hkv_t)`` with
  q/k norms (their inputs and statistics);
- selective: ``E (2 s_r h + T (q_t + 2 k_t) + 2 T f_t)`` (block inputs x and x + attention; q, k, v;
  gate, up);
- full: ``E s_r h`` (the layer input).

Outside the layers: rotary cos/sin at half width (``4 T head_dim``), the final norm (``2E s_r h + 4 s_r``:
its input and output, its statistics), the loss's fp32 softmax of the vocab shard (``4 T V_t``) and
small index tensors. With the head and the loss fused in chunks of ``c`` tokens (``loss.chunk_tokens``)
the softmax is not kept: per-token fp32 log-sum-exps and losses are (``8 T``), and under msp the gathered
head input (``E T h``); the head's backward makes one chunk's logits again (``(4 + 2E) c V_t``, fp32 and
the model dtype's) beside the input's and the fp32 weight's gradients.

The peak adds the backward's working set to what is kept at the end of the forward, at whichever of
three points is largest (each counted from the tensors live there): the head's backward (the logits
gradient, the head input's gradient and, under msp, the re-gathered head input), the final norm's
backward (fp32 temporaries of ``s_r h``), and the last layer's MLP backward after its recomputation
(the recomputed block, the gradient of the SwiGLU product, the gradients of gate and up, and under msp
the all-gathered gradient of the row-parallel output).
"""

from __future__ import annotations

from typing import Any

import torch

from tessera.model.args import ModelArgs
from tessera.parallel.sequence import TENSOR_MODES

__all__ = ["activation_bytes"]


def _bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def activation_bytes(model_cfg: Any, micro_bsz: int, seq_len: int, tp: int, mode: str, checkpoint: Any,
                     dtype: torch.dtype = torch.float32, chunk_tokens: int = 0,
                     fused_wgrad: bool = False, compiled: bool = False) -> dict[str, float]:
    """Bytes per TP rank: ``per_layer`` (kept by one layer), ``kept`` (everything kept at the end of the
    forward, loss included), ``peak`` (kept + the backward's largest working set); see the module doc.
    ``chunk_tokens``: the head and the loss fused in chunks of that many tokens (``loss.chunk_tokens``;
    0: the whole logits). ``fused_wgrad``: the fused head adds its weight gradient into the fp32 main gradient
    chunk by chunk (``hybrid_zero_optimizer.fuse_wgrad_accumulation``), so neither the fp32 accumulator nor a
    chunk's low-precision weight gradient exists; autograd gets an uninitialized placeholder of the weight's size."""
    a = ModelArgs.from_config(model_cfg)
    if mode not in TENSOR_MODES:
        raise ValueError(f"mode={mode!r}: must be one of {list(TENSOR_MODES)}")
    if checkpoint not in (False, True, "selective"):
        raise ValueError(f"checkpoint={checkpoint!r}: the closed form covers False, True and 'selective'")
    e = _bytes(dtype)
    t = tp
    T = micro_bsz * seq_len
    sr = T // t if mode == "msp" and t > 1 else T
    h, d = a.hidden_size, a.head_dim
    q_t, k_t = a.num_attention_heads * d // t, a.num_kv_attention_heads * d // t
    f_t, v_t = a.ffn_hidden_size // t, a.vocab_size // t
    Th, srh, Tf = T * h, sr * h, T * f_t
    drop = 2 * e * srh if a.dropout > 0 else 0

    qk_norms = e * T * (q_t + k_t) + 4 * T * (a.num_attention_heads + a.num_kv_attention_heads) // t if a.qk_norm else 0
    layer_none = (4 * e * srh + e * T * (2 * q_t + 2 * k_t) + 3 * e * Tf
                  + 8 * sr + 4 * T * (a.num_attention_heads // t) + drop + qk_norms)
    # compiled blocks without checkpointing: the compiler recomputes the elementwise work (norm outputs, the
    # SwiGLU product) in backward and keeps what it cannot recompute cheaply: the block input and the residual
    # sum, q, k, v, the attention output and its log-sum-exp, gate and up, the norm statistics
    layer_compiled = (e * (2 * srh + T * (2 * q_t + 2 * k_t) + 2 * Tf) + 8 * sr
                      + 4 * T * (a.num_attention_heads // t) + drop + qk_norms)
    per_layer = {False: layer_compiled if compiled else layer_none,
                 "selective": e * (2 * srh + T * (q_t + 2 * k_t) + 2 * Tf), True: e * srh}[checkpoint]
    top_keep = 4 * T * d + (9 * T if t > 1 else 0)  # rotary cos/sin; the embedding's local ids and mask
    final_norm = 2 * e * srh + 4 * sr
    sp = mode == "msp" and t > 1
    if chunk_tokens:  # fused: per-token log-sum-exps and losses (fp32), targets and masks; msp: the gathered input
        loss = 18 * T + (e * Th if sp else 0)
    else:
        loss = 4 * T * v_t + 10 * T  # fp32 softmax of the vocab shard; target indices and masks
    kept = a.num_layers * per_layer + top_keep + final_norm + loss

    # the head's backward: the logits gradient, the input gradient (and under msp the re-gathered input)
    grad_w_head = 4 * v_t * h
    if chunk_tokens:  # fused: the input's and the fp32 weight's gradients, and one chunk's logits made again
        c = min(chunk_tokens, T)
        # a chunk's logits and their gradient in the model dtype, and (eager) the fp32 softmax between them
        logits = 2 * e * c * v_t if compiled else (4 + (2 * e if e != 4 else 0)) * c * v_t
        chunk = logits + e * c * h + (0 if fused_wgrad else e * v_t * h)
        # fused: the weight's placeholder gradient is made after the last chunk is freed
        working = max(chunk, e * v_t * h) if fused_wgrad else grad_w_head + chunk
        head = kept + e * Th + working + (e * srh if sp else 0)
    elif sp:
        head = kept - loss + e * T * v_t + 2 * e * Th + grad_w_head
    else:
        head = kept - loss + max(e * T * v_t + e * Th + grad_w_head, 2 * e * Th)
    # the final norm's backward on its (chunk of the) sequence: the head's input (the norm output) is freed,
    # the incoming gradient takes its place; two fp32 temporaries of its size (the normalized input, the
    # gradient times it, reused for the input gradient), and a low-precision model's fp32 copy of the gradient
    norm = kept - loss + (8 + (4 if e != 4 else 0)) * srh
    # the last layer's MLP backward: the other layers' kept tensors, and this layer's live ones -- all it
    # keeps (none), recomputes (full), or keeps plus its recomputed MLP block (selective: the ffn norm's
    # output and statistics -- its input is the kept block input -- and the SwiGLU product)
    base = (a.num_layers - 1) * per_layer + top_keep
    if checkpoint == "selective":
        rest = per_layer + e * srh + 4 * sr + e * Tf
    elif checkpoint is False and compiled:  # what it keeps, and the norm output and SwiGLU product made again
        rest = per_layer + e * srh + e * Tf
    else:
        rest = layer_none
    grad_in = e * srh + (e * Th if mode == "msp" and t > 1 else 0)  # residual gradient (+ gathered for w2)
    at_w2 = rest + grad_in + e * Tf + 4 * h * f_t  # the gradient of the product, w2's weight gradient
    at_swiglu = rest - e * Tf + e * srh + 3 * e * Tf  # product freed; gradients of product, gate and up
    mlp = base + max(at_w2, at_swiglu)
    return {"per_layer": float(per_layer), "kept": float(kept), "peak": float(max(head, norm, mlp, kept))}
