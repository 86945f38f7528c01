"""HybridZeroOptimizer in one process, against independent references (torch AdamW, clip_grad_norm_)."""

import copy
import dataclasses
import io

import pytest
import torch
from torch import nn

from tessera.config import SCHEMA
from tessera.core.naive_amp import NaiveAMPModel, unwrap_model
from tessera.optim.hybrid_zero import HybridZeroOptimizer, TooManySkippedSteps
from tessera.optim.params import build_param_groups
from tessera.optim.settings import ZeroSettings
from tests.tolerances import adam_rtol, order_rtol, precision_rtol


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-relative difference of a to the reference b."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


class Net(nn.Module):
    def __init__(self, d_in=6, d=12, d_out=3):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d)
        self.norm = nn.LayerNorm(d)
        self.fc2 = nn.Linear(d, d_out)

    def forward(self, x):
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


def _batches(n, b=8, d_in=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, d_in, generator=g), torch.randn(b, 3, generator=g)) for _ in range(n)]


def _loss(model, x, y):
    return (model(x).float() - y).pow(2).mean()


def _adamw(groups, lr=0.05):
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


# Rounding bounds for Net (tests/tolerances.py). Its longest fp32 reduction is the loss's mean over
# 8 x 3 outputs; a value passes fc1, the norm, fc2 and the loss forward (4 reductions), twice that with
# backward. The two computations compared below then take Adam steps (adam_rtol): no gradient element gets
# near eps = 1e-8 (the smallest |g| over these runs is 3e-6), so Adam passes the difference on at gain 1.
NET_GRAD_RTOL = order_rtol(torch.float32, 8 * 3, 2 * 4)  # 1.2e-6
ADAM_UPDATE_OPS = 10  # m, v (two multiply-adds each), bias corrections, sqrt, + eps, divide, lr, decay


def _net_weights_rtol(lrs, weight_rms: float) -> float:
    """Weights after Adam steps at ``lrs`` whose gradients differ by Net's rounding bound."""
    return adam_rtol(NET_GRAD_RTOL, lrs=lrs, weight_rms=weight_rms)


def _rms(t: torch.Tensor) -> float:
    return float(t.detach().double().norm() / t.numel() ** 0.5)


@pytest.mark.parametrize("dtype", ["torch.float32", "torch.tf32"])
def test_fp32_matches_torch_adamw_with_clipping(dtype):
    torch.manual_seed(0)
    ref = Net()
    model = NaiveAMPModel(copy.deepcopy(ref), dtype=dtype, sync_buffer=False)
    ref_opt = _adamw(build_param_groups(ref, 0.1))
    opt = HybridZeroOptimizer(_adamw(build_param_groups(model, 0.1)), zero_cfg={"clip_grad_norm": 0.05},
                              dtype=dtype, param_names=unwrap_model(model))
    clipped = 0
    for step, (x, y) in enumerate(_batches(10)):
        lr = 0.05 * (0.8**step)  # an LR schedule: set on the wrapper's groups like a scheduler does
        for g in list(ref_opt.param_groups) + list(opt.param_groups):
            g["lr"] = lr
        ref_opt.zero_grad()
        _loss(ref, x, y).backward()
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05))
        ref_opt.step()
        opt.zero_grad()
        opt.backward(_loss(model, x, y))
        ok, norm = opt.step()
        assert ok
        # the norm of the same gradients summed in another order (n = every element), plus the gradients'
        # own difference once the weights differ (NET_GRAD_RTOL); tf32 is fp32 on the CPU
        numel = sum(p.numel() for p in ref.parameters())
        assert norm == pytest.approx(ref_norm, rel=order_rtol(torch.float32, numel) + NET_GRAD_RTOL)  # 2.2e-6
        clipped += ref_norm > 0.05
    assert clipped >= 5  # clipping was active
    lrs = [0.05 * (0.8**step) for step in range(10)]
    for (name, p), q in zip(model.model.named_parameters(), ref.parameters()):
        assert p.dtype == torch.float32
        assert rel(p, q) <= _net_weights_rtol(lrs, _rms(q)), name  # 2.5e-7 .. 5e-6; measured <= 2.2e-7
    # the inner optimizer holds fp32 tensors only (fp32 params are their own masters)
    assert all(t.dtype == torch.float32 for g in opt.optim.param_groups for t in g["params"])


