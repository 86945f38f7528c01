"""GPU acceptance: check tessera's CUDA path end to end on one GPU and print a report for BENCHMARKS.md.

    python -m tools.gpu_acceptance [--config configs/1B.py] [--steps 20] [--out report.md] [key.sub=value ...]

Each part runs in its own process, in this order:

1. the CUDA tests, ``python -m pytest -m cuda`` (skipped on CPU-only machines): flash_attn's varlen kernel
   against SDPA on packed rows (when flash_attn is installed), the memory check's prediction against the
   allocator's peak of a real step, the matmul probe against the datasheet, packed documents on CUDA;
2. ``train.py`` on this GPU (torchrun, one process, synthetic data) in bf16, fp16, tf32 and fp32 (the last
   two over a third of the steps: an fp32 step is several times a bf16 one): it must exit 0, its loss must
   stay finite and fall, and fp16's loss scaler must not skip half the steps;
3. the memory check's prediction for the bf16 run (``tessera.train.memory_check``, with this machine's
   flash_attn) beside the run's real peak (``torch.cuda.max_memory_allocated``, in metrics.jsonl), which
   must be within [0.95, 1.05] of it; when it is not, ``tools/memory_phases.py`` measures the run's state,
   forward, backward and optimizer step one by one beside the check's parts, to show which one misses;
4. the runs' MFU against the device's peak (the table row of its exact name, or the measured probe),
   and the bf16 matmul probe beside the table row;
5. the peer comparison, ``python -m benchmarks gpu-peers`` (tessera eager and compiled, compiled with one
   document a row and compiled without the weight-gradient fusion, against Hugging Face ``LlamaForCausalLM``
   eager and compiled; 3 interleaved rounds): its table is printed, tessera compiled must reach
   ``--peer-target`` times HF compiled's tokens/s and ``--mfu-target`` of the datasheet, packed rows may
   cost at most 3% more than one document a row, and the fusion's effect on the step time is reported.

The whole report is meant to take under 5 minutes (``--budget``): each part gets what is left of it.
``--benchmarks BENCHMARKS.md`` writes the report and the peer table into their sections of that file.

``key.sub=value`` overrides go to the training runs (and the prediction). The exit status is 0 when
every check passed, 1 otherwise, 2 without a CUDA device.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from typing import Any

from tessera.cli_args import positive_float, positive_int, probability

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Check:
    name: str
    ok: bool | None  # None: skipped
    detail: str
    figure: bool = False  # a measured figure without a verdict (ok is True when it was measured)


def run(cmd: list[str], timeout: float) -> tuple[int, str]:
    """Exit status and combined output of ``cmd`` in the repository root (124 on a time-out)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout if isinstance(e.stdout, str) else (e.stdout or b"").decode(errors="replace")
        return 124, out + f"\n(timed out after {timeout:.0f} s)"
    return proc.returncode, proc.stdout + proc.stderr


def parse_junit(path: str) -> list[Check]:
    """One Check per test case of a pytest JUnit XML report (skips carry their reason)."""
    checks = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        failed = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        if failed is not None:
            checks.append(Check(name, False, " ".join((failed.get("message") or "").split())[:300]))
        elif skipped is not None:
            checks.append(Check(name, None, " ".join((skipped.get("message") or "").split())[:300]))
        else:
            checks.append(Check(name, True, f"{float(case.get('time', 0)):.1f} s"))
    return checks


def cuda_tests(out_dir: str, timeout: float) -> list[Check]:
    junit = os.path.join(out_dir, "cuda_tests.xml")
    rc, out = run([sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-rs", "-s", "-p", "no:cacheprovider",
                   f"--junitxml={junit}"], timeout)
    if not os.path.exists(junit):
        return [Check("pytest -m cuda", False, f"exit {rc}: {out[-500:]}")]
    cases = parse_junit(junit)
    passed, skipped = sum(c.ok is True for c in cases), sum(c.ok is None for c in cases)
    summary = Check("pytest -m cuda", rc == 0 and passed > 0,
                    f"exit {rc}: {passed} passed, {skipped} skipped, {len(cases) - passed - skipped} failed")
    printed = [line for line in out.splitlines() if line.startswith(("predicted ", "NVIDIA", "Tesla"))]
    if printed:
        summary.detail += " (" + "; ".join(printed) + ")"
    return [summary, *cases]


