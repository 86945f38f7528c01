"""The decoder: TP=2/4 against TP=1, packed documents, checkpointing, sizes, FLOPs, the summary tool.

The TP test runs on 4 gloo processes. Every rank builds the TP=1 reference itself (no group) and the
TP model over its group, then compares bitwise initial weights (gathered), logits, loss (the reference
loss is plain F.cross_entropy on the TP=1 logits), every gradient and the weights after 3 SGD steps.
Tolerances are norm-wise relative errors (fp32), from tests/tolerances.py: sharded matmuls sum in a
different order (order_rtol over the forward or forward + backward), and after an SGD step the weights
carry that difference on into the next step's logits and gradients (sgd_rtol).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness.distributed import run_distributed
from harness.peak_rss import run_measured
from tessera import logs
from tessera.config import Config
from tessera.core.context import gpc, launch_from_torch
from tessera.model import attention as attention_module
from tessera.model import build_model, count_parameters, flops_per_token, rotary_cos_sin
from tessera.model.rotary import apply_rotary
from tessera.parallel import ColumnParallelLinear, MetaGroup, RowParallelLinear, vocab_parallel_cross_entropy
from tessera.parallel.attrs import partition_dim
from tessera.parallel.comm import gather_tensor
from tessera.train.builder import build_training_stack
from tests.tolerances import allclose_tols, order_rtol, precision_rtol, sgd_rtol, transformer_depth

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# GQA (8 query heads, 4 KV heads) so that tp=4 still splits KV heads; every size divisible by 4
SMALL = dict(num_layers=2, hidden_size=32, num_attention_heads=8, num_kv_attention_heads=4, vocab_size=64,
             mlp_ratio=2.0, multiple_of=16, dtype="torch.float32", use_flash_attn=False)
# longest fp32 sum: the w2 GEMM (ffn hidden 64) and the vocabulary (64); hidden 32, tokens 32
REDUCE_N = 64
LOGITS_RTOL = order_rtol(torch.float32, REDUCE_N, transformer_depth(SMALL["num_layers"]))  # 3.1e-6
LOSS_RTOL = order_rtol(torch.float32, REDUCE_N, transformer_depth(SMALL["num_layers"]) + 1)  # 3.2e-6
GRAD_RTOL = order_rtol(torch.float32, REDUCE_N, transformer_depth(SMALL["num_layers"], backward=True))  # 4.4e-6
REL_TOL = GRAD_RTOL  # the default of _assert_rel
# head_dim 6 where hidden / heads is 4; the head_dim x heads projections are not square
FAMILY_FEATURES = dict(head_dim=6, qk_norm=True, qkv_bias=True,
                       rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8})


def _model_cfg(**overrides):
    return Config.from_dict({"model": {**SMALL, **overrides}, "data": {"type": "synthetic", "seq_len": 32}}).model


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _assert_rel(a: torch.Tensor, b: torch.Tensor, what: str, tol: float = REL_TOL) -> None:
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    err = _rel_err(a, b)
    assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.2e}"


def _full(t: torch.Tensor, param: torch.Tensor, group) -> torch.Tensor:
    dim = partition_dim(param)
    return t if dim is None else gather_tensor(t.contiguous(), dim, group)


def _batch(seed: int = 0):
    """Two rows of 16 tokens, each row two documents, a few ignored targets."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 16), generator=g)
    target = torch.randint(0, SMALL["vocab_size"], (2, 16), generator=g)
    target[0, 4] = target[1, 15] = -100
    cu = torch.tensor([0, 5, 16, 27, 32], dtype=torch.int32)
    return ids, target, cu


@torch.no_grad()
def _sgd_step(model: torch.nn.Module, lr: float) -> None:
    """Plain SGD written out: torch.optim's constructor imports torch._dynamo (seconds per worker)."""
    for p in model.parameters():
        p -= lr * p.grad
        p.grad = None


