"""The pre-launch memory check: its closed form against the bytes a real optimizer holds, the layouts it
suggests, and train.py refusing a 7B run on this machine on every rank before allocating anything."""

from __future__ import annotations

import os

import pytest
import torch

from harness.distributed import run_torchrun
from harness.failure import explain
from tessera.config import Config, ConfigError
from tessera.core.job import Job
from tessera.core.layout import Layout
from tessera.memory.estimate import plan_persistent_state
from tessera.plan import make_plan
from tessera.train import memory_check
from tessera.train.builder import build_training_stack
from tessera.train.memory_check import check_memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.py")


def _check(cfg, world, tp, zero1, device):
    """``check_memory`` for rank 0 of a job of ``world`` ranks at this TP / ZeRO-1 layout on ``device``."""
    return check_memory(cfg, Job.of(cfg, layout=Layout.of(world, tp, zero1), device=device))


@pytest.mark.parametrize("dtype,marks", [("bf16", {"use_fp32_norm": True}), ("fp16", {"fp32_modules": ["output"]}),
                                         ("fp32", {})])
def test_plan_equals_the_bytes_a_real_optimizer_holds(dtype, marks):
    cfg = Config.from_file(TINY, [f"model.dtype={dtype}"] + [f"model.{k}={v!r}" for k, v in marks.items()])
    stack = build_training_stack(cfg, Job.of(cfg, seed=0), sync_buffer=False)
    model, opt = stack.model, stack.optimizer
    ids = torch.randint(0, cfg.model.vocab_size, (2, 16))
    opt.backward(model(ids).float().logsumexp(-1).mean())
    assert opt.step()[0]  # Adam states exist after the first step
    held = opt.memory_bytes()
    measured = sum(held[k] for k in ("weights", "main_grads", "masters", "optimizer_states"))
    plan = plan_persistent_state(cfg, world_size=1, tp=1, zero1=1)
    assert plan.params_per_rank == held["num_params"]
    assert plan.bytes_per_rank == pytest.approx(measured, rel=0.01)


def test_refusal_names_need_available_and_layouts_that_fit(monkeypatch):
    cfg = Config.from_file(TINY, ["model.dtype=bf16", "memory.headroom=0.0"])
    plan = plan_persistent_state(cfg, 4, 1, 1)
    need = plan.need
    assert plan.activation_bytes > 0 and need == plan.bytes_per_rank + plan.activation_bytes
    monkeypatch.setattr(memory_check, "available_bytes", lambda device: (need * 0.6, "test"))
    message = _check(cfg, 4, 1, 1, torch.device("cpu"))
    assert message is not None and f"training needs {need / 2**30:.1f} GiB per rank" in message
    # TP=2 halves the weights; ZeRO over 4 ranks quarters masters and states: both fit in 60 %
    assert "parallel.tensor.size=2 parallel.zero1.size=2" in message
    assert "parallel.tensor.size=1 parallel.zero1.size=4" in message
    monkeypatch.setattr(memory_check, "available_bytes", lambda device: (need * 1.01, "test"))
    assert _check(cfg, 4, 1, 1, torch.device("cpu")) is None


def _available(monkeypatch, free: float) -> None:
    monkeypatch.setattr(memory_check, "available_bytes", lambda device: (free, "test"))


def test_default_headroom_refuses_a_run_at_95_percent_of_free_memory(monkeypatch):
    """The check keeps the planner's share of memory free (0.1 unless memory.headroom says otherwise): a
    run planned at 95% of the free memory is refused, and fits with a 4% headroom."""
    cfg = Config.from_file(TINY, ["model.dtype=bf16"])
    assert cfg.memory.headroom == 0.1 and make_plan(cfg, 1, trace=False).headroom == 0.1  # one default for both
    need = plan_persistent_state(cfg, 1, 1, 1).need
    _available(monkeypatch, need / 0.95)
    message = _check(cfg, 1, 1, 1, torch.device("cpu"))
    assert message is not None and "memory.headroom=0.1" in message
    assert f"only {need / 0.95 * 0.9 / 2**30:.1f} GiB may be planned" in message
    assert _check(Config.from_file(TINY, ["model.dtype=bf16", "memory.headroom=0.04"]), 1, 1, 1,
                        torch.device("cpu")) is None


