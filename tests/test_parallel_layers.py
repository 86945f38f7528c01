"""Tensor-parallel layers and the vocab-parallel loss against plain single-process references.

One 4-process gloo run checks tp = 1, 2 and 4 (groups {0..3}, {0,1}/{2,3}, and no group) for every
layer: forward output, input gradient and weight/bias gradients against nn.Linear / nn.Embedding /
F.cross_entropy evaluated on the full tensors inside the worker, in fp64.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from harness.distributed import run_distributed
from tessera.parallel import (
    ColumnParallelLinear,
    MetaGroup,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from tessera.parallel.attrs import is_tensor_parallel, partition_dim
from tessera.parallel.comm import gather_tensor
from tests.tolerances import allclose_tols, order_rtol, unit_roundoff

F64 = torch.float64
# fp64 TP layers against the one-process layer: the same sums split over ranks (tests/tolerances.py). The
# longest is 15 (a weight gradient over 3 x 5 tokens); the cross entropy chains the most steps (exp, the
# vocabulary's sum, log, smoothing, the mean over tokens): depth 5. Elementwise: atol = rtol x the tensor's
# largest element (``allclose_tols``), as rounding differences are absolute, of the tensor's scale.
F64_RTOL = order_rtol(F64, 15, 5)  # 1.3e-15


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = F64_RTOL, atol: float | None = None) -> None:
    """Like torch.testing.assert_close (which imports DTensor: a second of start-up per worker);
    ``atol`` defaults to ``rtol`` times ``expected``'s largest magnitude."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (actual.shape, expected.shape)
    diff = (actual - expected).abs().max().item() if actual.numel() else 0.0
    if atol is None:
        atol = allclose_tols(rtol, float(expected.abs().max()) if expected.numel() else 0.0)["atol"]
    assert torch.allclose(actual, expected, rtol=rtol, atol=atol), f"max abs difference {diff:.3e}"


