"""Precision report: measured bytes/parameter against the closed forms written out here by hand."""

import json
import os

import pytest
import torch

from tessera.config import Config
from tessera.train.precision_report import precision_report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.py")


def _decoder():
    from tessera.model import build_model

    cfg = Config.from_file(TINY)
    return build_model(cfg.model, tp_group=None, seed=0, device="cpu"), cfg.model.vocab_size


def _batch(vocab):
    return torch.randint(0, vocab, (1, 16), generator=torch.Generator().manual_seed(0))


def _close(measured: dict, expected: dict, rel=0.05):
    for role, want in expected.items():
        assert measured[role] == pytest.approx(want, rel=rel, abs=1e-3), role


def test_bf16_without_zero_is_18_bytes_per_parameter():
    model, vocab = _decoder()
    r = precision_report(model, "torch.bfloat16", 1, batch=_batch(vocab))
    # bf16 weight 2 + fp32 main grad 4 + fp32 master 4 + Adam exp_avg/exp_avg_sq 8
    _close(r.measured, {"weights": 2, "main_grads": 4, "masters": 4, "optimizer_states": 8, "total": 18})
    assert r.num_params == sum(p.numel() for p in model.parameters())
    assert all(row.param_dtype == "bfloat16" and row.compute_dtype == "bfloat16" and not row.fp32 for row in r.rows)
    names = {row.name for row in r.rows}
    assert {"embedding", "layers.0.attention.wq", "layers.1.feed_forward.w2", "norm", "output"} <= names


def test_fp16_fp32_norms_and_model_dtype_reduction():
    model, vocab = _decoder()
    r = precision_report(model, "fp16", 1, batch=_batch(vocab), use_fp32_norm=True, fp32_modules=["output"],
                         reduce_dtype="model")
    rows = {row.name: row for row in r.rows}
    for name in ("norm", "layers.0.attention_norm", "layers.1.ffn_norm", "output"):
        assert rows[name].fp32 and rows[name].param_dtype == "float32" and rows[name].compute_dtype == "float32"
    assert rows["layers.0.attention.wq"].param_dtype == "float16" and not rows["layers.0.attention.wq"].fp32
    n_f = sum(p.numel() for n, p in model.named_parameters() if "norm" in n or n.startswith("output"))
    n = sum(p.numel() for p in model.parameters())
    n_l = n - n_f
    assert r.fp32_params == n_f and n_f > 0.1 * n
    # fp16 params: 2 (weight) + 2 (fp16 main grad) + 4 (master) + 8; fp32 params: 4 + 4 + 0 (own master) + 8
    _close(r.measured, {
        "weights": (2 * n_l + 4 * n_f) / n,
        "main_grads": (2 * n_l + 4 * n_f) / n,
        "masters": 4 * n_l / n,
        "optimizer_states": 8,
    })


@pytest.mark.parametrize("dtype", ["torch.float32", "torch.tf32"])
def test_fp32_params_are_their_own_masters(dtype):
    model, vocab = _decoder()
    r = precision_report(model, dtype, 1, batch=_batch(vocab))
    _close(r.measured, {"weights": 4, "main_grads": 4, "optimizer_states": 8, "total": 16})
    assert r.measured["masters"] == 0
    assert all(row.compute_dtype == ("tf32" if "tf32" in dtype else "float32") for row in r.rows)


def _tool():
    import importlib.util

    spec = importlib.util.spec_from_file_location("precision_report_tool", os.path.join(ROOT, "tools",
                                                                                         "precision_report.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


def test_tool_json_and_table(capsys):
    main = _tool()
    assert main(["--config", TINY, "--dtype", "bf16", "--use-fp32-norm", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["zero1_size"] == 1 and r["precision"] == "bfloat16" and r["fp32_params"] > 0
    assert r["measured"]["total"] == pytest.approx(r["closed_form"]["total"], rel=0.05)
    assert main(["--config", TINY, "model.dtype=fp16"]) == 0
    text = capsys.readouterr().out
    assert "precision float16" in text and "layers.1.feed_forward.w3" in text and "main_grads" in text


def test_tool_rejects_bad_config_key(capsys):
    assert _tool()(["--config", TINY, "model.dtpye=bf16"]) == 2
    assert "dtpye" in capsys.readouterr().err


# ZeRO-1 over 2 ranks (6 + 12/2 bytes per parameter) is measured inside the DP=2 run of
# tests/test_optimizer_dist.py (test_precision_report_zero1_2), where the processes already exist.


def test_policy_table_lists_every_buffer_with_measured_equal_to_the_closed_form():
    from tessera.model import build_model
    from tessera.train.precision_report import POLICIES, policy_table

    cfg = Config.from_file(TINY)
    text, rows = policy_table(lambda: build_model(cfg.model, tp_group=None, seed=0, device="cpu"), 1,
                              batch=_batch(cfg.model.vocab_size))
    assert all(name in text for name in POLICIES)
    assert len(rows) == len(POLICIES) * 6  # five buffers and the total per policy
    for row in rows:
        assert row["zero1"]["measured"] == pytest.approx(row["zero1"]["closed_form"], rel=0.01, abs=1e-3), row
    kahan = {r["buffer"]: r for r in rows if r["policy"] == "bf16 masters + Kahan + bf16 moments"}
    # bf16 weights 2 + fp32 grads 4 + masters shared 0 + Kahan 2 + bf16 moments 4 (12 bytes per parameter at d=1)
    assert kahan["total"]["zero1"]["closed_form"] == pytest.approx(12)
    assert kahan["masters"]["dtype"] == "= weights (shared)" and kahan["compensation"]["dtype"] == "bfloat16"


def test_zero1_outside_a_job_says_how_to_start_one():
    """The package starts no processes: ZeRO over 2 needs a job of 2 (tools/precision_report.py starts one)."""
    model, vocab = _decoder()
    with pytest.raises(ValueError, match=r"zero1_size=2 needs a job of 2 processes \(torchrun --nproc_per_node=2"):
        precision_report(model, "bf16", 2, batch=_batch(vocab))