def _compare_tp_run(group, overrides: dict) -> None:
    cfg = _model_cfg(**overrides)
    ref = build_model(cfg, tp_group=None, seed=77)
    model = build_model(cfg, tp_group=group, seed=77)
    ref_params = dict(ref.named_parameters())
    params = dict(model.named_parameters())
    assert params.keys() == ref_params.keys()
    for name, p in params.items():
        assert torch.equal(_full(p.detach(), p, group), ref_params[name].detach()), f"init differs: {name}"
    ids, target, cu = _batch()
    parallel_output = cfg.parallel_output
    weights_tol = {name: 0.0 for name in params}  # the weights' bound so far (sgd_rtol per step)
    norms = {name: float(p.detach().norm()) for name, p in ref_params.items()}
    for step in range(3):
        # to first order, a relative change eps_p of a weight matrix, embedding or norm weight changes what
        # passes through it by eps_p (condition number 1); independent, they add in quadrature. Biases start
        # at zero: their relative difference is large while their share of the outputs is small, so they
        # are left out of this sum (their absolute difference is inside the matrices' rounding bound)
        carried = math.sqrt(sum(weights_tol[n] ** 2 for n in weights_tol if not n.endswith(".bias")))
        ref_logits = ref(ids, cu_seqlens=cu)
        ref_loss = F.cross_entropy(ref_logits.view(-1, cfg.vocab_size), target.view(-1), label_smoothing=0.1)
        ref_loss.backward()
        logits = model(ids, cu_seqlens=cu)
        if parallel_output:
            assert logits.shape[-1] == cfg.vocab_size // dist.get_world_size(group)
            loss = vocab_parallel_cross_entropy(logits, target, group, label_smoothing=0.1)
            logits = gather_tensor(logits.detach(), -1, group)
        else:
            assert logits.shape[-1] == cfg.vocab_size
            loss = vocab_parallel_cross_entropy(logits, target, None, label_smoothing=0.1)
        loss.backward()
        _assert_rel(logits.detach(), ref_logits.detach(), f"step {step} logits", LOGITS_RTOL + carried)
        _assert_rel(loss.detach(), ref_loss.detach(), f"step {step} loss", LOSS_RTOL + carried)
        for name, p in params.items():
            assert p.grad is not None and p.grad.abs().sum() > 0, f"no gradient for {name}"
            _assert_rel(_full(p.grad, p, group), ref_params[name].grad, f"step {step} grad {name}", GRAD_RTOL + carried)
        for name, p in ref_params.items():  # measured after 3 steps: <= 1.1e-6 (grads at step 2: 3.5e-6)
            new_norm = float((p.detach() - 0.5 * p.grad).norm())
            weights_tol[name] = sgd_rtol(weights_tol[name], GRAD_RTOL + carried, lr=0.5, weight_norm=norms[name],
                                         grad_norm=float(p.grad.norm()), new_weight_norm=new_norm)
            norms[name] = new_norm
        _sgd_step(model, lr=0.5)
        _sgd_step(ref, lr=0.5)
    for name, p in params.items():
        _assert_rel(_full(p.detach(), p, group), ref_params[name].detach(), f"weights after 3 steps: {name}",
                    weights_tol[name])


