"""Sequence parallelism (``parallel.tensor.mode="msp"``) against mtp, and selective recomputation.

The reference for msp is mtp on the same TP group (itself checked against TP=1 in test_model.py): the
two build bitwise the same parameters, and must give the same logits, loss and every gradient up to
the rounding of two summation orders (fp32: the norm-weight gradients are summed from sequence chunks
in another order, reduce-scatter replaces all-reduce; tolerances from tests/tolerances.py, stated
below), then the same weights after 3 steps of tessera's optimizer (AdamW in HybridZeroOptimizer,
clipping on; adam_eps=1e-6: Adam's first steps move a weight by lr * g / (|g| + eps), so a gradient
element near eps turns the rounding difference of two summation orders into a full-size weight
difference -- the optimizer's conditioning, not a difference between the modes; ``adam_rtol`` bounds it).
Packed documents (cu_seqlens), grouped KV heads, biases, residual dropout (bitwise the same masks),
tied embeddings, gathered logits, both checkpointing kinds and bf16 with fp32 norms and head are covered
at TP=2; TP=4 runs the packed GQA case. Selective and
full checkpointing are checked against no checkpointing in one process, and so is what selective
recomputation runs again (no GEMM). The closed-form activation counts are checked against live tensor
bytes measured during forward+backward (``python -m benchmarks activations``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from harness.distributed import run_distributed
from tessera.config import Config, ConfigError
from tessera.memory.activations import activation_bytes
from tessera.model import build_model
from tessera.model.mlp import ffn_hidden_size
from tessera.parallel import vocab_parallel_cross_entropy
from tessera.parallel.attrs import is_tensor_parallel, partition_dim
from tessera.parallel.comm import gather_tensor
from tests.tolerances import adam_rtol, adam_window_gain, allclose_tols, order_rtol, transformer_depth

SMALL = dict(num_layers=2, hidden_size=32, num_attention_heads=8, num_kv_attention_heads=4, vocab_size=64,
             mlp_ratio=2.0, multiple_of=16, dtype="torch.float32", use_flash_attn=False)
SEQ = 16
# Tolerances (norm-wise relative, see tests/tolerances.py): msp and mtp sum the same products in other
# orders. Longest fp32 reduction: the w2 GEMM (ffn hidden 64) and the vocabulary's log-sum-exp (64); the
# hidden size (32) and the tokens a weight gradient sums (2 x 16) are shorter.
REDUCE_N = max(SMALL["hidden_size"], ffn_hidden_size(SMALL["hidden_size"], SMALL["mlp_ratio"], SMALL["multiple_of"]),
               SMALL["vocab_size"], 2 * SEQ)
LOGITS_RTOL = order_rtol(torch.float32, REDUCE_N, transformer_depth(SMALL["num_layers"]))  # 3.0e-6
LOSS_RTOL = order_rtol(torch.float32, REDUCE_N, transformer_depth(SMALL["num_layers"]) + 1)  # + the mean over tokens
GRAD_RTOL = order_rtol(torch.float32, REDUCE_N, transformer_depth(SMALL["num_layers"], backward=True))  # 4.4e-6
REL_TOL = GRAD_RTOL  # the default of _assert_rel: the loosest of the three
# Qwen3's q/k norms and its own head_dim (6, where hidden / heads is 4), Qwen2's q/k/v-only biases, YaRN
FAMILY_FEATURES = dict(head_dim=6, qk_norm=True, qkv_bias=True,
                       rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8})


def _cfg(tp: int = 1, mode: str = "mtp", **model):
    return Config.from_dict({"model": {**SMALL, **model}, "parallel": {"tensor": {"size": tp, "mode": mode}},
                             "data": {"type": "synthetic", "seq_len": SEQ}, "adam": {"lr": 1e-2, "adam_eps": 1e-6},
                             "lr_scheduler": {"warmup_ratio": 0.0, "eta_min": 1e-2},  # constant: never stepped
                             "hybrid_zero_optimizer": {"clip_grad_norm": 0.5}})


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _rms(t: torch.Tensor) -> float:
    return (t.double().norm() / t.numel() ** 0.5).item()


def _assert_rel(a: torch.Tensor, b: torch.Tensor, what: str, tol: float = REL_TOL) -> None:
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    err = _rel(a, b)
    assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.2e}"


def _batch(seed: int = 0):
    """Two rows of 16 tokens, each two documents (cu_seqlens over the flattened rows), an ignored target."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, SMALL["vocab_size"], (2, SEQ), generator=g)
    target = torch.randint(0, SMALL["vocab_size"], (2, SEQ), generator=g)
    target[0, 3] = -100
    return ids, target, torch.tensor([0, 5, 16, 27, 32], dtype=torch.int32)


