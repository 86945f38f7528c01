"""Precision telemetry against cases with a known answer, each computed here from the formats' own
definitions (ulps from ``torch.nextafter``, fp16/e4m3 ranges from ``torch.finfo``) or from torch's own
AdamW in fp64, never from the code under test: lost updates per master policy, gradient underflow and
overflow in fp16 against an fp32-marked twin, fp8 input scales, grouping, and that measuring changes
nothing in training and installs nothing when off."""

import math

import pytest
import torch
from torch import nn

from tessera.config import Config
from tessera.core.job import Job
from tessera.core.naive_amp import NaiveAMPModel
from tessera.optim.hybrid_zero import HybridZeroOptimizer
from tessera.optim.lowp_adamw import adamw_step
from tessera.parallel.layers import ColumnParallelLinear
from tessera.train.builder import build_training_stack
from tessera.train.precision_telemetry import MEASURES, PrecisionTelemetry, group_name
from tests.tolerances import gamma, unit_roundoff

POLICIES = {
    "fp32": {},
    "bf16": {"master_dtype": "bf16"},
    "kahan": {"master_dtype": "bf16", "master_compensation": "kahan"},
    "stochastic": {"master_dtype": "bf16", "master_compensation": "stochastic"},
    "bf16_states": {"optimizer_state_dtype": "bf16"},
}


class _Weight(nn.Module):
    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.w = nn.Parameter(w)

    def forward(self, x):
        return (self.w * x).sum()


class _Twins(nn.Module):
    """The same weights twice: ``a`` in the model dtype, ``b`` fp32-marked. Two outputs, so the fp32
    twin's gradient never passes through the low-precision graph."""

    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.a, self.b = _Weight(w.clone()), _Weight(w.clone())

    def forward(self, x):
        return self.a(x), self.b(x)


def _twins(w, dtype, policy="fp32", lr=1e-4, wd=0.0, group_by="module"):
    model = _Twins(w)
    amp = NaiveAMPModel(model, dtype=dtype, sync_buffer=False, fp32_modules=["b"])
    inner = torch.optim.AdamW(amp.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd)
    opt = HybridZeroOptimizer(inner, zero_cfg={**POLICIES[policy], "clip_grad_norm": 0.0}, dtype=dtype,
                              param_names=model)
    return model, amp, opt, PrecisionTelemetry(model, opt, every=1, group_by=group_by)


def _measured_step(amp, opt, tel, x, scale=1.0):
    tel.begin()
    try:
        ya, yb = amp(x)
        opt.backward((ya + yb) * scale)
        ok, _ = opt.step()
    finally:
        tel.detach()
    return ok, tel.finish()


def _half_ulp_bf16(w: torch.Tensor) -> torch.Tensor:
    """Half the distance from each bf16 value to its neighbour below (the update is negative)."""
    wb = w.to(torch.bfloat16)
    below = torch.nextafter(wb, torch.full_like(wb, -math.inf))
    return (wb.float() - below.float()) / 2


def _magnitudes(n=4096):
    """Weights 1.5 * 2**k for k in [-14, 0]: never a power of two (the neighbours on both sides are one
    ulp away) and spread so that some updates of 1e-4 are below half an ulp and some are not."""
    k = torch.arange(n) % 15 - 14
    return 1.5 * torch.pow(2.0, k.float())