def run_overrides(dtype: str, steps: int, log_folder: str, job: str) -> list[str]:
    """train.py overrides of an acceptance run: synthetic data, ``steps`` steps, no checkpoint, no sample."""
    return ["data.type='synthetic'", f"model.dtype='{dtype}'", f"data.total_steps={steps}", "data.valid_every=0",
            "metrics.progress_bar=False", "metrics.tensorboard=False", f"log_folder='{log_folder}'",
            f"job_name='{job}'", "ckpt.enable_save_ckpt=False", "ckpt.auto_resume=False",
            "generate.max_new_tokens=0"]


def train_run(config: str, dtype: str, steps: int, overrides: list[str], out_dir: str,
              timeout: float) -> tuple[int, str, str]:
    """Run train.py under torchrun with one process; (exit status, output, path of its metrics.jsonl)."""
    log_folder = os.path.join(out_dir, "runs")
    job = f"acceptance-{dtype}"
    rc, out = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                   os.path.join(ROOT, "train.py"), "--config", config,
                   *run_overrides(dtype, steps, log_folder, job), *overrides], timeout)
    return rc, out, os.path.join(log_folder, job, "metrics.jsonl")


def summarize_run(metrics_path: str) -> dict[str, Any]:
    """The figures of a run's metrics.jsonl that the report uses."""
    train, peak_event = [], None
    with open(metrics_path) as f:
        for line in f:
            record = json.loads(line)
            if record.get("kind") == "train":
                train.append(record)
            elif record.get("kind") == "event" and "peak_tflops" in record:
                peak_event = record
    late = train[len(train) // 2:] or train
    return {
        "steps": len(train), "losses": [r["loss"] for r in train],
        "skipped": train[-1]["skipped_steps"] if train else 0,
        "mfu": statistics.median(r["mfu"] for r in late) if late else float("nan"),
        "tflops": statistics.median(r["tflops"] for r in late) if late else float("nan"),
        "step_time": statistics.median(r["step_time"] for r in late) if late else float("nan"),
        "tgs": statistics.median(r["tgs"] for r in late) if late else float("nan"),
        "peak_mem_gib": max((r["peak_mem_gib"] for r in train), default=float("nan")),
        "peak_source": peak_event["message"] if peak_event else "",
    }


def judge_run(name: str, rc: int, out: str, summary: dict[str, Any] | None, steps: int) -> Check:
    """A training run passes when it exits 0 after ``steps`` steps with finite losses whose last three
    average below the first three, and skipped under half its steps."""
    if rc != 0 or summary is None:
        tail = " | ".join(line for line in out.splitlines()[-6:] if line.strip())
        return Check(name, False, f"exit {rc}: {tail[-600:]}")
    losses = summary["losses"]
    if summary["steps"] != steps or not all(math.isfinite(x) for x in losses):
        return Check(name, False, f"{summary['steps']} of {steps} steps logged, losses {losses}")
    first, last = statistics.mean(losses[:3]), statistics.mean(losses[-3:])
    ok = last < first and summary["skipped"] < steps / 2
    return Check(name, ok, f"loss {first:.3f} -> {last:.3f} (mean of first / last 3 steps), {summary['skipped']} "
                           f"skipped; median step {summary['step_time']:.3f} s, {summary['tgs']:,.0f} tokens/s, "
                           f"{summary['tflops']:.1f} TFLOP/s, MFU {summary['mfu']:.1%}; {summary['peak_source']}")


MEMORY_BAND = (0.95, 1.05)  # the real peak over the prediction: it must neither undercount nor waste the GPU


def memory_check_vs_peak(config: str, overrides: list[str], measured_gib: float) -> Check:
    """The check's planned need for the run (one rank, CUDA, this machine's flash_attn) beside the
    allocator's peak: within ``MEMORY_BAND`` of the prediction passes. Undercounting admits runs that run out
    of memory; overcounting refuses layouts that fit."""
    from tessera.config import Config
    from tessera.memory.estimate import plan_persistent_state

    cfg = Config.from_file(config, overrides)
    plan = plan_persistent_state(cfg, 1, 1, 1, device_type="cuda")
    predicted = plan.need / 2**30
    ratio = measured_gib / predicted
    low, high = MEMORY_BAND
    return Check(f"memory check vs real peak (bf16 run), within [{low}, {high}]", low <= ratio <= high,
                 f"predicted {predicted:.2f} GiB (state {plan.bytes_per_rank / 2**30:.2f} + activations "
                 f"{plan.activation_bytes / 2**30:.2f} + SDPA extras {plan.attention_bytes / 2**30:.2f} + "
                 f"workspaces {plan.runtime_bytes / 2**30:.2f}), torch.cuda.max_memory_allocated "
                 f"{measured_gib:.2f} GiB: {ratio:.2f} of the prediction")


def memory_phases(config: str, overrides: list[str], out_dir: str, timeout: float) -> Check:
    """``tools/memory_phases.py`` on the bf16 run's config: which part of the prediction misses (run when the
    memory check fails, so a failing report carries what calibrating the check needs)."""
    name = "memory phases (bf16): measured / check per part"
    result = os.path.join(out_dir, "phases.json")
    rc, out = run([sys.executable, os.path.join(ROOT, "tools", "memory_phases.py"), "--config", config,
                   "--json", result, *overrides], timeout)
    if rc != 0 or not os.path.exists(result):
        return Check(name, False, f"memory_phases exited {rc}: {out.strip().splitlines()[-1:] or ['no output']}")
    print("\n".join(line for line in out.splitlines() if line.startswith("|")), flush=True)
    with open(result) as f:
        rows = json.load(f)["rows"]
    parts = [f"{r['part'].split(':')[0].split(' (')[0]} {r['measured'] / 2**30:.2f} GiB"
             + (f" ({r['measured'] / r['check']:.2f})" if r["check"] else "") for r in rows]
    return Check(name, True, "; ".join(parts))


def probe_vs_table() -> Check:
    import torch

    from tessera.train.metrics import gpu_peak_tflops, measure_matmul_tflops

    name = torch.cuda.get_device_name()
    measured = measure_matmul_tflops(torch.bfloat16, torch.device("cuda"), seconds=2.0)
    sheet = gpu_peak_tflops(name, "bfloat16")
    if sheet is None:
        return Check("bf16 matmul probe", True, f"{measured:.0f} TFLOP/s ({name} has no table row: train.py uses "
                                                "this probe as its MFU peak)")
    ratio = measured / sheet
    return Check("bf16 matmul probe vs datasheet", 0.4 <= ratio <= 1.02,
                 f"{measured:.0f} TFLOP/s = {ratio:.0%} of the table's {sheet:.0f} for {name}")


def environment() -> str:
    import torch

    name = torch.cuda.get_device_name()
    major, minor = torch.cuda.get_device_capability()
    try:
        import flash_attn

        flash = f"flash_attn {getattr(flash_attn, '__version__', '?')}"
    except (ImportError, OSError) as e:  # not installed, or built for another torch/CUDA (undefined symbols)
        flash = f"no flash_attn ({type(e).__name__}: {str(e)[:80]})"
    return (f"{name} (sm {major}.{minor}, {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB), "
            f"torch {torch.__version__}, CUDA {torch.version.cuda}, {flash}")


def to_markdown(env: str, checks: list[Check], command: str) -> str:
    mark = {True: "pass", False: "FAIL", None: "skipped"}
    lines = [f"GPU acceptance, {time.strftime('%Y-%m-%d')}: {env}", "", f"`{command}`", "",
             "| check | result | details |", "|---|---|---|"]
    lines += [f"| {c.name} | {'figure' if c.figure and c.ok else mark[c.ok]} | {c.detail.replace('|', '/')} |"
              for c in checks]
    return "\n".join(lines)


DTYPES = ("bf16", "fp16", "tf32", "fp32")
ACCEPTANCE_TITLE = "## 18. GPU acceptance: tools/gpu_acceptance.py"


def steps_for(dtype: str, steps: int) -> int:
    """Steps of a run: ``steps`` in bf16/fp16, a third of them (at least 6) in tf32/fp32, whose steps are longer."""
    return steps if dtype in ("bf16", "fp16") else max(6, steps // 3)


ALL_PEERS_GIB = 120  # the six variants of configs/1B.py at once need about 110 GiB (an H200 holds them)


def peer_variants() -> list[str]:
    """Every gpu-peers variant where the GPU holds them all at once, else the three the checks need (tessera
    compiled, HF compiled, one document a row; about 70 GiB at configs/1B.py): the eager variants and the
    fusion-off one are left out, and the report says so."""
    import torch

    from benchmarks.gpu_peers import ONE_DOC, VARIANTS

    if torch.cuda.get_device_properties(0).total_memory / 2**30 >= ALL_PEERS_GIB:
        return list(VARIANTS)
    print(f"gpu-peers: {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB GPU: tessera compiled, "
          f"hf compiled and {ONE_DOC} only (the six variants need about {ALL_PEERS_GIB} GiB)", flush=True)
    return ["tessera compiled", "hf compiled", ONE_DOC]


def peers(config: str, overrides: list[str], target: float, mfu_target: float, out_dir: str, timeout: float,
          benchmarks: str | None = None) -> list[Check]:
    """``python -m benchmarks gpu-peers`` (3 rounds, every variant; its section written into ``benchmarks``):
    its table, and the checks read from it (``judge_peers``)."""
    name = f"tessera compiled / HF compiled tokens/s >= {target:g}"
    result = os.path.join(out_dir, "peers.json")
    rc, out = run([sys.executable, "-m", "benchmarks", "gpu-peers", "--config", config, "--rounds", "3",
                   "--only", ",".join(peer_variants()), "--out", benchmarks or "", "--json", result, *overrides],
                  timeout)
    if rc != 0 or not os.path.exists(result):
        return [Check(name, False, f"gpu-peers exited {rc}: {out.strip().splitlines()[-1:] or ['no output']}")]
    print("\n".join(line for line in out.splitlines() if line.startswith("|")), flush=True)
    with open(result) as f:
        return judge_peers(json.load(f), target, mfu_target)


def _paired(slow: list[float], fast: list[float]) -> tuple[float, float, float]:
    """Median, min and max of slow/fast step-time ratios paired by round."""
    ratios = sorted(a / b for a, b in zip(slow, fast))
    return statistics.median(ratios), ratios[0], ratios[-1]


PACKED_MARGIN = 1.03  # packed rows may cost at most 3% more than one document a row


def judge_peers(res: dict[str, Any], target: float, mfu_target: float) -> list[Check]:
    """From gpu-peers' result: tessera compiled against HF compiled (tokens/s, ``target``), its MFU against the
    datasheet (``mfu_target``), packed rows against one document a row (``PACKED_MARGIN``), and the step time
    without the weight-gradient fusion (a figure)."""
    wall = res["wall"]
    ours = wall["tessera compiled"]
    ratio, low, high = _paired(wall["hf compiled"], ours)
    checks = [Check(f"tessera compiled / HF compiled tokens/s >= {target:g}", ratio >= target,
                    f"{ratio:.2f}x (paired by round, {low:.2f}-{high:.2f})")]
    step = statistics.median(ours)
    tflops = res["tokens"] / step * res["flops_per_token"] / 1e12
    name = f"tessera compiled MFU >= {mfu_target:.0%} of the datasheet"
    if res.get("peak_tflops"):
        mfu = tflops / res["peak_tflops"]
        checks.append(Check(name, mfu >= mfu_target, f"{mfu:.1%} ({tflops:.0f} of {res['peak_tflops']:.0f} TFLOP/s, "
                                                      f"median step {step:.3f} s)"))
    else:
        checks.append(Check(name, None, f"no datasheet row for {res['device']} ({tflops:.0f} TFLOP/s)"))
    one_doc = "tessera compiled (one document a row)"
    if one_doc in wall:
        ratio, low, high = _paired(ours, wall[one_doc])
        checks.append(Check(f"packed rows within {PACKED_MARGIN - 1:.0%} of one document a row (step time)",
                            ratio <= PACKED_MARGIN, f"{ratio:.3f}x ({low:.3f}-{high:.3f}, paired by round)"))
    off = "tessera compiled (fusion off)"
    if off in wall:
        ratio, low, high = _paired(wall[off], ours)
        checks.append(Check("step time with the weight-gradient fusion off / on", True,
                            f"{ratio:.3f}x ({low:.3f}-{high:.3f}, paired by round)", figure=True))
    return checks


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "1B.py"), help="config of the training runs")
    p.add_argument("--steps", type=positive_int, default=20, help="steps of each training run (default 20)")
    p.add_argument("--out", default=None, help="also write the report (markdown) here")
    p.add_argument("--skip-tests", action="store_true", help="leave out pytest -m cuda")
    p.add_argument("--timeout", type=positive_int, default=1200, help="seconds allowed to each part at most")
    p.add_argument("--budget", type=positive_int, default=290, help="seconds for the whole report (default 290)")
    p.add_argument("--skip-peers", action="store_true", help="leave out the peer comparison")
    p.add_argument("--peer-target", type=positive_float, default=1.25,
                   help="tessera compiled / HF compiled tokens/s to pass (default 1.25)")
    p.add_argument("--mfu-target", type=probability, default=0.55,
                   help="tessera compiled's MFU against the datasheet to pass (default 0.55)")
    p.add_argument("--benchmarks", default=None, metavar="BENCHMARKS.md",
                   help="write the report and the peer table into their sections of this file")
    p.add_argument("overrides", nargs="*", help="key.sub=value pairs for the training runs")
    args = p.parse_intermixed_args(argv)
    if importlib.util.find_spec("benchmarks") is None:  # run as a file: tools/ on the path
        print("error: benchmarks/ is not importable: run this tool from the repository root as "
              "python -m tools.gpu_acceptance", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("error: tools/gpu_acceptance.py needs a CUDA device (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    env = environment()
    print(env, flush=True)
    checks: list[Check] = []
    deadline = time.monotonic() + args.budget

    def left() -> float:  # a part's time-out: what is left of the budget, at least a minute
        return max(60.0, min(float(args.timeout), deadline - time.monotonic()))

    with tempfile.TemporaryDirectory(prefix="tessera-gpu-acceptance-") as out_dir:
        if not args.skip_tests:
            checks += cuda_tests(out_dir, left())
            print(f"{checks[0].name}: {checks[0].detail}", flush=True)
        bf16_peak = None
        for dtype in DTYPES:
            steps = steps_for(dtype, args.steps)
            rc, out, metrics = train_run(args.config, dtype, steps, args.overrides, out_dir, left())
            summary = summarize_run(metrics) if rc == 0 and os.path.exists(metrics) else None
            checks.append(judge_run(f"train.py {dtype}, {steps} steps", rc, out, summary, steps))
            print(f"{checks[-1].name}: {checks[-1].detail}", flush=True)
            if dtype == "bf16" and summary is not None:
                bf16_peak = summary["peak_mem_gib"]
                run_cfg = run_overrides(dtype, steps, out_dir, "x") + args.overrides
                checks.append(memory_check_vs_peak(args.config, run_cfg, bf16_peak))
                if checks[-1].ok is False:  # where the prediction misses, part by part
                    checks.append(memory_phases(args.config, run_cfg, out_dir, left()))
        if bf16_peak is None:
            checks.append(Check("memory check vs real peak (bf16 run)", False, "the bf16 run did not finish"))
        checks.append(probe_vs_table())
        if not args.skip_peers:
            found = peers(args.config, args.overrides, args.peer_target, args.mfu_target, out_dir, left(),
                          args.benchmarks)
            checks += found
            for c in found:
                print(f"{c.name}: {c.detail}", flush=True)
    print(f"took {args.budget - (deadline - time.monotonic()):.0f} s of a {args.budget} s budget", flush=True)
    command = "python -m tools.gpu_acceptance " + " ".join(argv if argv is not None else sys.argv[1:])
    report = to_markdown(env, checks, command.strip())
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report + "\n")
    if args.benchmarks:
        from benchmarks.harness import write_section

        write_section(args.benchmarks, "gpu-acceptance", ACCEPTANCE_TITLE, report.splitlines())
    return 0 if all(c.ok is not False for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
