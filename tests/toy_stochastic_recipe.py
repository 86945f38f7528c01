"""A toy GEMM recipe that owns state, added the way a researcher adds one: this file plus one row of the GEMM
route table (``ROW``, installed by ``install``). ``toy-sr`` multiplies in fp32 like the CPU's upcast route, but
rounds the output gradient stochastically to ``KEEP_BITS`` mantissa bits before both backward GEMMs, drawing
from each linear's own ``torch.Generator``, seeded from the run's seed and the linear's name and carried by
checkpoints (``RecipeState``). ``python -m tests.toy_stochastic_recipe ARGS`` runs train.py with it installed.
"""

from __future__ import annotations

import sys
import zlib
from typing import Any

import torch
import torch.nn.functional as F

from tessera.parallel import gemm

RECIPE = "toy-sr"
KEEP_BITS = 3  # mantissa bits a gradient element keeps (fp32 has 23)


class StochasticRounding(gemm.RecipeState):
    """One linear's random stream."""

    def __init__(self, seed: int, name: str) -> None:
        self.generator = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**62)

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])


def stochastic_round(t: torch.Tensor, generator: torch.Generator, keep_bits: int = KEEP_BITS) -> torch.Tensor:
    """``t`` (fp32) rounded to ``keep_bits`` mantissa bits, up with probability equal to the dropped fraction:
    a uniform integer below one unit of the kept last place is added to the magnitude's bits, then the dropped
    bits are cleared (unbiased; never past a neighbour on the kept grid)."""
    drop = 23 - keep_bits
    bits = t.float().contiguous().view(torch.int32)
    noise = torch.randint(0, 2**drop, bits.shape, generator=generator, dtype=torch.int32)
    return ((bits + noise) & ~(2**drop - 1)).view(torch.float32)


def _state(p: gemm.GemmPolicy) -> StochasticRounding:
    assert isinstance(p.state, StochasticRounding), "toy-sr needs its state (enable_low_precision_linears gives it)"
    return p.state


def _forward(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, p: gemm.GemmPolicy, s: gemm.TpSplit,
             o: gemm.GemmObservers = gemm.NO_OBSERVERS) -> torch.Tensor:
    return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)


def _grad_input(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, p: gemm.GemmPolicy,
                s: gemm.TpSplit) -> torch.Tensor:
    return (stochastic_round(g, _state(p).generator) @ w.float()).to(x.dtype)


def _grad_weight(g2: torch.Tensor, x2: torch.Tensor, w: torch.Tensor, p: gemm.GemmPolicy,
                 s: gemm.TpSplit) -> torch.Tensor:
    return (stochastic_round(g2, _state(p).generator).t() @ x2.float()).to(w.dtype)


ROW = gemm.GemmRoute(
    "toy-sr", "recipe 'toy-sr' (a test's stateful recipe)", _forward, _grad_input, _grad_weight,
    adds_into_main_grad=False, fp32_gemms=True, sequence_chunked=False,
    doc="fp32 GEMMs; output gradients stochastically rounded to 3 mantissa bits from a per-linear stream",
    copy_bytes=4, recipe=RECIPE, make_state=StochasticRounding)


def install() -> None:
    """Add the row (once per process)."""
    if RECIPE not in gemm.gemm_recipes():
        gemm.add_route(ROW)


if __name__ == "__main__":
    install()
    import train

    sys.exit(train.main(sys.argv[1:]))
