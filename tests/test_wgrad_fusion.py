"""Weight gradients accumulated in fp32 inside the GEMM (``hybrid_zero_optimizer.fuse_wgrad_accumulation``).

The references are independent of the code under test: fp64 autograd on the same (exactly representable)
values, and the same model trained with the fusion off. What only the fusion can do is checked on the
bf16 path CPUs without native bf16 GEMMs take (``TESSERA_CPU_LOWP_MATMUL=upcast``: bf16 operands, fp32
products and sums): the main gradient keeps the fp32 accuracy of the GEMM, while a bf16 weight gradient
added afterwards is rounded to bf16 (relative error up to 2**-8 per entry, per micro-batch).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from harness.distributed import run_distributed
from tessera.core.naive_amp import NaiveAMPModel
from tessera.optim.hybrid_zero import HybridZeroOptimizer
from tessera.parallel import cpu_kernels, wgrad
from tessera.parallel.layers import ColumnParallelLinear, RowParallelLinear
from tessera.parallel.loss import LossSpec, linear_cross_entropy
from tests.tolerances import gamma, order_rtol, unit_roundoff

IN, HID, OUT, TOKENS, MICRO = 24, 16, 8, 32, 2


@pytest.fixture
def upcast_bf16(monkeypatch):
    """bf16 GEMMs as fp32 GEMMs on bf16 operands (what CPUs without avx512_bf16/AMX run), on any CPU."""
    monkeypatch.setenv("TESSERA_CPU_LOWP_MATMUL", "upcast")
    cpu_kernels.forget_cpu_kernels()
    yield
    cpu_kernels.forget_cpu_kernels()


class TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = ColumnParallelLinear(IN, HID, bias=True, init_seed=1)
        self.down = RowParallelLinear(HID, OUT, bias=False, init_seed=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.up(x))


def _batches(dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Inputs and output gradients exactly representable in bf16 (so fp64 sees the same values)."""
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(TOKENS, IN, generator=g).bfloat16().to(dtype),
             torch.randn(TOKENS, OUT, generator=g).bfloat16().to(dtype)) for _ in range(MICRO)]


def _main_grads(model: nn.Module, batches, fuse: bool) -> dict[str, torch.Tensor]:
    opt = HybridZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                              zero_cfg={"fuse_wgrad_accumulation": fuse}, param_names=model)
    for x, c in batches:  # micro-batches accumulate into the main gradients
        opt.backward((model(x).float() * c.float()).sum())
    return {n: opt.get_main_grad(p).clone() for n, p in model.named_parameters()}


def _reference(model: nn.Module, batches) -> dict[str, torch.Tensor]:
    """fp64 autograd of the same computation, the hidden activation rounded as the model's dtype rounds it."""
    ref = {n: p.detach().double().requires_grad_() for n, p in model.named_parameters()}
    dtype = next(model.parameters()).dtype
    for x, c in batches:
        h = F.linear(x.double(), ref["up.weight"], ref["up.bias"])
        h = h + (h.detach().to(dtype).double() - h.detach())  # the forward's rounding, a constant for autograd
        (F.linear(h, ref["down.weight"]) * c.double()).sum().backward()
    return {n: t.grad for n, t in ref.items()}


def _entry_bound(model: nn.Module, batches, name: str, n: int) -> torch.Tensor:
    """Per entry: gamma(n) times the sum of |products| the fp32 GEMM adds (forward-error bound of a dot product)."""
    with torch.no_grad():
        total = 0
        for x, c in batches:
            h = model.up(x).double()
            c64 = c.double()
            if name == "down.weight":
                total = total + c64.abs().t() @ h.abs()
            else:  # up.weight: the gradient of h is c @ down.weight, then times x
                gh = c64 @ model.down.weight.double()
                total = total + gh.abs().t() @ x.double().abs()
    return gamma(n, torch.float32) * total


