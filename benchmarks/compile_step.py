"""Training step with compiled decoder blocks (``model.compile``) against the same stack run eagerly.

    python -m benchmarks compile                       # the issue's hidden-512 config, TP=1, bf16 and fp32
    python -m benchmarks compile --tp 2 --demo         # configs/demo.py as is (TP=2, bf16) on 2 processes
    python -m benchmarks compile --steps 4 model.num_layers=2   # a quick look

Both stacks are built by ``build_training_stack`` from the same config (``model.compile.enabled`` False /
True) and step on the same batch, interleaved (eager, compiled, eager, ...), one torch thread per
process. Reported: the first two steps of each (the compiled stack's second step compiles: its first runs
eagerly), and the median and minimum of the following ones. At TP=2 the node-local shared-memory
all-reduce is used where train.py would use it (``dist.cpu_shm_allreduce='auto'``). Set
``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1`` to see a cold compile (inductor caches compiled graphs on disk).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from tessera.cli_args import positive_int

ISSUE_512 = ["model.hidden_size=512", "model.num_layers=4", "model.num_attention_heads=8",
             "model.num_kv_attention_heads=8", "data.seq_len=256", "data.micro_bsz=8", "data.type='synthetic'",
             "data.pack_sample_into_one=True", "parallel.tensor.size=1"]


def _config(overrides: list[str], compiled: bool) -> Any:
    from tessera.config import Config
    from tessera.config.loading import apply_overrides, load_python_file

    raw = load_python_file("configs/demo.py")
    apply_overrides(raw, [*overrides, f"model.compile.enabled={compiled}"], source="configs/demo.py")
    return Config.from_dict(raw, source="configs/demo.py")


def measure(overrides: list[str], steps: int, group: Any = None) -> dict[str, Any]:
    """Eager and compiled stacks of one config, interleaved; times in seconds."""
    import torch
    import torch.distributed as dist

    from tessera.config.precision import apply_precision
    from tessera.data import build_data
    from tessera.train.builder import Groups, build_training_stack

    torch.set_num_threads(1)
    cfg = _config(overrides, False)
    apply_precision(cfg.model.dtype)
    batches = build_data(cfg.data, vocab_size=cfg.model.vocab_size, max_seq_len=cfg.model.max_position_embeddings,
                         dp_rank=0, dp_size=1, seed=cfg.seed).train.next_step_batches()
    stacks = {name: build_training_stack(_config(overrides, on), Groups(tp=group), device="cpu", sync_buffer=False)
              for name, on in (("eager", False), ("compiled", True))}
    first: dict[str, list[float]] = {name: [] for name in stacks}
    times: dict[str, list[float]] = {name: [] for name in stacks}
    for i in range(2 + steps):
        for name, stack in stacks.items():
            if group is not None:
                dist.barrier(group)
            start = time.perf_counter()
            stack.trainer.train_step(batches)
            (first if i < 2 else times)[name].append(time.perf_counter() - start)
    return {"first": first, "median": {k: statistics.median(v) for k, v in times.items()},
            "min": {k: min(v) for k, v in times.items()}}


def _tp2_worker(rank: int, world: int, overrides: list[str], steps: int) -> dict[str, Any]:
    import torch.distributed as dist

    from tessera.parallel.comm import use_fast_collectives
    from tessera.parallel.shm_comm import ShmCollectives, shm_unavailable_reason

    group = dist.new_group(list(range(world)))
    route = None
    if shm_unavailable_reason(world) is None:
        route, _ = ShmCollectives.create(group)
        use_fast_collectives(group, route)
    try:
        out = measure(overrides, steps, group)
    finally:
        if route is not None:
            use_fast_collectives(group, None)
            route.close()
    out["route"] = "shared memory" if route is not None else "gloo"
    return out


def _row(label: str, r: dict[str, Any]) -> str:
    e, c = r["median"]["eager"], r["median"]["compiled"]
    return (f"| {label} | {1000 * e:.0f} | {1000 * c:.0f} | **{c / e:.3f}** | "
            f"{' / '.join(f'{t:.2f}' for t in r['first']['eager'])} | "
            f"{' / '.join(f'{t:.2f}' for t in r['first']['compiled'])} |")


def main(argv: Sequence[str] | None = None, prog: str = "python -m benchmarks compile") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, choices=[1, 2], default=1)
    ap.add_argument("--demo", action="store_true", help="configs/demo.py's own dims (default: the hidden-512 config)")
    ap.add_argument("--steps", type=positive_int, default=10, help="timed steps of each stack after two untimed")
    ap.add_argument("--dtype", action="append", default=None, help="model.dtype (repeatable; default bf16 and fp32, "
                                                                   "with --demo the config's)")
    ap.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    args = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    base = ["data.type='synthetic'"] if args.demo else list(ISSUE_512)
    base.append(f"parallel.tensor.size={args.tp}")
    dtypes = args.dtype or ([None] if args.demo else ["torch.bfloat16", "torch.float32"])
    print(f"`{prog} {' '.join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))}`\n")
    print("| config | eager step ms | compiled step ms | compiled / eager | eager steps 1 / 2 s "
          "| compiled steps 1 / 2 s (2: compile) |")
    print("|---|---|---|---|---|---|")
    for dtype in dtypes:
        overrides = base + ([f"model.dtype='{dtype}'"] if dtype else []) + list(args.overrides)
        if args.tp == 1:
            result = measure(overrides, args.steps)
        else:
            from harness.distributed import run_distributed

            result = run_distributed(_tp2_worker, 2, overrides, args.steps, timeout=1800.0)[0]
        label = (f"{'demo' if args.demo else 'hidden 512'}{' + overrides' if args.overrides else ''}, TP={args.tp}, "
                 f"{dtype or 'config dtype'}")
        print(_row(label, result), flush=True)
    return 0
