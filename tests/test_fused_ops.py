"""The fused RMSNorm, rotary and SwiGLU product (``tessera.model.fused_ops``) against plain PyTorch.

References are the eager formulas written here (autograd differentiates them): RMSNorm and rotary in
fp32 on upcast inputs, rounded once to the input dtype (so a bf16 result may differ from the reference
by one bf16 rounding step, where the fp32 values straddle a rounding boundary), the rotation also as a
complex product; the SwiGLU product as ``F.silu(gate) * up`` in the inputs' dtype (bitwise). fp64 runs
``gradcheck``. Also checked: what each op keeps for backward and which copies it makes, the meta device,
``torch.compile`` without graph breaks, an fp32-marked RMSNorm in a bf16 model, and the
sequence-parallel weight gradient of a bf16 and an fp32 norm on 2 gloo ranks against one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from harness.distributed import run_distributed
from tessera.core.naive_amp import NaiveAMPModel
from tessera.model import FeedForward, RMSNorm, build_model, rotary_cos_sin
from tessera.model.fused_ops import rms_norm, rotary, swiglu
from tessera.model.rotary import apply_rotary
from tests.tolerances import order_rtol, precision_rtol, unit_roundoff

EPS = 1e-5
LOW = (torch.bfloat16, torch.float16)
# fused vs eager, both fp32 (tests/tolerances.py): RMSNorm is the longest chain, the mean of squares over
# the hidden size (64) then rsqrt and two products, and as much again backward (a sum over the hidden size)
FP32_RTOL = order_rtol(torch.float32, 64, 8)  # 1.9e-6; measured <= 4.8e-8 of the values' scale


def _close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """fp32: within FP32_RTOL of the values and their scale; bf16/fp16: within one rounding step of the
    reference (both round an fp32 value once: values FP32_RTOL apart may straddle a rounding boundary)."""
    assert got.dtype == ref.dtype and got.shape == ref.shape, (what, got.dtype, ref.dtype, got.shape, ref.shape)
    g, r = got.double(), ref.double()
    scale = r.abs().max().item()
    if got.dtype in LOW:
        step = 2 * unit_roundoff(got.dtype)  # relative spacing of the format
        bound = r.abs() * step + scale * FP32_RTOL
    else:
        bound = r.abs() * FP32_RTOL + scale * FP32_RTOL
    bad = (g - r).abs() > bound
    assert not bad.any(), f"{what}: {int(bad.sum())} elements off, worst {(g - r).abs().max().item():.3g}"


def _grads(fn, inputs, grad_out):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(grad_out)
    return out.detach(), [t.grad for t in leaves]


# ------------------------------------------------------------------------------------------ references
def _ref_rms_norm(x, w):
    c = torch.promote_types(x.dtype, torch.float32)
    xc = x.to(c)
    return (xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + EPS) * w.to(c)).to(x.dtype)


def _ref_rotary(x, positions, base=10000.0):
    """Pair (i, i + d/2) as a complex number, rotated by position * base^(-2i/d), in fp64."""
    d = x.shape[-1]
    theta = positions[..., None, None].double() * base ** (-torch.arange(d // 2, dtype=torch.float64) * 2 / d)
    z = torch.complex(x[..., : d // 2].double(), x[..., d // 2:].double()) * torch.polar(torch.ones_like(theta), theta)
    return torch.cat([z.real, z.imag], dim=-1)


def _ref_rotary_fp32(x, cos_half, sin_half):
    """The rotate_half formula in fp32 on the upcast input, rounded once (autograd gives the reference backward)."""
    c = torch.promote_types(x.dtype, torch.float32)
    xc, cos, sin = x.to(c), torch.cat([cos_half] * 2, -1), torch.cat([sin_half] * 2, -1)
    half = x.shape[-1] // 2
    return (xc * cos + torch.cat([-xc[..., half:], xc[..., :half]], -1) * sin).to(x.dtype)


# ------------------------------------------------------------------------------------------ values
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_forward_and_gradients_match_the_fp32_formula(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 7, 64, generator=g) * 3).to(dtype)
    w = (1 + 0.2 * torch.randn(64, generator=g)).to(dtype)
    grad = torch.randn(3, 7, 64, generator=g).to(dtype)
    out, (gx, gw) = _grads(lambda a, b: rms_norm(a, b, EPS), (x, w), grad)
    ref, (rgx, rgw) = _grads(_ref_rms_norm, (x, w), grad)
    _close(out, ref, "output")
    _close(gx, rgx, "input gradient")
    _close(gw, rgw, "weight gradient")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotary_matches_the_complex_rotation_and_its_transpose(dtype):
    g = torch.Generator().manual_seed(1)
    positions = torch.tensor([[0, 1, 2, 7, 3], [5, 0, 1, 2, 9]])
    x = torch.randn(2, 5, 3, 16, generator=g).to(dtype)
    cos, sin = rotary_cos_sin(positions, 16, 10000.0)
    assert cos.shape == sin.shape == (2, 5, 1, 8) and cos.dtype == torch.float32  # half width: no duplicate half
    got, exact = apply_rotary(x, cos, sin), _ref_rotary(x, positions)
    if dtype == torch.float32:  # fp32 angles: pos * inv_freq rounded, so ~1e-6 absolute at these positions
        # the angle rounds twice (u of the angle, up to 9 rad), its cos/sin once (u), two terms per output
        # times |x|: 3.9e-6 here; measured 2.0e-7
        angle_err = precision_rtol(torch.float32, 1, 2) * float(positions.max()) + precision_rtol(torch.float32)
        assert (got.double() - exact).abs().max() < 2**0.5 * angle_err * float(x.abs().max())
    else:
        _close(got, exact.to(dtype), "rotated vs complex product")
    grad = torch.randn(2, 5, 3, 16, generator=g).to(dtype)
    out, (gx,) = _grads(lambda a: rotary(a, cos, sin), (x,), grad)
    ref, (rgx,) = _grads(lambda a: _ref_rotary_fp32(a, cos, sin), (x,), grad)
    _close(out, ref, "output")
    _close(gx, rgx, "input gradient")
    # a rotation: the gradient is the inverse rotation of the incoming gradient, so norms are kept (fp32)
    if dtype == torch.float32:  # up to the fp32 cos/sin (cos^2 + sin^2 = 1 + O(u)) and the norms' 16-long sums
        assert torch.allclose(gx.norm(dim=-1), grad.norm(dim=-1), rtol=order_rtol(torch.float32, 16, 4))  # 6.7e-7


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_swiglu_is_bitwise_autograd_of_silu_times_up(dtype):
    g = torch.Generator().manual_seed(2)
    gate, up, grad = (torch.randn(4, 5, 48, generator=g).to(dtype) for _ in range(3))
    out, (gg, gu) = _grads(swiglu, (gate, up), grad)
    ref, (rgg, rgu) = _grads(lambda a, b: F.silu(a) * b, (gate, up), grad)
    assert torch.equal(out, ref) and torch.equal(gg, rgg) and torch.equal(gu, rgu)


def test_fp64_gradcheck():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: rms_norm(a, b, EPS), (x, w))
    angles = torch.randn(2, 3, 1, 4, generator=g, dtype=torch.float64)
    q = torch.randn(2, 3, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a: rotary(a, angles.cos(), angles.sin()), (q,))
    gate, up = (torch.randn(3, 5, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(swiglu, (gate, up))
    # fp64 statistics, not fp32: agreement far below fp32 rounding
    _close(rms_norm(x, w, EPS), _ref_rms_norm(x, w), "fp64 output")
    ref = _ref_rms_norm(x, w)  # two orders of the 8-long mean of squares, rsqrt and two products
    assert (rms_norm(x, w, EPS) - ref).abs().max() < order_rtol(torch.float64, 8, 4) * float(ref.abs().max())


def test_bad_shapes_are_clear_errors():
    with pytest.raises(ValueError, match="weight of shape"):
        rms_norm(torch.zeros(2, 8), torch.ones(4), EPS)
    with pytest.raises(ValueError, match="half the last dim"):
        rotary(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8))
    with pytest.raises(ValueError, match="one shape and one dtype"):
        swiglu(torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.bfloat16))


# ------------------------------------------------------------------------------------------ memory and copies
def _saved_by(fn, *inputs):
    """The tensors autograd keeps for ``fn``'s backward."""
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return saved


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _new_bytes(saved, inputs) -> int:
    """Bytes kept for backward in tensors that are not (views of) the inputs."""
    mine = {_storage(t) for t in inputs}
    return sum(t.numel() * t.element_size() for t in saved if _storage(t) not in mine)


