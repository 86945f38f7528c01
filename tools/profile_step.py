"""Profile a few training steps and print the kernels that take the time.

    python -m tools.profile_step [--config configs/1B.py] [--device cuda] [--warmup 3] [--steps 3] [--top 25]
                                 [--hf] [--trace trace.json] [key.sub=value ...]

The step is the benchmarks' (``benchmarks.harness.build``: train.py's stack over synthetic data, one rank);
``--hf`` profiles Hugging Face's ``LlamaForCausalLM`` of the same dims instead (the peer of
``python -m benchmarks gpu-peers``), so the two tables can be read side by side. After ``--warmup`` steps
(compilation happens there), ``torch.profiler`` records ``--steps`` steps; the table lists the ``--top``
operators and kernels by device time (CPU time on a CPU), per step, with their share of the step.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Callable

from tessera.cli_args import positive_int


def _step(args: argparse.Namespace) -> Callable[[], float]:
    from benchmarks import gpu_peers, harness

    cfg = harness.load_config(args.config, ["data.type='synthetic'", "parallel.tensor.size=1", *args.overrides])
    if args.hf:
        return gpu_peers._hf_step(cfg, args.device, compiled=bool(cfg.model.compile.enabled))
    return gpu_peers._tessera_step(cfg, args.device, compiled=bool(cfg.model.compile.enabled))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/1B.py")
    p.add_argument("--device", default="cuda")
    p.add_argument("--warmup", type=positive_int, default=3, help="steps before recording (default 3)")
    p.add_argument("--steps", type=positive_int, default=3, help="steps recorded (default 3)")
    p.add_argument("--top", type=positive_int, default=25, help="rows of the table (default 25)")
    p.add_argument("--hf", action="store_true", help="profile HF LlamaForCausalLM of the same dims instead")
    p.add_argument("--trace", default=None, help="also write a Chrome trace here")
    p.add_argument("overrides", nargs="*", help="key.sub=value pairs for the config")
    args = p.parse_intermixed_args(argv)
    if importlib.util.find_spec("benchmarks") is None:  # run as a file: tools/ on the path
        print("error: benchmarks/ is not importable: run this tool from the repository root as "
              "python -m tools.profile_step", file=sys.stderr)
        return 2
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("error: --device cuda, but torch.cuda.is_available() is False (use --device cpu)", file=sys.stderr)
        return 2
    step = _step(args)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(args.warmup):
        step()
    sync()
    start = time.perf_counter()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            step()
        sync()
    wall = (time.perf_counter() - start) / args.steps
    if args.trace:
        prof.export_chrome_trace(args.trace)
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)
    total = sum(getattr(e, key) for e in events) / args.steps / 1e3
    what = "HF LlamaForCausalLM" if args.hf else "tessera"
    print(f"{what}, {args.config} {' '.join(args.overrides)}: step {wall * 1e3:.1f} ms wall (profiled), "
          f"{total:.1f} ms of self {'device' if cuda else 'CPU'} time a step")
    print("| operator / kernel | ms a step | share | calls a step |")
    print("|---|---|---|---|")
    for e in events[:args.top]:
        ms = getattr(e, key) / args.steps / 1e3
        print(f"| {e.key[:110].replace('|', '/')} | {ms:.2f} | {ms / total:.1%} | {e.count / args.steps:g} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
