"""Will it fit? Plan a config's memory, communication and step time without a GPU.

    python tools/plan.py configs/7B.py [key=value ...] [--world 8] [--gpu h100] [--gpu-memory 80] [--json]
    python tools/plan.py configs/70B.py --world 64 --gpu h100
    python tools/plan.py configs/7B.py --search --gpus 8 --gpu-memory 80 [--gpu h100]

One training iteration of the config runs at its real size on meta tensors, in a fake process group
of the real world size that refuses CPU tensors as NCCL does (``tessera.plan.dry_run``); the per-rank
report puts each traced figure beside its closed form, and adds in both columns what a GPU holds beyond
the tensors traced: SDPA's packed-row masks and expanded GQA K/V when flash_attn does not run
(``--flash-attn`` says it is installed on the planned GPUs), and an allowance for NCCL communicators and
cuBLAS workspaces. ``--search`` ranks the layouts (TP, ZeRO,
checkpointing, micro-batch size) that fit by predicted throughput, then traces the best one.
Everything is planned, not measured.

The last line is the verdict: "fits: ..." (exit 0) or "does NOT fit: ..." (exit 1), the peak per rank
against the --gpu's datasheet memory (or --gpu-memory GiB) less the headroom. Bad input: "error: ..."
and exit 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from tessera.cli_args import fraction, nonnegative_int, positive_float, positive_int, probability
from tessera.config import Config, ConfigError
from tessera.plan.planner import make_plan, search_layouts, with_layout
from tessera.plan.report import GPUS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="key.sub=value pairs, as for train.py")
    p.add_argument("--world", type=positive_int, default=None,
                   help="ranks of the job (default: parallel.tensor.size, or --gpus with --search)")
    p.add_argument("--rank", type=nonnegative_int, default=0, help="the rank to simulate (default 0)")
    p.add_argument("--gpu", default="h100", choices=sorted(GPUS), help="datasheet memory and peak (default h100)")
    p.add_argument("--gpu-memory", "--memory", dest="gpu_memory", type=positive_float, default=None, metavar="GIB",
                   help="GiB per GPU the peak is compared against (default: the --gpu's datasheet memory); "
                        "--search: the layouts that fit in it")
    p.add_argument("--mfu", type=probability, default=0.4,
                   help="model FLOPs utilization assumed for the step time, in (0, 1] (default 0.4)")
    p.add_argument("--headroom", type=fraction, default=None,
                   help="fraction of GPU memory kept free for the CUDA context and fragmentation (default: the "
                        "config's memory.headroom, 0.1 unless set)")
    p.add_argument("--flash-attn", action=argparse.BooleanOptionalAction, default=None,
                   help="whether flash_attn is installed on the planned GPUs (default: whether it is here); "
                        "without it SDPA's packed-row masks and expanded GQA K/V are counted")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--search", action="store_true", help="rank the layouts that fit")
    p.add_argument("--gpus", type=positive_int, default=None, help="--search: number of GPUs (default --world)")
    p.add_argument("--top", type=positive_int, default=10, help="--search: layouts listed")
    return p.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        cfg = Config.from_file(args.config, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    world = args.world or args.gpus or cfg.typed.parallel.tensor.size
    if args.search:
        gpus = args.gpus or world
        memory = args.gpu_memory or GPUS[args.gpu][0]
        found = search_layouts(cfg, gpus, memory, gpu=args.gpu, mfu=args.mfu, headroom=args.headroom,
                               flash_attn=args.flash_attn)
        if not found:
            print(f"does NOT fit: no layout of {gpus} GPUs with {memory:g} GiB each fits {args.config}",
                  file=sys.stderr)
            return 1
        best = found[0]
        plan = make_plan(with_layout(cfg, tp=best.tp, zero1=best.zero1, checkpoint=best.checkpoint,
                                     micro_bsz=best.micro_bsz, micro_num=best.micro_num), gpus,
                         config_name=args.config, gpu=args.gpu, mfu=args.mfu, headroom=args.headroom,
                         flash_attn=args.flash_attn, memory_gib=args.gpu_memory, memory_source="--gpu-memory")
        if args.json:
            print(json.dumps({"layouts": [vars(c) for c in found[: args.top]], "best": plan.to_dict()},
                             indent=1, default=str))
            return 0
        print(f"layouts of {gpus} x {memory:.0f} GiB that fit {args.config}, best predicted throughput first "
              f"(closed forms; MFU {args.mfu:.0%}, TP collectives at link speed):")
        print(f"{'tokens/s/GPU':>13} {'step s':>7} {'peak GiB':>9}  overrides")
        for c in found[: args.top]:
            print(f"{c.tokens_per_gpu_per_s:13,.0f} {c.step_time:7.2f} {c.peak / 2**30:9.1f}  {c.overrides()}")
        print(f"\nthe best layout, traced:\n{plan.format()}")
        return 0
    try:
        plan = make_plan(cfg, world, config_name=args.config, gpu=args.gpu, mfu=args.mfu, headroom=args.headroom,
                         rank=args.rank, flash_attn=args.flash_attn, memory_gib=args.gpu_memory,
                         memory_source="--gpu-memory")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(plan.to_json() if args.json else plan.format())
    return 0 if plan.fits is not False else 1


if __name__ == "__main__":
    sys.exit(main())