def _loss(logits: torch.Tensor, target: torch.Tensor, group, sharded: bool) -> torch.Tensor:
    return vocab_parallel_cross_entropy(logits, target, group if sharded else None, label_smoothing=0.1)


def _forward_backward(model, group, overrides: dict, seed: int = 0):
    ids, target, cu = _batch(seed)
    torch.manual_seed(11)  # the ambient stream: residual dropout masks
    logits = model(ids, cu_seqlens=cu)
    loss = _loss(logits, target, group, overrides.get("parallel_output", True))
    loss.backward()
    return logits.detach(), loss.detach()


def _compare_modes(group, singles, overrides: dict, optimizer_steps: int = 3) -> None:
    """msp against mtp on ``group``: init, logits, loss, grads; then weights after optimizer steps."""
    from tessera.core.job import Job, JobGroups
    from tessera.train.builder import build_training_stack

    tp = dist.get_world_size(group)
    cfg = {mode: _cfg(tp, mode, **overrides) for mode in ("mtp", "msp")}
    models = {mode: build_model(cfg[mode].model, tp_group=group, seed=77, tensor_mode=mode) for mode in cfg}
    ref, sp = models["mtp"], models["msp"]
    assert sp.sequence_parallel_forward() and not ref.sequence_parallel_forward()
    for (name, p), q in zip(ref.named_parameters(), sp.parameters()):
        assert torch.equal(p, q), f"init differs: {name}"  # same shards: bitwise, no gather needed
    logits_ref, loss_ref = _forward_backward(ref, group, overrides)
    logits, loss = _forward_backward(sp, group, overrides)
    _assert_rel(logits, logits_ref, "logits", LOGITS_RTOL)
    _assert_rel(loss, loss_ref, "loss", LOSS_RTOL)
    for (name, p), q in zip(ref.named_parameters(), sp.parameters()):
        assert q.grad is not None and p.grad.abs().sum() > 0, f"no gradient for {name}"
        _assert_rel(q.grad, p.grad, f"grad {name}")
    # validation-style forward (no autograd) runs the mtp dataflow: the same logits, any length
    with torch.no_grad():
        ids, _, cu = _batch(1)
        _assert_rel(sp.eval()(ids, cu_seqlens=cu), ref.eval()(ids, cu_seqlens=cu), "no-grad logits", LOGITS_RTOL)
        sp(ids[:, :7])  # 7 tokens do not split over tp: fine without autograd
        sp.train(), ref.train()
    if tp > 1:
        with pytest.raises(ValueError, match="sequence length 7 is not divisible"):
            sp(ids[:, :7])
    if not optimizer_steps:
        return
    rank = dist.get_rank()
    groups = JobGroups(tp=group, dp=singles[rank], zero1=singles[rank], world=dist.group.WORLD)
    for mode in models:  # the same seed: the same initial weights as the models above
        stack = build_training_stack(cfg[mode], Job.of(cfg[mode], groups, seed=77), sync_buffer=False)
        models[mode], amp, opt = stack.inner_model, stack.model, stack.optimizer
        for step in range(optimizer_steps):
            ids, target, cu = _batch(10 + step)
            torch.manual_seed(step)
            opt.backward(_loss(amp(ids, cu_seqlens=cu), target, group, overrides.get("parallel_output", True)))
            assert opt.step()[0]
    adam = cfg["mtp"].adam
    clip = cfg["mtp"].hybrid_zero_optimizer.clip_grad_norm
    for (name, p), q in zip(models["mtp"].named_parameters(), models["msp"].parameters()):
        # the gradients differ by GRAD_RTOL at every step; Adam's eps window amplifies that (adam_window_gain)
        # for gradients of RMS at most clip / sqrt(numel) (clipping); against this shard's weight RMS: ~1e-3 for
        # the 0.02-std matrices, ~4e-5 for the norm weights (RMS 1); measured over 20 seeds and CPU
        # capabilities: 1e-6 .. 1.2e-4 (one gradient element within eps of zero decides it)
        tol = adam_rtol(GRAD_RTOL, lrs=[adam.lr] * optimizer_steps, weight_rms=_rms(p.detach()),
                        gain=adam_window_gain(clip / p.numel() ** 0.5, adam.adam_eps))
        _assert_rel(q.detach(), p.detach(), f"after {optimizer_steps} optimizer steps: {name}", tol)


