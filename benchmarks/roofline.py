"""Roofline of one training step: how much of it is GEMMs, attention, the optimizer, collectives and
everything else, and how far the step is from the matmul peak (BENCHMARKS.md section 10).

    python -m benchmarks roofline [--quick] [--against PATH] [--threads N] [--dtypes bf16,fp32]
                                  [--layouts tp1,msp,mtp] [--out BENCHMARKS.md] [--json PATH] [key=value ...]
    python -m benchmarks roofline --policies [--against PATH] ...   # section 13: the optimizer's share per policy

Each checkout's steps run in persistent worker processes (``benchmarks/roofline_worker.py``, run by
path with ``PYTHONPATH`` set to that checkout: ``--against /tmp/base`` after
``git worktree add /tmp/base fb20d6e`` measures the old code with the same instruments). TP=2 runs
on 2 gloo processes per checkout. Variants (checkout x dtype) step in rotated order each round and
step-time ratios are paired per round, because shared machines are noisy (``--clock cpu`` takes every
figure in CPU seconds of its process instead). The matmul peak (MFU's denominator) is measured in this
process before each layout's workers start and after the last, the best kept.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks import harness
from tessera.cli_args import positive_int

_WORKER = os.path.join(harness.ROOT, "benchmarks", "roofline_worker.py")
_REPLY = "@@roofline "  # roofline_worker.REPLY (not imported: the parent need not load the worker's torch code)
_RUN_WORKER = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"

# the workload: the demo's recipe at hidden 512, 4 layers, 8 heads, 8 rows x 256 tokens, 1 micro-batch
WORKLOAD = ("model.hidden_size=512", "model.num_layers=4", "model.num_attention_heads=8",
            "model.num_kv_attention_heads=8", "data.seq_len=256", "data.micro_bsz=8", "data.micro_num=1",
            "data.type='synthetic'", "data.pack_sample_into_one=True", "model.init_std=0.02")
LAYOUTS = {"tp1": (1, None), "msp": (2, "msp"), "mtp": (2, "mtp")}  # name -> (TP size, parallel.tensor.mode)
DTYPES = {"bf16": "torch.bfloat16", "fp32": "torch.float32"}
ROWS = (("gemm", "GEMMs (replayed alone)"), ("attention", "attention (in place)"),
        ("optimizer", "optimizer step, collectives excluded"), ("collectives", "collectives"),
        ("other", "other (step minus the above)"))
SECTION, TITLE = "roofline", "## 10. Roofline: where a step's time goes"
POLICY_SECTION = "roofline-policies"
POLICY_TITLE = "## 13. The optimizer's share of a step, per precision policy"


@dataclass(frozen=True)
class Plan:
    """How much to measure."""

    warmup: int = 2
    rounds: int = 8
    recorded_steps: int = 3
    replays: int = 5
    peak_size: int = 2048
    peak_seconds: float = 2.0
    extra: tuple[str, ...] = ()  # overrides after the workload's (quick: a smaller batch)


PLANS = {"full": Plan(), "quick": Plan(warmup=1, rounds=3, recorded_steps=1, replays=2, peak_size=1024,
                                       peak_seconds=0.3, extra=("data.micro_bsz=2",))}


# ---------------------------------------------------------------------------------------- workers
class WorkerGroup:
    """The ``world`` worker processes of one checkout for one layout (one per TP rank): commands as JSON
    lines on their stdin, replies on stdout lines starting with ``_REPLY``, stderr in a log file."""

    def __init__(self, side: str, checkout: str, world: int, start: dict[str, Any], threads: int, tmpdir: str):
        self.side, self.checkout = side, checkout
        self.procs: list[subprocess.Popen[str]] = []
        self.logs: list[str] = []
        env = {**os.environ, "PYTHONPATH": checkout, "OMP_NUM_THREADS": str(threads)}
        for rank in range(world):
            path, log = (os.path.join(tmpdir, f"{side}_rank{rank}.{ext}") for ext in ("pkl", "log"))
            with open(path, "wb") as f:
                pickle.dump({**start, "rank": rank, "world": world, "threads": threads,
                             "init_file": os.path.join(tmpdir, f"{side}_store")}, f)
            with open(log, "w") as err:
                self.procs.append(subprocess.Popen([sys.executable, "-c", _RUN_WORKER, _WORKER, path], cwd=checkout,
                                                   env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                                   text=True))
            self.logs.append(log)

    def replies(self) -> list[dict[str, Any]]:
        """One reply per rank; a rank's error or death raises with its traceback / log tail."""
        out = []
        for rank, proc in enumerate(self.procs):
            assert proc.stdout is not None
            line = next((ln for ln in proc.stdout if ln.startswith(_REPLY)), None)  # other output is a library's
            if line is None:
                with open(self.logs[rank]) as f:
                    raise RuntimeError(f"{self.side} rank {rank} ({self.checkout}) exited; its stderr ends:\n"
                                       f"{f.read()[-4000:]}")
            reply = json.loads(line[len(_REPLY):])
            if "error" in reply:
                raise RuntimeError(f"{self.side} rank {rank} ({self.checkout}) failed:\n{reply['error']}")
            out.append(reply)
        return out

    def send(self, **cmd: Any) -> list[dict[str, Any]]:
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(cmd) + "\n")
            proc.stdin.flush()
        return self.replies()

    def close(self) -> None:
        for proc in self.procs:
            try:
                if proc.poll() is None and proc.stdin is not None:
                    proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                    proc.stdin.close()
                proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()


