"""Offline checkpoint layout conversion (TP x DP) and consolidation into one fp32 file.

What changes with the layout, and why this is enough:

- model shards: only DP rank 0 writes them (replicas are identical), one file per TP rank. A new TP
  size concatenates every TP-sharded tensor along its partition dim (from the model's parameter tags,
  rebuilt on the meta device from meta.json's config) and slices it for each new rank; replicated
  tensors are copied.
- optimizer shards: saved gathered over ZeRO, keyed by parameter name, so they are already
  independent of the DP/ZeRO layout; only TP reshards them, exactly like the model (masters and Adam
  moments have their parameter's shape; scalars such as Adam's ``step`` are replicated).
- RNG states: per global rank, meaningless in another layout; they are carried over only when the
  layout is unchanged. ``load_checkpoint`` returns ``rng_states=None`` for a changed layout, and
  ``train.py`` then reseeds (seed + step).
- meta.json: new layout and TP/ZeRO sizes in the config; step, tokens, LR schedule and the data
  sampler's position (global rows, layout-free) are kept.

Everything streams: one full tensor at a time in memory, written straight into all new shard files.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Mapping
from typing import Any

import torch

from tessera.checkpoint.errors import CheckpointError
from tessera.checkpoint.folders import new_step_folder, output_step_folder
from tessera.checkpoint.meta import new_meta, shard_files, write_meta
from tessera.checkpoint.reshard import param_layout, reshard
from tessera.checkpoint.safetensors_io import SafetensorsWriter
from tessera.checkpoint.source import CheckpointSource
from tessera.config import Config

__all__ = ["convert_checkpoint", "consolidate", "load_consolidated_state"]

logger = logging.getLogger("tessera")


def _zero1_for(config: Mapping[str, Any], dp: int) -> tuple[int, int]:
    """(config value, resolved size) of ZeRO-1 for the new DP size; an impossible old value becomes -1."""
    z = int(((config.get("parallel") or {}).get("zero1") or {}).get("size", -1))
    if z == -1 or (z >= 1 and dp % z == 0):
        return z, dp if z == -1 else z
    logger.warning("parallel.zero1.size=%d does not divide the new data-parallel size %d; using -1 (whole group)",
                   z, dp)
    return -1, dp


def _new_config(config: Mapping[str, Any], tp: int, zero1: int) -> dict[str, Any]:
    new = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in config.items()}
    par = dict(new.get("parallel") or {})
    par["tensor"] = {**dict(par.get("tensor") or {}), "size": tp}
    par["zero1"] = {**dict(par.get("zero1") or {}), "size": zero1}
    new["parallel"] = par
    try:
        return Config.from_dict(new).to_dict()
    except Exception as e:  # noqa: BLE001 - report a config that cannot exist in the new layout
        raise CheckpointError(f"the checkpoint's config is invalid at TP={tp}: {e}") from None


def _reshard_file_set(src: CheckpointSource, kind: str, tp: int, out: str) -> dict[str, Any]:
    """Write ``kind`` (model/optim) shards for ``tp`` ranks into ``out``; returns their meta.json entries."""
    old_files = shard_files(kind, src.tp_size)
    new_files = shard_files(kind, tp)
    tensors, metadata = src.header(old_files[0])
    new_layout = param_layout(src.model_cfg, tp)
    for f in old_files[1:]:
        other = src.header(f)[0]
        if set(other) != set(tensors):
            raise CheckpointError(f"{src.path}/{f} holds different tensors than {old_files[0]}")
    plan: list[tuple[str, int | None, tuple[int, ...], torch.dtype]] = []  # key, dim, new shard shape, dtype
    for key, info in tensors.items():
        dim = src.layout.dim_of_path(key, len(info["shape"]))
        shape = list(info["shape"])
        if dim is not None:
            full = sum(src.header(f)[0][key]["shape"][dim] for f in old_files)
            if full % tp:
                raise CheckpointError(f"{src.path}/{old_files[0]}: {key} has size {full} along dim {dim}, "
                                      f"which does not split over tensor-parallel size {tp}")
            shape[dim] = full // tp
        plan.append((key, dim, tuple(shape), info["dtype"]))
    for key, _, new_shape, _ in plan:  # the new shards must fit the model the config describes at the new TP
        for part in key.split("/"):
            want = new_layout.shapes.get(part)
            if want is not None and len(new_shape) == len(want) and new_shape != want:
                raise CheckpointError(f"{key}: resharded shape {new_shape} != model shape {want} at TP={tp}")
    entries = [(k, dt, s) for k, _, s, dt in plan]
    writers = [SafetensorsWriter(os.path.join(out, n), entries, metadata) for n in new_files]
    try:
        for key, dim, _, _ in plan:
            parts = [src.tensor(f, key) for f in (old_files if dim is not None else old_files[:1])]
            for w, piece in zip(writers, reshard(parts, dim, tp, name=key)):
                w.write(key, piece)
            del parts
        return {n: w.close() for n, w in zip(new_files, writers)}
    except BaseException:
        for w in writers:
            w.abort()
        raise


def convert_checkpoint(src_path: str, dst: str, *, tp: int, dp: int | None = None, verify: bool = True,
                       overwrite: bool = False) -> str:
    """Rewrite checkpoint ``src_path`` for TP size ``tp`` and DP size ``dp`` (default: unchanged).

    ``dst``: a ``step_<N>`` folder, or a save folder that gets ``step_<N>`` (same step as the source), so
    ``train.py ckpt.save_ckpt_folder=<dst>`` resumes from it. Returns the written step folder.
    """
    with CheckpointSource(src_path, verify=verify) as src:
        dp = src.dp_size if dp is None else dp
        if tp < 1 or dp < 1:
            raise ValueError(f"--tp and --dp must be >= 1, got tp={tp} dp={dp}")
        zero1_cfg, zero1 = _zero1_for(src.config, dp)
        config = _new_config(src.config, tp, zero1_cfg)
        step = int(src.meta.get("step", 0))
        final = output_step_folder(dst, step)
        if os.path.abspath(final) == os.path.abspath(src.path):
            raise CheckpointError(f"refusing to convert {src.path} onto itself; choose another destination")
        same_layout = tp == src.tp_size and dp == src.dp_size
        with new_step_folder(final, overwrite=overwrite) as out:
            files = _reshard_file_set(src, "model", tp, out)
            if src.has_optimizer:
                files.update(_reshard_file_set(src, "optim", tp, out))
            if same_layout:  # per-rank RNG streams only mean something in the layout that produced them
                for name, entry in src.meta["files"].items():
                    if name.startswith("rng_rank"):
                        shutil.copyfile(os.path.join(src.path, name), os.path.join(out, name))
                        files[name] = entry
            for name in ("tokenizer.json", "tokenizer_config.json"):  # an imported checkpoint's tokenizer
                if name in src.meta["files"] and os.path.isfile(os.path.join(src.path, name)):
                    shutil.copyfile(os.path.join(src.path, name), os.path.join(out, name))
                    files[name] = src.meta["files"][name]
            old = src.meta["layout"]
            meta = new_meta(step=step, layout={"tp_size": tp, "dp_size": dp, "zero1_size": zero1},
                            has_optimizer=src.has_optimizer, trainer_state=src.meta.get("trainer_state", {}),
                            config=config, files=files,
                            converted_from={"path": os.path.abspath(src.path),
                                            "layout": {k: old.get(k) for k in ("tp_size", "dp_size", "zero1_size")},
                                            "rng_states_kept": same_layout})
            for key in ("tokenizer", "hf_vocab_size", "imported_from"):  # interop records travel along
                if key in src.meta:
                    meta[key] = src.meta[key]
            write_meta(out, meta)
    return final


def consolidate(src_path: str, out_file: str, *, verify: bool = True) -> str:
    """One fp32 safetensors file of full (TP=1) parameters keyed by tessera name, masters preferred.

    The file's metadata holds the model config (``tessera_model_config``) so it is self-describing; a
    tied output head is stored once, as ``embedding.weight``.
    """
    with CheckpointSource(src_path, verify=verify) as src:
        names = src.param_names
        entries = [(n, torch.float32, src.full_shape(n)) for n in names]
        metadata = {"format": "pt", "tessera_model_config": json.dumps(src.model_cfg),
                    "source": os.path.abspath(src.path), "step": str(src.meta.get("step"))}
        os.makedirs(os.path.dirname(os.path.abspath(out_file)), exist_ok=True)
        writer = SafetensorsWriter(out_file, entries, metadata)
        try:
            for n in names:
                writer.write(n, src.full(n).float())
            writer.close()
        except BaseException:
            writer.abort()
            raise
    return out_file


def load_consolidated_state(src: CheckpointSource, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Full state dict (every ``state_dict`` key, tied keys sharing one tensor) for a TP=1 model."""
    full = {n: src.full(n).to(dtype) for n in src.param_names}
    return {k: full[src.layout.aliases.get(k, k)] for k in src.layout.state_keys}
