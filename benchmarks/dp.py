"""Data parallelism on this machine: what each collective moves, and overlapping it with backward.

    python -m benchmarks dp [--quick] [--rounds 12] [--config configs/demo.py] [key.sub=value ...]
    python -m benchmarks --section dp ...           # the same

DP=2 (spawned gloo processes, one thread each), bf16, ZeRO-1 over the DP group and without it:

- bytes each rank sends per optimizer step, counted at every c10d collective by the plan's counter
  (``tessera.plan.tracker.CollectiveTraffic``: the ring bytes of each call), beside the closed form:
  reduce-scatter of the fp32 main grads + all-gather of the bf16 parameters under ZeRO, one all-reduce
  of the grads without, plus the few bytes of the agreements (overflow flag, norm, losses);
- step time with each bucket's reduction launched during the last backward vs after it (the same
  model and batches, interleaved rounds, the slower rank per round).
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Sequence
from typing import Any

from benchmarks import harness
from tessera.cli_args import positive_int

TITLE = "## 7. Data parallelism: bytes per collective, and overlap with backward"
WORLD = 2


def _cfg(args: Any, *extra: str) -> Any:
    return harness.load_config(args["config"], [
        *args["overrides"], "model.dtype='bf16'", "parallel.tensor.size=1", "data.type='synthetic'",
        "data.pack_sample_into_one=True", f"data.micro_bsz={args['micro_bsz'] // WORLD}", "data.micro_num=1", *extra])


def _worker(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from tessera.plan.tracker import CollectiveTraffic

    torch.set_num_threads(1)
    whole = dist.group.WORLD
    alone = [dist.new_group([r]) for r in range(world)][rank]
    numel = sum(p.numel() for p in harness.build(_cfg(args)).optimizer.params)
    bucket = f"hybrid_zero_optimizer.reduce_bucket_size={-(-numel // args['buckets'])}"
    data = harness.batches(_cfg(args, bucket), rank, world)
    out: dict[str, Any] = {"params": numel, "bucket_size": -(-numel // args["buckets"])}
    for zero, group in ((world, whole), (1, alone)):
        stack = harness.build(_cfg(args, bucket), dp=whole, zero1=group, world=whole)
        stack.trainer.train_step(data)  # warm-up
        with CollectiveTraffic() as traffic:
            stack.trainer.train_step(data)
        opt = stack.optimizer
        grads, params = opt.gradients.flat_buffers.values(), [b.param_flat for b in opt.buckets]
        out[f"zero{zero}"] = {"sent": traffic.by_kind(), "buckets": len(opt.buckets),
                              "grad_bytes": sum(t.numel() * t.element_size() for t in grads),
                              "param_bytes": sum(t.numel() * t.element_size() for t in params)}
    variants = []
    for overlap in (True, False):  # only hybrid_zero_optimizer.overlap_sync_grad differs
        stack = harness.build(_cfg(args, bucket, f"hybrid_zero_optimizer.overlap_sync_grad={overlap}"), dp=whole,
                              zero1=whole, world=whole)
        variants.append(harness.Variant("overlap" if overlap else "after",
                                        lambda t=stack.trainer: t.train_step(data).loss, dist.barrier))
    timed = harness.interleave(variants, args["rounds"], quiet=rank > 0)
    out["times"] = {n: s.wall for n, s in timed.items()}
    out["losses"] = {n: s.values for n, s in timed.items()}
    return out


def measure(args: dict[str, Any]) -> dict[str, Any]:
    from harness.distributed import run_distributed
    from tessera.plan.tracker import ring_bytes

    _cfg(args)  # a bad config or override fails here, before the workers start
    res = run_distributed(_worker, WORLD, args, timeout=1800.0)
    job = {n: harness.slowest([r["times"][n] for r in res]) for n in res[0]["times"]}
    traffic = {}
    for key in (f"zero{WORLD}", "zero1"):
        row = res[0][key]
        sent, grads, params = row["sent"], row["grad_bytes"], row["param_bytes"]
        closed = (ring_bytes("reduce_scatter", grads, WORLD) + ring_bytes("all_gather", params, WORLD)
                  if key != "zero1" else ring_bytes("all_reduce", grads, WORLD))
        traffic[key] = {**row, "total": sum(sent.get(k, 0.0) for k in ("reduce_scatter", "all_gather", "all_reduce")),
                        "closed_form": closed, "ddp_all_reduce": ring_bytes("all_reduce", grads, WORLD)}
    return {"params": res[0]["params"], "bucket_size": res[0]["bucket_size"], "traffic": traffic, "job_times": job,
            "overlap_speedup": harness.paired(job["after"], job["overlap"]),
            "same_losses": res[0]["losses"]["overlap"] == res[0]["losses"]["after"]}


def markdown(res: dict[str, Any]) -> list[str]:
    t, mib = res["traffic"], 2**20
    lines = [
        f"Reproduce: {harness.provenance(res)}. DP={WORLD} gloo processes, one thread each, bf16 weights, fp32 main "
        f"grads, {res['params']:,} parameters in buckets of {res['bucket_size']:,} elements (1/8 of the model, so that "
        "there is something to overlap).", "",
        "Bytes sent per rank per optimizer step, counted at each c10d collective (ring closed form per call), against "
        "the closed form of the gradient reduction and parameter gather:", "",
        "| layout | reduce-scatter | all-gather | all-reduce | total | closed form | one DDP all-reduce |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, name in ((f"zero{WORLD}", f"ZeRO-1 over DP ({WORLD})"), ("zero1", "no ZeRO (size 1)")):
        s = t[key]["sent"]
        lines.append(f"| {name} | " + " | ".join(
            f"{s.get(k, 0) / mib:.3f} MiB ({int(s.get(k + '_calls', 0))} calls)"
            for k in ("reduce_scatter", "all_gather", "all_reduce"))
            + f" | {t[key]['total'] / mib:.3f} MiB | {t[key]['closed_form'] / mib:.3f} MiB | "
              f"{t[key]['ddp_all_reduce'] / mib:.3f} MiB |")
    z, med = t[f"zero{WORLD}"], {n: statistics.median(v) for n, v in res["job_times"].items()}
    return lines + [
        "",
        f"ZeRO over the DP group sends {z['total'] / z['ddp_all_reduce']:.2f}x the bytes of one DDP all-reduce of the "
        "gradients (closed form: (4 + 2) / 8 = 0.75 for fp32 grads and bf16 weights; 1.0 for fp32 weights). The "
        "all-reduce column is the agreements (token count, overflow flag, norm, loss): a few bytes.",
        "",
        f"DP={WORLD} step time, ZeRO over DP, {len(res['job_times']['after'])} rounds: reduction after backward "
        f"{med['after'] * 1e3:.1f} ms, overlapped with the last backward {med['overlap'] * 1e3:.1f} ms (medians); "
        f"throughput ratio overlap / after {harness.ratio(res['overlap_speedup'], 3)} (paired per round). Losses "
        f"identical both ways: {res['same_losses']}.",
    ]


def main(argv: Sequence[str] | None = None, prog: str = "python -m benchmarks dp") -> int:
    ap = harness.parser(prog, __doc__)
    ap.add_argument("--quick", action="store_true", help="3 rounds, 4 rows per step")
    ap.add_argument("--rounds", type=positive_int, default=None, help="timed rounds (default 12, quick 3)")
    ap.add_argument("--micro-bsz", type=positive_int, default=None, help="rows per step, both ranks (default 16)")
    ap.add_argument("--buckets", type=positive_int, default=8, help="gradient buckets of the model (default 8)")
    ap.add_argument("--config", default="configs/demo.py")
    ap.add_argument("overrides", nargs="*", help="key.sub=value overrides of that config")
    args = ap.parse_args(argv)
    spec = {"config": args.config, "overrides": list(args.overrides), "buckets": args.buckets,
            "rounds": args.rounds or (3 if args.quick else 12),
            "micro_bsz": max(WORLD, args.micro_bsz or (4 if args.quick else 16))}
    return harness.publish(args, argv, prog, "dp", TITLE, lambda: {"spec": spec, **measure(spec)}, markdown)


if __name__ == "__main__":
    sys.exit(main())
