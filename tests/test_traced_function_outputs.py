"""No autograd.Function forward inside a compiled block returns a tensor that is also one of its intermediates.

torch 2.11 (the GPU machines' torch) traces a Function's forward with its intermediates as extra outputs,
and where an output is one of them -- written in place, filled by an ``out=`` op or a collective, or handed
back by a no-op ``.to`` -- it routes the output's gradient to the intermediate's slot: the gradients of the
Function's inputs come back zero (pytorch/pytorch#180642). On an H100 that zeroed every ``ffn_norm``, ``w1``
and ``w3`` gradient of compiled blocks (BENCHMARKS.md section 18). torch 2.12+ hides the defect, so the
compiled-vs-eager tests of ``tests/test_compile.py`` pass here either way; this test looks for its cause
instead (``harness.traced_aliases``): every Function a decoder block calls, traced by Dynamo, in each
precision, GEMM route, checkpointing mode, attention path and tensor-parallel mode (TP=2 over torch's fake
process group, both collective routes), must return only tensors no intermediate shares storage with.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from harness import traced_aliases
from harness.distributed import fake_process_group
from tessera.core.naive_amp import NaiveAMPModel, enable_fp8_linears
from tessera.model import cpu_attention
from tessera.model.args import ModelArgs
from tessera.model.attention import plan_attention
from tessera.model.forward_info import ForwardContext
from tessera.model.rotary import rotary_cos_sin
from tessera.model.transformer import DecoderLayer, Transformer
from tessera.parallel import comm

pytestmark = pytest.mark.skipif(not traced_aliases.installed(), reason="this torch's Dynamo lacks the hooks")

BATCH, SEQ, HIDDEN = 2, 16, 64
PACKED = torch.tensor([0, 5, 16, 23, 32])  # two documents a row


def _layer(dtype: str, checkpoint: Any = False, group: Any = None, mode: str = "mtp", fp8: str | None = None,
           **features: Any) -> tuple[DecoderLayer, ModelArgs]:
    args = ModelArgs(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, num_kv_attention_heads=2,
                     vocab_size=128, checkpoint=checkpoint, parallel_output=False, **features)
    amp = NaiveAMPModel(Transformer(args, group, tensor_mode=mode), dtype=dtype, sync_buffer=False)
    if fp8 is not None:
        backend = "emulated"
        if ":" in fp8:
            fp8, backend = fp8.split(":")
        enable_fp8_linears(amp, fp8, backend=backend)
    layer = amp.model.layers[0]
    return layer.train(), args


def _trace(layer: DecoderLayer, args: ModelArgs, dtype: torch.dtype, packed: bool, selective: bool,
           mode: str = "mtp", tp: int = 1) -> traced_aliases.Recorder:
    """Dynamo traces the block's forward once (backend "eager": no code generation) under the recorder."""
    seq = SEQ // tp if mode == "msp" else SEQ
    x = torch.randn(BATCH, seq, HIDDEN, dtype=dtype, requires_grad=True)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    cos, sin = rotary_cos_sin(positions, args.head_dim, args.rope_base)
    plan = plan_attention(PACKED if packed else None, BATCH, SEQ, True)
    ctx = ForwardContext(cos, sin, plan, sequence_parallel=mode == "msp", selective=selective)
    if packed:
        plan.document_buckets()
        cpu_attention.outside_graphs()  # made before tracing, as compile_blocks does
    DecoderLayer.forward(layer, x, ctx)  # eagerly first, as compile_blocks does
    torch._dynamo.reset()
    with traced_aliases.recording() as recorder:
        out = torch.compile(DecoderLayer.forward, backend="eager", dynamic=False)(layer, x, ctx)
    out.float().sum().backward()
    return recorder


def _assert_clean(recorder: traced_aliases.Recorder) -> None:
    assert recorder.forwards > 0, "no autograd.Function was traced: the recorder saw nothing"
    assert not recorder.findings, "\n".join(f"{f.where}: returns the storage of {f.intermediate}"
                                            for f in recorder.findings)


# each dtype with and without selective checkpointing, each attention path (packed rows: the CPU kernel outside
# the graph; one document a row: its causal kernel, a Function inside it) once per dtype
@pytest.mark.parametrize("dtype,checkpoint,packed", [("float32", False, False), ("float32", "selective", True),
                                                     ("bfloat16", False, True), ("bfloat16", "selective", False)])
def test_one_process(dtype, checkpoint, packed):
    layer, args = _layer(dtype, checkpoint)
    _assert_clean(_trace(layer, args, getattr(torch, dtype), packed, checkpoint == "selective"))


@pytest.mark.parametrize("fp8", ["tensorwise", "rowwise", "rowwise:scaled_mm", "mxfp8", "nvfp4"])
def test_low_precision_gemm_routes(fp8):
    layer, args = _layer("bfloat16", fp8=fp8)
    _assert_clean(_trace(layer, args, torch.bfloat16, False, False))


def test_family_features():
    layer, args = _layer("float32", qk_norm=True, qkv_bias=True)
    _assert_clean(_trace(layer, args, torch.float32, False, False))


class _IdentityRoute:
    """A fast-collective route whose collectives return their input (values do not matter here)."""

    def supports(self, x: torch.Tensor, op: Any) -> bool:
        return True

    def all_reduce(self, x: torch.Tensor, op: Any) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([x, x])


@pytest.fixture
def fake_tp2():
    """A 2-rank group of torch's fake backend, in this process (its collectives return at once)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with fake_process_group("fake", 2):
        yield dist.group.WORLD


@pytest.mark.parametrize("mode", ["mtp", "msp"])
@pytest.mark.parametrize("route", ["torch.distributed", "fast"])
def test_tensor_parallel(fake_tp2, mode, route):
    """bf16 only: the collectives' Functions take the same path in every dtype."""
    dtype = "bfloat16"
    layer, args = _layer(dtype, group=fake_tp2, mode=mode)
    if route == "fast":
        comm.use_fast_collectives(fake_tp2, _IdentityRoute())
    try:
        _assert_clean(_trace(layer, args, getattr(torch, dtype), True, False, mode=mode, tp=2))
    finally:
        comm.use_fast_collectives(fake_tp2, None)
