"""HybridZeroOptimizer across processes (gloo): ZeRO-1 equivalence, memory, resharded resume, TP grad
norm, overflow agreement. Every reference is computed in this file from plain torch on one process."""

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness.distributed import run_distributed
from tessera.core.naive_amp import NaiveAMPModel, unwrap_model
from tessera.optim.hybrid_zero import HybridZeroOptimizer
from tessera.optim.params import build_param_groups
from tests.test_optimizer import NET_GRAD_RTOL, Net, _rms, rel  # the same small model and helpers
from tests.tolerances import adam_rtol, cast_rtol, order_rtol

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))



def _make(dtype, seed=0):
    torch.manual_seed(seed)
    return NaiveAMPModel(Net(), dtype=dtype, sync_buffer=False, fp32_modules=["norm"])


def _make_opt(model, **groups):
    inner = torch.optim.AdamW(build_param_groups(model, 0.1), lr=0.05, betas=(0.9, 0.95), weight_decay=0.1)
    return HybridZeroOptimizer(inner, zero_cfg={"clip_grad_norm": 0.5}, param_names=unwrap_model(model), **groups)


def _batches(n=5, b=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, 6, generator=g), torch.randn(b, 3, generator=g)) for _ in range(n)]


def _train(model, opt, batches, part=None):
    """``part=(rank, world)``: this DP rank's slice of each global batch."""
    for x, y in batches:
        if part is not None:
            x, y = x.chunk(part[1])[part[0]], y.chunk(part[1])[part[0]]
        opt.backward((model(x).float() - y).pow(2).mean())
        assert opt.step()[0]


def _params(model):
    return {n: p.detach().float().clone() for n, p in model.model.named_parameters()}


def _weights_rtol(steps: int, ref: torch.Tensor, bf16: bool = False, grad_rtol: float = NET_GRAD_RTOL) -> float:
    """Weights after ``steps`` Adam steps (lr 0.05) of two runs whose gradients differ by rounding (Net's
    bound, test_optimizer.py: another order of the same sums; Adam at gain 1, no gradient element near eps),
    against the reference weight ``ref``'s RMS; a bf16 parameter is its master rounded once more in each run
    (``cast_rtol``: all of them re-round when the masters differ by a bf16 ulp, none is expected to for
    rounding-sized differences)."""
    master = adam_rtol(grad_rtol, lrs=[0.05] * steps, weight_rms=_rms(ref))
    return master + (cast_rtol(torch.bfloat16, master, ref.numel()) if bf16 else 0.0)


def _zero_part(rank, world, batches, resume_at):
    whole = dist.group.WORLD
    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    out = {}
    for dtype in ("fp32", "bf16"):
        for zero in (2, 1):
            model = _make(dtype)
            opt = _make_opt(model, dp_group=whole, zero1_group=whole if zero == 2 else singles[rank],
                            global_group=whole)
            assert opt.zero1_size == zero
            _train(model, opt, batches[:resume_at], (rank, world))
            sd = opt.state_dict()  # collective over ZERO1
            _train(model, opt, batches[resume_at:], (rank, world))
            out[dtype, zero] = {"params": _params(model), "mem": opt.memory_bytes()}
            if dtype == "fp32" and zero == 2:
                out["state"] = sd
    # resume the zero1=2 state into fresh objects: same layout (zero1=2) and zero1=1
    for zero in (2, 1):
        model = _make("fp32", seed=123)
        opt = _make_opt(model, dp_group=whole, zero1_group=whole if zero == 2 else singles[rank])
        opt.load_state_dict(out["state"])
        _train(model, opt, batches[resume_at:], (rank, world))
        out["resumed", zero] = _params(model)
    if rank != 0:
        out.pop("state")
    return out


def _dp2_worker(rank, world, batches, resume_at):
    """One spawn for every DP=2 check (process start-up dominates the cost on a small CPU)."""
    overflow = _overflow_part(rank, world)
    zero = _zero_part(rank, world, batches, resume_at)
    return overflow, zero, _report_part()


