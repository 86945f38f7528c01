"""Training runs side by side: per-step losses, the first step where runs part, seed statistics, a picture.

    python tools/compare_runs.py RUN_A RUN_B [--assert-equal | --rtol R --atol A]
    python tools/compare_runs.py --group fp32='runs/fp32_seed*' --group bf16='runs/bf16_seed*' \\
        --baseline fp32 --window 50 --plot compare.png

A run is its log folder (``<log_folder>/<job_name>``, or the ``log_folder`` above it when it holds one
run) or its ``metrics.jsonl``: the tool reads nothing else. Each positional run is a group of its own;
``--group NAME=PATHS`` (comma-separated paths or globs) makes one group per setting, one run per seed.
It prints the runs, a per-step table (each run's value, or each group's mean and spread over seeds, and
the largest gap between any two runs), the first step where each run leaves the reference run (the
baseline's first) bitwise and its largest gap, and per group the last value (``--window N``: the mean of
the last N logged values) over its seeds, with its difference from the baseline, Welch's 95% interval and
a verdict: "within seed noise" when the interval holds 0, else "differs". Where a group and the baseline ran
the same seeds (a run's seed: its metrics.jsonl's, else a ``seed<N>`` folder in its path), each run is also
set against the baseline's run of its seed: the per-seed differences and their signs, their mean with the
paired t 95% interval (pairs - 1 degrees of freedom) and its verdict; else one line says why there is none.

Exit status: 0; 1 when ``--assert-equal`` (bitwise: same steps, same bits) or ``--rtol/--atol`` find a
difference, with one line naming the run and the first step; 2 for bad input (a missing, empty or corrupt
file, runs of different lengths), one ``error:`` line naming it. ``--plot`` needs matplotlib (the
``plots`` extra). See docs/compare-runs.md.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from tessera.analysis.run_compare import (
    CompareError,
    Difference,
    Group,
    GroupSummary,
    SeedPairs,
    Series,
    WindowMismatch,
    first_difference,
    largest_difference,
    moving_average,
    parse_group,
    read_series,
    shared_steps,
    short_labels,
    summarize,
    verdict,
)
from tessera.analysis.seed_stats import mean, sample_std, welch_interval
from tessera.cli_args import nonnegative_float, nonnegative_int, positive_int


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="*", help="run folders or metrics.jsonl files, one group each")
    ap.add_argument("--group", action="append", default=[], metavar="NAME=PATHS",
                    help="a group of runs, one per seed: comma-separated paths or globs (quote them)")
    ap.add_argument("--baseline", help="the group the others are set against (default: the first)")
    ap.add_argument("--kind", default="train", help="the records compared: train (default), valid, or eval "
                                                    "(--metric TASK/METRIC: the eval section's lm-eval scores)")
    ap.add_argument("--metric", default="loss", help="the number compared (default loss; e.g. bits_per_byte)")
    ap.add_argument("--window", type=positive_int, default=1,
                    help="a run's figure is the mean of its last N logged values (default 1: the last)")
    ap.add_argument("--rows", type=nonnegative_int, default=20, help="rows of the per-step table (0: every step)")
    ap.add_argument("--assert-equal", action="store_true", help="exit 1 unless every run equals the reference "
                    "bitwise at the same steps")
    ap.add_argument("--rtol", type=nonnegative_float, help="exit 1 where |run - ref| > atol + rtol * |ref|")
    ap.add_argument("--atol", type=nonnegative_float, help="see --rtol (each defaults to 0 when the other is set)")
    ap.add_argument("--plot", metavar="OUT.png", help="write the curves, smoothed curves and differences as a PNG")
    ap.add_argument("--smooth", type=nonnegative_int, default=0,
                    help="the plot's smoothing: trailing mean over N logged values (0: about 1/20 of the run)")
    return ap


def load_groups(args: argparse.Namespace) -> list[Group]:
    """The groups named on the command line, each run labelled by the shortest path suffix that tells it apart."""
    named = [(None, [path]) for path in args.runs] + [parse_group(g) for g in args.group]
    if not named:
        raise CompareError("no runs: name run folders, or groups with --group NAME=PATHS")
    series = [[read_series(p, args.kind, args.metric) for p in paths] for _, paths in named]
    paths = [s.path for runs in series for s in runs]
    real = [os.path.realpath(p) for p in paths]
    for path, where in zip(paths, real):
        if real.count(where) > 1:
            raise CompareError(f"{path}: the same run named twice")
    labels = iter(short_labels(paths))
    groups = []
    for (name, _), runs in zip(named, series):
        labelled = tuple(replace(s, label=next(labels)) for s in runs)
        groups.append(Group(name or labelled[0].label, labelled))
    names = [g.name for g in groups]
    for name in names:
        if names.count(name) > 1:
            raise CompareError(f"group {name} is named twice")
    if sum(len(g.runs) for g in groups) < 2:
        raise CompareError(f"one run ({groups[0].runs[0].path}): a comparison needs two at least")
    return groups


def _shown_steps(steps: Sequence[int], rows: int, also: Sequence[int]) -> list[int]:
    """``rows`` steps spread evenly over the run, its first and last included, plus the steps in ``also``."""
    if rows == 0 or rows >= len(steps):
        return list(steps)
    picked = {steps[round(i * (len(steps) - 1) / max(rows - 1, 1))] for i in range(rows)}
    return sorted(picked | {s for s in also if s in set(steps)})


def _cell(values: Sequence[float]) -> str:
    return f"{values[0]:.6f}" if len(values) == 1 else f"{mean(values):.6f} ±{sample_std(values):.2g}"


def step_table(groups: Sequence[Group], rows: int, also: Sequence[int]) -> list[str]:
    """Per step: each group's value (mean ± std over seeds) and the largest gap between any two runs."""
    runs = [r for g in groups for r in g.runs]
    steps = shared_steps(runs)
    if not steps:
        return ["per step: no step is in every run"]
    shown = _shown_steps(steps, rows, also)
    tables = [r.by_step() for r in runs]
    names = [g.name if len(g.runs) == 1 else f"{g.name} (mean ±std, {len(g.runs)})" for g in groups]
    width = max(18, *(len(n) for n in names))
    lines = [f"per step ({len(shown)} of the {len(steps)} steps every run has"
             + ("" if rows == 0 else "; --rows 0 shows all") + "):",
             f"  {'step':>7}  " + "  ".join(f"{n:>{width}}" for n in names) + f"  {'largest gap':>11}"]
    per_group = [[r.by_step() for r in g.runs] for g in groups]
    for step in shown:
        cells = [_cell([t[step] for t in group]) for group in per_group]
        at = [t[step] for t in tables]
        lines.append(f"  {step:>7}  " + "  ".join(f"{c:>{width}}" for c in cells) + f"  {max(at) - min(at):>11.3g}")
    return lines


