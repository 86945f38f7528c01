"""Import a Hugging Face model folder (config.json + safetensors) as a tessera checkpoint at TP size N.

    python tools/import_hf.py path/to/hf_model ckpts/model_tp2 --tp 2
    torchrun --nproc_per_node=2 train.py --config my_finetune.py ckpt.load_ckpt_folder=ckpts/model_tp2/step_0

Families: Llama 2 and 3.x (rope scaling "llama3" / "linear" / "yarn", explicit head_dim, tied embeddings),
Mistral, Qwen2 / Qwen2.5 and Qwen3 (dense); ``tessera.checkpoint.hf_config`` says which config keys each
one maps to. OUT is a save folder that gets ``step_0`` (or a ``step_<N>`` folder, written as is). The
checkpoint has model shards only (``has_optimizer: false``) and a meta.json whose config describes the
network; the tool prints that ``model`` section to paste into the fine-tuning config (``data`` there is a
placeholder). Weights stream tensor by tensor in their stored dtype unless ``--dtype`` is given.
``tokenizer.json`` (and ``tokenizer_config.json``) are copied into the step folder and recorded in
meta.json, so ``tools/generate.py`` and ``tools/export_hf.py`` find them.

Vocabulary not divisible by N: the embedding and head get zero rows up to the next multiple of N
(``model.vocab_size`` in the config is the padded size; the padded ids never occur in data, and their
logits are 0 until fine-tuning moves them). The HF size is recorded (``hf_vocab_size``) and
``tools/export_hf.py`` trims back to it. Anything the decoder cannot compute (another activation, partial
rotary, length-dependent rope scaling) is an error naming the key.
"""

from __future__ import annotations

import argparse
import sys

from tessera.checkpoint import CheckpointError, import_hf, read_meta
from tessera.cli_args import positive_int
from tessera.config.schema import SCHEMA, Key, Section


def model_section(model: dict) -> str:
    """``model = dict(...)`` for a config file: the keys whose value is not tessera's default (sub-sections such
    as ``compile`` are training choices, left out)."""
    spec = SCHEMA.keys["model"]
    assert isinstance(spec, Section)
    keys = "".join(f"    {k}={v!r},\n" for k, v in model.items()
                   if isinstance(key := spec.keys.get(k), Key) and key.default != v)
    return f"model = dict(\n{keys})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("hf_folder")
    p.add_argument("out", help="save folder (gets step_0) or a step_<N> folder")
    p.add_argument("--tp", type=positive_int, required=True, help="tensor-parallel size of the checkpoint")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None, help="default: as stored")
    p.add_argument("--overwrite", action="store_true")
    a = p.parse_args(argv)
    try:
        path = import_hf(a.hf_folder, a.out, tp=a.tp, dtype=a.dtype, overwrite=a.overwrite)
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {path}  (fine-tune with: train.py ... ckpt.load_ckpt_folder='{path}')")
    print("the network, for the fine-tuning config (keep the other model keys yours, e.g. checkpoint):")
    print(model_section(read_meta(path)["config"]["model"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
