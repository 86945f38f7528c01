"""Block formats as GEMM routes (``mxfp8-emulated``, ``nvfp4-emulated``): each GEMM blocks its operands along its
own reduction dim, TP=2 computes TP=1, a shard the block does not divide is refused when the model is built, and
per-module recipes (``model.fp8.rules``). The quantizers themselves are checked bit for bit against torchao in
tests/test_block_formats.py; here the reference is those quantizers applied along the dims written out below."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from harness.distributed import run_distributed
from tessera.parallel import block_formats as bf
from tessera.parallel.gemm import fp8_linear
from tests.tolerances import order_rtol, precision_rtol

BF16 = torch.bfloat16
RECIPES = ("mxfp8", "nvfp4")


def _data(seed: int = 0, t: int = 64, i: int = 64, o: int = 64):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, i, generator=g) * torch.linspace(0.1, 3, i)).to(BF16)
    w = (torch.randn(o, i, generator=g) * 0.2).to(BF16)
    b = torch.randn(o, generator=g).to(BF16)
    dy = (torch.randn(t, o, generator=g) * 1e-3).to(BF16)
    return x, w, b, dy


def _padded_q(t: torch.Tensor, recipe: str, dim: int) -> torch.Tensor:
    """``fake_quantize`` along ``dim`` of ``t`` zero-padded there to whole blocks, cut back."""
    block = bf.BLOCK_RECIPES[recipe][1]
    n = t.shape[dim]
    pad = [0, 0, 0, -n % block] if dim == 0 else [0, -n % block]
    return bf.fake_quantize(torch.nn.functional.pad(t.float(), pad), recipe, dim).narrow(dim, 0, n)


@pytest.mark.parametrize("tokens", [64, 40], ids=["whole-blocks", "ragged-tokens"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_each_gemm_blocks_along_its_reduction_dim(recipe, tokens):
    """forward x W^T: x and W along the input features; dx = g W: g and W along the output features;
    dW = g^T x: g and x along the tokens (zero-padded to whole blocks: a zero changes no block's scale)."""
    x, w, b, dy = _data(t=tokens)
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    y = fp8_linear(xr, wr, br, recipe)
    y.backward(dy)
    q = bf.fake_quantize
    ref_y = q(x, recipe, 1) @ q(w, recipe, 1).t() + b.float()
    ref_dx = q(dy, recipe, 1) @ q(w, recipe, 0)
    ref_dw = _padded_q(dy, recipe, 0).t() @ _padded_q(x, recipe, 0)
    assert torch.equal(y, ref_y.to(BF16))
    assert torch.equal(xr.grad, ref_dx.to(BF16))
    assert torch.equal(wr.grad, ref_dw.to(BF16))
    assert torch.equal(br.grad, dy.float().sum(0).to(BF16))
    # the blocks' direction is visible: W blocked along its output rows gives another forward
    assert not torch.equal(y, (q(x, recipe, 1) @ q(w, recipe, 0).t() + b.float()).to(BF16))
    # and the format's error is there, within its bound: each operand rounded once with the element format's
    # unit roundoff (E4M3 2^-4; E2M1 2^-2 at most), the output once to bf16
    exact = torch.nn.functional.linear(x.float(), w.float(), b.float())
    u = 2.0**-4 if recipe == "mxfp8" else 2.0**-2
    bound = 2**0.5 * u + precision_rtol(BF16)
    err = float((y.float() - exact).norm() / exact.norm())
    assert 1e-3 < err < bound, err


def _tp_worker(rank: int, world: int) -> dict:
    x, w, b, dy = _data(seed=1)
    group = dist.group.WORLD
    out = {}
    for recipe in RECIPES:
        # column-parallel: W rows split, x replicated, the output and its gradient split along features
        wc = w.chunk(world, 0)[rank].clone().requires_grad_()
        xc = x.clone().requires_grad_()
        y = fp8_linear(xc, wc, None, recipe, group=group, w_split_out=True)
        y.backward(dy.chunk(world, 1)[rank])
        gx = xc.grad.float()
        dist.all_reduce(gx, group=group)
        # row-parallel: W columns and x features split; partial outputs summed over the group
        wr = w.chunk(world, 1)[rank].clone().requires_grad_()
        xr = x.chunk(world, 1)[rank].clone().requires_grad_()
        yp = fp8_linear(xr, wr, None, recipe, group=group, x_split_in=True, w_split_in=True)
        yp.backward(dy)
        ys = yp.detach().float()
        dist.all_reduce(ys, group=group)
        out[recipe] = {"col": (y.detach(), gx, wc.grad), "row": (ys.to(BF16), xr.grad, wr.grad)}
    return out


@pytest.fixture(scope="module")
def tp2_runs():
    return run_distributed(_tp_worker, 2)


@pytest.mark.parametrize("recipe", RECIPES)
def test_block_routes_at_tp2_equal_tp1(recipe, tp2_runs):
    """Blocks never straddle a shard and NVFP4's per-tensor scale is agreed over TP, so every rank quantizes its
    shard as TP=1 quantizes that part: slices are bitwise TP=1's; sums of two bf16 partials (the column input
    grad, the row output) differ by ``order_rtol(bf16, 2)`` as in tests/test_fp8.py."""
    x, w, b, dy = _data(seed=1)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_linear(xr, wr, None, recipe)
    y.backward(dy)
    res = [r[recipe] for r in tp2_runs]
    assert torch.equal(torch.cat([r["col"][0] for r in res], 1), y)
    assert torch.equal(torch.cat([r["col"][2] for r in res], 0), wr.grad)
    assert torch.equal(torch.cat([r["row"][1] for r in res], 1), xr.grad)
    assert torch.equal(torch.cat([r["row"][2] for r in res], 1), wr.grad)
    tol = order_rtol(BF16, 2)

    def rel(a, ref):
        return float((a.float() - ref.float()).norm() / ref.float().norm())

    assert rel(res[0]["col"][1], xr.grad) < tol and rel(res[0]["row"][0], y) < tol


def test_nvfp4_shards_share_the_whole_tensors_scale():
    """Without the agreed amax a shard would scale its blocks by its own amax: the TP=2 result would differ."""
    x, w, _, _ = _data(seed=1)
    halves = [bf.fake_quantize(h, "nvfp4", 1) for h in w.chunk(2, 0)]
    whole = bf.fake_quantize(w, "nvfp4", 1)
    assert not torch.equal(torch.cat(halves, 0), whole)
    agreed = [bf.fake_quantize(h, "nvfp4", 1, amax=w.float().abs().amax()) for h in w.chunk(2, 0)]
    assert torch.equal(torch.cat(agreed, 0), whole)


# ------------------------------------------------------------------ in the model: build-time checks and rules
def _amp(overrides: list[str]):
    from tessera.config import Config
    from tessera.core.naive_amp import naive_amp_for, unwrap_model
    from tessera.model import build_model
    from tessera.precision.plan import PrecisionPlan
    from tests.test_train import TINY

    cfg = Config.from_file(TINY, ["model.dtype='torch.bfloat16'", *overrides])
    amp = naive_amp_for(build_model(cfg.model, tp_group=None, seed=1), PrecisionPlan.from_config(cfg), sync_buffer=False)
    return {n: m.fp8_recipe for n, m in unwrap_model(amp).named_modules() if hasattr(m, "fp8_recipe")}


def test_a_shard_the_block_does_not_divide_is_refused_when_the_model_is_built():
    from tessera.config import ConfigError

    # one KV head of 16 features: wk/wv give 16 outputs, not a multiple of MXFP8's 32-element block
    with pytest.raises(ConfigError, match=r"model.low_precision recipe 'mxfp8' on linear 'layers.0.attention.wk': its "
                                          r"out_features per rank, 16, is not a multiple of the 32-element"):
        _amp(["model.num_kv_attention_heads=1", 'model.fp8={"enabled": True, "recipe": "mxfp8"}'])
    # NVFP4's 16-element block divides it; a rule keeping the attention high lets MXFP8 run on the rest
    assert _amp(["model.num_kv_attention_heads=1", 'model.fp8={"enabled": True, "recipe": "nvfp4"}'])[
        "layers.0.attention.wk"] == "nvfp4"
    got = _amp(["model.num_kv_attention_heads=1",
                'model.fp8={"enabled": True, "recipe": "mxfp8", "rules": [["*.attention.w[kv]", "bf16"]]}'])
    assert got["layers.0.attention.wk"] is None and got["layers.0.attention.wq"] == "mxfp8"


def test_rules_give_per_module_recipes_first_match_wins_after_exclude():
    from tessera.core.naive_amp import fp8_recipe_of

    rules = [("layers.0.*", "bf16"), ("*.attention.*", "mxfp8"), ("*.feed_forward.*", "nvfp4"), ("*", "rowwise")]
    got = _amp(['model.fp8={"enabled": True, "recipe": "tensorwise", "exclude": ["output", "*.w2"], '
                f'"rules": {[list(r) for r in rules]}}}'])
    assert {n: r for n, r in got.items() if r} == {
        "layers.1.attention.wq": "mxfp8", "layers.1.attention.wk": "mxfp8", "layers.1.attention.wv": "mxfp8",
        "layers.1.attention.wo": "mxfp8", "layers.1.feed_forward.w1": "nvfp4", "layers.1.feed_forward.w3": "nvfp4"}
    assert fp8_recipe_of("output", "tensorwise", ["output"], [("*", "nvfp4")]) is None  # exclude first
    assert fp8_recipe_of("layers.3.attention.wq", "rowwise", [], [("*.wq", "none"), ("*", "nvfp4")]) is None
    assert fp8_recipe_of("layers.3.attention.wq", "rowwise", [], [("*.w1", "nvfp4")]) == "rowwise"


def test_bad_rules_and_backends_are_config_errors():
    from tessera.config import ConfigError

    with pytest.raises(ConfigError, match=r"model.low_precision.rules.*recipe must be one of"):
        _amp(['model.fp8={"enabled": True, "rules": [["*", "fp4"]]}'])
    with pytest.raises(ConfigError, match=r"model.low_precision.rules.*\(pattern, recipe\) pairs"):
        _amp(['model.fp8={"enabled": True, "rules": ["*"]}'])
    with pytest.raises(ConfigError, match=r"model.low_precision.backend='scaled_mm' runs the fp8 recipes"):
        _amp(['model.fp8={"enabled": True, "recipe": "nvfp4", "backend": "scaled_mm"}'])


def test_train_py_reports_the_refused_shard_in_one_error_line(tmp_path):
    """configs/tiny.py at TP=2 gives wk/wv 16 output features per rank: MXFP8 is refused before training."""
    from tests.test_train import train

    proc, _ = train(tmp_path, "mx", ["model.dtype=bf16", 'model.fp8={"enabled": True, "recipe": "mxfp8"}',
                                     "parallel.tensor.size=2"], nproc=2, expect_ok=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    lines = [line for line in out.splitlines() if "error: model.low_precision recipe 'mxfp8' on linear" in line]
    assert lines and "'layers.0.attention.wk'" in lines[0] and "16 (32 over tensor-parallel size 2)" in lines[0]
    assert "raise ConfigError" not in out  # reported, not a traceback


@pytest.mark.slow
@pytest.mark.parametrize("fp8", [
    '{"enabled": True, "recipe": "mxfp8"}',
    '{"enabled": True, "recipe": "nvfp4"}',
    '{"enabled": True, "recipe": "tensorwise", "rules": [["layers.0.*", "bf16"], ["*.attention.*", "mxfp8"], '
    '["*.feed_forward.*", "nvfp4"]]}'], ids=["mxfp8", "nvfp4", "rules"])
def test_block_recipes_train_configs_tiny(tmp_path, fp8):
    """The acceptance: configs/tiny.py in bf16 trains in each block recipe (exit 0) and its loss falls; the
    precision telemetry reports the block measures of the block-format linears (and only theirs) in
    metrics.jsonl, and tools/precision_telemetry.py summarises them."""
    from tests.test_train import losses, records, train

    _, log_dir = train(tmp_path, "blocks", ["model.dtype=bf16", f"model.fp8={fp8}", "metrics.precision_every=5"],
                       nproc=1)
    got = [loss for _, loss in sorted(losses(log_dir).items())]
    assert len(got) == 10 and all(map(torch.isfinite, torch.tensor(got)))
    assert sum(got[-3:]) / 3 < got[0], got
    measures = records(log_dir, "precision")[-1]["measures"]
    blocks = set(measures["block_flushed"])
    assert set(measures["block_saturated"]) == set(measures["block_underflow"]) == blocks
    if "rules" in fp8:
        assert blocks == {f"layers.1.{m}" for m in ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                                                     "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")}
        assert "fp8_scale" not in measures  # the rules leave no tensorwise linear
    else:
        assert len(blocks) == 14 and "output" not in blocks
    assert all(0 <= v <= 1 for name in ("block_flushed", "block_saturated", "block_underflow")
               for v in measures[name].values())
    from tests.test_precision_telemetry import _tool

    assert _tool().main([log_dir, "--measure", "block_flushed", "--no-plot"]) == 0
