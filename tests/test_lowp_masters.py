"""Low-precision masters and optimizer states, against independent references: torch's own
AdamW in fp64 / fp32, exact bf16 neighbours, and the same run without a checkpoint."""

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness.distributed import run_distributed
from tessera.checkpoint import Layout, TrainState, load_checkpoint, save_checkpoint
from tessera.optim.hybrid_zero import HybridZeroOptimizer
from tessera.optim.lowp_adamw import adamw_step, element_noise, stochastic_round_bf16
from tests.tolerances import allclose_tols, order_rtol

POLICIES = {  # name -> hybrid_zero_optimizer keys
    "fp32": {},
    "bf16": {"master_dtype": "bf16"},
    "kahan": {"master_dtype": "bf16", "master_compensation": "kahan"},
    "stochastic": {"master_dtype": "bf16", "master_compensation": "stochastic"},
    "bf16_states": {"optimizer_state_dtype": "bf16"},
    "kahan_bf16_states": {"master_dtype": "bf16", "master_compensation": "kahan", "optimizer_state_dtype": "bf16"},
}


class _Vec(nn.Module):
    def __init__(self, n, value=1.0, dtype=torch.bfloat16):
        super().__init__()
        self.w = nn.Parameter(torch.full((n,), value, dtype=dtype))

    def forward(self, g):
        return (self.w.float() * g).sum()


def _opt(model, policy, lr, wd=0.0, clip=0.0, **groups):
    inner = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd)
    return HybridZeroOptimizer(inner, zero_cfg={**POLICIES[policy], "clip_grad_norm": clip}, dtype="bf16",
                               param_names=model, seed=3, **groups)


# ------------------------------------------------------------------------------------ the rounding itself
def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour():
    x = torch.tensor([1.0 + 0.3 * 2**-7, -3.0 - 0.77 * 2**-6, 1e-3 * (1 + 0.5 * 2**-7)], dtype=torch.float32)
    lo = x.to(torch.bfloat16).float()  # the two bf16 neighbours of each value
    draws = torch.stack([stochastic_round_bf16(x, element_noise(0, 3, 17, step, 5, "cpu")).float()
                         for step in range(4000)])
    down = torch.where(lo <= x, lo, torch.nextafter(lo.to(torch.bfloat16), torch.tensor(-1e30, dtype=torch.bfloat16)).float())
    up = torch.where(lo >= x, lo, torch.nextafter(lo.to(torch.bfloat16), torch.tensor(1e30, dtype=torch.bfloat16)).float())
    assert bool(((draws == down) | (draws == up)).all())
    ulp = up - down
    # the mean of 4000 roundings is within 4 standard errors of the exact value (and not round-to-nearest)
    assert bool(((draws.mean(0) - x).abs() <= 4 * ulp / 2 / 4000**0.5).all()), (draws.mean(0) - x) / ulp


def test_noise_depends_on_element_step_and_seed_not_on_the_slice():
    a = element_noise(0, 100, 7, 3, 1, "cpu")
    assert torch.equal(element_noise(40, 60, 7, 3, 1, "cpu"), a[40:60])  # a shard sees the same bits
    assert not torch.equal(element_noise(0, 100, 7, 4, 1, "cpu"), a)
    assert not torch.equal(element_noise(0, 100, 7, 3, 2, "cpu"), a)
    assert not torch.equal(element_noise(0, 100, 8, 3, 1, "cpu"), a)
    assert int(a.min()) >= 0 and int(a.max()) < 65536 and a.float().std() > 10000


def test_fp32_update_equals_torch_adamw():
    torch.manual_seed(0)
    w = torch.randn(50)
    ref = nn.Parameter(w.clone())
    torch_opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    mine, state = w.clone(), {}
    hyper = torch_opt.param_groups[0]
    for _ in range(5):
        g = torch.randn(50)
        ref.grad = g.clone()
        torch_opt.step()
        adamw_step(mine, g, state, hyper, compensation="none", state_dtype=torch.float32)
    # the same AdamW roundings (10 per step, n = 1), perhaps in another order, over 5 steps, at the weights'
    # scale (tests/tolerances.py; measured: bitwise)
    torch.testing.assert_close(mine, ref.detach(), **allclose_tols(order_rtol(torch.float32, 1, 10 * 5),
                                                                   float(ref.detach().abs().max())))  # rtol 5.9e-7


