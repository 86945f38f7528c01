"""``python -m tessera.run``: torchrun in-process, whose failure ends with tessera's line when tessera reported it.

- Which failures are tessera's (in process, on the ``ProcessFailure`` objects torch builds from real error files):
  a one-line report written by ``tessera.error_file`` is; torch's own ``@record`` error file, tessera's traceback
  report and a rank that died of a signal other than torchrun's SIGTERM are not.
- The held log records of torchrun's workers layer come out before any later record, in order, or not at all.
- Real launches (slow): a bad config ends with the ranks' ``error:`` lines and one wrapper line (no traceback);
  a worker's uncaught exception keeps torchrun's full report; a good run exits 0; SIGTERM is torchrun's.
"""

from __future__ import annotations

import ast
import io
import logging
import os
import signal
import subprocess
import sys
import time
from importlib.metadata import EntryPoint

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.multiprocessing.errors.error_handler import ErrorHandler

from harness.distributed import kill_with_stacks, run_torchrun
from harness.failure import explain
from tessera import run as wrapper
from tessera.error_file import is_reported, write_error_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.py")
HANG_GUARD_S = 240  # a hang guard, not a speed requirement: a launch still running after this is hung
QUIET = ("metrics.progress_bar=False", "metrics.tensorboard=False", "generate.max_new_tokens=0")
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "GROUP_RANK")


def _env() -> dict[str, str]:
    """This environment without any launcher's variables; tessera imported from this checkout."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARIABLES and not k.startswith(("SLURM_", "TORCHELASTIC"))}
    return {**env, "PYTHONPATH": ROOT}


# ------------------------------------------------------------------------------------------ which failures
def _failure(tmp_path, name: str, exitcode: int, report: str | None = None, complete: bool = False,
             monkeypatch=None) -> ProcessFailure:
    """torch's ``ProcessFailure`` of a rank that exited with ``exitcode`` after tessera wrote ``report`` (None:
    no error file, as after a signal)."""
    path = tmp_path / f"{name}.json"
    if report is not None:
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
        write_error_file(report, complete=complete)
    return ProcessFailure(local_rank=0, pid=1000, exitcode=exitcode, error_file=str(path))


def test_only_tessera_s_one_line_report_is_marked(tmp_path, monkeypatch):
    """torch reads tessera's file as its own (the summary quotes the line); only the one-line report is marked,
    and torch's ``@record`` file of an uncaught exception (the reference format) is not."""
    line = "[rank 0] error: override model.hidden_size=-1: model.hidden_size: must be > 0, got -1"
    one_line = _failure(tmp_path, "line", 1, line, complete=True, monkeypatch=monkeypatch)
    assert f"traceback : {line}\n" in ChildFailedError("train.py", {0: one_line}).format_msg()
    assert is_reported(one_line.error_file_data)
    long = _failure(tmp_path, "long", 1, "[rank 0] training failed:\nTraceback ...", monkeypatch=monkeypatch)
    assert "traceback : [rank 0] training failed:\n" in ChildFailedError("train.py", {0: long}).format_msg()
    assert not is_reported(long.error_file_data)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "torch.json"))
    try:
        raise RuntimeError("error: looks like tessera's")
    except RuntimeError as e:
        ErrorHandler().record_exception(e)
    by_torch = ProcessFailure(local_rank=0, pid=1000, exitcode=1, error_file=str(tmp_path / "torch.json"))
    assert "RuntimeError: error: looks like tessera's" in ChildFailedError("x.py", {0: by_torch}).format_msg()
    assert not is_reported(by_torch.error_file_data)
    signalled = ProcessFailure(local_rank=0, pid=1000, exitcode=-signal.SIGSEGV, error_file=str(tmp_path / "none"))
    assert not is_reported(signalled.error_file_data)
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")
    write_error_file(line, complete=True)  # no launcher: nothing written, nothing raised
    assert sorted(p.name for p in tmp_path.iterdir()) == ["line.json", "long.json", "torch.json"]


