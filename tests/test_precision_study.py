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
    main, paired = out.split("**Paired by seed**")
    table = [line for line in main.splitlines() if line.startswith(("| fp32 masters", "| bf16 masters |"))]
    assert len(table) == 2 and all("| 2 |" in line for line in table)
    (pair,) = [line for line in paired.splitlines() if line.startswith("| bf16 masters |")]
    assert pair.startswith("| bf16 masters | 1024, 7 | ") and ("within seed noise" in pair or "differs" in pair)
    assert "[" in table[1] and ("within seed noise" in table[1] or "differs" in table[1])
    assert os.path.exists(tmp_path / "study" / "pictures" / precision_study.CURVES)
    # the same command again, one run cut short (no FINISHED file): only that run trains, the others are kept
    os.remove(work / "bf16_masters" / "seed1024" / precision_study.FINISHED)
    again = precision_study.main(["--seeds", "2", "--only", *POLICIES, "--telemetry-every", "0",
                                  "--workdir", str(work), *SMALL])
    err = capsys.readouterr().err
    assert again == 0
    assert err.count("kept the finished run") == 3 and err.count(": training") == 1
    assert "bf16 masters, seed 1024: training" in err
    rerun = json.loads((work / "study.json").read_text())["rows"]
    assert rerun[POLICIES[1]]["seeds"]["1024"]["bits_per_byte"] == rows[POLICIES[1]]["seeds"]["1024"]["bits_per_byte"]
    # a run trained with other overrides is not taken for this one
    assert precision_study.finished_run(str(work / "bf16_masters" / "seed7"), "configs/demo.py", ["seed=7"]) is None


TINY_RUNS = ["model.dtype='torch.bfloat16'", "data.total_steps=3", "lr_scheduler.total_steps=3", "generate.max_new_tokens=0",
             "metrics.progress_bar=False", "metrics.log_every=1"]


def _valid(run: str) -> dict:
    with open(os.path.join(run, "metrics.jsonl"), encoding="utf-8") as f:
        return [r for r in map(json.loads, f) if r["kind"] == "valid"][-1]


@pytest.mark.slow
def test_a_config_whose_validation_has_no_bytes_is_studied_in_bits_per_token(tmp_path, capsys):
    """configs/tiny.py validates on synthetic tokens, which stand for no text: no bits per byte. The study takes
    the figure every run's validation has (bits per token, read back here from each run's metrics.jsonl) instead
    of stopping after the first run with a KeyError; each run says when it starts and where its output goes."""
    work = tmp_path / "study"
    policies = ["fp32 masters (default)", "fp8 tensorwise"]  # the issue's, on tiny's model in bf16
    code = precision_study.main(["--config", "configs/tiny.py", "--seeds", "1", "--only", *policies,
                                 "--telemetry-every", "0", "--workdir", str(work), *TINY_RUNS])
    out, err = capsys.readouterr()
    assert code == 0 and "Traceback" not in err, err
    study = json.loads((work / "study.json").read_text())["rows"]
    for policy in policies:
        (seed,) = study[policy]["seeds"].values()
        assert seed["bits_per_token"] == _valid(seed["run"])["bits_per_token"] and "bits_per_byte" not in seed
        started = err.index(f"[study] {policy}, seed 1024: training (output in ")
        assert started < err.index(f"[study] {policy}, seed 1024: {seed['bits_per_token']:.4f} bits/token")
    table = [line for line in out.splitlines() if line.startswith("| ")]
    assert "final bits/token (mean ± std)" in table[0] and len(table) == 1 + len(policies)
    assert "bits per token (the config's held-out data records no bytes)" in out


def test_a_policy_the_config_cannot_take_is_refused_before_the_first_run(tmp_path, capsys):
    """configs/tiny.py's model is fp32, which fp8 refuses: one error line naming the policy, before the first
    policy (which the config takes) has trained."""
    work = tmp_path / "study"
    code = precision_study.main(["--config", "configs/tiny.py", "--seeds", "2", "--only", "fp32 masters (default)",
                                 "fp8 tensorwise", "--workdir", str(work), "data.total_steps=20"])
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    override = precision_study.STUDY["fp8 tensorwise"][0]  # the key that turns fp8 on
    assert code == 2 and line.startswith(f"error: policy 'fp8 tensorwise' on configs/tiny.py: override {override}: ")
    assert line.endswith("needs model.dtype bfloat16, not float32"), err
    assert "Traceback" not in err and os.listdir(work) == []  # no run was started


def test_a_config_without_held_out_data_is_refused_before_the_first_run(tmp_path, capsys):
    work = tmp_path / "study"
    code = precision_study.main(["--config", "configs/tiny.py", "--seeds", "1", "--only", POLICIES[0],
                                 "--workdir", str(work), "data.type='tokens'", f"data.train_folder='{tmp_path}'"])
    err = capsys.readouterr().err
    assert code == 2 and [line for line in err.splitlines() if line.startswith("error:")] == [
        "error: configs/tiny.py: data.type='tokens' without data.valid_folder has no validation, and the study "
        "compares the runs' final validation: give data.valid_folder=FOLDER"], err
    assert "Traceback" not in err and os.listdir(work) == []  # no run was started