def _report_part():
    from tessera.config import Config
    from tessera.model import build_model
    from tessera.train.precision_report import precision_report

    cfg = Config.from_file(os.path.join(ROOT, "configs", "tiny.py"))
    model = build_model(cfg.model, tp_group=None, seed=0, device="cpu")
    batch = torch.randint(0, cfg.model.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    return precision_report(model, "bf16", 2, batch=batch)  # the default group has 2 ranks: ZeRO over 2


@pytest.fixture(scope="module")
def dp2():
    batches, resume_at = _batches(), 3
    res = run_distributed(_dp2_worker, 2, batches, resume_at, init_process_group=False)
    return batches, resume_at, [r[0] for r in res], [r[1] for r in res], [r[2] for r in res]


def test_precision_report_zero1_2(dp2):
    for r in dp2[4]:
        assert r.zero1_size == 2
        # bf16 weight 2 + fp32 main grad 4 + (fp32 master 4 + Adam 8) / 2, from the allocated tensors
        expected = {"weights": 2, "main_grads": 4, "masters": 2, "optimizer_states": 4, "total": 6 + 12 / 2}
        for role, want in expected.items():
            assert r.measured[role] == pytest.approx(want, rel=0.05), role


def test_zero1_equivalence_memory_and_resharded_resume(dp2):
    batches, resume_at, _, res, _ = dp2
    r0, r1 = res

    # independent reference: one process on the global batch
    ref_model = _make("fp32")
    ref_opt = _make_opt(ref_model)
    _train(ref_model, ref_opt, batches)
    ref = _params(ref_model)
    bf16 = {n for n, p in _make("bf16").model.named_parameters() if p.dtype == torch.bfloat16}
    for r in res:
        for zero in (2, 1):
            for n, t in r["fp32", zero]["params"].items():
                # the DP halves of the batch are summed in another order; 5 steps (measured <= 1.7e-7,
                # bounds 3.3e-7 .. 4.5e-6 per parameter)
                assert rel(t, ref[n]) <= _weights_rtol(len(batches), ref[n]), (zero, n)
    for n in ref:  # DP replicas agree exactly; zero1=2 and zero1=1 do too (same reduction, same update)
        assert torch.equal(r0["fp32", 2]["params"][n], r1["fp32", 2]["params"][n])
        assert torch.equal(r0["bf16", 2]["params"][n], r1["bf16", 2]["params"][n])
        # up to the grad norm's order (partitioned over ZeRO ranks), which Adam carries on (measured <= 1.6e-7)
        assert rel(r0["bf16", 2]["params"][n], r0["bf16", 1]["params"][n]) <= _weights_rtol(len(batches), ref[n], n in bf16)

    # memory: masters + optimizer states per rank halve with zero1=2 (bf16 model: real fp32 masters)
    for r in res:
        half = r["bf16", 2]["mem"]["masters"] + r["bf16", 2]["mem"]["optimizer_states"]
        full = r["bf16", 1]["mem"]["masters"] + r["bf16", 1]["mem"]["optimizer_states"]
        assert half / full == pytest.approx(0.5, rel=0.05)
        assert r["bf16", 2]["mem"]["weights"] == pytest.approx(r["bf16", 1]["mem"]["weights"], rel=0.05)  # padding

    # resume: same layout is bitwise; zero1=1 and one process continue equal
    for r in res:
        for n in ref:
            assert torch.equal(r["resumed", 2][n], r["fp32", 2]["params"][n]), n
            # another ZeRO layout for the last steps (measured: bitwise)
            assert rel(r["resumed", 1][n], r["fp32", 2]["params"][n]) <= _weights_rtol(len(batches) - resume_at, ref[n]), n
    state = r0["state"]
    assert set(state["master"]) == set(ref)
    assert state["master"]["fc1.weight"].shape == (12, 6)  # full shapes, gathered over ZERO1
    single = _make("fp32", seed=7)
    single_opt = _make_opt(single)
    single_opt.load_state_dict(state)
    _train(single, single_opt, batches[resume_at:])
    for n, t in _params(single).items():  # the DP run's first steps, then one process (measured 1.7e-7)
        assert rel(t, ref[n]) <= _weights_rtol(len(batches), ref[n]), n


# ---------------------------------------------------------------------- tensor parallel
class TPNet(nn.Module):
    """RMSNorm (replicated) -> ColumnParallelLinear -> tanh -> RowParallelLinear (replicated bias).

    Built from tessera's TP layers with the shards of given full weights copied in, so TP=1 on one
    process is the independent reference.
    """

    def __init__(self, full: dict, tp_rank: int = 0, tp: int = 1, group=None):
        super().__init__()
        from tessera.model import RMSNorm
        from tessera.parallel import ColumnParallelLinear, RowParallelLinear

        h, f = full["w1"].shape[1], full["w1"].shape[0]
        self.norm = RMSNorm(h)
        self.fc1 = ColumnParallelLinear(h, f, bias=False, process_group=group)
        self.fc2 = RowParallelLinear(f, h, bias=True, process_group=group)
        with torch.no_grad():
            self.norm.weight.copy_(full["g"])
            self.fc1.weight.copy_(full["w1"].chunk(tp, 0)[tp_rank])
            self.fc2.weight.copy_(full["w2"].chunk(tp, 1)[tp_rank])
            self.fc2.bias.copy_(full["b"])

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(self.norm(x))))