def test_rms_norm_keeps_only_its_input_and_the_row_statistics():
    x = torch.randn(4, 6, 32, dtype=torch.bfloat16, requires_grad=True)
    norm = RMSNorm(32).to(torch.bfloat16)
    saved = _saved_by(norm, x)
    assert _new_bytes(saved, (x, norm.weight)) == 4 * 6 * 4  # one fp32 rstd per row; no fp32 copy, no product
    assert any(_storage(t) == _storage(x) for t in saved)


def test_swiglu_keeps_gate_and_up_only():
    gate = torch.randn(2, 5, 16, requires_grad=True)
    up = torch.randn(2, 5, 16, requires_grad=True)
    saved = _saved_by(swiglu, gate, up)
    assert _new_bytes(saved, (gate, up)) == 0 and len(saved) == 2  # silu(gate) is recomputed in backward
    ffn = FeedForward(16, 24)
    x = torch.randn(2, 5, 16, requires_grad=True)
    saved = _saved_by(ffn, x)
    # gate, up (kept by the product) and the product (w2's input): 3 tensors of 2 x 5 x 24 fp32
    assert _new_bytes(saved, (x, *ffn.parameters())) == 3 * 2 * 5 * 24 * 4


class _Ops(TorchDispatchMode):
    """Records each operator's name and the element count of its first tensor argument."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        self.calls.append((str(func.overloadpacket).split(".")[-1], first.numel() if first is not None else 0))
        return func(*args, **(kwargs or {}))


def test_rotary_keeps_nothing_per_call_and_concatenates_nothing():
    x = torch.randn(2, 5, 4, 16, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = rotary_cos_sin(torch.arange(5).expand(2, 5), 16, 10000.0)
    saved = _saved_by(lambda a: apply_rotary(a, cos, sin), x)
    assert _new_bytes(saved, (x, cos, sin)) == 0
    with _Ops() as ops:
        apply_rotary(x, cos, sin).backward(torch.ones_like(x))
    assert "cat" not in ops.names and "neg" not in ops.names, ops.names
    # one upcast in and one cast out per direction (bf16 -> fp32 -> bf16), nothing else
    assert ops.names.count("_to_copy") == 4, ops.names


def test_rms_norm_casts_only_what_fp32_statistics_need():
    """bf16: one upcast of the input and one rounding of the result per direction (and of the incoming gradient
    in backward); no fp32 copy of the weight's size is kept, no intermediate is rounded and cast back."""
    x = torch.randn(4, 6, 32, dtype=torch.bfloat16, requires_grad=True)
    norm = RMSNorm(32).to(torch.bfloat16)
    with _Ops() as ops:
        y = norm(x)
    big = [name for name, n in ops.calls if name in ("_to_copy", "copy_") and n == x.numel()]
    assert big == ["_to_copy", "_to_copy"], ops.calls  # x -> fp32, result -> bf16
    assert y.dtype == torch.bfloat16
    with _Ops() as ops:
        y.backward(torch.ones_like(y))
    big = [name for name, n in ops.calls if name in ("_to_copy", "copy_") and n == x.numel()]
    assert big == ["_to_copy"] * 3, ops.calls  # x -> fp32 (recomputed statistics), gradient -> fp32, dx -> bf16


