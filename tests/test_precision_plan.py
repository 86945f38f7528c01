"""The precision plan's promises: one resolved plan, the memory plan's GEMM route equal to the run's on every
device kind, each cross-key rule written once, and a recipe that owns state (an RNG stream) added in one file
plus one table row (``tests/toy_stochastic_recipe.py``) that trains, checkpoints and resumes bitwise."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.failure import explain
from tessera.checkpoint.tree import read_tree
from tessera.config import Config
from tessera.memory.extras import low_precision_gemm_bytes
from tessera.model.args import ModelArgs
from tessera.parallel import gemm
from tessera.precision.plan import LowPrecisionGemms, PrecisionPlan
from tests import toy_stochastic_recipe as toy

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.py")
QUIET = ("metrics.progress_bar=False", "metrics.tensorboard=False")
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# ------------------------------------------------------------------------------------ one plan, typed
def test_the_plan_reads_the_typed_config_once():
    cfg = Config.from_file(TINY, ["model.dtype='bf16'", "hybrid_zero_optimizer.master_dtype='bf16'",
                                  "hybrid_zero_optimizer.reduce_dtype='model'",
                                  'model.fp8={"enabled": True, "recipe": "mxfp8", "rules": [["*.w2", "nvfp4"]]}'])
    plan = PrecisionPlan.from_run(cfg.typed)
    assert plan == PrecisionPlan.from_config(cfg) == PrecisionPlan.from_config(cfg.to_dict())
    assert plan.dtype is torch.bfloat16 and plan.optimizer.master is torch.bfloat16
    assert plan.optimizer.reduce is torch.bfloat16 and plan.optimizer.state is torch.float32
    assert plan.gemms.recipes == ["mxfp8", "nvfp4"]


def test_each_cross_key_rule_is_written_once():
    """The rules' texts occur once in the package: a second copy of a rule would be a second place to keep."""
    sources = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "tessera").rglob("*.py"))
    for rule in ("model.low_precision.enabled=True needs model.dtype", "master_dtype='bf16' needs model.dtype",
                 "applies to bf16 masters only", "runs the fp8 recipes (tensorwise, rowwise)", "KEEP_HIGH = ("):
        assert len(re.findall(re.escape(rule), sources)) == 1, rule


# ------------------------------------------------------------------------------------ one truth for routes
DEVICE_KINDS = {"sm_80 (A100)": ("cuda", (8, 0)), "sm_90 (H100)": ("cuda", (9, 0)), "CPU": ("cpu", None)}


@pytest.mark.parametrize("kind", list(DEVICE_KINDS))
@pytest.mark.parametrize("recipe,backend", [("tensorwise", "auto"), ("rowwise", "auto"), ("rowwise", "emulated"),
                                            ("mxfp8", "auto"), ("nvfp4", "auto")])