def _bf16_smoke(group, features: dict | None = None) -> None:
    """bf16 with fp32 norms and head (NaiveAMPModel): msp close to mtp, norm weights fp32 and in sync."""
    from tessera.core.naive_amp import naive_amp_for
    from tessera.precision.plan import PrecisionPlan

    out = {}
    for mode in ("mtp", "msp"):
        cfg = _cfg(dist.get_world_size(group), mode, dtype="torch.bfloat16", fp32_modules=["*norm*", "output"],
                   **(features or {}))
        model = naive_amp_for(build_model(cfg.model, tp_group=group, seed=5, tensor_mode=mode),
                              PrecisionPlan.from_config(cfg), sync_buffer=False)
        ids, target, cu = _batch(2)
        logits = model(ids, cu_seqlens=cu)
        loss = _loss(logits, target, group, True)
        loss.backward()
        out[mode] = (logits.detach(), loss.detach(), {n: p.grad.float() for n, p in model.model.named_parameters()})
    # bf16 roundings in two orders: the GEMMs accumulate in fp32 and round their outputs once (n = 1),
    # the TP all-reduce / reduce-scatter sums tp bf16 partials (n = tp), on every layer, forward and back
    tp, layers = dist.get_world_size(group), SMALL["num_layers"]
    _assert_rel(out["msp"][0], out["mtp"][0], "bf16 logits",
                order_rtol(torch.bfloat16, tp, transformer_depth(layers)))  # tp=2: 3.6e-2
    _assert_rel(out["msp"][1], out["mtp"][1], "bf16 loss",
                order_rtol(torch.bfloat16, tp, transformer_depth(layers) + 1))  # 3.7e-2
    for name, g in out["mtp"][2].items():
        _assert_rel(out["msp"][2][name], g, f"bf16 grad {name}",
                    order_rtol(torch.bfloat16, tp, transformer_depth(layers, backward=True)))  # 5.1e-2
    norms = ["layers.0.ffn_norm.weight"] + (["layers.0.attention.q_norm.weight"] if (features or {}).get("qk_norm") else [])
    for name in norms:  # fp32 (marked), and summed over TP: every rank holds the same gradient
        norm_grad = out["msp"][2][name]
        assert norm_grad.dtype == torch.float32
        peer = gather_tensor(norm_grad.unsqueeze(0), 0, group)
        assert all(torch.equal(peer[0], row) for row in peer), f"norm-weight gradients differ over TP: {name}"


def _tp2_worker(rank: int, world: int) -> None:
    group = dist.group.WORLD
    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    _compare_modes(group, singles, {"dropout": 0.1})
    # biases: gradients only (Adam turns the near-zero k-bias gradient's rounding into full-size steps)
    _compare_modes(group, singles, {"bias": True, "tie_word_embeddings": True, "parallel_output": False,
                                    "checkpoint": True}, optimizer_steps=0)
    _compare_modes(group, singles, {"checkpoint": "selective", "bias": True, "dropout": 0.1}, optimizer_steps=0)
    _compare_modes(group, singles, {**FAMILY_FEATURES, "checkpoint": "selective"}, optimizer_steps=0)
    _bf16_smoke(group)
    _bf16_smoke(group, FAMILY_FEATURES)
    # a checkpoint is mode-independent: the same names, shapes, TP tags and values in both modes
    a = build_model(_cfg(2).model, tp_group=group, seed=3, tensor_mode="mtp").state_dict(keep_vars=True)
    b = build_model(_cfg(2).model, tp_group=group, seed=3, tensor_mode="msp").state_dict(keep_vars=True)
    assert a.keys() == b.keys()
    for name, p in a.items():
        q = b[name]
        assert torch.equal(p, q) and (is_tensor_parallel(p), partition_dim(p)) == (is_tensor_parallel(q), partition_dim(q))


def _tp4_worker(rank: int, world: int) -> None:
    singles = [dist.new_group([r]) for r in range(world)]
    _compare_modes(dist.group.WORLD, singles, {}, optimizer_steps=3)


def test_msp_matches_mtp_tp2():
    run_distributed(_tp2_worker, 2)


@pytest.mark.slow
def test_msp_matches_mtp_tp4():
    run_distributed(_tp4_worker, 4)


# ---------------------------------------------------------------------------- selective recomputation
class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] = self.counts.get(func.overloadpacket.__name__, 0) + 1
        return func(*args, **(kwargs or {}))


def _grads(checkpoint, **model):
    m = build_model(_cfg(checkpoint=checkpoint, **model).model, seed=9)
    ids, target, cu = _batch(3)
    torch.manual_seed(0)
    loss = F.cross_entropy(m(ids, cu_seqlens=cu).view(-1, SMALL["vocab_size"]), target.view(-1))
    with _CountOps() as ops:
        loss.backward()
    return loss.detach(), {n: p.grad for n, p in m.named_parameters()}, ops.counts


