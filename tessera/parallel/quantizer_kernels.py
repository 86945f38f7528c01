"""Where the block quantizers run: one compiled kernel per quantization, or torch's eager ops.

``block_formats``' quantizers are chains of element-wise passes (amax, scale, round, scale back), each a read
and a write of the whole operand; in the emulated block-format GEMMs they, not the GEMMs, took most of a step.
``torch.compile`` (inductor: C++ on a CPU, Triton on CUDA) fuses each chain into one or two passes over the
operand. The compiled kernels run the same fp32 operations on each
element, so their results are bitwise those of the eager ops (``tests/test_quantizer_kernels.py`` checks every
recipe, orientation and switch, with blocks at the scale formats' edges).

The choice is made once per process and device type, on first use, and logged once:
``TESSERA_QUANTIZER=auto`` (the default) compiles where a compiler is present (a C++ compiler for CPU tensors,
Triton for CUDA ones) and runs eagerly elsewhere; ``=compiled`` or ``=eager`` force one (``forget_quantizer_kernels``
lets a process that changes the variable have it read again). Code that ``torch.compile`` is already tracing
calls the eager functions, which the outer compile fuses itself; random numbers drawn from a ``torch.Generator``
inside the quantizer (not given as a tensor) also run eagerly, since a compiled draw would differ.
Blocks along a dim other than the last are quantized on a contiguous copy with that dim last (a strided
reduction vectorizes poorly), and handed back as a view in the caller's layout. ``hadamard.rht`` stays eager:
its butterfly stages, already contiguous passes, compile to slower code than torch's own kernels.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Callable
from typing import Any

import torch

from tessera.logs import log_once
from tessera.parallel import block_formats
from tessera.parallel.block_formats import BLOCK_RECIPES, BlockStats, Randomness

__all__ = ["ENV", "compiled_quantizers", "fake_quantize", "fake_quantize_nvfp4_2d", "fake_quantize_nvfp4_2d_with_stats",
           "fake_quantize_with_stats", "forget_quantizer_kernels", "fused"]

ENV = "TESSERA_QUANTIZER"
CHOICES = ("auto", "compiled", "eager")
_CHOICE: dict[str, bool] = {}  # device type -> compiled (made once: compiled_quantizers)
_COMPILED: dict[Callable[..., Any], Callable[..., Any]] = {}


def forget_quantizer_kernels() -> None:
    """Forget the choices made, so the next use reads ``TESSERA_QUANTIZER`` again (tests, benchmarks)."""
    _CHOICE.clear()


def _compiler(device_type: str) -> str | None:
    """What would compile the kernels for ``device_type``, or None."""
    if device_type == "cpu":
        cxx = os.environ.get("CXX") or next((c for c in ("g++", "c++", "clang++") if shutil.which(c)), None)
        return f"inductor's C++ ({cxx})" if cxx and shutil.which(cxx) else None
    if device_type == "cuda":
        return "inductor's Triton" if importlib.util.find_spec("triton") is not None else None
    return None


def compiled_quantizers(device_type: str) -> bool:
    """Whether the block quantizers of tensors on ``device_type`` run compiled (decided once, logged once)."""
    if device_type in _CHOICE:
        return _CHOICE[device_type]
    choice = os.environ.get(ENV, "auto")
    if choice not in CHOICES:
        raise ValueError(f"{ENV}={choice!r}: must be one of {list(CHOICES)}")
    compiler = _compiler(device_type)
    if choice == "compiled" and compiler is None:
        raise RuntimeError(f"{ENV}=compiled, but nothing compiles kernels for {device_type} tensors here "
                           "(a C++ compiler for the CPU, Triton for CUDA)")
    compiled = choice == "compiled" or (choice == "auto" and compiler is not None)
    why = f"{ENV}={choice}" if choice != "auto" else ("a compiler is present" if compiled else
                                                     f"no compiler for {device_type} tensors")
    log_once(f"block quantizers on {device_type}: " + (f"compiled by {compiler}" if compiled else "torch's eager ops")
             + f" ({why})")
    _CHOICE[device_type] = compiled
    return compiled


def fused(fn: Callable[..., Any], t: torch.Tensor, *args: Any) -> Any:
    """``fn(t, *args)``, compiled where ``compiled_quantizers`` says: ``fn`` a pure function of tensors and
    constants (no collectives, no random draws, no checks that raise), one compile cache per ``fn``."""
    if not _use_compiled(t):
        return fn(t, *args)
    return _compiled(fn)(t, *args)


def _use_compiled(t: torch.Tensor, generator: Randomness = None) -> bool:
    if torch.compiler.is_compiling() or isinstance(generator, torch.Generator):
        return False
    return compiled_quantizers(t.device.type)


RECOMPILE_LIMIT = 64  # graphs per quantizer function: its constants, input dtypes and ranks, torch's global switches


def _compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` compiled once, for any shape (one graph per recipe and switch, not per shape). Called under a
    recompile limit of ``RECOMPILE_LIMIT`` instead of dynamo's 8: a process that runs several recipes, or changes
    torch's global switches (``PrecisionPlan.apply``: every guard then fails once), compiles more variants of one
    function than that, and past the limit dynamo would run it eagerly with only a warning."""
    if fn not in _COMPILED:
        compiled = torch.compile(fn, dynamic=True)

        def call(*args: Any) -> Any:
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                return compiled(*args)
        _COMPILED[fn] = call
    return _COMPILED[fn]


