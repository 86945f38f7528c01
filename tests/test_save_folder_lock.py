"""One run per save folder: the lock ``train.py`` (rank 0) and the checkpoint-writing tools take on
``ckpt.save_ckpt_folder``.

- A second writer is refused before it writes anything, with one line naming the folder and the holder
  (pid and host); a reader (``ckpt.load_ckpt_folder``) takes no lock.
- A holder killed with SIGKILL leaves its lock file behind but no lock: the next writer takes the folder at
  once. A holder that ends cleanly removes the file.
- Through the command line: ``train.py`` on one process and under torchrun (every rank says it), the first
  run finishes and its checkpoints load; ``tools/convert_checkpoint.py`` and ``tools/import_hf.py``.

The other holder is always a separate process (within one process the lock is re-entrant, by design).
"""

from __future__ import annotations

import errno
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from types import ModuleType

import pytest

from harness.distributed import run_torchrun
from harness.failure import explain
from tessera.checkpoint import LOCK_FILE, CheckpointError, folder_lock, hold_folder, list_checkpoints
from tessera.checkpoint import lock as lock_mod

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.py")
FAULT_TRAIN = os.path.join(ROOT, "tests", "fault_train.py")
COMMON = ["metrics.progress_bar=False", "metrics.tensorboard=False", "generate.max_new_tokens=0", "data.seq_len=32",
          "data.micro_bsz=1"]
# a hang guard, not a speed requirement: a process still running after this is hung, and fails; generous, as a
# loaded 2-core machine can take minutes to start torch
HANG_GUARD_S = 300
# holds the lock until killed (stdin closed or a signal); imports the lock module only
HOLDER = ("import sys, time; from tessera.checkpoint.lock import hold_folder; hold_folder(sys.argv[1]); "
          "sys.stdin.read()")


# ------------------------------------------------------------------------------------------ helpers
def _env(**extra: str) -> dict[str, str]:
    """This environment without any launcher's variables (a test may run under one), plus ``extra``."""
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")
    env = {k: v for k, v in os.environ.items() if k not in launcher and not k.startswith(("SLURM_", "TORCHELASTIC"))}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": ROOT, **extra}


