"""Precision telemetry across processes (gloo): TP=2, DP=2 with ZeRO over the DP group (reduce-scattered
shards) and DP=2 without ZeRO (replicas) each report TP=1's figures, and train.py writes them to
metrics.jsonl and TensorBoard.

Every layout gets the same full gradients, written into its main grads (its TP slice of them; every DP
rank the same, as the DP average), so the gradient and update figures must match TP=1 exactly: an
element counted twice (a replicated norm weight, a DP replica, a ZeRO shard) or missed changes the
element counts and the per-layer fractions. Activations come from each layout's own forward of the same
global batch (bf16: TP changes the rounding), so they match within a tolerance."""

from __future__ import annotations

import json
import os
import zlib

import pytest
import torch
import torch.distributed as dist

from harness.distributed import run_distributed, run_torchrun
from harness.failure import explain
from tests.tolerances import element_order_rtol, order_rtol, transformer_depth

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.py")
VARIANTS = {  # name -> overrides: fp32 masters per module; Kahan masters, fp8 and msp per layer
    "fp32_masters": ["model.fp32_modules=['*norm*']"],
    "kahan_fp8_msp": ["model.fp32_modules=['*norm*']", "hybrid_zero_optimizer.master_dtype='bf16'",
                      "hybrid_zero_optimizer.master_compensation='kahan'", "model.fp8.enabled=True",
                      "parallel.tensor.mode='msp'", "metrics.precision_group='layer'"],
}
EXACT = ("grad_underflow", "grad_zero", "grad_overflow", "grad_amax_ratio", "update_lost", "update_below_half_ulp")