@pytest.mark.parametrize("model", [{}, {"bias": True, "dropout": 0.1}])
def test_selective_and_full_checkpointing_give_the_gradients_of_none(model):
    loss, grads, ops = _grads(False, **model)
    for checkpoint in ("selective", True):
        loss_c, grads_c, ops_c = _grads(checkpoint, **model)
        assert torch.equal(loss_c, loss)
        for name, g in grads.items():
            # recomputation runs the same kernels on the same inputs; what may change is the order in which
            # autograd adds the (at most 3) gradient contributions of a tensor used more than once, and the
            # rest of the backward pass carries that on (measured: bitwise equal on avx2, avx512, AMX)
            tol = allclose_tols(order_rtol(torch.float32, 3, transformer_depth(SMALL["num_layers"], backward=True)),
                                scale=g.abs().max().item())  # rtol 9.5e-7
            assert torch.allclose(grads_c[name], g, **tol), (checkpoint, name)
        recomputed_gemms = sum(ops_c.get(k, 0) - ops.get(k, 0) for k in ("mm", "addmm"))
        if checkpoint == "selective" and not model.get("dropout"):
            # no GEMM again: q/k/v/gate/up are kept; wo/w2 are never reached (their inputs end the recompute)
            # and the attention core runs again: one CPU flash forward per flash backward (2 layers x 2 buckets of
            # documents by length here: the packed rows go through the per-document kernel)
            flash = ops_c.get("_scaled_dot_product_flash_attention_for_cpu", 0)
            assert recomputed_gemms == 0 and flash == ops_c["_scaled_dot_product_flash_attention_for_cpu_backward"] == 4
        if checkpoint is True:
            assert recomputed_gemms > 0


# ---------------------------------------------------------------------------- config
def test_config_accepts_msp_and_selective_and_checks_seq_len():
    cfg = _cfg(2, "msp", checkpoint="selective")
    assert cfg.parallel.tensor.mode == "msp" and cfg.model.checkpoint == "selective"
    with pytest.raises(ConfigError) as e:
        Config.from_dict({"model": SMALL, "parallel": {"tensor": {"size": 4, "mode": "msp"}},
                          "data": {"type": "synthetic", "seq_len": 18}})
    assert "data.seq_len=18" in str(e.value) and "parallel.tensor.size=4" in str(e.value)
    Config.from_dict({"model": SMALL, "parallel": {"tensor": {"size": 4, "mode": "mtp"}},
                      "data": {"type": "synthetic", "seq_len": 18}})  # mtp does not split the sequence
    with pytest.raises(ConfigError, match="model.checkpoint"):
        _cfg(checkpoint="everything")
    with pytest.raises(ValueError, match="tensor_mode='sp'"):
        build_model(_cfg().model, tensor_mode="sp")


# ---------------------------------------------------------------------------- activation memory
def _measure_worker(rank: int, world: int, cases):
    from benchmarks.activations import case as build

    return [{"peak_bytes": build(dist.group.WORLD, **case)[0]} for case in cases]


def test_measured_activation_peak_matches_closed_form():
    model = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, mlp_ratio=2.0, multiple_of=16)
    cases = [dict(model=model, micro_bsz=2, seq_len=64, mode=mode, checkpoint=ck)
             for mode in ("mtp", "msp") for ck in (False, "selective", True)]
    cases.append(dict(model={**model, **FAMILY_FEATURES, "head_dim": 24}, micro_bsz=2, seq_len=64, mode="mtp",
                      checkpoint=False))  # q/k norms keep their inputs and statistics
    results = run_distributed(_measure_worker, 2, cases)[0]
    for case, r in zip(cases, results):
        closed = activation_bytes(case["model"], case["micro_bsz"], case["seq_len"], 2, case["mode"],
                                  case["checkpoint"], torch.float32)
        assert abs(r["peak_bytes"] - closed["peak"]) <= 0.10 * closed["peak"], (case, r, closed)
    features, measured = cases[-1], results[-1]["peak_bytes"]  # the q/k norms' share is ~12%: checked to 1%
    closed = activation_bytes(features["model"], 2, 64, 2, "mtp", False, torch.float32)["peak"]
    assert abs(measured - closed) <= 0.01 * closed, (measured, closed)
    by = {(c["mode"], c["checkpoint"]): r["peak_bytes"] for c, r in zip(cases[:-1], results[:-1])}
    assert by["msp", False] < by["mtp", False] and by["msp", "selective"] < by["mtp", "selective"]
