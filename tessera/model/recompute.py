"""Activation checkpointing per layer: ``model.checkpoint`` = True / a fraction of layers ("full") or
``"selective"``.

Full: a layer keeps only its input; backward runs the whole layer again (every GEMM and, under TP, its
collectives) before differentiating it. Selective: each half of a layer (attention block, MLP block)
runs under ``torch.utils.checkpoint`` with a selective policy
(``create_selective_checkpoint_contexts``): the outputs of the column-parallel GEMMs -- q, k, v and
the SwiGLU gate and up projections, marked by ``keep_gemm_outputs`` in the model code -- are kept, and
everything else is recomputed in backward: the norms, rotary, the attention core (SDPA), the SwiGLU
activation and product. Each block's input (the layer input x, and h = x + attention) is kept too, so
the row-parallel GEMMs (wo, w2) and their all-reduce / reduce-scatter never run again: recomputation
stops at their inputs (non-reentrant checkpoint's early stop).

Trade-off, per layer (``tessera.memory.activations`` has the closed forms, BENCHMARKS.md section 9
the measurements), with T tokens, hidden h, query/KV widths q/k, SwiGLU width f, TP size t, mtp, fp32:

- none keeps the norms' inputs and outputs, q/k after rotary, v, the attention output, the SwiGLU gate,
  up and product: ``4 T h + T (2q + 2k)/t + 3 T f/t`` elements;
- selective keeps x, h, q, k, v, gate, up: ``2 T h + T (q + 2k)/t + 2 T f/t`` -- 0.62x of none for a
  LLaMA-7B-shaped layer at t=2 -- for the cost of the elementwise ops and one more attention forward
  (``4 T s h / t`` FLOPs per layer at sequence length s); no GEMM runs twice;
- full keeps x only (``T h``) and recomputes the whole forward (+1/3 of a step's FLOPs), and its peak
  holds one recomputed layer besides.

Under msp the T h terms are per-rank chunks (divided by t) and the recomputation of a block re-runs
its all-gather before the column-parallel GEMMs (only the chunk is kept). With residual dropout > 0
the row-parallel GEMMs and their reductions run again too (the masks come after them). With the CPU
low-precision upcast (``tessera.parallel.gemm``) the kept GEMM outputs are the fp32 GEMM results (the
cast back is recomputed), twice the bytes of a bf16 output; GPUs keep them in the model dtype.

Attention dropout draws from the per-TP-rank TENSOR stream, which the checkpoint's own RNG stashing
does not cover: each checkpointed region carries an ``RNGReplay`` (in its ``ForwardContext``) so its
recomputation draws the same masks.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

__all__ = ["keep_gemm_outputs", "selective_checkpoint", "full_checkpoint", "RNGReplay"]

_STATE = threading.local()
_aten = torch.ops.aten
_GEMMS = frozenset({_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default})


def keep_gemm_outputs() -> AbstractContextManager[None]:
    """Mark the GEMMs run inside as kept by selective checkpointing (no effect anywhere else).

    Inside code that ``torch.compile`` traces it is a ``nullcontext`` (which Dynamo can carry across a
    graph break, unlike a generator context manager): a compiled selective checkpoint keeps every GEMM
    output its backward needs (``_policy``), the same set the marks select in eager mode.
    """
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return _mark_gemms()


@contextlib.contextmanager
def _mark_gemms() -> Iterator[None]:
    previous = getattr(_STATE, "keep", False)
    _STATE.keep = True
    try:
        yield
    finally:
        _STATE.keep = previous


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    # the same answer in the forward and in the recomputation: the same code sets the same marks. Compiled, the
    # policy is applied to the traced graph, where only the GEMM outputs that the backward reads are saved: those
    # of the marked (column-parallel) GEMMs; the row-parallel outputs feed a residual add only
    if op in _GEMMS and (getattr(_STATE, "keep", False) or _applied_to_a_traced_graph(args)):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _applied_to_a_traced_graph(args: tuple[Any, ...]) -> bool:
    """Whether the policy runs while torch.compile traces: ``is_compiling()`` says so from torch 2.12 on; torch
    2.11 applies it in AOTAutograd's functionalized trace with ``is_compiling()`` False (the GEMMs were then all
    recomputed), which its functional-tensor operands still tell."""
    return torch.compiler.is_compiling() or (bool(args) and isinstance(args[0], FunctionalTensor))


_selective_context = functools.partial(create_selective_checkpoint_contexts, _policy)


def selective_checkpoint(fn: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
    """``fn(*args, **kwargs)`` keeping only its marked GEMM outputs (and its inputs) for backward."""
    return checkpoint(fn, *args, use_reentrant=False, context_fn=_selective_context, **kwargs)


def full_checkpoint(fn: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
    """``fn(*args, **kwargs)`` keeping only its inputs; backward recomputes all of it."""
    return checkpoint(fn, *args, use_reentrant=False, **kwargs)


class RNGReplay:
    """Replays the attention-dropout RNG state when a checkpointed layer is recomputed.

    The TENSOR stream lives outside torch's ambient generator (``gpc`` swaps it in), so
    ``torch.utils.checkpoint``'s own RNG stashing does not cover it. The first run records the
    state at the dropout; the recomputation replays it inside ``fork_rng`` so the stream is not
    advanced twice.
    """

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] | None = None

    def run(self, fn: Callable[[], torch.Tensor], device: torch.device) -> torch.Tensor:
        cuda = device.type == "cuda"
        if self.state is None:
            self.state = {"cpu": torch.get_rng_state()}
            if cuda:
                self.state["cuda"] = torch.cuda.get_rng_state(device)
            return fn()
        with torch.random.fork_rng(devices=[device] if cuda else []):
            torch.set_rng_state(self.state["cpu"])
            if cuda:
                torch.cuda.set_rng_state(self.state["cuda"], device)
            return fn()