def _full_grad(name: str, shape: torch.Size) -> torch.Tensor:
    """A gradient of the full (TP=1) shape, from the parameter's name: normal values, zeros, and bf16/fp32
    subnormals, so every gradient measure has something to count."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    t = torch.randn(shape, generator=g) * 1e-3
    u = torch.rand(shape, generator=g)
    return torch.where(u < 0.05, 0.0, torch.where(u > 0.97, 1e-39, t))


def _measure(rank: int, world: int, variant: str, layout: str) -> dict:
    from tessera.config import Config
    from tessera.core.job import Job, JobGroups
    from tessera.parallel.attrs import partition_dim
    from tessera.train.builder import build_training_stack

    whole = dist.group.WORLD
    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    one = singles[rank]
    groups = {"tp2": JobGroups(tp=whole, dp=one, zero1=one, world=whole),
              "dp2_zero2": JobGroups(tp=one, dp=whole, zero1=whole, world=whole),
              "dp2_zero1": JobGroups(tp=one, dp=whole, zero1=one, world=whole),
              "tp1": JobGroups(tp=one, dp=one, zero1=one, world=one)}[layout]
    tp = 2 if layout == "tp2" else 1
    cfg = Config.from_file(TINY, [*VARIANTS[variant], "model.dtype='bf16'", f"parallel.tensor.size={tp}",
                                  "data.seq_len=32", "hybrid_zero_optimizer.clip_grad_norm=0.0",
                                  "metrics.precision_every=1"])
    stack = build_training_stack(cfg, Job.of(cfg, groups, seed=5), sync_buffer=False)
    tel, opt = stack.trainer.telemetry, stack.optimizer
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(9))
    if layout.startswith("dp2"):
        ids = ids[2 * rank : 2 * rank + 2]  # this DP rank's rows of the global batch
    tel.begin()
    stack.model(ids)  # the forward the activation hooks see; the gradients are written below
    tp_rank = dist.get_rank(groups.tp)
    for name, p in stack.inner_model.named_parameters():
        full = _full_grad(name, torch.Size(s * (tp if d == partition_dim(p) else 1) for d, s in enumerate(p.shape)))
        dim = partition_dim(p)
        opt.get_main_grad(p).copy_(full if dim is None else full.chunk(tp, dim)[tp_rank])
    ok, _ = opt.step()
    tel.detach()
    assert ok
    return tel.finish()


def _worker(rank: int, world: int) -> dict:
    return {(v, layout): _measure(rank, world, v, layout) for v in VARIANTS
            for layout in ("tp1", "tp2", "dp2_zero2", "dp2_zero1")}


def test_tp2_and_dp2_figures_equal_tp1():
    ranks = run_distributed(_worker, 2, timeout=300)
    assert ranks[0] == ranks[1]  # one all-gather: every rank holds the job's figures
    res = ranks[0]
    from tessera.config import Config
    from tessera.model import build_model

    n_params = sum(p.numel() for p in build_model(Config.from_file(TINY).model).parameters())
    n_largest = max(p.numel() for p in build_model(Config.from_file(TINY).model).parameters())
    n_layers = Config.from_file(TINY).model.num_layers
    for variant in VARIANTS:
        ref = res[(variant, "tp1")]
        m = ref["measures"]
        assert sum(ref["elements"].values()) == n_params  # every parameter element once
        assert 0 < min(m["grad_zero"].values()) and 0 < max(m["grad_underflow"].values())
        assert 0 < max(m["update_below_half_ulp"].values())  # (0 for the fp32 norms)
        for layout in ("tp2", "dp2_zero2", "dp2_zero1"):
            got = res[(variant, layout)]
            where = f"{variant} {layout}"
            assert got["elements"] == ref["elements"], where
            for measure in EXACT:
                assert got["measures"][measure] == m[measure], (where, measure)
            # the same updates, their RMS summed in fp64 in another order (<= 16k elements, two RMS in a
            # ratio): 2.8e-14, was 1e-9; measured 2.7e-15
            rms_rtol = order_rtol(torch.float64, n_largest, 2)
            for row, v in m["update_rms_ratio"].items():
                assert got["measures"]["update_rms_ratio"][row] == pytest.approx(v, rel=rms_rtol), (where, row)
            # an amax is one element of a bf16 activation that TP (or another batch split) rounds in another
            # order, up to the whole forward: element_order_rtol (4.4e-2, was 3e-2); measured <= 5.8e-3
            amax_rtol = element_order_rtol(torch.bfloat16, 1, transformer_depth(n_layers))
            for measure, tol in (("act_amax_ratio", amax_rtol), ("fp8_scale", amax_rtol)):
                for row, v in m.get(measure, {}).items():
                    assert got["measures"][measure][row] == pytest.approx(v, rel=tol), (where, measure, row)
            for measure in ("fp8_saturated", "fp8_underflow"):
                for row, v in m.get(measure, {}).items():
                    assert got["measures"][measure][row] == pytest.approx(v, abs=0.02), (where, measure, row)
    fp8 = res[("kahan_fp8_msp", "tp1")]["measures"]
    assert set(fp8["fp8_scale"]) == {"layers.0", "layers.1"}  # the head stays out of fp8 (model.fp8.exclude)
    assert max(fp8["update_lost"].values()) == 0.0  # Kahan keeps every update


def test_train_py_writes_the_figures_to_metrics_jsonl_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_folder = tmp_path / "logs"
    args = [os.path.join(ROOT, "train.py"), "--config", TINY, "data.type='synthetic'", "metrics.progress_bar=False",
            "model.dtype='bf16'", "data.seq_len=32", "data.total_steps=4", "parallel.tensor.size=2",
            "metrics.precision_every=2", f"log_folder='{log_folder}'", "job_name='tel'"]
    proc = run_torchrun(args, 2, timeout=240, cwd=str(tmp_path))
    assert proc.returncode == 0, explain(proc)
    lines = [json.loads(line) for line in open(log_folder / "tel" / "metrics.jsonl")]
    precision = [r for r in lines if r["kind"] == "precision"]
    assert [r["step"] for r in precision] == [2, 4]
    rec = precision[0]
    assert rec["group_by"] == "module" and rec["loss_scale"] == 1.0 and rec["step_skipped"] is False
    assert set(rec["measures"]["update_lost"]) == set(rec["elements"]) and "layers.1.feed_forward.w2" in rec["elements"]
    events = EventAccumulator(str(log_folder / "tel" / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert "precision/update_rms_ratio/layers.0.attention.wq" in tags and "precision/loss_scale" in tags
    assert [e.step for e in events.Scalars("precision/grad_zero/embedding")] == [2, 4]
    assert "loss" in tags  # the train scalars are still there


@pytest.mark.slow
def test_overhead_benchmark_smoke(tmp_path):
    """``python -m benchmarks precision-telemetry`` end to end on the tiny config: one round, both variants."""
    from benchmarks.cli import main

    out = tmp_path / "B.md"
    assert main(["precision-telemetry", "--config", "configs/tiny.py", "--steps", "6", "--rounds", "1", "--every", "3",
                 "--out", str(out), "--workdir", str(tmp_path / "runs"), "data.type='synthetic'",
                 "parallel.tensor.size=2", "model.dtype='bf16'", "data.seq_len=32"]) == 0
    text = out.read_text()
    assert "## 14. Precision telemetry" in text and "(on: steps [3, 6] measured)" in text
    assert text.count("\n| 1 | ") == 1 and "**Cost at N=3: " in text
