"""Data parallelism on this machine: what each collective moves, and overlapping it with backward.

DP=2 (spawned gloo processes, one thread each), bf16, ZeRO-1 over the DP group and without it:

- bytes each rank sends per optimizer step, counted at every c10d collective by the plan's counter
  (``tessera.plan.tracker.CollectiveTraffic``: the ring bytes of each call), with the closed form
  beside them: reduce-scatter of the fp32 main grads + all-gather of the bf16 parameters under ZeRO
  (``(d-1)/d * (4 + 2)`` bytes per parameter), one all-reduce of the grads without
  (``2 (d-1)/d * 4``), plus the few bytes of the agreements (overflow flag, norm, losses);
- step time with each bucket's reduction launched during the last backward vs after it (the same
  model, the same batches, interleaved A B A B and paired per round).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.runner import Mode, _batches, _config, _tessera, paired
from tessera.plan.tracker import CollectiveTraffic, ring_bytes


def _worker(rank: int, world: int, mode: Mode, buckets: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    whole = dist.group.WORLD
    singles = [dist.new_group([r]) for r in range(world)]
    probe = _config(mode, "bf16", mode.micro_bsz // world)
    numel = sum(p.numel() for p in _tessera(probe, [])[1].params)
    bucket = -(-numel // buckets)
    extra = (f"hybrid_zero_optimizer.reduce_bucket_size={bucket}",)
    out: dict[str, Any] = {"params": numel, "bucket_size": bucket}
    for zero in (world, 1):
        cfg = _config(mode, "bf16", mode.micro_bsz // world, extra=extra)
        shard = _batches(cfg, rank, world)
        trainer, opt = _tessera(cfg, shard, dp_group=whole, zero1_group=whole if zero == world else singles[rank],
                                global_group=whole)
        trainer.train_step(shard)  # warm-up
        with CollectiveTraffic() as traffic:
            trainer.train_step(shard)
        grads = opt.gradients.flat_buffers.values()
        params = [b.param_flat for b in opt.buckets]
        out[f"zero{zero}"] = {"sent": traffic.by_kind(), "grad_bytes": sum(t.numel() * t.element_size() for t in grads),
                              "param_bytes": sum(t.numel() * t.element_size() for t in params),
                              "buckets": len(opt.buckets)}
    shard = _batches(_config(mode, "bf16", mode.micro_bsz // world, extra=extra), rank, world)
    steps = {}
    for overlap in (True, False):  # the same model and batches; only hybrid_zero_optimizer.overlap_sync_grad differs
        cfg = _config(mode, "bf16", mode.micro_bsz // world,
                      extra=(*extra, f"hybrid_zero_optimizer.overlap_sync_grad={overlap}"))
        trainer, opt = _tessera(cfg, shard, dp_group=whole, zero1_group=whole, global_group=whole)
        steps["overlap" if overlap else "after"] = trainer
    times: dict[str, list[float]] = {n: [] for n in steps}
    losses: dict[str, list[float]] = {n: [] for n in steps}
    for r in range(1 + mode.par_max_rounds):
        order = list(steps) if r % 2 == 0 else list(steps)[::-1]
        for n in order:
            dist.barrier()
            t0 = time.perf_counter()
            losses[n].append(steps[n].train_step(shard).loss)
            dt = time.perf_counter() - t0
            if r:  # round 0 warms up
                times[n].append(dt)
    out["times"], out["losses"] = times, losses
    return out


def measure_dp(mode: Mode, buckets: int = 8) -> dict[str, Any]:
    from harness.distributed import run_distributed

    world = 2
    res = run_distributed(_worker, world, mode, buckets, timeout=1800.0)
    job = {n: [max(r["times"][n][i] for r in res) for i in range(len(res[0]["times"][n]))] for n in res[0]["times"]}
    traffic = {}
    for key in (f"zero{world}", "zero1"):
        row = res[0][key]
        sent = row["sent"]
        grads, params = row["grad_bytes"], row["param_bytes"]
        dp = sent.get("reduce_scatter", 0.0) + sent.get("all_gather", 0.0) + sent.get("all_reduce", 0.0)
        closed = (ring_bytes("reduce_scatter", grads, world) + ring_bytes("all_gather", params, world)
                  if key != "zero1" else ring_bytes("all_reduce", grads, world))
        traffic[key] = {"sent": sent, "total": dp, "closed_form": closed,
                        "ddp_all_reduce": ring_bytes("all_reduce", grads, world),
                        "grad_bytes": grads, "param_bytes": params, "buckets": row["buckets"]}
    return {"world": world, "params": res[0]["params"], "bucket_size": res[0]["bucket_size"], "traffic": traffic,
            "median_s": {n: statistics.median(v) for n, v in job.items()},
            "overlap_speedup": paired(job["after"], job["overlap"]),
            "same_losses": res[0]["losses"]["overlap"] == res[0]["losses"]["after"], "rounds": len(job["after"])}


def dp_markdown(res: dict[str, Any], command: str, machine: str) -> list[str]:
    w = res["world"]
    t = res["traffic"]
    mib = 2**20
    lines = [
        f"Reproduce: `{command}` ({machine}). DP={w} gloo processes, one thread each, bf16 weights, fp32 main grads, "
        f"{res['params']:,} parameters in buckets of {res['bucket_size']:,} elements.",
        "",
        "Bytes sent per rank per optimizer step, counted at each c10d collective (ring closed form per "
        "call), against the closed form of the gradient reduction and parameter gather:",
        "",
        "| layout | reduce-scatter | all-gather | all-reduce | total | closed form | one DDP all-reduce |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, name in ((f"zero{w}", f"ZeRO-1 over DP ({w})"), ("zero1", "no ZeRO (size 1)")):
        s = t[key]["sent"]
        lines.append(
            f"| {name} | {s.get('reduce_scatter', 0) / mib:.3f} MiB ({int(s.get('reduce_scatter_calls', 0))} calls) | "
            f"{s.get('all_gather', 0) / mib:.3f} MiB ({int(s.get('all_gather_calls', 0))}) | "
            f"{s.get('all_reduce', 0) / mib:.3f} MiB ({int(s.get('all_reduce_calls', 0))}) | "
            f"{t[key]['total'] / mib:.3f} MiB | {t[key]['closed_form'] / mib:.3f} MiB | "
            f"{t[key]['ddp_all_reduce'] / mib:.3f} MiB |")
    z = t[f"zero{w}"]
    lines += [
        "",
        f"ZeRO over the DP group sends {z['total'] / z['ddp_all_reduce']:.2f}x the bytes of one DDP all-reduce of the "
        f"gradients (closed form: (4 + 2) / 8 = 0.75 for fp32 grads and bf16 weights; 1.0 for fp32 weights); before "
        "the reduce-scatter it all-reduced the grads and then all-gathered the weights, 1.25x here (1.5x in fp32). "
        "The all-reduce column is the agreements (token count, overflow flag, norm, loss): a few bytes.",
        "",
        f"DP={w} step time, ZeRO over DP, {res['rounds']} paired rounds: reduction after backward "
        f"{res['median_s']['after'] * 1e3:.1f} ms, overlapped with the last backward "
        f"{res['median_s']['overlap'] * 1e3:.1f} ms "
        f"(median); throughput ratio overlap / after = **{res['overlap_speedup']['median']:.3f}** "
        f"(paired per round, min {res['overlap_speedup']['min']:.3f}, max {res['overlap_speedup']['max']:.3f}). "
        f"Losses identical both ways: {res['same_losses']}.",
    ]
    return lines
