"""``model.compile`` (``tessera.model.compile``): compiled decoder blocks against the same model run eagerly.

Reference: an identical model (same seed, same inputs) without ``compile_blocks``; losses, every gradient and
evaluation logits must agree within the rounding that kernel fusion changes: two orders of the same
computation (tests/tolerances.py: fp32 sums up to the ffn hidden size 256; bf16 one rounding per stored
tensor; fp8 the casts that fusion's bf16-ulp moves push across a rounding midpoint), as relative norms. Every case also asserts that the blocks really ran
compiled and that Dynamo found no graph break, the tensor-parallel collectives included (gloo, 2 processes,
both tensor modes, and the shared-memory all-reduce route). On CPU the inductor backend needs a C++
compiler; without one the tests use ``aot_eager`` (Dynamo and AOTAutograd, no code generation).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from harness.distributed import run_distributed
from tessera.config import Config, ConfigError
from tessera.core.job import Job
from tessera.core.naive_amp import NaiveAMPModel, enable_fp8_linears
from tessera.model.args import ModelArgs
from tessera.model.compile import compile_blocks, compiled_blocks
from tessera.model.documents import check_cu_seqlens
from tessera.model.transformer import Transformer
from tessera.parallel import wgrad
from tests.tolerances import mean_loss_rtol, order_rtol, requantize_rtol, transformer_depth

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ, BATCH, VOCAB = 32, 2, 128
PACKED = torch.tensor([0, 10, 32, 50, 57, 64])  # several documents per row, every row boundary a document boundary
STEPS = 3  # step 0 runs eagerly (warm-up), steps 1 and 2 compiled


@functools.cache
def _backend() -> str:
    """inductor where a C++ compiler is found (CI machines may lack one), else aot_eager."""
    from torch._inductor import config

    names = [c for c in config.cpp.cxx if c] + ["g++", "c++", "clang++"]
    return "inductor" if any(shutil.which(c) for c in names) else "aot_eager"


LAYERS = 2
FWD, BWD = transformer_depth(LAYERS), transformer_depth(LAYERS, backward=True)
TOKENS = BATCH * (SEQ - 1)  # the next-token loss's targets


def _loss_rtol(logits_rtol: float, loss: float) -> float:
    """The fp32 cross entropy of logits that differ by ``logits_rtol``: ``mean_loss_rtol`` (logits RMS <= 1
    at initialization), plus the loss's own two sums (log-sum-exp over the vocabulary, mean over tokens)."""
    own = order_rtol(torch.float32, VOCAB, 2)
    return mean_loss_rtol(logits_rtol, logits_norm=(TOKENS * VOCAB) ** 0.5, loss=loss, tokens=TOKENS, vocab=VOCAB) + own


def _tol(dtype: str) -> dict[str, float]:
    """Logits and gradient tolerances of one dtype: fp32 sums up to 256 long (the ffn hidden size), or one
    bf16 rounding per stored tensor (n = 1), over the forward (logits) or forward + backward (gradients).
    Measured (inductor vs eager): fp32 1.5e-7 / 4.5e-7, bf16 5.1e-3 / 8.9e-3."""
    u, n = {"float32": (torch.float32, 256), "bfloat16": (torch.bfloat16, 1)}[dtype]
    return {"logits": order_rtol(u, n, FWD), "grad": order_rtol(u, n, BWD)}  # fp32 6.2e-6 / 8.7e-6, bf16 2.5e-2 / 3.6e-2