def test_the_full_report_stays_unless_every_failed_rank_is_accounted_for(tmp_path, monkeypatch):
    def reported(exitcode: int = 1) -> ProcessFailure:
        return _failure(tmp_path, f"r{time.monotonic_ns()}", exitcode, "[rank 0] error: bad", True, monkeypatch)

    def traceback() -> ProcessFailure:
        return _failure(tmp_path, f"t{time.monotonic_ns()}", 1, "[rank 1] training failed:\nTraceback", False,
                        monkeypatch)

    def died(sig: int) -> ProcessFailure:  # no error file: its timestamp is now, after the reported ones
        return _failure(tmp_path, f"s{time.monotonic_ns()}", -sig)

    assert wrapper.reported_failure({}) is None
    assert wrapper.reported_failure({0: reported(), 1: reported()}) == (0, 1)
    assert wrapper.reported_failure({3: reported(2)}) == (3, 2)
    # a rank torchrun stopped, one that reported and then was stopped (exit code of a signal: exit 1 instead)
    assert wrapper.reported_failure({0: reported(), 1: died(signal.SIGTERM)}) == (0, 1)
    assert wrapper.reported_failure({1: reported(-signal.SIGTERM)}) == (1, 1)
    # another rank crashed: segfault, OOM kill, an uncaught exception
    assert wrapper.reported_failure({0: reported(), 1: died(signal.SIGSEGV)}) is None
    assert wrapper.reported_failure({0: reported(), 1: died(signal.SIGKILL)}) is None
    assert wrapper.reported_failure({0: reported(), 1: traceback()}) is None
    # the first failure is not tessera's one line
    first = traceback()
    first.timestamp -= 5
    assert wrapper.reported_failure({0: first, 1: reported()}) is None
    assert wrapper.reported_failure({0: died(signal.SIGTERM)}) is None


# ------------------------------------------------------------------------------------------ held log records
def test_held_records_come_out_first_in_order_or_not_at_all(monkeypatch):
    """A workers-layer warning or error is held; any later record, or the agent's info that an attempt ended,
    lets it out first (the info itself stays hidden, as torchrun hides it); ``drop`` loses what is held at the
    end, ``release`` lets it out; once the gates are gone nothing is filtered and the agent's level is back."""
    out = io.StringIO()
    top = logging.getLogger("tessera_test_run")
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(name)s %(message)s"))
    top.addHandler(handler)
    top.propagate = False
    top.setLevel(logging.INFO)
    monkeypatch.setattr(wrapper, "WORKERS_LOGGER", "tessera_test_run.workers")
    monkeypatch.setattr(wrapper, "AGENT_LOGGER", "tessera_test_run.agent")
    workers, agent = logging.getLogger("tessera_test_run.workers.api"), logging.getLogger("tessera_test_run.agent")
    agent.setLevel(logging.WARNING)
    held = wrapper._HeldRecords()
    held.install()
    try:
        workers.info("info passes")
        workers.warning("closing signal")
        workers.error("failed")
        assert out.getvalue() == "tessera_test_run.workers.api info passes\n"
        agent.warning("restarting")
        workers.error("attempt 2 failed")
        agent.info("attempt 2 ended")
        workers.error("attempt 3 failed")
        held.drop()
        workers.error("failed once more")
        held.release()
    finally:
        held.uninstall()
        top.removeHandler(handler)
    workers.error("after")
    assert agent.level == logging.WARNING
    assert out.getvalue().splitlines() == [f"tessera_test_run.{line}" for line in (
        "workers.api info passes", "workers.api closing signal", "workers.api failed", "agent restarting",
        "workers.api attempt 2 failed", "workers.api failed once more")]


# ------------------------------------------------------------------------------------------ real launches
def _wrapped(tmp_path, args: list[str], nproc: int = 2) -> subprocess.CompletedProcess[str]:
    return run_torchrun(args, nproc, timeout=HANG_GUARD_S, cwd=str(tmp_path), env=_env(), launcher="tessera.run")


@pytest.mark.slow
def test_a_bad_config_ends_with_tessera_s_lines_and_one_wrapper_line(tmp_path):
    proc = _wrapped(tmp_path, [os.path.join(ROOT, "train.py"), "--config", TINY, f"log_folder='{tmp_path / 'logs'}'",
                               "model.hidden_size=-1"])
    assert proc.returncode == 1, explain(proc)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    error = "error: override model.hidden_size=-1: model.hidden_size: must be > 0, got -1"
    assert lines[-1].startswith("tessera-run: rank ") and lines[-1].endswith(" (exit code 1); its error is above"), \
        explain(proc)
    assert lines[-2].startswith("[rank ") and lines[-2].endswith(f"] {error}"), explain(proc)
    # nor torchrun's log lines about the workers' ends (each names its source file)
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr, explain(proc)
    assert "distributed/elastic/" not in proc.stderr, explain(proc)


