"""Activation memory and step time per TP rank: mtp vs msp, checkpointing none / selective / full.

    python -m benchmarks activations                 # TP=2 on 2 spawned gloo processes (BENCHMARKS.md section 9)
    python -m benchmarks activations --layers 2 --hidden 64 --seq 64 --rounds 1 --out ''   # a quick look

Measured: the peak of live tensor bytes during one forward + backward (cross-entropy on the vocab-
sharded logits included) minus what was live before the forward, by the plan's tracker
(``tessera.plan.tracker.LiveBytes``: every storage an operator creates, followed through a weak
reference to the C++ storage, so a tensor autograd keeps for backward counts for as long as it lives;
a TorchDispatchMode, so it also sees the backward and the recomputation). Gradients of the parameters
are allocated before the forward, so they are not activations here. Step time: forward+backward
without the tracker, every case in interleaved rounds, the slower rank per round. The closed form
(``tessera.memory.activations``) is given beside each measurement.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks import harness
from tessera.cli_args import positive_int

TITLE = "## 9. Sequence parallelism (msp) and selective recomputation: activation memory and step time at TP=2"
CHECKPOINTS = {"none": False, "selective": "selective", "full": True}


def case(group: Any, *, model: dict[str, Any], micro_bsz: int, seq_len: int, mode: str,
         checkpoint: Any, chunk_tokens: int = 0) -> tuple[int, Callable[[], None]]:
    """One configuration on this rank: its activation peak in bytes (the lowest of three tracked steps: a buffer
    a collective's worker thread lets go of a moment late adds to a step's peak now and then, never subtracts)
    and its forward+backward as a step function. ``chunk_tokens``: the head and the loss fused (0: the logits
    whole, then the loss)."""
    import torch
    import torch.distributed as dist

    from tessera.config import Config
    from tessera.model import build_model
    from tessera.parallel import vocab_parallel_cross_entropy
    from tessera.parallel.loss import LossSpec
    from tessera.plan.tracker import LiveBytes

    tp = dist.get_world_size(group)
    cfg = Config.from_dict({"model": {"dtype": "torch.float32", "use_flash_attn": False, **model,
                                      "checkpoint": checkpoint}, "parallel": {"tensor": {"size": tp, "mode": mode}},
                            "data": {"type": "synthetic", "seq_len": seq_len}}).model
    net = build_model(cfg, tp_group=group, seed=0, tensor_mode=mode)
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    g = torch.Generator().manual_seed(0)
    ids, target = (torch.randint(0, cfg.vocab_size, (micro_bsz, seq_len), generator=g) for _ in range(2))

    def step() -> None:
        if chunk_tokens:  # the head and the loss fused (loss.chunk_tokens)
            net(ids, labels=target, loss=LossSpec(chunk_tokens=chunk_tokens)).backward()
        else:
            vocab_parallel_cross_entropy(net(ids), target, group).backward()

    step()  # warm-up: lazy initialisations are not activations
    peaks = []
    for _ in range(3):
        with LiveBytes() as tracker:
            step()
        peaks.append(tracker.peak)
    return min(peaks), step


def _worker(rank: int, world: int, cases: dict[str, dict[str, Any]], rounds: int) -> dict[str, Any]:
    import torch.distributed as dist

    built = {name: case(dist.group.WORLD, **c) for name, c in cases.items()}
    timed = harness.interleave([harness.Variant(n, step, dist.barrier) for n, (_, step) in built.items()], rounds,
                               warmup=0, quiet=rank > 0)
    return {n: {"peak_bytes": built[n][0], "times": s.wall} for n, s in timed.items()}


def run(args: Any) -> dict[str, Any]:
    import torch

    from harness.distributed import run_distributed
    from tessera.memory.activations import activation_bytes
    from tessera.parallel.sequence import TENSOR_MODES

    model = dict(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                 num_kv_attention_heads=args.kv_heads, vocab_size=args.vocab, mlp_ratio=8 / 3, multiple_of=64)
    cases = {f"{mode} {ck}": dict(model=model, micro_bsz=args.micro_bsz, seq_len=args.seq, mode=mode, checkpoint=c)
             for mode in TENSOR_MODES for ck, c in CHECKPOINTS.items()}
    res = run_distributed(_worker, args.tp, cases, args.rounds, timeout=3600)
    rows = {}
    for name, c in cases.items():
        closed = activation_bytes(model, args.micro_bsz, args.seq, args.tp, c["mode"], c["checkpoint"], torch.float32)
        rows[name] = {"peak_bytes": max(r[name]["peak_bytes"] for r in res), "closed_bytes": closed["peak"],
                      "times": harness.slowest([r[name]["times"] for r in res])}
    return {"tp": args.tp, "model": model, "micro_bsz": args.micro_bsz, "seq_len": args.seq, "rows": rows}


def markdown(res: dict[str, Any]) -> list[str]:
    import statistics

    m, mib = res["model"], 2**20
    lines = [f"Reproduce: {harness.provenance(res)}. TP={res['tp']}: {res['tp']} gloo processes of 1 thread each. "
             f"Model: {m['num_layers']} layers, hidden {m['hidden_size']}, {m['num_attention_heads']} heads "
             f"({m['num_kv_attention_heads']} KV heads), vocab {m['vocab_size']}, fp32; one micro-batch of "
             f"{res['micro_bsz']} x {res['seq_len']} tokens, loss = vocab-parallel cross-entropy. Step time: median "
             f"forward+backward of {len(next(iter(res['rows'].values()))['times'])} interleaved rounds, the slower "
             "rank per round.", "",
             "| mode | checkpoint | activation peak / rank (MiB) | closed form (MiB) | measured / closed | "
             "step time fwd+bwd (s) |", "|---|---|---:|---:|---:|---:|"]
    for name, r in res["rows"].items():
        mode, ck = name.split()
        lines.append(f"| {mode} | {ck} | {r['peak_bytes'] / mib:.2f} | {r['closed_bytes'] / mib:.2f} | "
                     f"{r['peak_bytes'] / r['closed_bytes']:.3f} | {statistics.median(r['times']):.3f} |")
    return lines


def main(argv: Sequence[str] | None = None, prog: str = "python -m benchmarks activations") -> int:
    ap = harness.parser(prog, __doc__)
    ap.add_argument("--tp", type=positive_int, default=2)
    ap.add_argument("--layers", type=positive_int, default=4)
    ap.add_argument("--hidden", type=positive_int, default=256)
    ap.add_argument("--heads", type=positive_int, default=8)
    ap.add_argument("--kv-heads", type=positive_int, default=4)
    ap.add_argument("--vocab", type=positive_int, default=1024)
    ap.add_argument("--seq", type=positive_int, default=512)
    ap.add_argument("--micro-bsz", type=positive_int, default=2)
    ap.add_argument("--rounds", type=positive_int, default=5, help="timed rounds of every case")
    args = ap.parse_args(argv)
    return harness.publish(args, argv, prog, "activations", TITLE, lambda: run(args), markdown)


if __name__ == "__main__":
    sys.exit(main())