# ------------------------------------------------------------------------------------ lost updates
@pytest.mark.parametrize("policy", ["fp32", "bf16", "kahan", "bf16_states"])
def test_lost_update_fraction_per_master_policy(policy):
    """Step 1 of AdamW moves every weight by lr (m_hat / sqrt(v_hat) = 1 for a constant gradient): the updates
    below half a bf16 ulp are known from the weights alone."""
    w, lr = _magnitudes(), 1e-4
    expected = float((lr < _half_ulp_bf16(w)).double().mean())  # the elements bf16 storage drops
    assert 0.3 < expected < 0.7  # a mixed case, not all or nothing
    model, amp, opt, tel = _twins(w, "bf16", policy, lr)
    ok, rec = _measured_step(amp, opt, tel, torch.ones_like(w))
    assert ok and rec["elements"] == {"a": w.numel(), "b": w.numel()}
    m = rec["measures"]
    # what a bf16 weight would drop: the same under every policy; the fp32-marked twin drops nothing
    assert m["update_below_half_ulp"]["a"] == pytest.approx(expected, abs=1e-12)
    assert m["update_below_half_ulp"]["b"] == 0.0 and m["update_lost"]["b"] == 0.0
    # what this policy's master storage dropped
    want = {"fp32": 0.0, "bf16_states": 0.0, "bf16": expected, "kahan": 0.0}[policy]
    assert m["update_lost"]["a"] == pytest.approx(want, abs=1e-12)
    # update RMS / weight RMS: every update is lr (up to eps) on the widened weights
    rms = lr / float(w.to(torch.bfloat16).double().square().mean().sqrt())
    assert m["update_rms_ratio"]["a"] == pytest.approx(rms, rel=1e-4)


def test_stochastic_rounding_loses_the_update_with_the_probability_it_rounds_back():
    """Stochastic rounding keeps a sub-ulp update with probability |u| / ulp: the fraction of elements left
    unchanged is, in expectation, the mean of 1 - |u| / ulp (0 where |u| >= ulp)."""
    w, lr = _magnitudes(), 1e-4
    ulp = 2 * _half_ulp_bf16(w)
    p_kept = (lr / ulp).clamp(max=1.0).double()
    expected, sigma = float((1 - p_kept).mean()), float((p_kept * (1 - p_kept)).sum().sqrt()) / w.numel()
    _, amp, opt, tel = _twins(w, "bf16", "stochastic", lr)
    ok, rec = _measured_step(amp, opt, tel, torch.ones_like(w))
    assert ok
    assert abs(rec["measures"]["update_lost"]["a"] - expected) < 4 * sigma + 1e-4, (rec["measures"], expected)