def _wait_until(what: str, ready, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not ready():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the process ended ({proc.returncode}) before {what}:\n{out[-2000:]}\n{err[-4000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no {what} within HANG_GUARD_S={HANG_GUARD_S} s")
        time.sleep(0.05)


def _holder(folder: str) -> subprocess.Popen:
    """Another process holding ``folder``'s lock (it has said so in the lock file once this returns)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, folder], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env())
    _wait_until("lock", lambda: f"pid {proc.pid} " in (lock_mod.lock_holder(folder) or ""), proc)
    return proc


def _kill(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.communicate(timeout=HANG_GUARD_S)


def _finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"still running after HANG_GUARD_S={HANG_GUARD_S} s (a hang):\n{err[-4000:]}")
    return proc.returncode, out, err


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "] error:" in line]


def _in_use(folder: str, pid: int) -> str:
    return f"{folder} is in use by another run (pid {pid} on host {socket.gethostname()}"


def _train(tmp_path, ckpt: str, *extra: str, script: str = os.path.join(ROOT, "train.py"), env=None):
    """``python train.py`` (one process) saving into ``ckpt``, in its own session."""
    args = [sys.executable, script, "--config", TINY, *COMMON, f"log_folder='{tmp_path / 'logs'}'",
            "ckpt.enable_save_ckpt=True", f"ckpt.save_ckpt_folder='{ckpt}'", *extra]
    return subprocess.Popen(args, cwd=str(tmp_path), env=_env(**(env or {})), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


# ------------------------------------------------------------------------------------------ the lock itself
def test_a_second_process_is_refused_naming_the_holder_then_takes_the_folder_once_it_is_killed(tmp_path):
    folder = str(tmp_path / "ckpt")
    holder = _holder(folder)
    try:
        with pytest.raises(CheckpointError) as refused:
            hold_folder(folder)
        assert _in_use(folder, holder.pid) in str(refused.value), refused.value
        assert os.path.join(folder, LOCK_FILE) in str(refused.value)
    finally:
        _kill(holder)  # SIGKILL: no clean-up ran, the lock file stays with the dead holder's name
    assert f"pid {holder.pid} " in (lock_mod.lock_holder(folder) or "")
    lock = hold_folder(folder)  # at once: the kernel dropped the lock with the process
    try:
        assert f"pid {os.getpid()} " in (lock_mod.lock_holder(folder) or "")
    finally:
        lock_mod.release(lock)
    assert not os.path.exists(os.path.join(folder, LOCK_FILE)), "a clean release removes the lock file"


def test_the_lock_is_reentrant_within_a_process_and_released_by_the_last_holder(tmp_path):
    folder = str(tmp_path / "ckpt")
    outer = hold_folder(folder)
    with folder_lock(folder) as inner:
        assert inner is outer and outer.count == 2
    assert os.path.exists(os.path.join(folder, LOCK_FILE)), "the outer hold still has it"
    lock_mod.release(outer)
    assert not os.path.exists(os.path.join(folder, LOCK_FILE))
    assert not lock_mod._HELD


def test_a_waiter_that_locked_a_removed_lock_file_starts_over_on_the_new_one(tmp_path, monkeypatch):
    """A holder removes the file (still locked) before unlocking; a process that had opened the old file gets
    the lock on a file no longer at the path, and must lock the one that is."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    path = str(folder / LOCK_FILE)
    real_open, opened = lock_mod._open, []

    def open_then_replace(p: str) -> int:
        fd = real_open(p)
        if not opened:  # the first file this waiter opened is removed and recreated by "the holder"
            os.unlink(p)
            open(p, "w").close()
        opened.append(fd)
        return fd

    monkeypatch.setattr(lock_mod, "_open", open_then_replace)
    lock = hold_folder(str(folder))
    try:
        assert len(opened) == 2 and lock.fd == opened[1]
        assert lock_mod._same_file(lock.fd, path)
    finally:
        lock_mod.release(lock)


def test_a_file_system_without_locks_warns_and_goes_on(tmp_path, monkeypatch, caplog):
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(lock_mod.fcntl, "flock", no_locks)
    folder = str(tmp_path / "ckpt")
    with caplog.at_level("WARNING", logger="tessera"), folder_lock(folder) as lock:
        assert lock.fd is None
    assert "does not support flock" in caplog.text and "would not be detected" in caplog.text


# ------------------------------------------------------------------------------------------ train.py
def test_train_py_refuses_a_held_save_folder_before_training(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    holder = _holder(ckpt)
    try:
        code, out, err = _finish(_train(tmp_path, ckpt, "data.total_steps=2"))
    finally:
        _kill(holder)
    assert code not in (0, None), err[-3000:]
    lines = _error_lines(err)
    assert len(lines) == 1, err[-3000:]
    assert f"error: ckpt.save_ckpt_folder={_in_use(ckpt, holder.pid)}" in lines[0], lines
    assert "Traceback" not in err and "step 1 |" not in out + err
    assert list_checkpoints(ckpt) == []


def test_fine_tuning_from_a_held_folder_only_reads_it(tmp_path):
    """``ckpt.load_ckpt_folder`` takes no lock: a run may start from the checkpoint of a run still going."""
    from tessera.checkpoint import Layout, Progress, TrainState, save_checkpoint
    from tessera.config import Config
    from tessera.model import build_model

    cfg = Config.from_file(TINY)
    src = str(tmp_path / "src")
    step = save_checkpoint(src, 1, TrainState(build_model(cfg.model, seed=0), progress=Progress(1)),
                           config=cfg.to_dict(), layout=Layout())
    holder = _holder(src)
    try:
        code, out, err = _finish(_train(tmp_path, str(tmp_path / "mine"), "data.total_steps=1",
                                        f"ckpt.load_ckpt_folder='{step}'"))
    finally:
        _kill(holder)
    assert code == 0, err[-3000:]
    assert f"initialized weights from {step}" in err
    assert [os.path.basename(p) for p in list_checkpoints(str(tmp_path / "mine"))] == ["step_1"]
    assert not os.path.exists(tmp_path / "mine" / LOCK_FILE), "the run's own lock went with it"


@pytest.mark.slow
def test_two_runs_on_one_folder_the_second_refuses_on_every_rank_and_the_first_finishes(tmp_path):
    """Run A (one process) holds at the end of step 2 (tests/fault_train.py's TESSERA_FAULT_READY); run B
    (torchrun, 2 ranks) on the same folder stops before training, one line on each rank naming A. A is then
    stopped through its stop file: it saves and exits 0, and run C resumes from A's checkpoint."""
    ckpt, ready, stop = str(tmp_path / "ckpt"), str(tmp_path / "ready"), str(tmp_path / "STOP")
    steps = ["data.total_steps=4", "ckpt.checkpoint_every=1"]
    a = _train(tmp_path, ckpt, *steps, "--stop-file", stop, script=FAULT_TRAIN,
               env={"TESSERA_FAULT_READY": f"2:{ready}"})
    _wait_until("step 2 of run A", lambda: os.path.exists(ready), a)
    b = run_torchrun([os.path.join(ROOT, "train.py"), "--config", TINY, *COMMON, *steps,
                      f"log_folder='{tmp_path / 'logs_b'}'", "ckpt.enable_save_ckpt=True",
                      f"ckpt.save_ckpt_folder='{ckpt}'"], nproc_per_node=2, timeout=HANG_GUARD_S, cwd=str(tmp_path),
                     env=_env())
    open(stop, "w").close()
    code_a, out_a, err_a = _finish(a)

    assert b.returncode not in (0, 124), explain(b)  # 124: the hang guard
    for rank in (0, 1):
        lines = [line for line in _error_lines(b.stderr) if line.startswith(f"[rank {rank}]")]
        assert len(lines) == 1, explain(b)
        assert f"ckpt.save_ckpt_folder={_in_use(ckpt, a.pid)}" in lines[0], lines
    assert "step 1 |" not in b.stdout + b.stderr, "B trained"

    assert code_a == 0, err_a[-4000:]
    assert "stop requested" in out_a + err_a and f"saved checkpoint {ckpt}/step_2" in out_a + err_a
    assert [os.path.basename(p) for p in list_checkpoints(ckpt)] == ["step_1", "step_2"]
    assert not os.path.exists(os.path.join(ckpt, LOCK_FILE)), "A ended cleanly: its lock file is gone"

    code_c, _, err_c = _finish(_train(tmp_path, ckpt, *steps))
    assert code_c == 0, err_c[-4000:]
    assert f"resumed from {ckpt}/step_2 at step 2" in err_c
    assert [os.path.basename(p) for p in list_checkpoints(ckpt)] == ["step_1", "step_2", "step_3", "step_4"]


@pytest.mark.slow
def test_after_kill_9_of_the_run_the_next_run_takes_the_folder_at_once(tmp_path):
    ckpt, ready = str(tmp_path / "ckpt"), str(tmp_path / "ready")
    steps = ["data.total_steps=3", "ckpt.checkpoint_every=1"]
    a = _train(tmp_path, ckpt, *steps, script=FAULT_TRAIN, env={"TESSERA_FAULT_READY": f"2:{ready}"})
    _wait_until("step 2 of run A", lambda: os.path.exists(ready), a)
    os.killpg(a.pid, signal.SIGKILL)
    a.communicate(timeout=HANG_GUARD_S)
    assert f"pid {a.pid} " in (lock_mod.lock_holder(ckpt) or ""), "the killed run's lock file is left behind"

    code, _, err = _finish(_train(tmp_path, ckpt, *steps))
    assert code == 0, err[-4000:]
    assert not _error_lines(err)
    assert f"resumed from {ckpt}/step_1 at step 1" in err
    assert [os.path.basename(p) for p in list_checkpoints(ckpt)] == ["step_1", "step_2", "step_3"]


# ------------------------------------------------------------------------------------------ tools
def _tool(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_lock_tool_{name[:-3]}", os.path.join(ROOT, "tools", name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_checkpoint_tools_refuse_a_folder_a_run_holds(tmp_path, capsys):
    """convert_checkpoint.py and import_hf.py write step folders: into a held save folder they stop with one
    line naming it and the holder, and write nothing there."""
    from tessera.checkpoint import Layout, Progress, TrainState, save_checkpoint
    from tessera.config import Config
    from tessera.model import build_model

    cfg = Config.from_file(TINY)
    src = save_checkpoint(str(tmp_path / "src"), 3, TrainState(build_model(cfg.model, seed=0), progress=Progress(3)),
                          config=cfg.to_dict(), layout=Layout())
    assert _tool("export_hf.py").main([src, str(tmp_path / "hf")]) == 0
    held = str(tmp_path / "held")
    holder = _holder(held)
    try:
        capsys.readouterr()
        runs = {"convert_checkpoint.py": [src, held, "--tp", "1"],
                "import_hf.py": [str(tmp_path / "hf"), os.path.join(held, "step_0"), "--tp", "1"]}
        for name, argv in runs.items():
            assert _tool(name).main(argv) == 1, name
            err = capsys.readouterr().err
            assert err.startswith(f"error: {_in_use(held, holder.pid)}") and err.count("\n") == 1, (name, err)
        assert sorted(os.listdir(held)) == [LOCK_FILE]
    finally:
        _kill(holder)
    assert _tool("convert_checkpoint.py").main([src, held, "--tp", "1"]) == 0  # the holder is gone
    assert [os.path.basename(p) for p in list_checkpoints(held)] == ["step_3"]
    assert sorted(os.listdir(held)) == ["step_3"]