# ------------------------------------------------------------------------------------ tracking fp32 masters
def _train_vec(policy, steps, lr, n=256):
    model = _Vec(n)
    opt = _opt(model, policy, lr)
    g = torch.linspace(0.5, 1.5, n)
    for _ in range(steps):
        opt.backward(model(g))
        assert opt.step()[0]
    # the weight as training sees it, plus (Kahan) what its compensation carries
    comp = [s.get("master_compensation") for s in opt.optim.state.values()]
    w = model.w.detach().float()
    return w, (w + comp[0].float() if comp[0] is not None else w)


def _reference(steps, lr, n=256):
    w = nn.Parameter(torch.ones(n, dtype=torch.float64))
    ref = torch.optim.AdamW([w], lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    g = torch.linspace(0.5, 1.5, n, dtype=torch.float64)
    for _ in range(steps):
        w.grad = g.clone()
        ref.step()
    return w.detach()


def test_kahan_masters_track_fp32_where_plain_bf16_masters_stall():
    """lr 1e-4 against a bf16 ulp of 2**-8..2**-7 near 1.0: every update is below half an ulp."""
    steps, lr = 1000, 1e-4
    ref = _reference(steps, lr)  # fp64 AdamW: moves by ~steps * lr = 0.1
    moved = float((1 - ref).mean())
    assert moved > 0.09
    plain, _ = _train_vec("bf16", steps, lr)
    assert bool((plain == 1.0).all())  # plain bf16 masters: every update rounded away
    kahan_w, kahan_sum = _train_vec("kahan", steps, lr)
    assert float((kahan_sum.double() - ref).abs().max()) < 0.01 * moved  # the pair tracks fp64 within 1%
    assert float((kahan_w.double() - ref).abs().max()) <= 2**-8  # the bf16 weight: within one rounding
    fp32_w, _ = _train_vec("fp32", steps, lr)  # fp32 masters: their bf16 weights, the same bound
    assert float((fp32_w.double() - ref).abs().max()) <= 2**-8
    stoch, _ = _train_vec("stochastic", steps, lr)  # each weight a bf16 value, unbiased on average
    assert abs(float(stoch.double().mean() - ref.mean())) < 0.02 * moved


def test_bf16_optimizer_states_follow_fp32_states():
    steps, lr = 50, 1e-2
    ref = _reference(steps, lr)
    w32, _ = _train_vec("fp32", steps, lr)
    w16, _ = _train_vec("bf16_states", steps, lr)
    assert float((w16.double() - ref).abs().max()) <= 2 * float((w32.double() - ref).abs().max()) + 2**-7


def test_policy_errors_name_the_key():
    model = _Vec(4, dtype=torch.float32)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="master_dtype"):
        HybridZeroOptimizer(inner, zero_cfg={"master_dtype": "bf16"}, dtype="fp32")
    with pytest.raises(ValueError, match="master_compensation"):
        HybridZeroOptimizer(torch.optim.AdamW(_Vec(4).parameters()), zero_cfg={"master_compensation": "kahan"},
                            dtype="bf16")
    with pytest.raises(ValueError, match="AdamW"):
        HybridZeroOptimizer(torch.optim.SGD(_Vec(4).parameters(), lr=0.1), zero_cfg={"master_dtype": "bf16"},
                            dtype="bf16")


# ------------------------------------------------------------------------------------ bytes per parameter
CLOSED_FORM = {  # bf16 weights, fp32 main grads; ZeRO size d -> (weights, grads, masters, comp, states)
    "fp32": lambda d: (2, 4, 4 / d, 0, 8 / d),
    "bf16": lambda d: (2, 4, 0, 0, 8 / d),  # masters share the weights' storage
    "kahan": lambda d: (2, 4, 0, 2 / d, 8 / d),
    "stochastic": lambda d: (2, 4, 0, 0, 8 / d),
    "bf16_states": lambda d: (2, 4, 4 / d, 0, 4 / d),
    "kahan_bf16_states": lambda d: (2, 4, 0, 2 / d, 4 / d),  # 2 + 4 + (2 + 4) / d
}


def _bytes(opt, n):
    mem = opt.memory_bytes()
    states = mem["optimizer_states"]  # the compensation is a state entry too, reported apart (counted once)
    step_bytes = 4 * len(opt.buckets)  # Adam's 0-dim step counters
    return (mem["weights"] / n, mem["main_grads"] / n, mem["masters"] / n, mem["compensation"] / n,
            (states - step_bytes) / n)


