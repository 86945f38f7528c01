"""Faults at launch, through the command line: one ``error:`` line on every rank that runs, naming the thing to
fix, and a non-zero exit within ``dist.timeout_s`` (and the start of Python) instead of a traceback or a hang.

- The rendezvous: nothing listening at ``--host/--port`` (slurm, rank 1 of 2), the port taken by another program
  (rank 0 cannot serve it; rank 1 meets a program that never answers), fewer processes than the world size, a
  rank started twice.
- The environment: a rank outside the world size (slurm and torchrun variables), ``MASTER_ADDR`` that does not
  resolve, NCCL without CUDA (under torchrun).
- The config: a config file whose code raises, a syntax error, an override that does not parse: the file and
  line (or the override) and the text.

Slurm is simulated with the variables ``train.py --launcher slurm`` reads (SLURM_PROCID, SLURM_NTASKS,
SLURM_LOCALID, SLURM_JOB_NODELIST). ``dist.timeout_s`` is a few seconds so a rendezvous gives up quickly.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed as dist

from harness.distributed import free_port, run_torchrun
from harness.failure import explain
from tessera.core.rendezvous import LaunchError, Rendezvous

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.py")
TIMEOUT_S = 3  # dist.timeout_s of these launches
COMMON = ["metrics.progress_bar=False", "metrics.tensorboard=False", "generate.max_new_tokens=0", "data.total_steps=1",
          "data.seq_len=32", "data.micro_bsz=1", f"dist.timeout_s={TIMEOUT_S}"]
# a hang guard, not a speed requirement: a launch still running after this is hung (well past dist.timeout_s),
# and fails; generous, as a loaded 2-core machine can take a minute to start torch
HANG_GUARD_S = 240


# ------------------------------------------------------------------------------------------ helpers
def _env(**extra: str) -> dict[str, str]:
    """This environment without any launcher's variables, plus ``extra``."""
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")
    env = {k: v for k, v in os.environ.items() if k not in launcher and not k.startswith(("SLURM_", "TORCHELASTIC"))}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": ROOT, **extra}


def _slurm(rank: int, tasks: int, **extra: str) -> dict[str, str]:
    return _env(SLURM_PROCID=str(rank), SLURM_NTASKS=str(tasks), SLURM_LOCALID=str(rank), **extra)


