"""train.py end to end under torchrun (CPU, gloo): resume, metrics files, resharding, bad data."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch

from harness.distributed import free_port, run_torchrun
from harness.failure import explain
from tests.tolerances import gamma, order_rtol, transformer_depth

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.py")
COMMON = ["data.type='synthetic'", "metrics.progress_bar=False", "model.dtype='torch.float32'",
          "data.seq_len=32", "data.micro_bsz=2", "data.micro_num=2", "lr_scheduler.total_steps=6",
          "lr_scheduler.warmup_ratio=0.2", "adam.lr=3e-3", "hybrid_zero_optimizer.clip_grad_norm=1.0"]
# a hang guard, not a speed requirement: a launch still running after this is hung (run_torchrun kills it and
# reports exit code 124); generous, as a loaded 2-core machine can take minutes
HANG_GUARD_S = 240


def _loss_rtol() -> float:
    """The tiny model's loss in two fp32 orders: its longest sum (vocabulary, ffn, hidden, sequence) over the
    forward plus the mean over tokens (6.3e-6)."""
    from tessera.config import Config
    from tessera.model.mlp import ffn_hidden_size

    cfg = Config.from_file(TINY, COMMON)
    m = cfg.model
    n = max(m.vocab_size, m.hidden_size, ffn_hidden_size(m.hidden_size, m.mlp_ratio, m.multiple_of), cfg.data.seq_len)
    return order_rtol(torch.float32, n, transformer_depth(m.num_layers) + 1)


def train(tmp_path, name, overrides, nproc=2, timeout=HANG_GUARD_S, expect_ok=True, extra=()):
    log_folder = str(tmp_path / "logs")
    args = [os.path.join(ROOT, "train.py"), "--config", TINY, *extra, *COMMON,
            f"log_folder='{log_folder}'", f"job_name='{name}'", *overrides]
    proc = run_torchrun(args, nproc, timeout=timeout, cwd=str(tmp_path))
    if expect_ok:
        assert proc.returncode == 0, explain(proc)
    return proc, os.path.join(log_folder, name)


def records(log_dir, kind="train"):
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [r for r in rows if r["kind"] == kind]


def losses(log_dir):
    return {r["step"]: r["loss"] for r in records(log_dir)}


@pytest.mark.slow
def test_resume_gives_identical_losses_and_metrics_files(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    tp2 = ["parallel.tensor.size=2"]
    _, full_dir = train(tmp_path, "full", tp2 + ["data.total_steps=6"])
    save = ["ckpt.enable_save_ckpt=True", f"ckpt.save_ckpt_folder='{ckpt}'"]
    _, first_dir = train(tmp_path, "first", tp2 + save + ["data.total_steps=3"])
    assert os.path.isdir(os.path.join(ckpt, "step_3"))
    _, second_dir = train(tmp_path, "second", tp2 + save + ["data.total_steps=6"])

    full, first, second = losses(full_dir), losses(first_dir), losses(second_dir)
    assert sorted(full) == [1, 2, 3, 4, 5, 6]
    assert sorted(first) == [1, 2, 3] and sorted(second) == [4, 5, 6]  # the restart resumed at step 3
    resumed = {**first, **second}
    assert resumed == full, (resumed, full)  # bitwise on CPU
    assert full[6] < full[1]  # it trains

    # resuming a checkpoint past data.total_steps trains nothing and says so
    proc, past_dir = train(tmp_path, "past", tp2 + save + ["data.total_steps=3"])
    assert "step_6 is past data.total_steps=3: nothing to train" in proc.stdout + proc.stderr
    assert records(past_dir) == [] and records(past_dir, "valid")

    # metrics.jsonl: one object per step with every metric of DESIGN.md
    rows = records(full_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "lr", "grad_norm", "loss_scale", "skipped_steps", "tgs", "tflops", "mfu", "step_time",
                "consumed_tokens", "peak_mem_gib"):
        assert all(isinstance(r[key], (int, float)) for r in rows), key
    assert rows[-1]["consumed_tokens"] == 6 * 2 * 2 * 32  # steps x micro_num x micro_bsz x seq (dp=1)
    assert all(r["mfu"] > 0 and r["tflops"] > 0 for r in rows)
    assert records(full_dir, "valid"), "final validation is logged"

    # TensorBoard: read back with tensorboard's own reader
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(full_dir, "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("loss", "lr", "grad_norm", "loss_scale", "tgs", "tflops", "mfu"):
        assert tag in tags, (tag, tags)
    tb_loss = [e.value for e in acc.Scalars("loss")]
    # TensorBoard stores the logged loss as fp32: one rounding, at most u_fp32 of it (was rtol 1e-6)
    assert np.allclose(tb_loss, [full[s] for s in range(1, 7)], rtol=gamma(1, torch.float32), atol=0)


@pytest.mark.parametrize("before, after", [((2, 4), (1, 2)), ((1, 2), (2, 4))], ids=["tp2dp1-to-tp1dp2", "tp1dp2-to-tp2dp1"])
@pytest.mark.slow
def test_resume_on_another_layout(tmp_path, before, after):
    """Save at TP=2 x DP=1, resume at TP=1 x DP=2 (and the reverse): same global batch, same next loss."""
    (tp_a, bsz_a), (tp_b, bsz_b) = before, after
    ckpt = str(tmp_path / "ckpt")
    save = ["ckpt.enable_save_ckpt=True", f"ckpt.save_ckpt_folder='{ckpt}'", "data.micro_num=1"]
    # micro_bsz is per DP rank: dp * micro_bsz = 4 rows per step in both layouts
    _, ref_dir = train(tmp_path, "ref", [f"parallel.tensor.size={tp_a}", f"data.micro_bsz={bsz_a}",
                                         "data.total_steps=3", "data.micro_num=1"])
    train(tmp_path, "a", [f"parallel.tensor.size={tp_a}", f"data.micro_bsz={bsz_a}", "data.total_steps=2"] + save)
    _, b_dir = train(tmp_path, "b", [f"parallel.tensor.size={tp_b}", f"data.micro_bsz={bsz_b}", "data.total_steps=3"] + save)
    ref, resumed = losses(ref_dir), losses(b_dir)
    assert sorted(resumed) == [3]
    # the same weights (bitwise from the checkpoint), another layout: two orders of the step-3 forward and
    # its mean loss (tests/tolerances.py; was 1e-5)
    assert math.isclose(resumed[3], ref[3], rel_tol=_loss_rtol()), (resumed[3], ref[3])


def _make_token_folder(folder, docs, vocab=256):
    from tessera.data.token_file import TokenFileWriter
    from tessera.data.tokenizer import ByteTokenizer

    w = TokenFileWriter(str(folder), ByteTokenizer(), created_by="tests/test_train.py")
    for d in docs:
        w.add(np.asarray(d, dtype=np.int64), num_bytes=len(d))
    w.close()


@pytest.mark.parametrize("case", ["missing", "empty", "truncated", "bad_token", "seq_too_long"])
def test_bad_data_stops_every_rank_with_a_clear_message(tmp_path, case):
    good = tmp_path / "good"
    _make_token_folder(good, [list(range(200)) for _ in range(20)])
    overrides = ["data.type='tokens'", f"data.train_folder='{good}'", "data.total_steps=2"]
    expect = None
    if case == "missing":
        overrides[1] = f"data.train_folder='{tmp_path / 'nope'}'"
        expect = str(tmp_path / "nope")
    elif case == "empty":
        (tmp_path / "empty").mkdir()
        overrides[1] = f"data.train_folder='{tmp_path / 'empty'}'"
        expect = str(tmp_path / "empty")
    elif case == "truncated":
        bins = [f for f in os.listdir(good) if f.endswith(".bin")]
        path = good / bins[0]
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
        expect = str(path)
    elif case == "bad_token":
        bad = tmp_path / "bad"
        _make_token_folder(bad, [[1, 2, 3], [4, 255, 6]])
        overrides[1] = f"data.train_folder='{bad}'"
        overrides.append("model.vocab_size=200")
        expect = str(bad)  # the message names the file; the id and the vocab size are checked below
    elif case == "seq_too_long":
        overrides += ["data.seq_len=64", "model.max_position_embeddings=48"]
        expect = "seq_len=64"
    proc, _ = train(tmp_path, case, overrides, expect_ok=False)
    assert proc.returncode not in (0, 124), proc.returncode  # 124: still running at HANG_GUARD_S (a hang)
    err = proc.stderr
    # torchrun returned, so every rank has stopped; whichever rank hit the problem first reported it
    # (each rank checks its data itself; the other may be stopped by torchrun before it prints)
    reports = [line for line in err.splitlines() if "] error:" in line and line.startswith("[rank ")]
    assert reports, err[-3000:]
    assert any(expect in line for line in reports), (expect, reports)
    if case == "bad_token":
        assert any("200" in line for line in reports), reports


@pytest.mark.slow
def test_two_agents_nnodes_2(tmp_path):
    """Two torchrun agents (--nnodes=2) on this machine, 2 processes each, TP=2 x DP=2."""
    import subprocess
    import sys

    port = free_port()
    log_folder = tmp_path / "logs"
    args = [os.path.join(ROOT, "train.py"), "--config", TINY, *COMMON, "parallel.tensor.size=2",
            "data.total_steps=2", "data.micro_num=1", f"log_folder='{log_folder}'", "job_name='nnodes'"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={n}",
                               "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={port}", *args],
                              cwd=str(tmp_path), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for n in (0, 1)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=240))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    rows = records(str(log_folder / "nnodes"))
    assert [r["step"] for r in rows] == [1, 2]
    assert "world 4 = tp 2 x dp 2" in outs[0][1]
    # TP groups are contiguous ranks, so each stays inside one torchrun agent ("node")
    assert "tensor-parallel groups are node-local (node0 holds ranks [0, 1])" in outs[0][1]
    assert "spans nodes" not in outs[0][1] + outs[1][1]


def test_plain_python_without_torchrun_runs_as_one_process(tmp_path):
    """``python train.py --config ...`` (no launcher, no MASTER_PORT) trains with world size 1."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    log_folder = str(tmp_path / "logs")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--config", TINY, *COMMON,
                           "data.total_steps=2", f"log_folder='{log_folder}'", "job_name='plain'"],
                          cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, explain(proc)
    assert "running as a single process, world size 1" in proc.stdout + proc.stderr
    assert sorted(losses(os.path.join(log_folder, "plain"))) == [1, 2]