class Probe(nn.Module):
    """out = x @ W.T: with exactly representable x the gradient is exact in bf16 and fp32 alike."""

    def __init__(self, w):
        super().__init__()
        self.lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
        with torch.no_grad():
            self.lin.weight.copy_(w)

    def forward(self, x):
        return self.lin(x)


def test_bf16_master_weights_keep_tiny_updates():
    g = torch.Generator().manual_seed(0)
    w0 = (1 + torch.rand(8, 16, generator=g)).bfloat16().float()  # weights in [1, 2], bf16-exact
    xs = [torch.randint(1, 4, (4, 16), generator=g).float() / 2 for _ in range(20)]  # positive: steady descent
    lr = 1e-4  # Adam moves each weight by ~lr: ~1e-4 of the weight, far below bf16's 2^-7 spacing
    pure = Probe(w0).bfloat16()
    pure_opt = torch.optim.AdamW(pure.parameters(), lr=lr, weight_decay=0.0)
    ref = Probe(w0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.0)
    model = NaiveAMPModel(Probe(w0), dtype="torch.bfloat16", sync_buffer=False)
    opt = HybridZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0),
                              zero_cfg={"clip_grad_norm": 0.0}, param_names=unwrap_model(model))
    for x in xs:
        pure_opt.zero_grad()
        pure(x.bfloat16()).float().sum().backward()
        pure_opt.step()
        ref_opt.zero_grad()
        ref(x).sum().backward()
        ref_opt.step()
        opt.backward(model(x).sum())
        assert opt.step()[0]
    assert torch.equal(pure.lin.weight.float(), w0)  # pure bf16 AdamW lost every update
    master = opt.state_dict()["master"]["lin.weight"]
    assert master.dtype == torch.float32
    assert (w0 - master).min() > 1.5e-3  # the masters moved down by ~20 * lr
    # the gradients are exact in both, so only the fp32 update's own roundings may differ (two AdamW
    # implementations: ADAM_UPDATE_OPS elementwise roundings, n = 1) -- measured: bitwise equal
    update_rtol = order_rtol(torch.float32, 1, ADAM_UPDATE_OPS)
    assert rel(master, ref.lin.weight) <= adam_rtol(update_rtol, lrs=[lr] * len(xs), weight_rms=_rms(w0))  # 2.5e-10
    assert torch.equal(model.model.lin.weight, master.bfloat16())  # bf16 weights = masters rounded


def test_fp16_loss_scaling_recovers_tiny_gradients():
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(8, 16, generator=g).half().float()
    x = torch.randn(4, 16, generator=g).half().float()
    c = 1e-8  # d loss / d out: below fp16's smallest subnormal (6e-8)

    ref = Probe(w0)
    (ref(x) * c).sum().backward()
    ref_grad = ref.lin.weight.grad
    assert ref_grad.abs().max() < 1e-6 and ref_grad.abs().max() > 1e-9

    plain = NaiveAMPModel(Probe(w0), dtype="fp16", sync_buffer=False)
    (plain(x) * c).sum().backward()
    assert plain.model.lin.weight.grad.abs().max() == 0  # vanished without scaling

    model = NaiveAMPModel(Probe(w0), dtype="fp16", sync_buffer=False)
    opt = HybridZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), zero_cfg={"clip_grad_norm": 0.0},
                              param_names=unwrap_model(model))
    assert opt.loss_scale == 2**16  # the dynamic scaler's documented default
    opt.backward((model(x) * c).sum())
    grad = opt.get_main_grad(model.model.lin.weight) / opt.loss_scale
    assert grad.dtype == torch.float32
    # fp16 rounds twice on the way: the scaled output gradient (c * 2^16) and the weight gradient's GEMM
    # output (fp32 accumulation inside, n = 1); x and W are fp16-exact. Measured 2.7e-4
    assert rel(grad, ref_grad) <= precision_rtol(torch.float16, 1, 2)  # 6.9e-4


def _mixed_model(seed=0):
    torch.manual_seed(seed)
    net = Net()
    return NaiveAMPModel(net, dtype="bf16", sync_buffer=False, fp32_modules=["norm"])


def _run(model, opt, batches):
    for x, y in batches:
        for mb in (slice(0, 4), slice(4, 8)):  # two micro-batches per step
            opt.backward(_loss(model, x[mb], y[mb]) / 2)
        assert opt.step()[0]