def test_fp32_linears_accumulate_into_the_main_grad_like_fp64_autograd():
    """fp32 weights: the GEMM adds each micro-batch's gradient into the main gradient (addmm_); both
    micro-batches are in it once each (not overwritten, not counted twice)."""
    model = TwoLinears()
    batches = _batches(torch.float32)
    got = _main_grads(model, batches, fuse=True)
    want = _reference(model, batches)
    for name in got:
        rtol = order_rtol(torch.float32, n=TOKENS * MICRO + HID, depth=2)
        err = float((got[name].double() - want[name]).norm() / want[name].norm())
        assert err <= rtol, (name, err, rtol)


def test_bf16_weight_gradients_keep_the_fp32_accuracy_of_the_gemm(upcast_bf16):
    """bf16 weights: with the fusion every entry of the main gradient is within the fp32 GEMM's
    forward-error bound of fp64; without it, the bf16 weight gradient's rounding (2**-8) shows. The hidden
    bf16 activation is the same in both and in the reference."""
    model = NaiveAMPModel(TwoLinears(), dtype=torch.bfloat16, sync_buffer=False).model
    batches = _batches(torch.bfloat16)
    want = _reference(model, batches)
    fused = _main_grads(model, batches, fuse=True)
    for name in ("down.weight",):  # its GEMM's operands (c, h) are exact bf16 values: the bound is the GEMM's
        bound = _entry_bound(model, batches, name, TOKENS * MICRO)
        excess = (fused[name].double() - want[name]).abs() - bound
        assert float(excess.max()) <= 0.0, (name, float(excess.max()))
    model.zero_grad(set_to_none=True)
    unfused = _main_grads(copy.deepcopy(model), batches, fuse=False)
    name = "down.weight"
    rel_fused = float((fused[name].double() - want[name]).norm() / want[name].norm())
    rel_unfused = float((unfused[name].double() - want[name]).norm() / want[name].norm())
    assert rel_unfused > 16 * rel_fused, (rel_unfused, rel_fused)  # bf16 rounding vs fp32 accumulation
    assert rel_unfused <= 2 * unit_roundoff(torch.bfloat16)  # and the unfused path is still a bf16 gradient


def test_the_chunked_head_adds_every_chunk_into_the_main_grad_once():
    """The head's GEMM fused with the loss, chunks of 5 rows (13 tokens: a remainder): the weight's main
    gradient equals fp64 ``F.cross_entropy`` on the full logits, over two micro-batches."""
    head = ColumnParallelLinear(16, 40, bias=False, init_seed=3)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(13, 16, generator=g), torch.randint(0, 40, (13,), generator=g)) for _ in range(2)]
    spec = LossSpec(chunk_tokens=5, reduction="sum")
    opt = HybridZeroOptimizer(torch.optim.SGD(head.parameters(), lr=0.0), param_names=head)
    assert wgrad.fused_main_grad(head.weight) is not None
    w64 = head.weight.detach().double().requires_grad_()
    for x, t in batches:
        opt.backward(linear_cross_entropy(x, head.weight, t, None, spec))
        F.cross_entropy(F.linear(x.double(), w64), t, reduction="sum").backward()
    got = opt.get_main_grad(head.weight).double()
    rtol = order_rtol(torch.float32, n=40 + 13 * 2, depth=3)
    assert float((got - w64.grad).norm() / w64.grad.norm()) <= rtol


def test_the_fused_head_never_holds_an_fp32_weight_gradient_buffer():
    """Memory: without the fusion the chunked head keeps a [V, h] fp32 accumulator for the weight's
    gradient through the backward; with it, that buffer never exists (the chunks add into the main grad)."""
    from tessera.plan.tracker import LiveBytes

    v, h, n = 2048, 64, 64
    head = ColumnParallelLinear(h, v, bias=False, init_seed=3)
    x = torch.randn(n, h, requires_grad=True)
    t = torch.randint(0, v, (n,))
    spec = LossSpec(chunk_tokens=16)
    peaks = {}
    for fuse in (False, True):
        opt = HybridZeroOptimizer(torch.optim.SGD(head.parameters(), lr=0.0),
                                  zero_cfg={"fuse_wgrad_accumulation": fuse}, param_names=head)
        loss = linear_cross_entropy(x, head.weight, t, None, spec)
        with LiveBytes(device_type="cpu") as live:
            opt.backward(loss)
        peaks[fuse] = live.peak
        opt.zero_grad()
    assert peaks[False] - peaks[True] >= v * h * 4, peaks  # at least the fp32 [V, h] accumulator


