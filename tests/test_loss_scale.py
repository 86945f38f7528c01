"""The loss scale is taken out of the update, the reported norm and the clipping (fp16 against fp32).

fp16 multiplies the loss by the scale (2**16 by default) before ``backward``; the optimizer must divide it out
of the gradients before they reach the inner optimizer, the norm and the clipping. AdamW is nearly blind to a
constant gradient factor, so these checks use SGD (whose update is proportional to the gradient) and AdamW
where ``eps`` is not negligible against the gradient (where the factor does show).

The model is one bias-free linear layer whose weights and inputs are exactly representable in fp16, so the
fp16 run and the fp32 reference differ only by the rounding of the fp16 forward and backward: each gradient
entry is a sum of ``B`` products, rounded once to fp16 after fp32 accumulation on CPU, so its relative error
is at most ``B * u16`` with ``u16 = 2**-11`` (plus one rounding of the scaled output gradient). A gradient
left scaled is off by a factor of 65,536, and an unscaled norm 65,536 times too large clips everything.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tessera.core.naive_amp import NaiveAMPModel, unwrap_model
from tessera.optim.hybrid_zero import HybridZeroOptimizer

BATCH, IN, OUT = 4, 16, 8
U16 = 2.0**-11
GRAD_RTOL = (BATCH + 2) * U16  # fp16 backward of one linear layer (see the module docstring)


class Linear(nn.Module):
    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.lin = nn.Linear(IN, OUT, bias=False)
        with torch.no_grad():
            self.lin.weight.copy_(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w0 = torch.randn(OUT, IN, generator=g).half().float()  # exact in fp16
    x = torch.randn(BATCH, IN, generator=g).half().float()
    c = torch.randn(BATCH, OUT, generator=g).half().float() * 2.0**-4  # d loss / d out, exact in fp16
    return w0, x, c


def _train(dtype: str, make_inner, steps: int, clip: float, c_scale: float = 1.0) -> tuple[torch.Tensor, list[float]]:
    """``steps`` optimizer steps of ``sum(out * c)`` on the linear layer in ``dtype``; the fp32 masters after
    them and the grad norm each step reported."""
    w0, x, c = _data()
    model = NaiveAMPModel(Linear(w0), dtype=dtype, sync_buffer=False)
    opt = HybridZeroOptimizer(make_inner(model.parameters()), zero_cfg={"clip_grad_norm": clip},
                              param_names=unwrap_model(model))
    norms = []
    for _ in range(steps):
        opt.backward((model(x) * (c * c_scale)).sum())
        success, norm = opt.step()
        assert success
        norms.append(float(norm))
    return opt.state_dict()["master"]["lin.weight"], norms  # the fp32 masters (fp16 weights are them, rounded)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_fp16_sgd_updates_like_fp32():
    """SGD's step is ``lr * grad``: a gradient left scaled by 2**16 moves the weights 65,536x too far."""
    sgd = lambda params: torch.optim.SGD(params, lr=0.5)  # noqa: E731
    w0 = _data()[0]
    w16, _ = _train("fp16", sgd, steps=1, clip=0.0)
    w32, _ = _train("fp32", sgd, steps=1, clip=0.0)
    # the weights are rounded to fp16 for the forward, the masters are not: compare the fp32 update itself,
    # against the update's own size (the fp16 weights' rounding is below that bound too: |w| u16 per entry)
    update16, update32 = w16 - w0, w32 - w0
    assert _rel(update16, update32) <= GRAD_RTOL, _rel(update16, update32)


def test_fp16_momentum_sgd_over_several_steps_updates_like_fp32():
    """Three momentum steps: the second and third forwards run on the fp16-rounded weights, each rounding at
    most u16 relative to the weight, so the update's error grows by that much per step at most."""
    msgd = lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)  # noqa: E731
    w0 = _data()[0]
    w16, _ = _train("fp16", msgd, steps=3, clip=0.0)
    w32, _ = _train("fp32", msgd, steps=3, clip=0.0)
    update16, update32 = w16 - w0, w32 - w0
    bound = 3 * GRAD_RTOL + 3 * U16 * float(w0.norm() / update32.norm())
    assert _rel(update16, update32) <= bound, (_rel(update16, update32), bound)


def test_fp16_adamw_with_a_non_negligible_eps_updates_like_fp32():
    """AdamW's first step is ``g / (|g| + eps)``: with gradients of 1e-6 and eps=1e-8 that is 0.990, and 1.000
    with the scale left in (the gradient 65,536x larger swamps eps). fp16 rounding moves it by ~eps/|g| x
    GRAD_RTOL, far below the 1% the bug would show."""
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-3, eps=1e-8, weight_decay=0.0)  # noqa: E731
    w0 = _data()[0]
    tiny = 2.0**-16  # d loss / d out ~ 1e-6: below fp16's normal range without the scale
    w16, _ = _train("fp16", adamw, steps=1, clip=0.0, c_scale=tiny)
    w32, _ = _train("fp32", adamw, steps=1, clip=0.0, c_scale=tiny)
    update16, update32 = w16 - w0, w32 - w0
    assert _rel(update16, update32) <= 1e-3, _rel(update16, update32)


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_fp16_grad_norm_and_clipping_equal_fp32(clip):
    """The reported norm is the unscaled one, and clipping acts on it: with clip 0.05 (below the norm) both
    runs clip by the same factor and take the same step."""
    sgd = lambda params: torch.optim.SGD(params, lr=0.5)  # noqa: E731
    w0 = _data()[0]
    w16, norms16 = _train("fp16", sgd, steps=1, clip=clip)
    w32, norms32 = _train("fp32", sgd, steps=1, clip=clip)
    assert abs(norms16[0] - norms32[0]) <= GRAD_RTOL * norms32[0], (norms16, norms32)
    if clip:
        assert norms32[0] > clip  # the clipping is active
    assert _rel(w16 - w0, w32 - w0) <= 2 * GRAD_RTOL  # the clip factor carries the norm's error once more