def _fp8_tol() -> dict[str, float]:
    """fp8 linears under inductor: fusion moves the values upstream of each cast by up to a bf16 ulp, which
    re-rounds a fraction of them to the neighbouring fp8 value (``requantize_rtol``): e4m3 at the 8 forward
    casts on a path (4 per layer), e5m2 at the 8 backward ones, in quadrature, plus the bf16 bound.
    Measured: loss 5.2e-5, gradients 9.6e-2."""
    e4m3 = requantize_rtol(torch.float8_e4m3fn, 2.0**-8) * (4 * LAYERS) ** 0.5  # 8.8e-2
    e5m2 = requantize_rtol(torch.float8_e5m2, 2.0**-8) * (4 * LAYERS) ** 0.5  # 0.125
    bf16 = _tol("bfloat16")
    return {"logits": bf16["logits"] + e4m3, "grad": bf16["grad"] + (e4m3**2 + e5m2**2) ** 0.5}  # 0.11 / 0.19


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test starts without compiled code or counters (identical layers of earlier tests would count)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def _args(checkpoint: Any = False, **kw: Any) -> ModelArgs:
    return ModelArgs(num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_attention_heads=2, vocab_size=VOCAB,
                     checkpoint=checkpoint, **kw)


def _model(dtype: str, checkpoint: Any = False, *, group: Any = None, mode: str = "mtp", fp32_norm: bool = False,
           fp8: bool = False, **features: Any) -> NaiveAMPModel:
    net = Transformer(_args(checkpoint, parallel_output=False, **features), group, tensor_mode=mode)
    amp = NaiveAMPModel(net, dtype=dtype, sync_buffer=False, use_fp32_norm=fp32_norm)
    if fp8:
        enable_fp8_linears(amp, "tensorwise")
    return amp.train()


def _ids(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))