def test_headroom_outside_zero_to_one_is_a_config_error():
    for bad in ("1.0", "-0.1"):
        with pytest.raises(ConfigError, match=r"memory\.headroom: must be in \[0, 1\)"):
            Config.from_file(TINY, [f"memory.headroom={bad}"])


def test_cuda_check_counts_communicators_and_workspaces(monkeypatch):
    """On CUDA each rank is allowed 1 GiB per NCCL communicator it joins (one per group of more than one
    rank: world, TP, DP, ZeRO) and 64 MiB of cuBLAS + cuBLASLt workspace; nothing on CPU."""
    cfg = Config.from_file(TINY, ["model.dtype=bf16", "memory.headroom=0.0"])
    gib, mib = 2**30, 2**20
    for world, tp, zero1, groups in [(1, 1, 1, 0), (2, 2, 1, 2), (8, 2, 4, 4), (8, 2, 1, 3), (4, 1, 4, 3)]:
        cpu = plan_persistent_state(cfg, world, tp, zero1)
        cuda = plan_persistent_state(cfg, world, tp, zero1, device_type="cuda", flash_installed=True)
        assert cpu.runtime_bytes == 0
        assert cuda.runtime_bytes == groups * gib + 64 * mib, (world, tp, zero1)
    # refused on CUDA when the state fits but the allowance does not
    cuda = plan_persistent_state(cfg, 8, 2, 4, device_type="cuda", flash_installed=True)
    _available(monkeypatch, cuda.need - 1)
    message = _check(cfg, 8, 2, 4, torch.device("cuda"))
    assert message is not None and "allowed for 4 NCCL communicator(s) and cuBLAS workspaces" in message
    _available(monkeypatch, cuda.need)
    assert _check(cfg, 8, 2, 4, torch.device("cuda")) is None


def test_train_py_refuses_7b_on_every_rank_before_allocating(tmp_path):
    hang_guard_s = 240  # a launch still running after this is hung (exit code 124); not a speed requirement
    proc = run_torchrun([os.path.join(ROOT, "train.py"), "--config", os.path.join(ROOT, "configs", "7B.py"),
                         "data.type=synthetic", "parallel.tensor.size=2", "metrics.progress_bar=False",
                         f"log_folder='{tmp_path}'"], 2, timeout=hang_guard_s, cwd=str(tmp_path))
    assert proc.returncode not in (0, 124), explain(proc)
    # each rank's own line (torchrun's summary quotes them too, indented)
    reports = [line for line in proc.stderr.splitlines()
               if line.startswith("[rank ") and " error: training needs" in line]
    # one whole line per rank (ranks writing at once must not interleave their reports)
    assert sorted(line.split("]")[0] for line in reports) == ["[rank 0", "[rank 1"]
    assert all(line.count("error: training needs") == 1 and line.endswith("starts anyway.") for line in reports)
    assert "--skip-memory-check" in proc.stderr and "Killed" not in proc.stderr


def _sdpa_cfg(*overrides: str) -> Config:
    # 3 layers, 4 query heads over 2 KV heads (head_dim 16), 3 rows of 60 tokens: 60 is no multiple of 8
    return Config.from_file(TINY, ["model.dtype=bf16", "model.num_layers=3", "data.seq_len=60", "data.micro_bsz=3",
                                   *overrides])


