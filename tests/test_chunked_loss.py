"""The head and the loss fused in chunks of tokens (``linear_cross_entropy``, ``loss.chunk_tokens``).

References: ``F.cross_entropy`` on the full logits ``F.linear(x, W)`` in fp64 (single process, every
reduction, label smoothing, ignored tokens, chunk sizes that do and do not divide the tokens); the decoder's
unfused path (logits, then ``vocab_parallel_cross_entropy``) at TP=1/2/4, mtp and msp, ``parallel_output``
both ways, an fp32-marked head in a bf16 model; and the live bytes of one forward and backward (no
``[tokens, vocab]`` fp32 tensor exists).

Tolerances: in fp64 the fused and reference losses differ only by summation order over the vocabulary and
the chunking (a few ulp of fp64, so 1e-12). In fp32 each logit is a dot product of length h = 64 and the
log-sum-exp a sum of V terms: relative error at most ``(h + V) * 2**-24`` per entry, so the mean loss and
gradients agree to ``(h + V) * u32`` (about 2e-5 here); across TP sizes the vocabulary sums split
differently, which stays within the same bound.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness.distributed import run_distributed
from tessera.parallel.loss import LossSpec, linear_cross_entropy

N, H, V = 13, 64, 96  # 13 tokens: chunks of 4 leave a remainder
U32 = 2.0**-24
FP32_RTOL = (H + V) * U32


def _data(dtype: torch.dtype = torch.float64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g, dtype=torch.float64).to(dtype)
    w = (torch.randn(V, H, generator=g, dtype=torch.float64) * 0.2).to(dtype)
    t = torch.randint(0, V, (N,), generator=g)
    t[[2, 7]] = -100  # ignored
    return x, w, t


def _reference(x, w, t, spec: LossSpec):
    x = x.detach().double().requires_grad_()
    w = w.detach().double().requires_grad_()
    loss = F.cross_entropy(F.linear(x, w), t, ignore_index=-100, label_smoothing=spec.label_smoothing,
                           reduction=spec.reduction)
    (loss if spec.reduction != "none" else (loss * torch.arange(N, dtype=loss.dtype)).sum()).backward()
    return loss.detach(), x.grad, w.grad


def _fused(x, w, t, spec: LossSpec, group=None):
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    loss = linear_cross_entropy(x, w, t, group, spec)
    (loss if spec.reduction != "none" else (loss * torch.arange(N, dtype=loss.dtype)).sum()).backward()
    return loss.detach(), x.grad, w.grad


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("chunk", [1, 4, 13, 1000])
def test_equals_cross_entropy_on_the_full_logits_in_fp64(reduction, smoothing, chunk):
    x, w, t = _data()
    spec = LossSpec(label_smoothing=smoothing, reduction=reduction, chunk_tokens=chunk)
    for got, want in zip(_fused(x, w, t, spec), _reference(x, w, t, spec)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_fp32_within_the_rounding_bound_and_gradients_of_ignored_rows_are_zero():
    x, w, t = _data(torch.float32)
    spec = LossSpec(label_smoothing=0.1, chunk_tokens=4)
    loss, gx, gw = _fused(x, w, t, spec)
    ref_loss, ref_gx, ref_gw = _reference(x, w, t, spec)
    assert loss.dtype == torch.float32 and gx.dtype == gw.dtype == torch.float32
    for got, want in ((loss, ref_loss), (gx, ref_gx), (gw, ref_gw)):
        assert float((got.double() - want).norm() / want.norm()) <= FP32_RTOL
    assert torch.count_nonzero(gx[[2, 7]]) == 0


def test_no_whole_logits_tensor_is_ever_alive():
    """Live CPU bytes during forward and backward: the unfused path holds [N, V] fp32 logits (and their
    softmax); the fused one holds at most a chunk of them beyond its inputs and gradients."""
    from tessera.plan.tracker import LiveBytes

    n, h, v = 512, 32, 4096
    x = torch.randn(n, h, requires_grad=True)
    w = torch.randn(v, h, requires_grad=True)
    t = torch.randint(0, v, (n,))
    whole = n * v * 4

    def peak(fn) -> int:
        with LiveBytes(device_type="cpu") as live:
            fn().backward()
        return live.peak

    unfused = peak(lambda: F.cross_entropy(F.linear(x, w), t))
    fused = peak(lambda: linear_cross_entropy(x, w, t, None, LossSpec(chunk_tokens=32)))
    assert unfused >= whole  # the reference does hold them
    grads = (n * h + v * h) * 4 + v * h * 4  # x's and w's gradients, and the fp32 accumulator of w's
    assert fused <= grads + 4 * (32 * v * 4) + 8 * n * 4, (fused, whole)


def _tp_worker(rank: int, world: int) -> None:
    """TP=world: vocab shards of the weight; the loss equals TP=1's, x's gradient summed over ranks equals
    TP=1's, and each rank's weight gradient is its shard of TP=1's."""
    group = dist.group.WORLD
    x, w, t = _data(torch.float64, seed=3)
    for spec in (LossSpec(chunk_tokens=5), LossSpec(label_smoothing=0.2, reduction="sum", chunk_tokens=3)):
        ref_loss, ref_gx, ref_gw = _fused(x, w, t, spec)
        shard = w.chunk(world)[rank]
        loss, gx, gw = _fused(x, shard, t, spec, group)
        dist.all_reduce(gx, group=group)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gx, ref_gx, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gw, ref_gw.chunk(world)[rank], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_matches_one_rank(world):
    run_distributed(_tp_worker, world)


MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 8, "num_kv_attention_heads": 4,
         "vocab_size": 96, "mlp_ratio": 2.0}
BF16_RTOL = 4 * MODEL["num_layers"] * 2.0**-8  # a rounding flip in bf16 per layer the difference passes through


def _decoder_worker(rank: int, world: int, mode: str, parallel_output: bool, dtype: str) -> None:
    """The decoder's fused head and loss (``model(..., labels=...)``) against its logits and
    ``vocab_parallel_cross_entropy``: the loss and every parameter's gradient, packed rows, chunks of 7."""
    from tessera.core.naive_amp import NaiveAMPModel
    from tessera.model import build_model
    from tessera.parallel import vocab_parallel_cross_entropy

    group = dist.group.WORLD if world > 1 else None
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, MODEL["vocab_size"], (2, 16), generator=g)
    labels = torch.randint(0, MODEL["vocab_size"], (2, 16), generator=g)
    labels[0, :3] = -100
    cu = torch.tensor([0, 5, 16, 32], dtype=torch.int32)
    grads, losses = {}, {}
    for fused in (False, True):
        model = build_model({**MODEL, "parallel_output": parallel_output}, tp_group=group, seed=5, tensor_mode=mode)
        if dtype == "bf16":  # fp32 norms and head, as model.fp32_modules=["*norm*", "output"]
            model = NaiveAMPModel(model, dtype=torch.bfloat16, sync_buffer=False, fp32_modules=["*norm", "output"])
        if fused:
            loss = model(ids, cu_seqlens=cu, labels=labels, loss=LossSpec(reduction="sum", chunk_tokens=7))
        else:
            logits = model(ids, cu_seqlens=cu)
            loss = vocab_parallel_cross_entropy(logits, labels, group if parallel_output else None, reduction="sum")
        loss.backward()
        losses[fused] = loss.detach().double()
        grads[fused] = {n: p.grad.double() for n, p in model.named_parameters()}
    rtol = FP32_RTOL * 8 if dtype == "fp32" else BF16_RTOL  # 8: two layers, forward and backward, tokens
    assert abs(float(losses[True] - losses[False])) <= rtol * abs(float(losses[False])), losses
    for name, want in grads[False].items():
        got = grads[True][name]
        err = float((got - want).norm() / want.norm().clamp(min=1e-30))
        assert err <= rtol, f"{name}: relative error {err:.2e} > {rtol:.2e}"


@pytest.mark.parametrize("world,mode,parallel_output,dtype", [
    (1, "mtp", True, "fp32"),
    (2, "mtp", True, "fp32"),
    (2, "msp", True, "fp32"),
    (2, "mtp", False, "fp32"),
    (4, "msp", False, "fp32"),
    (2, "msp", True, "bf16"),
])
def test_the_decoder_fused_head_loss_matches_its_unfused_path(world, mode, parallel_output, dtype):
    if world == 1:
        _decoder_worker(0, 1, mode, parallel_output, dtype)
    else:
        run_distributed(_decoder_worker, world, mode, parallel_output, dtype)


