"""Framework overhead and precisions: tessera's training step beside a plain PyTorch step of the same model.

    python -m benchmarks [--quick | --tiny] [--threads N] [--config configs/demo.py] [--note TEXT ...]
                         [--out BENCHMARKS.md] [--json PATH] [--render JSON] [key.sub=value ...]

BENCHMARKS.md sections 1 and 2. One process, ``--threads`` torch threads, TP=1, synthetic rows of one
document each (causal attention in both stacks). tessera = ``Trainer.train_step`` of the stack train.py
builds, in bf16 / fp16 / fp32 / tf32; plain = ``benchmarks.plain`` in fp32 and in bf16 autocast with
tessera's GEMM route (``tessera.parallel.gemm``; the CPU's kernel choice is ``tessera.parallel.cpu_kernels``),
so the framework's cost is told apart from the kernel choice. A second, small batch adds torch's own bf16
CPU kernels (``TESSERA_CPU_LOWP_MATMUL=native`` and plain ``torch.autocast``), slow on CPUs without bf16
instructions. Times are wall clock and CPU time of the process: with one thread, CPU time leaves out the
time the process waited for a core.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
from collections.abc import Sequence
from typing import Any

from benchmarks import harness
from tessera.cli_args import positive_int  # stdlib only: torch loads after the flags are parsed

SECTION = "overhead"
TITLE = "## 1. Framework overhead: tessera step vs plain PyTorch step"
DTYPES = ("bf16", "fp16", "fp32", "tf32")
ENV = "TESSERA_CPU_LOWP_MATMUL"
TARGET = 1.10  # framework overhead in bf16 on the demo model, at most
EXPECTED = 1.8  # bf16 speed-up over fp32 expected from bf16 matrix instructions


@dataclasses.dataclass(frozen=True)
class Size:
    """How much to measure: the main batch (rows of seq_len) and its rounds, then the small batch's."""

    config: str = "configs/demo.py"
    overrides: tuple[str, ...] = ()
    threads: int = 1
    micro_bsz: int = 16
    rounds: int = 12
    min_rounds: int = 5
    budget_s: float = 120.0  # rounds stop after this once min_rounds are done
    small_micro_bsz: int = 1
    small_seq_len: int | None = None  # None: the config's
    small_rounds: int = 3
    peak_seconds: float = 0.5


SIZES = {
    "full": Size(),
    "quick": Size(micro_bsz=4, rounds=3, min_rounds=3, budget_s=0.0, small_seq_len=64, small_rounds=2,
                  peak_seconds=0.25),
    "tiny": Size(config="configs/tiny.py", overrides=("data.seq_len=32",), micro_bsz=4, rounds=2, min_rounds=2,
                 budget_s=0.0, small_rounds=1, peak_seconds=0.05),  # the test mode: seconds in all
}


def _cfg(size: Size, dtype: str, micro_bsz: int, seq_len: int | None = None) -> Any:
    over = [*size.overrides, f"model.dtype='{dtype}'", "parallel.tensor.size=1", "data.type='synthetic'",
            "data.pack_sample_into_one=True", f"data.micro_bsz={micro_bsz}", "data.micro_num=1"]
    return harness.load_config(size.config, over + ([f"data.seq_len={seq_len}"] if seq_len else []))


def _kernels(value: str | None) -> Any:
    """Before a step: ``TESSERA_CPU_LOWP_MATMUL`` as this variant wants it (cpu_kernels reads it again when it
    changed)."""
    from tessera.parallel import cpu_kernels

    def set_env() -> None:
        if os.environ.get(ENV) != value:
            if value is None:
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = value
            cpu_kernels.forget_cpu_kernels()

    return set_env


def _tokens(data: list[Any]) -> int:
    return sum(b["input_ids"].numel() for b in data)


