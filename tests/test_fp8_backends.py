"""fp8 GEMM backends: the ``fp8-scaled-mm`` route (``torch._scaled_mm``) against the ``fp8-emulated`` one, TP=2
against TP=1, compiled against eager, and tessera's fp8 linear against torchao's ``Float8Linear``.

The bounds (tests/tolerances.py). Both backends multiply the same fp8 operands with the same scales: the
products are exact, so the two differ only in how the fp32 sum is formed and scaled (``_scaled_mm`` sums the
fp8 products and multiplies the sum by the two inverse scales, the emulation sums dequantized products): an
fp32 difference ``R32 = order_rtol(fp32, K) + 2 u_fp32`` of the result before its one rounding to bf16, which
flips some bf16 roundings (``cast_rtol``). Where TP sums bf16 partials (the column-parallel input gradient, the
row-parallel output), each of the two partials and their sum is such a rounding: three flips' worth.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from harness.distributed import run_distributed
from tessera.parallel import gemm
from tessera.parallel.fp8 import scaled
from tessera.parallel.gemm import fp8_linear
from tessera.parallel.layers import ColumnParallelLinear, RowParallelLinear
from tests.tolerances import cast_rtol, fp8_flip_rtol, order_rtol, precision_rtol, unit_roundoff

E4M3, E5M2, BF16 = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16
B, S, IN, HID, OUT = 2, 16, 64, 64, 32  # tiny: the CPU's _scaled_mm is a reference kernel
RECIPES = ("tensorwise", "rowwise")


def _r32(k: int) -> float:
    """fp32 difference of one fp8 GEMM's result between the backends: the sum of ``k`` exact products in two
    orders, and the kernel's two extra multiplications by the inverse scales."""
    return order_rtol(torch.float32, k) + 2 * unit_roundoff(torch.float32)


def _backend_tol(k: int, numel: int, roundings: int = 1) -> float:
    """Norm-wise difference of a bf16 result between the backends: ``roundings`` bf16 roundings of values that
    differ by ``_r32(k)``, each flipping some elements by one bf16 ulp."""
    return roundings * cast_rtol(BF16, _r32(k), numel)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


def _data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, S, IN, generator=g) * torch.linspace(0.1, 3, IN)).to(BF16)
    dy = (torch.randn(B, S, HID, generator=g) * 1e-3).to(BF16)
    h = (torch.randn(B, S, HID, generator=g) * torch.linspace(3, 0.1, HID)).to(BF16)
    dz = (torch.randn(B, S, OUT, generator=g) * 1e-3).to(BF16)
    return x, dy, h, dz


# ------------------------------------------------------------------ column and row linears, any TP size and mode
def _gather(t: torch.Tensor, dim: int, group, world: int) -> torch.Tensor:
    if world == 1:
        return t.detach()
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return torch.cat(parts, dim)


def _layers(group, world: int, rank: int, recipe: str, backend: str, mode: str, compiled: bool) -> dict:
    """Forward and backward of a column- and a row-parallel linear on this rank; every result gathered whole."""
    x, dy, h, dz = _data()
    sp = mode == "msp" and world > 1
    col = ColumnParallelLinear(IN, HID, bias=True, process_group=group, init_seed=7, init_name="col").to(BF16)
    row = RowParallelLinear(HID, OUT, bias=True, process_group=group, init_seed=7, init_name="row").to(BF16)
    with torch.no_grad():  # non-zero biases, the same on every TP size
        col.bias.copy_(torch.linspace(-1, 1, HID).chunk(world)[rank])
        row.bias.copy_(torch.linspace(1, -1, OUT))
    for layer in (col, row):
        layer.use_recipe(recipe, backend)

    def run_col(a):
        return col(a, sequence_parallel=sp)

    def run_row(a):
        return row(a, sequence_parallel=sp)

    if compiled:
        run_col, run_row = torch.compile(run_col, backend="aot_eager"), torch.compile(run_row, backend="aot_eager")
    xi = (x.chunk(world, -2)[rank] if sp else x).clone().requires_grad_()
    y = run_col(xi)
    y.backward(dy.chunk(world, -1)[rank])
    hi = h.chunk(world, -1)[rank].clone().requires_grad_()
    z = run_row(hi)
    z.backward(dz.chunk(world, -2)[rank] if sp else dz)
    return {
        "col": (_gather(y, -1, group, world), _gather(xi.grad, -2, group, world) if sp else xi.grad,
                _gather(col.weight.grad, 0, group, world), _gather(col.bias.grad, 0, group, world)),
        "row": (_gather(z, -2, group, world) if sp else z.detach(), _gather(hi.grad, -1, group, world),
                _gather(row.weight.grad, 1, group, world), row.bias.grad),
    }


