"""tools/gpu_acceptance.py's plumbing, on CPU: it refuses to run without a GPU, its training run and the
judgement of its metrics work on a real train.py run (CPU, gloo), and it reads pytest's per-test results.
The GPU checks themselves are ``tests/test_cuda_path.py`` (marked ``cuda``)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from types import ModuleType

import pytest

from harness.failure import explain

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.py")


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_acceptance", os.path.join(ROOT, "tools", "gpu_acceptance.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_without_a_gpu_it_exits_2_with_one_error_line():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-m", "tools.gpu_acceptance"], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 2, explain(proc)
    assert proc.stderr.strip().splitlines() == [
        "error: tools/gpu_acceptance.py needs a CUDA device (torch.cuda.is_available() is False)"]


def test_run_as_a_file_it_says_how_to_run_it_before_any_work():
    """``python tools/gpu_acceptance.py`` puts tools/ on the path, not the root: the peer comparison and the
    BENCHMARKS.md writer (benchmarks/, not installed) would fail after the GPU work; it stops first, saying how."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "gpu_acceptance.py")], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 2, explain(proc)
    assert proc.stderr.strip().splitlines() == [
        "error: benchmarks/ is not importable: run this tool from the repository root as "
        "python -m tools.gpu_acceptance"]


def test_a_training_run_is_judged_from_its_metrics(tmp_path):
    """The tool's own train.py run (torchrun, one process; here on CPU) with 6 steps of the tiny config:
    every step is logged, the loss falls, and the summary carries MFU and the peak's source."""
    tool = _tool()
    rc, out, metrics = tool.train_run(TINY, "bf16", 6, ["adam.lr=3e-3"], str(tmp_path), timeout=300)
    summary = tool.summarize_run(metrics)
    check = tool.judge_run("bf16", rc, out, summary, 6)
    assert check.ok, check.detail
    assert summary["steps"] == 6 and summary["mfu"] > 0 and "measured" in summary["peak_source"]
    # a run that logged too few steps, or diverged, fails
    assert not tool.judge_run("bf16", rc, out, summary, 7).ok
    assert not tool.judge_run("bf16", rc, out, dict(summary, losses=[*summary["losses"][:-1], float("nan")]), 6).ok
    assert not tool.judge_run("bf16", 1, "Traceback ...\nRuntimeError: boom", None, 6).ok


def test_pytest_results_are_read_per_test(tmp_path):
    (tmp_path / "test_three.py").write_text(
        "import pytest\n\ndef test_ok():\n    pass\n\ndef test_bad():\n    assert 1 == 2\n\n"
        "def test_skip():\n    pytest.skip('flash_attn is not installed')\n")
    junit = tmp_path / "out.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                    str(tmp_path / "test_three.py")], capture_output=True, timeout=300, cwd=tmp_path)
    checks = {c.name: c for c in _tool().parse_junit(str(junit))}
    assert [checks[f"test_three::test_{n}"].ok for n in ("ok", "bad", "skip")] == [True, False, None]
    assert "flash_attn is not installed" in checks["test_three::test_skip"].detail


@pytest.mark.parametrize("ratio,ok", [(0.9, False), (0.96, True), (1.0, True), (1.04, True), (1.1, False)])
def test_the_memory_verdict_needs_the_peak_within_the_prediction(ratio, ok):
    """The real peak within [0.95, 1.05] of the prediction: an undercount admits runs that run out of memory,
    an overcount refuses layouts that fit."""
    from tessera.config import Config
    from tessera.memory.estimate import plan_persistent_state

    tool = _tool()
    need = plan_persistent_state(Config.from_file(TINY), 1, 1, 1, device_type="cuda").need / 2**30
    assert tool.memory_check_vs_peak(TINY, [], need * ratio).ok is ok


def test_every_dtype_runs_and_the_long_ones_run_fewer_steps():
    """bf16, fp16, tf32 and fp32 all train in the report; fp32/tf32 take a third of the steps (at least 6)
    so the whole report fits its budget on one GPU."""
    tool = _tool()
    assert tool.DTYPES == ("bf16", "fp16", "tf32", "fp32")
    assert [tool.steps_for(d, 20) for d in tool.DTYPES] == [20, 20, 6, 6]
    assert tool.steps_for("fp32", 30) == 10


def _peers_result(ours: float, hf: float, one_doc: float, off: float, peak: float | None = 1000.0) -> dict:
    """A gpu-peers result of three rounds with the given median step times (s), 16,384 tokens a step."""
    rounds = lambda s: [s * 0.99, s, s * 1.01]  # noqa: E731 - three rounds around a median
    return {"wall": {"tessera compiled": rounds(ours), "hf compiled": rounds(hf),
                     "tessera compiled (one document a row)": rounds(one_doc),
                     "tessera compiled (fusion off)": rounds(off)},
            "tokens": 16384, "flops_per_token": 10e9, "peak_tflops": peak, "device": "NVIDIA H200"}


def test_the_peer_checks_read_speed_mfu_packing_and_fusion_from_one_result():
    """tokens/s against HF compiled, MFU against the datasheet, packed rows against one document a row (3%),
    and the fusion's step-time ratio reported as a figure (no verdict)."""
    tool = _tool()
    # 0.25 s a step: 16,384 tokens x 10 GFLOP / 0.25 s = 655 TFLOP/s, 65.5% of 1000; HF 1.4x slower
    good = {c.name.split(" >=")[0].split(" within")[0]: c for c in
            tool.judge_peers(_peers_result(0.25, 0.35, 0.245, 0.26), 1.25, 0.55)}
    assert [c.ok for c in good.values()] == [True, True, True, True]
    assert good["tessera compiled MFU"].detail.startswith("65.5%")
    assert good["step time with the weight-gradient fusion off / on"].figure
    assert good["step time with the weight-gradient fusion off / on"].detail.startswith("1.040x")
    bad = tool.judge_peers(_peers_result(0.30, 0.35, 0.28, 0.30), 1.25, 0.55)
    assert [c.ok for c in bad[:3]] == [False, False, False]  # 1.17x, 54.6%, packed 7% slower
    assert tool.judge_peers(_peers_result(0.25, 0.35, 0.25, 0.25, peak=None), 1.25, 0.55)[1].ok is None