def test_the_section_points_to_the_page_that_defines_each_measure_it_draws():
    """The heat maps' sentence names where the measures are defined: docs/telemetry.md, which defines each one
    the study draws (README's "Precision telemetry" is a one-line table row)."""
    telemetry = {"every": 50, "measure": "update_lost", "picture": "docs/precision/x.png", "steps": [50, 100],
                 "mean": [0.1, 0.2], "low": [50, 0.1], "high": [100, 0.2], "worst": [["layers.0", 0.3]]}
    seed = {"skipped": 0, "tgs": 100.0, "steps": 100, "bits_per_byte": 2.0}
    res = {"config": "configs/demo.py", "machine": {"cpu": "x", "cores": 2, "flags": {}, "torch": "2"},
           "date": "d", "curves": "c.png", "stats": [{"name": "bf16 masters", "n": 1, "mean": 2.0, "std": 0.0,
                                                      "welch": None, "verdict": "baseline"}],
           "rows": {"bf16 masters": {"name": "bf16 masters", "overrides": [], "seeds": {"1024": seed},
                                     "bytes_per_param": 12.0, "telemetry": telemetry}}}
    text = "\n".join(precision_study.markdown(res))
    assert "docs/telemetry.md says what each measure means" in text and "README" not in text
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "telemetry.md"),
              encoding="utf-8") as f:
        page = f.read()
    assert all(f"`{measure}`" in page for measure in set(precision_study.PICTURES.values()))


def _study_run(folder, bits_per_byte: float) -> str:
    """A run folder as the study leaves it: its metrics.jsonl with one final validation (no seed logged: the study
    knows each run's seed from its own records)."""
    os.makedirs(folder)
    with open(os.path.join(folder, "metrics.jsonl"), "w", encoding="utf-8") as f:
        f.write(json.dumps({"kind": "valid", "step": 10, "loss": 1.0, "bits_per_byte": bits_per_byte}) + "\n")
    return str(folder)


def test_the_section_names_the_seeds_paired_and_the_paired_interval_against_the_baseline(tmp_path):
    """Each policy's run meets the default's run of its seed (the study's own record of the seed, not the run
    order); the section lists the seeds paired, each difference and the paired interval (scipy's), and says why a
    policy that shares too few seeds has none."""
    stats_ref = pytest.importorskip("scipy.stats")
    base = {"1024": 2.10, "7": 2.25, "3": 2.02}
    bf16 = {"3": 2.05, "1024": 2.16, "7": 2.27}  # the seeds in another order: +0.06, +0.02, +0.03 by seed
    kahan = {"1024": 2.11, "11": 2.30}  # one seed shared
    seed = {"skipped": 0, "tgs": 100.0, "steps": 10}
    rows = {name: {"name": name, "overrides": [], "bytes_per_param": 12.0,
                   "seeds": {s: {**seed, "bits_per_byte": v, "run": _study_run(tmp_path / f"{i}_{s}", v)}
                             for s, v in figures.items()}}
            for i, (name, figures) in enumerate((("fp32 masters (default)", base), ("bf16 masters", bf16),
                                                 ("bf16 masters + Kahan", kahan)))}
    stats = precision_study.statistics_of(rows)
    p = stats[1]["paired"]
    ref = stats_ref.ttest_rel([2.16, 2.27, 2.05], [2.10, 2.25, 2.02]).confidence_interval(0.95)
    assert p["seeds"] == [1024, 7, 3] and p["differences"] == pytest.approx([0.06, 0.02, 0.03], abs=1e-12)
    assert (p["low"], p["high"], p["df"]) == pytest.approx((ref.low, ref.high, 2.0), rel=1e-9)
    assert stats[0]["paired"] is None and stats[2]["paired"]["seeds"] == [1024]
    res = {"config": "configs/demo.py", "machine": {"cpu": "x", "cores": 2, "flags": {}, "torch": "2"},
           "date": "d", "curves": "c.png", "stats": stats, "rows": rows}
    text = "\n".join(precision_study.markdown(res))
    assert "**Paired by seed**: each policy's run against the fp32 masters (default) run of the same seed" in text
    assert (f"| bf16 masters | 1024, 7, 3 | +0.0600, +0.0200, +0.0300 | +0.0367 [{ref.low:+.4f}, {ref.high:+.4f}] "
            f"| {p['verdict']} |") in text
    assert ("| bf16 masters + Kahan | 1024 | - | - | not available: bf16 masters + Kahan and fp32 masters (default) "
            "share one seed only (1024)") in text
