"""Reliability: restarts, crash-safe checkpoints, non-finite losses, no hangs, no unpickling.

The multi-process tests run ``tests/fault_train.py`` (train.py plus faults chosen by environment
variables) under torchrun on CPU with gloo, TP=2, and compare against one uninterrupted reference run
of the same configuration: per-step losses bitwise, the global sample ids each step trained on, a
digest of every rank's RNG states at the start of each step and of its parameters after it. Dropout
is on, so the losses themselves depend on the restored RNG streams. Every launch is bounded by
``HANG_GUARD_S``, so a hang fails the test instead of blocking CI; no wall-clock figure decides a verdict
(on a loaded machine it measures the machine): a stop request is sent once the run reports the step it
waits at, and the tests check the step the run says it stopped after.
"""

from __future__ import annotations

import builtins
import json
import logging
import multiprocessing as mp
import os
import pickle
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

from harness.distributed import kill_with_stacks
from harness.failure import explain
from harness.state import HeldState
from tessera.checkpoint import (
    LOCK_FILE,
    CheckpointError,
    Layout,
    Progress,
    TrainState,
    find_resumable_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from tessera.checkpoint import tree as ckpt_tree  # its ``save_file`` is what the crash test wraps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.py")
FAULT_TRAIN = os.path.join(ROOT, "tests", "fault_train.py")
N = 8  # steps of every run
COMMON = ["data.type='synthetic'", "metrics.progress_bar=False", "metrics.tensorboard=False",
          "model.dtype='torch.float32'", "parallel.tensor.size=2", "data.seq_len=32", "data.micro_bsz=2",
          "data.micro_num=2", f"data.total_steps={N}", f"lr_scheduler.total_steps={N}",
          "lr_scheduler.warmup_ratio=0.25", "adam.lr=3e-3", "model.dropout=0.1", "model.attn_dropout=0.1"]
# a hang guard, not a speed requirement: a launch (torchrun, 2 ranks, 8 tiny steps) still running after this
# is hung; generous, as a loaded 2-core machine can take minutes
HANG_GUARD_S = 300


# ------------------------------------------------------------------------------------------ helpers
class Run:
    """One torchrun launch of tests/fault_train.py in its own session (so it can be killed whole)."""

    def __init__(self, tmp_path, name, overrides=(), *, ckpt=None, env=None, torchrun_args=(), extra=()):
        self.log_dir = str(tmp_path / "logs" / name)
        self.trace_dir = str(tmp_path / "trace")
        self.ckpt = ckpt
        args = [FAULT_TRAIN, "--config", TINY, *extra, *COMMON, f"log_folder='{tmp_path / 'logs'}'",
                f"job_name='{name}'"]
        if ckpt:
            args += ["ckpt.enable_save_ckpt=True", f"ckpt.save_ckpt_folder='{ckpt}'"]
        full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1",
                        TESSERA_FAULT_TRACE=self.trace_dir)
        full_env.update(env or {})
        self.cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", *torchrun_args,
                    "--nproc_per_node=2", *args, *overrides]
        self.proc = subprocess.Popen(self.cmd, cwd=str(tmp_path), env=full_env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.stdout = self.stderr = ""

    def wait(self, timeout=HANG_GUARD_S) -> Run:
        try:
            self.stdout, self.stderr = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_with_stacks(self.proc.pid)
            self.stdout, self.stderr = self.proc.communicate()
            pytest.fail(f"torchrun did not finish within {timeout}s (a hang):\n{explain(self)}")
        return self

    @property
    def rc(self) -> int:
        return self.proc.returncode

    def check_ok(self) -> Run:
        assert self.rc == 0, explain(self)
        return self

    def rows(self, kind="train"):
        with open(os.path.join(self.log_dir, "metrics.jsonl")) as f:
            return [r for r in map(json.loads, f) if r["kind"] == kind]

    def losses(self):
        """Final loss per step: a restarted attempt appends records for the steps it re-does."""
        return {r["step"]: r["loss"] for r in self.rows()}

    def trace(self, rank):
        path = os.path.join(self.trace_dir, f"trace_rank{rank}.jsonl")
        with open(path) as f:
            return [json.loads(line) for line in f]


def launch(tmp_path, name, overrides=(), timeout=HANG_GUARD_S, **kw) -> Run:
    return Run(tmp_path, name, overrides, **kw).wait(timeout)


def last_per_step(records):
    out = {}
    for r in records:
        out[r["step"]] = r
    return out


def wait_for_file(path, run: Run, timeout=HANG_GUARD_S):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if run.proc.poll() is not None:
            pytest.fail(f"the run ended before creating {path}:\n{run.proc.stderr.read()[-4000:]}")
        if time.monotonic() > deadline:
            os.killpg(run.proc.pid, signal.SIGKILL)
            pytest.fail(f"{path} did not appear within {timeout}s")
        time.sleep(0.05)


def flip_bytes(path, offset_fraction=0.5, n=4):
    data = bytearray(open(path, "rb").read())
    at = int(len(data) * offset_fraction)
    for i in range(at, at + n):
        data[i] ^= 0xFF
    with open(path, "wb") as f:
        f.write(bytes(data))


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """The uninterrupted run: losses, per-rank traces, and a checkpoint after every step."""
    tmp = tmp_path_factory.mktemp("reference")
    ckpt = str(tmp / "ckpt")
    run = launch(tmp, "ref", ["ckpt.checkpoint_every=1"], ckpt=ckpt).check_ok()
    losses = run.losses()
    assert sorted(losses) == list(range(1, N + 1))
    assert len(run.rows()) == N
    traces = {r: last_per_step(run.trace(r)) for r in (0, 1)}
    samples = [s for step in range(1, N + 1) for s in traces[0][step]["samples"]]
    assert len(samples) == len(set(samples)) == N * 2 * 2  # micro_num x micro_bsz rows per step, DP=1
    assert traces[0][1]["samples"] == traces[1][1]["samples"]  # TP ranks see the same rows
    return {"losses": losses, "traces": traces, "ckpt": ckpt, "run": run}


def assert_continues_like_reference(run: Run, ref, from_step):
    """Steps ``from_step..N`` (final records) match the uninterrupted run bitwise, on both ranks."""
    losses = run.losses()
    for step in range(from_step, N + 1):
        assert losses[step] == ref["losses"][step], (step, losses, ref["losses"])
    for rank in (0, 1):
        got = last_per_step(run.trace(rank))
        for step in range(from_step, N + 1):
            want = ref["traces"][rank][step]
            assert got[step]["samples"] == want["samples"], f"rank {rank} step {step}: different data"
            assert got[step]["rng"] == want["rng"], f"rank {rank} step {step}: RNG states not restored"
            assert got[step]["params"] == want["params"], f"rank {rank} step {step}: parameters differ"


def events(run: Run):
    return run.rows("event")


def resumed_from(run: Run):
    return [e["resumed_from"] for e in events(run) if "resumed_from" in e]


# ------------------------------------------------------------------------------------------ restart
@pytest.mark.slow
def test_sigkill_rank1_then_torchrun_restart_resumes_bitwise(tmp_path, ref):
    seed = int(os.environ.get("TESSERA_RELIABILITY_SEED", "7005"))  # any seed must pass
    kill_step = random.Random(seed).randint(3, N - 1)
    print(f"seed {seed}: killing rank 1 with SIGKILL in step {kill_step}")
    ckpt = str(tmp_path / "ckpt")
    run = launch(tmp_path, "restart", ["ckpt.checkpoint_every=2"], ckpt=ckpt,
                 env={"TESSERA_FAULT_KILL": f"1:{kill_step}"}, torchrun_args=["--max-restarts=1"]).check_ok()
    assert f"SIGKILL: killed mid-step {kill_step}" in run.stderr  # the fault fired
    saved = 2 * ((kill_step - 1) // 2)  # the newest checkpoint completed before the kill
    assert [os.path.basename(p) if p else p for p in resumed_from(run)] == [None, f"step_{saved}"]

    # metrics.jsonl holds both attempts: steps saved+1 .. kill_step-1 were done twice
    counts = {}
    for r in run.rows():
        counts[r["step"]] = counts.get(r["step"], 0) + 1
    assert counts == {s: 2 if saved < s < kill_step else 1 for s in range(1, N + 1)}, counts
    assert run.losses() == ref["losses"]  # every final per-step loss, bitwise
    assert_continues_like_reference(run, ref, 1)
    # the restarted attempt (attempt 1) trained exactly steps saved+1..N: nothing repeated or skipped
    for rank in (0, 1):
        second = [r for r in run.trace(rank) if r["attempt"] == 1]
        assert [r["step"] for r in second] == list(range(saved + 1, N + 1))
    final = last_per_step(run.trace(0))
    samples = [s for step in range(1, N + 1) for s in final[step]["samples"]]
    assert len(samples) == len(set(samples))
    assert samples == [s for step in range(1, N + 1) for s in ref["traces"][0][step]["samples"]]
    assert run.rows()[-1]["consumed_tokens"] == ref["run"].rows()[-1]["consumed_tokens"]


# ------------------------------------------------------------------------------------------ crash-safe saving
@pytest.mark.slow
def test_kill_during_save_resumes_from_previous_checkpoint(tmp_path, ref):
    """Two interrupted saves in a row, then a clean finish: (1) rank 1 is killed while writing its
    shards of step 4; (2) the next launch resumes from step 2 and rank 0 is killed with every file of
    step 6 (meta.json included) written but the folder not yet renamed into place; (3) the last
    launch resumes from step 4. The losses of every step equal the uninterrupted run's."""
    ckpt = str(tmp_path / "ckpt")
    save = ["ckpt.checkpoint_every=2", "ckpt.keep_last=2"]
    first = launch(tmp_path, "first", save, ckpt=ckpt, env={"TESSERA_FAULT_SAVE": "1:4:mid_write"})
    assert first.rc not in (0, 124), first.rc
    assert "SIGKILL: killed while writing" in first.stderr and ".step_4.partial" in first.stderr
    # rank 0, stopped by torchrun, may or may not have gone through its exit path: its lock file (which locks
    # nothing once the process is gone) is left behind only in the latter case
    assert sorted(n for n in os.listdir(ckpt) if n != LOCK_FILE) == [".step_4.partial", "step_2"]

    second = launch(tmp_path, "second", save, ckpt=ckpt, env={"TESSERA_FAULT_SAVE": "0:6:before_commit"})
    assert second.rc not in (0, 124), second.rc
    assert "SIGKILL: killed before committing" in second.stderr
    assert "removing incomplete checkpoint folder" in second.stderr and ".step_4.partial" in second.stderr
    assert [os.path.basename(p) for p in resumed_from(second)] == ["step_2"]
    # rank 0 killed itself: its lock file stays (unlocked: the next launch takes the folder at once)
    assert sorted(os.listdir(ckpt)) == [".step_6.partial", LOCK_FILE, "step_2", "step_4"]
    assert os.path.isfile(os.path.join(ckpt, ".step_6.partial", "meta.json"))  # complete, yet unpublished

    third = launch(tmp_path, "third", save, ckpt=ckpt).check_ok()
    assert "removing incomplete checkpoint folder" in third.stderr and ".step_6.partial" in third.stderr
    assert [os.path.basename(p) for p in resumed_from(third)] == ["step_4"]
    assert sorted(second.losses()) == [3, 4, 5, 6] and sorted(third.losses()) == [5, 6, 7, 8]
    assert {**first.losses(), **second.losses(), **third.losses()} == ref["losses"]
    assert_continues_like_reference(third, ref, 5)
    assert sorted(os.listdir(ckpt)) == ["step_6", f"step_{N}"]  # keep_last=2, nothing partial left


def _tiny_state(model, step=0, rng=None, optimizer=None) -> TrainState:
    state = TrainState(model, optimizer, progress=Progress(step))
    state.register("rng", HeldState(rng), per_rank=True)
    return state


def _save_tiny(folder, step, weight_value, keep_last=0):
    model = nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.fill_(weight_value)
        model.bias.fill_(weight_value)
    return save_checkpoint(folder, step, _tiny_state(model, step, {"cpu": torch.arange(5)}), config=None,
                           layout=Layout(), keep_last=keep_last)


class _Crash:
    """Counts the filesystem operations of a save and kills the process (os._exit) at number ``at``.

    Operations: directory creation, opening a file for writing, every safetensors write (which can
    also die half-way: the file is left truncated), every rename, and every single unlink/rmdir of a
    folder removal (so a removal can die half-way too).
    """

    def __init__(self, at):
        self.at, self.count = at, 0

    def tick(self, what, partial_effect=None):
        self.count += 1
        if self.count == self.at:
            if partial_effect is not None:
                partial_effect()
            os._exit(17)

    def install(self):
        real_replace, real_makedirs, real_open, real_save = os.replace, os.makedirs, builtins.open, ckpt_tree.save_file

        def replace(src, dst):
            self.tick(f"replace {src} -> {dst}")
            real_replace(src, dst)

        def makedirs(path, *a, **k):
            self.tick(f"makedirs {path}")
            real_makedirs(path, *a, **k)

        def open_(file, mode="r", *a, **k):
            if any(c in mode for c in "wax+"):
                self.tick(f"open {file}")
            return real_open(file, mode, *a, **k)

        def save_file(tensors, path, metadata=None):
            def half():
                real_save(tensors, path, metadata=metadata)
                with real_open(path, "r+b") as f:
                    f.truncate(os.path.getsize(path) // 2)
            self.tick(f"save_file {path}", half)
            real_save(tensors, path, metadata=metadata)

        def rmtree(path, ignore_errors=False, **k):
            if not os.path.exists(path):
                if ignore_errors:
                    return
                raise FileNotFoundError(path)
            for dirpath, dirnames, filenames in os.walk(path, topdown=False):
                for name in filenames:
                    self.tick(f"unlink {name}")
                    os.unlink(os.path.join(dirpath, name))
                self.tick(f"rmdir {dirpath}")
                os.rmdir(dirpath)

        os.replace, os.makedirs, builtins.open, ckpt_tree.save_file = replace, makedirs, open_, save_file
        shutil.rmtree = rmtree


def _crashing_save(folder, step, value, keep_last, at, count_file):
    crash = _Crash(at)
    crash.install()
    _save_tiny(folder, step, value, keep_last)
    with open(count_file, "w") as f:
        f.write(str(crash.count))
    os._exit(0)


def _resume_tiny(folder):
    model = nn.Linear(4, 3)
    state = _tiny_state(model)
    path, meta = find_resumable_checkpoint(folder, Layout(), load=lambda p: load_checkpoint(p, state, layout=Layout()))
    if path is not None:
        assert torch.equal(state.per_rank["rng"].state["cpu"], torch.arange(5))
        assert state.components["progress"].step == meta["step"]
    return path, meta, model.weight[0, 0].item()


@pytest.mark.parametrize("scenario", ["new_step_keep_last_1", "resave_same_step"])
def test_kill_at_every_point_of_a_save_leaves_a_complete_checkpoint(tmp_path, scenario, caplog):
    """Crash a save after each of its filesystem operations in turn; auto-resume must always find an
    intact checkpoint (the old one until the new one is published, then the new one) with no fallback."""
    base = tmp_path / "base"
    if scenario == "new_step_keep_last_1":
        _save_tiny(str(base), 1, 1.0)
        step, value, old = 2, 2.0, (1, 1.0)
    else:  # re-saving a step that exists (e.g. a finished run launched again): the only checkpoint
        _save_tiny(str(base), 2, 1.0)
        step, value, old = 2, 2.0, (2, 1.0)
    ctx = mp.get_context("fork")

    def crash_at(at):
        folder = tmp_path / f"crash_{at}"
        shutil.copytree(base, folder)
        count_file = str(tmp_path / f"count_{at}")
        p = ctx.Process(target=_crashing_save, args=(str(folder), step, value, 1, at, count_file))
        p.start()
        p.join(60)
        assert p.exitcode is not None, "the crashing save hung"
        return str(folder), p.exitcode, count_file

    _, code, count_file = crash_at(0)  # never crashes: count the operations
    assert code == 0
    total = int(open(count_file).read())
    assert total >= 10, total
    seen = []
    for at in range(1, total + 1):
        folder, code, _ = crash_at(at)
        assert code == 17, (at, code)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tessera"):
            path, meta, weight = _resume_tiny(folder)
        assert path is not None, f"crash at operation {at}/{total}: no usable checkpoint left in {os.listdir(folder)}"
        got = (meta["step"], weight)
        assert got in (old, (step, value)), (at, got)
        assert not [r for r in caplog.records if "unusable" in r.getMessage()], \
            f"crash at operation {at}: the newest checkpoint was damaged: {caplog.text}"
        leftovers = [n for n in os.listdir(folder) if not n.startswith("step_")]
        assert not leftovers, f"crash at operation {at}: {leftovers} not cleaned up"
        seen.append(got)
    # the new checkpoint takes over at one point and stays; both states occur
    switch = seen.index((step, value))
    assert 0 < switch and all(s == (step, value) for s in seen[switch:]), seen


def test_keep_last_bounds_the_number_of_checkpoints(tmp_path):
    folder = str(tmp_path / "ckpt")
    for step in range(1, 6):
        _save_tiny(folder, step, float(step), keep_last=2)
        assert [os.path.basename(p) for p in list_checkpoints(folder)] == [f"step_{s}" for s in range(max(1, step - 1), step + 1)]
    assert sorted(os.listdir(folder)) == ["step_4", "step_5"]


# ------------------------------------------------------------------------------------------ damaged checkpoints
@pytest.mark.slow
def test_flipped_bytes_in_a_shard_are_reported_and_the_run_falls_back(tmp_path, ref):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for step in (2, 3):
        shutil.copytree(os.path.join(ref["ckpt"], f"step_{step}"), ckpt / f"step_{step}")
    damaged = ckpt / "step_3" / "model_tp1.safetensors"  # read by rank 1 only: rank 0 must fall back too
    flip_bytes(damaged)
    run = launch(tmp_path, "damaged", ["ckpt.checkpoint_every=1"], ckpt=str(ckpt)).check_ok()
    rank0_warnings = [line for line in run.stderr.splitlines() if "rank0 WARNING" in line]
    assert any(str(damaged) in line and "falling back" in line for line in rank0_warnings), explain(run)
    assert [os.path.basename(p) for p in resumed_from(run)] == ["step_2"]
    assert sorted(run.losses()) == list(range(3, N + 1))
    assert_continues_like_reference(run, ref, 3)


def _tiny_model_and_optimizer(seed):
    from tessera.core.naive_amp import NaiveAMPModel
    from tessera.optim.hybrid_zero import HybridZeroOptimizer

    torch.manual_seed(seed)
    model = NaiveAMPModel(nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 2)), dtype="bf16", sync_buffer=False)
    opt = HybridZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    return model, opt


def _train_and_save(folder, step, seed):
    from tessera.core.naive_amp import unwrap_model

    model, opt = _tiny_model_and_optimizer(seed)
    x = torch.randn(4, 6)
    opt.backward(model(x).float().pow(2).mean())
    assert opt.step()[0]
    save_checkpoint(folder, step, _tiny_state(unwrap_model(model), step, {"cpu": torch.get_rng_state()}, opt),
                    config={"seed": seed}, layout=Layout())
    return model, opt


def _resume_with_optimizer(folder):
    from tessera.core.naive_amp import unwrap_model

    model, opt = _tiny_model_and_optimizer(99)
    state = _tiny_state(unwrap_model(model), optimizer=opt)
    path, meta = find_resumable_checkpoint(folder, Layout(), load=lambda p: load_checkpoint(p, state, layout=Layout()))
    return path, meta, model, opt


@pytest.mark.parametrize("damage", ["flip:model_tp0.safetensors", "flip:optim_tp0_zero0.safetensors",
                                    "truncate:rng_rank0.safetensors", "truncate:model_tp0.safetensors",
                                    "flip:meta.json", "tamper:meta.json", "delete:optim_tp0_zero0.safetensors"])
def test_damaged_file_is_named_and_the_previous_checkpoint_is_used(tmp_path, caplog, damage):
    folder = str(tmp_path / "ckpt")
    old_model, _ = _train_and_save(folder, 1, seed=1)
    _train_and_save(folder, 2, seed=2)
    how, name = damage.split(":")
    target = os.path.join(folder, "step_2", name)
    if how == "flip":
        flip_bytes(target, 0.9 if name.endswith(".safetensors") else 0.02)
    elif how == "tamper":  # still valid JSON, a different step: only meta.json's own digest can tell
        meta = json.load(open(target))
        meta["trainer_state"]["progress"]["step"] = 7
        json.dump(meta, open(target, "w"))
    elif how == "truncate":
        with open(target, "r+b") as f:
            f.truncate(os.path.getsize(target) - 7)
    else:
        os.remove(target)
    from tessera.core.naive_amp import unwrap_model

    with pytest.raises(CheckpointError) as err:
        m, o = _tiny_model_and_optimizer(5)
        load_checkpoint(os.path.join(folder, "step_2"), _tiny_state(unwrap_model(m), optimizer=o), layout=Layout())
    assert target in str(err.value), err.value
    with caplog.at_level(logging.WARNING, logger="tessera"):
        path, meta, model, _ = _resume_with_optimizer(folder)
    assert os.path.basename(path) == "step_1" and meta["trainer_state"]["progress"]["step"] == 1
    assert any(target in r.getMessage() and "falling back" in r.getMessage() for r in caplog.records), caplog.text
    for p, q in zip(model.parameters(), old_model.parameters()):
        assert torch.equal(p, q)


def test_all_checkpoints_damaged_is_an_error_not_a_silent_fresh_start(tmp_path):
    folder = str(tmp_path / "ckpt")
    for step in (1, 2):
        _train_and_save(folder, step, seed=step)
        flip_bytes(os.path.join(folder, f"step_{step}", "model_tp0.safetensors"), 0.9)
    with pytest.raises(CheckpointError, match="no usable checkpoint") as err:
        _resume_with_optimizer(folder)
    assert "step_1" in str(err.value) and "step_2" in str(err.value)


# ------------------------------------------------------------------------------------------ no unpickling
@pytest.mark.slow
def test_loading_never_unpickles(tmp_path, monkeypatch, ref):
    """Load a real TP=2 training checkpoint (resharded to TP=1) and a ZeRO optimizer state with every
    unpickling entry point patched to raise."""
    import io

    from tessera.config import Config
    from tessera.core.job import Job
    from tessera.train.builder import build_training_stack

    def forbidden(*a, **k):
        raise AssertionError("a checkpoint load unpickled something")

    cfg = Config.from_file(TINY, [o for o in COMMON if not o.startswith("parallel.")])
    stack = build_training_stack(cfg, Job.of(cfg))
    model, opt = stack.model, stack.optimizer
    path = os.path.join(ref["ckpt"], f"step_{N}")
    assert sorted(os.listdir(path)) == ["meta.json", "model_tp0.safetensors", "model_tp1.safetensors",
                                        "optim_tp0_zero0.safetensors", "optim_tp1_zero0.safetensors",
                                        "rng_rank0.safetensors", "rng_rank1.safetensors"]
    for mod, name in [(pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load"),
                      (torch.serialization, "load")]:
        monkeypatch.setattr(mod, name, forbidden)
    import _pickle
    monkeypatch.setattr(_pickle, "loads", forbidden)
    monkeypatch.setattr(_pickle, "load", forbidden)
    monkeypatch.setattr(_pickle, "Unpickler", forbidden)
    with pytest.raises(AssertionError):  # the patch is effective
        pickle.loads(pickle.dumps(io.BytesIO))
    progress = Progress()
    load_checkpoint(path, TrainState(stack.inner_model, opt, progress=progress), layout=Layout())
    assert progress.step == N
    assert opt.state_dict()["num_steps"] == N
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_readme_says_config_files_run_as_code(tmp_path):
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert "Config files are Python and\nrun as code" in readme or "Config files are Python and run as code" in readme
    from tessera.config import Config

    marker = tmp_path / "ran"
    cfg = tmp_path / "cfg.py"
    cfg.write_text(open(TINY).read() + f"\nopen({str(marker)!r}, 'w').close()\n")
    Config.from_file(str(cfg))
    assert marker.exists()  # exactly what the README warns about


def test_metrics_jsonl_recovers_from_a_torn_last_line(tmp_path):
    """A rank 0 killed mid-write leaves half a JSON line; the restarted attempt's records stay parseable."""
    from tessera.train.metrics import MetricsWriter

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 1, "loss": 2.0}\n{"kind": "train", "st')
    w = MetricsWriter(str(tmp_path), True, 10, 1, tensorboard=False, progress_bar=False)
    w.log_train(2, {"loss": 1.5}, line=False)
    w.close()
    lines = path.read_text().splitlines()
    assert json.loads(lines[0])["step"] == 1 and json.loads(lines[-1])["step"] == 2
    assert lines[1] == '{"kind": "train", "st'  # the torn record is left alone, on its own line


# ------------------------------------------------------------------------------------------ non-finite losses
def test_nan_loss_in_bf16_skips_on_both_ranks_then_stops_naming_step_and_checkpoint(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run = launch(tmp_path, "nan", ["model.dtype='torch.bfloat16'", "ckpt.checkpoint_every=2",
                                   "hybrid_zero_optimizer.max_consecutive_skips=2"], ckpt=ckpt,
                 env={"TESSERA_FAULT_NAN": "1:2,4,5,6"})  # rank 1 only: rank 0's own loss stays finite
    assert run.rc not in (0, 124), run.rc
    expected = "stopping at step 6: 3 optimizer steps in a row had inf/NaN gradients"
    reports = [line for line in run.stderr.splitlines() if line.startswith("[rank ") and "] error: " in line]
    assert any(expected in line and f"last good checkpoint: {os.path.join(ckpt, 'step_4')}" in line
               and "max_consecutive_skips" in line for line in reports), explain(run)
    rows = {r["step"]: r for r in run.rows()}
    assert sorted(rows) == [1, 2, 3, 4, 5]
    assert [rows[s]["success"] for s in range(1, 6)] == [True, False, True, False, False]
    assert [rows[s]["skipped_steps"] for s in range(1, 6)] == [0, 1, 1, 2, 3]
    for rank in (0, 1):
        t = last_per_step(run.trace(rank))
        assert [t[s]["success"] for s in range(1, 6)] == [True, False, True, False, False], rank
        assert t[2]["params"] == t[1]["params"] and t[5]["params"] == t[4]["params"] == t[3]["params"], rank
        assert t[3]["params"] != t[2]["params"], rank  # a clean step after a skip trains again
    assert [os.path.basename(p) for p in list_checkpoints(ckpt)] == ["step_2", "step_4"]


def test_fp16_stop_rule_counts_skips_only_at_the_minimum_scale():
    """fp16: overflows back the scale off (no stop) until it reaches min_scale; from then on the same
    max_consecutive_skips rule as bf16/fp32 applies."""
    from tessera.core.grad_scaler import DynamicGradScaler
    from tessera.core.naive_amp import NaiveAMPModel
    from tessera.optim.hybrid_zero import HybridZeroOptimizer, TooManySkippedSteps

    torch.manual_seed(0)
    model = NaiveAMPModel(nn.Linear(4, 2), dtype="fp16", sync_buffer=False)
    scaler = DynamicGradScaler(initial_scale=2**10, min_scale=2**4, hysteresis=1, growth_interval=1000)
    opt = HybridZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), grad_scaler=scaler,
                              zero_cfg={"max_consecutive_skips": 3})
    x = torch.randn(3, 4)
    backoffs = 10 - 4  # 2**10 -> 2**4 by halving
    steps = 0
    with pytest.raises(TooManySkippedSteps) as err:
        while steps < 100:
            steps += 1
            opt.backward(model(x * float("inf")).float().sum())
            assert opt.step()[0] is False
    # backoffs overflows while the scale can still drop, then 3 allowed at the minimum, the 4th stops
    assert steps == backoffs + 3 + 1, steps
    assert opt.loss_scale == 2**4 and "at the minimum loss scale (loss scale now 16)" in str(err.value), err.value
    # bf16 (constant scale): every skip counts, and a clean step resets the count
    model = NaiveAMPModel(nn.Linear(4, 2), dtype="bf16", sync_buffer=False)
    opt = HybridZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), zero_cfg={"max_consecutive_skips": 3})

    def step(bad):
        opt.backward(model(x * float("nan") if bad else x).float().sum())
        return opt.step()[0]

    assert [step(True) for _ in range(3)] == [False] * 3
    assert step(False) is True
    assert [step(True) for _ in range(3)] == [False] * 3
    with pytest.raises(TooManySkippedSteps, match="4 optimizer steps in a row"):
        step(True)


