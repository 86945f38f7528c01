"""NaiveAMPModel: casting, fp32 islands (by attribute, by name, by norm switch), outputs, no dist needed."""

import copy

import pytest
import torch
from torch import nn

from tessera.config import ConfigError
from tessera.core.naive_amp import (
    NaiveAMPModel,
    fp32_module_names,
    mark_fp32_modules,
    mark_fp32_norms,
    module_has_fp32_attr,
    naive_amp_for,
    set_fp32_attr_to_module,
)
from tessera.precision.plan import PrecisionPlan


class MlpModel(nn.Module):  # verbatim from DESIGN.md
    def __init__(self):
        super().__init__()
        self.linear1 = nn.Linear(4, 1, bias=False)
        self.linear2 = nn.Linear(1, 4, bias=False)

    def forward(self, x):
        return self.linear2(self.linear1(x))


def _record_inputs(module, store, key):
    module.register_forward_hook(lambda m, args, out: store.__setitem__(key, (args[0].dtype, out.dtype)))


def test_design_example_bf16():
    torch.manual_seed(0)
    model = MlpModel()
    w1, w2 = model.linear1.weight.detach().clone(), model.linear2.weight.detach().clone()
    set_fp32_attr_to_module(model.linear2)
    assert module_has_fp32_attr(model.linear2) and not module_has_fp32_attr(model.linear1)
    model = NaiveAMPModel(model=model, output_to_fp32=True, dtype=torch.bfloat16, sync_buffer=False)
    assert model.model.linear1.weight.dtype == torch.bfloat16
    assert model.model.linear2.weight.dtype == torch.float32
    seen = {}
    _record_inputs(model.model.linear1, seen, "linear1")
    _record_inputs(model.model.linear2, seen, "linear2")
    x = torch.randn(3, 4)
    out = model(x)
    assert seen["linear1"] == (torch.bfloat16, torch.bfloat16)
    assert seen["linear2"][0] == torch.float32  # the fp32 module receives fp32 input
    assert out.dtype == torch.float32
    # independent reference: bf16 first layer, fp32 second layer, computed by hand
    h = (x.bfloat16() @ w1.bfloat16().t()).float()
    # the marked module's output is the model's output and output_to_fp32 asks for fp32: it comes back
    # as computed, not rounded to bf16 and upcast
    ref = h @ w2.t()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    out.sum().backward()
    assert model.model.linear1.weight.grad.dtype == torch.bfloat16
    assert model.model.linear2.weight.grad.dtype == torch.float32


@pytest.mark.parametrize("dtype", ["torch.tf32", torch.float32, "fp32"])
def test_fp32_and_tf32_cast_nothing(dtype):
    torch.manual_seed(0)
    ref = MlpModel()
    model = copy.deepcopy(ref)
    set_fp32_attr_to_module(model.linear2)
    wrapped = NaiveAMPModel(model, dtype=dtype, sync_buffer=False)
    for p, q in zip(wrapped.parameters(), ref.parameters()):
        assert p.dtype == torch.float32 and torch.equal(p, q)
    x = torch.randn(2, 4)
    assert torch.equal(wrapped(x), ref(x))