def _tp_full(h=8, f=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"g": 1 + torch.rand(h, generator=g), "w1": torch.randn(f, h, generator=g) / 3,
            "w2": torch.randn(h, f, generator=g) / 3, "b": torch.randn(h, generator=g)}


def _tp_worker(rank, world, full, x, t, clip):
    tp = 2
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp_rank, dp_rank = rank % tp, rank // tp
    tpg, dpg = tp_groups[dp_rank], dp_groups[tp_rank]
    model = TPNet(full, tp_rank, tp, tpg)
    opt = HybridZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1), zero_cfg={"clip_grad_norm": clip},
                              tp_group=tpg, dp_group=dpg, zero1_group=dpg, global_group=dist.group.WORLD,
                              param_names=model.named_parameters())
    xs, ts = x.chunk(2)[dp_rank], t.chunk(2)[dp_rank]
    opt.backward((model(xs) - ts).pow(2).mean())
    ok, norm = opt.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}

    # overflow on one rank only, agreement without a global group (TP then DP)
    model2 = TPNet(full, tp_rank, tp, tpg)
    opt2 = HybridZeroOptimizer(torch.optim.AdamW(model2.parameters(), lr=0.1), tp_group=tpg, dp_group=dpg)
    if rank == 3:
        model2.fc1.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    opt2.backward((model2(xs) - ts).pow(2).mean())
    skipped = opt2.step()[0] is False and torch.equal(model2.fc1.weight, full["w1"].chunk(tp, 0)[tp_rank])
    return {"ok": ok, "norm": norm, "params": params, "tp_rank": tp_rank, "skipped": skipped}


@pytest.mark.slow
def test_global_grad_norm_tp2_dp2_counts_replicated_once():
    full = _tp_full()
    g = torch.Generator().manual_seed(5)
    x, t = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)

    ref = TPNet(full)  # TP=1, one process, the global batch
    (ref(x) - t).pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    ref_norm = float(torch.nn.utils.get_total_norm(list(grads.values())))
    replicated = grads["norm.weight"].norm() ** 2 + grads["fc2.bias"].norm() ** 2
    double = (ref_norm**2 + replicated) ** 0.5
    assert double / ref_norm - 1 > 1e-3  # counting replicated params twice would be detected
    clip = ref_norm / 2
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
    torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
    ref_opt.step()

    res = run_distributed(_tp_worker, 4, full, x, t, clip)
    # TP and DP sum the gradients in another order: the loss's mean over 8 x 8 outputs is the longest sum;
    # norm, fc1, fc2, loss forward and back. The norm adds its own sum over every element.
    grad_rtol = order_rtol(torch.float32, 64, 2 * 4)  # 1.9e-6
    numel = sum(g.numel() for g in grads.values())
    for r in res:
        assert r["ok"]
        assert r["norm"] == pytest.approx(ref_norm, rel=grad_rtol + order_rtol(torch.float32, numel))  # 3.3e-6
        tr = r["tp_rank"]
        want = {"norm.weight": ref.norm.weight, "fc1.weight": ref.fc1.weight.chunk(2, 0)[tr],
                "fc2.weight": ref.fc2.weight.chunk(2, 1)[tr], "fc2.bias": ref.fc2.bias}
        for n, p in r["params"].items():  # one AdamW step, lr 0.1 (measured <= 2.5e-8)
            assert rel(p, want[n]) <= adam_rtol(grad_rtol, lrs=[0.1], weight_rms=_rms(want[n])), n
        assert r["skipped"]


# ---------------------------------------------------------------------- overflow, with gpc's groups
class BufNet(Net):
    def __init__(self):
        super().__init__()
        self.register_buffer("running", torch.zeros(3))


