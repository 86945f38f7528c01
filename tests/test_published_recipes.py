"""The published low-precision recipes on top of the bare formats (issue 60): MXFP8 with round-up scales, fp8 with
the weight gradient in high precision, DeepSeek-V3's blockwise fp8, and NVFP4's switches (2D weight blocks, the
Hadamard-transformed weight gradient, stochastic rounding of gradients, blocks kept in bf16, presets). Each runs
through the GEMM route table; TP=2 computes TP=1 (blocks never cross a shard, streams are drawn for the whole
operand); the quantizers themselves are tested in tests/test_block_recipes.py and tests/test_blockwise_fp8.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from harness.distributed import run_distributed
from tessera.config import Config, ConfigError
from tessera.parallel import block_formats as bf
from tessera.parallel import gemm
from tessera.parallel.gemm import RecipeSwitches, fp8_linear
from tessera.parallel.recipe_state import RecipeStream
from tests.tolerances import order_rtol

BF16 = torch.bfloat16
# (recipe, switches): each technique alone, and NVIDIA's full NVFP4 recipe
CASES = {
    "mxfp8 rceil": ("mxfp8", RecipeSwitches(scale_rounding="rceil")),
    "rowwise_with_gw_hp": ("rowwise_with_gw_hp", None),
    "blockwise": ("blockwise", None),
    "nvfp4 2D weights": ("nvfp4", RecipeSwitches(weight_2d=True)),
    "nvfp4 Hadamard wgrad": ("nvfp4", RecipeSwitches(hadamard=True)),
    "nvfp4 stochastic gradients": ("nvfp4", RecipeSwitches(stochastic=True)),
    "mxfp8 stochastic gradients": ("mxfp8", RecipeSwitches(scale_rounding="rceil", stochastic=True)),
    "nvfp4 NVIDIA recipe": ("nvfp4", RecipeSwitches(weight_2d=True, hadamard=True, stochastic=True)),
}
SIZE = 256  # features: two TP shards of 128, whole blocks of every recipe (blockwise tiles are 128)


def _data(seed: int = 0, t: int = 48):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, SIZE, generator=g) * torch.linspace(0.1, 3, SIZE)).to(BF16)
    w = (torch.randn(SIZE, SIZE, generator=g) * 0.2).to(BF16)
    dy = (torch.randn(t, SIZE, generator=g) * 1e-3).to(BF16)
    return x, w, dy


def _run(case: str, x, w, dy, **split):
    recipe, switches = CASES[case]
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_linear(xr, wr, None, recipe, switches=switches, state=RecipeStream(7, "lin"), **split)
    y.backward(dy)
    return y.detach(), xr.grad, wr.grad


def _tp_worker(rank: int, world: int) -> dict:
    x, w, dy = _data(seed=1)
    group = dist.group.WORLD
    out = {}
    for case in CASES:
        # column-parallel: W rows split, x replicated, the output and its gradient split along features
        y, gx, gw = _run(case, x, w.chunk(world, 0)[rank], dy.chunk(world, 1)[rank], group=group, w_split_out=True)
        gx = gx.float()
        dist.all_reduce(gx, group=group)
        # row-parallel: W columns and x features split; partial outputs summed over the group
        yp, gxr, gwr = _run(case, x.chunk(world, 1)[rank], w.chunk(world, 1)[rank], dy, group=group,
                            x_split_in=True, w_split_in=True)
        ys = yp.float()
        dist.all_reduce(ys, group=group)
        out[case] = {"col": (y, gx, gw), "row": (ys.to(BF16), gxr, gwr)}
    return out


@pytest.fixture(scope="module")
def tp2_runs():
    return run_distributed(_tp_worker, 2)


@pytest.mark.parametrize("case", list(CASES))
def test_each_recipe_at_tp2_equals_tp1(case, tp2_runs):
    """Every shard is quantized as TP=1 quantizes that part: slices bitwise TP=1's; sums of two bf16 partials
    (the column input grad, the row output) within ``order_rtol(bf16, 2)``."""
    x, w, dy = _data(seed=1)
    y, gx, gw = _run(case, x, w, dy)
    res = [r[case] for r in tp2_runs]
    assert torch.equal(torch.cat([r["col"][0] for r in res], 1), y)
    assert torch.equal(torch.cat([r["col"][2] for r in res], 0), gw)
    assert torch.equal(torch.cat([r["row"][1] for r in res], 1), gx)
    assert torch.equal(torch.cat([r["row"][2] for r in res], 1), gw)
    tol = order_rtol(BF16, 2)

    def rel(a, ref):
        return float((a.float() - ref.float()).norm() / ref.float().norm())

    assert rel(res[0]["col"][1], gx) < tol and rel(res[0]["row"][0], y) < tol


def test_rceil_scales_round_up_in_the_route():
    """The mxfp8 route quantizes with the policy's scale rounding: RCEIL's forward equals the quantizer's RCEIL
    operands multiplied, and differs from FLOOR's where some block clips under FLOOR."""
    x, w, _ = _data(seed=2)
    y = fp8_linear(x, w, None, "mxfp8", switches=RecipeSwitches(scale_rounding="rceil"))
    ref = (bf.fake_quantize(x.float(), "mxfp8", 1, scale_rounding="rceil")
           @ bf.fake_quantize(w.float(), "mxfp8", 1, scale_rounding="rceil").t()).to(BF16)
    assert torch.equal(y, ref)
    assert not torch.equal(y, fp8_linear(x, w, None, "mxfp8"))


