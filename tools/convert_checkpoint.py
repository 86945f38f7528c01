"""Change a checkpoint's TP x DP layout offline, or consolidate it into one fp32 safetensors file.

    python tools/convert_checkpoint.py ckpts/run/step_200 ckpts/run_tp1 --tp 1 --dp 1
    python tools/convert_checkpoint.py ckpts/run/step_200 --consolidate run_200.safetensors

SRC: a ``step_<N>`` folder (or a save folder: its newest step). DST: a save folder that gets
``step_<N>`` (so ``train.py ckpt.save_ckpt_folder=DST`` resumes from it) or a ``step_<N>`` folder.
Model and optimizer shards are resharded along each tensor's partition dim (optimizer state is
already DP/ZeRO-independent); step, tokens, LR schedule and sampler position are kept; per-rank RNG
states are kept only when the layout does not change (train.py reseeds otherwise). Everything
streams one tensor at a time, so a 7B checkpoint converts in a few GB of RAM.

``data.micro_bsz`` is per DP rank: to keep the global batch when DP changes, resume with
``data.micro_bsz = old_micro_bsz * old_dp / new_dp``.

``--consolidate OUT.safetensors``: full fp32 tensors keyed by tessera parameter name (fp32 optimizer
masters when present), with the model config in the file's metadata.
"""

from __future__ import annotations

import argparse
import sys

from tessera.checkpoint import CheckpointError, consolidate, convert_checkpoint, read_meta, resolve_step_folder
from tessera.cli_args import positive_int


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src")
    p.add_argument("dst", nargs="?", help="destination save folder or step_<N> folder (with --tp/--dp)")
    p.add_argument("--tp", type=positive_int, default=None, help="new tensor-parallel size (default: unchanged)")
    p.add_argument("--dp", type=positive_int, default=None, help="new data-parallel size (default: unchanged)")
    p.add_argument("--consolidate", metavar="OUT.safetensors", default=None, help="write one full fp32 file")
    p.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the source shards")
    p.add_argument("--overwrite", action="store_true", help="replace an existing destination step folder")
    a = p.parse_args(argv)
    if a.dst is None and a.consolidate is None:
        p.error("give DST (with --tp/--dp) and/or --consolidate OUT.safetensors")
    if a.dst is None and (a.tp is not None or a.dp is not None):
        p.error("--tp/--dp set the layout of DST: give DST too (--consolidate alone always writes TP=1)")
    try:
        if a.consolidate:
            print(f"wrote {consolidate(a.src, a.consolidate, verify=not a.no_verify)}")
        if a.dst is not None:
            old = read_meta(resolve_step_folder(a.src))["layout"]
            tp = int(old["tp_size"]) if a.tp is None else a.tp
            dp = int(old["dp_size"]) if a.dp is None else a.dp
            out = convert_checkpoint(a.src, a.dst, tp=tp, dp=dp, verify=not a.no_verify, overwrite=a.overwrite)
            print(f"wrote {out}: TP {old['tp_size']} x DP {old['dp_size']} -> TP {tp} x DP {dp}")
            if dp != int(old["dp_size"]):
                print(f"note: keep the global batch with data.micro_bsz = old micro_bsz x {old['dp_size']} / {dp}")
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