def _overflow_part(rank, world):
    from tessera.core.context import gpc, launch_from_torch

    cfg = dict(
        model=dict(num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=16, dtype="torch.float16"),
        data=dict(type="synthetic"),
        parallel=dict(tensor=dict(size=1), zero1=dict(size=-1)),
        grad_scaler=dict(fp16=dict(initial_scale=2**10, growth_interval=3), hysteresis=2),
        hybrid_zero_optimizer=dict(clip_grad_norm=1.0),
    )
    launch_from_torch(cfg, seed=0)
    torch.manual_seed(0)
    net = BufNet()
    net.running.fill_(float(rank))
    model = NaiveAMPModel(net, dtype=gpc.config.model.dtype)  # DATA mode, sync_buffer=True
    opt = HybridZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=0.01), grad_scal_cfg=gpc.config.grad_scaler,
        zero_cfg=gpc.config.hybrid_zero_optimizer, param_names=unwrap_model(model),
    )
    g = torch.Generator().manual_seed(rank)
    data = [(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(6)]

    def step(i, inject):
        handle = None
        if inject and rank == 1:
            handle = model.model.fc1.weight.register_hook(lambda gr: torch.full_like(gr, float("inf")))
        x, y = data[i]
        opt.backward((model(x) - y).pow(2).mean())
        if handle is not None:
            handle.remove()
        return opt.step()

    def snapshot():
        sd = opt.state_dict()
        return [p.detach().clone() for p in model.parameters()], sd

    out = {"zero1": opt.zero1_size, "results": []}
    out["results"].append(step(0, False))
    out["buffer"] = model.model.running.float().tolist()
    before = snapshot()
    unchanged = []
    for i in (1, 2):
        out["results"].append(step(i, True))
        after = snapshot()
        same = all(torch.equal(a, b) for a, b in zip(before[0], after[0]))
        for n in before[1]["master"]:
            same &= torch.equal(before[1]["master"][n], after[1]["master"][n])
            for k, v in before[1]["state"][n].items():
                same &= torch.equal(v, after[1]["state"][n][k])
        unchanged.append(same)
        out[f"scale_after_{i}"] = opt.loss_scale
    out["unchanged"] = unchanged
    for i in (3, 4, 5):
        out["results"].append(step(i, False))
    out["scale_history"] = list(opt.scale_history)
    out["final_scale"] = opt.loss_scale
    out["skipped"] = opt.skipped_steps
    out["params"] = [p.detach().float().clone() for p in model.parameters()]
    return out


def test_overflow_on_one_rank_skips_everywhere_with_hysteresis(dp2):
    r0, r1 = dp2[2]
    for r in (r0, r1):
        assert r["zero1"] == 2  # gpc's ZERO1 group was picked up by default
        assert r["buffer"] == [0.5, 0.5, 0.5]  # floating buffers averaged over DATA
        oks = [ok for ok, _ in r["results"]]
        assert oks == [True, False, False, True, True, True]
        assert r["unchanged"] == [True, True]  # params, masters, Adam states bitwise unchanged
        assert r["scale_after_1"] == 2**10  # hysteresis=2: the first overflow does not back off
        assert r["scale_after_2"] == 2**9  # the second does
        assert r["scale_history"] == [2**10, 2**10, 2**10, 2**9, 2**9, 2**9]
        assert r["final_scale"] == 2**10  # grown after growth_interval=3 clean steps
        assert r["skipped"] == 2
    for a, b in zip(r0["params"], r1["params"]):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- DP traffic of one step
def _traffic_worker(rank, world, zero):
    """Bytes each collective of one optimizer step moves, counted at the c10d collectives (the plan's counter)."""
    from tessera.plan.tracker import CollectiveTraffic

    whole = dist.group.WORLD
    singles = [dist.new_group([r]) for r in range(world)]
    model = _make("fp32")
    opt = _make_opt(model, dp_group=whole, zero1_group=whole if zero == 2 else singles[rank], global_group=whole)
    x, y = _batches(1)[0]
    opt.backward((model(x.chunk(world)[rank]) - y.chunk(world)[rank]).pow(2).mean())
    with CollectiveTraffic() as traffic:
        assert opt.step()[0]
    sent = traffic.by_kind()
    grad_bytes = sum(buf.numel() * buf.element_size() for buf in opt.gradients.flat_buffers.values())
    return {k: sent.get(k, 0.0) for k in ("all_reduce", "reduce_scatter", "all_gather")}, grad_bytes


@pytest.mark.skipif(not hasattr(dist, "reduce_scatter_single"), reason="torch without reduce_scatter_single")
def _ring_bytes(kind, nbytes, world):
    """Bytes one rank sends for a ring collective over ``nbytes`` of data."""
    return {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}[kind] * (world - 1) / world * nbytes


@pytest.mark.slow
def test_zero_over_the_dp_group_moves_what_one_ddp_all_reduce_moves():
    """DP=2: with ZeRO over the DP group the gradients are reduce-scattered into the shards, so a step
    sends (reduce-scatter + all-gather) bytes = one DDP all-reduce of the gradients, not 1.5x; without
    ZeRO it is that all-reduce. Small agreement flags (overflow, norm) are a few bytes on top."""
    (zero2, grad_bytes), _ = run_distributed(_traffic_worker, 2, 2)
    (zero1, grad_bytes1), _ = run_distributed(_traffic_worker, 2, 1)
    ddp = _ring_bytes("all_reduce", grad_bytes1, 2)  # the textbook ring closed form, written out here
    flags = 64  # the overflow flag and the norm: one scalar each, over 2 ranks
    assert zero1["reduce_scatter"] == 0 and ddp <= zero1["all_reduce"] <= ddp + flags
    dp_bytes = zero2["reduce_scatter"] + zero2["all_gather"]
    # fp32 parameters: the all-gather moves as many bytes as the reduce-scatter (padded buffers)
    assert dp_bytes == pytest.approx(_ring_bytes("all_reduce", grad_bytes, 2))
    assert zero2["all_reduce"] <= flags


# ---------------------------------------------------------------- DP reduction overlapped with backward
def _overlap_worker(rank, world):
    """DP=2, buckets of a few parameters: the reductions start inside the last backward, and the result
    equals the same step with the reduction after backward, and one process on the whole batch."""
    whole = dist.group.WORLD
    singles = [dist.new_group([r]) for r in range(world)]
    batches = _batches(3)
    out = {}
    for zero in (2, 1):
        for overlap in (True, False):
            model = _make("bf16")
            inner = torch.optim.AdamW(build_param_groups(model, 0.1), lr=0.05, betas=(0.9, 0.95), weight_decay=0.1)
            opt = HybridZeroOptimizer(inner, param_names=unwrap_model(model), dp_group=whole,
                                      zero1_group=whole if zero == 2 else singles[rank], global_group=whole,
                                      zero_cfg={"clip_grad_norm": 0.5, "overlap_sync_grad": overlap,
                                                "reduce_bucket_size": 40})
            hooks_seen = []  # gradients still missing (all buckets) when each bucket's reduction was launched
            red = opt.gradients
            start = red.start
            red.start = lambda b, start=start: (hooks_seen.append(sum(red.missing)), start(b))[1]
            for x, y in batches:
                x, y = x.chunk(world)[rank], y.chunk(world)[rank]
                for i, (xm, ym) in enumerate(zip(x.chunk(2), y.chunk(2))):  # two micro-batches
                    opt.backward((model(xm).float() - ym).pow(2).mean(), overlap_reduction=i == 1)
                launched = len(opt.gradients.launched)
                assert opt.step()[0]
            out[zero, overlap] = {"params": _params(model), "buckets": len(opt.buckets), "launched": launched,
                                  "missing_at_first_launch": hooks_seen[0] if hooks_seen else None}
    return out


def test_dp_reduction_overlaps_backward_and_changes_nothing():
    res = run_distributed(_overlap_worker, 2)
    bf16 = {n for n, p in _make("bf16").model.named_parameters() if p.dtype == torch.bfloat16}
    for r in res:
        for zero in (2, 1):
            on, off = r[zero, True], r[zero, False]
            assert on["buckets"] > 3  # small buckets: several reductions per step
            assert on["launched"] == on["buckets"] and off["launched"] == 0
            # the first reduction started while other buckets still waited for gradients
            assert on["missing_at_first_launch"] > 0
            for n in on["params"]:  # a sum over two ranks is exact whatever the schedule: bitwise equal
                assert torch.equal(on["params"][n], off["params"][n]), n
        for n in r[2, True]["params"]:  # the grad norm's order only (measured <= 1.1e-7)
            ref_p = r[1, True]["params"][n]
            assert rel(r[2, True]["params"][n], ref_p) < _weights_rtol(3, ref_p, n in bf16), n
    # one process on the whole batch (same micro-batch objective): the reference
    model = _make("bf16")
    ref = _make_opt(model)
    for x, y in _batches(3):
        # the DP objective: each rank's two micro-batch means, summed, averaged over the two ranks
        opt_loss = sum((model(x.chunk(2)[r].chunk(2)[i]).float() - y.chunk(2)[r].chunk(2)[i]).pow(2).mean()
                       for r in range(2) for i in range(2)) / 2
        ref.backward(opt_loss)
        assert ref.step()[0]
    # the reference's single backward adds the 4 micro-batches' bf16 gradients in bf16 (n = 4), the DP run in
    # fp32 main gradients; Adam carries that 3 steps (measured <= 2.6e-3; bounds 6e-3 .. 2.5e-2)
    for n, p in _params(model).items():
        assert rel(res[0][2, True]["params"][n], p) < _weights_rtol(3, p, n in bf16, order_rtol(torch.bfloat16, 4)), n
