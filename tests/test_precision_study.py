"""The precision study (``python -m benchmarks precision-study``) at a toy size: runs trained several at a time
give the figures of the same runs trained alone, and the section reports every policy over its seeds."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from benchmarks import precision_study

POLICIES = ["fp32 masters (default)", "bf16 masters"]
SMALL = ["parallel.tensor.size=1", "data.total_steps=3", "lr_scheduler.total_steps=3", "data.valid_micro_num=1",
         "generate.max_new_tokens=0", "metrics.progress_bar=False", "metrics.log_every=1"]


@pytest.mark.slow
def test_runs_trained_at_once_equal_runs_trained_alone_and_every_policy_has_its_seeds(tmp_path, capsys):
    work = tmp_path / "study"
    code = precision_study.main(["--seeds", "2", "--jobs", "2", "--only", *POLICIES, "--telemetry-every", "0",
                                 "--workdir", str(work), *SMALL])
    assert code == 0
    rows = json.loads((work / "study.json").read_text())["rows"]
    assert list(rows) == POLICIES
    assert all(list(rows[p]["seeds"]) == ["1024", "7"] for p in POLICIES)
    # the second seed of the second policy again, alone: the same final figure, bit for bit
    args = argparse.Namespace(overrides=SMALL, telemetry_every=0, workdir=str(tmp_path / "alone"),
                              config="configs/demo.py", pictures=str(tmp_path))
    alone = precision_study.run_seed(POLICIES[1], 1, 7, args)
    assert alone["bits_per_byte"] == rows[POLICIES[1]]["seeds"]["7"]["bits_per_byte"]
    assert rows[POLICIES[0]]["seeds"]["7"]["bits_per_byte"] != rows[POLICIES[0]]["seeds"]["1024"]["bits_per_byte"]
    out = capsys.readouterr().out
    assert "--seeds 2 --jobs 2" in out and "2 at a time" in out
    table = [line for line in out.splitlines() if line.startswith(("| fp32 masters", "| bf16 masters |"))]
    assert len(table) == 2 and all("| 2 |" in line for line in table)
    assert "[" in table[1] and ("within seed noise" in table[1] or "differs" in table[1])
    assert os.path.exists(tmp_path / "study" / "pictures" / precision_study.CURVES)