def measure(size: Size) -> dict[str, Any]:
    import torch

    from benchmarks.plain import PlainDecoder, PlainStep
    from tessera.model import ModelArgs, build_model, flops_per_token
    from tessera.parallel import cpu_kernels
    from tessera.precision.plan import PrecisionPlan
    from tessera.train.metrics import measure_matmul_tflops

    env = os.environ.get(ENV)
    cfgs = {d: _cfg(size, d, size.micro_bsz) for d in DTYPES}
    small = {d: _cfg(size, d, size.small_micro_bsz, size.small_seq_len) for d in ("bf16", "fp32")}
    fp32 = cfgs["fp32"]
    state = {k: v.clone() for k, v in build_model(fp32.model, seed=fp32.seed).state_dict().items()}
    optimizers: dict[str, Any] = {}

    def tessera(name: str, cfg: Any, data: list[Any], kernels: str | None) -> harness.Variant:
        stack = harness.build(cfg)
        optimizers.setdefault(name, stack.optimizer)

        precision = PrecisionPlan.from_config(cfg)

        def before() -> None:
            precision.apply()
            _kernels(kernels)()

        return harness.Variant(name, lambda: stack.trainer.train_step(data).loss, before)

    def plain(name: str, cfg: Any, data: list[Any], dtype: torch.dtype, gemm: str) -> harness.Variant:
        model = PlainDecoder(ModelArgs.from_config(cfg.model), dtype, gemm)
        model.load_state_dict(state)  # tessera's initial weights: the same model, the same first loss
        a = cfg.adam
        step = PlainStep(model, dtype, a.lr, (a.adam_beta1, a.adam_beta2), a.adam_eps, a.weight_decay,
                         cfg.hybrid_zero_optimizer.clip_grad_norm)
        x, y = (torch.cat([b[k] for b in data]) for k in ("input_ids", "labels"))
        return harness.Variant(name, lambda: step(x, y), _kernels(env))

    def peaks() -> dict[str, float]:
        return {d: measure_matmul_tflops(dt, torch.device("cpu"), seconds=size.peak_seconds)
                for d, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32))}

    def series(timed: dict[str, harness.Series]) -> dict[str, Any]:
        return {n: {"wall": s.wall, "cpu": s.cpu, "first_loss": s.warmup[0]} for n, s in timed.items()}

    threads, tf32 = torch.get_num_threads(), torch.backends.cuda.matmul.allow_tf32
    torch.set_num_threads(size.threads)
    try:
        data, sdata = harness.batches(fp32), harness.batches(small["fp32"])
        before = peaks()
        main = harness.interleave(
            [*(tessera(f"tessera {d}", cfgs[d], data, env) for d in DTYPES),
             plain("plain fp32", fp32, data, torch.float32, "torch"),
             plain("plain bf16 lowp", cfgs["bf16"], data, torch.bfloat16, "lowp")],
            size.rounds, min_rounds=size.min_rounds, budget_s=size.budget_s)
        native = harness.interleave(  # the small batch
            [tessera("tessera bf16", small["bf16"], sdata, env),
             tessera("tessera bf16 native", small["bf16"], sdata, "native"),
             tessera("tessera fp32", small["fp32"], sdata, env),
             plain("plain bf16 autocast", small["bf16"], sdata, torch.bfloat16, "torch"),
             plain("plain bf16 lowp", small["bf16"], sdata, torch.bfloat16, "lowp")], size.small_rounds)
        after = peaks()
    finally:
        _kernels(env)()
        torch.set_num_threads(threads)
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return {"size": dataclasses.asdict(size), "seq_len": fp32.data.seq_len, "tokens": _tokens(data),
            "small_tokens": _tokens(sdata), "flops_per_token": flops_per_token(fp32.model, fp32.data.seq_len),
            "num_params": sum(v.numel() for v in state.values()), "main": series(main), "small": series(native),
            "peaks": {d: max(before[d], after[d]) for d in before},
            "skipped": {d: optimizers[f"tessera {d}"].skipped_steps for d in DTYPES},
            "kernels": {"env": env or "auto", "bf16_upcast": cpu_kernels.upcast_on_cpu(torch.bfloat16)}}


# ---------------------------------------------------------------------------------------- markdown
def _both(a: dict[str, Any], b: dict[str, Any], nd: int = 2) -> str:
    """Paired ratio a / b, wall clock and CPU time, as two table cells."""
    return " | ".join(harness.ratio(harness.paired(a[k], b[k]), nd) for k in ("wall", "cpu"))


def _med(v: dict[str, Any], clock: str = "wall") -> float:
    return statistics.median(v[clock])


