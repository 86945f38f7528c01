"""tools/memory_phases.py on CPU: it measures a real step of the tiny config phase by phase (storages created,
``LiveBytes``) and sets the memory check's closed forms beside them. On the CPU the closed forms of the state
and of what a forward keeps are exact for this fp32 model (tests/test_plan.py checks them on their own), so
the tool's measurement must meet them; a bad config is one ``error:`` line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from harness.failure import explain

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "memory_phases.py")
TINY = os.path.join(ROOT, "configs", "tiny.py")


def test_the_phases_of_a_step_meet_the_checks_parts(tmp_path):
    out = tmp_path / "phases.json"
    proc = subprocess.run([sys.executable, TOOL, "--config", TINY, "--json", str(out), "data.micro_num=2"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, explain(proc)
    report = json.loads(out.read_text())
    rows = {r["part"].split(":")[0].split(" (")[0]: r for r in report["rows"]}
    phases = report["phases"]
    assert abs(rows["state"]["measured"] / rows["state"]["check"] - 1) <= 0.01
    assert abs(rows["a forward keeps"]["measured"] / rows["a forward keeps"]["check"] - 1) <= 0.05
    # the phases nest: a forward's peak holds what it keeps; the whole step holds the state and a backward
    assert phases["forward_peak"] >= phases["forward_kept"] > 0
    assert phases["backward_peak"] >= phases["forward_kept"]
    assert phases["step_peak"] >= phases["state"] + phases["forward_kept"]
    assert "| state: weights, main grads, masters, moments |" in proc.stdout


def test_a_bad_config_is_one_error_line(tmp_path):
    proc = subprocess.run([sys.executable, TOOL, "--config", str(tmp_path / "missing.py")], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 1, explain(proc)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "missing.py" in lines[0], proc.stderr
