"""The random Hadamard transform (RHT) of NVIDIA's NVFP4 training recipe (arXiv 2509.25149; Transformer Engine's
``NVFP4BlockScaling``), as pure tensor functions: no autograd, no process group.

The weight-gradient GEMM ``dW = G^T X`` sums over tokens. Multiplying both operands along the tokens by one
orthonormal ``Q = H diag(s)`` (``H`` a 16x16 Hadamard matrix, ``s`` a fixed random sign vector), block by
block, leaves the product unchanged, ``(Q G)^T (Q X) = G^T Q^T Q X = G^T X``, but spreads each block's outliers
over its 16 elements, so the block scales of a 16-element format fit the bulk better and fewer elements
flush to zero. The signs keep a structured input (a constant block, say) from landing on one Hadamard row.
The blocks lie along the token dim only, so a tensor-parallel shard of the feature dims transforms alone.

``rht`` computes the transform as a fast Walsh-Hadamard transform (log2 n butterfly stages of additions
and subtractions, then the 1/sqrt(n) factor, exact for n = 16): elementwise arithmetic, so the result is
the same bits whatever the shape of the tensor around a block (a shard transforms to the slice of the
whole) and each output carries at most log2 n roundings.
"""

from __future__ import annotations

import torch

__all__ = ["check_rht", "hadamard_matrix", "random_signs", "rht"]


def _check_power_of_two(n: int, what: str) -> None:
    if n < 1 or n & (n - 1):
        raise ValueError(f"{what} must be a power of two (Sylvester's construction), got {n}")


def hadamard_matrix(n: int = 16) -> torch.Tensor:
    """The orthonormal n x n Hadamard matrix of Sylvester's construction in fp32: entry ``(i, j)`` is
    ``(-1)**popcount(i & j) / sqrt(n)`` (symmetric, ``H @ H = I``). ``n`` a power of two."""
    _check_power_of_two(n, "Hadamard size")
    i = torch.arange(n)
    parity = torch.zeros(n, n, dtype=torch.int64)
    bits = i[:, None] & i[None, :]
    while bool(bits.any()):  # popcount, one bit at a time
        parity ^= bits & 1
        bits = bits >> 1
    return ((1 - 2 * parity).double() / n ** 0.5).float()


def random_signs(seed: int, n: int = 16) -> torch.Tensor:
    """n random signs (+1.0 / -1.0, fp32, on the CPU) from a ``torch.Generator`` seeded with ``seed``: the same
    vector for the same seed on every rank and device (move it where the tensor lives)."""
    if n < 1:
        raise ValueError(f"the number of signs must be positive, got {n}")
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2, (n,), generator=g) * 2 - 1).float()


def _fwht(x: torch.Tensor) -> torch.Tensor:
    """The unnormalized Walsh-Hadamard transform along dim -2 of ``x`` (``(..., n, rest)``, ``n`` a power of two)
    in Sylvester's order: stage h turns each pair ``(a, b)`` at distance h into ``(a + b, a - b)``. The transformed
    dim is not the last, so every operation runs over contiguous runs of ``rest`` elements (the transform along the
    tokens of a (tokens, features) operand reads it in place; a last-dim transform would stride by ``n``)."""
    n, rest = x.shape[-2], x.shape[-1]
    lead = x.shape[:-2]
    h = 1
    while h < n:
        pairs = x.reshape(*lead, n // (2 * h), 2, h, rest)
        a, b = pairs[..., 0, :, :], pairs[..., 1, :, :]
        x = torch.stack([a + b, a - b], dim=-3).reshape(*lead, n, rest)
        h *= 2
    return x


def rht(t: torch.Tensor, signs: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` with ``H diag(signs)`` applied to each block of ``n = len(signs)`` consecutive elements along ``dim``
    (``H`` = ``hadamard_matrix(n)``), in ``t``'s dtype promoted to fp32 (fp64 stays fp64). Applying it to both
    operands of a GEMM along the dim it sums over leaves the product unchanged. The size along ``dim`` must be
    a multiple of ``n``, a power of two."""
    check_rht(t, signs, dim)
    n = signs.numel()
    dtype = torch.promote_types(t.dtype, torch.float32)
    x = t.to(dtype).movedim(dim % t.dim(), 0)  # no copy for dim 0 of a contiguous tensor
    moved = x.shape
    blocks = x.reshape(moved[0] // n, n, -1) * signs.to(device=t.device, dtype=dtype).view(n, 1)
    y = _fwht(blocks) * (1.0 / n ** 0.5)
    return y.reshape(moved).movedim(0, dim % t.dim())


def check_rht(t: torch.Tensor, signs: torch.Tensor, dim: int) -> None:
    """A ValueError naming the sizes unless ``signs`` is a vector of a power-of-two length dividing ``t``'s ``dim``."""
    if signs.dim() != 1:
        raise ValueError(f"signs must be a vector, got shape {tuple(signs.shape)}")
    n = signs.numel()
    _check_power_of_two(n, "the Hadamard block (len(signs))")
    dim = dim % t.dim()
    size = t.shape[dim]
    if size % n:
        raise ValueError(f"the Hadamard block {n} does not divide size {size} of dim {dim} "
                         f"(shape {tuple(t.shape)})")
