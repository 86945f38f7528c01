"""What the precision telemetry costs: the demo trained with ``metrics.precision_every`` 0 and N, paired rounds.

    python -m benchmarks precision-telemetry [--steps 320] [--rounds 3] [--every 100] [--against PATH]
                                             [--config configs/demo.py] [--out BENCHMARKS.md] [key.sub=value ...]

Each variant is a ``train.py`` run under torchrun (the config's TP size in processes), from scratch, for
``--steps`` steps, without checkpoints, the final sample or more than one validation batch. A round runs
every variant once, in an order that rotates from round to round, and a round's ratios compare runs
made minutes apart on the same machine. The figure is the loop's wall time per step over the steps
after the first 10% (the ``time`` of consecutive ``train`` records of metrics.jsonl: the step, the
telemetry's reduction and its metrics.jsonl / TensorBoard writes, the data). On a shared machine whole
runs minutes apart differ by more than the telemetry costs, so the headline figure is local: what each
measured step adds to the loop against the steps around it in the same run, spread over N steps
(``local_extra``). ``--against PATH`` adds a third variant: another
checkout's train.py (e.g. ``git archive <commit> | tar -x -C /tmp/base``) with no telemetry keys, which
shows whether "off" costs anything at all.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.train_runs import ROOT, log, report, run_once
from tessera.cli_args import positive_int


def per_step_wall(run: dict[str, Any], first: int, last: int) -> float:
    """Mean loop wall time per step from step ``first`` to ``last``."""
    return (run["time"][last] - run["time"][first]) / (last - first)


def local_extra(run: dict[str, Any], k: int, window: int = 10) -> float:
    """What measured step ``k`` added to the loop, against its neighbours: the wall time from record k-1 to
    record k+1 (step k, its precision record, step k+1) less two median iterations of the steps around it."""
    gaps = [run["time"][j] - run["time"][j - 1] for j in range(k - window, k + window + 2)
            if j not in (k, k + 1) and j - 1 in run["time"] and j in run["time"]]
    return run["time"][k + 1] - run["time"][k - 1] - 2 * statistics.median(gaps)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    variants: dict[str, tuple[str, list[str]]] = {
        "off": (ROOT, [*args.overrides, "metrics.precision_every=0"]),
        "on": (ROOT, [*args.overrides, f"metrics.precision_every={args.every}"]),
    }
    if args.against:
        variants["base"] = (os.path.abspath(args.against), list(args.overrides))
    names = list(variants)
    first = max(1, args.steps // 10)
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            checkout, overrides = variants[name]
            log(f"[precision-telemetry] round {r + 1}/{args.rounds}: {name}")
            runs[name].append(run_once(checkout, overrides, args.config, args.steps,
                                       os.path.join(args.workdir, f"{name}_{r}")))
    wall = {n: [per_step_wall(run, first, args.steps) for run in runs[n]] for n in names}
    median = {n: [statistics.median(t for s, t in run["step_time"].items() if s > first) for run in runs[n]]
              for n in names}
    measured = runs["on"][0]["measured"]
    inner = [k for k in measured if first < k < args.steps]  # with a step on each side
    extra = [local_extra(run, k) for run in runs["on"] for k in inner]
    return {"config": args.config, "overrides": list(args.overrides), "steps": args.steps, "every": args.every,
            "rounds": args.rounds, "first": first, "against": os.path.abspath(args.against) if args.against else None,
            "names": names, "wall": wall, "median_step": median, "measured": measured, "local_extra_s": extra,
            "median_iteration_s": statistics.median(wall["off"])}


def _pct(ratio: float) -> str:
    return f"{100 * (ratio - 1):+.1f}%"


def markdown(res: dict[str, Any], command: str, machine: str) -> list[str]:
    names, wall, median = res["names"], res["wall"], res["median_step"]
    what = ("The demo (`configs/demo.py`: TP=2 on 2 processes, bf16)" if res["config"] == "configs/demo.py"
            and not res["overrides"] else f"`{res['config']}` with `{' '.join(res['overrides']) or '-'}`")
    label = {"off": "off", "on": f"on (N={res['every']})", "base": "base"}
    lines = [f"Reproduce: `{command}` ({machine}; {time.strftime('%Y-%m-%d')}). {what} trained {res['steps']} steps "
             f"per run from scratch with `metrics.precision_every=0` (off) and `={res['every']}` (on: steps "
             f"{res['measured']} measured)" + (f", and base: the checkout at `{res['against']}` (no telemetry code)"
                                               if res["against"] else "")
             + f"; {res['rounds']} rounds, each running every variant once, the order rotating per round. "
             f"Per run: the median `step_time` and the loop's mean wall time per step (the `time` of consecutive "
             f"metrics.jsonl records: steps, the telemetry's reduction and records, data), steps {res['first']} to "
             f"{res['steps']}.", "",
             "| round | " + " | ".join(f"{label[n]}: median step (ms)" for n in names) + " | "
             + " | ".join(f"{label[n]}: s/step" for n in names) + " | on / off (s/step) |",
             "|---:|" + "---:|" * (2 * len(names) + 1)]
    for i in range(res["rounds"]):
        lines.append(f"| {i + 1} | " + " | ".join(f"{1e3 * median[n][i]:.1f}" for n in names) + " | "
                     + " | ".join(f"{wall[n][i]:.4f}" for n in names) + f" | {wall['on'][i] / wall['off'][i]:.3f} |")
    extra, every = res["local_extra_s"], res["every"]
    if not extra:
        raise ValueError(f"no measured step has steps on both sides: raise --steps above {res['every']} + 1")
    cost = statistics.median(extra) / (every * res["median_iteration_s"])
    lines += ["", f"**Cost at N={every}: {100 * cost:.2f}% per step.** A measured step, against the steps around it in "
              f"the same run (the wall time from the record before it to the one after it, less two median iterations "
              f"of its 20 neighbours), adds {1e3 * statistics.median(extra):.0f} ms (median of {len(extra)}; "
              f"{', '.join(f'{1e3 * x:.0f}' for x in extra)} ms) to iterations of "
              f"{1e3 * res['median_iteration_s']:.0f} ms; spread over N={every} steps that is the figure above.",
              "Whole runs against each other, paired by round: on / off "
              + ", ".join(_pct(a / b) for a, b in zip(wall["on"], wall["off"])) + " (mean wall per step), "
              + ", ".join(_pct(a / b) for a, b in zip(median["on"], median["off"])) + " (median step)"
              + ("; off / base " + ", ".join(_pct(a / b) for a, b in zip(wall["off"], wall["base"])) + " and "
                 + ", ".join(_pct(a / b) for a, b in zip(median["off"], median["base"])) if res["against"] else "")
              + f". Runs minutes apart on a machine shared with other jobs (load average "
              f"{os.getloadavg()[0]:.1f} at the end) differ by more than the telemetry costs, so these ratios are "
              "noise around the local figure, not a second measurement of it.",
              "Off, the telemetry does not exist: the builder creates no telemetry object, so no hook is installed "
              "and no tensor allocated (`tests/test_precision_telemetry.py`); a step pays one `is not None` test."]
    return lines


def main(argv: Sequence[str] | None = None, prog: str = "python -m benchmarks precision-telemetry") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/demo.py")
    ap.add_argument("--steps", type=positive_int, default=320, help="steps per run (default 320)")
    ap.add_argument("--rounds", type=positive_int, default=3, help="paired rounds (default 3)")
    ap.add_argument("--every", type=positive_int, default=100, help="metrics.precision_every of 'on' (default 100)")
    ap.add_argument("--against", default=None, help="another checkout to run as a third variant (no telemetry keys)")
    ap.add_argument("--out", default="BENCHMARKS.md", help="file whose section 14 is replaced ('' = none)")
    ap.add_argument("--workdir", default="runs/precision_overhead")
    ap.add_argument("overrides", nargs="*", help="key.sub=value applied to every run")
    args = ap.parse_args(argv)
    if args.every + 1 >= args.steps:
        ap.error(f"--every {args.every} needs --steps above {args.every + 1}: a measured step with a step on each side")
    report(measure(args), args.workdir, argv, prog, args.out, "precision-telemetry",
           "## 14. Precision telemetry: what measuring costs", markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