def _tp_worker(rank: int, world_size: int) -> None:
    pair = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    whole = dist.new_group([0, 1, 2, 3])
    _compare_tp_run(pair, {})
    _compare_tp_run(whole, {})
    _compare_tp_run(whole, {"parallel_output": False, "checkpoint": True})
    _compare_tp_run(pair, {"tie_word_embeddings": True, "bias": True, "checkpoint": 0.5})
    # the family features (Qwen3's q/k norms and head_dim, Qwen2's q/k/v-only biases, YaRN): the q/k norm weights
    # see only this rank's heads, so their gradients must be summed over TP to match TP=1
    _compare_tp_run(whole, {**FAMILY_FEATURES, "checkpoint": "selective"})
    _compare_tp_run(pair, {**FAMILY_FEATURES, "bias": True, "mlp_bias": False, "checkpoint": True})
    # after a launch the builder passes gpc's TENSOR group, its seed and its TENSOR stream; build_model reads
    # nothing launched itself (the same call without a group is no TP, launched or not)
    launch_from_torch({"model": SMALL, "parallel": {"tensor": {"size": 2}}, "data": {"type": "synthetic"}}, seed=77)
    model = build_training_stack(gpc.config).inner_model
    assert model.tp_size == 2 and model.layers[0].attention.tensor_rng is not None
    assert build_model(gpc.config.model).tp_size == 1
    explicit = build_model(_model_cfg(), tp_group=pair, seed=77)
    for (name, p), q in zip(model.named_parameters(), explicit.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.slow
def test_tensor_parallel_model_matches_tp1():
    run_distributed(_tp_worker, 4)


def _tp4_quick_worker(rank: int, world_size: int) -> None:
    _compare_tp_run(dist.group.WORLD, {})


def test_tensor_parallel_model_at_tp4_matches_tp1_quick():
    """The quick run's TP=4 numerics (``-m "not slow"``): the plain decoder at TP=4 against TP=1; the slow
    test above adds TP=2 groups, tied weights, biases, recomputation and the family features."""
    run_distributed(_tp4_quick_worker, 4)


# ---------------------------------------------------------------------------- packed documents
def test_packed_documents_match_separate_runs_and_never_mix():
    model = build_model(_model_cfg(), seed=5).eval()
    lengths = [5, 8, 11, 9, 15]  # row 0: three documents, row 1: two
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(0, SMALL["vocab_size"], (n,), generator=g) for n in lengths]
    ids = torch.cat(docs).view(2, 24)
    cu = torch.tensor([0, 5, 13, 24, 33, 48], dtype=torch.int32)
    with torch.no_grad():
        packed = model(ids, cu_seqlens=cu).view(48, -1)
        alone = [model(d.unsqueeze(0))[0] for d in docs]
        starts = cu.tolist()
        for i, out in enumerate(alone):  # another order of the same sums (measured: bitwise, or 7e-8)
            _assert_rel(packed[starts[i]:starts[i + 1]], out, f"document {i}", LOGITS_RTOL)
        # explicit restarting positions give the same result as positions derived from cu_seqlens
        pos = torch.cat([torch.arange(n) for n in lengths]).view(2, 24)
        assert torch.equal(model(ids, cu_seqlens=cu, position_ids=pos).view(48, -1), packed)
        # perturb document 1 (middle of row 0): documents 0 and 2 are bitwise unchanged
        changed = ids.clone().view(-1)
        changed[5:13] = (changed[5:13] + 1) % SMALL["vocab_size"]
        out = model(changed.view(2, 24), cu_seqlens=cu).view(48, -1)
        assert torch.equal(out[0:5], packed[0:5]) and torch.equal(out[13:48], packed[13:48])
        assert not torch.allclose(out[5:13], packed[5:13])
        # and without cu_seqlens the later documents do see the earlier ones
        assert not torch.allclose(model(ids).view(48, -1)[13:24], packed[13:24])


@pytest.mark.cuda
@pytest.mark.parametrize("use_flash_attn", [True, False])
def test_cuda_bf16_packed_documents_match_separate_runs(use_flash_attn):
    """flash_attn varlen when installed (else SDPA with the mask) on CUDA; head_dim 16 suits flash_attn."""
    cfg = _model_cfg(hidden_size=64, num_attention_heads=4, num_kv_attention_heads=2, use_flash_attn=use_flash_attn)
    model = build_model(cfg, seed=5, device="cuda").to(torch.bfloat16).eval()
    lengths = [5, 8, 11, 9, 15]
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(0, SMALL["vocab_size"], (n,), generator=g).cuda() for n in lengths]
    cu = torch.tensor([0, 5, 13, 24, 33, 48], dtype=torch.int32)
    with torch.no_grad():
        packed = model(torch.cat(docs).view(2, 24), cu_seqlens=cu).view(48, -1).float()
        for i, d in enumerate(docs):
            alone = model(d.unsqueeze(0))[0].float()
            err = _rel_err(packed[cu[i]:cu[i + 1]], alone)
            # bf16 roundings (n = 1: fp32 accumulation) over the forward, in two orders: 2.5e-2
            tol = order_rtol(torch.bfloat16, 1, transformer_depth(cfg.num_layers))
            assert err < tol, f"document {i}: relative error {err:.2e} > {tol:.2e}"


def test_bad_cu_seqlens_is_a_clear_error():
    model = build_model(_model_cfg(), seed=5)
    ids = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="end at batch"):
        model(ids, cu_seqlens=torch.tensor([0, 4, 15], dtype=torch.int32))
    with pytest.raises(ValueError, match="row boundary"):
        model(ids, cu_seqlens=torch.tensor([0, 6, 16], dtype=torch.int32))


