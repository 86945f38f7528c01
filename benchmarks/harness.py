"""The harness every benchmark runs on: interleaved rounds, paired ratios, the machine, the report.

Rounds: the machines this runs on are shared and noisy, so variants are never timed one after the
other. After its warm-up, each variant runs one step per round, in an order that rotates from round
to round (A B C, B C A, C A B, ...), and a ratio of two variants is the median over rounds of their
ratio *in the same round*, with the min-max over rounds beside it: a slow phase of the machine hits
both sides of a ratio alike. A step is whatever the benchmark times: a training step, one command to
worker processes, a whole ``train.py`` run.

Report: a benchmark's ``main`` parses its flags on ``parser`` (which adds ``--out``, ``--json`` and
``--render``) and hands ``publish`` one function measuring a JSON-able result and one rendering it as
markdown lines. ``publish`` adds the command, date, commit and machine to the result, prints the
markdown, saves the result (``--json``) and, only when ``--out`` names a file, replaces the benchmark's marked
section there (``<!-- section:NAME -->`` ... ``<!-- /section:NAME -->``), leaving the rest of the file as it
is. ``--out`` defaults to none, so a benchmark run never rewrites the published figures unless asked with
``--out BENCHMARKS.md``.
``--render`` prints the section again from a saved result (and writes it with ``--out``), without
measuring.

Also here, for the benchmarks that build tessera: configs by path and overrides, synthetic batches,
the training stack through ``build_training_stack``, and whole ``train.py`` runs under torchrun.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
PUBLISHED = "BENCHMARKS.md"  # the published figures: written only when ``--out`` names it
# the CPU flags that decide the bf16/fp16 kernels
FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------- rounds
@dataclass
class Variant:
    """A named step; ``before`` runs untimed before each step (a barrier, a precision's process-wide switches)."""

    name: str
    step: Callable[[], Any]
    before: Callable[[], Any] | None = None


@dataclass
class Series:
    """One variant's rounds: wall and CPU seconds of this process per step, the step's return values."""

    warmup: list[Any] = field(default_factory=list)  # what the warm-up steps returned
    warmup_wall: list[float] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    values: list[Any] = field(default_factory=list)

    def median(self, clock: str = "wall") -> float:
        return statistics.median(getattr(self, clock))


def interleave(variants: Sequence[Variant], rounds: int, *, warmup: int = 1, min_rounds: int | None = None,
               budget_s: float = 0.0, quiet: bool = False) -> dict[str, Series]:
    """``warmup`` steps of each variant in turn, then up to ``rounds`` rounds in rotated order; with
    ``min_rounds``, stop after that many once ``budget_s`` seconds of rounds have passed."""
    out = {v.name: Series() for v in variants}

    def run(v: Variant) -> tuple[float, float, Any]:
        if v.before is not None:
            v.before()
        c0, t0 = time.process_time(), time.perf_counter()
        value = v.step()
        return time.perf_counter() - t0, time.process_time() - c0, value

    for v in variants:
        for _ in range(warmup):
            wall, _, value = run(v)
            out[v.name].warmup_wall.append(wall)
            out[v.name].warmup.append(value)
    start, least = time.perf_counter(), rounds if min_rounds is None else min_rounds
    r = 0
    while r < rounds and (r < least or time.perf_counter() - start < budget_s):
        k = r % len(variants)
        for v in [*variants[k:], *variants[:k]]:
            wall, cpu, value = run(v)
            s = out[v.name]
            s.wall.append(wall)
            s.cpu.append(cpu)
            s.values.append(value)
        r += 1
        if not quiet:
            log(f"  round {r}: " + ", ".join(f"{n} {s.wall[-1]:.3f}s" for n, s in out.items()))
    return out


def slowest(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Per round, the slowest rank's time: a step of a job lasts as long as its slowest rank."""
    return [max(times) for times in zip(*per_rank)]


def paired(a: Sequence[float], b: Sequence[float]) -> dict[str, float]:
    """Median, min and max over rounds of ``a[i] / b[i]`` (two times taken in the same round)."""
    ratios = [x / y for x, y in zip(a, b)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "n": len(ratios)}


def ratio(p: dict[str, float], nd: int = 2, bold: bool = True) -> str:
    """A paired ratio as markdown: ``**0.98x** [0.91-1.05]``."""
    mid = f"{p['median']:.{nd}f}x"
    return f"{f'**{mid}**' if bold else mid} [{p['min']:.{nd}f}-{p['max']:.{nd}f}]"


# ---------------------------------------------------------------------------------------- the machine
def machine() -> dict[str, Any]:
    """CPU model, cores, the flags that decide bf16/fp16 kernels, torch, Python, CUDA device, load."""
    import torch

    model, flags = platform.processor() or "unknown CPU", set[str]()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model in ("unknown CPU", "x86_64", ""):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(), "flags": {f: f in flags for f in FLAGS}, "torch": torch.__version__,
            "python": platform.python_version(), "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "load": loadavg()}


def machine_line(m: dict[str, Any]) -> str:
    """``AMD EPYC (2 cores; avx2, avx512f, avx512_bf16; no amx_bf16), torch 2.13.0+cpu``."""
    shown = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
    has = [f for f in shown if m["flags"].get(f)]
    lacks = [f for f in shown if not m["flags"].get(f)]
    return (f"{m['cpu']} ({m['cores']} cores; {', '.join(has) or 'no AVX2'}"
            + (f"; no {', '.join(lacks)}" if lacks and has else "") + f"), torch {m['torch']}"
            + (f", {m['cuda']}" if m.get("cuda") else ""))


def loadavg() -> float:
    """The 1-minute load average (NaN where the OS has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return float("nan")


def commit(path: str = ROOT) -> str:
    """The checkout's short commit, `` (modified)`` when tracked files differ from it."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=path, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return (git("rev-parse", "--short", "HEAD") or "unknown") + (
        " (modified)" if git("status", "--porcelain", "--untracked-files=no") else "")


# ---------------------------------------------------------------------------------------- the report
def parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """An argument parser with the report's flags (``--out``, ``--json``, ``--render``)."""
    ap = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    ap.add_argument("--out", default="", metavar="FILE",
                    help=f"also replace this benchmark's section of FILE (default: none, the report is only "
                         f"printed; --out {PUBLISHED} updates the published figures)")
    ap.add_argument("--json", default=None, help="also write the raw result as JSON here")
    ap.add_argument("--render", default=None, metavar="JSON",
                    help="print the section from a saved --json result (and write it with --out), without measuring")
    return ap


def command(prog: str, argv: Sequence[str] | None) -> str:
    return " ".join([prog, *(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))])