def markdown(res: dict[str, Any]) -> list[str]:
    main, small = res["main"], res["small"]
    tb, tf, pb, pf = main["tessera bf16"], main["tessera fp32"], main["plain bf16 lowp"], main["plain fp32"]
    m = res["machine"]
    native_bf16 = m["flags"].get("avx512_bf16") or m["flags"].get("amx_bf16")
    size = res["size"]
    lines = [
        f"Reproduce: {harness.provenance(res)}. Model: `{size['config']}`"
        + (f" with `{' '.join(size['overrides'])}`" if size["overrides"] else "")
        + f", {res['num_params']:,} parameters, seq_len {res['seq_len']}, {res['flops_per_token'] / 1e6:.2f} MFLOP "
        f"per token. One process, batch {size['micro_bsz']} x {res['seq_len']} = {res['tokens']} tokens, TP=1, "
        f"{size['threads']} thread(s), {len(tb['wall'])} rounds. CPU bf16 GEMMs in tessera "
        f"(`TESSERA_CPU_LOWP_MATMUL={res['kernels']['env']}`): "
        + ("fp32 GEMMs on bf16 operands." if res["kernels"]["bf16_upcast"] else "torch's native kernels."),
        "",
        "tessera = `Trainer.train_step` of the stack `build_training_stack` builds (fp32 masters and main grads, "
        "global-norm clipping). plain = `benchmarks/plain.py`: nn.Linear/nn.Embedding, RMSNorm, rotary, SDPA, "
        "SwiGLU with the same matmuls and the same initial weights, fp32 cross-entropy, `clip_grad_norm_`, "
        "`torch.optim.AdamW`; bf16 under `torch.autocast` (fp32 parameters).",
        "",
        "| variant | median step, wall (s) | median step, CPU (s) | tokens/s (wall) | first-step loss |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [f"| {n} | {_med(v):.3f} | {_med(v, 'cpu'):.3f} | {res['tokens'] / _med(v):.0f} | {v['first_loss']:.4f} |"
              for n, v in (("tessera bf16", tb), ("tessera fp32", tf), ("plain fp32", pf),
                           ("plain bf16 autocast, tessera's GEMM/attention kernels", pb))]
    over = harness.paired(tb["wall"], pb["wall"])["median"], harness.paired(tb["cpu"], pb["cpu"])["median"]
    lines += [
        "", "| time ratio (below 1: tessera faster) | wall clock | CPU time |", "|---|---:|---:|",
        f"| **framework overhead, bf16**: tessera bf16 / plain bf16 autocast, same kernels | {_both(tb, pb)} |",
        f"| framework overhead, fp32: tessera fp32 / plain fp32 | {_both(tf, pf)} |",
        f"| tessera bf16 / plain fp32 | {_both(tb, pf)} |",
        "",
        f"Target: framework overhead in bf16 at most {TARGET:.2f}. Measured {over[0]:.2f} wall clock, {over[1]:.2f} "
        "CPU time: **" + ("met" if max(over) <= TARGET else "met by one measure only" if min(over) <= TARGET
                          else "not met") + "**.",
        "",
        f"Small batch ({res['small_tokens']} tokens, {len(small['tessera bf16']['wall'])} rounds): torch's native bf16 "
        f"CPU kernels are slow on CPUs without bf16 instructions ({'not' if native_bf16 else 'as'} this one).",
        "",
        "| variant (small batch) | median step, wall (s) | median step, CPU (s) | first-step loss |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {n} | {_med(v):.3f} | {_med(v, 'cpu'):.3f} | {v['first_loss']:.4f} |" for n, v in small.items()]
    lines += [
        "", "| time ratio (small batch) | wall clock | CPU time |", "|---|---:|---:|",
        f"| tessera bf16 / plain bf16 torch.autocast | {_both(small['tessera bf16'], small['plain bf16 autocast'])} |",
        f"| tessera bf16 / plain bf16 autocast with tessera's kernels | "
        f"{_both(small['tessera bf16'], small['plain bf16 lowp'])} |",
        f"| plain autocast, native kernels / tessera's kernels | "
        f"{_both(small['plain bf16 autocast'], small['plain bf16 lowp'])} |",
        "",
    ]
    return lines + _precisions(res)


