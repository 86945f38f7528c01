"""One ``train.py`` run under torchrun, from scratch, and its per-step figures: what the whole-run benchmarks
(``precision-telemetry``, ``tensor-modes``) pair round by round."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# no checkpoints, no final sample, one validation batch: the loop is what these runs measure
FIXED = ["ckpt.enable_save_ckpt=False", "generate.max_new_tokens=0", "data.valid_micro_num=1",
         "metrics.progress_bar=False"]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_once(checkout: str, overrides: list[str], config: str, steps: int, run_dir: str) -> dict[str, Any]:
    """``checkout``'s train.py for ``steps`` steps; by step: the loop's wall ``time`` and the ``step_time``
    (seconds) of each ``train`` record of metrics.jsonl, and the steps with a ``precision`` record."""
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


def report(res: dict[str, Any], workdir: str, argv: Sequence[str] | None, prog: str, out: str, section: str,
           title: str, markdown: Callable[[dict[str, Any], str, str], list[str]]) -> None:
    """Save ``res`` as ``workdir/result.json``, print its markdown, write it as ``section`` of ``out`` ('': none)."""
    from benchmarks.cli import write_section
    from benchmarks.runner import machine_info

    with open(os.path.join(workdir, "result.json"), "w") as f:
        json.dump(res, f, indent=1)
    info = machine_info()
    machine = f"{info.get('cpu', 'CPU')}, {info.get('cores', '?')} cores, torch {info.get('torch')}"
    command = " ".join([prog, *(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))])
    lines = markdown(res, command, machine)
    print("\n".join(lines))
    if out:
        write_section(out, section, title, lines)
        log(f"wrote the {section} section of {out}")
