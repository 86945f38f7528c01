"""``python -m benchmarks emulation`` at a toy size: every variant runs (bf16 once, each recipe with its
quantizers eager and compiled), the table rows carry both columns, and the ratios are per round."""

from __future__ import annotations

import os

import pytest

from benchmarks import emulation
from tessera.parallel import quantizer_kernels


def test_the_linear_table_times_each_recipe_eager_and_compiled(monkeypatch, capsys):
    if quantizer_kernels._compiler("cpu") is None:
        pytest.skip("no C++ compiler: the quantizers cannot be compiled here")
    monkeypatch.setenv(quantizer_kernels.ENV, "eager")  # restored after the test, as the benchmark restores it
    monkeypatch.setattr(emulation, "LINEAR_DIMS", [("toy", (32, 32, 32))])
    monkeypatch.setattr(emulation, "RECIPES", [r for r in emulation.RECIPES if r[0] in ("bf16", "fp8 rowwise")])
    assert emulation.main(["--rounds", "2", "--skip-steps"]) == 0
    assert os.environ[quantizer_kernels.ENV] == "eager"
    out = capsys.readouterr().out
    rows = {line.split(" | ")[0][2:]: line for line in out.splitlines() if line.startswith("| ") and "---" not in line}
    assert set(rows) == {"recipe", "bf16", "fp8 rowwise"}
    for name in ("fp8 rowwise",):
        cells = [c.strip() for c in rows[name].strip("|").split("|")]
        assert float(cells[1]) > 0 and float(cells[3]) > 0 and cells[2].endswith("]") and cells[4].endswith("]")
    assert "**One linear, forward and backward**, toy (32 tokens, 32 -> 32)" in out
