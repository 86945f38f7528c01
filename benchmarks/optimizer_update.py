"""The AdamW update alone, per precision policy, against another checkout's update in the same run.

One update of a flat shard (default 13.5M elements, about the roofline model of section 10), 1 thread,
each policy's ours / theirs interleaved and the median of the rounds kept. The other checkout's
``lowp_adamw`` is loaded from its file (``tessera/optim`` or, before the optimizer had its own package,
``tessera/train``); its fp32 masters ran through torch's own AdamW.step, so that row uses it.

    python -m benchmarks optimizer-update --against PATH [--numel N] [--rounds R] [--out BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from types import ModuleType
from typing import Any

import torch

from tessera.optim import lowp_adamw

HYPER = {"lr": 1e-3, "weight_decay": 0.1, "eps": 1e-8, "betas": (0.9, 0.95)}
POLICIES = [  # (masters, moments, compensation)
    (torch.float32, torch.float32, "none"), (torch.float32, torch.bfloat16, "none"),
    (torch.bfloat16, torch.float32, "none"), (torch.bfloat16, torch.float32, "kahan"),
    (torch.bfloat16, torch.float32, "stochastic"), (torch.bfloat16, torch.bfloat16, "stochastic"),
]


def _load_theirs(path: str) -> ModuleType:
    for rel in ("tessera/optim/lowp_adamw.py", "tessera/train/lowp_adamw.py"):
        file = os.path.join(path, rel)
        if os.path.exists(file):
            spec = importlib.util.spec_from_file_location("theirs_lowp_adamw", file)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
    raise SystemExit(f"error: --against {path}: no tessera/optim/lowp_adamw.py or tessera/train/lowp_adamw.py")


def _ours(n: int, grad: torch.Tensor, master: torch.dtype, state: torch.dtype, comp: str) -> Callable[[], None]:
    w, st = torch.randn(n).to(master), {}

    def noise(a: int, z: int) -> torch.Tensor:
        return lowp_adamw.element_noise(a, z, 123, 5, 0, "cpu")

    return lambda: lowp_adamw.adamw_step(w, grad, st, HYPER, compensation=comp, state_dtype=state, noise=noise)


def _theirs(mod: ModuleType, n: int, grad: torch.Tensor, master: torch.dtype, state: torch.dtype,
            comp: str) -> Callable[[], Any]:
    if master == torch.float32 and state == torch.float32:  # torch's AdamW.step on the fp32 master slice
        p = torch.nn.Parameter(torch.randn(n))
        p.grad = grad
        return torch.optim.AdamW([p], foreach=False, **HYPER).step
    w, st = torch.randn(n).to(master), {}
    if hasattr(mod, "CHUNK"):  # the chunked update: noise(start, stop)
        noise: Callable[..., torch.Tensor] = lambda a, z: mod.element_noise(a, z, 123, 5, 0, "cpu")  # noqa: E731
    else:  # the eager update drew the whole shard's noise at once
        noise = lambda: mod.element_noise(0, n, 123, 5, 0, "cpu")  # noqa: E731
    return lambda: mod.adamw_step(w, grad, st, HYPER, compensation=comp, state_dtype=state, noise=noise)


def _short(dtype: torch.dtype) -> str:
    return "fp32" if dtype == torch.float32 else "bf16"


def main(argv: Sequence[str] | None = None, prog: str = "python -m benchmarks optimizer-update") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog=prog, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", required=True, help="another checkout (e.g. a git worktree of fb20d6e)")
    ap.add_argument("--numel", type=int, default=13_500_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="BENCHMARKS.md",
                    help="file whose 'optimizer-update' section is replaced ('' = none)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    theirs = _load_theirs(args.against)
    grad = torch.randn(args.numel) * 1e-3
    rows = []
    for master, state, comp in POLICIES:
        ours = _ours(args.numel, grad, master, state, comp)
        base = _theirs(theirs, args.numel, grad, master, state, comp)
        ours(), base()  # first touch of the states
        t_ours, t_base = [], []
        for _ in range(args.rounds):
            for fn, out in ((ours, t_ours), (base, t_base)):
                start = time.perf_counter()
                fn()
                out.append(time.perf_counter() - start)
        mo, mb = statistics.median(t_ours) * 1e3, statistics.median(t_base) * 1e3
        rows.append(f"| {_short(master)} | {_short(state)} | {comp} | {mb:.1f} | {mo:.1f} | {mo / mb:.3f} |")
        print(rows[-1], file=sys.stderr, flush=True)
    from benchmarks.cli import write_section
    from benchmarks.runner import machine_info

    command = " ".join([prog, *(shlex.quote(a) for a in argv)])
    info = machine_info()
    lines = ["```", command, "```", "",
             f"Measured {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {info.get('cpu', 'cpu')}, "
             f"torch {torch.__version__}, 1 thread; one update of a {args.numel:,}-element flat shard, median of "
             f"{args.rounds} interleaved rounds. 'against' is the update of the checkout at `{args.against}`; its "
             "fp32 masters ran torch's AdamW.step.",
             "", "| masters | moments | compensation | against ms | ours ms | ours / against |",
             "|---|---|---|---:|---:|---:|", *rows]
    if args.out:
        write_section(args.out, "optimizer-update", "## 12. The optimizer update per precision policy, against a base",
                      lines)
    print("\n".join(lines))
    return 0
