"""Per-module precision and measured training memory per parameter for a config's model.

    python tools/precision_report.py --config configs/tiny.py [--zero1 N] [--dtype bf16]
        [--fp32-modules "*norm*" output] [--use-fp32-norm] [--reduce-dtype fp32|model] [--json]
        [key.sub=value ...]
    python tools/precision_report.py --config configs/tiny.py --policies [--zero1 N] [--json]

Builds the config's decoder (TP=1, CPU), wraps it in NaiveAMPModel + HybridZeroOptimizer exactly as
training does, runs one step on random tokens and prints, per module, the parameter dtype, the compute
dtype and the fp32 marking, then the persistent bytes per parameter (weights, main grads, masters,
optimizer states) measured from the allocated tensors next to the closed form. ``--zero1 N`` runs the
measurement on N CPU processes (gloo) so the masters and states are really sharded N ways: the tool
starts itself under ``torchrun --standalone --nproc_per_node=N`` and rank 0 prints.
``--policies`` instead lists, for each optimizer precision policy (fp32 / bf16 masters, Kahan or
stochastic compensation, bf16 Adam moments), every persistent buffer with its dtype and bytes per
parameter, measured and closed form, without ZeRO and with ZeRO over N (default 2) processes.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
from collections.abc import Sequence

import torch

from tessera.cli_args import positive_int
from tessera.config import Config, ConfigError
from tessera.precision.plan import PrecisionPlan
from tessera.train.precision_report import policy_table, precision_report


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="a tessera config file")
    ap.add_argument("--zero1", type=positive_int, default=None,
                    help="ZeRO-1 size to measure (runs that many CPU processes under torchrun)")
    ap.add_argument("--dtype", default=None, help="override model.dtype (e.g. bf16, fp16, torch.tf32)")
    ap.add_argument("--fp32-modules", nargs="*", default=None, help="override model.fp32_modules patterns")
    ap.add_argument("--use-fp32-norm", action="store_true", default=None, help="set model.use_fp32_norm")
    ap.add_argument("--reduce-dtype", choices=("fp32", "model"), default=None,
                    help="override hybrid_zero_optimizer.reduce_dtype")
    ap.add_argument("--policies", action="store_true",
                    help="one table per optimizer precision policy (bf16 model), ZeRO 1 and --zero1 (default 2)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    args = ap.parse_args(argv)
    try:
        # --dtype is an override of model.dtype: a bad one fails here, before any process starts
        cfg = Config.from_file(args.config, [*args.overrides, *([f"model.dtype={args.dtype!r}"] if args.dtype else [])])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    nproc = (args.zero1 or 2) if args.policies else (args.zero1 or 1)
    if nproc > 1 and "WORLD_SIZE" not in os.environ:  # ZeRO over N ranks needs N processes: start them
        return _run_under_torchrun(nproc, list(sys.argv[1:] if argv is None else argv))
    if nproc > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        try:
            return _report(args, cfg, print if dist.get_rank() == 0 else lambda *a, **k: None)
        finally:
            dist.destroy_process_group()
    return _report(args, cfg, print)


def _run_under_torchrun(nproc: int, argv: list[str]) -> int:
    """This tool again, as a job of ``nproc`` CPU processes; its exit status."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.abspath(__file__), *argv]
    return subprocess.call(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"))


def _report(args: argparse.Namespace, cfg: Config, emit) -> int:
    try:
        from tessera.model import build_model  # imported lazily: the report itself needs no model code
    except ImportError as e:
        print(f"error: tessera.model.build_model is not available ({e})", file=sys.stderr)
        return 2
    run_cfg = cfg.typed  # the keys read here, checked by mypy
    model_cfg = run_cfg.model
    dtype = PrecisionPlan.from_config(cfg).model
    fp32_modules = list(model_cfg.fp32_modules) if args.fp32_modules is None else args.fp32_modules
    use_fp32_norm = model_cfg.use_fp32_norm if args.use_fp32_norm is None else args.use_fp32_norm
    reduce_dtype = args.reduce_dtype or run_cfg.hybrid_zero_optimizer.reduce_dtype
    g = torch.Generator().manual_seed(0)
    seq = min(run_cfg.data.seq_len, 64)  # memory per parameter does not depend on the batch
    batch = torch.randint(0, model_cfg.vocab_size, (1, seq), generator=g)
    if args.policies:
        text, rows = policy_table(functools.partial(build_model, model_cfg, tp_group=None, seed=run_cfg.seed,
                                                    device="cpu"), args.zero1 or 2, batch=batch)
        emit(json.dumps(rows, indent=1) if args.json else text)
        return 0
    model = build_model(model_cfg, tp_group=None, seed=run_cfg.seed, device="cpu")
    try:
        report = precision_report(model, dtype, args.zero1 or 1, batch=batch, fp32_modules=fp32_modules,
                                  use_fp32_norm=use_fp32_norm, reduce_dtype=reduce_dtype)
    except (ConfigError, ValueError) as e:  # a bad --dtype / --fp32-modules, or a --zero1 the job cannot run
        print(f"error: {e}", file=sys.stderr)
        return 2
    emit(report.to_json() if args.json else report.format())
    return 0


if __name__ == "__main__":
    sys.exit(main())