def _peak_worker(rank: int, world: int, cases: list[dict]) -> list[int]:
    from benchmarks.activations import case as build

    return [build(dist.group.WORLD, **c)[0] for c in cases]


def test_the_activation_closed_form_counts_the_fused_head():
    """Live bytes of one forward and backward at TP=2 against ``activation_bytes(..., chunk_tokens)``, to 10%
    as the unfused closed form is checked (tests/test_sequence_parallel.py); with a vocabulary of 512 the
    fused head's peak is below the unfused one's."""
    from tessera.memory.activations import activation_bytes

    model = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=512, mlp_ratio=2.0, multiple_of=16)
    cases = [dict(model=model, micro_bsz=2, seq_len=64, mode=mode, checkpoint=False, chunk_tokens=chunk)
             for mode in ("mtp", "msp") for chunk in (0, 16, 128)]
    measured = run_distributed(_peak_worker, 2, cases)[0]
    for case, peak in zip(cases, measured):
        if not case["chunk_tokens"]:
            continue
        closed = activation_bytes(model, 2, 64, 2, case["mode"], False, torch.float32, case["chunk_tokens"])["peak"]
        assert abs(peak - closed) <= 0.10 * closed, (case, peak, closed)
    by = {(c["mode"], c["chunk_tokens"]): p for c, p in zip(cases, measured)}
    assert by["mtp", 16] < by["mtp", 0] and by["msp", 16] < by["msp", 0]


def test_compiled_chunk_kernels_compute_the_eager_ones():
    """``LossSpec(compiled=True)`` (train.py's with compiled blocks): the per-chunk kernels through inductor give
    the eager path's loss and gradients, in fp32 within the fp32 bound (the same operations, fused: only the
    order of the exp sums and the exp implementation differ), with label smoothing and ignored rows."""
    from torch._inductor import config

    if not any(shutil.which(c) for c in [*(c for c in config.cpp.cxx if c), "g++", "c++", "clang++"]):
        pytest.skip("inductor needs a C++ compiler on the CPU")
    x, w, t = _data(torch.float32, seed=5)
    torch._dynamo.reset()  # compiled here, whatever this process compiled before
    torch._dynamo.utils.counters.clear()
    for spec in (LossSpec(chunk_tokens=4), LossSpec(chunk_tokens=4, label_smoothing=0.1, reduction="sum")):
        eager = _fused(x, w, t, spec)
        compiled = _fused(x, w, t, LossSpec(chunk_tokens=4, label_smoothing=spec.label_smoothing,
                                            reduction=spec.reduction, compiled=True))
        for got, want in zip(compiled, eager):
            torch.testing.assert_close(got, want, rtol=FP32_RTOL, atol=FP32_RTOL * float(want.abs().max()))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 3  # the three kernels did compile


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_chunk_kernels_leave_their_inputs_alone(dtype):
    """The compiled kernels write into none of their operands. A compiled function that does (the eager
    ``_row_sums`` shifts fp32 logits in place) got a wrong loss from the first step under torch 2.11's inductor;
    torch 2.13 computes it right, so the writes themselves are what is checked."""
    from torch._inductor import config

    from tessera.parallel.loss import _compiled_kernels

    if not any(shutil.which(c) for c in [*(c for c in config.cpp.cxx if c), "g++", "c++", "clang++"]):
        pytest.skip("inductor needs a C++ compiler on the CPU")
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 40, generator=g).to(dtype)
    target, mine = torch.randint(0, 40, (6,), generator=g), torch.rand(6, generator=g) > 0.3
    coef = torch.rand(6, generator=g)
    kernels = _compiled_kernels()
    row_max = kernels.row_max(logits, torch.float32)
    given = [t.clone() for t in (logits, row_max, target, mine, coef)]
    sums = kernels.row_sums(logits, row_max, target, mine, True)
    kernels.logits_grad(logits, row_max + sums[0].log(), target, mine, coef, 0.1, 40)
    for name, before, after in zip(("logits", "row_max", "target", "mine", "coef"), given,
                                   (logits, row_max, target, mine, coef)):
        assert torch.equal(before, after), f"a compiled chunk kernel wrote into its {name}"
