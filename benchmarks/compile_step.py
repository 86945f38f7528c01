"""Training step with compiled decoder blocks (``model.compile``) against the same stack run eagerly.

    python -m benchmarks compile                       # the hidden-512 workload, TP=1, bf16 and fp32
    python -m benchmarks compile --tp 2 --demo         # configs/demo.py as is (TP=2, bf16) on 2 processes
    python -m benchmarks compile --steps 4 --out '' model.num_layers=2   # a quick look

Both stacks are built by ``build_training_stack`` from the same config (``model.compile.enabled`` False /
True) and step on the same batch in interleaved rounds, one torch thread per process. Reported: the
two warm-up steps of each (the compiled stack's second step compiles: its first runs eagerly), and the
median of the rounds after them, the slower rank per round. At TP=2 the node-local shared-memory route
is used where train.py would use it. ``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1`` shows a cold compile
(inductor caches compiled graphs on disk).
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Sequence
from typing import Any

from benchmarks import harness
from tessera.cli_args import positive_int

TITLE = "## 11. Compiled blocks (`model.compile`) vs eager"
# configs/demo.py's recipe at hidden 512, 4 layers, 8 heads, 8 rows x 256 tokens (the roofline's workload)
HIDDEN_512 = ["model.hidden_size=512", "model.num_layers=4", "model.num_attention_heads=8",
              "model.num_kv_attention_heads=8", "data.seq_len=256", "data.micro_bsz=8", "data.type='synthetic'",
              "data.pack_sample_into_one=True"]


def measure(overrides: list[str], steps: int, group: Any = None) -> dict[str, Any]:
    """Eager and compiled stacks of one config, interleaved; seconds."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    cfgs = {name: harness.load_config("configs/demo.py", [*overrides, f"model.compile.enabled={on}"])
            for name, on in (("eager", False), ("compiled", True))}
    data = harness.batches(cfgs["eager"])
    variants = []
    for name, cfg in cfgs.items():
        stack = harness.build(cfg, tp=group)
        variants.append(harness.Variant(name, lambda t=stack.trainer: t.train_step(data).loss,
                                        (lambda: dist.barrier(group)) if group is not None else None))
    timed = harness.interleave(variants, steps, warmup=2, quiet=group is not None and dist.get_rank(group) > 0)
    return {n: {"first": s.warmup_wall, "times": s.wall} for n, s in timed.items()}


def _tp2_worker(rank: int, world: int, overrides: list[str], steps: int) -> dict[str, Any]:
    import torch.distributed as dist

    from tessera.parallel.comm import use_fast_collectives
    from tessera.parallel.shm_comm import ShmCollectives, shm_unavailable_reason

    group = dist.new_group(list(range(world)))
    route = ShmCollectives.create(group)[0] if shm_unavailable_reason(world) is None else None
    if route is not None:
        use_fast_collectives(group, route)
    try:
        return {**measure(overrides, steps, group), "route": "shared memory" if route is not None else "gloo"}
    finally:
        if route is not None:
            use_fast_collectives(group, None)
            route.close()


def run(args: Any) -> dict[str, Any]:
    base = ["data.type='synthetic'"] if args.demo else list(HIDDEN_512)
    rows = []
    for dtype in args.dtype or ([None] if args.demo else ["bf16", "fp32"]):
        overrides = [*base, f"parallel.tensor.size={args.tp}", *([f"model.dtype='{dtype}'"] if dtype else []),
                     *args.overrides]
        cfg = harness.load_config("configs/demo.py", overrides)  # a bad override fails here, before any worker starts
        label = f"{'demo' if args.demo else 'hidden 512'}{' + overrides' if args.overrides else ''}, TP={args.tp}"
        if args.tp == 1:
            res = measure(overrides, args.steps)
        else:
            from harness.distributed import run_distributed

            ranks = run_distributed(_tp2_worker, 2, overrides, args.steps, timeout=1800.0)
            res = {n: {"first": [max(t) for t in zip(*(r[n]["first"] for r in ranks))],
                       "times": harness.slowest([r[n]["times"] for r in ranks])} for n in ("eager", "compiled")}
            label += f" ({ranks[0]['route']})"
        rows.append({"label": f"{label}, {dtype or 'config dtype'}", "backend": cfg.model.compile.backend, **res,
                     "ratio": harness.paired(res["compiled"]["times"], res["eager"]["times"])})
        harness.log(f"{rows[-1]['label']}: compiled / eager {rows[-1]['ratio']['median']:.3f}")
    return {"rows": rows}


def markdown(res: dict[str, Any]) -> list[str]:
    backends = sorted({r["backend"] for r in res["rows"]})
    lines = [f"Reproduce: {harness.provenance(res)}. Backend {', '.join(backends)}, 1 thread per process; step times "
             "are medians of the interleaved rounds after two warm-up steps, ratios paired per round.", "",
             "| config | eager step ms | compiled step ms | compiled / eager | eager steps 1 / 2 s "
             "| compiled steps 1 / 2 s (2: compile) |", "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        e, c = (statistics.median(r[n]["times"]) for n in ("eager", "compiled"))
        lines.append(f"| {r['label']} | {1e3 * e:.0f} | {1e3 * c:.0f} | {harness.ratio(r['ratio'], 3)} | "
                     + " | ".join(" / ".join(f"{t:.2f}" for t in r[n]["first"]) for n in ("eager", "compiled")) + " |")
    return lines


def main(argv: Sequence[str] | None = None, prog: str = "python -m benchmarks compile") -> int:
    ap = harness.parser(prog, __doc__)
    ap.add_argument("--tp", type=int, choices=[1, 2], default=1)
    ap.add_argument("--demo", action="store_true", help="configs/demo.py's own dims (default: the hidden-512 workload)")
    ap.add_argument("--steps", type=positive_int, default=10, help="timed rounds after two warm-up steps")
    ap.add_argument("--dtype", action="append", default=None,
                    help="model.dtype (repeatable; default bf16 and fp32, with --demo the config's)")
    ap.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    args = ap.parse_args(argv)
    return harness.publish(args, argv, prog, "compile", TITLE, lambda: run(args), markdown)


if __name__ == "__main__":
    sys.exit(main())