def test_rowwise_with_gw_hp_keeps_the_weight_gradient_unquantized():
    """Forward and data gradient are the rowwise fp8 route's; the weight gradient is the unquantized GEMM."""
    x, w, dy = _data(seed=3)
    y, gx, gw = _run("rowwise_with_gw_hp", x, w, dy)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y_row = fp8_linear(xr, wr, None, "rowwise")
    y_row.backward(dy)
    assert torch.equal(y, y_row.detach()) and torch.equal(gx, xr.grad)
    assert torch.equal(gw, (dy.float().t() @ x.float()).to(BF16))
    assert not torch.equal(gw, wr.grad)


def test_the_recipes_are_config_choices_and_their_rows_are_in_the_table():
    for recipe, route in (("rowwise_with_gw_hp", "fp8-rowwise-gw-hp-emulated"), ("blockwise", "fp8-blockwise-emulated")):
        cfg = Config.from_file("configs/tiny.py", ["model.dtype='bf16'", "model.low_precision.enabled=True",
                                                   f"model.low_precision.recipe='{recipe}'"])
        assert cfg.typed.model.low_precision.recipe == recipe
        assert gemm.choose_route("cpu", BF16, gemm.policy_for(recipe)).name == route
    with pytest.raises(ConfigError, match="hadamard_wgrad=True is an nvfp4 switch"):
        Config.from_file("configs/tiny.py", ["model.dtype='bf16'", "model.low_precision.enabled=True",
                                             "model.low_precision.recipe='mxfp8'", "model.low_precision.hadamard_wgrad=True"])


def _stack(*overrides: str):
    from tessera.core.job import Job
    from tessera.train.builder import build_training_stack

    cfg = Config.from_file("configs/tiny.py", ["model.dtype='bf16'", "model.num_layers=4", *overrides])
    return cfg, build_training_stack(cfg, Job.of(cfg, seed=5), sync_buffer=False)


def _policies(model) -> dict[str, gemm.GemmPolicy]:
    return {n: m.gemm_policy for n, m in model.named_modules() if hasattr(m, "gemm_policy")}


@pytest.mark.parametrize("preset,kept", [("nvidia", {0, 3}), ("torchtitan", {3})])
def test_presets_keep_their_blocks_in_bf16_and_switch_the_rest(preset, kept):
    cfg, stack = _stack(f'model.low_precision={{"preset": "{preset}"}}')
    for name, p in _policies(stack.inner_model).items():
        block = int(name.split(".")[1]) if name.startswith("layers.") else None
        route = gemm.choose_route("cpu", BF16, p).name
        if block is None or block in kept:  # the head (exclude) and the kept blocks: the model dtype's route
            assert p == gemm.MODEL_DTYPE and route in ("native", "cpu-upcast"), name
            continue
        assert p.recipe == "nvfp4" and route == "nvfp4-emulated", name
        full = preset == "nvidia"
        assert (p.weight_2d, p.hadamard, p.stochastic) == (full, full, full), name
        assert isinstance(p.state, RecipeStream) is full, name


def test_the_forward_switches_to_the_model_dtype_at_the_configured_step():
    from tessera.precision.linears import ForwardSchedule

    cfg, stack = _stack("model.low_precision.enabled=True", "model.low_precision.recipe='nvfp4'",
                        "model.low_precision.high_precision_forward_from_step=3")
    schedule = ForwardSchedule(stack.inner_model, stack.job.precision.gemms)
    layer = stack.inner_model.layers[1].feed_forward.w2
    x = torch.randn(8, layer.in_features, generator=torch.Generator().manual_seed(0)).to(BF16)
    low = layer(x)
    assert not schedule.before_step(2) and not layer.gemm_policy.forward_high
    assert schedule.before_step(3) and layer.gemm_policy.forward_high and layer.gemm_policy.recipe == "nvfp4"
    high = layer(x)
    native = gemm.linear(x, layer.weight, layer.bias)  # the model dtype's route
    assert torch.equal(high, native) and not torch.equal(low, native)
    assert not schedule.before_step(4)  # once


def test_the_recipe_study_policies_load_on_the_demo_and_build_its_model():
    """``python -m benchmarks precision-study --set recipes``: every policy is a valid demo config whose model
    builds (the blockwise tiles and the NVFP4 blocks fit its shards), before hours of runs find out."""
    from benchmarks import precision_study as study
    from tessera.core.job import Job
    from tessera.memory.census import meta_census

    study.check_policies("configs/demo.py", [], list(study.RECIPE_STUDY), study.RECIPE_STUDY)
    for name, overrides in study.RECIPE_STUDY.items():
        cfg = Config.from_file("configs/demo.py", overrides)
        meta_census(cfg["model"], cfg.typed.parallel.tensor.size, Job.of(cfg).precision)  # builds, on meta
        assert cfg.typed.parallel.tensor.size == 1, name


