"""The failure message of a test that ran a subprocess names the subprocess's first error, not its last warnings."""

from __future__ import annotations

import subprocess
import sys
import time

from harness.distributed import kill_with_stacks
from harness.failure import explain, first_error

WARNINGS = "\n".join(f"[12:00:0{i} rank0 WARNING] config note {i}: " + "x" * 300 for i in range(20))


def test_tesseras_error_line_is_found_before_later_warnings():
    err = "[12:00:00 rank1 INFO] launched\n[rank 1] error: data.train_folder=/nope: no such folder\n" + WARNINGS
    proc = subprocess.CompletedProcess(["train.py"], 1, "", err)
    message = explain(proc)
    assert first_error(err) == "[rank 1] error: data.train_folder=/nope: no such folder"
    assert "first error (stderr): [rank 1] error: data.train_folder=/nope" in message
    assert message.startswith("exit code 1")


def test_a_tracebacks_exception_line_is_the_first_error():
    done = subprocess.run([sys.executable, "-c", "import warnings; warnings.warn('noise'); raise ValueError('bad x')"],
                          capture_output=True, text=True)
    assert done.returncode == 1
    assert first_error(done.stderr) == "ValueError: bad x"
    assert "first error (stderr): ValueError: bad x" in explain(done)


def test_no_error_is_said_plainly_and_objects_with_rc_work():
    class Run:
        rc, stdout, stderr = 3, "all fine", "nothing here"

    message = explain(Run())
    assert message.startswith("exit code 3") and "first error: none found" in message


def test_a_hung_run_is_killed_with_its_python_stacks(tmp_path):
    ready = tmp_path / "ready"
    child = f"import pathlib, time\ndef waits_forever():\n    pathlib.Path({str(ready)!r}).touch()\n    time.sleep(600)\nwaits_forever()"
    parent = f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {child!r}])"
    proc = subprocess.Popen([sys.executable, "-c", parent], stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={"PYTHONFAULTHANDLER": "1", "PATH": "/usr/bin:/bin"})
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert time.monotonic() < deadline and proc.poll() is None, "the child never started"
        time.sleep(0.05)
    kill_with_stacks(proc.pid)
    _, err = proc.communicate(timeout=60)
    assert "in waits_forever" in err, err