# ------------------------------------------------------------------------------------------ no hangs
def test_a_rank_raising_mid_step_stops_the_job_without_a_forced_kill(tmp_path):
    """Rank 1 raises in step 3: the job goes down with its error, and no rank is left hanging for torchrun to
    SIGKILL after its grace period (how long that takes is the machine's business: the launch's hang guard
    only catches a job that never ends)."""
    run = launch(tmp_path, "raise", env={"TESSERA_FAULT_RAISE": "1:3"})
    assert run.rc not in (0, 124), run.rc
    assert "[rank 1] training failed" in run.stderr and "injected fault: rank 1 raises mid-step 3" in run.stderr
    assert "forcefully exiting" not in run.stderr  # no rank was left hanging for torchrun to SIGKILL
    assert sorted(run.losses()) == [1, 2]


@pytest.mark.parametrize("route", ["gloo", "shm"])
def test_a_hung_rank_is_caught_by_the_collective_timeout(tmp_path, route):
    """Rank 1 stops answering mid-step; rank 0's next collective in the TP group (gloo made by new_group,
    or the shared-memory all-reduce) gives up after dist.timeout_s instead of gloo's default of 30
    minutes, and the job goes down: the error quotes the configured timeout (a hang until gloo's default would
    trip the launch's hang guard instead)."""
    timeout_s = 4
    mode = "off" if route == "gloo" else "on"
    run = launch(tmp_path, "hang", [f"dist.timeout_s={timeout_s}", f"dist.cpu_shm_allreduce='{mode}'"],
                 env={"TESSERA_FAULT_HANG": "1:3"})
    assert run.rc not in (0, 124), run.rc
    assert "hanging mid-step 3" in run.stderr
    assert "[rank 0] training failed" in run.stderr, explain(run)
    if route == "gloo":
        assert f"Timed out waiting {timeout_s * 1000}ms" in run.stderr, explain(run)
    else:
        assert f"timed out after {timeout_s} s (dist.timeout_s) waiting for global rank(s) [1]" in run.stderr, \
            explain(run)


