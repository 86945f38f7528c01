"""tools/compare_runs.py and its modules: seed statistics against independent references, bitwise checks
and exit codes on hand-made metrics.jsonl files, the picture, and two real train.py runs of one config (one
process, CPU: bitwise equal today)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from harness.failure import explain
from tessera.analysis.run_compare import (
    CompareError,
    Group,
    first_difference,
    moving_average,
    read_series,
    seed_in_path,
    short_labels,
    summarize,
)
from tessera.analysis.seed_stats import (
    paired_interval,
    sample_std,
    student_t_cdf,
    student_t_quantile,
    welch_interval,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.py")
HANG_GUARD_S = 240  # a train.py run still going after this is hung, not slow


def _tool():
    spec = importlib.util.spec_from_file_location("_compare_runs_tool", os.path.join(ROOT, "tools", "compare_runs.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TOOL = _tool()


def run_tool(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        code = TOOL.main(list(argv))
    except SystemExit as e:  # argparse
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def write_run(folder, losses: dict[int, float], valid: dict[int, float] | None = None, tail: str = "",
              seed: int | None = None):
    """A metrics.jsonl as train.py writes it: an event (with the run's seed, if given), train records (and valid
    ones), in a run folder."""
    os.makedirs(folder, exist_ok=True)
    event = {"kind": "event", "time": 0.0, "message": "start", "start_step": 0}
    lines = [json.dumps(event if seed is None else {**event, "seed": seed})]
    lines += [json.dumps({"kind": "train", "step": s, "time": 1.0, "loss": v, "lr": 1e-3}) for s, v in losses.items()]
    lines += [json.dumps({"kind": "valid", "step": s, "time": 2.0, "loss": v, "bits_per_byte": v / math.log(2)})
              for s, v in (valid or {}).items()]
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        f.write("\n".join(lines) + "\n" + tail)
    return str(folder)


def curve(seed: int, offset: float = 0.0, steps: int = 40) -> dict[int, float]:
    """A falling loss curve with seed noise: 5 at the start, about 3 + offset at the end."""
    rng = np.random.default_rng(seed)
    return {s: 3.0 + offset + 2.0 * math.exp(-s / 10) + float(rng.normal(0, 0.02)) for s in range(1, steps + 1)}


# ------------------------------------------------------------------------------------ t quantile and Welch
@pytest.mark.parametrize(("p", "df", "table"), [  # printed t tables, 3 decimals
    (0.975, 1, 12.706), (0.975, 2, 4.303), (0.975, 4, 2.776), (0.975, 10, 2.228), (0.975, 30, 2.042),
    (0.95, 5, 2.015), (0.995, 3, 5.841), (0.9995, 2, 31.599), (0.975, math.inf, 1.960)])
def test_t_quantile_matches_the_printed_tables(p, df, table):
    assert abs(student_t_quantile(p, df) - table) <= 5e-4  # half a unit of the table's last digit
    assert abs(student_t_quantile(1 - p, df) + table) <= 5e-4  # symmetric


@pytest.mark.parametrize("t", [-40.0, -3.1, -0.7, 0.0, 0.2, 1.5, 4.4, 250.0])
def test_t_cdf_matches_the_closed_forms_at_one_and_two_degrees_of_freedom(t):
    # df = 1 is Cauchy's distribution; df = 2 has a closed form too (both independent of the incomplete beta)
    assert abs(student_t_cdf(t, 1) - (0.5 + math.atan(t) / math.pi)) <= 1e-12
    assert abs(student_t_cdf(t, 2) - (0.5 + t / (2 * math.sqrt(2 + t * t)))) <= 1e-12


@pytest.mark.parametrize("df", [0.7, 1.684, 3.3, 12.5, 97.0, 4e6])
@pytest.mark.parametrize("p", [0.6, 0.9, 0.975, 0.999])
def test_t_quantile_inverts_the_cdf_at_fractional_degrees_of_freedom(p, df):
    q = student_t_quantile(p, df)
    assert abs(student_t_cdf(q, df) - p) <= 1e-10
    # more degrees of freedom, thinner tails: between the normal's quantile and a smaller df's
    assert student_t_quantile(p, math.inf) < q < student_t_quantile(p, df / 2)


def test_t_quantile_agrees_with_scipy_where_installed():
    stats = pytest.importorskip("scipy.stats")
    for df in (0.9, 1.0, 1.684, 2.5, 7.0, 33.3, 500.0):
        for p in (0.55, 0.8, 0.975, 0.995):
            assert student_t_quantile(p, df) == pytest.approx(stats.t.ppf(p, df), rel=1e-9)


def test_welch_interval_by_hand_equal_spreads():
    # a and b both have variance 1 over 3 values: se = sqrt(1/3 + 1/3), Welch's df = 2 (n - 1) = 4 exactly,
    # so the half width is t(0.975, 4) = 2.776 (table) times se
    w = welch_interval([1.0, 2.0, 3.0], [3.0, 4.0, 5.0])
    se = math.sqrt(2 / 3)
    assert w.difference == -2.0 and w.df == pytest.approx(4.0, rel=1e-12)
    assert w.standard_error == pytest.approx(se, rel=1e-12)
    assert abs((w.high - w.low) / 2 - 2.776 * se) <= 5e-4 * se
    assert w.contains_zero()  # [-4.27, +0.27]: two groups 2 apart with this spread are within seed noise


def test_welch_degrees_of_freedom_by_hand_unequal_spreads():
    # a: variance 1 over 3, b: variance 2 over 2 -> va = 1/3, vb = 1, df = (4/3)^2 / ((1/3)^2 / 2 + 1) = 32/19
    w = welch_interval([1.0, 2.0, 3.0], [4.0, 6.0])
    assert w.df == pytest.approx(32 / 19, rel=1e-12)
    half = student_t_quantile(0.975, 32 / 19) * math.sqrt(4 / 3)
    assert (w.low, w.high) == pytest.approx((-3 - half, -3 + half), rel=1e-12)
    assert sample_std([4.0, 6.0]) == pytest.approx(float(np.std([4.0, 6.0], ddof=1)), rel=1e-15)


def test_welch_without_spread_is_the_exact_difference_and_one_run_has_no_interval():
    w = welch_interval([2.0, 2.0], [1.5, 1.5, 1.5])
    assert (w.low, w.high, w.df) == (0.5, 0.5, math.inf) and not w.contains_zero()
    with pytest.raises(ValueError, match="at least 2 values"):
        welch_interval([1.0], [1.0, 2.0])


# ------------------------------------------------------------------------------------ the paired interval
A = [3.10, 3.25, 3.02, 3.18, 3.07]  # one setting's figure per seed
B = [3.06, 3.19, 3.00, 3.11, 3.05]  # another's, the same seeds in the same order: differences .04 .06 .02 .07 .02


def test_paired_interval_matches_scipy_on_fixed_numbers():
    stats = pytest.importorskip("scipy.stats")
    p = paired_interval(A, B)
    ref = stats.ttest_rel(A, B).confidence_interval(0.95)
    assert p.differences == pytest.approx((0.04, 0.06, 0.02, 0.07, 0.02), abs=1e-12)
    assert p.difference == pytest.approx(0.042, rel=1e-12) and p.df == 4
    assert (p.low, p.high) == pytest.approx((ref.low, ref.high), rel=1e-9)
    assert not p.contains_zero()  # every seed moved the same way, by about the same amount
    assert welch_interval(A, B).contains_zero()  # while the seeds' own spread (0.09) hides it from Welch
    ref90 = stats.ttest_rel(A, B).confidence_interval(0.90)
    assert (paired_interval(A, B, 0.90).low, paired_interval(A, B, 0.90).high) == pytest.approx(
        (ref90.low, ref90.high), rel=1e-9)


def test_paired_interval_by_hand_with_the_t_table():
    # differences 1, 2, 3: mean 2, sample std 1, se 1/sqrt(3); t(0.975, 2) = 4.303 (table), so 2 +- 2.484
    p = paired_interval([11.0, 12.0, 13.0], [10.0, 10.0, 10.0])
    se = 1 / math.sqrt(3)
    assert p.difference == 2.0 and p.df == 2.0 and p.standard_error == pytest.approx(se, rel=1e-12)
    assert abs(p.high - 2.0 - 4.303 * se) <= 5e-4 * se and abs(2.0 - p.low - 4.303 * se) <= 5e-4 * se
    assert p.contains_zero()  # [-0.48, +4.48]
    same = paired_interval([2.5, 3.5], [2.0, 3.0])  # no spread in the differences: the interval is the point
    assert (same.low, same.high, same.standard_error) == (0.5, 0.5, 0.0)
    with pytest.raises(ValueError, match="at least 2 pairs"):
        paired_interval([1.0], [2.0])
    with pytest.raises(ValueError, match="as many values"):
        paired_interval([1.0, 2.0], [2.0])


def _flat_runs(root, name: str, figures: dict[int, float], in_path: bool = False) -> str:
    """One run per seed whose loss is the figure at every step; the seed in the start event, or (``in_path``) in
    the folder name alone. The folders' order is not the seeds' order."""
    for i, (seed, figure) in enumerate(figures.items()):
        folder = root / name / (f"seed{seed}" if in_path else f"run{i}")
        write_run(folder, dict.fromkeys(range(1, 6), figure), seed=None if in_path else seed)
    return f"{name}={root / name}/*"


def test_compare_runs_prints_the_paired_interval_where_groups_share_seeds(tmp_path, capsys):
    base = _flat_runs(tmp_path, "fp32", dict(zip((1, 2, 3, 4, 5), B)))
    # the same seeds listed in another order: each run must meet the baseline run of its own seed
    mixed = _flat_runs(tmp_path, "fp8", {5: A[4], 3: A[2], 1: A[0], 4: A[3], 2: A[1]})
    code, out, err = run_tool(capsys, "--group", base, "--group", mixed)
    assert code == 0, err
    stats = pytest.importorskip("scipy.stats")
    ref = stats.ttest_rel(A, B).confidence_interval(0.95)
    welch = next(line for line in out.splitlines() if line.startswith("  fp8 "))
    assert "within seed noise (df" in welch  # Welch's, beside it
    paired = out[out.index("paired by seed:"):].splitlines()
    assert "the mean of the per-seed differences with the paired t 95% interval" in paired[0]
    assert "(seeds read from: metrics.jsonl)" in paired[0]
    row = paired[2].split()
    assert row[:3] == ["fp8", "5", "+0.042"] and " ".join(row[3:5]) == f"[{ref.low:+.4g}, {ref.high:+.4g}]"
    assert paired[2].endswith("differs (df 4)")
    assert paired[3] == ("    per seed, fp8 - fp32: 1: +0.04, 2: +0.06, 3: +0.02, 4: +0.07, 5: +0.02 "
                         "(signs + + + + +: 5 of 5 above 0)")


def test_groups_without_shared_seeds_say_why_there_is_no_paired_interval(tmp_path, capsys):
    base = _flat_runs(tmp_path, "fp32", {1: 3.0, 2: 3.1, 3: 3.2})
    other = _flat_runs(tmp_path, "other", {4: 3.0, 5: 3.1, 6: 3.2})
    one = _flat_runs(tmp_path, "one", {2: 3.0, 7: 3.1, 8: 3.2}, in_path=True)  # seeds from the folder names
    code, out, err = run_tool(capsys, "--group", base, "--group", other, "--group", one)
    assert code == 0, err
    lines = out[out.index("paired by seed:"):].splitlines()
    assert "(seeds read from: folder name, metrics.jsonl)" in lines[0]
    assert lines[2] == ("  other: paired interval not available: other and fp32 share no seed (seeds 4, 5, 6 "
                        "against 1, 2, 3); a paired interval needs 2")
    assert lines[3] == ("  one: paired interval not available: one and fp32 share one seed only (2) (seeds 2, 7, 8 "
                        "against 1, 2, 3); a paired interval needs 2")
    assert len(lines) == 4
    # runs whose seed nothing tells (two positional runs, no seed logged, none in the folder names)
    a, b = write_run(tmp_path / "a", curve(1)), write_run(tmp_path / "b", curve(2))
    code, out, _ = run_tool(capsys, a, b)
    assert code == 0 and out.splitlines()[-1] == (
        "  b: paired interval not available: the seeds of b's runs are not known (no seed in their metrics.jsonl "
        "records, no seed<N> in their folder names)")
    # two runs of one seed in a group: which pairs with which is not known
    twice = _flat_runs(tmp_path, "twice", {1: 3.0, 2: 3.1})
    write_run(tmp_path / "twice" / "again", dict.fromkeys(range(1, 6), 3.3), seed=1)
    code, out, _ = run_tool(capsys, "--group", base, "--group", twice)
    assert code == 0 and "twice: paired interval not available: seed 1 names 2 runs of twice" in out


def test_a_subset_of_shared_seeds_is_paired_and_the_rest_named(tmp_path):
    figures = {"fp32": {1: 3.0, 2: 3.1, 3: 3.2, 4: 3.3}, "bf16": {3: 3.25, 1: 3.01, 9: 3.5}}
    groups = []
    for name, by_seed in figures.items():
        _flat_runs(tmp_path, name, by_seed)
        groups.append(Group(name, tuple(read_series(str(tmp_path / name / f"run{i}")) for i in range(len(by_seed)))))
    (_, bf16) = summarize(groups, "fp32")
    assert bf16.seeds == (3, 1, 9)
    pairs = bf16.paired
    assert pairs is not None and pairs.interval is not None
    assert pairs.seeds == (1, 3) and pairs.unpaired == 3  # seeds 2 and 4 of fp32, 9 of bf16
    assert pairs.interval.differences == pytest.approx((0.01, 0.05), abs=1e-12)


def test_the_seed_is_read_from_the_records_else_from_a_seed_folder(tmp_path):
    assert seed_in_path("/r/bf16_seed7/tessera/metrics.jsonl") == 7
    assert seed_in_path("/study/nvfp4/seed3/run/metrics.jsonl") == 3
    assert seed_in_path("/r/Seed=12/metrics.jsonl") == 12 and seed_in_path("/r/x-seed-5/metrics.jsonl") == 5
    assert seed_in_path("/r/seeds3/metrics.jsonl") is None and seed_in_path("/r/myseed3/metrics.jsonl") is None
    logged = read_series(write_run(tmp_path / "bf16_seed7", curve(1), seed=11))
    assert (logged.seed, logged.seed_from) == (11, "metrics.jsonl")  # the run's own record wins over its folder
    named = read_series(write_run(tmp_path / "bf16_seed7b" / "seed8", curve(1)))
    assert (named.seed, named.seed_from) == (8, "folder name")
    resumed = write_run(tmp_path / "resumed", curve(1), seed=1)
    with open(os.path.join(resumed, "metrics.jsonl"), "a") as f:  # resumed under another seed
        f.write(json.dumps({"kind": "event", "time": 3.0, "message": "start", "seed": 2}) + "\n")
    s = read_series(resumed)
    assert s.seed is None and any("several seeds (1, 2): not paired" in n for n in s.notes)


# ------------------------------------------------------------------------------------ reading what train.py writes
def test_reading_a_run_takes_the_last_record_of_a_repeated_step_and_skips_a_torn_last_line(tmp_path):
    folder = write_run(tmp_path / "logs" / "job", {1: 5.0, 2: 4.0, 3: 3.5}, tail='{"kind": "train", "st')
    with open(os.path.join(folder, "metrics.jsonl"), "a") as f:  # a resume from step 1 repeats steps 2 and 3
        f.write("\n" + json.dumps({"kind": "train", "step": 2, "loss": 4.25}) + "\n"
                + json.dumps({"kind": "train", "step": 3, "loss": 3.75}) + "\n")
    s = read_series(str(tmp_path / "logs"))  # the log folder holding one run is enough
    assert s.steps == (1, 2, 3) and s.values == (5.0, 4.25, 3.75)
    assert len(s.notes) == 1 and "metrics.jsonl:5: a line cut short" in s.notes[0]
    with pytest.raises(CompareError, match=r"no kind='valid' records \(its kinds: event, train\)"):
        read_series(folder, "valid")
    with pytest.raises(CompareError, match=r"no number 'bits_per_byte' in this train record \(its numbers: loss"):
        read_series(folder, "train", "bits_per_byte")


@pytest.mark.parametrize("cut", ['{"kind": "train", "st', '{"kind": "train", "step": 3', '{"kind": ', '{"kind"',
                                 '{"kind": "train", "step": 3, "loss": Na', '{"kind": "train", "step": 3, "ok": fal'])
def test_a_line_cut_short_anywhere_is_skipped_with_a_note(tmp_path, cut):
    folder = write_run(tmp_path / "run", {1: 5.0, 2: 4.0}, tail=cut + "\n" + json.dumps({"kind": "train", "step": 3,
                                                                                      "loss": 3.0}) + "\n")
    s = read_series(folder)
    assert s.steps == (1, 2, 3) and len(s.notes) == 1 and "metrics.jsonl:4: a line cut short" in s.notes[0]


@pytest.mark.parametrize(("content", "message"), [
    (None, "no such file or folder"),
    ("", "empty"),
    ('{"kind": "train", "step": 1, "loss": 2.0}\nnot json at all\n{"kind": "train", "step": 2, "loss": 1.0}\n',
     r"metrics.jsonl:2: not a JSON line"),
    ('[1, 2]\n', "metrics.jsonl:1: not a JSON object"),
    ('{"kind": "train", "step": 1, "loss": 2.0} x\n', r"metrics.jsonl:1: not a JSON line \(Extra data\)"),
    ('{"kind": "train", "step": 1, "loss": nan}\n', r"metrics.jsonl:1: not a JSON line"),
    ('{"kind": "train", "loss": 2.0}\n', "metrics.jsonl:1: a train record without an integer 'step'"),
])
def test_a_bad_run_is_one_error_line_naming_the_file_and_exit_2(tmp_path, capsys, content, message):
    good = write_run(tmp_path / "good", curve(1))
    bad = tmp_path / "bad"
    if content is not None:
        bad.mkdir()
        (bad / "metrics.jsonl").write_text(content)
    code, out, err = run_tool(capsys, good, str(bad))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: ") and str(bad) in err
    assert re.search(message, err), err


def test_labels_are_the_shortest_folder_suffixes_that_tell_runs_apart():
    paths = ["/r/bf16_seed1/tessera/metrics.jsonl", "/r/bf16_seed2/tessera/metrics.jsonl", "/q/fp32/metrics.jsonl",
             "/p/x/tessera/metrics.jsonl", "/q/x/tessera/metrics.jsonl"]
    assert short_labels(paths) == ["bf16_seed1/tessera", "bf16_seed2/tessera", "fp32", "p/x/tessera", "q/x/tessera"]


# ------------------------------------------------------------------------------------ bitwise and tolerance checks
def test_bitwise_equal_runs_pass_and_one_ulp_at_step_7_fails_naming_step_and_run(tmp_path, capsys):
    losses = curve(3, steps=12)
    a = write_run(tmp_path / "a", losses)
    b = write_run(tmp_path / "b", losses)
    nudged = dict(losses)
    nudged[7] = math.nextafter(losses[7], math.inf)  # one unit in the last place
    nudged[9] += 1e-3
    c = write_run(tmp_path / "c", nudged)

    code, out, err = run_tool(capsys, a, b, "--assert-equal")
    assert code == 0 and err == "" and "b: identical at all 12 steps" in out

    code, out, err = run_tool(capsys, a, b, c, "--assert-equal")
    assert code == 1 and err.count("\n") == 1
    assert err.startswith("differs (bitwise): c ") and "from a at step 7:" in err
    assert "c: first differs at step 7" in out and "largest gap 0.001 at step 9" in out

    # within a tolerance above one ulp but below 1e-3, the first difference beyond it is step 9
    code, _, err = run_tool(capsys, a, c, "--atol", "1e-12")
    assert code == 1 and "at step 9:" in err
    assert run_tool(capsys, a, c, "--atol", "2e-3")[0] == 0
    assert run_tool(capsys, a, c, "--rtol", "1e-3")[0] == 0  # 1e-3 <= 1e-3 * |loss| (about 3)
    assert run_tool(capsys, a, c, "--rtol", "1e-4")[0] == 1
    assert run_tool(capsys, a, c, "--assert-equal", "--atol", "1")[0] == 2  # argparse: bitwise takes no tolerance


def test_a_missing_step_is_a_difference_and_nan_equals_only_nan(tmp_path, capsys):
    losses = curve(4, steps=6)
    a = write_run(tmp_path / "a", losses)
    b = write_run(tmp_path / "b", {s: v for s, v in losses.items() if s != 4})
    code, _, err = run_tool(capsys, a, b, "--assert-equal")
    assert code == 1 and "at step 4 is missing from it" in err
    with_nan = {**losses, 6: math.nan}
    ref = read_series(write_run(tmp_path / "n1", with_nan))
    assert first_difference(ref, read_series(write_run(tmp_path / "n2", with_nan))) is None
    d = first_difference(ref, read_series(a), atol=1.0)
    assert d is not None and d.step == 6


# ------------------------------------------------------------------------------------ groups of seeds
def test_group_statistics_match_numpy_and_welch_by_hand(tmp_path, capsys):
    for seed in (1, 2, 3):
        write_run(tmp_path / f"fp32_seed{seed}", curve(seed))
        write_run(tmp_path / f"bf16_seed{seed}", curve(10 + seed, offset=0.5))  # far beyond the noise (0.02)
        write_run(tmp_path / f"kahan_seed{seed}", curve(20 + seed, offset=0.001))  # well within it
    groups = {name: f"{name}=" + os.path.join(tmp_path, f"{name}_seed*") for name in ("fp32", "bf16", "kahan")}
    code, out, err = run_tool(capsys, "--group", groups["fp32"], "--group", groups["bf16"], "--group",
                              groups["kahan"], "--window", "10")
    assert code == 0, err

    seeds = {"fp32": (1, 2, 3), "bf16": (11, 12, 13), "kahan": (21, 22, 23)}
    offsets = {"fp32": 0.0, "bf16": 0.5, "kahan": 0.001}

    def last10(name: str) -> np.ndarray:  # each run's mean over steps 31..40, computed from the curves themselves
        return np.array([np.mean([v for s, v in curve(seed, offsets[name]).items() if s > 30]) for seed in seeds[name]])

    runs = {name: tuple(read_series(str(tmp_path / f"{name}_seed{i}")) for i in (1, 2, 3))
            for name in ("fp32", "bf16", "kahan")}
    summaries = {s.name: s for s in summarize([Group(n, r) for n, r in runs.items()], "fp32", window=10)}
    for name in ("fp32", "bf16", "kahan"):
        ref = last10(name)
        assert summaries[name].values == pytest.approx(tuple(ref), rel=1e-14)
        assert summaries[name].mean == pytest.approx(ref.mean(), rel=1e-14)
        assert summaries[name].std == pytest.approx(ref.std(ddof=1), rel=1e-12)
    assert summaries["fp32"].steps == (31, 40)
    for name, says in (("bf16", "differs"), ("kahan", "within seed noise")):
        a, b = last10(name), last10("fp32")
        va, vb = a.var(ddof=1) / 3, b.var(ddof=1) / 3
        df = (va + vb) ** 2 / (va**2 / 2 + vb**2 / 2)
        half = student_t_quantile(0.975, df) * math.sqrt(va + vb)
        w = summaries[name].vs_baseline
        assert w is not None
        assert (w.low, w.high, w.df) == pytest.approx((a.mean() - b.mean() - half, a.mean() - b.mean() + half, df),
                                                      rel=1e-9)
        row = next(line for line in out.splitlines() if line.strip().startswith(name + " "))
        assert row.split()[1] == "3" and says in row and f"[{w.low:+.4g}, {w.high:+.4g}]" in row
    assert "mean of the last 10 logged values (steps 31..40)" in out


def test_runs_of_different_lengths_are_an_error_and_the_baseline_must_exist(tmp_path, capsys):
    a = write_run(tmp_path / "a", curve(1, steps=40))
    b = write_run(tmp_path / "b", curve(2, steps=30))
    code, _, err = run_tool(capsys, a, b)
    assert code == 2 and "its last 1 logged steps (30..30" in err and "b/metrics.jsonl" in err
    code, out, err = run_tool(capsys, a, b, "--assert-equal")  # under a check, steps one run lacks are a finding
    assert code == 1 and "no group figures:" in out and "from a at step 1:" in err
    code, out, err = run_tool(capsys, a, write_run(tmp_path / "a_short", dict(list(curve(1).items())[:30])),
                              "--assert-equal")
    assert code == 1 and err.endswith("from a at step 31 is missing from it (reference " + repr(curve(1)[31]) + ")\n")
    assert run_tool(capsys, a, b, "--window", "0")[0] == 2  # argparse: a window holds one value at least
    c = write_run(tmp_path / "c", curve(3, steps=40))
    code, _, err = run_tool(capsys, a, c, "--baseline", "nope")
    assert code == 2 and "--baseline nope: no such group (the groups: a, c)" in err
    code, _, err = run_tool(capsys, a, os.path.join(a, "metrics.jsonl"))
    assert code == 2 and err == f"error: {os.path.join(a, 'metrics.jsonl')}: the same run named twice\n"
    assert run_tool(capsys, a)[0] == 2  # one run compares with nothing
    code, _, err = run_tool(capsys, "--group", "x=" + str(tmp_path / "none_*"), a)
    assert code == 2 and "none_*: the pattern matches no file or folder" in err


def test_valid_kind_compares_the_held_out_losses(tmp_path, capsys):
    a = write_run(tmp_path / "a", curve(1), valid={20: 3.5, 40: 3.1})
    b = write_run(tmp_path / "b", curve(1), valid={20: 3.5, 40: 3.2})
    code, out, err = run_tool(capsys, a, b, "--kind", "valid", "--assert-equal")
    assert code == 1 and "at step 40: 3.2 vs 3.1" in err
    assert "b: first differs at step 40" in out
    assert run_tool(capsys, a, b, "--assert-equal")[0] == 0  # their train losses are the same


def test_moving_average_is_a_trailing_mean():
    values = [1.0, 3.0, 2.0, 6.0, 4.0]
    expected = [np.mean(values[max(0, i - 2):i + 1]) for i in range(5)]
    assert moving_average(values, 3) == pytest.approx(expected, rel=1e-15)


# ------------------------------------------------------------------------------------ the picture
def test_the_plot_is_a_png_with_curves_in_every_panel(tmp_path, capsys):
    image = pytest.importorskip("matplotlib.image")
    for seed in (1, 2):
        write_run(tmp_path / f"fp32_seed{seed}", curve(seed))
        write_run(tmp_path / f"bf16_seed{seed}", curve(10 + seed, offset=0.1))
    out_png = str(tmp_path / "compare.png")
    code, out, err = run_tool(capsys, "--group", f"fp32={tmp_path}/fp32_seed*", "--group",
                              f"bf16={tmp_path}/bf16_seed1,{tmp_path}/bf16_seed2", "--plot", out_png)
    assert code == 0, err
    with open(out_png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    pixels = image.imread(out_png)[..., :3]
    height, width = pixels.shape[:2]
    assert width >= 1000 and height >= 700
    # every panel holds colour (curves and bands; axes and text are grey or black): not an empty frame
    colourful = pixels.max(axis=-1) - pixels.min(axis=-1) > 0.25
    for rows, cols in ((slice(0, height // 2), slice(0, width // 2)), (slice(0, height // 2), slice(width // 2, None)),
                       (slice(height // 2, None), slice(None))):
        assert colourful[rows, cols].mean() > 0.002


def test_a_missing_matplotlib_is_one_error_line_naming_the_extra(tmp_path, capsys, monkeypatch):
    a = write_run(tmp_path / "a", curve(1))
    b = write_run(tmp_path / "b", curve(2))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    code, _, err = run_tool(capsys, a, b, "--plot", str(tmp_path / "x.png"))
    assert code == 2 and err.startswith("error: --plot needs matplotlib") and '".[plots]"' in err
    assert not os.path.exists(tmp_path / "x.png")


# ------------------------------------------------------------------------------------ real train.py runs
def _train(tmp_path, name: str, seed: int) -> str:
    log_folder = str(tmp_path / name)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--config", TINY, "data.total_steps=6",
                           f"seed={seed}", "metrics.progress_bar=False", "metrics.tensorboard=False",
                           f"log_folder='{log_folder}'"], cwd=str(tmp_path), env={**env, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, explain(proc)
    return log_folder


def test_two_train_py_runs_of_one_config_are_bitwise_equal_and_one_ulp_in_a_copy_is_found(tmp_path, capsys):
    first, again = _train(tmp_path, "first", 1024), _train(tmp_path, "again", 1024)
    logged = read_series(first)
    assert (logged.seed, logged.seed_from) == (1024, "metrics.jsonl")  # train.py logs the seed compare_runs pairs by
    code, out, err = run_tool(capsys, first, again, "--assert-equal")
    assert code == 0, err
    assert "again/tessera: identical at all 6 steps" in out
    assert run_tool(capsys, first, again, "--kind", "valid", "--assert-equal")[0] == 0
    # the second run's file with the loss of step 4 moved by one unit in the last place, everything else as written
    records = [json.loads(line) for line in open(os.path.join(again, "tessera", "metrics.jsonl"))]
    moved = next(r for r in records if r["kind"] == "train" and r["step"] == 4)
    moved["loss"] = math.nextafter(moved["loss"], 0.0)
    os.makedirs(tmp_path / "moved")
    with open(tmp_path / "moved" / "metrics.jsonl", "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))
    code, out, err = run_tool(capsys, first, again, str(tmp_path / "moved"), "--assert-equal")
    assert code == 1 and err.startswith("differs (bitwise): moved ") and f"at step 4: {moved['loss']!r} vs" in err