def _step(model: torch.nn.Module, step: int, cu_seqlens: torch.Tensor | None) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss (next-token cross entropy, written here) and gradients of one forward/backward; grads are cleared."""
    ids = _ids(step)
    logits = model(ids, cu_seqlens=cu_seqlens)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1))
    loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _graph_breaks() -> int:
    """Graph breaks, except the one designed in: CPU attention over packed rows runs eagerly
    (``torch.compiler.disable``), its document buckets take new shapes every batch and would recompile."""
    return sum(n for reason, n in torch._dynamo.utils.counters["graph_break"].items()
               if not ("torch.compiler.disable" in reason and "function _packed " in reason))


def _compare(eager: torch.nn.Module, compiled: torch.nn.Module, tol: dict[str, float], cu_seqlens: torch.Tensor | None,
             evaluate: bool = True) -> dict[str, float]:
    """Run both models STEPS times on the same inputs; assert agreement (``tol``: logits and gradient bounds,
    the loss's follows from the logits' unless given); return the worst relative errors."""
    worst = {"loss": 0.0, "grad": 0.0, "logits": 0.0}
    for step in range(STEPS):
        le, ge = _step(eager, step, cu_seqlens)
        lc, gc = _step(compiled, step, cu_seqlens)
        loss_tol = tol["loss"] if "loss" in tol else _loss_rtol(tol["logits"], le)
        assert abs(lc - le) <= loss_tol * abs(le), (step, le, lc)
        worst["loss"] = max(worst["loss"], abs(lc - le) / abs(le))
        for name in ge:
            err = _rel(gc[name], ge[name])
            assert err <= tol["grad"], (step, name, err)
            worst["grad"] = max(worst["grad"], err)
    if evaluate:  # evaluation forwards: the first warms up eagerly, the second is compiled
        eager.eval(), compiled.eval()
        with torch.no_grad():
            for step in range(2):
                want, got = eager(_ids(10 + step), cu_seqlens=cu_seqlens), compiled(_ids(10 + step), cu_seqlens=cu_seqlens)
                err = _rel(got.float(), want.float())
                assert err <= tol["logits"], ("eval", step, err)
                worst["logits"] = max(worst["logits"], err)
        eager.train(), compiled.train()
    return worst


def _check_compiled_ran() -> None:
    """Graphs were compiled and run, without any graph break (a break in a block would split it)."""
    stats = torch._dynamo.utils.counters["stats"]
    assert stats["unique_graphs"] >= 2, dict(stats)  # the backend probe's graph, and at least one block graph
    assert _graph_breaks() == 0, dict(torch._dynamo.utils.counters["graph_break"])


CASES = [  # (dtype, checkpoint, packed documents), each with the test backend (inductor where it can compile)
    ("bfloat16", False, True),
    ("float32", False, True),
    ("bfloat16", True, False),
    ("bfloat16", "selective", True),
    ("float32", "selective", False),
]
# the quick run traces without code generation (seconds); the slow run compiles with the test backend
PARAMS = [pytest.param("aot_eager", "bfloat16", False, True, id="aot_eager-bfloat16-False-True"),
          *(pytest.param(None, *c, marks=pytest.mark.slow) for c in CASES)]


@pytest.mark.parametrize("backend,dtype,checkpoint,packed", PARAMS)
def test_compiled_blocks_match_eager(backend, dtype, checkpoint, packed, caplog):
    backend = backend or _backend()
    caplog.set_level(logging.INFO, logger="tessera")
    eager, compiled = _model(dtype, checkpoint), _model(dtype, checkpoint)
    assert compile_blocks(compiled, backend=backend) == 2
    _compare(eager, compiled, _tol(dtype), PACKED if packed else None)
    _check_compiled_ran()
    assert compiled_blocks(compiled) == 2
    compile_lines = [r.getMessage() for r in caplog.records if "graph(s) compiled for the training forward" in r.getMessage()]
    assert len(compile_lines) == 1 and f"backend {backend}" in compile_lines[0], compile_lines


def test_family_features_compile_without_a_break():
    """Qwen3's q/k norms and head_dim, Qwen2's q/k/v biases and YaRN inside the traced block, with fp32 norms."""
    features = dict(head_dim=24, qk_norm=True, qkv_bias=True,
                    rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})
    eager = _model("bfloat16", "selective", fp32_norm=True, **features)
    compiled = _model("bfloat16", "selective", fp32_norm=True, **features)
    compile_blocks(compiled, backend="aot_eager")
    _compare(eager, compiled, _tol("bfloat16"), PACKED)
    _check_compiled_ran()


@pytest.mark.slow
def test_fp32_marked_norms_in_a_bf16_model():
    eager, compiled = _model("bfloat16", fp32_norm=True), _model("bfloat16", fp32_norm=True)
    assert compiled.model.layers[0].attention_norm.weight.dtype == torch.float32
    compile_blocks(compiled, backend=_backend())
    _compare(eager, compiled, _tol("bfloat16"), PACKED)
    _check_compiled_ran()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_fp8_linears(backend):
    """Traced without code generation (aot_eager) the fp8 linears compute exactly what eager does. With
    inductor, fusion moves values upstream by bf16 ulps and the e5m2 gradients (2 mantissa bits) round some of
    them to the neighbouring fp8 value: the loss (e4m3 forward) still agrees to 1e-3, the gradients only to
    about the size of fp8's own rounding (5-10 % in norm, as far as bf16 is from fp8 here)."""
    if backend == "inductor" and _backend() != "inductor":
        pytest.skip("no C++ compiler for inductor")
    eager, compiled = _model("bfloat16", fp8=True), _model("bfloat16", fp8=True)
    compile_blocks(compiled, backend=backend)
    if backend == "aot_eager":  # the same kernels in the same order: no rounding differs (was 1e-6)
        _compare(eager, compiled, {"loss": 0.0, "logits": 0.0, "grad": 0.0}, PACKED)
    else:
        _compare(eager, compiled, _fp8_tol(), PACKED, evaluate=False)
    _check_compiled_ran()