def test_fusion_off_reduce_dtype_model_and_plain_linears_use_the_hook():
    """Nothing is attached when the setting is off, when main grads are not fp32 (``reduce_dtype='model'``)
    or for a weight that is not a parallel linear's own (an ``nn.Linear``, a tied embedding)."""
    model = TwoLinears()
    HybridZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), zero_cfg={"fuse_wgrad_accumulation": False})
    assert wgrad.fused_main_grad(model.up.weight) is None
    bf16 = NaiveAMPModel(TwoLinears(), dtype=torch.bfloat16, sync_buffer=False).model
    HybridZeroOptimizer(torch.optim.SGD(bf16.parameters(), lr=0.0), zero_cfg={"reduce_dtype": "model"})
    assert wgrad.fused_main_grad(bf16.up.weight, torch.float32) is None
    plain = nn.Linear(4, 4)
    HybridZeroOptimizer(torch.optim.SGD(plain.parameters(), lr=0.0))
    assert wgrad.fused_main_grad(plain.weight) is None
    fused = TwoLinears()
    HybridZeroOptimizer(torch.optim.SGD(fused.parameters(), lr=0.0))
    assert wgrad.fused_main_grad(fused.up.weight) is not None
    assert wgrad.fused_main_grad(copy.deepcopy(fused).up.weight) is None  # a copy is not attached
    handle = fused.up.weight.register_hook(lambda g: g * 2)  # a gradient hook must see the gradient
    assert wgrad.fused_main_grad(fused.up.weight) is None
    handle.remove()
    assert wgrad.fused_main_grad(fused.up.weight) is not None


MODEL = {"vocab_size": 64, "hidden_size": 32, "num_layers": 2, "num_attention_heads": 4,
         "num_kv_attention_heads": 2, "mlp_ratio": 2.0, "dtype": "torch.float32"}


def _decoder_grads(rank: int, world: int, mode: str, tie: bool, fuse: bool, compile_backend: str | None,
                   steps: int = 1) -> tuple[dict[str, torch.Tensor], list[int]]:
    """The decoder (TP=``world``, ``mode``) built as train.py builds it; its main gradients after the last of
    ``steps`` steps of three micro-batches, and the number of fused adds (``add_wgrad`` calls) per step."""
    from unittest import mock

    from tessera.config import Config
    from tessera.core.job import Job, JobGroups
    from tessera.train.builder import build_training_stack

    group = dist.group.WORLD if world > 1 else None
    g = torch.Generator().manual_seed(3)
    data = [(torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g))
            for _ in range(3)]
    cu = torch.tensor([0, 5, 16, 32], dtype=torch.int32)
    compiled = {"enabled": compile_backend is not None, "backend": compile_backend or "inductor"}
    cfg = Config.from_dict({"model": {**MODEL, "tie_word_embeddings": tie, "compile": compiled},
                            "parallel": {"tensor": {"size": world, "mode": mode}},
                            "data": {"type": "synthetic", "seq_len": 16},
                            "hybrid_zero_optimizer": {"fuse_wgrad_accumulation": fuse}})
    singles = [dist.new_group([r]) for r in range(world)] if world > 1 else [None]
    groups = JobGroups(tp=group, dp=singles[rank], zero1=singles[rank], world=group)
    stack = build_training_stack(cfg, Job.of(cfg, groups, seed=5), sync_buffer=False)
    adds = []
    with mock.patch.object(wgrad, "add_wgrad", wraps=wgrad.add_wgrad) as counted:
        for _ in range(steps):
            stack.optimizer.zero_grad()
            counted.reset_mock()
            for ids, labels in data:
                loss = stack.model(ids, cu_seqlens=cu, labels=labels, loss=LossSpec(chunk_tokens=7))
                stack.optimizer.backward(loss)
            adds.append(counted.call_count)
    grads = {n: stack.optimizer.get_main_grad(p).double() for n, p in stack.inner_model.named_parameters()}
    return grads, adds