CASES = [(r, b, m, c) for r in RECIPES for b in ("emulated", "scaled_mm") for m in ("mtp", "msp") for c in (False, True)]


def _tp_worker(rank: int, world: int) -> dict:
    return {case: _layers(dist.group.WORLD, world, rank, *case) for case in CASES}


@pytest.fixture(scope="module")
def tp2_runs():
    return run_distributed(_tp_worker, 2)[0]


@pytest.fixture(scope="module")
def tp1_runs():
    return {case: _layers(None, 1, 0, *case) for case in CASES if case[2] == "mtp"}


# (column, row): the reduction lengths of (y, dx, dW) and their element counts, and whether TP=2 sums bf16
# partials of it (column dx, row y)
_K = {"col": (IN, HID, B * S), "row": (HID, OUT, B * S)}
_N = {"col": (B * S * HID, B * S * IN, HID * IN), "row": (B * S * OUT, B * S * HID, OUT * HID)}
_TP_SUMMED = {"col": (False, True, False), "row": (True, False, False)}


def _assert_backends_agree(emulated: dict, scaled_mm: dict, tp: int) -> None:
    for layer in ("col", "row"):
        for i, what in enumerate(("output", "input grad", "weight grad")):
            roundings = 3 if tp > 1 and _TP_SUMMED[layer][i] else 1
            tol = _backend_tol(_K[layer][i], _N[layer][i], roundings)
            got = _rel(scaled_mm[layer][i], emulated[layer][i])
            assert got <= tol, f"{layer} {what}: scaled_mm vs emulated {got:.2e} > {tol:.2e}"
        # the bias gradient is the same fp32 sum of the output gradient in both routes
        assert torch.equal(scaled_mm[layer][3], emulated[layer][3])


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_scaled_mm_matches_the_emulation_at_tp1(recipe, compiled, tp1_runs):
    _assert_backends_agree(tp1_runs[recipe, "emulated", "mtp", compiled], tp1_runs[recipe, "scaled_mm", "mtp", compiled],
                           1)
    # compiled and eager run the same route: the same kernels on the same operands
    for layer in ("col", "row"):
        for a, b in zip(tp1_runs[recipe, "scaled_mm", "mtp", compiled][layer],
                        tp1_runs[recipe, "scaled_mm", "mtp", not compiled][layer]):
            assert torch.equal(a, b)