# ------------------------------------------------------------------------------------------ where they run
def test_meta_device_shapes_forward_and_backward():
    x = torch.empty(2, 8, 32, device="meta", dtype=torch.bfloat16, requires_grad=True)
    w = torch.empty(32, device="meta", dtype=torch.bfloat16, requires_grad=True)
    q = torch.empty(2, 8, 4, 16, device="meta", dtype=torch.bfloat16, requires_grad=True)
    cos, sin = rotary_cos_sin(torch.arange(8, device="meta").expand(2, 8), 16, 10000.0)
    gate, up = (torch.empty(2, 8, 48, device="meta", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    outs = (rms_norm(x, w, EPS), rotary(q, cos, sin), swiglu(gate, up))
    assert [o.shape for o in outs] == [x.shape, q.shape, gate.shape] and all(o.dtype == torch.bfloat16 for o in outs)
    torch.autograd.backward(outs, [torch.empty_like(o) for o in outs])
    assert all(t.grad is not None and t.grad.shape == t.shape and t.grad.dtype == t.dtype for t in (x, w, q, gate, up))
    model = build_model(dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=96, checkpoint="selective",
                             mlp_ratio=2.0, multiple_of=16), device="meta")
    model(torch.zeros(2, 16, dtype=torch.long, device="meta")).sum().backward()
    assert all(p.grad is not None and p.grad.is_meta for p in model.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_traced_by_torch_compile_without_graph_breaks(dtype):
    """fullgraph=True: dynamo refuses any break inside the three Functions (forward and backward)."""
    torch._dynamo.reset()

    def block(x, w, q, cos, sin, gate, up):
        return rms_norm(x, w, EPS).sum() + rotary(q, cos, sin).float().pow(2).sum() + swiglu(gate, up).float().sum()

    g = torch.Generator().manual_seed(4)
    cos, sin = rotary_cos_sin(torch.arange(6).expand(2, 6), 8, 10000.0)
    leaves = [torch.randn(2, 6, 16, generator=g), torch.randn(16, generator=g), torch.randn(2, 6, 3, 8, generator=g),
              torch.randn(2, 6, 24, generator=g), torch.randn(2, 6, 24, generator=g)]
    leaves = [t.to(dtype) for t in leaves]

    def run(fn):
        ts = [t.clone().requires_grad_() for t in leaves]
        fn(ts[0], ts[1], ts[2], cos, sin, ts[3], ts[4]).backward()
        return [t.grad for t in ts]

    compiled = run(torch.compile(block, backend="aot_eager", fullgraph=True))
    for a, b in zip(compiled, run(block)):
        _close(a, b, "compiled gradient")


def test_fp32_marked_norm_in_a_bf16_model():
    """An RMSNorm kept fp32 inside a bf16 model: fp32 weight, fp32 statistics on the upcast bf16 input."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(16, 16, bias=False)
            self.norm = RMSNorm(16)

        def forward(self, x):
            return self.norm(self.proj(x))

    torch.manual_seed(5)
    net = Net()
    with torch.no_grad():
        net.norm.weight.normal_(1.0, 0.2)
    amp = NaiveAMPModel(net, dtype=torch.bfloat16, fp32_modules=["norm"], sync_buffer=False)
    assert net.proj.weight.dtype == torch.bfloat16 and net.norm.weight.dtype == torch.float32
    x = torch.randn(3, 5, 16)
    h = F.linear(x.bfloat16(), net.proj.weight.detach()).float().requires_grad_()  # the norm's fp32 input
    w = net.norm.weight.detach().clone().requires_grad_()
    ref = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + net.norm.eps) * w
    out = amp(x)
    assert out.dtype == torch.float32
    _close(out, ref, "fp32 norm output")
    grad = torch.randn(3, 5, 16)
    out.backward(grad)
    ref.backward(grad)
    assert net.norm.weight.grad.dtype == torch.float32
    _close(net.norm.weight.grad, w.grad, "fp32 norm weight gradient")


# ------------------------------------------------------------------------------------------ sequence parallel
def _sp_norm_worker(rank: int, world: int, dtype_name: str):
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(2, 8, 32, generator=g) * 2).to(dtype)
    grad = torch.randn(2, 8, 32, generator=g).to(dtype)
    weight = (1 + 0.2 * torch.randn(32, generator=g)).to(dtype)

    def run(group, chunk: slice, sp: bool):
        norm = RMSNorm(32, EPS, process_group=group).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(weight)
        xi = x[:, chunk].clone().requires_grad_()
        out = norm(xi, sequence_parallel=sp)
        out.backward(grad[:, chunk])
        return out.detach(), xi.grad, norm.weight.grad

    n = 8 // world
    return run(None, slice(None), False), run(dist.group.WORLD, slice(rank * n, (rank + 1) * n), True)


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_sequence_parallel_weight_gradient_matches_one_process(dtype_name):
    """msp on 2 gloo ranks: each rank normalizes its sequence chunk; the weight gradient, summed over the
    ranks in fp32 and rounded once, is the full-sequence gradient of one process."""
    results = run_distributed(_sp_norm_worker, 2, dtype_name)
    for rank, ((out1, gx1, gw1), (out, gx, gw)) in enumerate(results):
        rows = slice(rank * 4, (rank + 1) * 4)
        assert torch.equal(out, out1[:, rows]) and torch.equal(gx, gx1[:, rows])  # rows are independent
        assert gw.dtype == gw1.dtype
        _close(gw, gw1, f"rank {rank} weight gradient")
    assert torch.equal(results[0][1][2], results[1][1][2])  # every rank holds the same full gradient


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_the_formulas(dtype):
    """The same Functions on CUDA tensors: values and gradients against the formulas on the same device."""
    g = torch.Generator().manual_seed(7)
    x, grad = (torch.randn(4, 9, 64, generator=g).to(dtype).cuda() for _ in range(2))
    w = (1 + 0.2 * torch.randn(64, generator=g)).to(dtype).cuda()
    out, grads = _grads(lambda a, b: rms_norm(a, b, EPS), (x, w), grad)
    ref, refs = _grads(_ref_rms_norm, (x, w), grad)
    _close(out.cpu(), ref.cpu(), "cuda rms_norm")
    for a, b in zip(grads, refs):
        _close(a.cpu(), b.cpu(), "cuda rms_norm gradient")
    cos, sin = rotary_cos_sin(torch.arange(9, device="cuda").expand(4, 9), 16, 10000.0)
    q = x.view(4, 9, 4, 16)
    out, (gq,) = _grads(lambda a: rotary(a, cos, sin), (q,), grad.view(4, 9, 4, 16))
    ref, (rq,) = _grads(lambda a: _ref_rotary_fp32(a, cos, sin), (q,), grad.view(4, 9, 4, 16))
    _close(out.cpu(), ref.cpu(), "cuda rotary")
    _close(gq.cpu(), rq.cpu(), "cuda rotary gradient")
    out, grads = _grads(swiglu, (x, grad), w.expand_as(x).contiguous())
    ref, refs = _grads(lambda a, b: F.silu(a) * b, (x, grad), w.expand_as(x).contiguous())
    assert torch.equal(out, ref) and all(torch.equal(a, b) for a, b in zip(grads, refs))
