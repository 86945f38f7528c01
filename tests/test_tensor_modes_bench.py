"""``python -m benchmarks tensor-modes``: whole train.py runs per tensor mode and checkout, paired by round."""

from __future__ import annotations

import json
import os
import statistics

import pytest

from benchmarks.tensor_modes import main, markdown

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_end_to_end_on_the_tiny_config(tmp_path):
    out, work = tmp_path / "B.md", tmp_path / "runs"
    assert main(["--against", ROOT, "--config", "configs/tiny.py", "--modes", "msp", "--steps", "6", "--rounds", "1",
                 "--out", str(out), "--workdir", str(work), "data.type='synthetic'", "parallel.tensor.size=2",
                 "data.seq_len=32"]) == 0
    res = json.loads((work / "result.json").read_text())
    assert sorted(res["median_step"]) == ["base msp", "ours msp"]
    assert all(len(v) == 1 and v[0] > 0 for v in res["median_step"].values())
    for tree in ("ours", "base"):
        steps = [json.loads(line) for line in (work / f"{tree}_msp_0" / "run" / "metrics.jsonl").read_text().split("\n")
                 if '"kind": "train"' in line]
        assert [r["step"] for r in steps] == list(range(1, 7))
    text = out.read_text()
    assert "## 15. Tensor modes" in text and "\n| msp | " in text


def test_each_variant_runs_its_checkout_in_its_mode_in_rotating_order(monkeypatch, tmp_path):
    import benchmarks.tensor_modes as tm
    from benchmarks import harness

    calls = []

    def fake_run(checkout, config, overrides, run_dir):
        calls.append((checkout, overrides[-2], os.path.basename(run_dir)))
        assert overrides[-1] == "data.total_steps=10" and set(harness.LOOP_ONLY) <= set(overrides)
        return [{"kind": "train", "step": s, "step_time": 0.1} for s in range(1, 11)]

    monkeypatch.setattr(harness, "train_run", fake_run)
    args = tm.argparse.Namespace(against=str(tmp_path), modes=["mtp", "msp"], steps=10, rounds=2, config="c.py",
                                 overrides=["a.b=1"], workdir=str(tmp_path / "w"))
    res = tm.measure(args)
    ours, base = harness.ROOT, str(tmp_path)
    assert calls == [
        (ours, "parallel.tensor.mode='mtp'", "ours_mtp_0"), (base, "parallel.tensor.mode='mtp'", "base_mtp_0"),
        (ours, "parallel.tensor.mode='msp'", "ours_msp_0"), (base, "parallel.tensor.mode='msp'", "base_msp_0"),
        (base, "parallel.tensor.mode='mtp'", "base_mtp_1"), (ours, "parallel.tensor.mode='msp'", "ours_msp_1"),
        (base, "parallel.tensor.mode='msp'", "base_msp_1"), (ours, "parallel.tensor.mode='mtp'", "ours_mtp_1"),
    ]
    assert res["median_step"] == {k: [0.1, 0.1] for k in ("ours mtp", "base mtp", "ours msp", "base msp")}


def test_ratios_are_paired_by_round():
    machine = {"cpu": "cpu", "cores": 2, "flags": {}, "torch": "2", "load": 1.0}
    res = {"command": "cmd", "date": "today", "commit": "abc", "machine": machine, "config": "configs/demo.py", "overrides": [], "steps": 300, "rounds": 3, "first": 30, "against": "/b",
           "modes": ["mtp", "msp"],
           "median_step": {"ours mtp": [0.10, 0.11, 0.09], "base mtp": [0.10, 0.10, 0.10],
                           "ours msp": [0.09, 0.10, 0.09], "base msp": [0.14, 0.13, 0.15]}}
    text = "\n".join(markdown(res))
    ours, base = res["median_step"]["ours msp"], res["median_step"]["base msp"]
    ratios = sorted(a / b for a, b in zip(ours, base))
    assert f"| msp | 90.0 / 100.0 / 90.0 | 140.0 / 130.0 / 150.0 | **{statistics.median(ratios):.2f}x** " \
           f"[{ratios[0]:.2f}-{ratios[-1]:.2f}] |" in text
    assert "msp / mtp, paired by round: ours **0.91x** [0.90-1.00], base **1.40x** [1.30-1.50]." in text


def test_unknown_mode_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--against", ROOT, "--modes", "mtp,fsp"])
    assert "'mtp,fsp': comma-separated, of mtp,msp" in capsys.readouterr().err