def provenance(res: dict[str, Any]) -> str:
    """Where a result comes from: its command, date, commit and machine."""
    return (f"`{res['command']}` on {res['date']} at commit {res['commit']}; {machine_line(res['machine'])}, "
            f"1-minute load average {res['machine']['load']} at the start, {res.get('load_end', '?')} at the end")


def publish(args: argparse.Namespace, argv: Sequence[str] | None, prog: str, section: str, title: str,
            measure: Callable[[], dict[str, Any]], markdown: Callable[[dict[str, Any]], list[str]]) -> int:
    """Measure (or load ``--render``), print the markdown, save the result, write the section; the exit status."""
    from tessera.config import ConfigError

    if args.render:
        with open(args.render) as f:
            result = json.load(f)
    else:
        result = {"command": command(prog, argv), "commit": commit(), "machine": machine(),
                  "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
        try:  # a bad config path or key=value override surfaces when the benchmark loads it
            result.update(measure())
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        result["load_end"] = loadavg()
    lines = markdown(result)
    print("\n".join(lines))
    if args.json and not args.render:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.out:
        write_section(args.out, section, title, lines)
        log(f"wrote the {section} section of {args.out}")
    return 0


def _marks(name: str) -> tuple[str, str]:
    return f"<!-- section:{name} -->", f"<!-- /section:{name} -->"


def write_section(path: str, name: str, title: str, lines: list[str]) -> None:
    """Replace section ``name`` of ``path`` (append it when absent), leaving the rest of the file as it is."""
    start, end = _marks(name)
    block = "\n".join([start, title, "", *lines, end])
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        text = ""
    if start in text and end in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + ("\n\n" if text.strip() else "") + block + "\n"
    with open(path, "w") as f:
        f.write(text)


# ---------------------------------------------------------------------------------------- tessera
def config_path(path: str) -> str:
    """Config paths are relative to the repository root, wherever the benchmark is started from."""
    return path if os.path.isabs(path) or os.path.exists(path) else os.path.join(ROOT, path)


def load_config(path: str, overrides: Sequence[str]) -> Any:
    from tessera.config import Config

    return Config.from_file(config_path(path), list(overrides))


def batches(cfg: Any, dp_rank: int = 0, dp_size: int = 1) -> list[Any]:
    """One optimizer step's micro-batches of ``cfg``'s data (synthetic rows in the benchmarks)."""
    from tessera.data import build_data

    data = build_data(cfg.data, vocab_size=cfg.model.vocab_size, max_seq_len=cfg.model.max_position_embeddings,
                      dp_rank=dp_rank, dp_size=dp_size, seed=cfg.seed)
    return data.train.next_step_batches()


def build(cfg: Any, device: str = "cpu", **groups: Any) -> Any:
    """train.py's stack (``build_training_stack``) over ``groups`` (``tp``, ``dp``, ``zero1``, ``world``; default
    none), without the buffer sync a benchmark does not need; the precision's process-wide switches set."""
    from tessera.core.job import Job, JobGroups
    from tessera.train.builder import build_training_stack

    job = Job.of(cfg, JobGroups(**groups), device=device)
    job.precision.apply()
    return build_training_stack(cfg, job, sync_buffer=False)


# no checkpoints, no final sample, one validation batch: the training loop is what such a run measures
LOOP_ONLY = ("ckpt.enable_save_ckpt=False", "generate.max_new_tokens=0", "data.valid_micro_num=1",
             "metrics.progress_bar=False")


def train_run(checkout: str, config: str, overrides: Sequence[str], run_dir: str,
              cache_folder: str | None = None) -> list[dict[str, Any]]:
    """``checkout``'s train.py under torchrun (the config's TP size in processes), from scratch in ``run_dir``;
    the records of its metrics.jsonl. ``cache_folder``: the run's ``data.cache_folder`` (default: the repository's
    ``data_cache``, shared by every run so the stdlib corpus is tokenized once)."""
    config = config_path(config)
    nproc = load_config(config, overrides).parallel.tensor.size
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    cache_folder = cache_folder or os.path.join(ROOT, "data_cache")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(checkout, "train.py"), "--config", config, *overrides,
           f"data.cache_folder='{cache_folder}'", f"ckpt.save_ckpt_folder='{run_dir}/ckpt'",
           f"log_folder='{run_dir}'", "job_name='run'"]
    with open(os.path.join(run_dir, "stdout.log"), "w") as out:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=checkout)).returncode
    if rc:
        raise RuntimeError(f"train.py exited {rc}: {shlex.join(cmd)}; see {run_dir}/stdout.log")
    with open(os.path.join(run_dir, "run", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]