def _bytes_worker(rank, world):
    whole = dist.group.WORLD
    out = {}
    for policy in POLICIES:
        model = _Vec(4096)
        opt = _opt(model, policy, 1e-3, dp_group=whole, zero1_group=whole, global_group=whole)
        opt.backward(model(torch.ones(4096)))
        assert opt.step()[0]
        out[policy] = _bytes(opt, 4096)
    return out


def test_measured_bytes_per_parameter_equal_the_closed_form_with_and_without_zero():
    for policy in POLICIES:
        model = _Vec(4096)
        opt = _opt(model, policy, 1e-3)
        opt.backward(model(torch.ones(4096)))
        assert opt.step()[0]
        assert _bytes(opt, 4096) == pytest.approx(CLOSED_FORM[policy](1)), policy
    res = run_distributed(_bytes_worker, 2)
    for policy in POLICIES:
        assert res[0][policy] == pytest.approx(CLOSED_FORM[policy](2)), policy


# ------------------------------------------------------------------------------------ resume and layouts
def _small(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3)).to(torch.bfloat16)


def _steps(model, opt, seeds, part=(0, 1)):
    for s in seeds:
        g = torch.Generator().manual_seed(s)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        x, y = x.chunk(part[1])[part[0]], y.chunk(part[1])[part[0]]
        opt.backward((model(x.to(torch.bfloat16)).float() - y).pow(2).mean())
        assert opt.step()[0]


def _small_opt(model, policy, **groups):
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    return HybridZeroOptimizer(inner, zero_cfg={**POLICIES[policy], "clip_grad_norm": 0.0}, dtype="bf16",
                               param_names=model, seed=11, **groups)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_resume_across_a_checkpoint_is_bitwise(tmp_path, policy):
    model = _small()
    opt = _small_opt(model, policy)
    _steps(model, opt, [1, 2])
    path = save_checkpoint(str(tmp_path), 2, TrainState(model, opt), config=None, layout=Layout())
    _steps(model, opt, [3, 4, 5])
    m2 = _small(seed=9)
    o2 = _small_opt(m2, policy)
    load_checkpoint(path, TrainState(m2, o2), layout=Layout())
    _steps(m2, o2, [3, 4, 5])
    for (n, p), q in zip(model.named_parameters(), m2.parameters()):
        assert torch.equal(p, q), (policy, n)
    for s1, s2 in zip(opt.optim.state.values(), o2.optim.state.values()):
        assert s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1), policy


def _zero_worker(rank, world):
    whole = dist.group.WORLD
    singles = [dist.new_group([r]) for r in range(world)]
    out = {}
    for policy in POLICIES:
        for zero in (2, 1):
            model = _small()
            opt = _small_opt(model, policy, dp_group=whole, zero1_group=whole if zero == 2 else singles[rank],
                             global_group=whole)
            _steps(model, opt, [1, 2, 3], (rank, world))
            out[policy, zero] = [p.detach().clone() for p in model.parameters()]
    return out


def test_zero_1_and_2_give_the_same_weights_for_every_policy():
    """Clipping off, so nothing depends on the order of a norm's sum: every policy bitwise equal, and the
    replicas on both DP ranks identical (stochastic rounding draws per element, not per shard)."""
    res = run_distributed(_zero_worker, 2)
    for policy in POLICIES:
        for a, b in zip(res[0][policy, 2], res[0][policy, 1]):
            assert torch.equal(a, b), policy
        for a, b in zip(res[0][policy, 2], res[1][policy, 2]):
            assert torch.equal(a, b), policy


def test_config_checks_name_the_keys():
    from tessera.config import Config, ConfigError

    tiny = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tiny.py")
    with pytest.raises(ConfigError, match="master_dtype='bf16' needs model.dtype bfloat16"):
        Config.from_file(tiny, ["hybrid_zero_optimizer.master_dtype='bf16'", "model.dtype='torch.float16'"])
    with pytest.raises(ConfigError, match="master_compensation='kahan' applies to bf16 masters only"):
        Config.from_file(tiny, ["hybrid_zero_optimizer.master_compensation='kahan'", "model.dtype='bf16'"])
    with pytest.raises(ConfigError, match="optimizer_state_dtype"):
        Config.from_file(tiny, ["hybrid_zero_optimizer.optimizer_state_dtype='fp16'"])
    cfg = Config.from_file(tiny, ["hybrid_zero_optimizer.master_dtype='bf16'", "model.dtype='bf16'",
                                  "hybrid_zero_optimizer.master_compensation='stochastic'"])
    assert cfg.hybrid_zero_optimizer.master_compensation == "stochastic"