def test_resume_is_bitwise():
    batches = _batches(6, seed=3)
    model = _mixed_model()
    opt = HybridZeroOptimizer(_adamw(build_param_groups(model, 0.1)), zero_cfg={"clip_grad_norm": 0.5},
                              param_names=unwrap_model(model))
    _run(model, opt, batches)

    model2 = _mixed_model()
    opt2 = HybridZeroOptimizer(_adamw(build_param_groups(model2, 0.1)), zero_cfg={"clip_grad_norm": 0.5},
                               param_names=unwrap_model(model2))
    _run(model2, opt2, batches[:3])
    buf = io.BytesIO()
    torch.save(opt2.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    assert set(saved["state"]["fc1.weight"]) >= {"exp_avg", "exp_avg_sq", "step"}
    assert saved["master"]["fc1.weight"].shape == (12, 6)

    model3 = _mixed_model(seed=99)  # different initial weights: everything must come from the state
    opt3 = HybridZeroOptimizer(_adamw(build_param_groups(model3, 0.1)), zero_cfg={"clip_grad_norm": 0.5},
                               param_names=unwrap_model(model3))
    opt3.load_state_dict(saved)
    _run(model3, opt3, batches[3:])
    for (n, p), q in zip(model.model.named_parameters(), model3.model.parameters()):
        assert torch.equal(p, q), n
    a, b = opt.state_dict(), opt3.state_dict()
    for n in a["master"]:
        assert torch.equal(a["master"][n], b["master"][n]), n
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(a["state"][n][k], b["state"][n][k]), (n, k)
    assert b["num_steps"] == 6


def test_gradient_accumulation_equals_one_big_batch():
    batches = _batches(3, seed=5)
    torch.manual_seed(0)
    a = NaiveAMPModel(Net(), dtype="fp32", sync_buffer=False)
    b = copy.deepcopy(a)
    opt_a = HybridZeroOptimizer(_adamw(a.parameters()), zero_cfg={"clip_grad_norm": 1.0})
    opt_b = HybridZeroOptimizer(_adamw(b.parameters()), zero_cfg={"clip_grad_norm": 1.0})
    _run(a, opt_a, batches)
    for x, y in batches:
        opt_b.backward(_loss(b, x, y))
        opt_b.step()
    for p, q in zip(a.parameters(), b.parameters()):
        # two micro-batches sum the 8 samples' gradients in another order; Adam carries it 3 steps
        assert rel(p, q) <= _net_weights_rtol([0.05] * len(batches), _rms(q))  # 4e-7 .. 1.8e-6; measured 1.6e-7


def test_reduce_dtype_model_accumulates_in_bf16():
    model = _mixed_model()
    opt = HybridZeroOptimizer(_adamw(model.parameters()), zero_cfg={"reduce_dtype": "model"})
    ref_model = _mixed_model()
    ref_opt = HybridZeroOptimizer(_adamw(ref_model.parameters()))
    batches = _batches(3)
    _run(model, opt, batches)
    _run(ref_model, ref_opt, batches)
    mem, ref_mem = opt.memory_bytes(), ref_opt.memory_bytes()
    assert mem["main_grads"] < 0.75 * ref_mem["main_grads"]  # bf16 buffers for the bf16 parameters
    for p, q in zip(model.parameters(), ref_model.parameters()):
        # same training, coarser gradients: the two micro-batches' bf16 gradients are summed in bf16 (one
        # more bf16 rounding, n = 2) instead of fp32; Adam carries that 3 steps into the fp32 masters, and
        # the bf16 parameters compared here are the masters rounded once more, in each run. Measured <= 1.7e-3
        grad_rtol = precision_rtol(torch.bfloat16, 2)
        weight_rounding = order_rtol(torch.bfloat16) if p.dtype == torch.bfloat16 else 0.0
        tol = adam_rtol(grad_rtol, lrs=[0.05] * len(batches), weight_rms=_rms(q)) + weight_rounding  # 9e-4 .. 2e-2
        assert rel(p, q) < tol


def test_build_param_groups():
    model = _mixed_model()
    groups = build_param_groups(model, 0.1)
    by_name = {g["name"]: g for g in groups}
    names = {id(p): n for n, p in model.model.named_parameters()}
    assert {names[id(p)] for p in by_name["decay"]["params"]} == {"fc1.weight", "fc2.weight"}
    assert {names[id(p)] for p in by_name["no_decay"]["params"]} == {"fc1.bias", "fc2.bias", "norm.weight",
                                                                      "norm.bias"}
    assert by_name["decay"]["weight_decay"] == 0.1 and by_name["no_decay"]["weight_decay"] == 0.0
    assert len(build_param_groups(model, 0.1, decay_norm_and_bias=True)) == 1


def test_unused_and_frozen_parameters_and_overflow_skip_single_process():
    model = _mixed_model()
    extra = nn.Parameter(torch.ones(3))  # never receives a gradient: treated as a zero gradient
    frozen = nn.Parameter(torch.ones(2), requires_grad=False)  # left alone (no weight decay either)
    opt = HybridZeroOptimizer(_adamw([*model.parameters(), extra, frozen]), zero_cfg={"max_consecutive_skips": 2})
    x, y = _batches(1)[0]
    opt.backward(_loss(model, x, y))
    ok, norm = opt.step()
    assert ok and norm > 0
    assert torch.equal(frozen, torch.ones(2))
    assert not torch.equal(extra, torch.ones(3))  # zero gradient, but AdamW's weight decay applies
    before = opt.state_dict()
    params = [p.detach().clone() for p in model.parameters()]
    for i in range(2):
        opt.backward(_loss(model, x * float("inf"), y))
        assert opt.step() == (False, float("inf"))
    after = opt.state_dict()
    assert all(torch.equal(p, q) for p, q in zip(params, model.parameters()))
    for n in before["master"]:
        assert torch.equal(before["master"][n], after["master"][n])
        assert torch.equal(before["state"][n]["exp_avg"], after["state"][n]["exp_avg"])
    assert opt.skipped_steps == 2
    opt.backward(_loss(model, x * float("nan"), y))
    with pytest.raises(TooManySkippedSteps, match="3 optimizer steps in a row"):
        opt.step()


def test_clear_errors():
    model = _mixed_model()
    inner = _adamw(model.parameters())
    HybridZeroOptimizer(inner)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        HybridZeroOptimizer(model)
    used = _adamw([nn.Parameter(torch.ones(2))])
    used.param_groups[0]["params"][0].grad = torch.ones(2)
    used.step()
    with pytest.raises(ValueError, match="fresh optimizer"):
        HybridZeroOptimizer(used)
    with pytest.raises(TypeError, match="float64"):
        HybridZeroOptimizer(_adamw([nn.Parameter(torch.ones(2, dtype=torch.float64))]))
    with pytest.raises(ValueError, match="no name"):
        HybridZeroOptimizer(_adamw([nn.Parameter(torch.ones(2))]), param_names={})
    other = _mixed_model()
    sd = HybridZeroOptimizer(_adamw(other.parameters()), param_names=unwrap_model(other)).state_dict()
    wide = NaiveAMPModel(Net(d=16), dtype="bf16", sync_buffer=False, fp32_modules=["norm"])
    with pytest.raises(ValueError, match="shape"):
        HybridZeroOptimizer(_adamw(wide.parameters()), param_names=unwrap_model(wide)).load_state_dict(sd)


def test_settings_enter_through_zero_cfg_only():
    """clip_grad_norm, reduce_dtype, max_consecutive_skips, ...: one path (the hybrid_zero_optimizer
    section), with the config schema's keys; a misspelt key is an error, not a silent default."""
    model = _mixed_model()
    for kwarg in ("clip_grad_norm", "reduce_dtype", "max_consecutive_skips"):
        with pytest.raises(TypeError, match=kwarg):
            HybridZeroOptimizer(_adamw(model.parameters()), **{kwarg: 1})
    with pytest.raises(ValueError, match="clip_grad_nrom"):
        HybridZeroOptimizer(_adamw(model.parameters()), zero_cfg={"clip_grad_nrom": 1.0})
    assert {f.name for f in dataclasses.fields(ZeroSettings)} == set(SCHEMA.keys["hybrid_zero_optimizer"].keys)
    opt = HybridZeroOptimizer(_adamw(model.parameters()), zero_cfg={"clip_grad_norm": 0, "reduce_dtype": "model"})
    assert opt.settings == ZeroSettings(clip_grad_norm=0.0, reduce_dtype="model")
    assert opt.dp_size == opt.tp_size == opt.zero1_size == 1 and len(opt.params) == 6
    with pytest.raises(AttributeError):
        opt.scaler = None  # read-only views


def test_documented_import_paths_are_the_optim_classes():
    from tessera.core.grad_scaler import DynamicGradScaler
    from tessera.core.grad_scaler import DynamicGradScaler as documented_scaler
    from tessera.optim import HybridZeroOptimizer as documented_optimizer

    assert documented_optimizer is HybridZeroOptimizer and documented_scaler is DynamicGradScaler