def _describe(d: Difference) -> str:
    if d.value is None:
        return f"step {d.step} is missing from it (reference {d.reference!r})"
    if d.reference is None:
        return f"step {d.step} is missing from the reference (it has {d.value!r})"
    return f"step {d.step}: {d.value!r} vs {d.reference!r}"


def difference_lines(groups: Sequence[Group], reference: Series) -> list[str]:
    """Each run against the reference run: the first step where the bits part, and the widest gap."""
    lines = [f"against {reference.label} (bitwise):"]
    for g in groups:
        for r in g.runs:
            if r is reference:
                continue
            d = first_difference(reference, r)
            gap = largest_difference(reference, r)
            widest = f"; largest gap {gap[1]:.3g} at step {gap[0]}" if gap and gap[1] else ""
            lines.append(f"  {r.label}: " + (f"identical at all {len(r.steps)} steps" if d is None
                                             else f"first differs at {_describe(d)}{widest}"))
    return lines


def summary_lines(summaries: Sequence[GroupSummary], baseline: str, window: int, what: str) -> list[str]:
    first, last = summaries[0].steps
    span = f"the last logged value (step {last})" if window == 1 else \
        f"the mean of the last {window} logged values (steps {first}..{last})"
    lines = [f"{what}: {span}, over seeds; difference from {baseline} with Welch's 95% interval:",
             f"  {'group':<20} {'runs':>4} {'mean':>10} {'std':>9} {'difference':>11} {'95% interval':>24}  verdict"]
    for s in summaries:
        if s.name == baseline:
            diff, interval, says = "-", "-", "baseline"
        else:
            w = s.vs_baseline
            diff = f"{s.mean - summaries[[x.name for x in summaries].index(baseline)].mean:+.4g}"
            interval = f"[{w.low:+.4g}, {w.high:+.4g}]" if w else "-"
            says = verdict(w) + (f" (df {w.df:.1f})" if w else "")
        std = f"{s.std:.3g}" if len(s.values) > 1 else "-"
        lines.append(f"  {s.name:<20} {len(s.values):>4} {s.mean:>10.6f} {std:>9} {diff:>11} {interval:>24}  {says}")
    return lines


