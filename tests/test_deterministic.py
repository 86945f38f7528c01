"""``deterministic=True``: two runs of one config write the same losses bit for bit (one process, TP=2 and DP=2
under torchrun, compiled blocks), checked with ``tools/compare_runs.py --assert-equal``, which tells another seed
or another ``model.dtype`` apart; the switches it sets and what it refuses (CUDA states passed by hand); and
gloo's CPU collectives, which it relies on, repeat their summation order.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from harness.distributed import run_distributed, run_torchrun
from harness.failure import explain
from tessera.config import Config, ConfigError
from tessera.core import determinism
from tessera.core.determinism import apply_determinism, determinism_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.py")
HANG_GUARD_S = 300  # a train.py run still going after this is hung, not slow
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
QUIET = ("metrics.progress_bar=False", "metrics.tensorboard=False")


def train_tiny(tmp_path, name: str, *overrides: str, nproc: int = 1, steps: int = 6) -> str:
    """``train.py --config configs/tiny.py`` (one process, or ``nproc`` under torchrun); its log folder."""
    log_folder = str(tmp_path / name)
    args = [os.path.join(ROOT, "train.py"), "--config", TINY, f"data.total_steps={steps}", *QUIET,
            f"log_folder='{log_folder}'", *overrides]
    if nproc == 1:
        env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
        proc = subprocess.run([sys.executable, *args], cwd=str(tmp_path), env={**env, "OMP_NUM_THREADS": "1"},
                              capture_output=True, text=True, timeout=HANG_GUARD_S)
    else:
        proc = run_torchrun(args, nproc, timeout=HANG_GUARD_S, cwd=str(tmp_path))
    assert proc.returncode == 0, explain(proc)
    return log_folder


def _compare_runs():
    spec = importlib.util.spec_from_file_location("_compare_runs_det", os.path.join(ROOT, "tools", "compare_runs.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


COMPARE = _compare_runs()


def assert_equal_exit(capsys, *runs: str) -> tuple[int, str]:
    """``python tools/compare_runs.py RUNS --assert-equal`` in this process: its exit code and stderr."""
    capsys.readouterr()
    code = COMPARE.main([*runs, "--assert-equal", "--rows", "0"])
    return code, capsys.readouterr().err


def _losses(log_folder: str) -> list[float]:
    with open(os.path.join(log_folder, "tessera", "metrics.jsonl")) as f:
        return [r["loss"] for r in map(json.loads, f) if r.get("kind") == "train"]


# ------------------------------------------------------------------------------------ runs of train.py
def test_one_process_repeats_bitwise_and_a_seed_or_dtype_change_is_told_apart(tmp_path, capsys):
    first = train_tiny(tmp_path, "first", "deterministic=True")
    again = train_tiny(tmp_path, "again", "deterministic=True")
    assert assert_equal_exit(capsys, first, again)[0] == 0
    assert len(_losses(first)) == 6
    seed = train_tiny(tmp_path, "seed", "deterministic=True", "seed=7")
    code, err = assert_equal_exit(capsys, first, seed)
    assert code == 1 and "seed/tessera" in err and "at step 1" in err  # another init: differs from the start
    bf16 = train_tiny(tmp_path, "bf16", "deterministic=True", "model.dtype='torch.bfloat16'")
    code, err = assert_equal_exit(capsys, first, bf16)
    assert code == 1 and "bf16/tessera" in err


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    ("tp2", "parallel.tensor.size=2"),  # the shared-memory TP route
    # gloo's reduce-scatter (ZeRO-1) and all-gather; gloo's all-reduce, TP's route where the shared-memory one is
    # unavailable, repeats its order (test_gloo_all_reduce_and_reduce_scatter_repeat_their_order_on_three_ranks)
    ("dp2", "parallel.tensor.size=1"),
    ("tp2_compiled", "parallel.tensor.size=2", "model.compile.enabled=True"),
])
def test_two_processes_repeat_bitwise(tmp_path, capsys, layout):
    name, *overrides = layout
    runs = [train_tiny(tmp_path, f"{name}_{i}", "deterministic=True", *overrides, nproc=2) for i in range(2)]
    code, err = assert_equal_exit(capsys, *runs)
    assert code == 0, err


# ------------------------------------------------------------------------------------ the switches
def _cfg(**top):
    """configs/tiny.py's typed view with top-level keys overridden (as on train.py's command line)."""
    return Config.from_file(TINY, [f"{k}={v!r}" for k, v in top.items()]).typed


def test_off_sets_nothing_and_on_sets_cublas_and_nccl_only_where_they_apply():
    off, on = _cfg(deterministic=False), _cfg(deterministic=True)
    everything = dict(cuda=True, cuda_initialized=False, nccl_group=True, group_exists=False)
    assert determinism_env(off, {}, **everything) == {}
    assert determinism_env(on, {}, cuda=False, cuda_initialized=False, nccl_group=False, group_exists=False) == {}
    cuda_on = replace(on, model=replace(on.model, use_flash_attn=False))
    assert determinism_env(cuda_on, {}, **everything) == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "^NVLS"}
    # values already in the environment that are deterministic are kept
    keep = {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "NCCL_ALGO": "Ring"}
    assert determinism_env(cuda_on, keep, **everything) == {}


@pytest.mark.parametrize(("environ", "state", "key"), [
    ({}, dict(cuda_initialized=True), "CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment"),  # too late to set it
    ({"CUBLAS_WORKSPACE_CONFIG": ":0:0"}, {}, "CUBLAS_WORKSPACE_CONFIG=':0:0'"),
    ({"NCCL_ALGO": "NVLS"}, {}, "NCCL_ALGO='NVLS'"),
    ({}, dict(group_exists=True), "NCCL_ALGO=^NVLS in the environment"),  # communicators may exist already
])
def test_what_cannot_be_made_deterministic_is_a_config_error_naming_it(environ, state, key):
    on = _cfg(deterministic=True)
    on = replace(on, model=replace(on.model, use_flash_attn=False))
    args = {**dict(cuda=True, cuda_initialized=False, nccl_group=True, group_exists=False), **state}
    with pytest.raises(ConfigError, match="deterministic=True") as e:
        determinism_env(on, environ, **args)
    assert key in str(e.value)


def test_cudnn_benchmark_and_the_flash_attn_package_are_refused(monkeypatch):
    on = _cfg(deterministic=True, cudnn_benchmark=True)
    with pytest.raises(ConfigError, match="cudnn_benchmark=True contradicts deterministic=True"):
        determinism_env(on, {}, cuda=False, cuda_initialized=False, nccl_group=False, group_exists=False)
    monkeypatch.setattr(determinism, "_flash_attn_installed", lambda: True)
    flash = replace(on, cudnn_benchmark=False, model=replace(on.model, use_flash_attn=True))
    with pytest.raises(ConfigError, match="model.use_flash_attn=True with deterministic=True"):
        determinism_env(flash, {}, cuda=True, cuda_initialized=False, nccl_group=False, group_exists=False)


def test_apply_switches_torch_on_and_back_off():
    import torch._inductor.config as inductor_config

    environ: dict[str, str] = {}
    try:
        apply_determinism(_cfg(deterministic=True), "gloo", 1, environ)
        assert torch.are_deterministic_algorithms_enabled() and inductor_config.deterministic
        assert environ == ({"CUBLAS_WORKSPACE_CONFIG": ":4096:8"} if torch.cuda.is_available() else {})
    finally:
        apply_determinism(_cfg(deterministic=False), "gloo", 1, environ)
    assert not torch.are_deterministic_algorithms_enabled() and not inductor_config.deterministic


# ------------------------------------------------------------------------------------ gloo's order
def _gloo_repeats(rank: int, world: int) -> list[list[torch.Tensor]]:
    """The same all-reduce and reduce-scatter 8 times each: inputs whose sum changes bits with its order."""
    gen = torch.Generator().manual_seed(rank)
    # magnitudes spread over 2^-20 .. 2^20 per rank: (a + b) + c and a + (b + c) round differently
    x = torch.randn(3 * 4096, generator=gen) * 2.0 ** torch.randint(-20, 21, (3 * 4096,), generator=gen)
    reduced, scattered = [], []
    for _ in range(8):
        t = x.clone()
        dist.all_reduce(t)
        reduced.append(t)
        out = torch.empty(4096)
        (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, x.clone())
        scattered.append(out)
    return [reduced, scattered, [x]]


def test_gloo_all_reduce_and_reduce_scatter_repeat_their_order_on_three_ranks():
    results = run_distributed(_gloo_repeats, 3, timeout=120)
    inputs = [r[2][0] for r in results]
    for rank, (reduced, scattered, _) in enumerate(results):
        assert all(torch.equal(t, reduced[0]) for t in reduced), f"rank {rank}: all-reduce results differ"
        assert all(torch.equal(t, scattered[0]) for t in scattered), f"rank {rank}: reduce-scatter results differ"
        assert torch.equal(reduced[0], results[0][0][0]), f"rank {rank}: another all-reduce result than rank 0"
    # the check can fail: the two association orders of these inputs differ in many elements
    left, right = (inputs[0] + inputs[1]) + inputs[2], inputs[0] + (inputs[1] + inputs[2])
    assert (left != right).sum() > 100
