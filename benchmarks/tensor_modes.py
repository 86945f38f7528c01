"""The training step in each tensor mode (mtp, msp) against another checkout: whole train.py runs, paired rounds.

    python -m benchmarks tensor-modes --against PATH [--modes mtp,msp] [--steps 300] [--rounds 3]
                                      [--config configs/demo.py] [--out BENCHMARKS.md] [key.sub=value ...]

Each variant (checkout x mode) is a ``train.py`` run under torchrun from scratch (``benchmarks.train_runs``:
no checkpoints, no sample, one validation batch). A round runs every variant once, in an order that
rotates from round to round. Per run the figure is the median ``step_time`` (forward, backward and
optimizer, where the tensor-parallel collectives run) over the steps after the first 10%; ratios are
taken within a round, between runs made minutes apart on the same machine.
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
from tessera.parallel.sequence import TENSOR_MODES

TITLE = "## 15. Tensor modes: the step in mtp and msp against a base"


def measure(args: argparse.Namespace) -> dict[str, Any]:
    checkouts = {"ours": ROOT, "base": os.path.abspath(args.against)}
    names = [(tree, mode) for mode in args.modes for tree in checkouts]
    first = max(1, args.steps // 10)
    median: dict[str, list[float]] = {f"{t} {m}": [] for t, m in names}
    for r in range(args.rounds):
        for tree, mode in names[r % len(names):] + names[: r % len(names)]:
            log(f"[tensor-modes] round {r + 1}/{args.rounds}: {tree} {mode}")
            run = run_once(checkouts[tree], [*args.overrides, f"parallel.tensor.mode='{mode}'"], args.config,
                           args.steps, os.path.join(args.workdir, f"{tree}_{mode}_{r}"))
            median[f"{tree} {mode}"].append(statistics.median(t for s, t in run["step_time"].items() if s > first))
    return {"config": args.config, "overrides": list(args.overrides), "steps": args.steps, "rounds": args.rounds,
            "first": first, "against": checkouts["base"], "modes": list(args.modes), "median_step": median}


def _paired(a: list[float], b: list[float]) -> str:
    ratios = sorted(x / y for x, y in zip(a, b))
    return f"**{statistics.median(ratios):.2f}x** [{ratios[0]:.2f}-{ratios[-1]:.2f}]"


def markdown(res: dict[str, Any], command: str, machine: str) -> list[str]:
    median, modes = res["median_step"], res["modes"]
    what = f"`{res['config']}`" + (f" with `{' '.join(res['overrides'])}`" if res["overrides"] else "")
    lines = [f"Reproduce: `{command}` ({machine}; {time.strftime('%Y-%m-%d')}). {what} trained {res['steps']} "
             f"steps per run from scratch, in each tensor mode, by this checkout (ours) and by the one at "
             f"`{res['against']}` (base); {res['rounds']} rounds, each running every variant once, the order "
             f"rotating per round. Per run: the median `step_time` of steps {res['first'] + 1} to {res['steps']}; "
             "ratios paired by round (median [min-max]).", "",
             "| mode | ours: median step (ms), per round | base | ours / base |", "|---|---|---|---|"]
    for mode in modes:
        ours, base = median[f"ours {mode}"], median[f"base {mode}"]
        lines.append(f"| {mode} | {' / '.join(f'{1e3 * t:.1f}' for t in ours)} | "
                     f"{' / '.join(f'{1e3 * t:.1f}' for t in base)} | {_paired(ours, base)} |")
    if len(modes) == 2:
        a, b = modes[1], modes[0]
        lines += ["", f"{a} / {b}, paired by round: ours {_paired(median[f'ours {a}'], median[f'ours {b}'])}, "
                  f"base {_paired(median[f'base {a}'], median[f'base {b}'])}."]
    return lines


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in TENSOR_MODES]
    if not modes or bad:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated, of {','.join(TENSOR_MODES)}")
    return modes


def main(argv: Sequence[str] | None = None, prog: str = "python -m benchmarks tensor-modes") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", required=True, help="the other checkout (e.g. git worktree add /tmp/base <commit>)")
    ap.add_argument("--modes", type=_modes, default=list(TENSOR_MODES), help="comma-separated (default mtp,msp)")
    ap.add_argument("--config", default="configs/demo.py")
    ap.add_argument("--steps", type=positive_int, default=300, help="steps per run (default 300)")
    ap.add_argument("--rounds", type=positive_int, default=3, help="paired rounds (default 3)")
    ap.add_argument("--out", default="BENCHMARKS.md", help="file whose section 15 is replaced ('' = none)")
    ap.add_argument("--workdir", default="runs/tensor_modes")
    ap.add_argument("overrides", nargs="*", help="key.sub=value applied to every run")
    args = ap.parse_args(argv)
    if not os.path.isfile(os.path.join(args.against, "train.py")):
        ap.error(f"--against {args.against}: no train.py there")
    report(measure(args), args.workdir, argv, prog, args.out, "tensor-modes", TITLE, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
