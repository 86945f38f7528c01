"""What the precision telemetry costs: the demo trained with ``metrics.precision_every`` 0 and N, paired rounds.

    python -m benchmarks precision-telemetry [--steps 300] [--rounds 3] [--every 100] [--against PATH]
                                             [--config configs/demo.py] [--out BENCHMARKS.md] [key.sub=value ...]

Each variant is a ``train.py`` run under torchrun (the config's TP size in processes), from scratch, for
``--steps`` steps, without checkpoints, the final sample or more than one validation batch. A round runs
every variant once, in an order that rotates from round to round, and a round's ratios compare runs
made minutes apart on the same machine. The figure is the loop's wall time per step over the steps
after the first 10% (the ``time`` of consecutive ``train`` records of metrics.jsonl: the step, the
telemetry's reduction and its metrics.jsonl / TensorBoard writes, the data), and, apart, the measured
steps' own ``step_time`` against the median step. ``--against PATH`` adds a third variant: another
checkout's train.py (e.g. ``git archive <commit> | tar -x -C /tmp/base``) with no telemetry keys, which
shows whether "off" costs anything at all.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from tessera.cli_args import positive_int

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXED = ["ckpt.enable_save_ckpt=False", "generate.max_new_tokens=0", "data.valid_micro_num=1",
         "metrics.progress_bar=False"]


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_once(checkout: str, overrides: list[str], config: str, steps: int, run_dir: str) -> dict[str, Any]:
    """One train.py run; its per-step loop wall times and step times (seconds), by step."""
    from tessera.config import Config

    nproc = Config.from_file(config, overrides).parallel.tensor.size
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(checkout, "train.py"), "--config", config, *FIXED, *overrides, f"data.total_steps={steps}",
           f"data.cache_folder='{os.path.join(ROOT, 'data_cache')}'", f"log_folder='{run_dir}'", "job_name='run'"]
    env = dict(os.environ, PYTHONPATH=checkout)
    with open(os.path.join(run_dir, "stdout.log"), "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env).returncode
    if rc:
        raise RuntimeError(f"train.py exited {rc}: {shlex.join(cmd)}; see {run_dir}/stdout.log")
    with open(os.path.join(run_dir, "run", "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    train = {r["step"]: r for r in records if r["kind"] == "train"}
    measured = [r["step"] for r in records if r["kind"] == "precision"]
    return {"time": {s: r["time"] for s, r in train.items()},
            "step_time": {s: r["step_time"] for s, r in train.items()}, "measured": measured}


def per_step_wall(run: dict[str, Any], first: int, last: int) -> float:
    """Mean loop wall time per step from step ``first`` to ``last``."""
    return (run["time"][last] - run["time"][first]) / (last - first)


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
            _log(f"[precision-telemetry] round {r + 1}/{args.rounds}: {name}")
            runs[name].append(run_once(checkout, overrides, args.config, args.steps,
                                       os.path.join(args.workdir, f"{name}_{r}")))
    wall = {n: [per_step_wall(run, first, args.steps) for run in runs[n]] for n in names}
    out: dict[str, Any] = {"config": args.config, "overrides": list(args.overrides), "steps": args.steps,
                           "every": args.every, "rounds": args.rounds, "first": first,
                           "against": os.path.abspath(args.against) if args.against else None, "wall": wall,
                           "ratio_on_off": [a / b for a, b in zip(wall["on"], wall["off"])],
                           "measured": runs["on"][0]["measured"]}
    if args.against:
        out["ratio_off_base"] = [a / b for a, b in zip(wall["off"], wall["base"])]
    # a measured step's own time against the median step of the same run
    extra = []
    for run in runs["on"]:
        steady = [t for s, t in run["step_time"].items() if s > first and s not in run["measured"]]
        median = statistics.median(steady)
        extra += [run["step_time"][s] - median for s in run["measured"] if s > first]
    out["measured_step_extra_s"] = extra
    out["median_step_s"] = statistics.median(t for run in runs["off"] for s, t in run["step_time"].items() if s > first)
    return out


def markdown(res: dict[str, Any], command: str, machine: str) -> list[str]:
    on_off = res["ratio_on_off"]
    what = ("The demo (`configs/demo.py`: TP=2 on 2 processes, bf16)" if res["config"] == "configs/demo.py"
            and not res["overrides"] else f"`{res['config']}` with `{' '.join(res['overrides']) or '-'}`")
    lines = [f"Reproduce: `{command}` ({machine}; {time.strftime('%Y-%m-%d')}). {what} "
             f"trained {res['steps']} steps per run from scratch, with "
             f"`metrics.precision_every=0` (off) and `={res['every']}` (on: steps {res['measured']} measured), "
             f"{res['rounds']} paired rounds, the order rotating per round. Figure: the training loop's wall time per "
             f"step from step {res['first']} to {res['steps']} (the `time` of consecutive metrics.jsonl records: the "
             "step, the telemetry's reduction, its metrics.jsonl and TensorBoard lines, the data).", "",
             "| round | off: s/step | on: s/step | on / off |"
             + (" base: s/step | off / base |" if res["against"] else ""),
             "|---:|---:|---:|---:|" + ("---:|---:|" if res["against"] else "")]
    for i in range(res["rounds"]):
        row = f"| {i + 1} | {res['wall']['off'][i]:.4f} | {res['wall']['on'][i]:.4f} | {on_off[i]:.3f} |"
        if res["against"]:
            row += f" {res['wall']['base'][i]:.4f} | {res['ratio_off_base'][i]:.3f} |"
        lines.append(row)
    extra = res["measured_step_extra_s"]
    lines += ["", f"Overhead at N={res['every']}: median {100 * (statistics.median(on_off) - 1):+.2f}% per step "
              f"(rounds {', '.join(f'{100 * (r - 1):+.2f}%' for r in on_off)}). A measured step takes "
              f"{1e3 * statistics.median(extra):.0f} ms more than the median step "
              f"({1e3 * res['median_step_s']:.0f} ms) "
              f"in the `step_time` it reports (median of {len(extra)}), so the expected cost is about "
              f"{100 * statistics.median(extra) / res['median_step_s'] / res['every']:.2f}% at N={res['every']}; "
              "the rest of a round's difference is the shared machine's noise."]
    if res["against"]:
        lines.append(f"Off against {res['against']} (no telemetry code): median "
                     f"{100 * (statistics.median(res['ratio_off_base']) - 1):+.2f}% per step.")
    else:
        lines.append("Off, the telemetry does not exist: the builder creates no telemetry object, so no hook is "
                     "installed and no tensor allocated (`tests/test_precision_telemetry.py`); a step pays one "
                     "`is not None` test.")
    return lines


def main(argv: Sequence[str] | None = None, prog: str = "python -m benchmarks precision-telemetry") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/demo.py")
    ap.add_argument("--steps", type=positive_int, default=300, help="steps per run (default 300)")
    ap.add_argument("--rounds", type=positive_int, default=3, help="paired rounds (default 3)")
    ap.add_argument("--every", type=positive_int, default=100, help="metrics.precision_every of 'on' (default 100)")
    ap.add_argument("--against", default=None, help="another checkout to run as a third variant (no telemetry keys)")
    ap.add_argument("--out", default="BENCHMARKS.md")
    ap.add_argument("--workdir", default="runs/precision_overhead")
    ap.add_argument("overrides", nargs="*", help="key.sub=value applied to every run")
    args = ap.parse_args(argv)
    from benchmarks.cli import write_section
    from benchmarks.runner import machine_info

    res = measure(args)
    with open(os.path.join(args.workdir, "result.json"), "w") as f:
        json.dump(res, f, indent=1)
    info = machine_info()
    machine = f"{info.get('cpu', 'CPU')}, {info.get('cores', '?')} cores, torch {info.get('torch')}"
    command = " ".join([prog, *(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))])
    write_section(args.out, "precision-telemetry", "## 14. Precision telemetry: what measuring costs",
                  markdown(res, command, machine))
    _log(f"wrote the precision-telemetry section of {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
