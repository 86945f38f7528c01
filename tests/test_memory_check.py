"""The pre-launch memory check: its closed form against the bytes a real optimizer holds, the layouts it
suggests, and train.py refusing a 7B run on this machine on every rank before allocating anything."""

from __future__ import annotations

import os
import time

import pytest
import torch

from harness.distributed import run_torchrun
from tessera.config import Config
from tessera.train import memory_check
from tessera.train.builder import build_training_stack
from tessera.train.memory_check import check_memory, plan_persistent_state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.py")


@pytest.mark.parametrize("dtype,marks", [("bf16", {"use_fp32_norm": True}), ("fp16", {"fp32_modules": ["output"]}),
                                         ("fp32", {})])
def test_plan_equals_the_bytes_a_real_optimizer_holds(dtype, marks):
    cfg = Config.from_file(TINY, [f"model.dtype={dtype}"] + [f"model.{k}={v!r}" for k, v in marks.items()])
    stack = build_training_stack(cfg, seed=0, sync_buffer=False)
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
    cfg = Config.from_file(TINY, ["model.dtype=bf16"])
    plan = plan_persistent_state(cfg, 4, 1, 1)
    need = plan.need
    assert plan.activation_bytes > 0 and need == plan.bytes_per_rank + plan.activation_bytes
    monkeypatch.setattr(memory_check, "available_bytes", lambda device: (need * 0.6, "test"))
    message = check_memory(cfg, 4, 1, 1, torch.device("cpu"))
    assert message is not None and f"training needs {need / 2**30:.1f} GiB per rank" in message
    # TP=2 halves the weights; ZeRO over 4 ranks quarters masters and states: both fit in 60 %
    assert "parallel.tensor.size=2 parallel.zero1.size=2" in message
    assert "parallel.tensor.size=1 parallel.zero1.size=4" in message
    monkeypatch.setattr(memory_check, "available_bytes", lambda device: (need * 1.01, "test"))
    assert check_memory(cfg, 4, 1, 1, torch.device("cpu")) is None


def test_train_py_refuses_7b_on_every_rank_before_allocating(tmp_path):
    t0 = time.time()
    proc = run_torchrun([os.path.join(ROOT, "train.py"), "--config", os.path.join(ROOT, "configs", "7B.py"),
                         "data.type=synthetic", "parallel.tensor.size=2", "metrics.progress_bar=False",
                         f"log_folder='{tmp_path}'"], 2, timeout=120, cwd=str(tmp_path))
    assert proc.returncode != 0 and time.time() - t0 < 60
    reports = [line for line in proc.stderr.splitlines() if " error: training needs" in line]
    # one whole line per rank (ranks writing at once must not interleave their reports)
    assert sorted(line.split("]")[0] for line in reports) == ["[rank 0", "[rank 1"]
    assert all(line.count("error: training needs") == 1 and line.endswith("starts anyway.") for line in reports)
    assert "--skip-memory-check" in proc.stderr and "Killed" not in proc.stderr
