"""``python -m benchmarks roofline``: the step decomposition checked against independent counts.

The GEMM FLOPs the recorder sees in one real step must equal 6 x tokens x the matmul weights written
out here from the config's dims (forward 2 per weight, backward 4) and tessera.model.flops' closed
form; recording must not change what the step computes; the parts must fit inside the step; TP=2
must record exactly half of TP=1's GEMM FLOPs per rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from benchmarks.roofline import PLANS, _summary, variant_overrides, variants
from benchmarks.roofline_worker import OpCall, Recorder, TensorSpec, Worker, _fresh, replay
from harness.failure import explain
from tessera.config import load_python_file
from tessera.model.flops import matmul_parameters

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# configs/tiny.py: 2 layers, hidden 64, 4 heads of 16 (2 KV heads), SwiGLU 2 x 64 = 128, vocab 256
TINY = ["data.type='synthetic'", "data.pack_sample_into_one=True", "data.seq_len=32", "data.micro_bsz=2",
        "data.micro_num=1"]


def _tiny_matmul_weights() -> int:
    h, q, kv, ffn, vocab, layers = 64, 4 * 16, 2 * 16, 128, 256, 2
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * ffn  # wq, wk + wv, wo, w1 + w3 + w2
    return layers * per_layer + vocab * h  # + the output head


def _worker(dtype: str = "torch.float32") -> Worker:
    raw = load_python_file(os.path.join(ROOT, "configs/tiny.py"))
    return Worker({"raw": raw, "source": "configs/tiny.py", "variants": {"v": [*TINY, f"model.dtype='{dtype}'"]}})


@pytest.mark.parametrize("dtype", ["torch.float32", "torch.bfloat16"])
def test_recorded_gemm_flops_are_the_models_matmul_flops(dtype):
    torch.set_num_threads(1)
    w = _worker(dtype)
    w.step("v")
    dec = w.decompose("v", recorded_steps=1, replays=1)
    tokens = 2 * 32
    # the head fused with the loss (loss.chunk_tokens, on by default) makes its logits again in backward: one
    # more forward GEMM of the head (vocab 256 x hidden 64) than the model's 6 x tokens x matmul weights
    head_again = 2 * tokens * 256 * 64
    assert dec["gemm_flops"] == 6 * tokens * _tiny_matmul_weights() + head_again
    assert dec["gemm_flops"] == 6 * tokens * matmul_parameters(w.stacks["v"].cfg.model) + head_again
    assert dec["attention_calls"] == 2 * 2  # a forward and a backward kernel per layer
    assert dec["gemm_replay_s"] > 0 and dec["attention_s"] > 0


def test_recording_does_not_change_the_step():
    torch.set_num_threads(1)
    plain, recorded = _worker(), _worker()
    losses = []
    for w, record in ((plain, False), (recorded, True)):
        stack = w.stacks["v"]
        out = []
        for _ in range(3):
            if record:
                with Recorder(w.sync):
                    out.append(stack.trainer.train_step(stack.batches).loss)
            else:
                out.append(w.step("v")["loss"])
        losses.append(out)
    assert losses[0] == losses[1]
    assert losses[0][2] != losses[0][0]  # the optimizer really stepped through the timing wrapper
    assert recorded.stacks["v"].optimizer.num_steps == 3


def test_parts_fit_inside_the_step_and_sum_to_it():
    torch.set_num_threads(1)
    w = _worker()
    w.step("v")
    steps = [[w.step("v")] for _ in range(3)]
    assert all(0 < s[0]["opt_s"] < s[0]["step_s"] and s[0]["comm_s"] == 0 for s in steps)
    summary = _summary(steps, w.decompose("v", recorded_steps=1, replays=2))
    parts = summary["parts"]
    assert all(parts[k] > 0 for k in ("gemm", "attention", "optimizer"))
    # at these dims the measured kernels are a small part of the step: "other" is far from zero
    assert parts["other"] > 0
    assert sum(parts.values()) == pytest.approx(summary["step_s"])


def test_replay_tensors_keep_shape_strides_and_dtype():
    gen = torch.Generator().manual_seed(0)
    for spec in (TensorSpec((3, 5), (1, 3), torch.bfloat16, "cpu"), TensorSpec((4, 6), (0, 1), torch.float32, "cpu"),
                 TensorSpec((2, 0, 3), (0, 3, 1), torch.float32, "cpu"), TensorSpec((7,), (2,), torch.int32, "cpu")):
        t = _fresh(spec, gen)
        assert (tuple(t.shape), t.stride(), t.dtype) == (spec.shape, spec.stride, spec.dtype)
    # a replayed mm computes on operands of the recorded layout
    a, b = torch.randn(8, 4), torch.randn(6, 4).t()
    with Recorder(lambda: None) as rec:
        torch.mm(a, b)
    (call,) = rec.calls
    assert isinstance(call, OpCall) and call.kind == "gemm" and call.flops == 2 * 8 * 4 * 6
    assert call.args[1] == TensorSpec((4, 6), (1, 4), torch.float32, "cpu")
    assert len(replay([call], 3, lambda: None)) == 3


def test_workload_overrides_come_before_the_users():
    over = variant_overrides("msp", "bf16", PLANS["full"], ["data.seq_len=64"])
    assert over.index("data.seq_len=256") < over.index("data.seq_len=64")
    assert "parallel.tensor.size=2" in over and "parallel.tensor.mode='msp'" in over
    assert "model.dtype='torch.bfloat16'" in over


def test_policy_variants_carry_each_policys_optimizer_keys():
    from tessera.train.precision_report import POLICIES

    named = variants("tp1", ["bf16"], PLANS["full"], ["data.seq_len=64"], list(POLICIES))
    assert list(named) == [f"bf16 {p}" for p in POLICIES]
    for policy, (dtype, over) in zip(POLICIES, named.values()):
        assert dtype == "bf16" and over[-1] == "data.seq_len=64"  # the user's overrides come last
        assert {o for o in over if o.startswith("hybrid_zero_optimizer.")} == \
            {f"hybrid_zero_optimizer.{k}='{v}'" for k, v in POLICIES[policy].items()}
    assert variants("tp1", ["bf16", "fp32"], PLANS["full"], []) == {
        d: (d, variant_overrides("tp1", d, PLANS["full"], [])) for d in ("bf16", "fp32")}


@pytest.mark.slow
def test_cli_policies_write_the_optimizer_share_section(tmp_path):
    """``--policies``: one stack per policy, the optimizer's share per row, section 13 (not 10) written."""
    out, js = tmp_path / "B.md", tmp_path / "r.json"
    out.write_text("# Benchmarks\n")
    cmd = [sys.executable, "-m", "benchmarks", "roofline", "--policies", "fp32 masters (default),bf16 masters + Kahan",
           "--quick", "--clock", "cpu", "--rounds", "1", "--config", "configs/tiny.py", "--out", str(out),
           "--json", str(js), "model.hidden_size=64", "model.num_layers=2", "model.num_attention_heads=4",
           "model.num_kv_attention_heads=4", "data.seq_len=32", "data.micro_bsz=2"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, explain(proc)
    res = json.loads(js.read_text())
    rows = res["layouts"]["tp1"]["ours"]
    assert list(rows) == ["bf16 fp32 masters (default)", "bf16 bf16 masters + Kahan"]
    for s in rows.values():
        assert s["dtype"] == "bf16" and 0 < s["parts"]["optimizer"] < s["step_s"]
    text = out.read_text()
    assert "## 13. The optimizer's share of a step, per precision policy" in text and "## 10." not in text
    assert "| bf16 bf16 masters + Kahan |" in text


@pytest.mark.slow
def test_cli_tp1_and_tp2_against_itself(tmp_path):
    """The whole command on tiny dims: TP=1 and TP=2 (msp) workers of this checkout against itself."""
    out, js = tmp_path / "B.md", tmp_path / "r.json"
    out.write_text("# Benchmarks\n\n<!-- section:dp -->\n## 7. dp\n<!-- /section:dp -->\n")
    dims = ["model.hidden_size=64", "model.num_layers=2", "model.num_attention_heads=4",
            "model.num_kv_attention_heads=4", "data.seq_len=32", "data.micro_bsz=2"]
    cmd = [sys.executable, "-m", "benchmarks", "roofline", "--quick", "--clock", "cpu", "--rounds", "2", "--dtypes", "fp32",
           "--layouts", "tp1,msp", "--config", "configs/tiny.py", "--against", ROOT, "--out", str(out), "--json", str(js), *dims]
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, explain(proc)
    res = json.loads(js.read_text())
    tp1, msp = res["layouts"]["tp1"], res["layouts"]["msp"]
    assert [d["gemm_flops"] for d in msp["ours"]["fp32"]["decomposition"]] == \
        [tp1["ours"]["fp32"]["gemm_flops"] / 2] * 2
    for layout in (tp1, msp):
        ours, against = layout["ours"]["fp32"], layout["against"]["fp32"]
        assert ours["first_loss"] == against["first_loss"]  # the same checkout builds the same model
        assert ours["vs_against"]["n"] == 2
        assert sum(ours["parts"].values()) == pytest.approx(ours["step_s"])
    assert msp["ours"]["fp32"]["parts"]["collectives"] > 0
    text = out.read_text()
    assert "<!-- section:dp -->" in text and "## 10. Roofline: where a step's time goes" in text
    assert "| **step** |" in text and "step time / " in text
    rendered = tmp_path / "C.md"  # --render writes the same section from the JSON, without measuring
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "roofline", "--render", str(js), "--out", str(rendered)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, explain(proc)
    assert rendered.read_text().strip() == text[text.index("<!-- section:roofline"):].strip()