@pytest.mark.slow
def test_a_restarted_run_shows_the_earlier_attempt_s_failure_where_it_happened(tmp_path):
    """With ``--max-restarts=1`` both attempts fail alike: torchrun's line about the first attempt's failure
    stays between the attempts (as torchrun prints it); only the last attempt's lines are left out."""
    args = [os.path.join(ROOT, "train.py"), "--config", TINY, f"log_folder='{tmp_path / 'logs'}'", "parallel.tensor.size=3"]
    proc = run_torchrun(args, 2, timeout=HANG_GUARD_S, cwd=str(tmp_path), env=_env(), launcher="tessera.run",
                        torchrun_args=("--standalone", "--max-restarts=1"))
    assert proc.returncode == 1, explain(proc)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    torchrun_lines = [i for i, line in enumerate(lines) if "failed (exitcode: " in line]
    errors = [i for i, line in enumerate(lines) if line.startswith("[rank ") and "] error: override parallel" in line]
    assert len(torchrun_lines) == 1 and errors[0] < torchrun_lines[0] < errors[-1], explain(proc)
    assert lines[-1].startswith("tessera-run: rank ") and lines[-2].startswith("[rank "), explain(proc)
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr, explain(proc)


@pytest.mark.slow
def test_an_uncaught_exception_keeps_torchrun_s_full_report(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text("raise RuntimeError('the worker crashed')\n")
    proc = _wrapped(tmp_path, [str(script)], nproc=1)
    assert proc.returncode == 1, explain(proc)
    for expected in ("RuntimeError: the worker crashed", "failed (exitcode: 1) local_rank: 0",
                     "torch.distributed.elastic.multiprocessing.errors.ChildFailedError",
                     "Root Cause (first observed failure):", "exitcode  : 1"):
        assert expected in proc.stderr, explain(proc)
    assert "tessera-run:" not in proc.stderr, explain(proc)


@pytest.mark.slow
def test_a_good_run_exits_0(tmp_path):
    log_folder = tmp_path / "logs"
    proc = _wrapped(tmp_path, [os.path.join(ROOT, "train.py"), "--config", TINY, "data.total_steps=2", *QUIET,
                               f"log_folder='{log_folder}'"], nproc=1)
    assert proc.returncode == 0, explain(proc)
    assert "tessera-run:" not in proc.stderr and "Traceback" not in proc.stderr, explain(proc)
    assert list(log_folder.rglob("metrics.jsonl")), explain(proc)


def _sigterm_run(tmp_path, module: str) -> tuple[int, str, bool]:
    """``python -m MODULE`` (torchrun or the wrapper) of one worker that sleeps, sent SIGTERM once the worker
    runs: its exit code, its stderr, and whether the worker is gone."""
    ready = tmp_path / f"{module}.pid"
    script = tmp_path / "sleeper.py"
    script.write_text("import os, sys, time\nopen(sys.argv[1] + '.tmp', 'w').write(str(os.getpid()))\n"
                      "os.rename(sys.argv[1] + '.tmp', sys.argv[1])\ntime.sleep(600)\n")
    cmd = [sys.executable, "-m", module, "--standalone", "--nproc_per_node=1", str(script), str(ready)]
    proc = subprocess.Popen(cmd, cwd=str(tmp_path), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1]
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=HANG_GUARD_S)
    finally:
        if proc.poll() is None:
            kill_with_stacks(proc.pid)
    return proc.returncode, err, _gone(int(ready.read_text()))


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie nobody reaped yet has ended too)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.slow
def test_sigterm_is_handled_as_torchrun_handles_it(tmp_path):
    """The reference is torchrun itself: the same exit code, its ``SignalException``, the worker stopped."""
    torchrun = _sigterm_run(tmp_path, "torch.distributed.run")
    wrapped = _sigterm_run(tmp_path, "tessera.run")
    assert torchrun[0] != 0 and torchrun[2] and "SignalException" in torchrun[1], torchrun[1]
    assert wrapped[0] == torchrun[0] and wrapped[2], wrapped[1]
    assert "SignalException: Process" in wrapped[1] and "closing signal SIGTERM" in wrapped[1], wrapped[1]


def test_the_tessera_run_command_is_the_wrapper():
    """setup.py's console script ``tessera-run`` loads ``tessera.run.cli`` (read from setup.py's source: the
    editable install may predate it)."""
    tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    scripts = [ast.literal_eval(k.value)["console_scripts"] for node in ast.walk(tree) if isinstance(node, ast.Call)
               for k in node.keywords if k.arg == "entry_points"]
    assert scripts == [["tessera-run = tessera.run:cli"]]
    name, target = (part.strip() for part in scripts[0][0].split("="))
    assert EntryPoint(name, target, "console_scripts").load() is wrapper.cli
