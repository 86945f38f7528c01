"""Print a model's parameter count, per-TP-rank shapes and training FLOPs per token, without weights.

    python tools/model_summary.py configs/7B.py [--tp N] [--seq-len S]

The model is built on the meta device with a ``MetaGroup`` standing in for the TP group, so nothing is
allocated and no process group is needed: the 7B takes a second or two. The count of the TP=1 build
is checked against the closed form ``tessera.model.count_parameters`` (exit status 1 on a mismatch).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from tessera.cli_args import positive_int
from tessera.config import Config, ConfigError
from tessera.config.typed import ModelConfig
from tessera.model import build_model, count_parameters, flops_per_token
from tessera.parallel import MetaGroup, partition_dim


def short_count(n: int) -> str:
    """A count in the largest unit it reaches: 6.74 B, 915.41 M, 921.60 K, 512."""
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return str(n)


def _meta_model(model_cfg: ModelConfig, tp: int) -> torch.nn.Module:
    return build_model(model_cfg, tp_group=MetaGroup(tp), seed=0, device="meta", tensor_rng=None)


def _full_count(model: torch.nn.Module, tp: int) -> int:
    """Parameters of the whole model from one rank's shards (sharded ones count tp times)."""
    return sum(p.numel() * (tp if partition_dim(p) is not None else 1) for p in model.parameters())


def summarize(config_path: str, tp: int | None = None, seq_len: int | None = None) -> str:
    """The summary text; raises SystemExit when the built model disagrees with ``count_parameters``."""
    cfg = Config.from_file(config_path).typed
    tp = cfg.parallel.tensor.size if tp is None else tp
    seq_len = cfg.data.seq_len if seq_len is None else seq_len
    expected = count_parameters(cfg.model)
    built = sum(p.numel() for p in _meta_model(cfg.model, 1).parameters())
    if built != expected:
        raise SystemExit(
            f"parameter count mismatch: meta model at tp=1 has {built:,}, count_parameters says {expected:,}"
        )
    model = _meta_model(cfg.model, tp)
    if _full_count(model, tp) != expected:
        raise SystemExit(f"tp={tp} shards add up to {_full_count(model, tp):,} parameters, expected {expected:,}")
    per_rank = sum(p.numel() for p in model.parameters())
    flops = flops_per_token(cfg.model, seq_len)
    lines = [
        f"config: {config_path}",
        f"parameters: {expected:,} ({short_count(expected)}), checked against the tp=1 meta build",
        f"tensor parallel: tp={tp}; per rank {per_rank:,} parameters ({short_count(per_rank)})",
        f"training FLOPs per token at seq_len={seq_len}: {flops:.4e} (fwd+bwd, no causal halving)",
        "",
        f"shapes per TP rank (tp={tp}); layers.1..{cfg.model.num_layers - 1} are like layers.0:",
    ]
    width = max(len(n) for n, _ in model.named_parameters())
    for name, p in model.named_parameters():
        if name.startswith("layers.") and not name.startswith("layers.0."):
            continue
        dim = partition_dim(p)
        how = "replicated" if dim is None else f"sharded dim {dim}"
        lines.append(f"  {name:<{width}}  {str(list(p.shape)):<16} {how}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--tp", type=positive_int, default=None, help="tensor-parallel size (default: the config's)")
    parser.add_argument("--seq-len", type=positive_int, default=None,
                        help="for FLOPs per token (default: data.seq_len)")
    args = parser.parse_args(argv)
    try:
        print(summarize(args.config, args.tp, args.seq_len))
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