def _precisions(res: dict[str, Any]) -> list[str]:
    """Section 2, from the same rounds."""
    main, small, peaks = res["main"], res["small"], res["peaks"]
    fp32 = main["tessera fp32"]
    lines = ["## 2. Precisions on this machine: bf16, fp16, fp32, tf32", "",
             f"tessera's steps of section 1's rounds ({res['tokens']} tokens). fp16 runs with dynamic loss scaling "
             "(skipped steps: warm-up and rounds); tf32 is a CUDA matmul mode, on a CPU exactly the fp32 code path.",
             "", "| model.dtype | median step, wall (s) | median step, CPU (s) | speed-up vs fp32 (t_fp32 / t), wall "
             "| same, CPU time | skipped steps |", "|---|---:|---:|---:|---:|---:|"]
    for d in DTYPES:
        v = main[f"tessera {d}"]
        lines.append(f"| {d} | {_med(v):.3f} | {_med(v, 'cpu'):.3f} | {_both(fp32, v)} | "
                     f"{res['skipped'][d]} |")
    bf = [harness.paired(fp32[k], main["tessera bf16"][k])["median"] for k in ("wall", "cpu")]
    mfu = res["flops_per_token"] * res["tokens"] / _med(main["tessera bf16"]) / 1e12 / peaks["bf16"]
    flags = res["machine"]["flags"]
    lines += [
        "",
        f"With torch's native bf16 kernels (small batch): t_fp32 / t_bf16_native "
        f"{_both(small['tessera fp32'], small['tessera bf16 native']).replace(' | ', ' wall, ')} CPU.",
        "",
        f"Expected from bf16 matrix instructions: bf16 at least {EXPECTED}x faster than fp32. Measured {bf[0]:.2f}x "
        f"wall clock, {bf[1]:.2f}x CPU time: **{'holds' if min(bf) >= EXPECTED else 'does not hold here'}**. "
        + ("" if flags.get("avx512_bf16") or flags.get("amx_bf16") else
           "This CPU has no bf16 matrix instructions (no avx512_bf16 or AMX): a bf16 GEMM is an fp32 GEMM on upcast "
           "operands (the same FLOPs at the fp32 rate, plus the conversions) or torch's far slower reference kernel. ")
        + f"Matmul peak in this run (1024^3, `metrics.measure_matmul_tflops`): bf16 {peaks['bf16']:.3f}, fp32 "
        f"{peaks['fp32']:.3f} TFLOP/s ({peaks['bf16'] / peaks['fp32']:.2f}x); the bf16 step reaches {100 * mfu:.1f}% "
        "of the bf16 peak (MFU): the rest of the step -- elementwise ops, norms, softmax, the fp32 optimizer update, "
        "GEMMs too small to reach the peak -- gains little from bf16. Section 10 splits a step into these parts.",
        "",
        "Notes: " + " ".join([*res.get("notes", []), "Every variant starts from the same initial weights and batch, "
                              "so equal first-step losses show that both stacks compute the same model."]),
    ]
    return lines


def main(argv: Sequence[str] | None = None, prog: str = "python -m benchmarks", epilog: str = "") -> int:
    import argparse

    ap = harness.parser(prog, __doc__)
    ap.epilog, ap.formatter_class = epilog, argparse.RawDescriptionHelpFormatter
    ap.add_argument("--quick", action="store_true", help="a smaller batch and 3 rounds (about a minute)")
    ap.add_argument("--tiny", action="store_true", help="configs/tiny.py dims, seconds in all (the test mode)")
    ap.add_argument("--threads", type=positive_int, default=None, help="torch threads (default 1)")
    ap.add_argument("--config", default=None, help="model/optimizer config (default configs/demo.py)")
    ap.add_argument("--note", action="append", default=[], help="a sentence for the section's notes")
    ap.add_argument("overrides", nargs="*", help="key.sub=value overrides of that config")
    args = ap.parse_args(argv)
    size = SIZES["tiny" if args.tiny else "quick" if args.quick else "full"]
    size = dataclasses.replace(size, overrides=(*size.overrides, *args.overrides),
                               **({"threads": args.threads} if args.threads else {}),
                               **({"config": args.config} if args.config else {}))
    return harness.publish(args, argv, prog, SECTION, TITLE, lambda: {**measure(size), "notes": args.note}, markdown)


if __name__ == "__main__":
    sys.exit(main())