def _randn(*shape: int, seed: int) -> torch.Tensor:
    """The same tensor on every rank, from a private generator."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _shard(t: torch.Tensor, dim: int, tp: int, rank: int) -> torch.Tensor:
    return t.chunk(tp, dim=dim)[rank]


def _groups(rank: int) -> dict[int, object]:
    """tp -> this rank's group; every rank creates every group in the same order."""
    pair = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    whole = dist.new_group([0, 1, 2, 3])
    return {1: None, 2: pair[rank // 2], 4: whole}


def _check_column(group, tp: int, r: int) -> None:
    w, b = _randn(8, 6, seed=1), _randn(8, seed=2)
    x_full, g_out = _randn(3, 5, 6, seed=3), _randn(3, 5, 8, seed=4)
    ref = nn.Linear(6, 8, dtype=F64)
    with torch.no_grad():
        ref.weight.copy_(w)
        ref.bias.copy_(b)
    xr = x_full.clone().requires_grad_()
    yr = ref(xr)
    (yr * g_out).sum().backward()
    for gather in (False, True):
        layer = ColumnParallelLinear(6, 8, bias=True, gather_output=gather, process_group=group, dtype=F64)
        assert layer.weight.shape == (8 // tp, 6) and partition_dim(layer.weight) == 0
        assert partition_dim(layer.bias) == 0
        with torch.no_grad():
            layer.weight.copy_(_shard(w, 0, tp, r))
            layer.bias.copy_(_shard(b, 0, tp, r))
        x = x_full.clone().requires_grad_()
        y = layer(x)
        expect_y = yr if gather else _shard(yr, -1, tp, r)
        _assert_close(y, expect_y)
        (y * (g_out if gather else _shard(g_out, -1, tp, r))).sum().backward()
        _assert_close(x.grad, xr.grad)
        _assert_close(layer.weight.grad, _shard(ref.weight.grad, 0, tp, r))
        _assert_close(layer.bias.grad, _shard(ref.bias.grad, 0, tp, r))


def _check_row(group, tp: int, r: int) -> None:
    w, b = _randn(6, 8, seed=11), _randn(6, seed=12)
    x_full, g_out = _randn(3, 5, 8, seed=13), _randn(3, 5, 6, seed=14)
    ref = nn.Linear(8, 6, dtype=F64)
    with torch.no_grad():
        ref.weight.copy_(w)
        ref.bias.copy_(b)
    xr = x_full.clone().requires_grad_()
    yr = ref(xr)
    (yr * g_out).sum().backward()
    for parallel_input in (True, False):
        layer = RowParallelLinear(8, 6, bias=True, input_is_parallel=parallel_input, process_group=group, dtype=F64)
        assert layer.weight.shape == (6, 8 // tp) and partition_dim(layer.weight) == 1
        assert not is_tensor_parallel(layer.bias)
        with torch.no_grad():
            layer.weight.copy_(_shard(w, 1, tp, r))
            layer.bias.copy_(b)
        x = (_shard(x_full, -1, tp, r) if parallel_input else x_full).clone().requires_grad_()
        y = layer(x)
        _assert_close(y, yr)
        (y * g_out).sum().backward()
        expect_gx = _shard(xr.grad, -1, tp, r) if parallel_input else xr.grad
        _assert_close(x.grad, expect_gx)
        _assert_close(layer.weight.grad, _shard(ref.weight.grad, 1, tp, r))
        _assert_close(layer.bias.grad, ref.bias.grad)


def _check_embedding(group, tp: int, r: int) -> None:
    w = _randn(12, 5, seed=21)
    ids = torch.tensor([[0, 3, 11, 6], [5, 5, 9, 2]])  # hits every rank's range at tp=4
    g_out = _randn(2, 4, 5, seed=22)
    ref = nn.Embedding(12, 5, dtype=F64)
    with torch.no_grad():
        ref.weight.copy_(w)
    yr = ref(ids)
    (yr * g_out).sum().backward()
    layer = VocabParallelEmbedding(12, 5, process_group=group, dtype=F64)
    assert layer.weight.shape == (12 // tp, 5) and partition_dim(layer.weight) == 0
    with torch.no_grad():
        layer.weight.copy_(_shard(w, 0, tp, r))
    y = layer(ids)
    _assert_close(y, yr)
    (y * g_out).sum().backward()
    _assert_close(layer.weight.grad, _shard(ref.weight.grad, 0, tp, r))


def _check_cross_entropy(group, tp: int, r: int) -> None:
    vocab = 12
    logits_full = _randn(2, 7, vocab, seed=31) * 3
    target = torch.randint(0, vocab, (2, 7), generator=torch.Generator().manual_seed(32))
    target[0, 1] = target[1, 4] = -100
    other = int(target[0, 0])  # a real class id used as ignore_index
    for ignore_index, smoothing, reduction in [(-100, 0.0, "mean"), (-100, 0.1, "mean"), (-100, 0.2, "sum"),
                                               (other, 0.1, "mean"), (-100, 0.1, "none")]:
        if ignore_index != -100:
            target = target.masked_fill(target == -100, ignore_index)
        lr = logits_full.clone().requires_grad_()
        ref = F.cross_entropy(lr.view(-1, vocab), target.view(-1), ignore_index=ignore_index,
                              label_smoothing=smoothing, reduction=reduction)
        if reduction == "none":
            ref = ref.view(target.shape)
        g = _randn(*ref.shape, seed=33) if reduction == "none" else torch.tensor(1.7, dtype=F64)
        (ref * g).sum().backward()
        shard = _shard(logits_full, -1, tp, r).clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(shard, target, group, ignore_index=ignore_index,
                                            label_smoothing=smoothing, reduction=reduction)
        _assert_close(loss, ref)
        (loss * g).sum().backward()
        _assert_close(shard.grad, _shard(lr.grad, -1, tp, r))


def _check_tp_invariant_init(group, tp: int) -> None:
    """Shards of a layer built at tp, gathered, are bitwise the tp=1 layer (same seed and name)."""
    rng_before = torch.get_rng_state()
    builders = [
        (lambda g: ColumnParallelLinear(6, 8, process_group=g, init_seed=5, init_name="a.col"), 0),
        (lambda g: RowParallelLinear(8, 6, process_group=g, init_seed=5, init_name="a.row"), 1),
        (lambda g: VocabParallelEmbedding(12, 5, process_group=g, init_seed=5, init_name="a.emb"), 0),
    ]
    for build, dim in builders:
        full = build(None).weight.detach()
        gathered = gather_tensor(build(group).weight.detach(), dim, group)
        assert torch.equal(gathered, full)
        assert full.std() > 0.01  # really initialized
    assert torch.equal(torch.get_rng_state(), rng_before), "init must not touch the ambient RNG"


def _layers_worker(rank: int, world_size: int) -> None:
    groups = _groups(rank)
    for tp, group in groups.items():
        r = rank % tp
        _check_column(group, tp, r)
        _check_row(group, tp, r)
        _check_embedding(group, tp, r)
        _check_cross_entropy(group, tp, r)
        _check_tp_invariant_init(group, tp)


def test_parallel_layers_match_single_process_references_tp_1_2_4():
    run_distributed(_layers_worker, 4)


def test_non_divisible_sizes_name_the_sizes():
    with pytest.raises(ValueError, match="out_features=10 is not divisible by tensor-parallel size 4"):
        ColumnParallelLinear(4, 10, process_group=MetaGroup(4), device="meta")
    with pytest.raises(ValueError, match="in_features=6 is not divisible by tensor-parallel size 4"):
        RowParallelLinear(6, 4, process_group=MetaGroup(4), device="meta")
    with pytest.raises(ValueError, match="=250 is not divisible by tensor-parallel size 4"):
        VocabParallelEmbedding(250, 4, process_group=MetaGroup(4), device="meta")


def test_init_depends_on_seed_and_name_only():
    a = ColumnParallelLinear(5, 7, init_seed=3, init_name="x")
    torch.manual_seed(123)  # the ambient RNG has no say
    b = ColumnParallelLinear(5, 7, init_seed=3, init_name="x")
    c = ColumnParallelLinear(5, 7, init_seed=3, init_name="y")
    d = ColumnParallelLinear(5, 7, init_seed=4, init_name="x")
    assert torch.equal(a.weight, b.weight)
    assert not torch.equal(a.weight, c.weight) and not torch.equal(a.weight, d.weight)
    assert torch.equal(a.bias, torch.zeros(7))


def test_cross_entropy_low_precision_logits_computed_in_fp32():
    logits = (torch.randn(4, 9, 50, generator=torch.Generator().manual_seed(0)) * 4).to(torch.bfloat16)
    target = torch.randint(0, 50, (4, 9), generator=torch.Generator().manual_seed(1))
    x = logits.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(x, target, label_smoothing=0.05)
    assert loss.dtype == torch.float32
    ref_in = logits.float().requires_grad_()
    ref = F.cross_entropy(ref_in.view(-1, 50), target.view(-1), label_smoothing=0.05)
    # both in fp32 from the same (bf16-exact) logits: two orders of exp, the vocabulary's sum (50), log and
    # the mean over 36 tokens
    fp32_rtol = order_rtol(torch.float32, 50, 4)  # 1.2e-6
    _assert_close(loss, ref, rtol=fp32_rtol)
    loss.backward()
    ref.backward()
    assert x.grad.dtype == torch.bfloat16
    # the gradient, computed in fp32, is rounded once to bf16: at most u_bf16 of each element
    _assert_close(x.grad.float(), ref_in.grad, rtol=unit_roundoff(torch.bfloat16) + fp32_rtol)


def test_cross_entropy_all_ignored_mean_is_zero_not_nan():
    x = torch.randn(3, 8, requires_grad=True)
    loss = vocab_parallel_cross_entropy(x, torch.full((3,), -100))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(x.grad, torch.zeros(3, 8))