def _assert_same_main_grads(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Within two fp32 evaluation orders of each other (the decoder's depth, three micro-batches)."""
    rtol = order_rtol(torch.float32, n=64, depth=3 * 9 * 2 + 6)
    for name, ref in want.items():
        err = float((got[name] - ref).norm() / ref.norm().clamp(min=1e-30))
        assert err <= rtol, f"{name}: {err:.2e} > {rtol:.2e}"


def _decoder_worker(rank: int, world: int, mode: str, tie: bool) -> None:
    """Fused against unfused, eager: every main gradient within two fp32 evaluation orders of each other."""
    unfused, _ = _decoder_grads(rank, world, mode, tie, fuse=False, compile_backend=None)
    fused, adds = _decoder_grads(rank, world, mode, tie, fuse=True, compile_backend=None)
    assert adds[0] > 0
    _assert_same_main_grads(fused, unfused)


@pytest.mark.parametrize("world,mode,tie", [(1, "mtp", True), (2, "msp", False)])
def test_the_decoder_gets_the_same_main_grads_fused_and_unfused(world, mode, tie):
    if world == 1:
        _decoder_worker(0, 1, mode, tie)
    else:
        run_distributed(_decoder_worker, world, mode, tie)


def _compiled_worker(rank: int, world: int, mode: str, backend: str) -> None:
    """Compiled blocks fuse as many weight gradients as eager code does, from the first compiled step on,
    and reach the unfused eager main gradients. The first step's first micro-batch warms the blocks up
    eagerly; the second step runs compiled only."""
    want, _ = _decoder_grads(rank, world, mode, False, fuse=False, compile_backend=None)
    _, eager_adds = _decoder_grads(rank, world, mode, False, fuse=True, compile_backend=None)
    got, adds = _decoder_grads(rank, world, mode, False, fuse=True, compile_backend=backend, steps=2)
    assert adds == [eager_adds[0]] * 2, (adds, eager_adds)  # every linear of every block, inside the graphs
    _assert_same_main_grads(got, want)


@pytest.mark.skipif(not wgrad.COMPILED_FUSION, reason="this torch has no cudagraph_unsafe tag")
@pytest.mark.parametrize("world,mode,backend", [(1, "mtp", "aot_eager"), (1, "mtp", "inductor"),
                                                pytest.param(2, "msp", "aot_eager", marks=pytest.mark.slow)])
def test_compiled_blocks_add_their_weight_gradients_into_the_main_grads(world, mode, backend):
    """``tessera::weight_grad`` inside the traced backward (AOTAutograd's graph; inductor's code too)."""
    if world == 1:
        _compiled_worker(0, 1, mode, backend)
    else:
        run_distributed(_compiled_worker, world, mode, backend)


@pytest.mark.skipif(not wgrad.COMPILED_FUSION, reason="this torch has no cudagraph_unsafe tag")
def test_a_compiled_linear_decides_at_run_time_and_never_recompiles_for_it(upcast_bf16):
    """The fusion is decided when the compiled backward runs, not when it is traced: the same graph gives
    autograd the ordinary bf16 gradient before the main gradients are attached and after they are taken
    away, and adds into them (in fp32, on the upcast path) while they are attached."""
    from torch._dynamo.utils import counters

    model = NaiveAMPModel(TwoLinears(), dtype=torch.bfloat16, sync_buffer=False).model
    x, c = _batches(torch.bfloat16)[0]
    cpu_kernels.decide_cpu_kernels()  # before tracing, as compile_blocks does
    step = torch.compile(lambda inp: (model(inp).float() * c.float()).sum(), backend="aot_eager", fullgraph=True)
    want = _reference(model, [(x, c)])["down.weight"]
    step(x).backward()
    plain = model.down.weight.grad.double()
    model.zero_grad(set_to_none=True)
    graphs = counters["stats"]["unique_graphs"]
    main = torch.zeros_like(model.down.weight, dtype=torch.float32)
    wgrad.attach_main_grad(model.down.weight, main)
    step(x).backward()
    assert wgrad.take_added(model.down.weight)  # added inside the graph, the placeholder handed to autograd
    fused = main.double()
    wgrad.attach_main_grad(model.down.weight, None)
    model.zero_grad(set_to_none=True)
    step(x).backward()
    assert not wgrad.take_added(model.down.weight) and torch.equal(model.down.weight.grad.double(), plain)
    assert counters["stats"]["unique_graphs"] == graphs
    bound = _entry_bound(model, [(x, c)], "down.weight", TOKENS)
    assert float(((fused - want).abs() - bound).max()) <= 0.0  # the fp32 GEMM's accuracy
    assert float((plain - want).abs().max()) > float((fused - want).abs().max())  # the bf16 gradient's rounding


def test_resolve_finds_the_attached_parameter_behind_an_alias_only():
    """Compiled code passes aliases of the parameters: the same storage, shape and dtype resolve to the
    attached parameter; a copy, another shape of the storage, or a parameter whose storage moved do not."""
    model = TwoLinears()
    HybridZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.0))
    w = model.up.weight
    assert wgrad.resolve(w.detach()) is w
    assert wgrad.resolve(w.detach().clone()) is not w
    assert wgrad.resolve(w.detach().view(-1)) is not w
    moved = w.detach().clone()
    alias = w.detach()
    w.data = moved
    assert wgrad.resolve(alias) is alias and wgrad.resolve(moved) is moved


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bf16_weight_gradients_accumulate_in_fp32():
    """On the GPU the bf16 operands go through an fp32-output GEMM (``addmm(out_dtype=float32)`` where torch
    has it, logged): every entry within the fp32 GEMM's bound of fp64, as on the CPU's upcast path."""
    model = NaiveAMPModel(TwoLinears(), dtype=torch.bfloat16, sync_buffer=False).model.cuda()
    batches = [(x.cuda(), c.cuda()) for x, c in _batches(torch.bfloat16)]
    assert wgrad.fused_main_grad(model.down.weight) is None  # not attached yet
    fused = _main_grads(model, batches, fuse=True)
    assert wgrad.fused_main_grad(model.down.weight) is not None, "no fp32-output GEMM found on this GPU"
    want = _reference(model, batches)
    bound = _entry_bound(model, batches, "down.weight", TOKENS * MICRO)
    excess = (fused["down.weight"].double() - want["down.weight"]).abs() - bound
    assert float(excess.max()) <= 0.0, float(excess.max())


def test_meta_runs_without_an_out_dtype_addmm_check_shapes_and_allocate_nothing(monkeypatch):
    """A torch whose meta addmm takes no ``out_dtype`` (2.11: a TypeError in its decomposition, which broke every
    bf16 dry run there) adds in place shapes-only, as the fused GEMM allocates nothing; a shape mismatch raises."""
    monkeypatch.setattr(wgrad, "_KERNELS", {})
    monkeypatch.setattr(wgrad, "_meta_addmm_out", lambda: False)
    weight = torch.nn.Parameter(torch.empty(5, 3, device="meta", dtype=torch.bfloat16))
    main = torch.empty(5, 3, device="meta")
    wgrad.attach_main_grad(weight, main)
    grad, x = torch.empty(8, 5, device="meta", dtype=torch.bfloat16), torch.empty(8, 3, device="meta", dtype=torch.bfloat16)
    wgrad.add_wgrad(main, weight, grad, x)
    assert wgrad._KERNELS[("meta", torch.bfloat16)] == "meta_in_place"
    with pytest.raises(RuntimeError, match=r"main gradient \(5, 3\) does not match"):
        wgrad.add_wgrad(main, weight, grad, torch.empty(8, 4, device="meta", dtype=torch.bfloat16))
