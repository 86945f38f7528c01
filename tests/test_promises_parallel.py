"""The vocab-parallel loss's numerical promises, against F.cross_entropy (written for the mutation pass).

Large logits: a softmax is invariant to a shift of its logits, and the loss promises to compute it stably by
subtracting the row maximum before ``exp``. Logits near 1000 overflow ``exp`` even in fp64 (whose range
ends at ~709) without that shift; F.cross_entropy shifts too, so it stays the reference. Both entry points
are checked: the loss on given logits and the head's GEMM fused with it (``linear_cross_entropy``).

Tolerances (tests/tolerances.py): in fp64 the two computations differ by the order of the vocabulary's
sum and by the rounding of the shifted logits, an absolute error of ``u * |logit|`` (the shift subtracts
~1000 from each), which exp turns into that relative error of each probability: ``order_rtol`` over the
vocabulary, times the logits' magnitude.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.parallel import vocab_parallel_cross_entropy
from tessera.parallel.loss import LossSpec, linear_cross_entropy
from tests.tolerances import order_rtol

F64 = torch.float64
N, H, V = 9, 16, 24
OFFSET = 1000.0  # exp(1000) overflows fp64 (and exp(89) fp32): only the max shift keeps the loss finite


def _target(seed: int = 0) -> torch.Tensor:
    t = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(seed))
    t[3] = -100  # an ignored token as well
    return t


def _close(a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
    """Within fp64 rounding of logits of magnitude ``scale`` (module docstring); NaN/inf fail."""
    tol = order_rtol(F64, V, 3) * scale * float(b.abs().max().clamp_min(1.0))
    assert torch.isfinite(a).all() and float((a - b).abs().max()) <= tol, (a, b)


def test_large_logits_give_finite_losses_and_gradients_equal_to_cross_entropy():
    g = torch.Generator().manual_seed(1)
    logits = (OFFSET + 3 * torch.randn(N, V, generator=g, dtype=F64)).requires_grad_()
    ref_in = logits.detach().clone().requires_grad_()
    t = _target()
    for smoothing in (0.0, 0.1):
        logits.grad = ref_in.grad = None
        loss = vocab_parallel_cross_entropy(logits, t, label_smoothing=smoothing)
        ref = F.cross_entropy(ref_in, t, label_smoothing=smoothing)
        loss.backward()
        ref.backward()
        _close(loss.detach(), ref.detach(), OFFSET)
        _close(logits.grad, ref_in.grad, OFFSET)


def test_large_logits_through_the_fused_head_and_loss():
    """Feature 0 is 1 on every token and row 0 of the head's weight column is OFFSET: every logit is shifted
    by OFFSET, which the softmax ignores; chunks of 4 tokens leave a remainder."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(N, H, generator=g, dtype=F64)
    w = 0.3 * torch.randn(V, H, generator=g, dtype=F64)
    x[:, 0] = 1.0
    w[:, 0] = OFFSET
    t = _target(3)
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = linear_cross_entropy(xa, wa, t, None, LossSpec(chunk_tokens=4))
    loss.backward()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = F.cross_entropy(F.linear(xr, wr), t)
    ref.backward()
    _close(loss.detach(), ref.detach(), OFFSET)
    _close(wa.grad, wr.grad, OFFSET)
    # d loss / d x = (p - onehot) @ w: column 0 of w is OFFSET, so the logits' rounding (relative u, absolute
    # u * OFFSET) reaches that column of the input gradient multiplied by OFFSET once more
    _close(xa.grad[:, 1:], xr.grad[:, 1:], OFFSET)
    _close(xa.grad[:, :1], xr.grad[:, :1], OFFSET * OFFSET)