def test_resuming_with_more_steps_recomputes_the_lr_schedule_and_says_so(tmp_path):
    """Two steps saved, then resumed with ``data.total_steps=4`` (``lr_scheduler.total_steps`` follows it): the
    cosine is recomputed over 4 steps, and the warning names both lengths and the jump. Reference by hand, without
    warmup and with eta_min 0: step 3 (index 2) of a 4-step cosine is lr * (1 + cos(pi / 2)) / 2 = lr / 2, where
    the saved 2-step schedule had reached eta_min = 0."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    log_folder, ckpt = str(tmp_path / "logs"), str(tmp_path / "ckpt")
    common = [a for a in COMMON if not a.startswith("lr_scheduler.")] + [
        "lr_scheduler.warmup_ratio=0.0", "lr_scheduler.eta_min=0.0", "ckpt.enable_save_ckpt=True",
        f"ckpt.save_ckpt_folder='{ckpt}'", "ckpt.auto_resume=True", "data.valid_every=0", "generate.max_new_tokens=0"]

    def run(steps: int, name: str) -> subprocess.CompletedProcess:
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--config", TINY, *common,
                               f"data.total_steps={steps}", f"log_folder='{log_folder}'", f"job_name='{name}'"],
                              cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
        assert proc.returncode == 0, explain(proc)
        return proc

    first = run(2, "first")
    assert "lr_scheduler.total_steps is" not in first.stdout + first.stderr
    resumed = run(4, "resumed")
    warnings = [line for line in (resumed.stdout + resumed.stderr).splitlines() if "lr_scheduler.total_steps is" in line]
    assert len(warnings) == 1, explain(resumed)
    assert warnings[0].endswith("lr_scheduler.total_steps is 4 here, 2 in the checkpoint's run (it follows "
                                "data.total_steps unless set): the learning-rate schedule is recomputed over 4 steps, "
                                "so step 3 uses lr 1.500e-03 where the saved schedule gave 0.000e+00; set "
                                "lr_scheduler.total_steps=2 to keep the saved schedule (past step 2 it stays at "
                                "lr_scheduler.eta_min=0)"), warnings[0]
    lrs = {r["step"]: r["lr"] for r in records(os.path.join(log_folder, "resumed"))}
    assert sorted(lrs) == [3, 4]
    assert lrs[3] == pytest.approx(3e-3 * (1 + math.cos(math.pi * 2 / 4)) / 2, rel=1e-12)
    assert lrs[4] == pytest.approx(3e-3 * (1 + math.cos(math.pi * 3 / 4)) / 2, rel=1e-12)
