"""The fused AdamW update (``tessera.optim.lowp_adamw``) against independent references: torch's
single-tensor AdamW on fp32 copies, the AdamW formula written out in fp64 here, a pure-Python version of
the noise hash, and the same update taken in one chunk (chunking must not change a single bit)."""

import functools
import logging
import math

import pytest
import torch
from torch import nn

from tessera import logs
from tessera.optim.hybrid_zero import HybridZeroOptimizer
from tessera.optim.lowp_adamw import adamw_step, element_noise
from tests.tolerances import allclose_tols, gamma, order_rtol, precision_rtol, unit_roundoff

HYPER = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
# one AdamW step's elementwise fp32 roundings: the two moments (two multiply-adds each), bias corrections,
# sqrt, + eps, divide, lr, the decay product and the weight's update (n = 1 each)
UPDATE_OPS = 10


def _reference_adamw(w, grads, hyper=HYPER):
    """AdamW written out in fp64 (torch's arithmetic: decoupled decay, bias-corrected moments)."""
    w, m, v = w.double().clone(), torch.zeros_like(w, dtype=torch.float64), torch.zeros_like(w, dtype=torch.float64)
    b1, b2 = hyper["betas"]
    for t, g in enumerate(grads, 1):
        g = g.double()
        w *= 1 - hyper["lr"] * hyper["weight_decay"]
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        denom = (v.sqrt() / math.sqrt(1 - b2**t)) + hyper["eps"]
        w -= hyper["lr"] / (1 - b1**t) * m / denom
    return w


def test_fp32_fused_update_follows_the_adamw_formula_and_torch():
    torch.manual_seed(0)
    w0 = torch.randn(1000)
    grads = [torch.randn(1000) for _ in range(5)]
    mine, state = w0.clone(), {}
    ref = nn.Parameter(w0.clone())
    torch_opt = torch.optim.AdamW([ref], foreach=False, **HYPER)  # torch's single-tensor loop
    for g in grads:
        adamw_step(mine, g, state, HYPER, compensation="none", state_dtype=torch.float32)
        ref.grad = g.clone()
        torch_opt.step()
    # against fp64: every step's fp32 roundings, at the weights' scale (allclose_tols); measured 5.5e-7 abs
    steps = len(grads)
    exact = _reference_adamw(w0, grads)
    torch.testing.assert_close(mine.double(), exact, **allclose_tols(precision_rtol(torch.float32, 1, UPDATE_OPS * steps),
                                                                      float(exact.abs().max())))  # rtol 4.2e-7
    # against torch's loop: the same roundings, perhaps in another order (measured: bitwise)
    torch.testing.assert_close(mine, ref.detach(), **allclose_tols(order_rtol(torch.float32, 1, UPDATE_OPS * steps),
                                                                   float(ref.detach().abs().max())))  # 5.9e-7
    for key in ("exp_avg", "exp_avg_sq"):  # the state torch's AdamW would hold, under the same names
        torch_state = torch_opt.state[ref][key]  # two roundings per step (measured: bitwise)
        torch.testing.assert_close(state[key], torch_state, **allclose_tols(order_rtol(torch.float32, 1, 2 * steps),
                                                                            float(torch_state.abs().max())))
    assert float(state["step"]) == 5 and state["step"].dim() == 0 and state["step"].device.type == "cpu"


def _noise(a, z, step):
    return element_noise(a, z, 11, step, 5, "cpu")


@pytest.mark.parametrize("compensation,state_dtype", [("none", torch.float32), ("kahan", torch.float32),
                                                      ("stochastic", torch.float32), ("kahan", torch.bfloat16),
                                                      ("none", torch.bfloat16)])
def test_chunks_do_not_change_a_bit(compensation, state_dtype):
    """Chunk sizes 7 (ragged) and 64 give exactly the single-chunk update, for every low-precision policy."""
    torch.manual_seed(1)
    w0 = torch.randn(301).bfloat16()
    grads = [torch.randn(301) * 1e-2 for _ in range(3)]
    results = []
    for chunk in (1 << 20, 7, 64):
        w, state = w0.clone(), {}
        for step, g in enumerate(grads, 1):
            adamw_step(w, g, state, HYPER, compensation=compensation, state_dtype=state_dtype, chunk=chunk,
                       noise=functools.partial(_noise, step=step))
        results.append((w, state))
    for w, state in results[1:]:
        assert torch.equal(w, results[0][0])
        for key, value in state.items():
            assert torch.equal(value, results[0][1][key]), key


def test_bf16_masters_round_the_fp32_update_to_nearest():
    """One step from bf16 storage: the fp64 AdamW of the widened weight, rounded to the nearest bf16."""
    torch.manual_seed(2)
    w0 = (torch.randn(4096) * 3).bfloat16()
    g = torch.randn(4096)
    w, state = w0.clone(), {}
    adamw_step(w, g, state, HYPER, compensation="none", state_dtype=torch.float32, chunk=1000)
    expected = _reference_adamw(w0.float(), [g]).float()
    near = expected.bfloat16()
    # the fp32 kernel and fp64 can straddle a rounding midpoint only at a handful of elements: the kernel's
    # value is within fp32_err of the fp64 one, which is within that of a bf16 midpoint with probability
    # fp32_err / u_bf16; allowed: that many, plus a Poisson 3-sigma margin and 3 (~4 elements of 4096)
    fp32_err = precision_rtol(torch.float32, 1, UPDATE_OPS)  # 1.9e-7
    expect = w.numel() * fp32_err / unit_roundoff(torch.bfloat16)
    assert (w != near).float().mean() < (expect + 3 * expect**0.5 + 3) / w.numel()
    # at most UPDATE_OPS fp32 roundings per element: worst case gamma (6e-7)
    slack = gamma(UPDATE_OPS, torch.float32) * expected.abs()
    assert bool(((w.float() - expected).abs() <= (near.float() - expected).abs() + slack).all())


