"""The precision study: the demo trained under each optimizer / fp8 policy, same seed and data.

    python -m benchmarks precision-study [--config configs/demo.py] [--only NAME ...] [--workdir runs/precision_study]
                                         [--telemetry-every 50] [--out BENCHMARKS.md] [key.sub=value ...]
    python -m benchmarks precision-study --render runs/precision_study/study.json   # the section again

Each policy is one full ``train.py`` run (``harness.train_run``: torchrun, as many processes as the
config's layout needs) from scratch in its own folder. A run's final validation bits per byte, its
median tokens/s per device (the first 10% of the steps left out as warm-up) and its persistent bytes per
parameter (the closed form of ``precision_report``) are kept in ``<workdir>/study.json``, so the policies
can be run one invocation at a time (``--only``); the section is rendered from every row there.

Every run also records the precision telemetry (``metrics.precision_every``, ``--telemetry-every``; 0
turns it off), and ``tools/precision_telemetry.py`` draws one heat map per policy, of the measure that
tells the most about it (``PICTURES``), into ``--pictures`` (docs/precision/<policy>.png).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import statistics
import sys
from collections.abc import Sequence
from typing import Any

from benchmarks import harness
from tessera.cli_args import nonnegative_int

TITLE = "## 8. Precision study: the demo under each optimizer and fp8 policy"
STUDY: dict[str, list[str]] = {  # name -> config overrides (bf16 model, as the demo)
    "fp32 masters (default)": [],
    "bf16 masters": ["hybrid_zero_optimizer.master_dtype='bf16'"],
    "bf16 masters + Kahan": ["hybrid_zero_optimizer.master_dtype='bf16'",
                             "hybrid_zero_optimizer.master_compensation='kahan'"],
    "bf16 masters + stochastic": ["hybrid_zero_optimizer.master_dtype='bf16'",
                                  "hybrid_zero_optimizer.master_compensation='stochastic'"],
    "bf16 Adam moments": ["hybrid_zero_optimizer.optimizer_state_dtype='bf16'"],
    "fp8 tensorwise": ["model.fp8.enabled=True", "model.fp8.recipe='tensorwise'"],
    "fp8 rowwise": ["model.fp8.enabled=True", "model.fp8.recipe='rowwise'"],
    "mxfp8": ["model.fp8.enabled=True", "model.fp8.recipe='mxfp8'"],
    "nvfp4": ["model.fp8.enabled=True", "model.fp8.recipe='nvfp4'"],
    # the published recipes' shape: the ends high, attention MXFP8, the MLP NVFP4
    "per module: ends bf16, attention mxfp8, MLP nvfp4": [
        "model.fp8.enabled=True", "model.fp8.rules=[['layers.0.*', 'bf16'], ['layers.3.*', 'bf16'], "
        "['*.attention.*', 'mxfp8'], ['*.feed_forward.*', 'nvfp4']]"],
}
# the telemetry measure drawn for each policy: what it changes, or what it risks
PICTURES: dict[str, str] = {
    "fp32 masters (default)": "update_below_half_ulp",  # what bf16 masters would drop here
    "bf16 masters": "update_lost",  # what they do drop
    "bf16 masters + Kahan": "update_lost",
    "bf16 masters + stochastic": "update_lost",
    "bf16 Adam moments": "update_rms_ratio",  # the moments set the update's size
    "fp8 tensorwise": "fp8_underflow",  # the input elements e4m3 flushes to zero
    "fp8 rowwise": "fp8_underflow",
    "mxfp8": "block_flushed",  # the input elements a block's scale leaves below the element format
    "nvfp4": "block_flushed",
    "per module: ends bf16, attention mxfp8, MLP nvfp4": "block_flushed",
}
SEED_SPREAD = 0.03  # bits/byte: 1.670 / 1.695 / 1.663 for seeds 1024 / 7 / 3 of the demo (configs/demo.py)


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


def _bytes_per_param(config: str, overrides: list[str]) -> float:
    from tessera.config.checks import parallel_sizes
    from tessera.core.precision import Precision
    from tessera.model import build_model
    from tessera.train.precision_report import closed_form_bytes

    cfg = harness.load_config(config, overrides)
    tp = cfg.parallel.tensor.size
    _, _, zero1 = parallel_sizes(tp, tp, cfg.parallel.zero1.size)
    n = sum(p.numel() for p in build_model(cfg.model, tp_group=None, device="meta").parameters())
    return closed_form_bytes(Precision.from_config(cfg), zero1, n, 0)["total"]  # the overrides are in cfg


def picture(name: str, log_dir: str, out: str) -> dict[str, Any]:
    """The policy's heat map, drawn by tools/precision_telemetry.py, and the figures of its sentence: the measure's
    mean over the rows at the first and last measured step, its lowest and highest, and the three highest rows."""
    spec = importlib.util.spec_from_file_location("precision_telemetry_tool",
                                                  os.path.join(harness.ROOT, "tools", "precision_telemetry.py"))
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    measure = PICTURES[name]
    rows, steps, values = tool.table(tool.load(log_dir)[1], measure)
    tool.render(out, rows, steps, values, tool.MEASURES[measure], f"{name}: {measure} per module and step")
    means = [statistics.mean(v[i] for v in values if not math.isnan(v[i])) for i in range(len(steps))]
    lo, hi = min(range(len(steps)), key=means.__getitem__), max(range(len(steps)), key=means.__getitem__)
    return {"measure": measure, "picture": os.path.relpath(out, harness.ROOT), "steps": [steps[0], steps[-1]],
            "mean": [means[0], means[-1]], "low": [steps[lo], means[lo]], "high": [steps[hi], means[hi]],
            "worst": [(w[0], w[1]) for w in tool.worst(rows, values, tool.MEASURES[measure], 3)]}


def run_policy(name: str, args: Any) -> dict[str, Any]:
    extra = [*args.overrides, *([f"metrics.precision_every={args.telemetry_every}"] if args.telemetry_every else [])]
    overrides = [*extra, *STUDY[name]]
    run_dir = os.path.join(args.workdir, _slug(name))
    records = harness.train_run(harness.ROOT, args.config, overrides, run_dir)
    train = [r for r in records if r.get("kind") == "train"]
    valid = [r for r in records if r.get("kind") == "valid"]
    row = {"name": name, "overrides": STUDY[name], "bits_per_byte": valid[-1]["bits_per_byte"],
           "tgs": statistics.median(r["tgs"] for r in train[len(train) // 10:]), "skipped": train[-1]["skipped_steps"],
           "bytes_per_param": _bytes_per_param(args.config, overrides), "steps": train[-1]["step"]}
    if args.telemetry_every:
        row["telemetry"] = {"every": args.telemetry_every, **picture(
            name, os.path.join(run_dir, "run"), os.path.join(args.pictures, f"{_slug(name)}.png"))}
    return row


def measure(args: Any) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    if os.path.exists(args.json):
        with open(args.json) as f:
            rows = json.load(f).get("rows", {})
    for name in args.only or list(STUDY):
        harness.log(f"[study] {name} ...")
        rows[name] = run_policy(name, args)
        harness.log(f"[study] {name}: {rows[name]['bits_per_byte']:.4f} bits/byte, {rows[name]['tgs']:.0f} tokens/s")
        with open(args.json, "w") as f:  # kept after each run: a study can be run one policy at a time
            json.dump({"rows": rows}, f, indent=1)
    return {"config": args.config, "rows": rows}


def markdown(res: dict[str, Any]) -> list[str]:
    rows = [res["rows"][n] for n in STUDY if n in res["rows"]]
    base = res["rows"].get("fp32 masters (default)")
    config = "" if res["config"] == "configs/demo.py" else f" --config {res['config']}"
    lines = [f"Reproduce: `python -m benchmarks precision-study{config}` ({harness.machine_line(res['machine'])}; "
             f"{res['date']}). Each row is a full demo run (`configs/demo.py`: bf16 model, TP=2, seed 1024, the same "
             "data), from scratch; bits per byte over every held-out file; tokens/s per device is the median over the "
             "run (first 10% of steps left out); bytes per parameter are the persistent training state of this "
             "layout (closed form, `tools/precision_report.py --policies` measures it).", "",
             "| policy | overrides | final bits/byte | vs fp32 masters | tokens/s per device | bytes/param | "
             "skipped steps |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        delta = f"{r['bits_per_byte'] - base['bits_per_byte']:+.4f}" if base else "-"
        lines.append(f"| {r['name']} | `{' '.join(r['overrides']) or '-'}` | {r['bits_per_byte']:.4f} | {delta} | "
                     f"{r['tgs']:.0f} | {r['bytes_per_param']:.1f} | {r['skipped']} |")
    beyond = [f"{r['name']} ({r['bits_per_byte'] - base['bits_per_byte']:+.3f})" for r in rows
              if base and abs(r["bits_per_byte"] - base["bits_per_byte"]) > SEED_SPREAD]
    lines += ["", f"One seed per policy: differences below about {SEED_SPREAD} bits/byte, the spread of three seeds of "
              "the demo (`configs/demo.py`'s docstring), are not shown to be more than one trajectory's luck; "
              f"beyond it: {', '.join(beyond) or 'none'}. Runs of a study can share the cores with other jobs, so "
              "compare tokens/s only within one uninterrupted study; fp8 and the block formats are emulated on a CPU "
              "(operands rounded exactly, fp32 GEMMs), so there they cost speed by construction."]
    drawn = [r for r in rows if r.get("telemetry")]
    if drawn:
        lines += ["", "**What each policy does to the numerics, per module** (the same runs, "
                  f"`metrics.precision_every={drawn[0]['telemetry']['every']}`; one heat map per policy, module x "
                  "step, drawn by `python tools/precision_telemetry.py <run> --measure <name>`; README \"Precision "
                  "telemetry\" says what each measure means)."]
    for r in drawn:
        t = r["telemetry"]
        worst = ", ".join(f"`{row}` {mean:.3g}" for row, mean in t["worst"])
        lines += ["", f"*{r['name']}* — `{t['measure']}`, mean over the modules: {t['mean'][0]:.3g} at step "
                  f"{t['steps'][0]}, lowest {t['low'][1]:.3g} at step {t['low'][0]}, highest {t['high'][1]:.3g} at "
                  f"step {t['high'][0]}, {t['mean'][1]:.3g} at step {t['steps'][1]}; the highest modules over the "
                  f"run: {worst}.", "",
                  f"![{r['name']}: {t['measure']}]({t['picture']})"]
    return lines


def main(argv: Sequence[str] | None = None, prog: str = "python -m benchmarks precision-study") -> int:
    ap = harness.parser(prog, __doc__)
    ap.add_argument("--config", default="configs/demo.py")
    ap.add_argument("--only", nargs="*", default=None, choices=list(STUDY), help="run only these policies")
    ap.add_argument("--workdir", default="runs/precision_study")
    ap.add_argument("--telemetry-every", type=nonnegative_int, default=50,
                    help="metrics.precision_every of every run (0: no telemetry, no pictures)")
    ap.add_argument("--pictures", default="docs/precision", help="where the heat maps go")
    ap.add_argument("overrides", nargs="*", help="key.sub=value applied to every run")
    args = ap.parse_args(argv)
    args.json = args.json or os.path.join(args.workdir, "study.json")
    os.makedirs(args.workdir, exist_ok=True)
    return harness.publish(args, argv, prog, "precision-study", TITLE, lambda: measure(args), markdown)


if __name__ == "__main__":
    sys.exit(main())
