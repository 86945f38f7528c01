"""The training step in each tensor mode (mtp, msp) against another checkout: whole train.py runs, paired rounds.

    python -m benchmarks tensor-modes --against PATH [--modes mtp,msp] [--steps 300] [--rounds 3]
                                      [--config configs/demo.py] [--out BENCHMARKS.md] [key.sub=value ...]

Each variant (checkout x mode) is a ``train.py`` run under torchrun from scratch (``harness.train_run``
with ``harness.LOOP_ONLY``: no checkpoints, no sample, one validation batch); a round runs every variant
once, in an order that rotates from round to round. Per run the figure is the median ``step_time``
(forward, backward and optimizer, where the tensor-parallel collectives run) over the steps after the
first 10%; ratios are taken within a round, between runs made minutes apart on the same machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Sequence
from typing import Any

from benchmarks import harness
from tessera.cli_args import positive_int
from tessera.parallel.sequence import TENSOR_MODES

TITLE = "## 15. Tensor modes: the step in mtp and msp against a base"


def measure(args: argparse.Namespace) -> dict[str, Any]:
    checkouts = {"ours": harness.ROOT, "base": os.path.abspath(args.against)}
    first = max(1, args.steps // 10)
    done: dict[tuple[str, str], int] = {}  # runs so far per (checkout, mode), for the folder names

    def run(tree: str, mode: str) -> float:
        done[tree, mode] = done.get((tree, mode), -1) + 1
        records = harness.train_run(checkouts[tree], args.config, [
            *harness.LOOP_ONLY, *args.overrides, f"parallel.tensor.mode='{mode}'", f"data.total_steps={args.steps}"],
            os.path.join(args.workdir, f"{tree}_{mode}_{done[tree, mode]}"))
        return statistics.median(x["step_time"] for x in records if x["kind"] == "train" and x["step"] > first)

    variants = [harness.Variant(f"{tree} {mode}", lambda t=tree, m=mode: run(t, m))
                for mode in args.modes for tree in checkouts]
    timed = harness.interleave(variants, args.rounds, warmup=0)
    return {"config": args.config, "overrides": list(args.overrides), "steps": args.steps, "rounds": args.rounds,
            "first": first, "against": checkouts["base"], "modes": list(args.modes),
            "median_step": {n: s.values for n, s in timed.items()}}


def markdown(res: dict[str, Any]) -> list[str]:
    median, modes = res["median_step"], res["modes"]
    what = f"`{res['config']}`" + (f" with `{' '.join(res['overrides'])}`" if res["overrides"] else "")
    lines = [f"Reproduce: {harness.provenance(res)}. {what} trained {res['steps']} steps per run from scratch, in "
             f"each tensor mode, by this checkout (ours) and by the one at `{res['against']}` (base); {res['rounds']} "
             "rounds, each running every variant once, the order rotating per round. Per run: the median `step_time` "
             f"of steps {res['first'] + 1} to {res['steps']}; ratios paired by round (median [min-max]).", "",
             "| mode | ours: median step (ms), per round | base | ours / base |", "|---|---|---|---|"]
    for mode in modes:
        ours, base = median[f"ours {mode}"], median[f"base {mode}"]
        lines.append(f"| {mode} | {' / '.join(f'{1e3 * t:.1f}' for t in ours)} | "
                     f"{' / '.join(f'{1e3 * t:.1f}' for t in base)} | {harness.ratio(harness.paired(ours, base))} |")
    if len(modes) == 2:
        a, b = modes[1], modes[0]
        lines += ["", f"{a} / {b}, paired by round: " + ", ".join(
            f"{tree} {harness.ratio(harness.paired(median[f'{tree} {a}'], median[f'{tree} {b}']))}"
            for tree in ("ours", "base")) + "."]
    return lines


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes or any(m not in TENSOR_MODES for m in modes):
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated, of {','.join(TENSOR_MODES)}")
    return modes


def main(argv: Sequence[str] | None = None, prog: str = "python -m benchmarks tensor-modes") -> int:
    ap = harness.parser(prog, __doc__)
    ap.add_argument("--against", required=True, help="the other checkout (e.g. git worktree add /tmp/base <commit>)")
    ap.add_argument("--modes", type=_modes, default=list(TENSOR_MODES), help="comma-separated (default mtp,msp)")
    ap.add_argument("--config", default="configs/demo.py")
    ap.add_argument("--steps", type=positive_int, default=300, help="steps per run (default 300)")
    ap.add_argument("--rounds", type=positive_int, default=3, help="paired rounds (default 3)")
    ap.add_argument("--workdir", default="runs/tensor_modes", help="the runs' folders and result.json")
    ap.add_argument("overrides", nargs="*", help="key.sub=value applied to every run")
    args = ap.parse_args(argv)
    if not os.path.isfile(os.path.join(args.against, "train.py")):
        ap.error(f"--against {args.against}: no train.py there")
    args.json = args.json or os.path.join(args.workdir, "result.json")
    return harness.publish(args, argv, prog, "tensor-modes", TITLE, lambda: measure(args), markdown)


if __name__ == "__main__":
    sys.exit(main())