# ------------------------------------------------------------------------------------------ stop requests
def stops_reported(run: Run) -> list[tuple[str, int]]:
    """(reason, step) of each "stop requested (REASON) after step N" event the run logged."""
    found = [re.fullmatch(r"stop requested \((.*)\) after step (\d+)", e.get("message", "")) for e in events(run)]
    return [(m.group(1), int(m.group(2))) for m in found if m]


@pytest.mark.slow
def test_sigterm_and_stop_file_save_and_exit_then_resume(tmp_path, ref):
    """A stop request saves the step the run reports it stopped after, and a relaunch resumes from there.

    Which step a request lands after is not left to timing: with TESSERA_FAULT_READY the run reports (a file)
    that step STEP is done and holds there until the request has reached its ranks, so it stops after STEP."""
    ckpt = str(tmp_path / "ckpt")
    every = ["ckpt.checkpoint_every=100"]  # only the stop requests (and the end) save

    # 1. SIGTERM to the torchrun agent once the run reports step 3 done
    ready = str(tmp_path / "ready_a")
    a = Run(tmp_path, "a", every, ckpt=ckpt, env={"TESSERA_FAULT_READY": f"3:{ready}"})
    wait_for_file(ready, a)
    a.proc.send_signal(signal.SIGTERM)
    a.wait()
    assert stops_reported(a) == [("SIGTERM", 3)], (events(a), explain(a))
    stop_a = 3
    assert max(a.losses()) == stop_a  # nothing trained past the reported step
    assert [os.path.basename(p) for p in list_checkpoints(ckpt)] == [f"step_{stop_a}"]
    # torchrun itself exits 1 when signalled (SignalException); its workers saved and returned cleanly
    for rank in (0, 1):
        assert f"[fault_train rank {rank} attempt 0] main returned 0" in a.stderr, explain(a)
    assert "forcefully exiting" not in a.stderr, explain(a)  # no SIGKILL after torchrun's grace period
    assert "training failed" not in a.stderr and "] error:" not in a.stderr

    # 2. resume, then a stop file once the run reports step stop_a + 2 done
    ready, stop_file = str(tmp_path / "ready_b"), str(tmp_path / "STOP")
    b = Run(tmp_path, "b", every, ckpt=ckpt, extra=["--stop-file", stop_file],
            env={"TESSERA_FAULT_READY": f"{stop_a + 2}:{ready}"})
    wait_for_file(ready, b)
    open(stop_file, "w").close()
    b.wait()
    b.check_ok()
    assert [os.path.basename(p) for p in resumed_from(b)] == [f"step_{stop_a}"]
    assert stops_reported(b) == [(f"stop file {stop_file}", stop_a + 2)], events(b)
    stop_b = stop_a + 2
    assert max(b.losses()) == stop_b
    assert [os.path.basename(p) for p in list_checkpoints(ckpt)] == [f"step_{stop_a}", f"step_{stop_b}"]
    assert not os.path.exists(stop_file), "an honoured stop file is removed so the next launch trains on"

    # 3. resume and finish; every step's final loss equals the uninterrupted run's
    c = launch(tmp_path, "c", every, ckpt=ckpt).check_ok()
    assert [os.path.basename(p) for p in resumed_from(c)] == [f"step_{stop_b}"]
    assert {**a.losses(), **b.losses(), **c.losses()} == ref["losses"]
    assert_continues_like_reference(c, ref, stop_b + 1)
