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
import copy
import dataclasses
import datetime
import json
import os
import pickle
import queue
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from tessera.cli_args import positive_int

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_WORKER = os.path.join(_ROOT, "benchmarks", "roofline_worker.py")
_REPLY = "@@roofline "  # roofline_worker.REPLY (not imported: the parent need not load the worker's torch code)
_RUN_WORKER = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"

# issue 30's workload: the demo's recipe at hidden 512, 4 layers, 8 heads, 8 rows x 256 tokens, 1 micro-batch
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


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------- workers
class WorkerGroup:
    """The ``world`` worker processes of one checkout for one layout (one per TP rank)."""

    def __init__(self, side: str, checkout: str, world: int, start: dict[str, Any], threads: int, tmpdir: str):
        self.side, self.checkout = side, checkout
        self.procs: list[subprocess.Popen[str]] = []
        self.logs: list[str] = []
        self.lines: list[queue.Queue[str | None]] = []
        init_file = os.path.join(tmpdir, f"{side}_store")
        env = {**os.environ, "PYTHONPATH": checkout, "OMP_NUM_THREADS": str(threads)}
        for rank in range(world):
            path = os.path.join(tmpdir, f"{side}_rank{rank}.pkl")
            with open(path, "wb") as f:
                pickle.dump({**start, "rank": rank, "world": world, "init_file": init_file, "threads": threads}, f)
            log = os.path.join(tmpdir, f"{side}_rank{rank}.log")
            self.logs.append(log)
            with open(log, "w") as err:
                proc = subprocess.Popen([sys.executable, "-c", _RUN_WORKER, _WORKER, path], cwd=checkout, env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
            lines: queue.Queue[str | None] = queue.Queue()
            threading.Thread(target=self._read, args=(proc.stdout, lines), daemon=True).start()
            self.procs.append(proc)
            self.lines.append(lines)

    @staticmethod
    def _read(stream: TextIO | None, lines: queue.Queue[str | None]) -> None:
        assert stream is not None
        for line in stream:
            if line.startswith(_REPLY):
                lines.put(line[len(_REPLY):])
        lines.put(None)  # the process closed its stdout (exited)

    def replies(self, timeout: float = 1800.0) -> list[dict[str, Any]]:
        """One reply per rank; a rank's error or death raises with its traceback / log tail."""
        out = []
        for rank, lines in enumerate(self.lines):
            try:
                line = lines.get(timeout=timeout)
            except queue.Empty:
                raise RuntimeError(f"{self.side} rank {rank} ({self.checkout}): no reply in {timeout:.0f}s") from None
            if line is None:
                with open(self.logs[rank]) as f:
                    tail = f.read()[-4000:]
                raise RuntimeError(f"{self.side} rank {rank} ({self.checkout}) exited; its stderr ends:\n{tail}")
            reply = json.loads(line)
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
            if proc.poll() is None and proc.stdin is not None:
                try:
                    proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                    proc.stdin.close()
                except OSError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
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


def policy_overrides(policy: str) -> list[str]:
    """The ``hybrid_zero_optimizer`` overrides of one optimizer precision policy (``precision_report.POLICIES``)."""
    from tessera.train.precision_report import POLICIES

    return [f"hybrid_zero_optimizer.{k}='{v}'" for k, v in POLICIES[policy].items()]


def variants(layout: str, dtypes: Sequence[str], plan: Plan, extra: Sequence[str],
             policies: Sequence[str] = ()) -> dict[str, tuple[str, list[str]]]:
    """Variant name -> (dtype, overrides): one per dtype, or one per dtype and optimizer policy."""
    if not policies:
        return {d: (d, variant_overrides(layout, d, plan, extra)) for d in dtypes}
    return {f"{d} {p}": (d, variant_overrides(layout, d, plan, [*policy_overrides(p), *extra]))
            for d in dtypes for p in policies}


def _peak_size(plan: Plan, device: str) -> int:
    return max(plan.peak_size, 8192) if device == "cuda" else plan.peak_size


def _peaks(dtypes: Sequence[str], threads: int, plan: Plan, device: str, clock: str) -> dict[str, float]:
    """Best TFLOP/s of one square matmul per dtype through the model's kernel choice
    (``tessera.parallel.lowp.linear``), timed with the workers' clock."""
    import torch

    from benchmarks.roofline_worker import CLOCKS
    from tessera.config.precision import apply_precision
    from tessera.parallel.lowp import linear

    torch.set_num_threads(threads)
    dev, size, now = torch.device(device), _peak_size(plan, device), CLOCKS[clock]
    g = torch.Generator(device=dev).manual_seed(0)
    out = {}
    for d in dtypes:
        apply_precision(DTYPES[d])  # fp32 means fp32, not TF32, on a GPU
        dt = torch.bfloat16 if d == "bf16" else torch.float32
        a, b = (torch.randn(size, size, device=dev, generator=g).to(dt) for _ in range(2))
        linear(a, b)
        best, deadline = 0.0, time.perf_counter() + plan.peak_seconds
        while time.perf_counter() < deadline:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = now()
            linear(a, b)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            best = max(best, 2 * size**3 / max(now() - t0, 1e-9) / 1e12)
        out[d] = best
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


def paired(a: list[float], b: list[float]) -> dict[str, float]:
    """Median, min and max over rounds of ``a[i] / b[i]`` (times taken in the same round)."""
    ratios = [x / y for x, y in zip(a, b)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "n": len(ratios)}


def measure_layout(layout: str, sides: dict[str, str], named: dict[str, list[str]], raw: dict[str, Any], source: str,
                   plan: Plan, threads: int, device: str, clock: str, tmpdir: str) -> dict[str, Any]:
    """Build every side's stacks for ``layout`` (one per variant of ``named``: name -> overrides), interleave
    their steps, decompose each; per side and variant."""
    world = LAYOUTS[layout][0]
    dtypes = list(named)
    start = {"raw": raw, "source": source, "device": device, "clock": clock, "variants": named}
    groups: dict[str, WorkerGroup] = {}
    try:
        for side, checkout in sides.items():
            groups[side] = WorkerGroup(f"{layout}_{side}", checkout, world, start, threads, tmpdir)
        info = {side: g.replies()[0] for side, g in groups.items()}
        for side, i in info.items():
            _log(f"  {layout} {side}: tessera from {i['tessera']}, stacks through {i['stacks'][dtypes[0]]['api']}")
        variants = [(side, d) for d in dtypes for side in sides]
        steps: dict[tuple[str, str], list[list[dict[str, Any]]]] = {v: [] for v in variants}
        first_loss = {}
        for side, d in variants:
            for _ in range(plan.warmup):
                r = groups[side].send(cmd="step", variant=d)
                first_loss.setdefault((side, d), r[0]["loss"])
        for r in range(plan.rounds):
            k = r % len(variants)
            for side, d in variants[k:] + variants[:k]:
                steps[(side, d)].append(groups[side].send(cmd="step", variant=d))
            _log(f"  {layout} round {r + 1}: " + ", ".join(
                f"{side} {d} {steps[(side, d)][-1][0]['step_s'] * 1e3:.0f} ms" for side, d in variants))
        out: dict[str, Any] = {}
        for side, d in variants:
            dec = groups[side].send(cmd="decompose", variant=d, recorded_steps=plan.recorded_steps,
                                    replays=plan.replays)
            summary = _summary(steps[(side, d)], dec[0])
            summary.update(first_loss=first_loss.get((side, d)), tokens=info[side]["stacks"][d]["tokens"],
                           api=info[side]["stacks"][d]["api"], decomposition=dec, steps=steps[(side, d)])
            out.setdefault(side, {})[d] = summary
        return out
    finally:
        for g in groups.values():
            g.close()


def _git(cwd: str, *args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def run(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """Measure every layout; a JSON-able dict (``to_markdown`` renders it)."""
    from benchmarks.runner import machine_info
    from tessera.config import Config, apply_overrides, load_python_file
    from tessera.model.flops import flops_per_token

    plan = PLANS["quick" if args.quick else "full"]
    if args.rounds is not None:
        plan = dataclasses.replace(plan, rounds=args.rounds)
    source = args.config if os.path.isabs(args.config) else os.path.join(_ROOT, args.config)
    raw = load_python_file(source)  # read once: every worker measures the same file contents
    sides = {"ours": _ROOT}
    if args.against:
        sides["against"] = os.path.abspath(args.against)
    result: dict[str, Any] = {
        "command": command, "quick": args.quick, "plan": plan.__dict__, "threads": args.threads, "clock": args.clock,
        "device": args.device, "peak_size": _peak_size(plan, args.device),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_info(), "config": args.config, "overrides": list(args.overrides),
        "commits": {side: (_git(path, "rev-parse", "--short", "HEAD") or "unknown")
                    + (" (modified)" if _git(path, "status", "--porcelain", "--untracked-files=no") else "")
                    for side, path in sides.items()},
        "against_path": sides.get("against"), "loadavg": [os.getloadavg()], "layouts": {},
        "policies": list(args.policies),
    }
    _log(f"roofline: {result['machine']['cpu']}, {args.threads} thread(s), commits {result['commits']}")
    fpt = {}  # model FLOPs per token from this checkout's closed form; building the configs checks the overrides
    named = {layout: variants(layout, args.dtypes, plan, args.overrides, args.policies) for layout in args.layouts}
    for layout in args.layouts:
        for name, (_, overrides) in named[layout].items():
            cfg_raw = copy.deepcopy(raw)
            apply_overrides(cfg_raw, overrides, source=source)
            cfg = Config.from_dict(cfg_raw, source=source)
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
            result["loadavg"].append(os.getloadavg())
            _log(f"[{time.perf_counter() - t0:.0f}s] {layout} done")
    peaks.append(_peaks(args.dtypes, args.threads, plan, args.device, args.clock))
    result["peaks_tflops"] = {d: max(p[d] for p in peaks) for d in args.dtypes}
    result["peaks_all"] = peaks
    for layout, res in result["layouts"].items():
        world = LAYOUTS[layout][0]
        for side in res:
            for name, s in res[side].items():
                job = statistics.median(s["job_times"])
                s["tflops"] = s["flops_per_token"] * s["tokens"] / job / 1e12
                s["mfu"] = s["tflops"] / (result["peaks_tflops"][s["dtype"]] * world)
                if side == "ours" and "against" in res:
                    s["vs_against"] = paired(s["job_times"], res["against"][name]["job_times"])
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
    m = result["machine"]
    flags = ", ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if m["flags"].get(f)) or "none"
    no_flags = ", ".join(f for f in ("avx2", "avx512_bf16", "amx_bf16") if not m["flags"].get(f))
    dtypes = list(result["peaks_tflops"])
    against = result["commits"].get("against")
    lines = [
        *(["**A `--quick` run (smaller batch, few rounds): a smoke result, not the figures to quote.**", ""]
          if result["quick"] else []),
        "```", result["command"], "```", "",
        f"Measured {result['date']} at commit {result['commits']['ours']}"
        + (f", against {against} (the checkout at `{result['against_path']}`) in the same run" if against else "")
        + f"; {m['cpu']} ({m['cores']} cores; flags: {flags}" + (f"; without {no_flags}" if no_flags else "")
        + f"), torch {m['torch']}, {result['threads']} thread(s) per process, device {result['device']}, "
          "1-minute load average " + " / ".join(f"{x[0]:.1f}" for x in result["loadavg"])
        + " (start / after each layout). Times are "
        + ("CPU seconds of each process, all its threads (`--clock cpu`: descheduling and blocking waits "
           "for the other rank left out). " if result["clock"] == "cpu" else "wall-clock. ")
        + f"Workload: `{result['config']}` with "
          f"`{' '.join(WORKLOAD + tuple(PLANS['quick'].extra if result['quick'] else ()))}`"
        + (f" and `{' '.join(result['overrides'])}`" if result["overrides"] else "") + ".",
        *_busy_warning(result),
        "",
        "Matmul peak (best square matmul through the model's kernel choice, "
        f"{result['peak_size']}^3, measured before each layout and after the last, the best kept): "
        + ", ".join(f"{d} {result['peaks_tflops'][d]:.3f} TFLOP/s" for d in dtypes) + " per process.",
        "",
        "How: GEMMs = every matmul operator of one real step (forward, backward, optimizer; recorded by a "
        "TorchDispatchMode) replayed alone in order on fresh tensors of the same shapes, strides and dtypes "
        "(the fastest of the replays); "
        "attention = the fused attention operators timed in place during that step; optimizer = "
        "`optimizer.step()` minus the collectives inside it; collectives = time inside torch.distributed calls; "
        "other = the step's median minus those (norms, rotary, SwiGLU, casts, copies, Python). TP=2: 2 gloo "
        "processes, rank 0's decomposition; MFU on the job's step (the slower rank) against 2x the peak.",
    ]
    return lines


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
                f"{ours[d]['vs_against']['median']:.2f}x [{ours[d]['vs_against']['min']:.2f}-"
                f"{ours[d]['vs_against']['max']:.2f}] | " for d in dtypes) + " |")
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
                row += (f" {v['median']:.2f}x [{v['min']:.2f}-{v['max']:.2f}] | "
                        f"{100 * a['parts']['optimizer'] / a['step_s']:.1f}% |")
            lines.append(row)
    return lines


def main(argv: Sequence[str] | None = None, prog: str = "python -m benchmarks roofline") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
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
    ap.add_argument("--out", default="BENCHMARKS.md",
                    help="file whose 'roofline' (with --policies: 'roofline-policies') section is replaced "
                         "('' = none)")
    ap.add_argument("--json", default=None, help="also write the raw results as JSON here")
    ap.add_argument("--render", default=None, metavar="JSON", help="write the section from a --json file, no measuring")
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
        if "--layouts" not in explicit:
            args.layouts = "tp1"
        if "--dtypes" not in explicit:
            args.dtypes = "bf16"
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
    command = " ".join([prog, *(shlex.quote(a) for a in argv)])
    from tessera.config import ConfigError

    try:
        if args.render:
            with open(args.render) as f:
                result = json.load(f)
        else:
            result = run(args, command)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    lines = to_markdown(result)
    print("\n".join(lines))
    if args.out:
        from benchmarks.cli import write_section

        section, title = (POLICY_SECTION, POLICY_TITLE) if result.get("policies") else (SECTION, TITLE)
        write_section(args.out, section, title, lines)
        _log(f"wrote the {section} section of {args.out}")
    if args.json and not args.render:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
