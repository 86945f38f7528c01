"""Activation memory and step time per TP rank: mtp vs msp, checkpointing none / selective / full.

    python -m benchmarks activations                 # TP=2 on 2 spawned gloo processes (BENCHMARKS.md section 9)
    python -m benchmarks activations --layers 2 --hidden 64 --seq 64 --steps 1   # a quick look

Measured: the peak of live tensor bytes during one forward + backward (cross-entropy on the vocab-
sharded logits included) minus what was live before the forward, by the plan's tracker
(``tessera.plan.tracker.LiveBytes``: every storage an operator creates, followed through a weak
reference to the C++ storage, so a tensor autograd keeps for backward counts for as long as it lives;
a TorchDispatchMode, so it also sees the backward and the recomputation). Gradients of the parameters
are allocated before the forward, so they are not activations here. Step time: the median over
``--steps`` forward+backward passes without the tracker (after one warm-up). The closed form
(``tessera.model.activations``) is printed beside each measurement, with the relative difference.
"""

from __future__ import annotations

import argparse
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from tessera.cli_args import positive_int
from tessera.config import Config
from tessera.model import build_model
from tessera.model.activations import activation_bytes
from tessera.parallel import vocab_parallel_cross_entropy
from tessera.parallel.sequence import TENSOR_MODES
from tessera.plan.tracker import LiveBytes


def _model_cfg(model: dict[str, Any], seq_len: int, tp: int, mode: str, checkpoint: Any):
    return Config.from_dict({"model": {"dtype": "torch.float32", "use_flash_attn": False, **model,
                                       "checkpoint": checkpoint},
                             "parallel": {"tensor": {"size": tp, "mode": mode}},
                             "data": {"type": "synthetic", "seq_len": seq_len}}).model


def measure(group: Any, *, model: dict[str, Any], micro_bsz: int, seq_len: int, mode: str, checkpoint: Any,
            steps: int = 3) -> dict[str, Any]:
    """Peak activation bytes on this rank (the lowest of three tracked steps) and the median forward+backward
    time, for one configuration."""
    tp = dist.get_world_size(group)
    cfg = _model_cfg(model, seq_len, tp, mode, checkpoint)
    net = build_model(cfg, tp_group=group, seed=0, tensor_mode=mode)
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (micro_bsz, seq_len), generator=g)
    target = torch.randint(0, cfg.vocab_size, (micro_bsz, seq_len), generator=g)

    def step() -> None:
        loss = vocab_parallel_cross_entropy(net(ids), target, group)
        loss.backward()

    step()  # warm-up: lazy initialisations are not activations
    # the peak of three tracked steps' peaks, the lowest: a buffer a collective's worker thread lets go of a moment
    # late adds to one step's peak now and then (never subtracts), and the lowest is the layers' own
    peaks = []
    for _ in range(3):
        with LiveBytes() as tracker:
            step()
        peaks.append(tracker.peak)
    times = []
    for _ in range(steps):
        dist.barrier(group)
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"peak_bytes": min(peaks), "step_s": statistics.median(times)}


def _worker(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    return [measure(dist.group.WORLD, **case) for case in cases]


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main(argv: Sequence[str] | None = None, prog: str = "python -m benchmarks activations") -> int:
    """Measure every mode x checkpointing case and print the markdown table; returns the exit status."""
    from harness.distributed import run_distributed

    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=positive_int, default=2)
    ap.add_argument("--layers", type=positive_int, default=4)
    ap.add_argument("--hidden", type=positive_int, default=256)
    ap.add_argument("--heads", type=positive_int, default=8)
    ap.add_argument("--kv-heads", type=positive_int, default=4)
    ap.add_argument("--vocab", type=positive_int, default=1024)
    ap.add_argument("--seq", type=positive_int, default=512)
    ap.add_argument("--micro-bsz", type=positive_int, default=2)
    ap.add_argument("--steps", type=positive_int, default=5)
    args = ap.parse_args(argv)
    model = dict(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                 num_kv_attention_heads=args.kv_heads, vocab_size=args.vocab, mlp_ratio=8 / 3, multiple_of=64)
    checkpoints = [("none", False), ("selective", "selective"), ("full", True)]
    cases = [dict(model=model, micro_bsz=args.micro_bsz, seq_len=args.seq, mode=mode, checkpoint=ck, steps=args.steps)
             for mode in TENSOR_MODES for _, ck in checkpoints]
    results = run_distributed(_worker, args.tp, cases, timeout=3600)
    mib = 2**20
    print(f"command: {' '.join([prog, *(shlex.quote(a) for a in argv)])}")
    print(f"machine: {_cpu_name()}, {torch.get_num_threads()} threads here, {args.tp} gloo processes (1 thread each), "
          f"torch {torch.__version__}")
    print(f"model: {args.layers} layers, hidden {args.hidden}, {args.heads} heads ({args.kv_heads} KV), vocab "
          f"{args.vocab}, SwiGLU {build_model(model, device='meta').args.ffn_hidden_size}; micro_bsz "
          f"{args.micro_bsz} x seq {args.seq}, fp32, TP={args.tp}\n")
    print("| mode | checkpoint | activation peak / rank (MiB) | closed form (MiB) | measured / closed | "
          "step time fwd+bwd (s) |")
    print("|---|---|---:|---:|---:|---:|")
    for i, case in enumerate(cases):
        name = next(n for n, ck in checkpoints if ck == case["checkpoint"])
        peaks = [r[i]["peak_bytes"] for r in results]
        step_s = max(r[i]["step_s"] for r in results)
        closed = activation_bytes(model, args.micro_bsz, args.seq, args.tp, case["mode"], case["checkpoint"],
                                  torch.float32)["peak"]
        print(f"| {case['mode']} | {name} | {max(peaks) / mib:.2f} | {closed / mib:.2f} | {max(peaks) / closed:.3f} | "
              f"{step_s:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