def _start(tmp_path, args=(), env=None, config=TINY, overrides=()) -> subprocess.Popen:
    """``python train.py --config CONFIG ARGS COMMON OVERRIDES`` in its own session."""
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config", config, *args, *COMMON,
           f"log_folder='{tmp_path / 'logs'}'", *overrides]
    return subprocess.Popen(cmd, cwd=str(tmp_path), env=env or _env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the launch still ran after HANG_GUARD_S={HANG_GUARD_S} s (a hang):\n{err[-4000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _one_error(proc: subprocess.CompletedProcess, rank: str | None) -> str:
    """The launch failed and rank ``rank`` (None: a process no launcher gave a rank, whose line has no rank
    prefix) said why in exactly one ``error:`` line, with no traceback."""
    assert proc.returncode not in (0, None), explain(proc)
    prefix = f"[rank {rank}] " if rank is not None else ""
    lines = [line for line in proc.stderr.splitlines() if line.startswith(f"{prefix}error: ")]
    assert len(lines) == 1, explain(proc)
    assert rank is not None or "[rank" not in proc.stderr, explain(proc)  # no rank to name: none named
    assert "Traceback" not in proc.stderr and "training failed" not in proc.stderr, explain(proc)
    assert "step 1 |" not in proc.stdout
    return lines[0][len(f"{prefix}error: "):]


@pytest.fixture
def foreign_listener():
    """A port held by a program that accepts connections and never says a word."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("0.0.0.0", 0))
    sock.listen(16)
    yield sock.getsockname()[1]
    sock.close()


# ------------------------------------------------------------------------------------------ the rendezvous
def test_a_rendezvous_nobody_answers_names_host_port_and_the_wait(tmp_path):
    """Slurm rank 1 of 2 with nothing at the first node of the job (the default host) on --port."""
    port = free_port()
    proc = _finish(_start(tmp_path, ["--launcher", "slurm", "--port", str(port)],
                          _slurm(1, 2, SLURM_JOB_NODELIST="127.0.0.1")))
    line = _one_error(proc, "1")
    assert line.startswith(f"rendezvous at 127.0.0.1:{port} unreachable: no answer in {TIMEOUT_S} s "
                           "(dist.timeout_s; last: Connection refused)"), line
    assert f"rank 0 of this job runs on 127.0.0.1 and listens on port {port}" in line and "--host and --port" in line


def test_a_port_another_program_holds(tmp_path, foreign_listener):
    """Rank 0 cannot serve the rendezvous there; rank 1 reaches the program, which never answers (torch's own
    client would wait forever)."""
    port = foreign_listener
    args = ["--launcher", "slurm", "--host", "127.0.0.1", "--port", str(port)]
    procs = [_start(tmp_path, args, _slurm(rank, 2)) for rank in (0, 1)]
    rank0, rank1 = (_finish(p) for p in procs)
    line = _one_error(rank0, "0")
    assert line.startswith(f"rendezvous port {port} (--port) on {socket.gethostname()} is in use by another "
                           "program"), line
    line = _one_error(rank1, "1")
    assert line.startswith(f"rendezvous at 127.0.0.1:{port}: something accepts connections there but did not answer "
                           f"as rank 0's store within {TIMEOUT_S} s (dist.timeout_s)"), line
    assert "choose another --port" in line


def test_fewer_processes_than_the_world_size(tmp_path):
    """SLURM_NTASKS=3 with two tasks started: both say how many joined, and which variable to check."""
    port = str(free_port())
    args = ["--launcher", "slurm", "--host", "127.0.0.1", "--port", port]
    procs = [_start(tmp_path, args, _slurm(rank, 3)) for rank in (0, 1)]
    for rank, proc in enumerate(procs):
        line = _one_error(_finish(proc), str(rank))
        assert line.startswith(f"rendezvous at 127.0.0.1:{port}: 2 of 3 ranks joined in {TIMEOUT_S} s "
                               "(dist.timeout_s): check that SLURM_NTASKS=3 is the number of processes launched"), line


def test_a_rank_started_twice_is_named(tmp_path):
    """The rank count in the store, without processes: rank 0 and two rank 1s of a world of 2 (threads)."""
    port = free_port()
    outcome: dict[str, str] = {}
    stores = []  # kept: rank 0's store serves the rendezvous only while it lives

    def join(name: str, rank: int) -> None:
        try:
            stores.append(Rendezvous("127.0.0.1", port, rank, 2, names=("--host", "--port"),
                                     world_name="SLURM_NTASKS", rank_name="SLURM_PROCID").connect(TIMEOUT_S))
            outcome[name] = "joined"
        except LaunchError as e:
            outcome[name] = str(e)

    first = threading.Thread(target=join, args=("rank 0", 0))
    first.start()
    join("rank 1", 1)
    join("rank 1 again", 1)
    first.join(HANG_GUARD_S)
    assert outcome["rank 0"] == outcome["rank 1"] == "joined", outcome
    assert outcome["rank 1 again"] == (f"rendezvous at 127.0.0.1:{port}: a second process joined as rank 1 "
                                       "(SLURM_PROCID=1): every process of the job needs its own SLURM_PROCID")


# ------------------------------------------------------------------------------------------ the environment
def test_a_rank_outside_the_world_size(tmp_path):
    slurm = _start(tmp_path, ["--launcher", "slurm", "--host", "127.0.0.1", "--port", str(free_port())],
                   _slurm(2, 2))
    torchrun = _start(tmp_path, env=_env(RANK="3", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                                         MASTER_PORT=str(free_port())))
    assert _one_error(_finish(slurm), "2") == ("SLURM_PROCID=2 does not fit SLURM_NTASKS=2 (ranks 0..1): launch every "
                                              "process of the job with the same SLURM_NTASKS and its own SLURM_PROCID")
    assert _one_error(_finish(torchrun), "3").startswith("RANK=3 does not fit WORLD_SIZE=2 (ranks 0..1)")


def test_master_addr_that_does_not_resolve_and_its_traceback_at_debug_level(tmp_path):
    env = dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="no-such-host.invalid",
               MASTER_PORT=str(free_port()))
    plain = _start(tmp_path, env=_env(**env))
    debug = _start(tmp_path, env=_env(TESSERA_LOG_LEVEL="DEBUG", **env))
    line = _one_error(_finish(plain), "1")
    assert line.startswith("MASTER_ADDR=no-such-host.invalid does not resolve ("), line
    assert line.endswith("set it to the host name or address of the node that runs rank 0"), line
    debug_run = _finish(debug)
    assert debug_run.returncode != 0, explain(debug_run)
    assert f"[rank 1] error: {line}" in debug_run.stderr
    assert "Traceback" in debug_run.stderr and "gaierror" in debug_run.stderr, explain(debug_run)


@pytest.mark.skipif(torch.cuda.is_available() and dist.is_nccl_available(), reason="NCCL runs here")
def test_nccl_without_cuda_under_torchrun_stops_every_rank(tmp_path):
    proc = run_torchrun([os.path.join(ROOT, "train.py"), "--config", TINY, *COMMON, f"log_folder='{tmp_path}/logs'",
                         "dist.backend='nccl'"], nproc_per_node=2, timeout=HANG_GUARD_S, cwd=str(tmp_path), env=_env())
    assert proc.returncode not in (0, 124), explain(proc)  # 124: the hang guard
    for rank in (0, 1):
        lines = [line for line in proc.stderr.splitlines() if line.startswith(f"[rank {rank}] error: ")]
        assert len(lines) == 1, explain(proc)
        assert lines[0].endswith("error: backend nccl (dist.backend) is not available: "
                                 + ("this torch is built without NCCL" if not dist.is_nccl_available() else
                                    "no CUDA device is visible to this process")
                                 + "; use dist.backend='gloo' on CPUs, or leave dist.backend unset (nccl where CUDA "
                                   "is, else gloo)"), lines
    assert "training failed" not in proc.stderr


# ------------------------------------------------------------------------------------------ the config
def test_config_errors_name_the_file_the_line_and_its_text(tmp_path):
    raising, syntax = tmp_path / "raising.py", tmp_path / "syntax.py"
    raising.write_text(open(TINY).read() + "\nx = 1\ny = x / 0\n")
    syntax.write_text(open(TINY).read() + "\ndata = dict(seq_len=32\nadam = dict(lr=1)\n")
    raising_line = len(open(TINY).read().splitlines()) + 3
    procs = [_start(tmp_path, config=str(raising)), _start(tmp_path, config=str(syntax)),
             _start(tmp_path, overrides=["data.seq_len=64", "model.hidden_size=[1,"])]
    raised, bad_syntax, bad_override = (_one_error(_finish(p), None) for p in procs)
    assert raised == (f"error while running config file {raising}, line {raising_line} `y = x / 0`: "
                      "ZeroDivisionError: division by zero"), raised
    assert re.fullmatch(rf"syntax error in config file {re.escape(str(syntax))}, line \d+, column \d+: .*`.+`",
                        bad_syntax), bad_syntax
    assert "data = dict(seq_len=32" in bad_syntax or "adam = dict(lr=1)" in bad_syntax, bad_syntax
    last = len(COMMON) + 3  # COMMON, log_folder, then the two above
    assert bad_override == (f"bad override 'model.hidden_size=[1,' (override {last} of {last} on the command line): "
                            "value '[1,' is not a Python literal: '[' was never closed at column 1 of the value"), \
        bad_override


def test_a_config_helper_that_raises_names_the_config_line_and_where_it_was_raised(tmp_path):
    """In-process (``Config.from_file``): the config's line that called the helper, and the helper's own line."""
    from tessera.config import Config, ConfigError

    (tmp_path / "helper_mod.py").write_text("def hidden(n):\n    return {'a': 1}[n]\n")
    config = tmp_path / "cfg.py"
    config.write_text(f"import sys\nsys.path.insert(0, {str(tmp_path)!r})\nimport helper_mod\n"
                      "model = dict(hidden_size=helper_mod.hidden('b'))\n")
    with pytest.raises(ConfigError) as e:
        Config.from_file(config)
    assert str(e.value) == (f"error while running config file {config}, line 4 "
                            "`model = dict(hidden_size=helper_mod.hidden('b'))`: KeyError: 'b' (raised at "
                            f"{tmp_path / 'helper_mod.py'}, line 2)")
    sys.modules.pop("helper_mod", None)