# ---------------------------------------------------------------------------------------- measuring
def variant_overrides(layout: str, dtype: str, plan: Plan, extra: Sequence[str]) -> list[str]:
    """The workload, the plan's and the user's overrides, for one layout and dtype."""
    tp, mode = LAYOUTS[layout]
    over = [*WORKLOAD, *plan.extra, f"model.dtype='{DTYPES[dtype]}'", f"parallel.tensor.size={tp}"]
    if mode is not None:
        over.append(f"parallel.tensor.mode='{mode}'")
    return [*over, *extra]


def variants(layout: str, dtypes: Sequence[str], plan: Plan, extra: Sequence[str],
             policies: Sequence[str] = ()) -> dict[str, tuple[str, list[str]]]:
    """Variant name -> (dtype, overrides): one per dtype, or one per dtype and optimizer precision policy
    (``precision_report.POLICIES``: its ``hybrid_zero_optimizer`` keys)."""
    from tessera.train.precision_report import POLICIES

    if not policies:
        return {d: (d, variant_overrides(layout, d, plan, extra)) for d in dtypes}
    return {f"{d} {p}": (d, variant_overrides(layout, d, plan, [
        *(f"hybrid_zero_optimizer.{k}='{v}'" for k, v in POLICIES[p].items()), *extra]))
        for d in dtypes for p in policies}


def _peak_size(plan: Plan, device: str) -> int:
    return max(plan.peak_size, 8192) if device == "cuda" else plan.peak_size


def _peaks(dtypes: Sequence[str], threads: int, plan: Plan, device: str, clock: str) -> dict[str, float]:
    """Best TFLOP/s of one square matmul per dtype through the model's kernel choice
    (``metrics.measure_matmul_tflops``), timed with the workers' clock."""
    import torch

    from benchmarks.roofline_worker import CLOCKS
    from tessera.train.metrics import measure_matmul_tflops

    torch.set_num_threads(threads)
    out = {}
    for d in dtypes:
        _precision_switches(DTYPES[d])  # fp32 means fp32, not TF32, on a GPU
        out[d] = measure_matmul_tflops(torch.bfloat16 if d == "bf16" else torch.float32, torch.device(device),
                                       _peak_size(plan, device), plan.peak_seconds, iterations=1, timer=CLOCKS[clock])
    return out


