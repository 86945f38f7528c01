"""The AdamW update of a flat master shard in one fused pass: fp32 or bf16 masters, fp32 or bf16 moments.

Why fused: an eager AdamW reads and writes the whole shard once per operator (about ten passes, each
allocating a shard-sized temporary), which made the update a large share of a step. torch's fused AdamW
kernel (``torch._fused_adamw_``, CPU and CUDA) does the whole update in one pass. With fp32 masters and
fp32 moments it runs on the shard itself; with low-precision storage the shard is walked in chunks: each
chunk is widened to fp32 scratch buffers, updated by the same kernel, and rounded back, so the data
crosses memory once and the scratch is reused. On a CPU a chunk is small enough for its scratch to stay
in the core's cache, yet large enough that the dozen operator calls per chunk are not the cost; on a GPU
every call is a kernel launch, so a chunk is a large slice of the shard (``chunk_for``).

Why low-precision masters need care: with bf16 masters an update smaller than half a bf16 ulp of the
weight is rounded away, so a small learning rate stalls training. Two remedies, ``master_compensation``:

- ``kahan``: a bf16 compensation buffer ``c`` keeps what rounding the weight lost. The weight is
  read as ``w + c`` in fp32, updated, then split again into ``w = bf16(value)`` and
  ``c = bf16(value - w)``. The pair holds about 16 significant bits, and the lost part is carried
  forward instead of dropped.
- ``stochastic``: the updated fp32 value is rounded up or down at random, with probabilities that
  make the rounding unbiased. The random bits are a hash of (seed, step, parameter name, element
  index), so a replicated element rounds the same way on every TP/DP rank and in every ZeRO layout,
  and a resumed run draws the same bits (the step is checkpointed).

The moments are computed in fp32 and stored in ``optimizer_state_dtype``, rounded to nearest.
The arithmetic is torch's AdamW: decoupled weight decay, bias-corrected moments, eps outside the sqrt.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["adamw_step", "stochastic_round_bf16", "element_noise", "name_key", "COMPENSATIONS", "CHUNK",
           "CUDA_CHUNK", "chunk_for", "Noise", "Observe"]

COMPENSATIONS = ("none", "kahan", "stochastic")
CHUNK = 1 << 18  # elements per chunk of a low-precision update on a CPU: 1 MiB per fp32 scratch buffer
CUDA_CHUNK = 1 << 24  # on a GPU: 64 MiB per fp32 scratch buffer, a few launches per shard
_M1, _M2 = 0x7FEB352D, 0x2C1B3C6D  # hash multipliers (odd, < 2**31)
_WEYL = 0x9E3779B9  # golden-ratio increment: consecutive indices land far apart before mixing
_LOW16 = -65536  # int32 mask 0xFFFF0000: the bits a bf16 keeps of an fp32
_LANES = 64  # a multiple of every CPU vector width (fp32) and of the fused kernel's task unit

Noise = Callable[[int, int], torch.Tensor]
# (start, stop, update, before, unchanged) per chunk: see tessera.optim.step_observer.StepObserver.update
Observe = Callable[[int, int, torch.Tensor, torch.Tensor, torch.Tensor], None]


def _int32(x: int) -> int:
    """A 32-bit pattern as the signed value an int32 tensor holds."""
    x &= 0xFFFFFFFF
    return x - (1 << 32) if x >= 1 << 31 else x


def _mix32_int(x: int) -> int:
    """A 32-bit integer finaliser (murmur-style) of one Python integer."""
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * _M1) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * _M2) & 0xFFFFFFFF
    return x ^ (x >> 16)


def name_key(name: str) -> int:
    """A stable 32-bit key of a parameter name (the same on every rank and in every layout)."""
    return zlib.crc32(name.encode())


_WEYL_STEPS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _weyl_steps(n: int, device: torch.device) -> torch.Tensor:
    """``arange(n) * _WEYL`` (int32, wrapping), cached per device: the index term of every noise draw (a chunk
    holds half as many pairs as elements)."""
    size = max(n, CHUNK // 2)
    key = (device, size)
    if key not in _WEYL_STEPS:
        _WEYL_STEPS.clear() if len(_WEYL_STEPS) > 8 else None
        _WEYL_STEPS[key] = torch.arange(size, dtype=torch.int64, device=device).mul_(_WEYL).bitwise_and_(
            0xFFFFFFFF).to(torch.int32)  # low 32 bits: the int32 wrap
    return _WEYL_STEPS[key][:n]


def chunk_for(device: torch.device) -> int:
    """Elements per chunk of a low-precision update on ``device`` (see the module docstring)."""
    return CUDA_CHUNK if device.type == "cuda" else CHUNK


def element_noise(start: int, stop: int, param_key: int, step: int, seed: int, device: Any,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """16 random bits (int32 in [0, 65536)) for elements ``[start, stop)`` of one parameter at ``step``.

    One 32-bit hash per pair of elements: element ``i`` takes the low 16 bits of hash ``i // 2`` when
    ``i`` is even and the high 16 bits when it is odd, so half as many hashes are computed as there are
    elements. int32 arithmetic that wraps modulo 2**32 (logical shifts by masking): a few vectorised
    integer operations per pair; written into ``out`` when given. The value depends only on the element
    index and the keys, not on where a draw starts or ends."""
    lo, hi = start // 2, (stop + 1) // 2  # the pairs that cover [start, stop)
    key = _int32(_mix32_int(param_key ^ _mix32_int(step ^ _mix32_int(seed))) + lo * _WEYL)
    n = hi - lo
    base = _weyl_steps(n, torch.device(device)) if n <= CHUNK else None
    if base is None:  # large draws: the index term computed here (wraps like the cached one)
        base = torch.arange(n, dtype=torch.int64, device=device).mul_(_WEYL).bitwise_and_(
            0xFFFFFFFF).to(torch.int32)
    x = base + key
    shifted = torch.empty_like(x)
    for shift, mult in ((16, _M1), (15, _M2)):
        x.bitwise_xor_(torch.bitwise_right_shift(x, shift, out=shifted).bitwise_and_((1 << (32 - shift)) - 1))
        x.mul_(mult)
    x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=shifted).bitwise_and_(0xFFFF))
    # the int32 hashes read as int16 pairs are (low, high) halves in element order (little-endian, as on every
    # device torch runs on); widening sign-extends, the mask takes the 16 bits back
    halves = x.view(torch.int16)[start - 2 * lo : start - 2 * lo + (stop - start)]
    bits = out.copy_(halves) if out is not None else halves.to(torch.int32)
    return bits.bitwise_and_(0xFFFF)


def stochastic_round_bf16(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` rounded to bf16 up or down with probability proportional to the distance (unbiased):
    add 16 random bits below the bf16 mantissa, then truncate."""
    bits = x.contiguous().view(torch.int32)
    return ((bits + noise) & _LOW16).view(torch.float32).to(torch.bfloat16)