def _fp64_adamw(w, steps, lr):
    ref = nn.Parameter(w.double().clone())
    opt = torch.optim.AdamW([ref], lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    for _ in range(steps):
        ref.grad = torch.ones_like(ref)
        opt.step()
    return ref.detach()


def test_too_small_a_learning_rate_bf16_masters_lose_everything_kahan_recovers_the_motion():
    """lr 1e-4 on weights of 1.0 (bf16 ulp 2**-8 below 1.0): every update is below half an ulp. Plain bf16
    masters report ~100% lost and never move; fp32 masters report 0 and track fp64 AdamW; Kahan reports 0
    and its bf16 weights move with the fp64 reference."""
    n, lr, steps = 512, 1e-4, 40
    w = torch.ones(n)
    ref = _fp64_adamw(w, steps, lr)  # about steps * lr = 0.004: one bf16 ulp below 1.0
    out = {}
    for policy in ("bf16", "fp32", "kahan"):
        model, amp, opt, tel = _twins(w, "bf16", policy, lr)
        lost = []
        for _ in range(steps):
            ok, rec = _measured_step(amp, opt, tel, torch.ones(n))
            assert ok
            lost.append(rec["measures"]["update_lost"]["a"])
            assert rec["measures"]["update_below_half_ulp"]["a"] == 1.0  # a bf16 weight would drop every one
        comp = [s.get("master_compensation") for s in opt.optim.state.values() if "master_compensation" in s]
        masters = opt.state_dict()["master"]["a.w"].double()
        out[policy] = (lost, model.a.w.detach().float(), masters + (comp[0].double() if comp else 0))
    lost, weights, _ = out["bf16"]
    assert min(lost) == 1.0 and bool((weights == 1.0).all())  # every update lost: the weights never moved
    for policy in ("fp32", "kahan"):
        lost, weights, value = out[policy]
        assert max(lost) == 0.0, policy
        assert float((value - ref).abs().max()) < 0.01 * float((1 - ref).abs().mean()), policy  # the motion kept
        assert float((weights < 1.0).double().mean()) > 0.99, policy  # and the bf16 weights moved


def test_observing_an_update_gives_the_same_bits_and_the_fp32_update():
    """adamw_step with an observer, chunked at 100 elements: the same weights and states as without, and the
    reported update is the fp32 step of torch's AdamW (fp64 reference) from the same state."""
    torch.manual_seed(0)
    n = 1000
    w0, grads = torch.randn(n), [torch.randn(n) for _ in range(3)]
    hyper = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    for master_dtype, comp, state_dtype in [(torch.float32, "none", torch.float32), (torch.float32, "none", torch.bfloat16),
                                            (torch.bfloat16, "none", torch.float32), (torch.bfloat16, "kahan", torch.float32)]:
        runs = []
        for observing in (False, True):
            master, state, seen = w0.to(master_dtype), {}, []
            for g in grads:
                observe = (lambda a, z, u, before, unchanged: seen.append((a, z, u.clone(), before.clone()))) \
                    if observing else None
                adamw_step(master, g, state, hyper, compensation=comp, state_dtype=state_dtype, chunk=100,
                           observe=observe)
            runs.append((master, state, seen))
        (m0, s0, _), (m1, s1, seen) = runs
        assert torch.equal(m0, m1), (master_dtype, comp, state_dtype)
        assert all(torch.equal(s0[k], s1[k]) for k in s0 if isinstance(s0[k], torch.Tensor))
        assert [(a, z) for a, z, _, _ in seen[:8]] == [(a, min(a + 128, n)) for a in range(0, n, 128)]  # whole lanes
        # the last step's update against fp64 AdamW from the state before it (the fp32 master, or bf16 + compensation)
        last = seen[-8:]
        u = torch.cat([s[2] for s in last])
        before = torch.cat([s[3] for s in last])
        ref = nn.Parameter(before.double().clone())
        opt = torch.optim.AdamW([ref], lr=hyper["lr"], betas=hyper["betas"], eps=hyper["eps"],
                                weight_decay=hyper["weight_decay"])
        opt.state[ref] = {"step": torch.tensor(2.0), "exp_avg": torch.zeros(n, dtype=torch.float64),
                          "exp_avg_sq": torch.zeros(n, dtype=torch.float64)}
        if state_dtype == torch.float32:  # replay the moments exactly (bf16 moments round them: skip that case)
            for g in grads[:2]:
                st = opt.state[ref]
                st["exp_avg"].mul_(0.9).add_(g.double(), alpha=0.1)
                st["exp_avg_sq"].mul_(0.95).addcmul_(g.double(), g.double(), value=0.05)
            ref.grad = grads[2].double()
            opt.step()
            # the fp32 kernel against fp64: the moments' 2 roundings per step over 3 steps and the update's
            # ~10, each at most u of the update (few roundings: worst case gamma, 9.5e-7; was 1e-4); the
            # recorded update is a difference of weights, each rounded within u of its size (atol, as before)
            torch.testing.assert_close(u.double(), ref.detach() - before.double(), rtol=gamma(16, torch.float32),
                                       atol=4 * unit_roundoff(torch.float32) * float(before.abs().max()))


# ------------------------------------------------------------------------------------ gradients in fp16
def test_fp16_gradients_in_and_below_the_subnormal_range_against_an_fp32_marked_twin():
    """fp16 model, loss scale 2**16. Scaled so the gradients are 2**-20 * x (x in [1, 2)): every fp16 gradient
    is a non-zero subnormal (fp16's smallest normal is 2**-14): underflow 100%. Scaled to 2**-30 * x, below
    the smallest fp16 subnormal (2**-24): the fp16 backward flushes every one to zero. The fp32-marked twin
    computes the same gradients in fp32, where both are normal numbers: no underflow, no zeros."""
    fp16 = torch.finfo(torch.float16)
    assert fp16.tiny == 2**-14 and fp16.smallest_normal == 2**-14
    n = 256
    x = torch.linspace(1, 1.99, n)
    for exponent, underflow, zeros in ((-20, 1.0, 0.0), (-30, None, 1.0)):
        _, amp, opt, tel = _twins(torch.ones(n), "fp16")
        assert opt.loss_scale == 2**16
        ok, rec = _measured_step(amp, opt, tel, x, scale=2.0 ** (exponent - 16))
        assert ok
        m = rec["measures"]
        assert m["grad_zero"]["a"] == zeros and m["grad_zero"]["b"] == 0.0
        assert m["grad_underflow"].get("a") == underflow  # absent when nothing is left non-zero
        assert m["grad_underflow"]["b"] == 0.0  # the fp32 twin: no underflow where the fp16 one has it
        assert m["grad_amax_ratio"]["b"] == pytest.approx(2.0**exponent * 1.99 / torch.finfo(torch.float32).max,
                                                          rel=1e-6)


def test_fp32_gradients_below_the_fp16_range_count_as_underflow_when_the_parameter_is_fp16():
    """The definition itself: a gradient element non-zero in the fp32 main grad and below fp16's smallest normal
    (subnormal there, or below the subnormal range and so zero) underflows for an fp16 parameter, not for fp32."""
    n = 100
    _, amp, opt, tel = _twins(torch.ones(n), "fp16")
    tel.begin()
    for name in ("a", "b"):
        p = getattr(amp.model, name).w
        g = opt.get_main_grad(p)
        g.copy_(torch.where(torch.arange(n) % 2 == 0, 1e-9, 1e-6))  # loss scale included; 1e-9: below 2**-24
    opt.step()
    tel.detach()
    m = tel.finish()["measures"]
    assert m["grad_underflow"] == {"a": 1.0, "b": 0.0}
    assert m["grad_zero"] == {"a": 0.0, "b": 0.0}


def test_fp16_overflow_is_counted_and_the_skipped_step_recorded():
    """Half the fp16 gradients beyond fp16's largest value (inf in the fp16 backward): overflow 50%, the step
    is skipped and said so; the fp32 twin holds the same gradients as finite numbers."""
    n = 64
    x = torch.where(torch.arange(n) < n // 2, 0.5, 1e4)
    _, amp, opt, tel = _twins(torch.full((n,), 1e-4), "fp16")  # small weights: the forward stays finite
    # the output's gradient 2**-8 * 2**16 = 256 (loss scale included): the weights' 128 fits fp16, 2.56e6 does not
    ok, rec = _measured_step(amp, opt, tel, x, scale=2**-8)
    assert not ok and rec["step_skipped"] and rec["skipped_steps"] == 1 and rec["loss_scale"] == 2**16
    m = rec["measures"]
    assert m["grad_overflow"] == {"a": 0.5, "b": 0.0}
    assert math.isinf(m["grad_amax_ratio"]["a"])
    assert "update_lost" not in m  # no update on a skipped step


# ------------------------------------------------------------------------------------ fp8 and activations
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_input_scale_saturation_and_underflow(recipe):
    """An fp8 linear's input with known extremes: e4m3 holds magnitudes up to 448 and subnormals down to
    2**-9, so after scaling by 448 / amax an element below 2**-10 becomes zero, and the amax (with whatever
    rounds onto it) lands on 448: saturated."""
    e4m3 = torch.finfo(torch.float8_e4m3fn)
    assert e4m3.max == 448 and float(torch.tensor(2**-9).to(torch.float8_e4m3fn)) == 2**-9
    g = torch.Generator().manual_seed(0)
    rows, k = 8, 32
    x = (torch.rand(rows, k, generator=g) + 0.1).to(torch.bfloat16).float()
    x[:, 0] = torch.arange(1, rows + 1).float()  # row amax = row index + 1 (the tensor's: 8)
    x[:4, 1] = 1e-6  # flushed at any of these scales (448 / amax <= 448: 4.5e-4 < 2**-10)
    x[4:, 2] = 0.0  # zeros: not counted as underflow
    model = nn.Module()
    model.lin = ColumnParallelLinear(k, 16, bias=False, init_std=0.1)
    amp = NaiveAMPModel(model, dtype="bf16", sync_buffer=False)
    model.lin.fp8_recipe = recipe
    opt = HybridZeroOptimizer(torch.optim.AdamW(amp.parameters(), lr=1e-3), dtype="bf16", param_names=model)
    tel = PrecisionTelemetry(model, opt, every=1)
    tel.begin()
    y = amp.model.lin(x.to(torch.bfloat16))
    opt.backward(y.float().sum())
    opt.step()
    tel.detach()
    m = tel.finish()["measures"]
    amax_rows = x.abs().amax(1)
    scales = 448 / (amax_rows if recipe == "rowwise" else amax_rows.max().expand(rows))
    scaled = x.abs() * scales[:, None]
    assert m["fp8_scale"]["lin"] == pytest.approx(float(scales.min()), rel=1e-6)
    # e4m3's two largest magnitudes are 416 and 448: from 432 on (the tie goes to 448's even mantissa) an
    # element lands on the largest one
    assert [float(torch.tensor(v).to(torch.float8_e4m3fn)) for v in (431.9, 432.0)] == [416.0, 448.0]
    assert m["fp8_saturated"]["lin"] == pytest.approx(float((scaled >= 432).double().mean()))
    nonzero = x != 0
    assert m["fp8_underflow"]["lin"] == pytest.approx(float((scaled[nonzero] < 2**-10).double().mean()))
    assert m["fp8_underflow"]["lin"] > 0 and m["fp8_saturated"]["lin"] > 0
    assert m["act_amax_ratio"]["lin"] == pytest.approx(float(y.detach().abs().max()) / torch.finfo(torch.bfloat16).max)


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_block_format_input_saturation_underflow_and_flushed_elements(recipe):
    """A block-format linear's input with known extremes: one block of tiny values (its scale underflows: below
    E8M0's 2**-127 for MXFP8, below E4M3's smallest normal relative to the tensor's scale for NVFP4) and elements
    far below their block's amax (flushed to zero); the shares are the input's ``block_stats``, per block and
    element, in metrics.jsonl's measures."""
    from tessera.parallel.block_formats import BLOCK_RECIPES, block_stats

    block = BLOCK_RECIPES[recipe][1]
    g = torch.Generator().manual_seed(0)
    rows, k = 8, 64
    x = (torch.rand(rows, k, generator=g) + 0.1)
    x[:, 0] = torch.arange(1, rows + 1).float()
    x[0, :block] = 2.0**-124 if recipe == "mxfp8" else 1e-4  # the underflowing block
    x[1:4, 1] = 1e-6  # flushed
    x = x.to(torch.bfloat16)
    model = nn.Module()
    model.lin = ColumnParallelLinear(k, 32, bias=False, init_std=0.1)
    amp = NaiveAMPModel(model, dtype="bf16", sync_buffer=False)
    model.lin.fp8_recipe = recipe
    opt = HybridZeroOptimizer(torch.optim.AdamW(amp.parameters(), lr=1e-3), dtype="bf16", param_names=model)
    tel = PrecisionTelemetry(model, opt, every=1)
    tel.begin()
    y = amp.model.lin(x)
    opt.backward(y.float().sum())
    opt.step()
    tel.detach()
    assert model.lin.block_observe is None
    m = tel.finish()["measures"]
    ref = block_stats(x, recipe, 1)
    n_blocks = rows * k // block
    assert m["block_underflow"]["lin"] == pytest.approx(1 / n_blocks) == pytest.approx(float(ref.scale_underflow))
    assert m["block_saturated"]["lin"] == 0.0 == float(ref.scale_saturated)
    assert m["block_flushed"]["lin"] == pytest.approx(float(ref.flushed_to_zero)) and m["block_flushed"]["lin"] >= 3 / x.numel()
    assert "fp8_scale" not in m


# ------------------------------------------------------------------------------------ the training stack
def _tiny(every=0, **extra):
    overrides = ["model.dtype='bf16'", "model.fp32_modules=['*norm*']", "hybrid_zero_optimizer.clip_grad_norm=1.0",
                 f"metrics.precision_every={every}", *(f"{k}={v!r}" for k, v in extra.items())]
    return Config.from_file("configs/tiny.py", overrides)


def _batches(step):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 256, (2, 33), generator=g)
    return [{"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}]


def _train(cfg, steps, seed=3):
    stack = build_training_stack(cfg, Job.of(cfg, seed=seed), sync_buffer=False)
    results = [stack.trainer.train_step(_batches(s), step=s) for s in range(1, steps + 1)]
    return stack, results


def _hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize("policy", ["fp32", "kahan", "stochastic", "bf16_states"])
def test_measuring_changes_nothing_in_training(policy):
    keys = {f"hybrid_zero_optimizer.{k}": v for k, v in POLICIES[policy].items()}
    off, r_off = _train(_tiny(0, **keys), 3)
    on, r_on = _train(_tiny(1, **keys), 3)
    assert [r.loss for r in r_off] == [r.loss for r in r_on]
    for (name, p), q in zip(off.inner_model.named_parameters(), on.inner_model.parameters()):
        assert torch.equal(p, q), name
    assert all(r.precision is None for r in r_off) and all(r.precision is not None for r in r_on)


def test_nothing_installed_when_off_and_hooks_only_during_a_measured_step():
    off, _ = _train(_tiny(0), 1)
    assert off.trainer.telemetry is None
    on = build_training_stack(_tiny(2), Job.of(_tiny(2), seed=3), sync_buffer=False)
    base = _hooks(on.model)
    assert base == _hooks(off.model)  # NaiveAMPModel's fp32-island hooks only
    seen = []
    probe = on.inner_model.layers[0].attention.wq.register_forward_hook(lambda *a: seen.append(_hooks(on.model)))
    for step in (1, 2, 3):
        seen.clear()
        result = on.trainer.train_step(_batches(step), step=step)
        assert _hooks(on.model) == base + 1  # afterwards: only the probe
        measured = step == 2
        assert (result.precision is not None) == measured
        # during the step: one output hook per module owning parameters, on measured steps only
        owners = sum(1 for m in on.inner_model.modules() if any(True for _ in m.parameters(recurse=False)))
        assert seen[0] == base + 1 + (owners if measured else 0)
    probe.remove()


def test_the_head_output_is_measured_only_when_the_logits_exist():
    """loss.chunk_tokens > 0 (the default) fuses the head with the loss: its logits never exist whole, so the
    head's row has no activation measures; with loss.chunk_tokens=0 it has them. Its gradients are measured
    either way."""
    fused = _train(_tiny(1), 1)[1][-1].precision["measures"]
    whole = _train(_tiny(1, **{"loss.chunk_tokens": 0}), 1)[1][-1].precision["measures"]
    assert "output" not in fused["act_amax_ratio"] and "output" in whole["act_amax_ratio"]
    assert "output" in fused["grad_amax_ratio"] and "norm" in fused["act_amax_ratio"]


def test_rows_by_layer_and_kind_aggregate_the_module_rows():
    """The same step measured per module, per layer and per kind: element counts add up, maxima are the maxima
    of the module rows, fractions are their element-weighted means."""
    recs = {}
    for group_by in ("module", "layer", "kind"):
        _, results = _train(_tiny(1, **{"metrics.precision_group": group_by}), 2)
        recs[group_by] = results[-1].precision
    mod = recs["module"]
    model = build_training_stack(_tiny(0), Job.of(_tiny(0))).inner_model
    for name, module in model.named_modules():
        params = list(module.parameters(recurse=False))
        if params:
            assert mod["elements"][name] == sum(p.numel() for p in params)
    for group_by in ("layer", "kind"):
        rec = recs[group_by]
        for row, n in rec["elements"].items():
            members = [r for r in mod["elements"] if group_name(r, group_by) == row]
            assert members and n == sum(mod["elements"][r] for r in members)
            assert rec["measures"]["grad_amax_ratio"][row] == max(mod["measures"]["grad_amax_ratio"][r] for r in members)
            seen = [r for r in members if r in mod["measures"]["act_amax_ratio"]]  # the fused head has no output
            if seen:
                assert rec["measures"]["act_amax_ratio"][row] == max(mod["measures"]["act_amax_ratio"][r] for r in seen)
            zero = sum(mod["measures"]["grad_zero"][r] * mod["elements"][r] for r in members) / n
            assert rec["measures"]["grad_zero"][row] == pytest.approx(zero, abs=1e-12)
    assert set(recs["kind"]["elements"]) == {"embedding", "layers.*.attention_norm", "layers.*.attention.wq",
                                             "layers.*.attention.wk", "layers.*.attention.wv", "layers.*.attention.wo",
                                             "layers.*.ffn_norm", "layers.*.feed_forward.w1", "layers.*.feed_forward.w3",
                                             "layers.*.feed_forward.w2", "norm", "output"}
    assert set(recs["layer"]["elements"]) == {"embedding", "layers.0", "layers.1", "norm", "output"}
    assert set(mod["measures"]) == set(MEASURES) - {"fp8_scale", "fp8_saturated", "fp8_underflow", "block_saturated",
                                                    "block_underflow", "block_flushed"}


def test_config_keys_and_the_compile_rule():
    from tessera.config import ConfigError

    cfg = _tiny(0)
    assert cfg.metrics.precision_every == 0 and cfg.metrics.precision_group == "module"
    with pytest.raises(ConfigError, match="metrics.precision_every: must be >= 0"):
        _tiny(-1)
    with pytest.raises(ConfigError, match="metrics.precision_group: must be one of"):
        _tiny(1, **{"metrics.precision_group": "param"})
    with pytest.raises(ConfigError, match="metrics.precision_activations=False"):
        _tiny(5, **{"model.compile.enabled": True})
    _tiny(5, **{"model.compile.enabled": True, "metrics.precision_activations": False})  # gradients and updates only


# ------------------------------------------------------------------------------------ the tool
def _tool():
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "precision_telemetry.py")
    spec = importlib.util.spec_from_file_location("precision_telemetry_tool", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_dir(tmp_path):
    """A metrics.jsonl with train lines and three precision records of known values (and a torn last line)."""
    import json

    lines = [{"kind": "train", "step": 1, "loss": 5.0}]
    for step, lost in ((10, {"a": 0.5, "b": 0.0, "c": 0.25}), (20, {"a": 0.7, "b": 0.1, "c": 0.25}),
                       (30, {"a": 0.9, "b": 0.2})):
        lines.append({"kind": "precision", "step": step, "group_by": "module", "loss_scale": 1.0,
                      "skipped_steps": 0, "step_skipped": False, "elements": {"a": 10, "b": 10, "c": 10},
                      "measures": {"update_lost": lost, "update_rms_ratio": {"a": 1e-3, "b": 1e-5, "c": 1e-4}}})
    text = "".join(json.dumps(r) + "\n" for r in lines) + '{"kind": "prec'
    (tmp_path / "metrics.jsonl").write_text(text)
    return str(tmp_path)


def test_tool_heat_map_and_worst_rows(tmp_path, capsys):
    tool = _tool()
    out = tmp_path / "pics" / "lost.png"
    assert tool.main([_run_dir(tmp_path), "--measure", "update_lost", "--out", str(out), "--top", "2"]) == 0
    text = capsys.readouterr().out
    assert "3 rows x 3 measured steps (10..30)" in text
    worst = [line.split() for line in text.splitlines() if line.startswith("  ") and not line.strip().startswith("row")]
    assert [w[0] for w in worst] == ["a", "c"]  # means 0.7, 0.25, 0.1: the top two
    assert [float(x) for x in worst[0][1:]] == pytest.approx([0.7, 0.9, 0.9])
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(data[16:20], "big") > 300  # a real picture
    # a log-scale measure (drawn on a log color scale): ranked the same way
    assert tool.main([_run_dir(tmp_path), "--measure", "update_rms_ratio", "--out", str(tmp_path / "rms.png")]) == 0
    text = capsys.readouterr().out
    assert [line.split()[0] for line in text.splitlines()[4:7]] == ["a", "c", "b"]
    assert (tmp_path / "rms.png").read_bytes()[:4] == b"\x89PNG"


def test_tool_errors_are_one_clear_line(tmp_path, capsys, monkeypatch):
    import sys

    tool = _tool()
    run = _run_dir(tmp_path)
    assert tool.main([run, "--measure", "fp8_scale"]) == 2
    assert "this run has no values of it" in capsys.readouterr().err
    assert tool.main([run, "--measure", "nope"]) == 2
    assert "unknown; the measures are" in capsys.readouterr().err
    assert tool.main([str(tmp_path / "missing"), "--measure", "update_lost"]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'missing'}: no such file or folder\n"
    (tmp_path / "no_run").mkdir()
    assert tool.main([str(tmp_path / "no_run"), "--measure", "update_lost"]) == 2
    assert "no metrics.jsonl there" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
    assert tool.main([str(tmp_path / "empty"), "--measure", "update_lost"]) == 2
    assert "metrics.precision_every=N" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    assert tool.main([run, "--measure", "update_lost"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the heat map needs matplotlib") and "--no-plot" in err
    assert tool.main([run, "--measure", "update_lost", "--no-plot"]) == 0  # the summary needs no matplotlib


def test_tool_reads_a_log_folder_holding_one_run_as_compare_runs_does(tmp_path, capsys):
    """train.py writes <log_folder>/<job_name>/metrics.jsonl: the log_folder alone names the run when it holds
    one (tools/compare_runs.py's rule), and two runs there are refused, naming both."""
    import shutil

    (tmp_path / "logs" / "job").mkdir(parents=True)
    run = _run_dir(tmp_path / "logs" / "job")
    tool = _tool()
    assert tool.main([str(tmp_path / "logs"), "--measure", "update_lost", "--no-plot"]) == 0
    assert f"{run}/metrics.jsonl: 3 rows x 3 measured steps" in capsys.readouterr().out
    shutil.copytree(run, tmp_path / "logs" / "other")
    assert tool.main([str(tmp_path / "logs"), "--measure", "update_lost", "--no-plot"]) == 2
    assert "several runs below it" in capsys.readouterr().err


def test_a_model_whose_names_the_optimizer_does_not_use_is_refused():
    model, amp, opt, _ = _twins(torch.ones(4), "bf16")
    with pytest.raises(ValueError, match="parameter 'a.w' belongs to no module of the model given"):
        PrecisionTelemetry(amp, opt, every=1)  # the wrapper: its names are model.a.w


def test_tool_list_names_every_row_even_one_a_measure_skips(tmp_path, capsys):
    """A row only some measures have (the head's ``output``: no fp8 scale) is still named by --list."""
    import json

    rec = {"kind": "precision", "step": 5, "group_by": "module", "loss_scale": 1.0, "skipped_steps": 0,
           "step_skipped": False, "elements": {"a": 4},
           "measures": {"fp8_scale": {"a": 0.5}, "grad_zero": {"a": 0.0, "output": 0.1}}}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(rec) + "\n")
    assert _tool().main([str(tmp_path), "--list"]) == 0
    text = capsys.readouterr().out
    assert "2 rows by module: a, output" in text
    assert [line.split()[:2] for line in text.splitlines()[1:]] == [["fp8_scale", "1"], ["grad_zero", "2"]]
