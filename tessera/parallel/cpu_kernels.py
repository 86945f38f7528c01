"""Whether this CPU runs bf16/fp16 through torch's own kernels or as fp32 kernels on upcast operands.

What a bf16 GEMM means on a GPU tensor core: bf16 operands, exact products, fp32 accumulation, the
result rounded to bf16. On a CPU without avx512_bf16/AMX, torch's bf16 kernels are reference loops,
far slower than its fp32 GEMMs (BENCHMARKS.md and docs/cpu-kernels.md have the figures). Upcasting
the bf16 operands to fp32 and running the fp32 GEMM computes the same thing -- products of bf16
values are exact in fp32, accumulation is fp32, the output is rounded to bf16. The GEMM routes
(``tessera.parallel.gemm``: the ``cpu-upcast`` row) and attention (``tessera.model.sdpa``,
``tessera.model.cpu_attention``) read the choice made here.

The choice is made once per process per dtype (on first use, or by ``decide_cpu_kernels`` before
``torch.compile`` traces a model, so the traced code sees a constant, not an environment read) and
logged. ``TESSERA_CPU_LOWP_MATMUL=native`` forces torch's own kernels (for benchmarks), ``=upcast``
forces ours; ``forget_cpu_kernels`` lets a process that changes the variable (benchmarks, tests) have
it read again.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

__all__ = ["ENV", "NATIVE_FLAGS", "choice_source", "decide_cpu_kernels", "forget_cpu_kernels", "upcast_on_cpu"]

logger = logging.getLogger("tessera")

ENV = "TESSERA_CPU_LOWP_MATMUL"
NATIVE_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}
_UPCAST: dict[torch.dtype, bool] = {}  # the choice per dtype, made once (upcast_on_cpu)
_SOURCE: dict[torch.dtype, str] = {}  # what made it: "auto" (the CPU's flags), "native" or "upcast" (the variable)


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _decide(dtype: torch.dtype) -> bool:
    choice = os.environ.get(ENV, "auto")
    if choice not in ("auto", "native", "upcast"):
        raise ValueError(f"{ENV}={choice!r}: must be 'auto', 'native' or 'upcast'")
    if choice == "native":
        upcast = False
    elif choice == "upcast":
        upcast = True
    else:
        upcast = not any(flag in _cpu_flags() for flag in NATIVE_FLAGS[dtype])
    how = ("fp32 GEMMs on upcast operands, fp32 accumulation, output rounded to " + str(dtype).split(".")[-1]
           if upcast else "torch's native kernels")
    why = f"{ENV}={choice}" if choice != "auto" else (
        f"this CPU has {'none' if upcast else 'one'} of {'/'.join(NATIVE_FLAGS[dtype])}")
    logger.info("CPU %s matmuls (and SDPA attention: KV cache, dropout): %s (%s)", str(dtype).split(".")[-1], how, why)
    return upcast


def upcast_on_cpu(dtype: torch.dtype) -> bool:
    """True when ``dtype`` matmuls on this CPU should run as fp32 GEMMs on upcast operands (decided on first
    use for each dtype, then a dict lookup that ``torch.compile`` reads as a constant)."""
    if dtype not in NATIVE_FLAGS:
        return False
    if dtype not in _UPCAST:
        _UPCAST[dtype] = _decide(dtype)
        _SOURCE[dtype] = os.environ.get(ENV, "auto")
    return _UPCAST[dtype]


def choice_source(dtype: torch.dtype) -> str:
    """``"auto"`` when this CPU's flags made the choice for ``dtype``, else the forcing variable's value."""
    upcast_on_cpu(dtype)
    return _SOURCE.get(dtype, "auto")


def decide_cpu_kernels() -> dict[torch.dtype, bool]:
    """Make (and log) the choice for every low-precision dtype now, e.g. before compiling a model."""
    return {dtype: upcast_on_cpu(dtype) for dtype in NATIVE_FLAGS}


def forget_cpu_kernels() -> None:
    """Drop the choices made so far: the next use reads ``TESSERA_CPU_LOWP_MATMUL`` again. Code compiled
    before keeps the choice it was traced with."""
    _UPCAST.clear()
    _SOURCE.clear()
