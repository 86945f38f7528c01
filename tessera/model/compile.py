"""``model.compile``: every decoder block's forward through ``torch.compile`` (``compile_blocks``).

What is compiled: ``DecoderLayer.forward`` -- norms, attention, SwiGLU, residual adds, the
tensor-parallel collectives (torch.distributed calls, which Dynamo turns into functional collectives,
so mtp and msp blocks trace whole), and under selective checkpointing the checkpointed halves, whose
policy the compiler applies to the traced graph (``tessera.model.recompute``). All blocks run one
code object: Dynamo caches compiled graphs per code object, with parameters as graph inputs, so the
identical layers share them; a block whose guards differ gets its own (the first block of a forward
builds the packed-document mask that the others reuse). Shapes are static (``dynamic=False``): a new
batch shape compiles again.

What is not: embedding, final norm, head and loss (one call each per step); the full-checkpoint
wrapper around a block (it calls the compiled block, and again in backward); forwards with a KV cache
(generation: a new length every token). Meta or fake parameters (dry runs) are never compiled.

Warm-up: a block's first call with a new signature (grad mode, train/eval, input shape and dtype) runs
eagerly, so choices the code inside makes lazily (kernel selection, log-once messages, caches) are made
in Python before the tracer sees them, and are constants of the traced code; a checkpoint's
recomputation of that call runs eagerly as well (it must save what the forward saved). The CPU
low-precision kernel choice (``tessera.parallel.cpu_kernels``), which picks the GEMM route
(``tessera.parallel.gemm``), is made before anything is traced. Weight gradients reach the fp32 main
gradients inside the graphs through ``tessera::weight_grad`` (``tessera.parallel.wgrad``).
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake

from tessera.model import cpu_attention
from tessera.model.attention import select_backend
from tessera.model.forward_info import ForwardContext
from tessera.model.transformer import DecoderLayer
from tessera.parallel import cpu_kernels

__all__ = ["BACKENDS", "MODES", "compile_blocks", "compiles_blocks", "compiled_blocks", "settings_problem"]

logger = logging.getLogger("tessera")

BACKENDS = ("inductor", "aot_eager", "eager")  # eager / aot_eager: Dynamo (and AOTAutograd) without code generation
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass
class _Shared:
    """What the blocks of one model share: the compiled function and the compile-time bookkeeping."""

    fn: Any
    backend: str
    mode: str
    count: int
    pending_s: float = 0.0
    pending_graphs: int = 0
    logged: set[tuple[bool, bool]] = field(default_factory=set)


def _graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class _CompiledForward:
    """Stands in for one block's ``forward`` (an instance attribute, so names and state dicts are untouched)."""

    def __init__(self, layer: DecoderLayer, shared: _Shared, position: int) -> None:
        self._layer = weakref.ref(layer)  # the layer holds this object: no reference cycle
        self.shared = shared
        self.position = position  # this block's index among the compiled ones (the last one closes a forward)
        self.seen: set[tuple[Any, ...]] = set()
        self.warmup_ctx: weakref.ref[ForwardContext] | None = None

    def eager(self, layer: DecoderLayer, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return DecoderLayer.forward(layer, x, ctx)

    def __call__(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        layer = self._layer()
        assert layer is not None, "a compiled forward outlived its layer"
        if ctx.cache is not None or x.is_meta or is_fake(x):
            return self.eager(layer, x, ctx)
        key = (torch.is_grad_enabled(), layer.training, tuple(x.shape), x.dtype, x.device,
               ctx.sequence_parallel, ctx.selective)
        if key not in self.seen:  # warm-up: see the module docstring
            self.seen.add(key)
            self.warmup_ctx = weakref.ref(ctx)
            return self.eager(layer, x, ctx)
        if self.warmup_ctx is not None and self.warmup_ctx() is ctx:  # a checkpoint recomputing the warm-up call
            return self.eager(layer, x, ctx)
        _prepare_plan(ctx, x)
        shared = self.shared
        before, start = _graphs_compiled(), time.perf_counter()
        out = shared.fn(layer, x, ctx)
        new = _graphs_compiled() - before
        if new:
            shared.pending_s += time.perf_counter() - start
            shared.pending_graphs += new
        if self.position == shared.count - 1 and shared.pending_graphs:
            self._log(key[0], key[1])
        return out

    def _log(self, grad: bool, training: bool) -> None:
        shared = self.shared
        kind = "training" if grad and training else ("evaluation" if not grad else "forward")
        detail = "" if kind != "training" or (grad, training) in shared.logged else (
            "; the backward graphs compile during the first backward")
        shared.logged.add((grad, training))
        logger.info("model.compile: %d graph(s) compiled for the %s forward of %d blocks in %.1f s (backend %s, "
                    "mode %s)%s", shared.pending_graphs, kind, shared.count, shared.pending_s, shared.backend,
                    shared.mode, detail)
        shared.pending_s, shared.pending_graphs = 0.0, 0


def _prepare_plan(ctx: ForwardContext, x: torch.Tensor) -> None:
    """Build what packed rows need now, outside the compiled block: the CPU kernel's document buckets (read
    from the host boundaries, which Dynamo cannot trace), the SDPA mask or the varlen boundaries (the plan
    builds them lazily on first use, and Dynamo cannot trace that assignment inside a checkpointed region,
    where it would leave the first block of every forward eager)."""
    plan = ctx.plan
    if not plan.packed:
        return
    if x.device.type == "cpu":
        plan.document_buckets()
    elif select_backend(x.device, x.dtype, plan.use_flash_attn, packed=True)[0] == "sdpa":
        plan.mask(x.device)
    else:  # flash_attn or torch's varlen kernel: the int32 boundaries on the device
        plan.varlen(x.device)


def _block_forward(layer: DecoderLayer, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
    return DecoderLayer.forward(layer, x, ctx)


def _probe(backend: str, mode: str, device: torch.device) -> None:
    """Compile and run a two-op function on ``device``: a backend that cannot compile here (inductor on a CPU
    without a C++ compiler) fails now, in one line naming the key, not inside the first step."""
    fn = torch.compile(lambda t: torch.nn.functional.silu(t) * t, backend=backend, dynamic=False,
                       mode=mode if backend == "inductor" else None)
    try:
        fn(torch.ones(8, device=device))
    except Exception as e:  # noqa: BLE001 - any failure to compile is reported the same way
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        why = f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]
        hint = " (install a C++ compiler such as g++)" if backend == "inductor" and device.type == "cpu" else ""
        raise RuntimeError(f"model.compile.backend={backend!r} cannot compile on {device.type}{hint}: {why}; "
                           "or set model.compile.enabled=False") from None


def settings_problem(backend: str, mode: str) -> str | None:
    """What is wrong with this backend and mode, naming the keys (the config checks call it too), or None."""
    if backend not in BACKENDS:
        return f"model.compile.backend={backend!r}: must be one of {list(BACKENDS)}"
    if mode not in MODES:
        return f"model.compile.mode={mode!r}: must be one of {list(MODES)}"
    if mode != "default" and backend != "inductor":
        return (f"model.compile.mode={mode!r} is a mode of the inductor backend, not of "
                f"model.compile.backend={backend!r}")
    return None


def compiles_blocks(setting: bool | str, device_type: str, hooks_activations: bool) -> bool:
    """``model.compile.enabled`` resolved: True / False as set; ``"auto"`` compiles on CUDA and stays eager on
    the CPU (where compiling a short run costs more than it saves) and where the precision telemetry hooks
    module outputs inside the blocks. The one rule the builder and the memory check both read."""
    if setting != "auto":
        return bool(setting)
    return device_type == "cuda" and not hooks_activations


def compile_blocks(model: nn.Module, *, backend: str = "inductor", mode: str = "default") -> int:
    """Run every ``DecoderLayer`` inside ``model`` (a ``Transformer``, or a wrapper holding one) through
    ``torch.compile`` from its second call on (see the module docstring); returns how many were set up
    (0 for a model on meta or fake tensors: a dry run stays eager)."""
    problem = settings_problem(backend, mode)
    if problem:
        raise ValueError(problem)
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    if not layers:
        raise ValueError(f"model.compile: {type(model).__name__} holds no DecoderLayer to compile")
    params = [p for layer in layers for p in layer.parameters()]
    if any(p.is_meta or is_fake(p) for p in params):
        logger.info("model.compile: parameters on meta/fake tensors (a dry run): the blocks run eagerly")
        return 0
    if any(isinstance(layer.forward, _CompiledForward) for layer in layers):
        raise ValueError("model.compile: the blocks of this model are compiled already")
    cpu_kernels.decide_cpu_kernels()  # a per-process constant before anything is traced
    cpu_attention.outside_graphs()  # the packed CPU kernel's graph-break wrapper, made before tracing
    device = params[0].device
    _probe(backend, mode, device)
    fn = torch.compile(_block_forward, backend=backend, dynamic=False, mode=mode if backend == "inductor" else None)
    shared = _Shared(fn, backend, mode, len(layers))
    for i, layer in enumerate(layers):
        layer.forward = _CompiledForward(layer, shared, i)  # type: ignore[method-assign]
    logger.info("model.compile: %d decoder blocks compiled with torch.compile (backend %s, mode %s, static shapes) "
                "from their second call on; generation (KV cache) stays eager", len(layers), backend, mode)
    return len(layers)


def compiled_blocks(model: nn.Module) -> int:
    """How many decoder blocks of ``model`` run compiled (``compile_blocks``)."""
    return sum(isinstance(m.forward, _CompiledForward) for m in model.modules() if isinstance(m, DecoderLayer))
