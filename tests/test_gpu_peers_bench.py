"""``python -m benchmarks gpu-peers`` runs end to end (configs/tiny.py dims on the CPU, eager variants): both
stacks train on the same tokens and the report has a row per variant with a paired ratio."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from harness.failure import explain

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_gpu_peers_runs_on_tiny_dims(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "B.md"
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "gpu-peers", "--tiny", "--device", "cpu", "--rounds",
                           "2", "--warmup", "1", "--only", "tessera eager,hf eager", "--out", str(out),
                           "--json", str(tmp_path / "r.json")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, explain(proc)
    text = out.read_text()
    assert "<!-- section:gpu-peers -->" in text and "| tessera eager |" in text and "| hf eager |" in text
    assert "tokens/s vs hf eager" in text and "**1.00x**" in text  # hf eager against itself