def _fused(w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: torch.Tensor,
           hyper: Mapping[str, Any]) -> None:
    """torch's fused AdamW on fp32 ``w`` / ``m`` / ``v`` in place; ``step`` is the step being taken (from 1).

    The kernel's vector loop and its scalar tail round differently, so an element's result would depend
    on where a call ends (on the ZeRO layout, on the chunking). Calls therefore cover whole multiples of
    ``_LANES`` elements, and the ragged end goes through a zero-padded scratch of ``_LANES`` elements."""
    beta1, beta2 = (float(b) for b in hyper["betas"])
    lr, wd, eps = float(hyper["lr"]), float(hyper["weight_decay"]), float(hyper["eps"])

    def kernel(w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> None:
        torch._fused_adamw_([w], [g], [m], [v], [], [step], lr=lr, beta1=beta1, beta2=beta2, weight_decay=wd,
                            eps=eps, amsgrad=False, maximize=False)

    n = w.numel()
    body = n - n % _LANES
    if body:
        kernel(w[:body], g[:body], m[:body], v[:body])
    if body < n:
        pad = [torch.zeros(_LANES, dtype=torch.float32, device=w.device) for _ in range(4)]
        for buf, t in zip(pad, (w, g, m, v)):
            buf[: n - body].copy_(t[body:])
        kernel(*pad)
        for buf, t in zip((pad[0], pad[2], pad[3]), (w, m, v)):
            t[body:].copy_(buf[: n - body])


def adamw_step(master: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], hyper: Mapping[str, Any], *,
               compensation: str, state_dtype: torch.dtype, noise: Noise | None = None, chunk: int | None = None,
               observe: Observe | None = None) -> None:
    """One AdamW update of the flat ``master`` shard (fp32 or bf16) from the fp32 ``grad``, in place.

    ``state`` holds ``step`` (0-dim fp32, on the host as torch's AdamW keeps it), ``exp_avg`` /
    ``exp_avg_sq`` (``state_dtype``) and, for Kahan, ``master_compensation`` (bf16); missing entries start
    at zero. ``noise(start, stop)`` returns the random bits of stochastic rounding for shard elements
    ``[start, stop)``. ``chunk``: elements per chunk of low-precision storage (default ``chunk_for`` the device);
    the result does not depend on it. ``observe`` sees each chunk's fp32 update (precision telemetry); with it
    the fp32 path runs chunk by chunk too, which gives the same bits (calls cover whole lanes, see ``_fused``).
    """
    if hyper.get("amsgrad") or hyper.get("maximize"):
        raise ValueError("the fused AdamW update supports AdamW without amsgrad or maximize")
    if compensation not in COMPENSATIONS:
        raise ValueError(f"master_compensation must be one of {list(COMPENSATIONS)}, got {compensation!r}")
    if compensation == "stochastic" and noise is None and master.dtype != torch.float32:
        raise ValueError("stochastic rounding needs noise(start, stop)")
    if "step" not in state:
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(master, dtype=state_dtype)
        state["exp_avg_sq"] = torch.zeros_like(master, dtype=state_dtype)
    if compensation == "kahan" and master.dtype != torch.float32 and "master_compensation" not in state:
        state["master_compensation"] = torch.zeros_like(master, dtype=torch.bfloat16)
    state["step"] += 1
    now = float(state["step"])
    step = torch.full((), now, dtype=torch.float32, device=master.device)  # the kernel's copy, on its device
    m_all, v_all = state["exp_avg"], state["exp_avg_sq"]
    chunk = chunk_for(master.device) if chunk is None else chunk
    if master.dtype == torch.float32 and m_all.dtype == torch.float32 and v_all.dtype == torch.float32:
        if observe is None:
            _fused(master, grad, m_all, v_all, step, hyper)
            return
        size = -(-max(1, chunk) // _LANES) * _LANES
        for a in range(0, master.numel(), size):
            w, z = master[a : a + size], min(a + size, master.numel())
            before = w.clone()
            _fused(w, grad[a:z], m_all[a:z], v_all[a:z], step, hyper)
            observe(a, z, w - before, before, w == before)
        return
    _chunked(master, grad, state, hyper, step, compensation if master.dtype != torch.float32 else "none",
             noise, chunk, observe)


def _chunked(master: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], hyper: Mapping[str, Any],
             step: torch.Tensor, compensation: str, noise: Noise | None, chunk: int, observe: Observe | None) -> None:
    """The fused kernel over chunks of low-precision storage (``chunk_for``), through reused fp32 scratch."""
    n = master.numel()
    size = min(-(-max(1, chunk) // _LANES) * _LANES, -(-n // _LANES) * _LANES)  # whole lanes per chunk
    scratch = {key: torch.empty(size, dtype=torch.float32, device=master.device)
               for key, t in (("w", master), ("m", state["exp_avg"]), ("v", state["exp_avg_sq"]), ("c", master))
               if t.dtype != torch.float32}
    comp = state.get("master_compensation") if compensation == "kahan" else None
    for a in range(0, n, size):
        z = min(a + size, n)
        w, m, v = master[a:z], state["exp_avg"][a:z], state["exp_avg_sq"][a:z]
        w32, m32, v32 = (scratch[k][: z - a].copy_(t) if k in scratch else t for k, t in (("w", w), ("m", m), ("v", v)))
        if comp is not None:
            w32.add_(scratch["c"][: z - a].copy_(comp[a:z]))
        if observe is not None:  # the value the update starts from, and the stored bits it may change
            before, stored = w32.clone(), (w.clone(), comp[a:z].clone() if comp is not None else None)
        _fused(w32, grad[a:z], m32, v32, step, hyper)
        if observe is not None:
            update = w32 - before  # before the rounding below reuses w32
        for k, t, t32 in (("m", m, m32), ("v", v, v32)):
            if k in scratch:
                t.copy_(t32)
        if "w" in scratch:
            if compensation == "stochastic":
                assert noise is not None  # checked by adamw_step
                bits = w32.view(torch.int32)
                w.copy_(bits.add_(noise(a, z)).bitwise_and_(_LOW16).view(torch.float32))  # exact: low bits are zero
            else:
                w.copy_(w32)  # round to nearest
                if comp is not None:
                    comp[a:z].copy_(w32.sub_(scratch["c"][: z - a].copy_(w)))
        if observe is not None:
            unchanged = w == stored[0]
            if comp is not None and stored[1] is not None:
                unchanged &= comp[a:z] == stored[1]
            observe(a, z, update, before, unchanged)