@pytest.mark.slow  # 16 TP=2 runs, half of them compiled: ~2 minutes on 2 cores
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("mode", ["mtp", "msp"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_scaled_mm_matches_the_emulation_at_tp2(recipe, mode, compiled, tp2_runs):
    _assert_backends_agree(tp2_runs[recipe, "emulated", mode, compiled], tp2_runs[recipe, "scaled_mm", mode, compiled], 2)


@pytest.mark.slow  # 16 TP=2 runs, half of them compiled: ~2 minutes on 2 cores
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("mode", ["mtp", "msp"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_scaled_mm_at_tp2_matches_tp1(recipe, mode, compiled, tp1_runs, tp2_runs):
    """The amaxes agreed over TP give every rank the TP=1 scales: TP=2 differs from TP=1 by its bf16 partial
    sums only (two partials rounded, then their sum: ``order_rtol(bf16, 2)``, as tests/test_fp8.py)."""
    tol = order_rtol(BF16, 2)  # 7.8e-3
    one, two = tp1_runs[recipe, "scaled_mm", "mtp", compiled], tp2_runs[recipe, "scaled_mm", mode, compiled]
    for layer in ("col", "row"):
        for i, what in enumerate(("output", "input grad", "weight grad", "bias grad")):
            got = _rel(two[layer][i], one[layer][i])
            assert got <= tol, f"{layer} {what}: TP=2 {mode} vs TP=1 {got:.2e} > {tol:.2e}"


def test_compiled_layers_trace_scaled_mm_in_all_three_gemms():
    """Inside a compiled block the route's three GEMMs are ``_scaled_mm`` calls in the traced graphs (not a graph
    break back to eager): one in the forward graph, two in the backward one."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs: list[int] = []  # _scaled_mm calls per traced graph

    def record(gm, inputs):
        graphs.append(sum(1 for n in gm.graph.nodes if "_scaled_mm" in str(n.target)))
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    layer = ColumnParallelLinear(IN, HID, bias=False, init_seed=1).to(BF16)
    layer.use_recipe("rowwise", "scaled_mm")
    fn = torch.compile(layer, backend=aot_autograd(fw_compiler=record, bw_compiler=record), fullgraph=True)
    x = _data()[0].clone().requires_grad_()
    fn(x).float().square().sum().backward()
    assert graphs == [1, 2]


# ------------------------------------------------------------------ against torchao's Float8Linear (TP=1)
def _torchao_config(recipe: str):
    """torchao's config for tessera's recipe: tensorwise is its default (e4m3 input and weight, e5m2 gradient,
    unrounded scales); rowwise is axiswise scaling with e5m2 gradients and unrounded scales (torchao's own
    'rowwise' recipe uses e4m3 gradients and power-of-two scales)."""
    from torchao.float8 import CastConfig, Float8LinearConfig, ScalingGranularity

    if recipe == "tensorwise":
        return Float8LinearConfig()
    axis = ScalingGranularity.AXISWISE
    return Float8LinearConfig(cast_config_input=CastConfig(scaling_granularity=axis, target_dtype=E4M3),
                              cast_config_weight=CastConfig(scaling_granularity=axis, target_dtype=E4M3),
                              cast_config_grad_output=CastConfig(scaling_granularity=axis, target_dtype=E5M2),
                              round_scales_to_power_of_2=False)


def _cast_flips(t: torch.Tensor, fmt: torch.dtype, reduce_dim: int | None) -> int:
    """Elements of ``t`` that torchao's quantizer and tessera's cast to different fp8 values, checked to be
    neighbours: the two compute ``max / amax`` in fp64 and fp32, so a scale may differ by one fp32 ulp, and an
    element at an fp8 rounding tie (common for bf16 inputs) then rounds the other way."""
    from torchao.float8 import ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    axis = ScalingGranularity.TENSORWISE if reduce_dim is None else ScalingGranularity.AXISWISE
    dim = None if reduce_dim is None else (-1 if reduce_dim == 1 else 0)  # torchao takes 0 or -1
    theirs = hp_tensor_to_float8_dynamic(t, fmt, LinearMMConfig(), scaling_granularity=axis, axiswise_dim=dim)
    q, scale = scaled(t, fmt, None if reduce_dim is None else 1 - reduce_dim)
    assert float(((theirs._scale - scale) / scale).abs().max()) <= 2 * unit_roundoff(torch.float32)
    a, b = theirs._data.float(), q.float()
    assert bool(((a - b).abs() <= 2 * unit_roundoff(fmt) * torch.maximum(a.abs(), b.abs())).all())
    return int((a != b).sum())


@pytest.mark.parametrize("backend", ["scaled_mm", "emulated"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_linear_matches_torchao_float8_linear(recipe, backend):
    """Forward and both gradients of tessera's fp8 linear against torchao's ``Float8Linear`` (its quantizer and
    ``_scaled_mm`` calls), same weights and inputs. Bound: the fp32 order difference before the bf16 rounding
    (``_backend_tol``), plus the operand elements the two quantizers round to neighbouring fp8 values (counted by
    ``_cast_flips``), each moving the result as ``fp8_flip_rtol`` says. Measured: tensorwise bitwise equal; rowwise
    output 0 .. 6e-4, gradients 2.7e-3 .. 3.0e-3 (torchao's second rounding, below)."""
    from torchao.float8 import convert_to_float8_training

    x, dy, _, _ = _data(1)
    x2, dy2 = x.reshape(-1, IN), dy.reshape(-1, HID)
    w = (torch.randn(HID, IN, generator=torch.Generator().manual_seed(2)) * 0.2).to(BF16)
    model = torch.nn.Sequential(torch.nn.Linear(IN, HID, bias=False)).to(BF16)
    with torch.no_grad():
        model[0].weight.copy_(w)
    convert_to_float8_training(model, config=_torchao_config(recipe))
    assert type(model[0]).__name__ == "Float8Linear"
    xa = x.clone().requires_grad_()
    ya = model(xa)
    ya.backward(dy)
    xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
    yb = fp8_linear(xb, wb, None, recipe, backend=backend)
    yb.backward(dy)

    rows = recipe == "rowwise"

    def flips(*operands):
        return sum(fp8_flip_rtol(fmt, t.numel(), _cast_flips(t, fmt, dim if rows else None))
                   for t, fmt, dim in operands if _cast_flips(t, fmt, dim if rows else None))

    # (operand, format, the dim its amax runs over when rowwise) of each GEMM
    fwd = flips((x2, E4M3, 1), (w, E4M3, 1))
    dgrad = flips((dy2, E5M2, 1), (w, E4M3, 0))
    wgrad = flips((dy2, E5M2, 0), (x2, E4M3, 0))
    # torchao's rowwise GEMMs without fast accumulation (both backward ones) call the tensorwise kernel with unit
    # scales, round the sum to bf16, then multiply by the row and column scales and round again
    # (``addmm_float8_unwrapped``): one more bf16 rounding of every element on its side
    twice = precision_rtol(BF16) if rows else 0.0
    checks = (("output", ya, yb, IN, fwd, 0.0), ("input grad", xa.grad, xb.grad, HID, dgrad, twice),
              ("weight grad", model[0].weight.grad, wb.grad, B * S, wgrad, twice))
    for what, theirs, ours, k, flip_tol, extra in checks:
        tol = _backend_tol(k, ours.numel()) + flip_tol + extra
        got = _rel(ours, theirs)
        assert got <= tol, f"{what}: tessera ({backend}) vs torchao {got:.2e} > {tol:.2e}"


def test_auto_backend_picks_the_emulation_without_fp8_tensor_cores(monkeypatch, caplog):
    """auto: scaled_mm only where the device has fp8 tensor cores (CUDA sm_89+), logged once with why; an explicit
    scaled_mm on a CPU runs it and warns that it is slow."""
    import logging

    from tessera import logs

    monkeypatch.setattr(logs, "_LOGGED", set())
    monkeypatch.setattr(gemm, "_FP8_CORES", {"cpu": False, "cuda": True})
    auto, explicit = gemm.GemmPolicy("fp8", "tensorwise"), gemm.GemmPolicy("fp8", "tensorwise", "scaled_mm")
    with caplog.at_level(logging.INFO, logger="tessera"):
        assert gemm.choose_route("cpu", BF16, auto).name == "fp8-emulated"
        assert gemm.choose_route("cuda", BF16, auto).name == "fp8-scaled-mm"
        assert gemm.choose_route("cpu", BF16, explicit).name == "fp8-scaled-mm"
        assert gemm.choose_route("cpu", BF16, gemm.GemmPolicy("fp8", "tensorwise", "emulated")).name == "fp8-emulated"
        gemm.choose_route("cpu", BF16, explicit)
    msgs = [(r.levelname, r.getMessage()) for r in caplog.records if r.getMessage().startswith("GEMMs of")]
    assert len(msgs) == 4
    assert "cpu has no fp8 tensor cores" in msgs[0][1] and "has fp8 tensor cores" in msgs[1][1]
    assert msgs[2][0] == "WARNING" and "reference kernel" in msgs[2][1]
    monkeypatch.setattr(gemm, "_FP8_CORES", {})
    assert not gemm.fp8_tensor_cores("cpu")


def test_block_formats_have_no_scaled_mm_backend():
    with pytest.raises(ValueError, match="mxfp8 has no scaled_mm route"):
        gemm.GemmPolicy("block", "mxfp8", "scaled_mm")
    with pytest.raises(ValueError, match="fp8 backend must be one of"):
        gemm.GemmPolicy("fp8", "tensorwise", "cublas")


# ------------------------------------------------------------------ the acceptance command, through train.py
def _loss_tol() -> float:
    """Relative loss difference of the two backends over a short run of configs/tiny.py in bf16 (10 steps).

    Per step, every bf16 rounding on the forward and backward path may flip between the backends (two orders of
    the fp32 sums inside the same fp8 GEMMs): ``order_rtol(bf16, 1, depth)`` over the backward depth, the
    gradients' as much; Adam moves the weights apart by ``sum(lr) / weight RMS`` times that (``adam_rtol``,
    init std 0.02), and the logits (and the loss, which moves less) follow the weights."""
    from tessera.config import Config
    from tests.test_train import COMMON, TINY
    from tests.tolerances import adam_rtol, transformer_depth

    cfg = Config.from_file(TINY, COMMON)
    grads = order_rtol(BF16, 1, transformer_depth(cfg.model.num_layers, backward=True))
    lrs = [cfg.adam.lr] * cfg.data.total_steps  # the schedule never exceeds the peak
    return grads + adam_rtol(grads, lrs=lrs, weight_rms=0.02)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_train_py_fp8_scaled_mm_matches_emulated(tmp_path, tp):
    """``train.py --config configs/tiny.py model.dtype=bf16 'model.fp8={"enabled": True, "backend": ...}'``: both
    backends train (exit 0) and their losses agree within ``_loss_tol`` (9.0e-2) at every step. Measured on this
    CPU, configs/tiny.py's own 10 steps: equal for 2 steps, then up to 1e-4 apart."""
    from tests.test_train import losses, train

    got = {}
    for backend in ("emulated", "scaled_mm"):
        fp8 = '{"enabled": True, "backend": "' + backend + '"}'
        (tmp_path / backend).mkdir()
        _, log_dir = train(tmp_path / backend, backend, ["model.dtype=bf16", f"model.fp8={fp8}",
                                                         f"parallel.tensor.size={tp}"], nproc=tp)
        got[backend] = losses(log_dir)
    assert got["emulated"].keys() == got["scaled_mm"].keys() and len(got["emulated"]) == 10
    tol = _loss_tol()
    for step, loss in got["emulated"].items():
        assert abs(got["scaled_mm"][step] - loss) <= tol * abs(loss), (step, got)
