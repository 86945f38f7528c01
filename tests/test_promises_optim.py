"""HybridZeroOptimizer's clipping and overflow promises, against plain torch (written for the mutation pass).

Each test kills mutants of ``harness/mutants.py`` that no other fast test caught:

- clipping acts only above ``clip_grad_norm`` and a step with all-zero gradients (an all-padding batch)
  succeeds: the update equals ``torch.nn.utils.clip_grad_norm_`` + ``torch.optim.SGD``;
- TP=2: the global norm counts every parameter once (TP-sharded ones on each rank, replicated ones once,
  squares summed over TP), so the reported norm and the clipped SGD step equal TP=1's;
- DP=2 with ZeRO over DP and no global group: an inf that only one rank's shard holds skips the step on
  both ranks (the overflow flag is agreed over DP);
- the fp16 loss scaler resumed from its state dict in the middle of a hysteresis count or a growth window
  follows the uninterrupted scaler.

SGD rather than AdamW: SGD's step is proportional to the clipped gradient, so a wrong clip factor shows in
the weights (one AdamW step is nearly ``lr * sign(g)`` whatever the factor).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness.distributed import run_distributed
from tessera.core.grad_scaler import DynamicGradScaler
from tessera.optim.hybrid_zero import HybridZeroOptimizer
from tessera.parallel import ColumnParallelLinear, RowParallelLinear
from tests.tolerances import order_rtol, unit_roundoff

HANG_GUARD_S = 60  # an overflow verdict the ranks disagree on leaves one rank in the all-gather of the step
H, F, BATCH = 8, 16, 8
LR = 0.5
U32 = unit_roundoff(torch.float32)
# TP=2 against TP=1 (tests/tolerances.py): the longest sum is the loss's mean over BATCH x H outputs; the
# gain, both linears and the loss, forward and back: depth 8. The norm adds its own sum over every element.
GRAD_RTOL = order_rtol(torch.float32, BATCH * H, 2 * 4)
NORM_RTOL = GRAD_RTOL + order_rtol(torch.float32, H + F * H + F + H * F + H)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ---------------------------------------------------------------------- one process
def _net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))


def _data(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 3, generator=g)


def _ours(clip: float, scale_loss: float = 1.0) -> tuple[bool, float, list[torch.Tensor]]:
    model = _net()
    opt = HybridZeroOptimizer(torch.optim.SGD(model.parameters(), lr=LR), zero_cfg={"clip_grad_norm": clip})
    x, y = _data()
    opt.backward((model(x) - y).pow(2).mean() * scale_loss)
    ok, norm = opt.step()
    return ok, norm, [p.detach().clone() for p in model.parameters()]


def _torch(clip: float) -> tuple[float, list[torch.Tensor]]:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = _data()
    (model(x) - y).pow(2).mean().backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
    opt.step()
    return norm, [p.detach().clone() for p in model.parameters()]


def test_clipping_acts_only_above_the_threshold():
    """Below the threshold the step is plain SGD (factor exactly 1); above it, torch's clip_grad_norm_."""
    w0 = [p.detach().clone() for p in _net().parameters()]
    ref_norm, ref_unclipped = _torch(1e9)
    for clip in (2 * ref_norm, ref_norm / 4):  # inactive, then active
        ok, norm, ours = _ours(clip)
        _, ref = _torch(clip)
        assert ok
        # the same per-tensor norms summed in another order (fp32 norms, fp64 sum here)
        assert abs(norm - ref_norm) <= order_rtol(torch.float32, sum(p.numel() for p in w0)) * ref_norm
        for a, b, p0 in zip(ours, ref, w0):  # the clip factor carries the norm's difference once, then lr * g
            assert rel(a - p0, b - p0) <= 2 * order_rtol(torch.float32, sum(p.numel() for p in w0)) + 4 * U32
        if clip > ref_norm:
            assert all(torch.equal(a, b) for a, b in zip(ours, ref_unclipped))  # factor 1: bitwise plain SGD


def test_a_step_with_all_zero_gradients_succeeds_with_clipping_on():
    """An all-padding micro-batch gives zero gradients (the loss promises 0, not NaN): the step must go
    through, report norm 0 and leave SGD's weights where they were."""
    w0 = [p.detach().clone() for p in _net().parameters()]
    ok, norm, ours = _ours(clip=1.0, scale_loss=0.0)
    assert ok and norm == 0.0
    assert all(torch.equal(a, b) for a, b in zip(ours, w0))


@pytest.mark.parametrize("before", [[True, True], [False, False, False]])
def test_a_resumed_loss_scaler_follows_the_uninterrupted_one(before):
    """Saved after two of three overflows (hysteresis 3) or three of four clean steps (growth interval 4):
    the next overflow backs off, or the next clean step grows, in the resumed scaler as in the original."""
    kw = dict(initial_scale=2.0**10, growth_interval=4, hysteresis=3)
    original = DynamicGradScaler(**kw)
    for found_inf in before:
        original.update(found_inf)
    resumed = DynamicGradScaler(**kw)
    resumed.load_state_dict(original.state_dict())
    event = before[0]  # one more of the same: completes the count
    original.update(event)
    resumed.update(event)
    assert original.scale == (2.0**9 if event else 2.0**11)  # by the rule (the scaler's docstring)
    assert resumed.scale == original.scale