def _per_seed(name: str, baseline: str, pairs: SeedPairs) -> str:
    """Each paired seed's difference and the signs: a setting that moves every seed the same way shows here."""
    assert pairs.interval is not None
    diffs = pairs.interval.differences
    signs = " ".join("+" if d > 0 else "-" if d < 0 else "0" for d in diffs)
    above = sum(d > 0 for d in diffs)
    left = f"; {pairs.unpaired} run(s) without a partner left out" if pairs.unpaired else ""
    return (f"    per seed, {name} - {baseline}: " + ", ".join(f"{s}: {d:+.4g}" for s, d in zip(pairs.seeds, diffs))
            + f" (signs {signs}: {above} of {len(diffs)} above 0{left})")


def _seed_sources(groups: Sequence[Group]) -> str:
    sources = sorted({r.seed_from for g in groups for r in g.runs if r.seed_from})
    return f" (seeds read from: {', '.join(sources)})" if sources else ""


def paired_lines(summaries: Sequence[GroupSummary], groups: Sequence[Group], baseline: str) -> list[str]:
    """Each group against the baseline run by run of the same seed: the paired interval, or why there is none."""
    others = [s for s in summaries if s.paired is not None]
    if not others:
        return []
    lines = [f"paired by seed: each run against the {baseline} run of its seed (the same initial weights and data "
             f"order); the mean of the per-seed differences with the paired t 95% interval, pairs - 1 degrees of "
             f"freedom{_seed_sources(groups)}:",
             f"  {'group':<20} {'pairs':>5} {'mean diff':>11} {'95% interval':>24}  verdict"]
    for s in others:
        pairs = s.paired
        assert pairs is not None
        p = pairs.interval
        if p is None:
            lines.append(f"  {s.name}: paired interval {pairs.why_not}")
            continue
        lines.append(f"  {s.name:<20} {len(pairs.seeds):>5} {p.difference:>+11.4g} "
                     f"{f'[{p.low:+.4g}, {p.high:+.4g}]':>24}  {verdict(p)} (df {p.df:.0f})")
        lines.append(_per_seed(s.name, baseline, pairs))
    return lines


def check(groups: Sequence[Group], reference: Series, rtol: float, atol: float) -> str | None:
    """The one line naming the run and step of the first difference beyond the tolerance, or None."""
    found = [(d, r) for g in groups for r in g.runs if r is not reference
             for d in [first_difference(reference, r, rtol, atol)] if d is not None]
    if not found:
        return None
    d, run = min(found, key=lambda x: x[0].step)
    rule = "bitwise" if rtol == atol == 0 else f"rtol {rtol:g}, atol {atol:g}"
    return f"differs ({rule}): {run.label} ({run.path}) from {reference.label} at {_describe(d)}"


# ---------------------------------------------------------------------------------------------- the picture
def _curves(runs: Sequence[Series], smooth: int) -> tuple[list[int], list[list[float]]]:
    """The steps every run of a group has, and each run's (smoothed) values there."""
    steps = shared_steps(runs)
    per_run = []
    for r in runs:
        at = r.by_step()
        per_run.append(moving_average([at[s] for s in steps], smooth))
    return steps, per_run


def _draw_group(ax: Any, g: Group, smooth: int, color: Any, marker: str | None) -> None:
    steps, per_run = _curves(g.runs, smooth)
    means = [mean(col) for col in zip(*per_run)]
    if len(per_run) > 1:
        ax.fill_between(steps, [min(c) for c in zip(*per_run)], [max(c) for c in zip(*per_run)], color=color,
                        alpha=0.2, linewidth=0)
    label = g.name if len(g.runs) == 1 else f"{g.name}: mean of {len(g.runs)} seeds, band min-max"
    ax.plot(steps, means, color=color, label=label, linewidth=1.3, marker=marker, markersize=3)


def _draw_difference(ax: Any, g: Group, base: Group, smooth: int, color: Any, marker: str | None) -> list[float]:
    """Draws the group's smoothed difference from the baseline and its band; returns the values drawn after the
    first twentieth of the run (the start, where spreads are widest, need not set the panel's scale)."""
    steps = shared_steps([*g.runs, *base.runs])
    _, mine = _curves([_restrict(r, steps) for r in g.runs], smooth)
    _, theirs = _curves([_restrict(r, steps) for r in base.runs], smooth)
    columns = list(zip(zip(*mine), zip(*theirs)))
    line = [mean(a) - mean(b) for a, b in columns]
    ax.plot(steps, line, color=color, marker=marker, markersize=3, label=f"{g.name} - {base.name}")
    later = len(steps) // 20
    drawn = line[later:]
    if len(g.runs) > 1 and len(base.runs) > 1:
        intervals = [welch_interval(a, b) for a, b in columns]
        ax.fill_between(steps, [w.low for w in intervals], [w.high for w in intervals], color=color, alpha=0.2,
                        linewidth=0, label=f"{g.name}: 95% Welch interval")
        drawn += [w.low for w in intervals[later:]] + [w.high for w in intervals[later:]]
    return drawn


