"""A run's precision telemetry as a picture and a short list: heat map of row x step for one measure, worst rows.

    python tools/precision_telemetry.py RUN_DIR --measure update_lost [--out heatmap.png] [--top 8] [--no-plot]
    python tools/precision_telemetry.py RUN_DIR --list

RUN_DIR is the run's log folder (``<log_folder>/<job_name>``, holding ``metrics.jsonl``), the ``log_folder``
above it when that holds one run, or the file (found as ``tools/compare_runs.py`` finds a run). The
records are the ``kind="precision"`` lines a run writes with ``metrics.precision_every=N``; the measures
and what they mean are ``tessera.train.precision_telemetry.MEASURES`` (``--list`` prints them with the
rows and steps the run has). The heat map needs matplotlib (``pip install -e ".[plots]"``); the text
summary does not (``--no-plot``). Ratios of very different sizes (amax, RMS, scales) are drawn on a log
scale, fractions on a linear one; a blank cell is a step that had nothing to say for that row.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

from tessera.analysis.run_compare import CompareError, metrics_path
from tessera.cli_args import positive_int
from tessera.files import os_error_text
from tessera.train.precision_telemetry import MEASURES, Measure


class ToolError(Exception):
    """A problem with the input, reported as one ``error:`` line."""


def load(run_dir: str) -> tuple[str, list[dict[str, Any]]]:
    """(path of metrics.jsonl, its precision records in step order)."""
    try:
        path = metrics_path(run_dir)
    except CompareError as e:
        raise ToolError(str(e)) from None
    records = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                if number > 1 and not line.endswith("\n"):
                    continue  # the torn last line of a run killed mid-write
                raise ToolError(f"{path}:{number}: not a JSON line ({e.msg})") from None
            if record.get("kind") == "precision":
                records.append(record)
    if not records:
        raise ToolError(f"{path} has no precision records: train with metrics.precision_every=N (N > 0)")
    by_step = {r["step"]: r for r in records}  # a resumed run may repeat a step: its last record counts
    return path, [by_step[s] for s in sorted(by_step)]


def all_rows(records: list[dict[str, Any]]) -> list[str]:
    """Every row of the run in model order ("elements" lists every row; a measure may skip some, e.g. the head)."""
    rows: list[str] = []
    for r in records:
        for names in (r.get("elements", {}), *r["measures"].values()):
            rows += [row for row in names if row not in rows]
    return rows


def table(records: list[dict[str, Any]], measure: str) -> tuple[list[str], list[int], list[list[float]]]:
    """(rows, steps, values[row][step]) of one measure; NaN where a step has no value for a row."""
    present = sorted({m for r in records for m in r["measures"]})
    if measure not in MEASURES:
        raise ToolError(f"--measure {measure}: unknown; the measures are {list(MEASURES)}")
    if measure not in present:
        raise ToolError(f"--measure {measure}: this run has no values of it; it has {present}")
    rows = all_rows(records)
    steps = [r["step"] for r in records]
    values = [[float(r["measures"].get(measure, {}).get(row, math.nan)) for r in records] for row in rows]
    keep = [i for i, v in enumerate(values) if any(not math.isnan(x) for x in v)]
    return [rows[i] for i in keep], steps, [values[i] for i in keep]


def worst(rows: list[str], values: list[list[float]], m: Measure, top: int) -> list[tuple[str, float, float, float]]:
    """The ``top`` worst rows by their mean over the steps: (row, mean, last, extreme), worst first."""
    out = []
    for row, v in zip(rows, values):
        seen = [x for x in v if not math.isnan(x)]
        if not seen:
            continue
        finite = [x for x in seen if math.isfinite(x)]
        mean = sum(finite) / len(finite) if len(finite) == len(seen) else (math.inf if m.higher_is_worse else 0.0)
        extreme = max(seen) if m.higher_is_worse else min(seen)
        out.append((row, mean, seen[-1], extreme))
    out.sort(key=lambda t: t[1], reverse=m.higher_is_worse)
    return out[:top]


def summary(path: str, rows: list[str], steps: list[int], values: list[list[float]], m: Measure, top: int) -> str:
    lines = [f"{m.name}: {m.doc}", f"{path}: {len(rows)} rows x {len(steps)} measured steps ({steps[0]}..{steps[-1]})",
             f"worst {min(top, len(rows))} rows ({'highest' if m.higher_is_worse else 'lowest'} mean first):",
             f"  {'row':<36} {'mean':>11} {'last':>11} {'max' if m.higher_is_worse else 'min':>11}"]
    for row, mean, last, extreme in worst(rows, values, m, top):
        lines.append(f"  {row:<36} {mean:>11.4g} {last:>11.4g} {extreme:>11.4g}")
    return "\n".join(lines)


def render(out: str, rows: list[str], steps: list[int], values: list[list[float]], m: Measure, title: str) -> None:
    """The heat map (rows top to bottom in model order, steps left to right) as a PNG."""
    try:
        import matplotlib
    except ImportError:
        raise ToolError("the heat map needs matplotlib, which is not installed: pip install -e \".[plots]\" "
                        "(or pip install matplotlib); --no-plot prints the summary alone") from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import LogNorm, Normalize

    data = np.ma.masked_invalid(np.array(values, dtype=np.float64))
    positive = data[data > 0]
    label = m.name
    # no value at that step (and, on a log scale, zero): grey, never a colour of the scale
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="lightgrey")
    if m.log_scale:
        data = np.ma.masked_where(data <= 0, data)
        lo = float(positive.min()) if positive.size else 1e-12
        hi = max(float(positive.max()) if positive.size else 1.0, lo * 10)
        norm: Normalize = LogNorm(vmin=lo, vmax=hi)
        label += " (log scale)"
        grey = "grey: 0 or no value"
    else:
        norm = Normalize(vmin=0.0, vmax=max(float(data.max()) if data.count() else 1.0, 1e-12))
        grey = "grey: no value"
    height = min(2.0 + 0.22 * len(rows), 40.0)
    fig, ax = plt.subplots(figsize=(min(6.0 + 0.12 * len(steps), 16.0), height))
    image = ax.imshow(data, aspect="auto", interpolation="nearest", cmap=cmap, norm=norm)
    ax.set_yticks(range(len(rows)), rows, fontsize=7)
    ticks = list(range(0, len(steps), max(1, len(steps) // 12)))
    ax.set_xticks(ticks, [str(steps[i]) for i in ticks], fontsize=7)
    ax.set_xlabel(f"step ({grey})")
    ax.set_title(title, fontsize=9)
    bar = fig.colorbar(image, ax=ax, label=label)
    if m.log_scale:  # a log bar's ends fall between its decades: say where it starts and stops
        from matplotlib.ticker import FuncFormatter

        bar.set_ticks(sorted({lo, hi, *(float(v) for v in bar.get_ticks() if lo <= v <= hi)}))
        bar.ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.3g}"))
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", metavar="RUN_DIR",
                    help="the run's log folder (<log_folder>/<job_name>, or a log_folder holding one run) or its "
                         "metrics.jsonl")
    ap.add_argument("--measure", default=None, help=f"one of {', '.join(MEASURES)}")
    ap.add_argument("--out", default=None, help="the PNG to write (default: RUN_DIR/precision_<measure>.png)")
    ap.add_argument("--top", type=positive_int, default=8, help="worst rows to print (default 8)")
    ap.add_argument("--title", default=None, help="the picture's title (default: the measure and the run)")
    ap.add_argument("--no-plot", action="store_true", help="print the summary only (no matplotlib needed)")
    ap.add_argument("--list", action="store_true", help="list the run's measures, rows and steps, then exit")
    args = ap.parse_args(argv)
    try:
        path, records = load(args.run_dir)
        if args.list:
            present = sorted({m for r in records for m in r["measures"]})
            rows = all_rows(records)
            print(f"{path}: {len(records)} precision records, steps {records[0]['step']}..{records[-1]['step']}, "
                  f"{len(rows)} rows by {records[-1].get('group_by', '?')}: {', '.join(rows)}")
            for name in present:
                n = len({row for r in records for row in r["measures"].get(name, {})})
                doc = MEASURES[name].doc if name in MEASURES else "(not a known measure)"
                print(f"  {name:<22} {n:>3} rows  {doc}")
            return 0
        if args.measure is None:
            raise ToolError(f"--measure is required (one of {list(MEASURES)}; --list shows this run's)")
        m = MEASURES.get(args.measure)
        rows, steps, values = table(records, args.measure)
        assert m is not None  # table() refused unknown names
        print(summary(path, rows, steps, values, m, args.top))
        if not args.no_plot:
            out = args.out or os.path.join(os.path.dirname(path), f"precision_{m.name}.png")
            run = os.path.basename(os.path.dirname(os.path.abspath(path)))
            render(out, rows, steps, values, m, args.title or f"{m.name} per {records[-1].get('group_by', 'row')} "
                                                             f"and step ({run})")
            print(f"wrote {out}")
    except ToolError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {os_error_text(e)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