# ---------------------------------------------------------------------- TP=2 and DP=2 (one spawn)
class GainMLP(nn.Module):
    """A replicated gain -> ColumnParallelLinear (sharded bias) -> tanh -> RowParallelLinear (replicated bias)."""

    def __init__(self, full: dict[str, torch.Tensor], group=None, tp: int = 1, rank: int = 0):
        super().__init__()
        self.gain = nn.Parameter(full["gain"].clone())
        self.fc1 = ColumnParallelLinear(H, F, bias=True, process_group=group)
        self.fc2 = RowParallelLinear(F, H, bias=True, process_group=group)
        with torch.no_grad():
            self.fc1.weight.copy_(full["w1"].chunk(tp, 0)[rank])
            self.fc1.bias.copy_(full["b1"].chunk(tp, 0)[rank])
            self.fc2.weight.copy_(full["w2"].chunk(tp, 1)[rank])
            self.fc2.bias.copy_(full["b2"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x * self.gain)))


def _full(seed: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"gain": 1 + torch.rand(H, generator=g), "w1": torch.randn(F, H, generator=g) / 3,
            "b1": torch.randn(F, generator=g), "w2": torch.randn(H, F, generator=g) / 3,
            "b2": 3 * torch.randn(H, generator=g)}  # large replicated gradients: counting them wrong shows


def _tp_data(seed: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, H, generator=g), torch.randn(BATCH, H, generator=g)


def _tp_part(rank: int, world: int, clip: float) -> dict:
    """TP=2 over the two ranks: one clipped SGD step; the reported norm and this rank's parameters."""
    model = GainMLP(_full(), dist.group.WORLD, world, rank)
    opt = HybridZeroOptimizer(torch.optim.SGD(model.parameters(), lr=LR), zero_cfg={"clip_grad_norm": clip},
                              tp_group=dist.group.WORLD, param_names=model.named_parameters())
    x, t = _tp_data()
    opt.backward((model(x) - t).pow(2).mean())
    ok, norm = opt.step()
    return {"ok": ok, "norm": norm, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _overflow_part(rank: int) -> dict:
    """DP=2, ZeRO over DP, no global group; rank 1's fc2.weight gradient is inf, which reaches only the rank
    whose shard holds fc2.weight."""
    model = _net()
    w0 = [p.detach().clone() for p in model.parameters()]
    opt = HybridZeroOptimizer(torch.optim.SGD(model.parameters(), lr=LR), dp_group=dist.group.WORLD,
                              zero1_group=dist.group.WORLD, param_names=model.named_parameters())
    assert opt.gradients.reduce_scatter and len(opt.buckets) == 1
    b = opt.buckets[0]
    i = b.names.index("2.weight")
    owners = {(b.offsets[i] + k) // b.shard for k in (0, b.numels[i] - 1)}
    assert len(owners) == 1  # one rank's shard holds the whole inf: only that rank sees it
    if rank == 1:
        model[2].weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    x, y = _data()
    opt.backward((model(x.chunk(2)[rank]) - y.chunk(2)[rank]).pow(2).mean())
    ok, _ = opt.step()
    return {"ok": ok, "unchanged": all(torch.equal(p, q) for p, q in zip(model.parameters(), w0))}


def _worker(rank: int, world: int, clip: float) -> tuple[dict, dict]:
    return _tp_part(rank, world, clip), _overflow_part(rank)


def test_tp2_norm_counts_every_parameter_once_and_dp2_agrees_on_an_overflow_in_one_shard():
    full = _full()
    ref = GainMLP(full)  # TP=1, one process: the reference
    x, t = _tp_data()
    (ref(x) - t).pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    ref_norm = float(torch.nn.utils.get_total_norm(list(grads.values())))
    replicated = sum(float(grads[n].norm()) ** 2 for n in ("gain", "fc2.bias"))
    assert ((ref_norm**2 + replicated) ** 0.5 / ref_norm - 1) > 100 * NORM_RTOL  # counted twice would show
    assert (1 - (ref_norm**2 - replicated) ** 0.5 / ref_norm) > 100 * NORM_RTOL  # and so would never
    clip = ref_norm / 2
    w0 = {n: p.detach().clone() for n, p in ref.named_parameters()}
    torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
    torch.optim.SGD(ref.parameters(), lr=LR).step()

    res = run_distributed(_worker, 2, clip, timeout=HANG_GUARD_S)
    for rank, (tp, overflow) in enumerate(res):
        assert tp["ok"]
        assert abs(tp["norm"] - ref_norm) <= NORM_RTOL * ref_norm, (tp["norm"], ref_norm)
        shards = {"gain": lambda v: v, "fc1.weight": lambda v: v.chunk(2, 0)[rank],
                  "fc1.bias": lambda v: v.chunk(2, 0)[rank], "fc2.weight": lambda v: v.chunk(2, 1)[rank],
                  "fc2.bias": lambda v: v}
        for n, p in tp["params"].items():  # the clipped update: lr x factor (carries the norm's error) x grad
            want, start = shards[n](dict(ref.named_parameters())[n]), shards[n](w0[n])
            assert rel(p - start, want - start) <= GRAD_RTOL + NORM_RTOL + 4 * U32, n
        assert overflow == {"ok": False, "unchanged": True}, rank