def test_rotary_is_rotate_half_convention():
    """Independent reference: pair (i, i + d/2) is a complex number rotated by pos * base^(-2i/d)."""
    d, base = 8, 10000.0
    x = torch.randn(1, 5, 2, d, dtype=torch.float64)
    pos = torch.tensor([[0, 1, 2, 7, 3]])
    cos, sin = rotary_cos_sin(pos, d, base)
    got = apply_rotary(x, cos, sin)
    theta = pos[..., None, None].double() * base ** (-torch.arange(d // 2, dtype=torch.float64) * 2 / d)
    z = torch.complex(x[..., : d // 2], x[..., d // 2 :]) * torch.polar(torch.ones_like(theta), theta)
    expected = torch.cat([z.real, z.imag], dim=-1)
    # the angles are fp32 (rotary_cos_sin): pos * base^(-2i/d) rounds twice (u of the angle, up to 7 rad
    # here), its cos/sin once more (u of a value <= 1); each output adds two such terms times |x|, and the
    # fp64 multiply-add adds nothing measurable. Bound 1.9e-6 for max |x| ~2; measured 4.6e-8
    angle_err = precision_rtol(torch.float32, 1, 2) * float(theta.max()) + precision_rtol(torch.float32)
    assert torch.allclose(got, expected, rtol=0, atol=math.sqrt(2) * angle_err * float(x.abs().max()))


# ---------------------------------------------------------------------------- checkpointing
class _TensorStream:
    """A second RNG stream entered as a context manager, like gpc.seed(ParallelMode.TENSOR)."""

    def __init__(self, seed: int) -> None:
        self.state = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def __call__(self):
        outer = torch.get_rng_state()
        torch.set_rng_state(self.state)
        try:
            yield
        finally:
            self.state = torch.get_rng_state()
            torch.set_rng_state(outer)


def _grads_with(checkpoint, dropout: bool):
    drop = {"dropout": 0.1, "attn_dropout": 0.2} if dropout else {}
    model = build_model(_model_cfg(checkpoint=checkpoint, **drop), seed=9, tensor_rng=_TensorStream(4))
    ids, target, cu = _batch(1)
    torch.manual_seed(0)
    loss = F.cross_entropy(model(ids, cu_seqlens=cu).view(-1, SMALL["vocab_size"]), target.view(-1))
    loss.backward()
    return model, loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("dropout", [False, True])
def test_activation_checkpointing_gives_identical_gradients(dropout):
    _, loss, grads = _grads_with(False, dropout)
    for checkpoint in (True, 0.5):
        model, loss_c, grads_c = _grads_with(checkpoint, dropout)
        assert model.num_checkpoint_layers == (2 if checkpoint is True else 1)
        assert torch.equal(loss_c, loss)
        for name, g in grads.items():
            # recomputation runs the same kernels on the same inputs; what may change is the order in which
            # autograd adds the (at most 3) gradient contributions of a tensor used more than once, carried
            # through the backward pass (rtol 9.5e-7)
            tol = allclose_tols(order_rtol(torch.float32, 3, transformer_depth(SMALL["num_layers"], backward=True)),
                                scale=g.abs().max().item())
            assert torch.allclose(grads_c[name], g, **tol), name
    if dropout:  # the dropout is real: without it the loss differs
        assert not torch.equal(_grads_with(False, False)[1], loss)


@pytest.mark.parametrize("checkpoint", [False, True, "selective"])
def test_blocks_share_one_forward_context_and_recomputation_sees_it_again(checkpoint, monkeypatch):
    seen = []  # (layer index, context) per attention call, recomputations included
    original = attention_module.Attention.forward

    def spy(self, x, ctx):
        seen.append((self.layer_index, ctx))
        return original(self, x, ctx)

    monkeypatch.setattr(attention_module.Attention, "forward", spy)
    model = build_model(_model_cfg(checkpoint=checkpoint, attn_dropout=0.2), seed=9, tensor_rng=_TensorStream(4))
    ids, _, cu = _batch(1)
    model(ids, cu_seqlens=cu).float().square().mean().backward()
    forward, recomputed = seen[:2], sorted(seen[2:], key=lambda call: call[0])  # backward runs the layers in reverse
    assert [i for i, _ in forward] == [0, 1]
    # built once: every layer gets the same angles and plan (so the packed mask is built once)
    assert forward[0][1].cos is forward[1][1].cos and forward[0][1].plan is forward[1][1].plan
    if checkpoint is False:
        assert forward[0][1] is forward[1][1] and forward[0][1].rng_replay is None and not recomputed
        return
    # each checkpointed region has its own RNG replay, and its recomputation gets the very same context
    assert forward[0][1].rng_replay is not forward[1][1].rng_replay
    assert [i for i, _ in recomputed] == [0, 1]
    assert all(again is first for (_, again), (_, first) in zip(recomputed, forward))


# ---------------------------------------------------------------------------- sizes and errors
@pytest.mark.parametrize("overrides, message", [
    ({"hidden_size": 48, "num_attention_heads": 6, "num_kv_attention_heads": 6},
     "num_attention_heads=6 is not divisible"),
    ({"num_kv_attention_heads": 2}, "num_kv_attention_heads=2 is not divisible"),
    ({"vocab_size": 250}, "vocab_size=250 is not divisible"),
])
def test_non_divisible_model_fails_at_build_naming_sizes(overrides, message):
    with pytest.raises(ValueError, match=message + " by tensor-parallel size 4"):
        build_model(_model_cfg(**overrides), tp_group=MetaGroup(4), device="meta")


def test_module_names_and_tp_tags():
    model = build_model(_model_cfg(), tp_group=MetaGroup(2), device="meta")
    names = dict(model.named_modules())
    for name in ["embedding", "layers.1.attention_norm", "layers.1.attention.wq", "layers.1.attention.wk",
                 "layers.1.attention.wv", "layers.1.attention.wo", "layers.1.ffn_norm", "layers.1.feed_forward.w1",
                 "layers.1.feed_forward.w2", "layers.1.feed_forward.w3", "norm", "output"]:
        assert name in names, name
    assert isinstance(names["output"], ColumnParallelLinear)
    assert isinstance(names["layers.0.attention.wo"], RowParallelLinear)
    dims = {n: partition_dim(p) for n, p in model.named_parameters()}
    assert dims["embedding.weight"] == 0 and dims["output.weight"] == 0 and dims["norm.weight"] is None
    assert dims["layers.0.attention.wo.weight"] == 1 and dims["layers.0.feed_forward.w3.weight"] == 0
    assert model.layers[0].attention.wk.weight.shape == (4 * 4 // 2, 32)  # 4 KV heads of 4 dims over 2 ranks


def test_build_does_not_touch_ambient_rng_and_meta_allocates_nothing():
    state = torch.get_rng_state()
    a = build_model(_model_cfg(), seed=3)
    assert torch.equal(torch.get_rng_state(), state)
    meta = build_model(_model_cfg(), seed=3, device="meta")
    assert all(p.is_meta for p in meta.parameters())
    assert sum(p.numel() for p in meta.parameters()) == sum(p.numel() for p in a.parameters())


def test_attention_backend_logged_once(caplog):
    logs._LOGGED.clear()
    model = build_model(_model_cfg(), seed=1)
    ids, _, cu = _batch()
    with caplog.at_level(logging.INFO, logger="tessera"):
        for _ in range(2):  # the same choices again: nothing more logged
            model(ids)
            model(ids, cu_seqlens=cu)
    records = [r.getMessage() for r in caplog.records if "attention backend" in r.getMessage()]
    # one line per distinct choice (CPU: one kernel for one-document rows, another for packed rows), each saying why
    assert len(records) == 2 and "one document per row" in records[0] and "packed rows" in records[1]
    assert all("flash_attn not used" in r and "use_flash_attn=False" in r for r in records)


# ---------------------------------------------------------------------------- counts and FLOPs
def test_7b_shapes_and_parameter_count_on_meta():
    cfg = Config.from_file(os.path.join(ROOT, "configs", "7B.py"))
    model = build_model(cfg.model, tp_group=MetaGroup(1), device="meta")
    assert model.layers[0].feed_forward.w1.weight.shape == (11008, 4096)  # 4096 * 8/3 rounded up to 256
    assert sum(p.numel() for p in model.parameters()) == count_parameters(cfg.model)
    assert 7.0e9 < count_parameters(cfg.model) < 7.5e9


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": True, "bias": True}])
def test_count_parameters_and_flops_match_the_built_model(overrides):
    cfg = _model_cfg(**overrides)
    model = build_model(cfg, seed=0)
    assert count_parameters(cfg) == sum(p.numel() for p in model.parameters())
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear)))
    seq = 32
    attention = 2 * 2 * seq * cfg.hidden_size * cfg.num_layers  # QK^T and AV, per token, forward
    assert flops_per_token(cfg, seq) == pytest.approx(3 * (2 * linear + attention))


def test_model_summary_tool_7b_allocates_nothing():
    """tools/model_summary.py builds the 7B on the meta device: in a fresh process of its own (harness.peak_rss),
    after importing what the tool imports, running it raises that process's peak RSS by next to nothing, where
    one TP rank's fp32 shard alone would be ~3.4 GiB (and the TP=1 count build ~27 GiB). How long it takes is
    not asserted (a loaded machine says nothing about the tool): the timeout only catches a hang."""
    hang_guard_s = 300
    run = run_measured(os.path.join(ROOT, "tools", "model_summary.py"), [os.path.join(ROOT, "configs", "7B.py"), "--tp",
                       "8"], preload=("torch", "tessera.config", "tessera.model", "tessera.parallel"),
                       timeout=hang_guard_s)
    assert run.returncode == 0, run.stderr
    cfg = Config.from_file(os.path.join(ROOT, "configs", "7B.py"))
    assert f"{count_parameters(cfg.model):,}" in run.stdout
    assert "layers.0.feed_forward.w1.weight" in run.stdout and "[1376, 4096]" in run.stdout
    shard_bytes = 4 * count_parameters(cfg.model) / 8
    assert run.growth_bytes < 64 * 2**20 < shard_bytes / 50, \
        f"the tool raised its process's peak RSS by {run.growth_bytes / 2**20:.0f} MiB"
    assert math.isfinite(flops_per_token(cfg.model, 2048))


def test_1b_config_is_about_one_billion():
    cfg = Config.from_file(os.path.join(ROOT, "configs", "1B.py"))
    model = build_model(cfg.model, tp_group=MetaGroup(8), device="meta")  # splits over tp=8 too
    assert sum(p.numel() for p in model.parameters()) < count_parameters(cfg.model)
    assert 0.9e9 < count_parameters(cfg.model) < 1.2e9


def test_matches_hugging_face_llama_without_permutation():
    """Independent reference: the same weights, copied name for name (no q/k permutation), in HF Llama."""
    transformers = pytest.importorskip("transformers")
    cfg = _model_cfg()
    model = build_model(cfg, seed=3).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # non-trivial norm weights
                p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(name)))
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=model.args.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_kv_attention_heads, rms_norm_eps=cfg.layer_norm_epsilon,
        rope_theta=cfg.rope_base, max_position_embeddings=64, tie_word_embeddings=False,
        attn_implementation="eager",
    )
    hf = transformers.LlamaForCausalLM(hf_cfg).double().eval()
    renames = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
               "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
               "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
               "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm",
               "ffn_norm": "post_attention_layernorm"}
    state = {}
    for name, p in model.named_parameters():
        module = name.rsplit(".", 1)[0]
        if module.startswith("layers."):
            _, i, rest = module.split(".", 2)
            key = f"model.layers.{i}.{renames[rest]}"
        else:
            key = {"embedding": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}[module]
        state[key + ".weight"] = p.detach()
    hf.load_state_dict(state, strict=True)
    ids, _, cu = _batch()
    pos = torch.cat([torch.arange(5), torch.arange(11), torch.arange(11), torch.arange(5)]).view(2, 16)
    with torch.no_grad():
        # HF's RMSNorm computes in fp32 even for fp64 models: agreement to ~1e-7, not 1e-15. One computation
        # (HF's) against an exact one: the 2 x layers + 1 norms each sum hidden_size fp32 squares
        tol = precision_rtol(torch.float32, cfg.hidden_size, 2 * cfg.num_layers + 1)  # 7.5e-7
        _assert_rel(model(ids), hf(ids).logits, "logits vs HF Llama", tol)
        _assert_rel(model(ids, position_ids=pos), hf(ids, position_ids=pos).logits, "logits vs HF, positions", tol)