@pytest.mark.parametrize("overrides,checkpoint,flash,expected", [
    # packed rows, SDPA: the bool mask once, an additive bf16 copy per layer (rows padded to 64 columns),
    # K/V expanded to the 2 query heads of a TP rank in every layer
    ([], False, False, 3 * 60 * 60 + 3 * (3 * 60 * 64 * 2) + 3 * (2 * 3 * 60 * 2 * 16 * 2)),
    # recomputed attention core: one layer's copies at a time
    ([], "selective", False, 3 * 60 * 60 + 3 * 60 * 64 * 2 + 2 * 3 * 60 * 2 * 16 * 2),
    ([], True, False, 3 * 60 * 60 + 3 * 60 * 64 * 2 + 2 * 3 * 60 * 2 * 16 * 2),
    # flash_attn runs every bf16 layer: nothing
    (["model.use_flash_attn=True"], False, True, 0),
    # one document per row: no mask; bf16 K/V go to SDPA's GQA-capable flash kernel unexpanded
    (["data.pack_sample_into_one=True"], False, False, 0),
    # fp32 q/k/v are expanded even without a mask
    (["data.pack_sample_into_one=True", "model.dtype=fp32"], False, False, 3 * (2 * 3 * 60 * 2 * 16 * 4)),
    # an fp32-marked attention in one layer skips flash_attn there: its fp32 mask and K/V copies only
    (["model.use_flash_attn=True", "model.fp32_modules=['layers.1.attention']"], False, True,
     3 * 60 * 60 + 3 * 60 * 64 * 4 + 2 * 3 * 60 * 2 * 16 * 4),
])
def test_cuda_check_counts_sdpa_masks_and_gqa_copies(overrides, checkpoint, flash, expected, monkeypatch):
    from tessera.memory import extras as memory_extras

    monkeypatch.setattr(memory_extras, "torch_varlen", lambda: (None, "an older torch"))  # SDPA for packed rows
    cfg = _sdpa_cfg(*overrides, f"model.checkpoint={checkpoint!r}")
    plan = plan_persistent_state(cfg, 2, 2, 1, device_type="cuda", flash_installed=flash)
    assert plan.attention_bytes == expected
    assert plan.need == plan.bytes_per_rank + plan.activation_bytes + expected + plan.runtime_bytes
    assert plan_persistent_state(cfg, 2, 2, 1, flash_installed=flash).attention_bytes == 0  # CPU: not this path


@pytest.mark.parametrize("overrides,expected", [
    (["model.use_flash_attn=True"], 0),  # packed bf16 rows: torch's varlen kernel, no mask, no K/V copies
    (["model.use_flash_attn=True", "model.attn_dropout=0.1"],  # no dropout there: SDPA with the mask
     3 * 60 * 60 + 3 * (3 * 60 * 64 * 2) + 3 * (2 * 3 * 60 * 2 * 16 * 2)),
    (["model.use_flash_attn=True", "model.fp32_modules=['layers.1.attention']"],  # fp32 q/k/v: SDPA in that layer
     3 * 60 * 60 + 3 * 60 * 64 * 4 + 2 * 3 * 60 * 2 * 16 * 4),
])
def test_cuda_check_counts_nothing_where_torch_varlen_runs(overrides, expected):
    from tessera.model.torch_varlen import torch_varlen

    if torch_varlen()[0] is None:
        pytest.skip("this torch has no varlen attention")
    plan = plan_persistent_state(_sdpa_cfg(*overrides), 2, 2, 1, device_type="cuda", flash_installed=False)
    assert plan.attention_bytes == expected


@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8"])
def test_low_precision_runs_count_their_activations_and_gemm_copies(recipe, tmp_path):
    """With fp8 or a block format on, the check counts the activations (the routes keep the model-dtype input,
    as bf16 does) and the operand copies of one GEMM's backward: the whole step's peak that
    ``tools/memory_phases.py`` measures on the CPU is within [0.95, 1.05] of the prediction."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "phases.json"
    overrides = ["model.dtype=bf16", "data.type=synthetic", "model.hidden_size=128", "data.seq_len=256",
                 "model.max_position_embeddings=256", "data.micro_bsz=4",
                 f'model.fp8={{"enabled": True, "recipe": "{recipe}"}}']
    proc = subprocess.run([sys.executable, os.path.join(root, "tools", "memory_phases.py"), "--config",
                           os.path.join(root, "configs", "tiny.py"), "--json", str(out), *overrides],
                          capture_output=True, text=True, timeout=300, cwd=root,
                          env=dict(os.environ, PYTHONPATH=root))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    whole = rows[-1]
    assert whole["check"] > 0
    assert 0.95 <= whole["measured"] / whole["check"] <= 1.05, rows