def test_kahan_keeps_the_fp32_trajectory():
    """bf16 weight + bf16 compensation track fp32 AdamW where plain bf16 masters stall (lr tiny vs ulp)."""
    torch.manual_seed(3)
    w0 = (1 + torch.rand(512)).bfloat16()
    grads = [torch.randn(512) for _ in range(30)]
    hyper = {**HYPER, "lr": 1e-4, "weight_decay": 0.0}
    kahan, k_state = w0.clone(), {}
    plain, p_state = w0.clone(), {}
    for g in grads:
        adamw_step(kahan, g, k_state, hyper, compensation="kahan", state_dtype=torch.float32, chunk=100)
        adamw_step(plain, g, p_state, hyper, compensation="none", state_dtype=torch.float32, chunk=100)
    exact = _reference_adamw(w0.float(), grads, hyper)
    carried = kahan.double() + k_state["master_compensation"].double()
    motion = (exact - w0.double()).abs().mean()  # about steps * lr
    err = (carried - exact).abs()
    assert err.mean() < 0.02 * motion and err.max() < 0.1 * motion  # the pair's ~16 bits: a small part of it
    assert torch.equal(plain, w0)  # every update was below half an ulp: rounded away


def _noise_in_python(index, param_key, step, seed):
    """The documented hash, one element at a time with Python integers (no torch)."""
    def mix(x):
        x &= 0xFFFFFFFF
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
        return x ^ (x >> 16)
    key = mix(param_key ^ mix(step ^ mix(seed)))
    pair = mix(index // 2 * 0x9E3779B9 + key)  # one hash per pair of elements: low half even, high half odd
    return (pair >> 16 if index % 2 else pair) & 0xFFFF


@pytest.mark.parametrize("start", [0, 5, 70_000, 2**31 - 40])
def test_noise_equals_the_hash_computed_with_python_integers(start):
    """The int32 wrapping arithmetic (cached index term, large and small draws, any start) is the hash."""
    n = 37 if start > 2**31 - 100 else 70_001  # a draw larger than one chunk goes the uncached way
    got = element_noise(start, start + n, 0xDEADBEEF, 12, 1024, "cpu")
    for i in (0, 1, 2, n // 2, n // 2 + 1, n - 2, n - 1):
        assert int(got[i]) == _noise_in_python(start + i, 0xDEADBEEF, 12, 1024), i
    for a, z in ((0, n), (1, n), (0, n - 1), (3, 10)):  # into `out`: pair-aligned or not, the same bits
        out = torch.full((z - a,), -1, dtype=torch.int32)
        assert element_noise(start + a, start + z, 0xDEADBEEF, 12, 1024, "cpu", out=out) is out
        assert torch.equal(out, got[a:z])


class _Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(40))
        self.b = nn.Parameter(torch.randn(3, 7))


def test_optimizer_uses_the_fused_update_for_adamw_and_the_inner_step_otherwise(caplog, monkeypatch):
    """HybridZeroOptimizer(AdamW) moves fp32 weights as torch's AdamW does, and logs the fused kernel;
    an SGD inner optimizer keeps its own step (moves as torch's SGD)."""
    torch.manual_seed(4)
    for make, fused in ((lambda ps: torch.optim.AdamW(ps, **HYPER), True),
                        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), False)):
        model, ref = _Two(), _Two()
        ref.load_state_dict(model.state_dict())
        opt = HybridZeroOptimizer(make(list(model.parameters())), zero_cfg={"clip_grad_norm": 0.0}, param_names=model)
        ref_opt = make(list(ref.parameters()))
        caplog.clear()
        monkeypatch.setattr(logs, "_LOGGED", set())  # logged once per process: forget earlier tests'
        with caplog.at_level(logging.INFO, logger="tessera"):
            for _ in range(3):
                x = torch.randn(40)
                for m in (model, ref):
                    (m.a * x).sum().mul(m.b.sum()).backward()
                opt.step()
                ref_opt.step()
                ref_opt.zero_grad()
        for p, q in zip(model.parameters(), ref.parameters()):
            # the same gradients; the update's roundings in another order, 3 steps (a difference in one step
            # changes the next gradients by as much: Adam passes it at gain 1)
            torch.testing.assert_close(p, q, **allclose_tols(order_rtol(torch.float32, 1, UPDATE_OPS * 3),
                                                             float(q.abs().max())))  # rtol 4.6e-7
        text = caplog.text
        assert opt.policy.fused(opt.optim) == fused
        assert ("fused AdamW kernel" in text) == fused and ("SGD.step()" in text) == (not fused), text
