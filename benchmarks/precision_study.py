"""The precision study: the demo trained under each optimizer / fp8 policy, over seeds, the same data.

    python -m benchmarks precision-study [--config configs/demo.py] [--seeds 3] [--jobs 1] [--only NAME ...]
                                         [--workdir runs/precision_study] [--telemetry-every 50]
                                         [--out BENCHMARKS.md] [key.sub=value ...]
    python -m benchmarks precision-study --render runs/precision_study/study.json --out BENCHMARKS.md

Each policy is trained ``--seeds`` times (the seeds ``SEEDS`` in order: the demo's own first), each a full
``train.py`` run (``harness.train_run``: torchrun, as many processes as the config's layout needs) from
scratch in ``<workdir>/<policy>/seed<N>``, its output in ``stdout.log`` there (a line says when each run starts
and ends). Per run: the final validation bits per byte (bits per token where the config's held-out data records
no bytes, e.g. ``data.type='synthetic'``: ``METRICS``; a config without held-out data, or one a policy cannot
apply to, e.g. fp8 on an fp32 model, is refused before the first run), the median tokens/s
per device (the first 10% of the steps left out as warm-up); per policy the persistent bytes per parameter
(``tessera.memory.persistent``). They are kept in ``<workdir>/study.json``, so policies can be run
one invocation at a time (``--only``). ``--jobs N`` trains N runs at a time (a machine with many cores: the
whole 3-seed study is 30 demo runs, hours on 2 cores). The section's statistics are ``tools/compare_runs.py``'s
(``tessera.analysis.run_compare.summarize``): per policy the mean and standard deviation of the final bits per
byte over its seeds, and the difference from the default policy with Welch's 95% interval and the verdict, and
paired by seed (each policy's run against the default's run of the same seed) the per-seed differences with the
paired t interval and its verdict;
its picture (the training-loss curves, a seed band per policy, the differences) goes to
``<pictures>/study_curves.png``.

The runs of the first seed also record the precision telemetry (``metrics.precision_every``,
``--telemetry-every``; 0 turns it off), and ``tools/precision_telemetry.py`` draws one heat map per policy,
of the measure that tells the most about it (``PICTURES``), into ``--pictures`` (docs/precision/<policy>.png
when ``--out BENCHMARKS.md`` publishes, else under the workdir; the curves picture goes there too).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import statistics
import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any

from benchmarks import harness
from tessera.analysis.run_compare import Group, SeedPairs, read_series, summarize, verdict, with_seed
from tessera.cli_args import nonnegative_int, positive_int
from tessera.config import ConfigError

TITLE = "## 8. Precision study: the demo under each optimizer and fp8 policy"
PICTURES_PUBLISHED = "docs/precision"  # the heat maps BENCHMARKS.md section 8 links to
STUDY: dict[str, list[str]] = {  # name -> config overrides (bf16 model, as the demo)
    "fp32 masters (default)": [],
    "bf16 masters": ["hybrid_zero_optimizer.master_dtype='bf16'"],
    "bf16 masters + Kahan": ["hybrid_zero_optimizer.master_dtype='bf16'",
                             "hybrid_zero_optimizer.master_compensation='kahan'"],
    "bf16 masters + stochastic": ["hybrid_zero_optimizer.master_dtype='bf16'",
                                  "hybrid_zero_optimizer.master_compensation='stochastic'"],
    "bf16 Adam moments": ["hybrid_zero_optimizer.optimizer_state_dtype='bf16'"],
    "fp8 tensorwise": ["model.low_precision.enabled=True", "model.low_precision.recipe='tensorwise'"],
    "fp8 rowwise": ["model.low_precision.enabled=True", "model.low_precision.recipe='rowwise'"],
    "mxfp8": ["model.low_precision.enabled=True", "model.low_precision.recipe='mxfp8'"],
    "nvfp4": ["model.low_precision.enabled=True", "model.low_precision.recipe='nvfp4'"],
    # the published recipes' shape: the ends high, attention MXFP8, the MLP NVFP4
    "per module: ends bf16, attention mxfp8, MLP nvfp4": [
        "model.low_precision.enabled=True",
        "model.low_precision.rules=[['layers.0.*', 'bf16'], ['layers.3.*', 'bf16'], "
        "['*.attention.*', 'mxfp8'], ['*.feed_forward.*', 'nvfp4']]"],
}
_ON = ["parallel.tensor.size=1", "model.low_precision.enabled=True"]
_NVFP4 = ["model.low_precision.enabled=True", "model.low_precision.recipe='nvfp4'"]
_FULL = ["parallel.tensor.size=1", "model.low_precision={'preset': 'nvidia'}"]
# the published recipes (issue 60), on the demo at TP=1 (its 2 processes as DP=2): blockwise fp8's 128-tiles do not
# fit the demo's 64-feature TP=2 shards, and one layout for every policy keeps the pairs comparable
RECIPE_STUDY: dict[str, list[str]] = {
    "bf16": ["parallel.tensor.size=1"],
    "nvfp4 bare": ["parallel.tensor.size=1", *_NVFP4],
    "nvfp4 NVIDIA recipe (preset nvidia)": _FULL,
    "NVIDIA recipe without 2D weights": [*_FULL, "model.low_precision.nvfp4_2d_weights=False"],
    "NVIDIA recipe without RHT": [*_FULL, "model.low_precision.hadamard_wgrad=False"],
    "NVIDIA recipe without SR": [*_FULL, "model.low_precision.stochastic_gradients=False"],
    "NVIDIA recipe without bf16 blocks": [*_FULL, "model.low_precision.keep_first_blocks=0",
                                          "model.low_precision.keep_last_blocks=0"],
    "nvfp4 torchtitan (preset torchtitan)": ["parallel.tensor.size=1", "model.low_precision={'preset': 'torchtitan'}"],
    "mxfp8 floor": [*_ON, "model.low_precision.recipe='mxfp8'", "model.low_precision.mx_scale_rounding='floor'"],
    "mxfp8 rceil": [*_ON, "model.low_precision.recipe='mxfp8'", "model.low_precision.mx_scale_rounding='rceil'"],
    "fp8 rowwise": [*_ON, "model.low_precision.recipe='rowwise'"],
    "fp8 rowwise_with_gw_hp": [*_ON, "model.low_precision.recipe='rowwise_with_gw_hp'"],
    "fp8 blockwise": [*_ON, "model.low_precision.recipe='blockwise'"],
}


@dataclass(frozen=True)
class Study:
    """One set of policies and the BENCHMARKS.md section it writes."""

    policies: dict[str, list[str]]
    section: str
    title: str


STUDIES = {
    "optimizer": Study(STUDY, "precision-study", TITLE),
    "recipes": Study(RECIPE_STUDY, "recipe-study",
                     "## 21. The published low-precision recipes: NVFP4's techniques, MXFP8's scales, fp8 variants"),
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
    # the recipes study: the flushed inputs of the block formats, the fp8 underflow of the fp8 ones
    **{name: "block_flushed" for name in ("nvfp4 bare", "nvfp4 NVIDIA recipe (preset nvidia)",
                                          "NVIDIA recipe without 2D weights", "NVIDIA recipe without RHT",
                                          "NVIDIA recipe without SR", "NVIDIA recipe without bf16 blocks",
                                          "nvfp4 torchtitan (preset torchtitan)", "mxfp8 floor", "mxfp8 rceil")},
    "fp8 rowwise_with_gw_hp": "fp8_underflow",
    "bf16": "update_below_half_ulp",
    "fp8 blockwise": "update_lost",  # the blockwise route reports no quantization measures of its own
}
BASELINE = "fp32 masters (default)"
SEEDS = (1024, 7, 3, 11, 13, 17, 19, 23, 29, 31)  # the demo's own three first (configs/demo.py's docstring)
CURVES = "study_curves.png"  # compare_runs' picture of every policy's training curves, under --pictures
# the figure of a run: its final validation's bits per byte, else (no bytes recorded) its bits per token
METRICS = {"bits_per_byte": ("bits per byte", "bits/byte"), "bits_per_token": ("bits per token", "bits/token")}


class StudyError(Exception):
    """A run of the study failed or gave no figure: one ``error:`` line naming the run and its log."""


def _policies(args: Any) -> Mapping[str, list[str]]:
    """The study's policies (``--set``); the optimizer study's for callers that build their own arguments."""
    return getattr(args, "policies", STUDY)


def check_policies(config: str, overrides: Sequence[str], names: Sequence[str],
                   policies: Mapping[str, list[str]] | None = None) -> None:
    """Refuse, before the first run, what would stop the study after hours of runs: a policy the config cannot
    take (fp8 or bf16 masters on an fp32 model), or runs that would end without a validation (the figure)."""
    for name in names:
        try:
            cfg = harness.load_config(config, [*overrides, *(policies or STUDY)[name]])
        except ConfigError as e:
            raise ConfigError(f"policy {name!r} on {config}: {e}") from None
        check_validation(config, cfg.data)


def check_validation(config: str, data: Any) -> None:
    """Refuse a ``data`` section (of ``config``) whose runs would end without a validation: token or text data
    with no held-out folder or rule."""
    if data.type in ("synthetic", "stdlib") or data.valid_folder:
        return
    rule = data.type == "text" and (data.text.valid_fraction or data.text.valid_every_nth)
    if not rule:
        held_out = " or a held-out rule (data.text.valid_fraction / valid_every_nth)" if data.type == "text" else ""
        raise ConfigError(f"{config}: data.type={data.type!r} without data.valid_folder has no validation, and the "
                          f"study compares the runs' final validation: give data.valid_folder=FOLDER{held_out}")


def figure_metric(rows: dict[str, Any]) -> str:
    """The study's figure: bits per byte when every run's validation has it, else bits per token (which every
    validation has)."""
    runs = [s for r in rows.values() for s in r["seeds"].values()]
    return "bits_per_byte" if all("bits_per_byte" in s for s in runs) else "bits_per_token"


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


def _bytes_per_param(config: str, overrides: list[str]) -> float:
    from tessera.config.checks import parallel_sizes
    from tessera.memory.persistent import closed_form_bytes
    from tessera.model import build_model
    from tessera.precision.plan import PrecisionPlan

    cfg = harness.load_config(config, overrides)
    tp = cfg.parallel.tensor.size
    _, _, zero1 = parallel_sizes(tp, tp, cfg.parallel.zero1.size)
    n = sum(p.numel() for p in build_model(cfg.model, tp_group=None, device="meta").parameters())
    return closed_form_bytes(PrecisionPlan.from_config(cfg), zero1, n, 0)["total"]  # the overrides are in cfg


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


def _run_dir(args: Any, name: str, seed: int) -> str:
    return os.path.join(args.workdir, _slug(name), f"seed{seed}")


FINISHED = "finished.json"  # in a run's folder once train.py exited 0: its config and overrides


def finished_run(run_dir: str, config: str, overrides: Sequence[str]) -> list[dict[str, Any]] | None:
    """The records of a run that finished in ``run_dir`` with this config and these overrides (so a study cut
    short trains only its missing runs when its command is run again); None when there is none, it was cut
    short (no ``FINISHED`` file) or it was trained otherwise."""
    try:
        with open(os.path.join(run_dir, FINISHED)) as f:
            done = json.load(f)
        if done != {"config": config, "overrides": list(overrides)}:
            return None
        with open(os.path.join(run_dir, "run", "metrics.jsonl")) as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return None


def run_seed(name: str, index: int, seed: int, args: Any) -> dict[str, Any]:
    """Train policy ``name`` once, with ``seed`` (the ``index``-th of ``SEEDS``); its figures, and for the first seed
    its telemetry's heat map."""
    telemetry = args.telemetry_every and index == 0
    extra = [*args.overrides, f"seed={seed}",
             *([f"metrics.precision_every={args.telemetry_every}"] if telemetry else [])]
    run_dir = _run_dir(args, name, seed)
    overrides = [*extra, *_policies(args)[name]]
    records = finished_run(run_dir, args.config, overrides)
    if records is not None:
        harness.log(f"[study] {name}, seed {seed}: kept the finished run in {run_dir}")
    else:
        harness.log(f"[study] {name}, seed {seed}: training (output in {os.path.join(run_dir, 'stdout.log')})")
        try:
            records = harness.train_run(harness.ROOT, args.config, overrides, run_dir)
        except RuntimeError as e:  # train.py's own error line is the last line of its log
            raise StudyError(f"{name}, seed {seed}: {e}") from None
        with open(os.path.join(run_dir, FINISHED), "w") as f:  # written last: a killed run leaves none
            json.dump({"config": args.config, "overrides": overrides}, f)
    train = [r for r in records if r.get("kind") == "train"]
    valid = [r for r in records if r.get("kind") == "valid"]
    if not (train and valid):
        raise StudyError(f"{name}, seed {seed}: the run logged no {'validation' if train else 'training step'} "
                         f"(see {os.path.join(run_dir, 'stdout.log')})")
    figures = {k: valid[-1][k] for k in METRICS if k in valid[-1]}
    out: dict[str, Any] = {**figures, "skipped": train[-1]["skipped_steps"],
                           "tgs": statistics.median(r["tgs"] for r in train[len(train) // 10:]),
                           "steps": train[-1]["step"], "run": os.path.join(run_dir, "run")}
    metric = next(iter(figures))  # bits per byte first, where the run has it
    harness.log(f"[study] {name}, seed {seed}: {figures[metric]:.4f} {METRICS[metric][1]}")
    if telemetry:
        out["telemetry"] = {"every": args.telemetry_every, **picture(
            name, os.path.join(run_dir, "run"), os.path.join(args.pictures, f"{_slug(name)}.png"))}
    return out


def run_policies(names: Sequence[str], args: Any, rows: dict[str, Any]) -> None:
    """Train every policy of ``names`` once per seed, ``args.jobs`` runs at a time, into ``rows`` (a policy's row
    replaced once all its seeds are done); ``args.json`` is rewritten after each policy, so a study can be run a
    few policies at a time. With ``--jobs`` above 1 the runs share the cores: tokens/s then measure a loaded
    machine, while the losses are those of the same runs alone (each run's numerics depend on its seed only)."""
    seeds = SEEDS[:args.seeds]
    pending = {name: len(seeds) for name in names}
    done: dict[str, dict[int, dict[str, Any]]] = {name: {} for name in names}
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:  # each run is its own torchrun: threads only wait
        futures = {pool.submit(run_seed, name, i, seed, args): (name, i)
                   for name in names for i, seed in enumerate(seeds)}
        for future in as_completed(futures):
            name, i = futures[future]
            done[name][i] = future.result()  # a failed run stops the study with its train.py error
            pending[name] -= 1
            if pending[name]:
                continue
            per_seed = [done[name][j] for j in range(len(seeds))]
            row: dict[str, Any] = {"name": name, "overrides": _policies(args)[name],
                                   "seeds": {str(seed): {k: v for k, v in s.items() if k != "telemetry"}
                                             for seed, s in zip(seeds, per_seed, strict=True)},
                                   "bytes_per_param": _bytes_per_param(args.config,
                                                                       [*args.overrides, *_policies(args)[name]])}
            if "telemetry" in per_seed[0]:
                row["telemetry"] = per_seed[0]["telemetry"]
            rows[name] = row
            with open(args.json, "w") as f:
                json.dump({"rows": rows}, f, indent=1)


def statistics_of(rows: dict[str, Any], kind: str = "valid", metric: str | None = None,
                  order: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """compare_runs' statistics of the rows' runs: per policy the final ``metric`` (default: ``figure_metric``)
    over seeds, and against the baseline policy (the first policy when the default was not run) Welch's 95%
    interval and the verdict."""
    metric = metric or figure_metric(rows)
    names = [n for n in (order or STUDY) if n in rows]
    groups = [Group(n, tuple(with_seed(read_series(s["run"], kind, metric), int(seed), "study.json")
                             for seed, s in rows[n]["seeds"].items())) for n in names]
    baseline = BASELINE if BASELINE in names else names[0]
    out = []
    for g in summarize(groups, baseline):
        w = g.vs_baseline
        out.append({"name": g.name, "n": len(g.values), "mean": g.mean, "std": g.std, "baseline": baseline,
                    "welch": None if w is None else {"difference": w.difference, "low": w.low, "high": w.high,
                                                     "df": w.df},
                    "verdict": "baseline" if g.name == baseline else verdict(w), "paired": _paired(g.paired)})
    return out


def _paired(pairs: SeedPairs | None) -> dict[str, Any] | None:
    """A policy against the baseline by seed, for study.json: the seeds paired, their differences, the paired
    interval and verdict, or why there is none; None for the baseline."""
    if pairs is None:
        return None
    p = pairs.interval
    if p is None:
        return {"seeds": list(pairs.seeds), "why_not": pairs.why_not}
    return {"seeds": list(pairs.seeds), "differences": list(p.differences), "difference": p.difference,
            "low": p.low, "high": p.high, "df": p.df, "verdict": verdict(p)}


def curves(rows: dict[str, Any], out: str, order: Sequence[str] | None = None) -> str:
    """compare_runs' picture of the training curves, one group per policy: mean line and seed band, smoothed
    view, differences from the baseline; the path written (relative to the repository root)."""
    spec = importlib.util.spec_from_file_location("compare_runs_tool", os.path.join(harness.ROOT, "tools",
                                                                                  "compare_runs.py"))
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    names = [n for n in (order or STUDY) if n in rows]
    runs = {n: ",".join(s["run"] for s in rows[n]["seeds"].values()) for n in names}
    argv = [a for n in names for a in ("--group", f"{_slug(n)}={runs[n]}")]
    baseline = BASELINE if BASELINE in names else names[0]
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    code = tool.main([*argv, "--baseline", _slug(baseline), "--rows", "0", "--plot", out])
    if code != 0:
        raise RuntimeError(f"tools/compare_runs.py exited {code} drawing {out}")
    return os.path.relpath(out, harness.ROOT)


def measure(args: Any) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    if os.path.exists(args.json):
        with open(args.json) as f:
            rows = json.load(f).get("rows", {})
    rows = {n: r for n, r in rows.items() if "seeds" in r}  # rows of the one-seed study have no runs to compare
    names = args.only or list(args.policies)
    # a ConfigError: publish's one error line, before any run
    check_policies(args.config, args.overrides, names, args.policies)
    harness.log(f"[study] {len(names)} policies x {args.seeds} seeds, {args.jobs} run(s) at a time")
    run_policies(names, args, rows)
    metric = figure_metric(rows)
    return {"config": args.config, "jobs": args.jobs, "rows": rows, "metric": metric,
            "policies": list(args.policies), "stats": statistics_of(rows, metric=metric, order=list(args.policies)),
            "curves": curves(rows, os.path.join(args.pictures, CURVES), order=list(args.policies))}


def paired_table(stats: Sequence[dict[str, Any]]) -> list[str]:
    """The section's paired statistics: which seeds each policy was paired on, each seed's difference, and the
    paired interval against the baseline policy (none in results saved before they were computed)."""
    paired = [st for st in stats if st.get("paired")]
    if not paired:
        return []
    if all("why_not" in st["paired"] for st in paired):  # e.g. one seed per policy: one line, not a table of dashes
        return ["", f"**Paired by seed**: {paired[0]['name']}: {paired[0]['paired']['why_not']}."]
    lines = ["", f"**Paired by seed**: each policy's run against the {paired[0]['baseline']} run of the same seed "
             "(the same initial weights and data order), so the seeds' own spread cancels; the mean of the per-seed "
             "differences with the paired t 95% interval (pairs - 1 degrees of freedom) and its verdict.", "",
             "| policy | seeds paired | per-seed difference | mean [95% paired interval] | verdict |",
             "|---|---|---|---:|---|"]
    for st in paired:
        p = st["paired"]
        seeds = ", ".join(map(str, p["seeds"])) or "-"
        if "why_not" in p:
            lines.append(f"| {st['name']} | {seeds} | - | - | {p['why_not']} |")
            continue
        each = ", ".join(f"{d:+.4f}" for d in p["differences"])
        lines.append(f"| {st['name']} | {seeds} | {each} | {p['difference']:+.4f} [{p['low']:+.4f}, "
                     f"{p['high']:+.4f}] | {p['verdict']} |")
    return lines


def _interval(st: dict[str, Any]) -> str:
    w = st["welch"]
    if w is None:
        return "-"
    return f"{w['difference']:+.4f} [{w['low']:+.4f}, {w['high']:+.4f}]"


def markdown(res: dict[str, Any]) -> list[str]:
    rows = [res["rows"][n] for n in res.get("policies", STUDY) if n in res["rows"]]
    stats = {st["name"]: st for st in res["stats"]}
    seeds = sorted({len(r["seeds"]) for r in rows})
    config = "" if res["config"] == "configs/demo.py" else f" --config {res['config']}"
    n_seeds = "/".join(map(str, seeds))
    jobs = res.get("jobs", 1)
    steps = sorted({s["steps"] for r in rows for s in r["seeds"].values()})
    reproduce = res.get("command") or (f"python -m benchmarks precision-study{config} --seeds {seeds[-1]}"
                                       f"{f' --jobs {jobs}' if jobs > 1 else ''}")
    at_commit = f", commit {res['commit']}" if res.get("commit") else ""
    metric = res.get("metric", "bits_per_byte")  # results saved before the metric was recorded: bits per byte
    figure = ("the final bits per byte over every held-out file" if metric == "bits_per_byte" else
              "the final validation's bits per token (the config's held-out data records no bytes)")
    baseline = next((st["baseline"] for st in res["stats"] if "baseline" in st), BASELINE)
    lines = [f"Reproduce: `{reproduce}` ({harness.machine_line(res['machine'])}; {res['date']}{at_commit}). "
             f"Each run trains {'/'.join(map(str, steps))} steps. Each policy is trained {n_seeds} times, "
             f"seeds {', '.join(map(str, SEEDS[:seeds[-1]]))} (the same data otherwise), each run from scratch; the "
             f"figure is {figure}, its mean and standard deviation over the seeds; the difference from the default "
             "policy comes with Welch's 95% interval and the verdict of "
             "`tools/compare_runs.py` (docs/compare-runs.md says what it means: \"within seed noise\" is no proof "
             "of equality). Tokens/s per device is the median over the runs' steps (first 10% left out); bytes per "
             "parameter are the persistent training state of this layout (closed form, `tools/precision_report.py "
             "--policies` measures it).", "",
             f"| policy | overrides | seeds | final {METRICS[metric][1]} (mean ± std) | vs {baseline} [95% interval] "
             "| verdict | "
             "tokens/s per device | bytes/param | skipped steps |",
             "|---|---|---:|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        st = stats[r["name"]]
        per_seed = list(r["seeds"].values())
        tgs = statistics.median(s["tgs"] for s in per_seed)
        skipped = "/".join(str(s["skipped"]) for s in per_seed)
        lines.append(f"| {r['name']} | `{' '.join(r['overrides']) or '-'}` | {st['n']} | {st['mean']:.4f} ± "
                     f"{st['std']:.4f} | {_interval(st)} | {st['verdict']} | {tgs:.0f} | {r['bytes_per_param']:.1f} "
                     f"| {skipped} |")
    lines += paired_table(res["stats"])
    lines += ["", f"![training loss per policy: mean over seeds with the seed band, smoothed, and the difference from "
              f"{baseline} with its 95% band]({res['curves']})", "",
              ("The runs were trained " + (f"{jobs} at a time, sharing the machine's cores, so tokens/s are those of "
                                           "a loaded machine" if jobs > 1 else "one at a time") +
               ". Runs of a study can share the cores with other jobs, so compare tokens/s only within one "
               "uninterrupted study; fp8 and the block formats are emulated on a CPU (operands rounded exactly, fp32 "
               "GEMMs), so there they cost speed by construction.")]
    drawn = [r for r in rows if r.get("telemetry")]
    if drawn:
        lines += ["", "**What each policy does to the numerics, per module** (the runs of the first seed, "
                  f"`metrics.precision_every={drawn[0]['telemetry']['every']}`; one heat map per policy, module x "
                  "step, drawn by `python tools/precision_telemetry.py <run> --measure <name>`; docs/telemetry.md says "
                  "what each measure means)."]
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
    ap.add_argument("--seeds", type=positive_int, default=3,
                    help=f"runs per policy, seeds {', '.join(map(str, SEEDS))} in order (at most {len(SEEDS)}; "
                         "2 or more give an interval)")
    ap.add_argument("--jobs", type=positive_int, default=1,
                    help="runs trained at a time (each a torchrun of the config's TP size): on a machine with many "
                         "cores, about cores / TP size; tokens/s are then those of a shared machine")
    ap.add_argument("--set", default="optimizer", choices=list(STUDIES),
                    help="which policies: the optimizer and format policies (section 8) or the published "
                         "low-precision recipes (section 21: NVFP4's techniques one by one, MXFP8's scale rounding, "
                         "fp8 rowwise / rowwise_with_gw_hp / blockwise)")
    ap.add_argument("--only", nargs="*", default=None, choices=[n for t in STUDIES.values() for n in t.policies],
                    help="run only these policies")
    ap.add_argument("--workdir", default=None, help="default: runs/precision_study (runs/recipe_study for --set "
                                                     "recipes); a rerun trains only the runs missing there")
    ap.add_argument("--telemetry-every", type=nonnegative_int, default=50,
                    help="metrics.precision_every of every run (0: no telemetry, no pictures)")
    ap.add_argument("--pictures", default=None,
                    help=f"where the heat maps go (default: {PICTURES_PUBLISHED} with --out {harness.PUBLISHED}, "
                         "else WORKDIR/pictures)")
    ap.add_argument("overrides", nargs="*", help="key.sub=value applied to every run")
    args = ap.parse_args(argv)
    study = STUDIES[args.set]
    args.policies = study.policies
    args.workdir = args.workdir or os.path.join("runs", study.section.replace("-", "_"))
    unknown = [n for n in args.only or () if n not in study.policies]
    if unknown:
        ap.error(f"--only {unknown}: not policies of --set {args.set}")
    if args.seeds > len(SEEDS):
        ap.error(f"--seeds {args.seeds}: at most {len(SEEDS)} (the seeds of SEEDS)")
    args.json = args.json or os.path.join(args.workdir, "study.json")
    if args.pictures is None:  # the published pictures go with the published figures, never by default
        publishing = os.path.basename(args.out) == harness.PUBLISHED
        args.pictures = PICTURES_PUBLISHED if publishing else os.path.join(args.workdir, "pictures")
    os.makedirs(args.workdir, exist_ok=True)
    try:
        return harness.publish(args, argv, prog, study.section, study.title, lambda: measure(args), markdown)
    except StudyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