def _restrict(run: Series, steps: Sequence[int]) -> Series:
    at = run.by_step()
    return replace(run, steps=tuple(steps), values=tuple(at[s] for s in steps))


def plot(out: str, groups: Sequence[Group], baseline: str, smooth: int, what: str) -> None:
    """Three panels: the raw curves, the smoothed curves (mean line and seed band per group), and each group's
    smoothed difference from the baseline with its per-step 95% Welch interval."""
    try:
        import matplotlib
    except ImportError:
        raise CompareError("--plot needs matplotlib, which is not installed: pip install -e \".[plots]\" "
                           "(the plots extra), or pip install matplotlib") from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    length = len(shared_steps([r for g in groups for r in g.runs]))
    smooth = smooth or max(1, length // 20)
    marker = "o" if length <= 30 else None
    tab10 = plt.get_cmap("tab10")
    colors = [tab10(i) for i in range(10)]
    base = next(g for g in groups if g.name == baseline)
    crowded = len(groups) > 4  # the legends would cover the curves: they go right of the panels, once per panel row
    fig, axes = plt.subplot_mosaic([["raw", "smoothed"], ["diff", "diff"]], figsize=(18 if crowded else 13, 9),
                                   layout="constrained")
    raw, smoothed, diff = axes["raw"], axes["smoothed"], axes["diff"]
    runs = sum(len(g.runs) for g in groups)
    fig.suptitle(f"{what}: {runs} runs in {len(groups)} group{'s' * (len(groups) > 1)}, baseline {baseline}")
    scale = [0.0]
    for i, g in enumerate(groups):
        _draw_group(raw, g, 1, colors[i % 10], marker)
        _draw_group(smoothed, g, smooth, colors[i % 10], marker)
        if g is not base:
            scale += _draw_difference(diff, g, base, smooth, colors[i % 10], marker)
    finite = [v for v in scale if math.isfinite(v)]
    pad = 0.08 * (max(finite) - min(finite)) or 1e-12
    diff.set_ylim(min(finite) - pad, max(finite) + pad)
    diff.axhline(0.0, color="black", linewidth=0.8, label=f"{baseline} (baseline)", zorder=1)
    raw.set_title(f"{what}: raw")
    smoothed.set_title(f"{what}: smoothed (trailing mean over {smooth} logged values)")
    diff.set_title(f"difference from {baseline} (smoothed as above); within seed noise where the band covers 0")
    for ax, ylabel in ((raw, what), (smoothed, what), (diff, f"{what} - {baseline}")):
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if not crowded:
            ax.legend(fontsize=8)
        elif ax is not raw:  # the raw panel shares the smoothed one's colours
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.assert_equal and (args.rtol is not None or args.atol is not None):
        _parser().error("--assert-equal is bitwise: leave out --rtol/--atol, or drop --assert-equal")
    what = f"{args.kind} {args.metric}"
    checking = args.assert_equal or args.rtol is not None or args.atol is not None
    try:
        groups = load_groups(args)
        baseline = args.baseline or groups[0].name
        try:
            summaries = summarize(groups, baseline, args.window)
            summary = summary_lines(summaries, baseline, args.window, what) + paired_lines(summaries, groups, baseline)
        except WindowMismatch as e:
            if not checking:
                raise
            summary = [f"no group figures: {e}"]  # under a check, steps one run lacks are its finding (exit 1)
        reference = next(g for g in groups if g.name == baseline).runs[0]
        for note in (n for g in groups for r in g.runs for n in r.notes):
            print(f"note: {note}", file=sys.stderr)
        firsts = [d.step for g in groups for r in g.runs if r is not reference
                  for d in [first_difference(reference, r)] if d is not None]
        lines = [f"{what}; baseline {baseline}; reference run {reference.label}", "runs:"]
        lines += [f"  {r.label:<28} {g.name:<16} {len(r.steps):>6} steps ({r.steps[0]}..{r.steps[-1]})  {r.path}"
                  for g in groups for r in g.runs]
        lines += step_table(groups, args.rows, firsts[:1])
        lines += difference_lines(groups, reference)
        lines += summary
        print("\n".join(lines))
        if args.plot:
            plot(args.plot, groups, baseline, args.smooth, what)
            print(f"wrote {args.plot}")
    except CompareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if checking:
        problem = check(groups, reference, args.rtol or 0.0, args.atol or 0.0)
        if problem:
            print(problem, file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