def _rows(t: torch.Tensor, recipe: str, amax: torch.Tensor | None, scale_rounding: str,
          noise: torch.Tensor | None) -> torch.Tensor:
    return block_formats.fake_quantize(t, recipe, -1, amax, scale_rounding, noise)


def _rows_stats(t: torch.Tensor, recipe: str, amax: torch.Tensor | None, scale_rounding: str,
                noise: torch.Tensor | None) -> tuple[torch.Tensor, BlockStats]:
    return block_formats.fake_quantize_with_stats(t, recipe, -1, amax, scale_rounding, noise)


def _tiles(w: torch.Tensor, amax: torch.Tensor | None) -> torch.Tensor:
    return block_formats.fake_quantize_nvfp4_2d(w, amax)


def _tiles_stats(w: torch.Tensor, amax: torch.Tensor | None) -> tuple[torch.Tensor, BlockStats]:
    return block_formats.fake_quantize_nvfp4_2d_with_stats(w, amax)


def _check(t: torch.Tensor, recipe: str, dim: int, scale_rounding: str) -> None:
    """block_formats' own errors, raised before a compiled call (a raise inside traced code would not be one line)."""
    if recipe not in BLOCK_RECIPES:
        raise ValueError(f"block recipe must be one of {list(BLOCK_RECIPES)}, got {recipe!r}")
    if scale_rounding not in block_formats.SCALE_ROUNDINGS:
        raise ValueError(f"MX scale rounding must be one of {list(block_formats.SCALE_ROUNDINGS)}, "
                         f"got {scale_rounding!r}")
    block_formats.check_blocks(t, BLOCK_RECIPES[recipe][1], dim)


def _last(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` with ``dim`` moved last, contiguous (no copy when it already is last)."""
    return t if dim == t.dim() - 1 else t.movedim(dim, -1).contiguous()


def _along_last(fn: Callable[..., Any], t: torch.Tensor, recipe: str, dim: int, amax: torch.Tensor | None,
                scale_rounding: str, generator: Randomness) -> Any:
    dim = dim % t.dim()
    _check(t, recipe, dim, scale_rounding)
    assert not isinstance(generator, torch.Generator)  # drawn inside the quantizer: eager (_use_compiled)
    noise = None if generator is None else _last(generator, dim)
    out = _compiled(fn)(_last(t, dim), recipe, amax, scale_rounding, noise)
    if isinstance(out, tuple):
        return out[0].movedim(-1, dim), out[1]
    return out.movedim(-1, dim)


def fake_quantize(t: torch.Tensor, recipe: str, dim: int = -1, amax: torch.Tensor | None = None,
                  scale_rounding: str = "floor", generator: Randomness = None) -> torch.Tensor:
    """``block_formats.fake_quantize``, bitwise, compiled where ``compiled_quantizers`` says."""
    if not _use_compiled(t, generator):
        return block_formats.fake_quantize(t, recipe, dim, amax, scale_rounding, generator)
    result: torch.Tensor = _along_last(_rows, t, recipe, dim, amax, scale_rounding, generator)
    return result


def fake_quantize_with_stats(t: torch.Tensor, recipe: str, dim: int = -1, amax: torch.Tensor | None = None,
                             scale_rounding: str = "floor",
                             generator: Randomness = None) -> tuple[torch.Tensor, BlockStats]:
    """``block_formats.fake_quantize_with_stats``, bitwise, compiled where ``compiled_quantizers`` says."""
    if not _use_compiled(t, generator):
        return block_formats.fake_quantize_with_stats(t, recipe, dim, amax, scale_rounding, generator)
    q, stats = _along_last(_rows_stats, t, recipe, dim, amax, scale_rounding, generator)
    return q, BlockStats(*stats)


def fake_quantize_nvfp4_2d(w: torch.Tensor, amax: torch.Tensor | None = None) -> torch.Tensor:
    """``block_formats.fake_quantize_nvfp4_2d``, bitwise, compiled where ``compiled_quantizers`` says."""
    if not _use_compiled(w):
        return block_formats.fake_quantize_nvfp4_2d(w, amax)
    block_formats.check_tiles_2d(w, block_formats.NVFP4_BLOCK)
    result: torch.Tensor = _compiled(_tiles)(w, amax)
    return result


def fake_quantize_nvfp4_2d_with_stats(w: torch.Tensor,
                                      amax: torch.Tensor | None = None) -> tuple[torch.Tensor, BlockStats]:
    """``block_formats.fake_quantize_nvfp4_2d_with_stats``, bitwise, compiled where ``compiled_quantizers`` says."""
    if not _use_compiled(w):
        return block_formats.fake_quantize_nvfp4_2d_with_stats(w, amax)
    block_formats.check_tiles_2d(w, block_formats.NVFP4_BLOCK)
    q, stats = _compiled(_tiles_stats)(w, amax)
    return q, BlockStats(*stats)