def test_planned_gemm_bytes_are_those_of_the_route_the_run_takes(monkeypatch, kind, recipe, backend):
    device, capability = DEVICE_KINDS[kind]
    monkeypatch.setattr(gemm, "_FP8_CORES", {})  # the run asks the device it is on
    monkeypatch.setattr(torch.cuda, "is_available", lambda: device == "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    run_route = gemm.choose_route(device, torch.bfloat16, gemm.policy_for(recipe, backend))
    cfg = Config.from_file(TINY, ["model.dtype='bf16'"]).typed
    a = ModelArgs.from_config(cfg.model)
    elements = cfg.data.micro_bsz * cfg.data.seq_len * a.ffn_hidden_size + a.ffn_hidden_size * a.hidden_size
    planned = low_precision_gemm_bytes(cfg.model, cfg.data.as_dict(), 1,
                                       LowPrecisionGemms(True, recipe, backend=backend), device, capability)
    assert planned == run_route.copy_bytes * elements
    if recipe in ("tensorwise", "rowwise") and backend == "auto":  # the fp8 tensor cores decide: sm_89+
        assert run_route.name == ("fp8-scaled-mm" if capability == (9, 0) else "fp8-emulated"), kind


# ------------------------------------------------------------------------------------ a recipe with state
def test_stochastic_rounding_is_unbiased_and_never_passes_a_neighbour():
    draws = 4096
    t = torch.full((draws,), 1.0 + 2**-6)  # between the 3-bit neighbours 1 and 1.125, 1/8 of the way up
    r = toy.stochastic_round(t, torch.Generator().manual_seed(0))
    assert set(r.unique().tolist()) <= {1.0, 1.125}
    p = (2**-6) / 0.125
    # the mean of Bernoulli(p) draws: 5 standard deviations of it
    assert abs(float((r == 1.125).float().mean()) - p) <= 5 * (p * (1 - p) / draws) ** 0.5


@pytest.fixture
def toy_route(monkeypatch):
    """The toy recipe's row in copies of the table, for this test only (the table is the process's)."""
    monkeypatch.setattr(gemm, "ROUTES", dict(gemm.ROUTES))
    monkeypatch.setattr(gemm, "_ROW_RECIPES", dict(gemm._ROW_RECIPES))
    toy.install()


def _stack(seed: int):
    from tessera.core.job import Job
    from tessera.train.builder import build_training_stack

    cfg = Config.from_file(TINY, ["model.dtype='bf16'", f'model.fp8={{"enabled": True, "recipe": "{toy.RECIPE}"}}'])
    return build_training_stack(cfg, Job.of(cfg, seed=seed), sync_buffer=False)


def test_every_linear_gets_its_own_stream_from_the_seed_and_its_name(toy_route):
    from tessera.precision.linears import RecipeStates

    states = RecipeStates(_stack(3).inner_model)
    assert len(states.states) == 14 and "output" not in states.states  # 7 linears a layer; the head excluded
    again, other = RecipeStates(_stack(3).inner_model), RecipeStates(_stack(4).inner_model)
    first = {n: s.generator.initial_seed() for n, s in states.states.items()}
    assert len(set(first.values())) == len(first)  # every linear its own stream
    assert first == {n: s.generator.initial_seed() for n, s in again.states.items()}
    assert first.keys() == other.states.keys() and all(
        first[n] != s.generator.initial_seed() for n, s in other.states.items())


def _train(tmp_path: Path, name: str, *overrides: str) -> list[float]:
    log = tmp_path / name
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    args = [sys.executable, "-m", "tests.toy_stochastic_recipe", "--config", TINY, "model.dtype='bf16'",
            f'model.fp8={{"enabled": True, "recipe": "{toy.RECIPE}"}}', "data.total_steps=6", *QUIET,
            f"log_folder='{log}'", *overrides]
    proc = subprocess.run(args, cwd=str(ROOT), env={**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, explain(proc)
    with open(log / "tessera" / "metrics.jsonl") as f:
        return [r["loss"] for r in map(json.loads, f) if r.get("kind") == "train"]


@pytest.mark.slow
def test_a_stateful_recipe_trains_and_resumes_bitwise(tmp_path):
    ckpt = tmp_path / "ckpt"
    whole = _train(tmp_path, "whole", "ckpt.enable_save_ckpt=True", "ckpt.checkpoint_every=3",
                   f"ckpt.save_ckpt_folder='{ckpt}'")
    assert len(whole) == 6 and all(map(lambda x: x == x, whole))
    rank_state = read_tree(str(ckpt / "step_3" / "rng_rank0.safetensors"))
    assert len(rank_state["gemm_recipes"]) == 14  # every linear's stream, beside the run's RNG streams
    again = tmp_path / "again"
    shutil.copytree(ckpt / "step_3", again / "step_3")
    resumed = _train(tmp_path, "resumed", "ckpt.enable_save_ckpt=True", "ckpt.auto_resume=True",
                     f"ckpt.save_ckpt_folder='{again}'")
    assert resumed == whole[3:]  # bitwise: the streams continue where the checkpoint left them


def test_the_low_precision_log_names_each_recipes_operand_formats():
    """Block formats round gradients to their own element format (issue 62: the log said e5m2 for them)."""
    from tessera.precision.linears import gradient_format

    assert gradient_format("mxfp8") == "e4m3 forward and gradients"
    assert gradient_format("nvfp4") == "e2m1 forward and gradients"
    assert gradient_format("rowwise") == "e4m3 forward / e5m2 gradients"


def test_a_config_written_with_model_fp8_still_loads_and_says_the_new_name(caplog):
    """``model.fp8`` (the published configs' name) is read as ``model.low_precision``, in a file's dict and in an
    override alike, with one warning line naming the new name."""
    import logging

    from tessera import logs

    logs._LOGGED.discard("config: model.fp8 is now called model.low_precision; read as model.low_precision")
    with caplog.at_level(logging.WARNING, logger="tessera"):
        old = Config.from_file(TINY, ["model.dtype='bf16'", "model.fp8.enabled=True", "model.fp8.recipe='nvfp4'"])
        old_dict = Config.from_dict({**Config.from_file(TINY).to_dict(), "model": {
            **{k: v for k, v in Config.from_file(TINY).to_dict()["model"].items() if k != "low_precision"},
            "dtype": "bf16", "fp8": {"enabled": True, "recipe": "nvfp4"}}})
    new = Config.from_file(TINY, ["model.dtype='bf16'", "model.low_precision.enabled=True",
                                  "model.low_precision.recipe='nvfp4'"])
    assert old.typed.model.low_precision == new.typed.model.low_precision == old_dict.typed.model.low_precision
    assert "fp8" not in old["model"] and "fp8" not in old_dict["model"]
    said = [r.getMessage() for r in caplog.records if "model.fp8 is now called model.low_precision" in r.getMessage()]
    assert len(said) == 1