class Block(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.attention_norm = nn.LayerNorm(d)
        self.wq = nn.Linear(d, d)
        self.ffn_norm = nn.LayerNorm(d)
        self.w1 = nn.Linear(d, d)

    def forward(self, x):
        return self.w1(self.ffn_norm(self.wq(self.attention_norm(x))))


class RMSNormLike(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.register_buffer("eps", torch.tensor(1e-6))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class TinyLM(nn.Module):
    def __init__(self, vocab=16, d=8):
        super().__init__()
        self.embedding = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([Block(d), Block(d)])
        self.norm = RMSNormLike(d)
        self.output = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        h = self.embedding(ids)
        for layer in self.layers:
            h = layer(h)
        return {"logits": self.output(self.norm(h)), "aux": [h, ids]}


def test_mark_by_patterns_and_nested_outputs():
    model = TinyLM()
    marked = mark_fp32_modules(model, ["*norm*", "output"])
    assert set(marked) == {"layers.0.attention_norm", "layers.0.ffn_norm", "layers.1.attention_norm",
                           "layers.1.ffn_norm", "norm", "output"}
    amp = NaiveAMPModel(model, dtype="fp16", sync_buffer=False)
    dtypes = {n: p.dtype for n, p in amp.model.named_parameters()}
    for n, dt in dtypes.items():
        want = torch.float32 if ("norm" in n or n.startswith("output")) else torch.float16
        assert dt == want, n
    assert amp.model.norm.eps.dtype == torch.float32  # buffers of marked modules stay fp32 too
    seen = {}
    _record_inputs(amp.model.layers[0].wq, seen, "wq")  # right after a marked norm
    _record_inputs(amp.model.layers[0].ffn_norm, seen, "ffn_norm")
    ids = torch.randint(0, 16, (2, 5))
    out = amp(ids)
    assert seen["wq"] == (torch.float16, torch.float16)  # the norm's output went back to fp16
    assert seen["ffn_norm"][0] == torch.float32
    assert out["logits"].dtype == torch.float32 and out["aux"][0].dtype == torch.float32
    assert out["aux"][1].dtype == torch.int64  # integer tensors are never cast
    amp_raw = NaiveAMPModel(TinyLM(), dtype="fp16", sync_buffer=False, output_to_fp32=False)
    assert amp_raw(ids)["logits"].dtype == torch.float16


def test_unknown_pattern_is_a_clear_error():
    with pytest.raises(ConfigError, match="outptu"):
        mark_fp32_modules(TinyLM(), ["outptu"])


def test_use_fp32_norm_by_class_and_name():
    model = TinyLM()
    marked = mark_fp32_norms(model)
    assert "norm" in marked and "layers.1.ffn_norm" in marked
    assert all(module_has_fp32_attr(model.get_submodule(n)) for n in marked)
    assert not module_has_fp32_attr(model.output)
    precision = PrecisionPlan.of("torch.bfloat16", use_fp32_norm=True, fp32_modules=("output",))
    amp = naive_amp_for(TinyLM(), precision, sync_buffer=False)
    assert fp32_module_names(amp) >= {"norm", "output", "layers.0.attention_norm"}
    assert amp.model.embedding.weight.dtype == torch.bfloat16
    assert amp.model.output.weight.dtype == torch.float32
    assert amp.model.layers[1].ffn_norm.weight.dtype == torch.float32
    assert amp(torch.randint(0, 16, (1, 4)))["logits"].dtype == torch.float32


def test_nested_marks_do_not_cast_back_inside_fp32():
    model = TinyLM()
    set_fp32_attr_to_module(model.layers[0])
    set_fp32_attr_to_module(model.layers[0].attention_norm)  # nested mark inside a marked block
    amp = NaiveAMPModel(model, dtype="bf16", sync_buffer=False)
    seen = {}
    _record_inputs(amp.model.layers[0].wq, seen, "wq")
    amp(torch.randint(0, 16, (1, 3)))
    assert seen["wq"] == (torch.float32, torch.float32)


def test_tp_tags_and_parameter_identity_survive_cast():
    from tessera.parallel.attrs import partition_dim, set_tensor_parallel_attrs

    model = TinyLM()
    set_tensor_parallel_attrs(model.output.weight, 0)
    before = list(model.parameters())
    amp = NaiveAMPModel(model, dtype="bf16", sync_buffer=False)
    assert all(a is b for a, b in zip(before, amp.model.parameters()))
    assert partition_dim(amp.model.output.weight) == 0


def test_sync_buffer_is_a_no_op_without_distributed(monkeypatch):
    """No process group: sync_buffer=True runs no collective, leaves the buffers as they were and gives the
    same output as sync_buffer=False on an identical model."""
    import torch.distributed as dist

    assert not dist.is_initialized()

    def no_collective(*args, **kwargs):
        raise AssertionError("sync_buffer ran a collective without a process group")

    monkeypatch.setattr(dist, "all_reduce", no_collective)
    model = TinyLM()
    with torch.no_grad():
        model.norm.eps.fill_(0.25)  # a buffer an average could change if it were synced
    twin = copy.deepcopy(model)
    synced = NaiveAMPModel(model, dtype="bf16", sync_buffer=True)
    plain = NaiveAMPModel(twin, dtype="bf16", sync_buffer=False)
    buffers = {n: b.clone() for n, b in synced.model.named_buffers()}
    ids = torch.randint(0, 16, (1, 3))
    out, ref = synced(ids), plain(ids)
    assert torch.equal(out["logits"], ref["logits"])
    assert all(torch.equal(b, buffers[n]) for n, b in synced.model.named_buffers()) and buffers


# ---------------------------------------------------------------- the decoder's precision corners
from tessera.model import build_model  # noqa: E402
from tessera.model.generation import generate_ids  # noqa: E402
from tessera.model.kv_cache import KVCache, forward_with_cache, generate_ids_cached  # noqa: E402
from tests.tolerances import allclose_tols, order_rtol, precision_rtol, transformer_depth  # noqa: E402

SMALL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_kv_attention_heads=2, vocab_size=64,
             mlp_ratio=2.0, multiple_of=16, use_flash_attn=False)


def _decoder(**overrides):
    return build_model({**SMALL, **overrides}, seed=3)


@pytest.mark.parametrize("marks", [["output"], ["embedding"]])
def test_tied_weight_with_one_side_fp32_is_a_config_error_naming_both(marks):
    with pytest.raises(ConfigError) as e:
        NaiveAMPModel(_decoder(tie_word_embeddings=True), dtype=torch.bfloat16, fp32_modules=marks, sync_buffer=False)
    assert "embedding.weight" in str(e.value) and "output.weight" in str(e.value)


def test_tied_weight_marked_on_both_sides_is_fp32_and_the_residual_stream_stays_bf16():
    model = NaiveAMPModel(_decoder(tie_word_embeddings=True), dtype=torch.bfloat16,
                          fp32_modules=["embedding", "output"], sync_buffer=False)
    inner = model.model
    assert inner.output.weight is inner.embedding.weight and inner.embedding.weight.dtype == torch.float32
    seen = {}
    inner.layers[0].register_forward_pre_hook(lambda m, args: seen.__setitem__("h", args[0].dtype))
    logits = model(torch.randint(0, 64, (2, 8)))
    assert seen["h"] == torch.bfloat16 and logits.dtype == torch.float32
    # fp32 and tf32 store everything in fp32: the same marks cannot conflict there
    NaiveAMPModel(_decoder(tie_word_embeddings=True), dtype=torch.float32, fp32_modules=["output"], sync_buffer=False)


def test_fp32_head_logits_are_not_rounded_to_bf16():
    """Independent reference: the fp32 head applied by hand to the bf16 hidden state."""
    torch.manual_seed(0)
    model = NaiveAMPModel(_decoder(), dtype=torch.bfloat16, fp32_modules=["output"], sync_buffer=False)
    inner = model.model
    with torch.no_grad():
        inner.output.weight.mul_(40.0)  # logits of size ~10-20, where bf16 rounding is ~0.06
    hidden = {}
    inner.norm.register_forward_hook(lambda m, args, out: hidden.__setitem__("h", out))
    logits = model(torch.randint(0, 64, (2, 8)))
    ref = hidden["h"].float() @ inner.output.weight.t()
    assert logits.abs().max() > 8
    # the same fp32 GEMM (32-long sums) in two orders, atol at the logits' scale (measured: bitwise)
    torch.testing.assert_close(logits, ref, **allclose_tols(order_rtol(torch.float32, SMALL["hidden_size"]),
                                                            float(ref.abs().max())))  # rtol 4.8e-7
    assert not torch.equal(logits, ref.bfloat16().float())  # the old rounding would differ


@pytest.mark.parametrize("marks,head_dtype", [(["output"], torch.float32), (["norm"], torch.bfloat16),
                                              ([], torch.bfloat16)])
def test_the_head_dtype_is_decided_once_and_handed_to_the_decoder(marks, head_dtype):
    model = NaiveAMPModel(_decoder(), dtype=torch.bfloat16, fp32_modules=marks, sync_buffer=False)
    assert model.head_dtype == model.model.head_dtype == head_dtype
    assert _decoder().head_dtype is None  # unwrapped: the head computes in the hidden state's dtype


def test_fp32_head_fused_with_the_loss_computes_in_fp32():
    """The head fused with the loss never calls the head module (no hooks): it takes the same decision.
    Independent reference: the per-token cross-entropy in fp64 of the fp32 head applied by hand to the bf16
    hidden state; the bf16 head's loss lies far outside the bound."""
    from tessera.parallel.loss import LossSpec

    torch.manual_seed(0)
    model = NaiveAMPModel(_decoder(), dtype=torch.bfloat16, fp32_modules=["output"], sync_buffer=False)
    inner = model.model
    with torch.no_grad():
        inner.output.weight.mul_(40.0)  # logits of size ~10-20, where bf16 rounding is ~0.06
    hidden = {}
    inner.norm.register_forward_hook(lambda m, args, out: hidden.__setitem__("h", out.detach()))
    ids, labels = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    loss = model(ids, labels=labels, loss=LossSpec(reduction="none")).detach()
    assert loss.dtype == torch.float32
    weight = inner.output.weight.detach()

    def token_losses(logits):
        return torch.nn.functional.cross_entropy(logits.double().flatten(0, 1), labels.flatten(), reduction="none")

    ref = token_losses(hidden["h"].double() @ weight.double().t()).view_as(loss)
    scale = float((hidden["h"].double() @ weight.double().t()).abs().max())
    # one fp32 GEMM (32-long sums) and a log-sum-exp over the vocabulary, against fp64; atol at the logits' scale
    tols = allclose_tols(2 * precision_rtol(torch.float32, SMALL["hidden_size"] + SMALL["vocab_size"]), scale)
    torch.testing.assert_close(loss.double(), ref, **tols)
    bf16 = token_losses((hidden["h"] @ weight.bfloat16().t()).float()).view_as(loss)
    assert (bf16 - ref).abs().max() > tols["atol"] + tols["rtol"] * ref.abs().max()  # the test can tell


@pytest.mark.parametrize("marks", [["layers.*.attention"], ["layers.1"], ["norm", "output"]])
def test_generation_with_fp32_islands_equals_full_recomputation(marks):
    """The KV-cache path goes through the same module forwards, so fp32 marks cast there too."""
    torch.manual_seed(0)
    model = NaiveAMPModel(_decoder(), dtype=torch.bfloat16, fp32_modules=marks, sync_buffer=False).model
    model.eval()
    ids = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        full = model(ids).float()
        cache = KVCache()
        parts = [forward_with_cache(model, ids[:, a:b], cache).float() for a, b in [(0, 5), (5, 6), (6, 12)]]
    # chunked vs full forward of a bf16 model: two orders, one bf16 rounding per stored tensor (n = 1) over
    # the forward (2.5e-2), atol at the logits' scale (was 0.05 with logits <= 0.32); measured <= 2e-3 abs
    tol = order_rtol(torch.bfloat16, 1, transformer_depth(SMALL["num_layers"]))
    torch.testing.assert_close(torch.cat(parts, dim=1), full, **allclose_tols(tol, float(full.abs().max())))
    prompt = ids[0, :4].tolist()
    assert generate_ids_cached(model, prompt, 6, temperature=0.0) == generate_ids(model, prompt, 6, temperature=0.0)
