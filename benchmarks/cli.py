"""Benchmark tessera's training step side by side with plain PyTorch and write BENCHMARKS.md.

Run from the repository root (``benchmarks`` is not part of the installed package):

    python -m benchmarks [--quick] [--out BENCHMARKS.md] [--json results.json] [--threads N]
                         [--config configs/demo.py] [key.sub=value ...]
    python -m benchmarks --only-gpu --out BENCHMARKS_GPU.md      # the GPU section alone (needs CUDA)
    python -m benchmarks --render results.json --out BENCHMARKS.md  # re-render a saved run (no measuring)
    python -m benchmarks --section dp    # only section 7 (DP bytes and overlap), the rest of the file kept
    python -m benchmarks precision-study [--only NAME ...]   # section 8: the demo under each precision policy
    python -m benchmarks activations [--layers N ...]        # section 9's table: activation peak per TP rank
    python -m benchmarks roofline [--quick] [--against PATH]  # section 10: where a step's time goes, MFU
    python -m benchmarks attention-kernels [--only SHAPE ...] # CPU attention kernels side by side
    python -m benchmarks compile [--tp 2 --demo ...]         # section 11: compiled blocks vs eager step time
    python -m benchmarks precision-telemetry [--every 100]   # section 14: what the precision telemetry costs
    python -m benchmarks tensor-modes --against PATH         # section 15: the step in mtp and msp vs a base

Sections: (1) framework overhead vs a plain PyTorch step of the same model, (2) bf16/fp16/fp32/tf32,
(3) TP=2 and DP=2 vs one process on the same cores with the communication share, (4) measured bytes
per parameter vs the closed form, (5) TFLOP/s and MFU against a matmul peak measured in the same run,
(6) a bf16 step on configs/1B.py dims when CUDA is available. Variants are interleaved (A B A B ...)
and ratios are paired per round, because shared machines are noisy. ``--quick`` takes about a minute
on 2 cores; the full run about 4-6 minutes (more on a loaded machine).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import shlex
import sys
from collections.abc import Sequence

from tessera.cli_args import positive_int  # stdlib only: torch still loads after parsing


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _marks(name: str) -> tuple[str, str]:
    return f"<!-- section:{name} -->", f"<!-- /section:{name} -->"


def _sections(text: str) -> dict[str, str]:
    """The marked sections of a BENCHMARKS file: name -> text including its marks."""
    out = {}
    for line in text.splitlines():
        if line.startswith("<!-- section:"):
            name = line[len("<!-- section:") : -len(" -->")]
            start, end = _marks(name)
            if end in text:
                out[name] = text[text.index(start) : text.index(end) + len(end)]
    return out


def write_section(path: str, name: str, title: str, lines: list[str]) -> None:
    """Replace section ``name`` of ``path`` (or append it), leaving the rest of the file as it is."""
    start, end = _marks(name)
    block = "\n".join([start, title, "", *lines, end])
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        text = ""
    old = _sections(text).get(name)
    text = text.replace(old, block) if old else text.rstrip("\n") + "\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(text)


def keep_sections(path: str, text: str) -> str:
    """``text`` (a full run's markdown) with the marked sections of the file it replaces appended."""
    try:
        with open(path) as f:
            old = _sections(f.read())
    except FileNotFoundError:
        return text
    return text.rstrip("\n") + "".join("\n\n" + block for block in old.values()) + "\n"


# ``python -m benchmarks <name> ...``: measurements with command lines of their own -> their module
# (a ``main(argv, prog)``)
SUBCOMMANDS = {
    "precision-study": ("benchmarks.precision_study", "section 8: the demo trained under each precision policy"),
    "activations": ("benchmarks.activations", "section 9's table: activation peak and step time per TP rank"),
    "roofline": ("benchmarks.roofline", "sections 10 and 13 (--policies): a step split into GEMMs, attention, "
                                      "optimizer, collectives, rest"),
    "attention-kernels": ("benchmarks.attention_kernels", "CPU attention kernels per shape and dtype (1 thread)"),
    "compile": ("benchmarks.compile_step", "section 11: training step with compiled blocks vs eager"),
    "optimizer-update": ("benchmarks.optimizer_update", "section 12: the AdamW update per precision policy vs a base"),
    "precision-telemetry": ("benchmarks.precision_overhead",
                            "section 14: the demo with metrics.precision_every 0 vs N, paired rounds"),
    "tensor-modes": ("benchmarks.tensor_modes", "section 15: the demo's step in mtp and msp against a base checkout"),
}


def main(argv: Sequence[str] | None = None, prog: str = "python -m benchmarks") -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), measure, write the markdown; returns the exit status.
    A first argument naming one of ``SUBCOMMANDS`` runs that measurement with the rest."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        module = importlib.import_module(SUBCOMMANDS[argv[0]][0])
        return module.main(argv[1:], prog=f"{prog} {argv[0]}")
    epilog = "other measurements (each with its own --help):\n" + "\n".join(
        f"  {prog} {name:<16} {what}" for name, (_, what) in SUBCOMMANDS.items())
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0], epilog=epilog,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer rounds and a smaller batch (about a minute)")
    ap.add_argument("--tiny", action="store_true", help="configs/tiny.py dims, seconds in all (the test mode)")
    ap.add_argument("--out", default="BENCHMARKS.md", help="markdown file to write")
    ap.add_argument("--json", default=None, help="also write the raw results as JSON here")
    ap.add_argument("--threads", type=positive_int, default=None,
                    help="torch threads of the single-process sections")
    gpu = ap.add_mutually_exclusive_group()
    gpu.add_argument("--only-gpu", action="store_true", help="measure only the GPU section (needs CUDA)")
    gpu.add_argument("--no-gpu", action="store_true", help="skip the GPU section even when CUDA is available")
    ap.add_argument("--config", default=None,
                    help="model/optimizer config of the CPU sections (default: configs/demo.py)")
    ap.add_argument("--note", action="append", default=[], help="a line for the file's notes (context of the run)")
    ap.add_argument("--section", choices=["dp"], default=None,
                    help="measure one extra section and replace only it in --out (dp: DP=2 bytes per collective "
                         "vs the closed form, and overlap of the gradient reduction with backward on vs off)")
    ap.add_argument("--render", default=None, metavar="JSON",
                    help="write the markdown from a run saved with --json, without measuring")
    ap.add_argument("overrides", nargs="*", help="key.sub=value overrides of that config (e.g. model.hidden_size=256)")
    args = ap.parse_args(argv)

    import torch

    from benchmarks.report import gpu_only_markdown, to_markdown
    from benchmarks.runner import MODES, measure_gpu, run_bench
    from tessera.config import ConfigError

    mode = MODES["tiny" if args.tiny else "quick" if args.quick else "full"]
    if args.threads is not None:
        mode = dataclasses.replace(mode, threads=args.threads)
    if args.config is not None:
        mode = dataclasses.replace(mode, config=args.config)
    if args.overrides:
        mode = dataclasses.replace(mode, overrides=(*mode.overrides, *args.overrides))
    command = " ".join([prog, *(shlex.quote(a) for a in argv)])
    if args.render:
        with open(args.render) as f:
            result = json.load(f)
        with open(args.out, "w") as f:
            f.write(to_markdown(result, result["command"]) if "single" in result else
                    gpu_only_markdown(result, result["command"]))
        _log(f"wrote {args.out} from {args.render}")
        return 0
    if args.section == "dp":
        from benchmarks.dp import dp_markdown, measure_dp
        from benchmarks.runner import machine_info

        res = measure_dp(mode)
        info = machine_info()
        machine = f"{info.get('cpu', 'CPU')}, {info.get('cores', '?')} cores, torch {torch.__version__}"
        write_section(args.out, "dp", "## 7. Data parallelism: bytes per collective, and overlap with backward",
                      dp_markdown(res, command, machine))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
        _log(f"wrote the dp section of {args.out}")
        return 0
    if args.only_gpu and not torch.cuda.is_available():
        print("error: --only-gpu needs a CUDA device", file=sys.stderr)
        return 2
    try:  # a bad --config or key=value override surfaces as a ConfigError when the first section loads it
        if args.only_gpu:
            result = {"mode": dataclasses.asdict(mode), "gpu": measure_gpu(mode, "cuda", _log)}
            text = gpu_only_markdown(result, command)
        else:
            result = run_bench(mode, _log, gpu=False if args.no_gpu else None)
            result["notes"] = list(args.note)
            text = to_markdown(result, command)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result["command"] = command
    text = keep_sections(args.out, text)
    with open(args.out, "w") as f:
        f.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    _log(f"wrote {args.out}")
    return 0