def test_2d_weight_blocks_give_the_forward_and_the_data_gradient_one_quantized_weight():
    """With 2D blocks both GEMMs multiply ``fake_quantize_nvfp4_2d(W)`` (bitwise); with 1-D blocks the forward's and
    the dgrad's quantized weights differ in most elements (the issue: 77%)."""
    x, w, dy = _data(seed=4)
    y, gx, _ = _run("nvfp4 2D weights", x, w, dy)
    w2 = bf.fake_quantize_nvfp4_2d(w.float())
    assert torch.equal(y, (bf.fake_quantize(x.float(), "nvfp4", 1) @ w2.t()).to(BF16))
    assert torch.equal(gx, (bf.fake_quantize(dy.float(), "nvfp4", 1) @ w2).to(BF16))
    along_in, along_out = bf.fake_quantize(w.float(), "nvfp4", 1), bf.fake_quantize(w.float(), "nvfp4", 0)
    assert float((along_in != along_out).float().mean()) > 0.5


def test_the_hadamard_transform_meets_both_weight_gradient_operands_and_cancels_in_their_product(monkeypatch):
    """With the quantizer made exact, the transformed weight gradient equals the plain one to fp32 rounding (the
    transform is orthogonal); the transform is applied along the tokens to exactly the two wgrad operands, with
    the run's signs."""
    x, w, dy = _data(seed=5, t=40)  # 40 tokens: padded to 48, three 16-token blocks
    calls = []
    real_rht = gemm.rht

    def spy(t, signs, dim):
        calls.append((tuple(t.shape), dim))
        return real_rht(t, signs, dim)

    monkeypatch.setattr(gemm, "rht", spy)
    monkeypatch.setattr(gemm, "fake_quantize", lambda t, *a, **k: t.float())  # exact "quantization"
    stream = RecipeStream(7, "lin")
    _, _, gw = _run("nvfp4 Hadamard wgrad", x, w, dy)
    assert calls == [((48, SIZE), 0), ((48, SIZE), 0)]  # g and x of the weight gradient only, along the tokens
    exact = dy.double().t() @ x.double()
    # two fp32 transforms (4 butterfly stages each) and a 48-term fp32 sum, then one bf16 rounding
    bound = 2.0**-8 * exact.abs() + 48 * 2.0**-22 * (dy.double().abs().t() @ x.double().abs())
    assert bool(((gw.double() - exact).abs() <= bound).all())
    assert torch.equal(stream.signs, RecipeStream(7, "other").signs)  # one sign vector for the run


def test_stochastic_gradients_draw_from_the_linears_stream_and_resume_it():
    """Each backward draws twice from the stream (the input gradient's and the weight gradient's rounding); the
    same stream state gives bitwise the same gradients, another draw other ones; round-to-nearest is untouched."""
    x, w, dy = _data(seed=6)
    recipe, switches = CASES["nvfp4 stochastic gradients"]

    def grads(stream):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fp8_linear(xr, wr, None, recipe, switches=switches, state=stream)
        y.backward(dy)
        return y.detach(), xr.grad, wr.grad

    stream = RecipeStream(7, "lin")
    first = grads(stream)
    assert stream.draws == 2
    second = grads(stream)
    resumed = RecipeStream(7, "lin")
    resumed.load_state_dict(RecipeStream(7, "lin").state_dict())
    assert all(torch.equal(a, b) for a, b in zip(grads(resumed), first))
    assert torch.equal(first[0], second[0])  # the forward is round-to-nearest
    assert not torch.equal(first[1], second[1]) and not torch.equal(first[2], second[2])
    nearest = fp8_linear(x, w, None, "nvfp4")
    assert torch.equal(first[0], nearest)


@pytest.mark.slow
def test_nvidias_recipe_trains_configs_tiny_at_tp1_and_tp2(tmp_path):
    """The acceptance: configs/tiny.py in bf16 with the NVIDIA preset (2D weights, Hadamard wgrad, stochastic
    gradients, the first block in bf16) trains at TP=1 and TP=2 (exit 0, finite losses that fall), and the first
    step's loss, which only the round-to-nearest forward decides, agrees across the layouts to the order bound of
    bf16 sums over the row-parallel shards."""
    from tests.test_train import losses, train

    runs = {}
    for tp in (1, 2):
        (tmp_path / f"tp{tp}").mkdir()
        _, log_dir = train(tmp_path / f"tp{tp}", f"nvidia_tp{tp}", [
            "model.dtype=bf16", 'model.low_precision={"preset": "nvidia"}', f"parallel.tensor.size={tp}",
            "data.total_steps=8"], nproc=tp)
        runs[tp] = [loss for _, loss in sorted(losses(log_dir).items())]
    for got in runs.values():
        assert len(got) == 8 and all(map(torch.isfinite, torch.tensor(got))) and sum(got[-3:]) / 3 < got[0], got
    assert abs(runs[2][0] - runs[1][0]) <= order_rtol(BF16, 2, 2 * 2) * abs(runs[1][0])
