"""What a newcomer sees when something is wrong: one ``error:`` line that names its cause.

- Before a rank exists (no launcher gave one, no job joined yet) the line is ``error: ...``, not
  ``[rank ?] error: ...``; a single process that has joined its job of one is rank 0.
- An error caused by a command-line override names the override, not the config file that does not hold it.
- A bad value of a ``TESSERA_*`` environment variable is one line, not a traceback.
- Under torchrun, each rank's line is also its error file, which torchrun's failure summary then shows in place
  of "To enable traceback see ..." (torchrun still prints its own ``ChildFailedError`` summary after it: its
  agent raises that for any non-zero exit of a worker, whatever the worker writes; ``python -m tessera.run`` leaves
  it out: tests/test_run_wrapper.py).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from harness.distributed import run_torchrun
from harness.failure import explain
from tessera.config import Config, ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.py")
HANG_GUARD_S = 240  # a hang guard, not a speed requirement
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "GROUP_RANK")


def _env(**extra: str) -> dict[str, str]:
    """This environment without any launcher's variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARIABLES and not k.startswith(("SLURM_", "TORCHELASTIC"))}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": ROOT, **extra}


def _train(tmp_path, *overrides: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``python train.py --config tiny OVERRIDES`` without a launcher (started, not waited for)."""
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config", TINY, "metrics.progress_bar=False",
           f"log_folder='{tmp_path / 'logs'}'", *overrides]
    return subprocess.Popen(cmd, cwd=str(tmp_path), env=env or _env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=HANG_GUARD_S)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _only_error_line(proc: subprocess.CompletedProcess, rank: str | None = None) -> str:
    """Exit 1 and exactly one error line, no traceback: ``[rank R] error: ...`` once the single process has
    joined its job of one (``rank`` "0"), ``error: ...`` with no rank named before; that line without the rank."""
    assert proc.returncode == 1, explain(proc)
    prefix = f"[rank {rank}] " if rank is not None else ""
    lines = [line for line in proc.stderr.splitlines() if line.startswith(f"{prefix}error: ")]
    assert len(lines) == 1, explain(proc)
    assert "Traceback" not in proc.stderr and (rank is not None or "[rank" not in proc.stderr), explain(proc)
    return lines[0][len(prefix):]


def test_an_override_s_error_names_the_override_and_a_file_s_error_the_file(tmp_path):
    """In-process: the value came from the command line, so the message begins with that override and does not
    send the reader to the file; the same mistake in the file keeps ``(in FILE)`` and blames no override."""
    with pytest.raises(ConfigError) as e:
        Config.from_file(TINY, ["data.seq_len=32", "model.dtype=bogus"])
    assert str(e.value).startswith("override model.dtype=bogus: model.dtype: unknown dtype 'bogus'; valid names: ")
    assert "(in " not in str(e.value) and "model.dtype: model.dtype" not in str(e.value), e.value
    both = ["data.seq_len=64", "model.max_position_embeddings=48"]
    with pytest.raises(ConfigError) as e:
        Config.from_file(TINY, both)
    assert str(e.value) == f"overrides {' '.join(both)}: data.seq_len=64 exceeds model.max_position_embeddings=48", \
        e.value
    in_file = tmp_path / "bad_dtype.py"
    in_file.write_text(open(TINY).read() + "\nmodel['dtype'] = 'bogus'\n")
    with pytest.raises(ConfigError) as e:
        Config.from_file(in_file, ["data.seq_len=32"])
    assert str(e.value).startswith("model.dtype: unknown dtype 'bogus'") and str(e.value).endswith(f"(in {in_file})")


def test_train_py_without_a_launcher_reports_one_unranked_line(tmp_path):
    """A bad override at validation, and an override the launch refuses (the world size of one process cannot
    hold TP 2): each is one ``error: override ...`` line without a rank."""
    dtype, tensor = _train(tmp_path, "model.dtype=bogus"), _train(tmp_path, "parallel.tensor.size=2")
    line = _only_error_line(_finish(dtype))
    assert line.startswith("error: override model.dtype=bogus: model.dtype: unknown dtype 'bogus'"), line
    line = _only_error_line(_finish(tensor))
    assert line == ("error: override parallel.tensor.size=2: world size 1 is not a multiple of "
                    "parallel.tensor.size=2: world size must equal tensor size x data size"), line


def test_a_bad_tessera_environment_variable_is_one_line(tmp_path):
    """``TESSERA_CPU_LOWP_MATMUL`` is read at the first bf16 matmul on a CPU, deep in the first step: its
    ValueError reaches train.py's report as one line naming the variable and its value."""
    proc = _finish(_train(tmp_path, "model.dtype='torch.bfloat16'", "data.type='synthetic'", "data.total_steps=1",
                          env=_env(TESSERA_CPU_LOWP_MATMUL="bogus")))
    line = _only_error_line(proc, rank="0")
    assert line.startswith("error: environment variable TESSERA_CPU_LOWP_MATMUL='bogus': "), line
    assert "training failed" not in proc.stderr and "step 1 |" not in proc.stdout, explain(proc)


def test_under_torchrun_each_rank_s_line_is_what_torchrun_s_summary_shows(tmp_path):
    """A real torchrun of two ranks with a bad override: one tessera line per rank, and torchrun's summary quotes
    those lines (the error file) instead of pointing to its documentation."""
    proc = run_torchrun([os.path.join(ROOT, "train.py"), "--config", TINY, f"log_folder='{tmp_path / 'logs'}'",
                         "model.dtype=bogus"], nproc_per_node=2, timeout=HANG_GUARD_S, cwd=str(tmp_path), env=_env())
    assert proc.returncode == 1, explain(proc)
    reported = {}
    for line in proc.stderr.splitlines():
        if line.startswith("[rank ") and "] error: " in line:
            reported.setdefault(line[len("[rank "):line.index("]")], []).append(line)
    # each rank that reported did so once (torchrun may stop the slower rank before it reports)
    assert reported and all(len(lines) == 1 for lines in reported.values()), explain(proc)
    for rank, (line,) in reported.items():
        assert line.startswith(f"[rank {rank}] error: override model.dtype=bogus: model.dtype: unknown dtype"), line
    root_cause = proc.stderr.split("Root Cause (first observed failure):")[-1]
    quoted = [line.strip()[len("traceback : "):] for line in root_cause.splitlines()
              if line.strip().startswith("traceback : ")]
    assert len(quoted) == 1 and quoted[0] in [lines[0] for lines in reported.values()], explain(proc)
