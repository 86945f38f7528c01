"""More environment faults a user can trigger ("Ready for the cluster"): files that cannot be read or written
outside a checkpoint save. Each ends in one ``error:`` line on every rank naming the key and the path, a
non-zero exit, and nothing already saved lost.

- the config path is a folder or unreadable; an OSError that reaches train.py's ``run()`` from anywhere;
- token files that cannot be read (on every rank, or on one rank only: every rank stops together);
- the stdlib corpus preparation failing on rank 0 (a disk full) while the others wait;
- the metrics file (metrics.jsonl, the TensorBoard folder) that cannot be opened, or stops being writable
  mid-run (a small tmpfs filling up, or an injected ENOSPC): every rank stops after saving a checkpoint;
- a stop file that cannot be removed; a weights-only start whose folder is missing (the key is named).

Faults a root-run test machine cannot produce (permission denied) are injected by tests/io_fault_train.py.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from harness.distributed import run_torchrun
from harness.failure import explain
from tessera.checkpoint import read_meta, read_tree, verify_files
from tessera.config import Config, ConfigError
from tests.test_env_faults import small_tmpfs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = ["metrics.progress_bar=False", "metrics.tensorboard=False", "data.seq_len=32", "data.micro_bsz=1",
          "parallel.zero1.size=2", "generate.max_new_tokens=0", "lr_scheduler.total_steps=4"]


def _train(tmp, *overrides, refuse: str | None = None, script: str = "train.py", extra_args=(), timeout=300):
    """train.py (or tests/io_fault_train.py with ``refuse``) on 2 gloo ranks with the tiny config."""
    path = os.path.join(ROOT, "tests", "io_fault_train.py") if refuse else os.path.join(ROOT, script)
    return run_torchrun([path, "--config", os.path.join(ROOT, "configs", "tiny.py"), *extra_args, *COMMON,
                         f"log_folder='{tmp}/logs'", *overrides], nproc_per_node=2, timeout=timeout, cwd=str(tmp),
                        env={"TESSERA_REFUSE": refuse} if refuse else None)


def _only_error_lines(proc, expected: str) -> None:
    """Exactly one error line per rank, the same on both, equal to ``expected``; no traceback."""
    assert proc.returncode not in (0, 124), explain(proc)
    for rank in (0, 1):
        lines = [line for line in proc.stderr.splitlines() if line.startswith(f"[rank {rank}] error:")]
        assert lines == [f"[rank {rank}] error: {expected}"], explain(proc)
    assert "training failed" not in proc.stderr, explain(proc)  # no worker traceback


def _trained_steps(proc) -> list[int]:
    return [int(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("step ")]


@pytest.fixture(scope="module")
def token_folder(tmp_path_factory):
    """A small prepared token folder (byte tokenizer: vocab 257, so the model gets vocab_size=512)."""
    base = tmp_path_factory.mktemp("tokens")
    (base / "in").mkdir()
    for i in range(3):
        (base / "in" / f"doc{i}.txt").write_text(" ".join(f"word{(i * 7 + j) % 50}" for j in range(2000)))
    spec = importlib.util.spec_from_file_location("_prepare_data_tool", os.path.join(ROOT, "tools", "prepare_data.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main(["--input", str(base / "in"), "--output", str(base / "out"), "--quiet"]) == 0
    return str(base / "out" / "train")


# ------------------------------------------------------------------------------------------ config, run()
def test_a_config_path_that_is_a_folder_or_unreadable_is_named(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=f"^config file {tmp_path} is a folder, not a Python file$"):
        Config.from_file(tmp_path)
    cfg = tmp_path / "c.py"
    cfg.write_text("model = dict(num_layers=1)\n")
    import importlib.machinery

    def refuse(self, path):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(importlib.machinery.SourceFileLoader, "get_data", refuse)
    with pytest.raises(ConfigError, match=f"^cannot read config file {cfg}: Permission denied$"):
        Config.from_file(cfg)


def _run_with_main_raising(tmp_path, exc: str) -> subprocess.CompletedProcess:
    code = (f"import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('train', {os.path.join(ROOT, 'train.py')!r})\n"
            f"train = importlib.util.module_from_spec(spec); spec.loader.exec_module(train)\n"
            f"def main(): raise {exc}\n"
            f"train.main = main\n"
            f"train.run()\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                          env=dict(os.environ, RANK="3"))


def test_a_file_error_reaching_run_is_one_line_naming_what_was_being_done(tmp_path):
    proc = _run_with_main_raising(tmp_path, "PermissionError(13, 'Permission denied', '/x/y.bin')")
    assert proc.returncode == 1 and proc.stderr == "[rank 3] error: starting: /x/y.bin: Permission denied\n", \
        proc.stderr
    proc = _run_with_main_raising(tmp_path, "ConnectionResetError(104, 'Connection reset by peer')")
    assert proc.returncode == 1 and proc.stderr.startswith("[rank 3] training failed:\nTraceback"), proc.stderr


# ------------------------------------------------------------------------------------------ data
@pytest.mark.parametrize("ranks", ["*", "1"])
def test_unreadable_token_files_stop_every_rank_with_one_line(tmp_path, token_folder, ranks):
    """Every rank, or rank 1 alone, is refused the token file: both ranks report it (rank 1's named) and
    nothing trains; rank 0 does not wait in a collective for a rank that has gone."""
    proc = _train(tmp_path, "data.type='tokens'", f"data.train_folder='{token_folder}'", "model.vocab_size=512",
                  "data.total_steps=2", refuse=f"{ranks}:13:memmap:tokens.bin")
    who = "" if ranks == "*" else "rank 1: "
    _only_error_lines(proc, f"{who}data.train_folder={token_folder}: {token_folder}/tokens.bin: Permission denied")
    assert _trained_steps(proc) == []


def test_a_failed_stdlib_preparation_on_rank_0_stops_every_rank(tmp_path):
    """Rank 0 prepares the corpus while rank 1 waits; its disk fills at once: both ranks report it."""
    cache = tmp_path / "cache"
    proc = _train(tmp_path, "data.type='stdlib'", f"data.cache_folder='{cache}'", "data.total_steps=1",
                  refuse="0:28:open:tokens.bin")
    assert proc.returncode not in (0, 124), explain(proc)
    for rank in (0, 1):
        lines = [line for line in proc.stderr.splitlines() if line.startswith(f"[rank {rank}] error:")]
        assert len(lines) == 1, explain(proc)
        assert lines[0].startswith(f"[rank {rank}] error: rank 0: data.cache_folder={cache}: {cache}/"), lines
        assert lines[0].endswith("tokens.bin: No space left on device"), lines
    assert "training failed" not in proc.stderr and _trained_steps(proc) == []


# ------------------------------------------------------------------------------------------ metrics
@pytest.mark.parametrize("blocked", ["metrics.jsonl", "tensorboard"])
def test_a_metrics_file_that_cannot_be_opened_stops_every_rank_before_training(tmp_path, blocked):
    """metrics.jsonl taken by a folder, or the TensorBoard folder taken by a file: one line on both ranks."""
    log_dir = tmp_path / "logs" / "tessera"
    log_dir.mkdir(parents=True)
    if blocked == "metrics.jsonl":
        (log_dir / blocked).mkdir()
        why = f"{log_dir}/metrics.jsonl: Is a directory"
    else:
        (log_dir / blocked).write_text("")
        why = f"{log_dir}/tensorboard exists and is not a folder"
    proc = _train(tmp_path, "data.type='synthetic'", "data.total_steps=2", "metrics.tensorboard=True")
    _only_error_lines(proc, f"rank 0: log_folder={tmp_path}/logs: cannot write the metrics: {why}")
    assert _trained_steps(proc) == []


def _check_stopped_after_saving(proc, ckpt: str, why: str) -> None:
    steps = _trained_steps(proc)
    assert steps, explain(proc)
    last = os.path.join(ckpt, f"step_{steps[-1]}")
    _only_error_lines(proc, f"rank 0: {why}; stopped after step {steps[-1]}, last checkpoint: {last}")
    assert steps[-1] < 40 and sorted(os.listdir(ckpt)) == [f"step_{steps[-1]}"]
    meta = read_meta(last)  # the state up to the failure is saved, complete and loadable
    verify_files(last, list(meta["files"]), meta)
    for name in meta["files"]:
        read_tree(os.path.join(last, name))


def test_metrics_failing_mid_run_stop_every_rank_after_saving(tmp_path):
    """The 6th metrics.jsonl line of rank 0 fails with ENOSPC (injected): every rank saves and stops."""
    ckpt = str(tmp_path / "ckpt")
    proc = _train(tmp_path, "data.type='synthetic'", "data.total_steps=40", "ckpt.enable_save_ckpt=True",
                  f"ckpt.save_ckpt_folder='{ckpt}'", refuse="0:28:metrics:6")
    _check_stopped_after_saving(proc, ckpt, f"log_folder={tmp_path}/logs: cannot write the metrics: "
                                            f"{tmp_path}/logs/tessera/metrics.jsonl: No space left on device")
    assert _trained_steps(proc)[-1] == 5  # line 1 is the start event, lines 2-5 are steps 1-4, step 5 fails


def test_a_log_folder_filling_up_mid_run_stops_every_rank_after_saving(tmp_path):
    """The log folder on a 64 KiB tmpfs with one 4 KiB page left: metrics.jsonl fills it after a few steps."""
    with small_tmpfs(tmp_path / "small", 64 * 1024) as mnt:
        with open(os.path.join(mnt, "filler"), "wb") as f:
            f.write(b"\0" * (60 * 1024))
        ckpt = str(tmp_path / "ckpt")
        proc = _train(tmp_path, "data.type='synthetic'", "data.total_steps=40", "ckpt.enable_save_ckpt=True",
                      f"ckpt.save_ckpt_folder='{ckpt}'", f"log_folder='{mnt}/logs'")
        _check_stopped_after_saving(proc, ckpt, f"log_folder={mnt}/logs: cannot write the metrics: "
                                                f"{mnt}/logs/tessera/metrics.jsonl: No space left on device")


# ------------------------------------------------------------------------------------------ stop file, weights
def test_a_stop_file_that_cannot_be_removed_is_an_error_on_every_rank(tmp_path):
    stop = tmp_path / "stop"
    stop.mkdir()  # os.remove refuses a folder, as it refuses a file in a folder this user cannot write
    ckpt = str(tmp_path / "ckpt")
    proc = _train(tmp_path, "data.type='synthetic'", "data.total_steps=5", "ckpt.enable_save_ckpt=True",
                  f"ckpt.save_ckpt_folder='{ckpt}'", extra_args=["--stop-file", str(stop)])
    _only_error_lines(proc, f"--stop-file {stop}: cannot remove it after stopping ({stop}: Is a directory): remove "
                            f"it before relaunching, or the next launch stops after its first step; last checkpoint: "
                            f"{ckpt}/step_1")
    assert _trained_steps(proc) == [1] and os.listdir(ckpt) == ["step_1"]


def test_a_missing_weights_only_start_names_its_key(tmp_path):
    missing = tmp_path / "nowhere"
    proc = _train(tmp_path, "data.type='synthetic'", "data.total_steps=1", f"ckpt.load_ckpt_folder='{missing}'")
    _only_error_lines(proc, f"ckpt.load_ckpt_folder={missing}: {missing}/meta.json is missing: {missing} is not a "
                            "complete checkpoint")
