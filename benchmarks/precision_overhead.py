"""What the precision telemetry costs: the demo trained with ``metrics.precision_every`` 0 and N, paired rounds.

    python -m benchmarks precision-telemetry [--steps 320] [--rounds 3] [--every 100] [--against PATH]
                                             [--config configs/demo.py] [--out BENCHMARKS.md] [key.sub=value ...]

Each variant is a ``train.py`` run under torchrun from scratch (``harness.train_run`` with
``harness.LOOP_ONLY``) for ``--steps`` steps; a round runs every variant once, in an order that rotates
from round to round. Per run: the loop's mean wall time per step after the first 10% (the ``time`` of
consecutive ``train`` records of metrics.jsonl: the step, the telemetry's reduction and its records, the
data) and the median ``step_time``. Whole runs minutes apart on a shared machine differ by more than
the telemetry costs, so the headline figure is local: what each measured step adds to the loop against
the steps around it in the same run, spread over N steps. ``--against PATH`` adds a third variant:
another checkout's train.py with no telemetry keys, which shows whether "off" costs anything at all.
"""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Sequence
from typing import Any

from benchmarks import harness
from tessera.cli_args import positive_int

TITLE = "## 14. Precision telemetry: what measuring costs"


def local_extra(time: dict[int, float], k: int, window: int = 10) -> float:
    """What measured step ``k`` added to the loop, against its neighbours: the wall time from record k-1 to
    record k+1 (step k, its precision record, step k+1) less two median iterations of the steps around it."""
    gaps = [time[j] - time[j - 1] for j in range(k - window, k + window + 2)
            if j not in (k, k + 1) and j - 1 in time and j in time]
    return time[k + 1] - time[k - 1] - 2 * statistics.median(gaps)