def test_selective_checkpoint_keeps_gemm_outputs_when_compiled():
    """Compiled, the selective policy runs on the traced graph: backward runs each of a layer's 7 GEMMs twice
    (input and weight gradients) and recomputes none of them (q, k, v, gate, up are kept, as in eager). The
    weight gradients' GEMMs are ``tessera::weight_grad`` calls (``tessera.parallel.wgrad``), one per weight."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from tessera.model.attention import plan_attention
    from tessera.model.forward_info import ForwardContext
    from tessera.model.rotary import rotary_cos_sin
    from tessera.model.transformer import DecoderLayer

    backward_graphs: list[Any] = []

    def keep_backward(gm: Any, inputs: Any) -> Any:
        backward_graphs.append(gm)
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=lambda gm, inputs: make_boxed_func(gm.forward), bw_compiler=keep_backward)
    args = _args("selective")
    layer = Transformer(args).layers[0]
    x = torch.randn(BATCH, SEQ, 64, requires_grad=True)
    cos, sin = rotary_cos_sin(torch.arange(SEQ).expand(BATCH, SEQ), args.head_dim, args.rope_base)
    ctx = ForwardContext(cos, sin, plan_attention(None, BATCH, SEQ, True), selective=True)
    DecoderLayer.forward(layer, x, ctx)  # eager first, as compile_blocks does (log-once messages)
    torch.compile(DecoderLayer.forward, backend=backend, dynamic=False)(layer, x, ctx).sum().backward()
    gemms = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    if wgrad.COMPILED_FUSION:
        gemms += (torch.ops.tessera.weight_grad.default,)
    counts = [sum(n.op == "call_function" and n.target in gemms for n in gm.graph.nodes) for gm in backward_graphs]
    assert counts == [14], counts
    assert _graph_breaks() == 0


def test_a_graph_break_inside_the_gemm_marks_is_a_clean_break():
    """Code that Dynamo cannot trace inside ``keep_gemm_outputs`` (a fused kernel, a collective) splits the graph
    there; it must not throw the whole function back to eager."""
    from tessera.model.recompute import keep_gemm_outputs

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        with keep_gemm_outputs():
            y = x @ w
            torch._dynamo.graph_break()
            y = y @ w
        return y.relu()

    x, w = torch.randn(4, 4), torch.randn(4, 4)
    torch.testing.assert_close(torch.compile(f, backend="eager")(x, w), f(x, w))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2  # both sides of the break compiled


def test_generation_and_cache_forwards_stay_eager():
    from tessera.model.kv_cache import generate_ids_cached

    eager, compiled = Transformer(_args()), Transformer(_args())
    compile_blocks(compiled, backend="aot_eager")
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # the backend probe's
    prompt = [1, 2, 3]
    assert generate_ids_cached(compiled, prompt, 6, temperature=0.0) == generate_ids_cached(eager, prompt, 6,
                                                                                             temperature=0.0)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_meta_model_is_not_compiled():
    model = Transformer(_args(), device="meta")
    assert compile_blocks(model) == 0 and compiled_blocks(model) == 0


def test_bad_settings_name_the_key():
    model = Transformer(_args())
    with pytest.raises(ValueError, match=r"model.compile.backend='tvm'"):
        compile_blocks(model, backend="tvm")
    with pytest.raises(ValueError, match=r"model.compile.mode='max-autotune'.*backend='aot_eager'"):
        compile_blocks(model, backend="aot_eager", mode="max-autotune")
    tiny = os.path.join(ROOT, "configs", "tiny.py")
    with pytest.raises(ConfigError, match=r"model.compile.backend"):
        Config.from_file(tiny, ["model.compile.backend='tvm'"])
    with pytest.raises(ConfigError, match=r"model.compile.mode='reduce-overhead'.*model.compile.backend='eager'"):
        Config.from_file(tiny, ["model.compile.enabled=True", "model.compile.mode='reduce-overhead'",
                                "model.compile.backend='eager'"])
    compile_blocks(model, backend="eager")
    with pytest.raises(ValueError, match="compiled already"):
        compile_blocks(model, backend="eager")


@pytest.mark.slow
def test_inductor_without_a_cpp_compiler_fails_in_one_line():
    code = ("import torch\nfrom tessera.model.args import ModelArgs\nfrom tessera.model.transformer import Transformer\n"
            "from tessera.model.compile import compile_blocks\n"
            "m = Transformer(ModelArgs(num_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=64))\n"
            "try:\n    compile_blocks(m, backend='inductor')\nexcept RuntimeError as e:\n    print('ERROR', e)\n")
    env = dict(os.environ, CXX="/nonexistent/c++", TORCHINDUCTOR_FORCE_DISABLE_CACHES="1", PYTHONPATH=ROOT,
               TORCHINDUCTOR_CACHE_DIR=os.path.join(ROOT, ".pytest_cache", "no-cxx-inductor"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300).stdout
    lines = [line for line in out.splitlines() if line.startswith("ERROR")]
    assert lines and "model.compile.backend='inductor' cannot compile on cpu" in lines[0], out
    assert "model.compile.enabled=False" in lines[0] and len(lines[0]) < 600


def test_build_training_stack_compiles_the_blocks_and_a_dry_run_does_not(monkeypatch):
    """With model.compile on, a real stack's blocks are compiled; the dry run of the same config (meta
    parameters, one full step) builds its stack through the same builder, whose compile_blocks sets up no
    block, and Dynamo captures no frame and compiles no graph while it runs."""
    from torch._dynamo.utils import counters

    from tessera.plan import dry_run
    from tessera.train import builder
    from tessera.train.builder import build_training_stack

    cfg = Config.from_file(os.path.join(ROOT, "configs", "tiny.py"),
                           ["model.compile.enabled=True", "model.compile.backend='aot_eager'"])
    stack = build_training_stack(cfg, Job.of(cfg), sync_buffer=False)
    assert compiled_blocks(stack.inner_model) == cfg.model.num_layers > 0
    calls = []

    def recording(model, **kw):
        calls.append((model, compile_blocks(model, **kw)))
        return calls[-1][1]

    monkeypatch.setattr(builder, "compile_blocks", recording)
    before = (counters["frames"]["total"], counters["stats"]["unique_graphs"])
    trace = dry_run(cfg, 2)
    assert trace.persistent_total > 0 and trace.backward_peak > 0  # the step ran
    assert [(n, compiled_blocks(model)) for model, n in calls] == [(0, 0)]  # asked once, set up nothing
    assert (counters["frames"]["total"], counters["stats"]["unique_graphs"]) == before, "the dry run compiled"


# ---------------------------------------------------------------------------------------------- TP = 2 (gloo)
def _tp2_worker(rank: int, world: int, modes: list[str], checkpoints: list[Any], shm_for: list[Any]) -> dict[str, Any]:
    """Compiled against eager at TP=2 for each mode and checkpointing; the cases in ``shm_for`` run over the
    node-local shared-memory route (train.py's CPU default), the others over gloo's functional collectives."""
    import torch.distributed as dist

    from tessera.parallel.comm import use_fast_collectives

    group = dist.new_group([0, 1])
    route = None
    if shm_for:
        from tessera.parallel.shm_comm import ShmCollectives

        route, why = ShmCollectives.create(group)
        assert route is not None, why
    out: dict[str, Any] = {}
    try:
        for mode in modes:
            for checkpoint in checkpoints:
                routed = route is not None and checkpoint in shm_for
                use_fast_collectives(group, route if routed else None)
                torch._dynamo.reset()
                torch._dynamo.utils.counters.clear()
                eager = _model("bfloat16", checkpoint, group=group, mode=mode)
                compiled = _model("bfloat16", checkpoint, group=group, mode=mode)
                # inductor (its C++ build is most of this test's time) for train.py's CPU default, the shared-memory
                # route; checkpointing is decided before code generation (AOTAutograd's partitioner, which
                # aot_eager runs too), so those cases trace, partition and compare through aot_eager
                compile_blocks(compiled, backend=_backend() if routed else "aot_eager")
                worst = _compare(eager, compiled, _tol("bfloat16"), PACKED, evaluate=checkpoint is False)
                calls: dict[str, Any] = {}
                if routed:  # every TP collective of a compiled step takes the route, as eager ones do
                    for name, model in (("eager", eager), ("compiled", compiled)):
                        calls[name] = _route_calls(route, lambda model=model: _step(model, 0, PACKED))
                    calls["layers"] = compiled_blocks(compiled)
                out[f"{mode} {checkpoint}"] = (worst, dict(torch._dynamo.utils.counters["stats"]), _graph_breaks(),
                                               calls)
    finally:
        if route is not None:
            use_fast_collectives(group, None)
            route.close()
    return out


def _route_calls(route: Any, run: Any) -> dict[str, int]:
    """How many times ``run()`` calls each collective of the shared-memory route."""
    calls = {"all_reduce": 0, "all_gather": 0}
    originals = {name: getattr(route, name) for name in calls}

    def counted(name: str) -> Any:
        def call(*args: Any) -> Any:
            calls[name] += 1
            return originals[name](*args)
        return call

    for name in calls:
        setattr(route, name, counted(name))
    try:
        run()
    finally:
        for name, fn in originals.items():
            setattr(route, name, fn)
    return calls


def _check_tp2(results: list[dict[str, Any]]) -> None:
    for per_rank in results:
        for name, (worst, stats, breaks, calls) in per_rank.items():
            assert breaks == 0, (name, breaks)
            if calls:
                eager, compiled = calls["eager"], calls["compiled"]
                assert compiled["all_reduce"] == eager["all_reduce"] > 0, (name, calls)
                if name.startswith("msp"):  # per layer: 2 forward gathers, 2 of the gradients, 2 re-gathers for
                    # the weight gradients, which the compiled backward takes from the forward's gathered input
                    assert compiled["all_gather"] == eager["all_gather"] - 2 * calls["layers"] > 0, (name, calls)
                else:  # mtp gathers only the logits, outside the blocks
                    assert compiled["all_gather"] == eager["all_gather"] == 1, (name, calls)
            assert stats["unique_graphs"] >= 2, (name, stats)
            assert worst["grad"] <= _tol("bfloat16")["grad"], (name, worst)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["mtp", "msp"])
def test_tp2_compiled_matches_eager(mode):
    """Both tensor modes, no / full / selective checkpointing, packed documents: the collectives are traced, so
    no graph break anywhere. Full and selective checkpointing go through gloo (torch.distributed calls become
    functional collectives, as NCCL's do on a GPU), compiled with aot_eager; no checkpointing goes through the
    node-local shared-memory route (train.py's CPU default), compiled with inductor, one custom op per collective
    inside the graph (msp's all-gathers and
    reduce-scatters too), and every TP collective of a compiled step takes the route as eager ones do."""
    from tessera.parallel.shm_comm import shm_unavailable_reason

    shm_for = [False] if shm_unavailable_reason(2) is None else []
    results = run_distributed(_tp2_worker, 2, [mode], [False, True, "selective"], shm_for, timeout=900)
    _check_tp2(results)
    assert all(bool(per_rank[f"{mode} False"][3]) == bool(shm_for) for per_rank in results)


# ---------------------------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("checkpoint", [False, "selective"])
def test_cuda_bf16_compiled_matches_eager(checkpoint):
    torch.manual_seed(0)
    eager, compiled = _model("bfloat16", checkpoint).cuda(), _model("bfloat16", checkpoint).cuda()
    compile_blocks(compiled, backend="inductor")
    cu = PACKED.cuda()
    for step in range(STEPS):
        ids = _ids(step).cuda()
        # a device cu_seqlens comes with its longest document from the host (the model never reads it back)
        max_seqlen = check_cu_seqlens(PACKED, *ids.shape)
        losses, grads = [], []
        for m in (eager, compiled):
            logits = m(ids, cu_seqlens=cu, max_seqlen=max_seqlen)
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1))
            loss.backward()
            losses.append(loss.item())
            grads.append({n: p.grad.float().clone() for n, p in m.named_parameters()})
            m.zero_grad(set_to_none=True)
        tol = _tol("bfloat16")
        assert abs(losses[1] - losses[0]) <= _loss_rtol(tol["logits"], losses[0]) * abs(losses[0])
        for name in grads[0]:
            assert _rel(grads[1][name], grads[0][name]) <= tol["grad"], name
    _check_compiled_ran()