def _summary(steps: list[list[dict[str, Any]]], dec: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's decomposition in seconds (medians over rounds; ``other`` = step minus the rest), and the
    job's step time per round (the slowest rank)."""
    rank0 = [s[0] for s in steps]
    parts = {
        "gemm": dec["gemm_replay_s"],
        "attention": dec["attention_s"],
        "optimizer": statistics.median(s["opt_s"] - s["opt_comm_s"] for s in rank0),
        "collectives": statistics.median(s["comm_s"] for s in rank0),
    }
    step = statistics.median(s["step_s"] for s in rank0)
    parts["other"] = step - sum(parts.values())
    return {"parts": parts, "step_s": step, "job_times": [max(r["step_s"] for r in s) for s in steps],
            "gemm_in_place_s": dec["gemm_in_place_s"], "gemm_flops": dec["gemm_flops"],
            "optimizer_step_s": statistics.median(s["opt_s"] for s in rank0),
            "first_loss": steps[0][0]["loss"] if steps else None}


def measure_layout(layout: str, sides: dict[str, str], named: dict[str, list[str]], raw: dict[str, Any], source: str,
                   plan: Plan, threads: int, device: str, clock: str, tmpdir: str) -> dict[str, Any]:
    """Build every side's stacks for ``layout`` (one per variant of ``named``: name -> overrides), interleave
    their steps (each round: one step command per side and variant), decompose each; per side and variant."""
    start = {"raw": raw, "source": source, "device": device, "clock": clock, "variants": named}
    groups: dict[str, WorkerGroup] = {}
    try:
        for side, checkout in sides.items():
            groups[side] = WorkerGroup(f"{layout}_{side}", checkout, LAYOUTS[layout][0], start, threads, tmpdir)
        info = {side: g.replies()[0] for side, g in groups.items()}
        for side, i in info.items():
            harness.log(f"  {layout} {side}: tessera from {i['tessera']}")
        pairs = [(side, d) for d in named for side in sides]
        steps = [harness.Variant(f"{side} {d}", lambda g=groups[side], d=d: g.send(cmd="step", variant=d))
                 for side, d in pairs]
        timed = harness.interleave(steps, plan.rounds, warmup=plan.warmup)
        out: dict[str, Any] = {}
        for side, d in pairs:
            dec = groups[side].send(cmd="decompose", variant=d, recorded_steps=plan.recorded_steps,
                                    replays=plan.replays)
            series = timed[f"{side} {d}"]
            summary = _summary(series.values, dec[0])
            summary.update(first_loss=series.warmup[0][0]["loss"] if series.warmup else None,
                           tokens=info[side]["stacks"][d]["tokens"], decomposition=dec, steps=series.values)
            out.setdefault(side, {})[d] = summary
        return out
    finally:
        for g in groups.values():
            g.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure every layout; a JSON-able dict (``to_markdown`` renders it)."""
    from tessera.config import load_python_file
    from tessera.model.flops import flops_per_token

    plan = PLANS["quick" if args.quick else "full"]
    if args.rounds is not None:
        plan = dataclasses.replace(plan, rounds=args.rounds)
    source = harness.config_path(args.config)
    raw = load_python_file(source)  # read once: every worker measures the same file contents
    sides = {"ours": harness.ROOT, **({"against": os.path.abspath(args.against)} if args.against else {})}
    result: dict[str, Any] = {
        "quick": args.quick, "plan": plan.__dict__, "threads": args.threads, "clock": args.clock, "device": args.device,
        "peak_size": _peak_size(plan, args.device), "config": args.config, "overrides": list(args.overrides),
        "commits": {side: harness.commit(path) for side, path in sides.items()}, "against_path": sides.get("against"),
        "loadavg": [harness.loadavg()], "layouts": {}, "policies": list(args.policies)}
    harness.log(f"roofline: {args.threads} thread(s), commits {result['commits']}")
    fpt = {}  # model FLOPs per token from this checkout's closed form; building the configs checks the overrides
    named = {layout: variants(layout, args.dtypes, plan, args.overrides, args.policies) for layout in args.layouts}
    for layout in args.layouts:
        for name, (_, overrides) in named[layout].items():
            cfg = harness.load_config(source, overrides)
            fpt[(layout, name)] = flops_per_token(cfg.model, cfg.data.seq_len)
    peaks = []
    with tempfile.TemporaryDirectory(prefix="roofline_") as tmpdir:
        for layout in args.layouts:  # the peak before each layout and after the last: the best of them counts
            peaks.append(_peaks(args.dtypes, args.threads, plan, args.device, args.clock))
            t0 = time.perf_counter()
            res = measure_layout(layout, sides, {n: o for n, (_, o) in named[layout].items()}, raw, source, plan,
                                 args.threads, args.device, args.clock, tmpdir)
            for side in res:
                for name, (d, _) in named[layout].items():
                    res[side][name].update(flops_per_token=fpt[(layout, name)], dtype=d)
            result["layouts"][layout] = res
            result["loadavg"].append(harness.loadavg())
            harness.log(f"[{time.perf_counter() - t0:.0f}s] {layout} done")
    peaks.append(_peaks(args.dtypes, args.threads, plan, args.device, args.clock))
    result["peaks_tflops"] = {d: max(p[d] for p in peaks) for d in args.dtypes}
    result["peaks_all"] = peaks
    for layout, res in result["layouts"].items():
        for side in res:
            for name, s in res[side].items():
                s["tflops"] = s["flops_per_token"] * s["tokens"] / statistics.median(s["job_times"]) / 1e12
                s["mfu"] = s["tflops"] / (result["peaks_tflops"][s["dtype"]] * LAYOUTS[layout][0])
                if side == "ours" and "against" in res:
                    s["vs_against"] = harness.paired(s["job_times"], res["against"][name]["job_times"])
    return result


# ---------------------------------------------------------------------------------------- markdown
def _busy_warning(result: dict[str, Any]) -> list[str]:
    """A line when the figures contradict themselves (MFU over 100%, a negative remainder): a busy machine."""
    odd = [f"{layout} {side} {d}" for layout, res in result["layouts"].items() for side in res
           for d, s in res[side].items() if s["mfu"] > 1 or s["parts"]["other"] < 0]
    if not odd:
        return []
    return ["", f"**Not trustworthy: {', '.join(odd)} show an MFU above 100% or a negative remainder: other "
                "processes took the cores during parts of the run. Rerun on a quiet machine (or with `--clock cpu`).**"]


def _header(result: dict[str, Any]) -> list[str]:
    """The command, the machine and the method, shared by both sections."""
    against = result["commits"].get("against")
    return [
        *(["**A `--quick` run (smaller batch, few rounds): a smoke result, not the figures to quote.**", ""]
          if result["quick"] else []),
        f"Reproduce: {harness.provenance(result)}"
        + (f"; against {against} (the checkout at `{result['against_path']}`) in the same run" if against else "")
        + f". {result['threads']} thread(s) per process, device {result['device']}, 1-minute load average "
        + " / ".join(f"{x:.1f}" for x in result["loadavg"]) + " (start / after each layout). Times are "
        + ("CPU seconds of each process, all its threads (`--clock cpu`: descheduling and blocking waits "
           "for the other rank left out). " if result["clock"] == "cpu" else "wall-clock. ")
        + f"Workload: `{result['config']}` with "
          f"`{' '.join(WORKLOAD + tuple(PLANS['quick'].extra if result['quick'] else ()))}`"
        + (f" and `{' '.join(result['overrides'])}`" if result["overrides"] else "") + ".",
        *_busy_warning(result),
        "",
        "Matmul peak (best square matmul through the model's kernel choice, "
        f"{result['peak_size']}^3, measured before each layout and after the last, the best kept): "
        + ", ".join(f"{d} {p:.3f} TFLOP/s" for d, p in result["peaks_tflops"].items()) + " per process.",
        "",
        "How: GEMMs = every matmul operator of one real step (forward, backward, optimizer; recorded by a "
        "TorchDispatchMode) replayed alone in order on fresh tensors of the same shapes, strides and dtypes "
        "(the fastest of the replays); attention = the fused attention operators timed in place during that step; "
        "optimizer = `optimizer.step()` minus the collectives inside it; collectives = time inside "
        "torch.distributed calls; other = the step's median minus those (norms, rotary, SwiGLU, casts, copies, "
        "Python). TP=2: 2 gloo processes, rank 0's decomposition; MFU on the job's step (the slower rank) against "
        "2x the peak. Variants (checkout x dtype) step in interleaved rounds; step-time ratios are paired per round.",
    ]


def to_markdown(result: dict[str, Any]) -> list[str]:
    """The section's lines (without its title)."""
    if result.get("policies"):
        return policies_markdown(result)
    lines = _header(result)
    dtypes = list(result["peaks_tflops"])
    against = result["commits"].get("against")
    for layout, res in result["layouts"].items():
        tp, mode = LAYOUTS[layout]
        ours = res["ours"]
        lines += ["", f"### TP={tp}" + (f" ({mode}), {tp} processes" if mode else ", 1 process"), "",
                  "| | " + " | ".join(f"{d} ms | {d} % of step" for d in dtypes) + " |",
                  "|---|" + "---:|---:|" * len(dtypes)]
        for key, label in ROWS:
            lines.append(f"| {label} | " + " | ".join(
                f"{ours[d]['parts'][key] * 1e3:.1f} | {100 * ours[d]['parts'][key] / ours[d]['step_s']:.0f}%"
                for d in dtypes) + " |")
        lines.append("| **step** | " + " | ".join(f"**{ours[d]['step_s'] * 1e3:.1f}** | 100%" for d in dtypes) + " |")
        lines.append("| GEMMs timed in place (not in the sum) | " + " | ".join(
            f"{ours[d]['gemm_in_place_s'] * 1e3:.1f} | " for d in dtypes) + " |")
        lines.append("| step / GEMM-only time | " + " | ".join(
            f"{ours[d]['step_s'] / ours[d]['parts']['gemm']:.2f}x | " for d in dtypes) + " |")
        lines.append("| model TFLOP/s (MFU) | " + " | ".join(
            f"{ours[d]['tflops']:.3f} ({100 * ours[d]['mfu']:.1f}%) | " for d in dtypes) + " |")
        if "against" in res:
            lines.append(f"| step time / {against}'s (paired rounds) | " + " | ".join(
                f"{harness.ratio(ours[d]['vs_against'], bold=False)} | " for d in dtypes) + " |")
            for d in dtypes:
                a = res["against"][d]
                lines.append("")
                lines.append(f"{against}, {d}: step {a['step_s'] * 1e3:.1f} ms = " + " + ".join(
                    f"{label.split(' (')[0].split(',')[0]} {a['parts'][key] * 1e3:.1f}" for key, label in ROWS)
                    + f" ms; first loss {a['first_loss']:.4f} (ours {ours[d]['first_loss']:.4f}).")
    return lines


def policies_markdown(result: dict[str, Any]) -> list[str]:
    """``--policies``: per layout, one row per (dtype, optimizer policy) with the optimizer's share of the step."""
    lines = _header(result)
    against = result["commits"].get("against")
    lines += ["", "Each row is one optimizer precision policy (`tessera.train.precision_report.POLICIES`: the "
                  "`hybrid_zero_optimizer` keys of `tools/precision_report.py --policies`) on the same workload; "
                  "the optimizer column is `optimizer.step()` without its collectives, its share is of the same "
                  "variant's median step."]
    for layout, res in result["layouts"].items():
        tp, mode = LAYOUTS[layout]
        ours = res["ours"]
        head = "| variant | step ms | optimizer ms | optimizer % of step | step / GEMM-only time |"
        rule = "|---|---:|---:|---:|---:|"
        if "against" in res:
            head += f" step / {against}'s (paired rounds) | {against}: optimizer % of step |"
            rule += "---:|---:|"
        lines += ["", f"### TP={tp}" + (f" ({mode}), {tp} processes" if mode else ", 1 process"), "", head, rule]
        for name, s in ours.items():
            opt = s["parts"]["optimizer"]
            row = (f"| {name} | {s['step_s'] * 1e3:.1f} | {opt * 1e3:.1f} | {100 * opt / s['step_s']:.1f}% | "
                   f"{s['step_s'] / s['parts']['gemm']:.2f}x |")
            if "against" in res:
                a, v = res["against"][name], s["vs_against"]
                row += f" {harness.ratio(v, bold=False)} | {100 * a['parts']['optimizer'] / a['step_s']:.1f}% |"
            lines.append(row)
    return lines


def main(argv: Sequence[str] | None = None, prog: str = "python -m benchmarks roofline") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = harness.parser(prog, __doc__)
    ap.add_argument("--quick", action="store_true", help="a smaller batch and few rounds (about a minute)")
    ap.add_argument("--against", default=None, metavar="PATH",
                    help="another checkout measured in the same run (e.g. git worktree add /tmp/base fb20d6e)")
    ap.add_argument("--threads", type=positive_int, default=1, help="torch threads per process")
    ap.add_argument("--dtypes", default="bf16,fp32", help=f"comma-separated, of {','.join(DTYPES)}")
    ap.add_argument("--layouts", default="tp1,msp,mtp",
                    help="comma-separated: tp1 (1 process), msp / mtp (TP=2 on 2 gloo processes)")
    ap.add_argument("--rounds", type=positive_int, default=None, help="timed rounds (default: 8, quick: 3)")
    ap.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                    help="cpu: every figure in CPU seconds of its process (for a busy machine; 1 thread per process)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: TP=1 only")
    ap.add_argument("--config", default="configs/demo.py", help="the config the workload overrides")
    ap.add_argument("--policies", nargs="?", const="all", default=None, metavar="NAMES",
                    help="one variant per optimizer precision policy (comma-separated names of "
                         "tessera.train.precision_report.POLICIES; default all) and write section 13 instead; "
                         "default --layouts tp1 --dtypes bf16")
    ap.add_argument("overrides", nargs="*", help="key.sub=value overrides after the workload's")
    args = ap.parse_args(argv)
    if args.policies is not None:
        from tessera.train.precision_report import POLICIES

        names = list(POLICIES) if args.policies == "all" else [p.strip() for p in args.policies.split(",") if p.strip()]
        bad = [p for p in names if p not in POLICIES]
        if bad or not names:
            ap.error(f"--policies: {bad or 'nothing'} not among {list(POLICIES)}")
        args.policies = names
        explicit = {a.split("=")[0] for a in argv}
        args.layouts = args.layouts if "--layouts" in explicit else "tp1"
        args.dtypes = args.dtypes if "--dtypes" in explicit else "bf16"
    else:
        args.policies = []
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    args.layouts = [v.strip() for v in args.layouts.split(",") if v.strip()]
    for flag, values, known in (("--dtypes", args.dtypes, DTYPES), ("--layouts", args.layouts, LAYOUTS)):
        bad = [v for v in values if v not in known]
        if bad or not values:
            ap.error(f"{flag}: {bad or 'nothing'} not among {list(known)}")
    if args.device == "cuda" and any(LAYOUTS[v][0] > 1 for v in args.layouts):
        ap.error("--device cuda measures TP=1 only (the TP=2 workers use gloo on CPU): pass --layouts tp1")
    if args.against and not os.path.isdir(os.path.join(args.against, "tessera")):
        ap.error(f"--against {args.against}: no tessera/ package there")
    if args.render:  # the section the saved run belongs to
        with open(args.render) as f:
            args.policies = json.load(f).get("policies") or []
    section, title = (POLICY_SECTION, POLICY_TITLE) if args.policies else (SECTION, TITLE)
    try:
        return harness.publish(args, argv, prog, section, title, lambda: run(args), to_markdown)
    except RuntimeError as e:  # a worker's failure, with its traceback or log tail
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())


def _precision_switches(dtype: str) -> None:
    """The process-wide switches of ``dtype`` in this checkout (``tessera.precision.switches``; a base checkout
    from before the precision package has them in ``tessera.core.precision``, an older one in
    ``tessera.config.precision``)."""
    try:
        from tessera.precision.switches import apply_precision
    except ImportError:
        try:
            from tessera.core.precision import apply_precision  # type: ignore[import-not-found,no-redef]
        except ImportError:
            from tessera.config.precision import apply_precision  # type: ignore[attr-defined,no-redef]
    apply_precision(dtype)