def measure(args: Any) -> dict[str, Any]:
    variants = {"off": (harness.ROOT, ["metrics.precision_every=0"]),
                "on": (harness.ROOT, [f"metrics.precision_every={args.every}"])}
    if args.against:
        variants["base"] = (os.path.abspath(args.against), [])
    first, done = max(1, args.steps // 10), {n: 0 for n in variants}

    def run(name: str) -> dict[str, Any]:
        checkout, extra = variants[name]
        records = harness.train_run(checkout, args.config, [*harness.LOOP_ONLY, *args.overrides, *extra,
                                                            f"data.total_steps={args.steps}"],
                                    os.path.join(args.workdir, f"{name}_{done[name]}"))
        done[name] += 1
        train = {r["step"]: r for r in records if r["kind"] == "train"}
        time = {s: r["time"] for s, r in train.items()}
        return {"wall": (time[args.steps] - time[first]) / (args.steps - first), "time": time,
                "median": statistics.median(r["step_time"] for s, r in train.items() if s > first),
                "measured": [r["step"] for r in records if r["kind"] == "precision"]}

    timed = harness.interleave([harness.Variant(n, lambda n=n: run(n)) for n in variants], args.rounds, warmup=0)
    runs = {n: s.values for n, s in timed.items()}
    measured = runs["on"][0]["measured"]
    extra = [local_extra(r["time"], k) for r in runs["on"] for k in measured if first < k < args.steps]
    wall = {n: [r["wall"] for r in v] for n, v in runs.items()}
    return {"config": args.config, "overrides": list(args.overrides), "steps": args.steps, "every": args.every,
            "rounds": args.rounds, "first": first, "against": os.path.abspath(args.against) if args.against else None,
            "names": list(variants), "wall": wall, "measured": measured, "local_extra_s": extra,
            "median_step": {n: [r["median"] for r in v] for n, v in runs.items()},
            "median_iteration_s": statistics.median(wall["off"])}


def _pct(a: Sequence[float], b: Sequence[float]) -> str:
    return ", ".join(f"{100 * (x / y - 1):+.1f}%" for x, y in zip(a, b))


def markdown(res: dict[str, Any]) -> list[str]:
    names, wall, median, every = res["names"], res["wall"], res["median_step"], res["every"]
    extra = res["local_extra_s"]
    what = ("The demo (`configs/demo.py`: TP=2 on 2 processes, bf16)" if res["config"] == "configs/demo.py"
            and not res["overrides"] else f"`{res['config']}` with `{' '.join(res['overrides']) or '-'}`")
    label = {"off": "off", "on": f"on (N={every})", "base": "base"}
    if not extra:
        raise ValueError(f"no measured step has steps on both sides: raise --steps above {every} + 1")
    cost = statistics.median(extra) / (every * res["median_iteration_s"])
    lines = [f"Reproduce: {harness.provenance(res)}. {what} trained {res['steps']} steps per run from scratch with "
             f"`metrics.precision_every=0` (off) and `={every}` (on: steps {res['measured']} measured)"
             + (f", and base: the checkout at `{res['against']}` (no telemetry code)" if res["against"] else "")
             + f"; {res['rounds']} rounds, each running every variant once, the order rotating per round. Per run: "
             "the median `step_time` and the loop's mean wall time per step (the `time` of consecutive metrics.jsonl "
             f"records: steps, the telemetry's reduction and records, data), steps {res['first']} to {res['steps']}.",
             "", "| round | " + " | ".join(f"{label[n]}: median step (ms)" for n in names) + " | "
             + " | ".join(f"{label[n]}: s/step" for n in names) + " | on / off (s/step) |",
             "|---:|" + "---:|" * (2 * len(names) + 1)]
    for i in range(res["rounds"]):
        lines.append(f"| {i + 1} | " + " | ".join(f"{1e3 * median[n][i]:.1f}" for n in names) + " | "
                     + " | ".join(f"{wall[n][i]:.4f}" for n in names) + f" | {wall['on'][i] / wall['off'][i]:.3f} |")
    return lines + [
        "", f"**Cost at N={every}: {100 * cost:.2f}% per step.** A measured step, against the steps around it in the "
        "same run (the wall time from the record before it to the one after it, less two median iterations of its 20 "
        f"neighbours), adds {1e3 * statistics.median(extra):.0f} ms (median of {len(extra)}; "
        f"{', '.join(f'{1e3 * x:.0f}' for x in extra)} ms) to iterations of {1e3 * res['median_iteration_s']:.0f} ms; "
        f"spread over N={every} steps that is the figure above.",
        f"Whole runs against each other, paired by round: on / off {_pct(wall['on'], wall['off'])} (mean wall per "
        f"step), {_pct(median['on'], median['off'])} (median step)"
        + (f"; off / base {_pct(wall['off'], wall['base'])} and {_pct(median['off'], median['base'])}"
           if res["against"] else "")
        + f". Runs minutes apart on a machine shared with other jobs (load average {res['load_end']} at the end) "
        "differ by more than the telemetry costs, so these ratios are noise around the local figure, not a second "
        "measurement of it.",
        "Off, the telemetry does not exist: the builder creates no telemetry object, so no hook is installed and no "
        "tensor allocated (`tests/test_precision_telemetry.py`); a step pays one `is not None` test."]


def main(argv: Sequence[str] | None = None, prog: str = "python -m benchmarks precision-telemetry") -> int:
    ap = harness.parser(prog, __doc__)
    ap.add_argument("--config", default="configs/demo.py")
    ap.add_argument("--steps", type=positive_int, default=320, help="steps per run (default 320)")
    ap.add_argument("--rounds", type=positive_int, default=3, help="paired rounds (default 3)")
    ap.add_argument("--every", type=positive_int, default=100, help="metrics.precision_every of 'on' (default 100)")
    ap.add_argument("--against", default=None, help="another checkout to run as a third variant (no telemetry keys)")
    ap.add_argument("--workdir", default="runs/precision_overhead", help="the runs' folders and result.json")
    ap.add_argument("overrides", nargs="*", help="key.sub=value applied to every run")
    args = ap.parse_args(argv)
    if args.every + 1 >= args.steps:
        ap.error(f"--every {args.every} needs --steps above {args.every + 1}: a measured step with a step on each side")
    args.json = args.json or os.path.join(args.workdir, "result.json")
    return harness.publish(args, argv, prog, "precision-telemetry", TITLE, lambda: measure(args), markdown)


if __name__ == "__main__":
    sys.exit(main())
