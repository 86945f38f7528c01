"""Hugging Face export and import, streaming one tensor at a time.

What maps to what (families, names, ``config.json`` keys) is ``tessera.checkpoint.hf_config``; this
module moves the tensors. An import records the family it came from (``imported_from.family`` in
meta.json) so that the export writes the same family back when it can describe the model.

Vocabulary padding on import: tessera shards the vocabulary over TP, so it must divide by the TP
size. An HF vocabulary that does not is padded with zero rows (embedding and head) up to the next
multiple; those ids never occur in the data, their logits are exactly 0 before fine-tuning, and the
original size is recorded in meta.json (``hf_vocab_size``) so the export trims the rows again.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tessera.checkpoint.errors import CheckpointError
from tessera.checkpoint.folders import new_step_folder, output_step_folder
from tessera.checkpoint.hf_config import (
    EXPORT_DTYPES,
    from_hf_name,
    hf_config_from_model_cfg,
    hf_family,
    model_cfg_from_hf_config,
    to_hf_name,
)
from tessera.checkpoint.meta import file_entry, new_meta, shard_files, write_meta
from tessera.checkpoint.reshard import ParamLayout, param_layout, reshard
from tessera.checkpoint.safetensors_io import SafetensorsReader, SafetensorsWriter, read_header
from tessera.checkpoint.source import CheckpointSource
from tessera.checkpoint.tree import flat_state_metadata
from tessera.config import Config
from tessera.config.dtypes import dtype_from_name
from tessera.data.errors import DataError
from tessera.data.run_tokenizer import tokenizer_for_checkpoint
from tessera.data.tokenizer import HFTokenizer, write_hf_tokenizer_files
from tessera.precision.plan import storage_dtype

__all__ = ["to_hf_name", "from_hf_name", "hf_config_from_model_cfg", "model_cfg_from_hf_config", "export_hf",
           "import_hf", "parse_dtype_name"]

_VOCAB_ROWS = ("embedding.weight", "output.weight")  # vocab-indexed along dim 0


def parse_dtype_name(name: str) -> torch.dtype:
    """``fp32|bf16|fp16`` (or the long names) -> torch dtype."""
    return dtype_from_name(name, among=EXPORT_DTYPES)


def run_dtype(model_cfg: Mapping[str, Any]) -> torch.dtype:
    """The storage dtype a run trained in (tf32 is fp32 storage), from its saved ``model`` section."""
    return storage_dtype(model_cfg)


# ---------------------------------------------------------------------------------------- export
def export_hf(ckpt: str, out_dir: str, *, dtype: str | torch.dtype | None = None, vocab_size: int | None = None,
              tokenizer: str | None = None, verify: bool = True, overwrite: bool = False) -> dict[str, Any]:
    """Write ``out_dir`` (config.json, model.safetensors, generation_config.json, tokenizer files when
    the run had a tokenizer) from tessera checkpoint ``ckpt``, streaming one full tensor at a time.

    ``dtype``: output dtype (default: the run's training dtype); values come from the fp32 optimizer
    masters when present, so ``fp32`` is exact. ``vocab_size``: trim embedding/head rows (default: the
    HF size recorded by the import, else the model's). ``tokenizer``: ``"byte"``, a tokenizer.json,
    ``"none"`` (write no tokenizer files), or None for the run's own. Returns a summary dict.
    """
    os.makedirs(out_dir, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        if os.path.exists(os.path.join(out_dir, name)) and not overwrite:
            raise FileExistsError(f"{os.path.join(out_dir, name)} exists; pass --overwrite or choose another folder")
    with CheckpointSource(ckpt, verify=verify) as src:
        m = src.model_cfg
        if dtype is None:
            out_dtype = run_dtype(m)
        else:
            out_dtype = dtype if isinstance(dtype, torch.dtype) else parse_dtype_name(dtype)
        vocab = int(vocab_size or src.meta.get("hf_vocab_size") or m["vocab_size"])
        if not 0 < vocab <= int(m["vocab_size"]):
            raise ValueError(f"--vocab-size {vocab} must be in [1, model.vocab_size={m['vocab_size']}]")
        if tokenizer == "none":
            tok, tok_note = None, "--tokenizer none"
        else:
            tok, tok_note = tokenizer_for_checkpoint(src.path, src.meta, tokenizer)
        if tok is not None and tok.vocab_size > vocab:
            raise ValueError(f"the tokenizer ({tok_note}) has {tok.vocab_size} ids but the exported vocabulary only "
                             f"{vocab}; pass --tokenizer none or another tokenizer")
        # the family the import came from when it can describe the model (refused before anything is written)
        family = hf_family(m, prefer=(src.meta.get("imported_from") or {}).get("family"))
        names = src.param_names
        if m.get("tie_word_embeddings"):
            names = [n for n in names if n != "output.weight"]

        def out_shape(n: str) -> tuple[int, ...]:
            shape = list(src.full_shape(n))
            if n in _VOCAB_ROWS:
                shape[0] = vocab
            return tuple(shape)

        writer = SafetensorsWriter(os.path.join(out_dir, "model.safetensors"),
                                   [(to_hf_name(n), out_dtype, out_shape(n)) for n in names], {"format": "pt"})
        try:
            for n in names:
                t = src.full(n)
                if n in _VOCAB_ROWS:
                    t = t[:vocab]
                writer.write(to_hf_name(n), t.to(out_dtype))
            writer.close()
        except BaseException:
            writer.abort()
            raise
        eos = tok.eod_id if tok is not None else None
        config = hf_config_from_model_cfg(m, vocab_size=vocab, dtype=out_dtype, eos_token_id=eos, family=family)
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
            json.dump({"eos_token_id": eos, "bos_token_id": None, "pad_token_id": None}, f, indent=2)
        written = ["config.json", "generation_config.json", "model.safetensors"]
        if tok is not None:
            written += write_hf_tokenizer_files(tok, out_dir, int(m["max_position_embeddings"]))
        return {"out_dir": out_dir, "files": written, "dtype": str(out_dtype), "vocab_size": vocab,
                "weights_from": "fp32 optimizer masters" if src.has_optimizer else "model shards",
                "tokenizer": tok_note if tok is not None else f"none ({tok_note})", "source": src.path}


# ---------------------------------------------------------------------------------------- import
def _hf_weight_files(hf_dir: str) -> dict[str, str]:
    """HF tensor name -> safetensors file holding it (single file, sharded index, or any *.safetensors)."""
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map") or {}
        return {k: os.path.join(hf_dir, v) for k, v in weight_map.items()}
    files = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
    if not files:
        bins = [f for f in os.listdir(hf_dir) if f.endswith(".bin") or f.endswith(".pt")]
        hint = (f" (found {bins}: pickled weights are not loaded; re-save them with "
                "model.save_pretrained(..., safe_serialization=True))") if bins else ""
        raise CheckpointError(f"{hf_dir} holds no .safetensors weights{hint}")
    out: dict[str, str] = {}
    for file in files:
        path = os.path.join(hf_dir, file)
        for name in read_header(path)[0]:
            out[name] = path
    return out


def _eod_token_name(tokenizer_json: str, hf: Mapping[str, Any]) -> str | None:
    """The token string of the config's ``eos_token_id`` (the first one when it is a list)."""
    eos = hf.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if eos is None:
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    return Tokenizer.from_file(tokenizer_json).id_to_token(int(eos))


def import_hf(hf_dir: str, dst: str, *, tp: int, dtype: str | torch.dtype | None = None, step: int = 0,
              overwrite: bool = False) -> str:
    """Write a tessera checkpoint (model shards for ``tp`` ranks, meta.json, tokenizer) from the Hugging Face
    model in ``hf_dir`` (a family of ``tessera.checkpoint.hf_config``).

    ``dst``: a ``step_<N>`` folder, or a folder that gets ``step_<step>``. ``dtype``: storage dtype of the
    shards (default: each HF tensor's own). Returns the step folder, ready for ``ckpt.load_ckpt_folder``.
    """
    if tp < 1:
        raise ValueError(f"--tp must be >= 1, got {tp}")
    src = _read_hf_model(hf_dir, tp)
    out_dtype = None if dtype is None else (dtype if isinstance(dtype, torch.dtype) else parse_dtype_name(dtype))
    plan = _import_plan(src, out_dtype)
    final = output_step_folder(dst, step)
    with new_step_folder(final, overwrite=overwrite) as out:
        files = _write_model_shards(out, plan, src.layout, tp)
        extra: dict[str, Any] = {"hf_vocab_size": src.hf_vocab,
                                 "imported_from": {"path": os.path.abspath(hf_dir), "family": src.family,
                                                   "vocab_padded_to": src.model_cfg["vocab_size"]}}
        if os.path.isfile(os.path.join(hf_dir, "tokenizer.json")):
            for name in ("tokenizer.json", "tokenizer_config.json"):
                if os.path.isfile(os.path.join(hf_dir, name)):
                    shutil.copyfile(os.path.join(hf_dir, name), os.path.join(out, name))
                    files[name] = file_entry(os.path.join(out, name))
            extra["tokenizer"] = _tokenizer_record(os.path.join(out, "tokenizer.json"), src.hf)
        meta = new_meta(step=step, layout={"tp_size": tp, "dp_size": 1, "zero1_size": 1}, has_optimizer=False,
                        trainer_state={"progress": {"step": step, "consumed_tokens": 0}}, config=src.config,
                        files=files, **extra)
        write_meta(out, meta)
    return final


@dataclass(frozen=True)
class _HFModel:
    """A Hugging Face model folder as the import reads it: its config, the tessera config it maps to, the shard
    layout at the target TP size, and which safetensors file holds each tensor."""

    hf_dir: str
    cfg_path: str
    hf: dict[str, Any]
    model_cfg: dict[str, Any]
    hf_vocab: int
    family: str
    config: dict[str, Any]
    layout: ParamLayout
    tp: int
    weight_files: dict[str, str]


def _read_hf_model(hf_dir: str, tp: int) -> _HFModel:
    cfg_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"{cfg_path} is missing: not a Hugging Face model folder")
    with open(cfg_path) as f:
        hf = json.load(f)
    model_cfg, hf_vocab, family = model_cfg_from_hf_config(hf, tp, cfg_path)
    max_pos = model_cfg["max_position_embeddings"]
    raw = {"model": model_cfg, "parallel": {"tensor": {"size": tp}},
           "data": {"type": "synthetic", "seq_len": min(2048, max_pos, model_cfg["sliding_window"] or max_pos)}}
    try:
        config = Config.from_dict(raw, source=cfg_path).to_dict()
    except Exception as e:  # noqa: BLE001 - ConfigError/ValueError: name the problem and the file
        raise CheckpointError(f"{cfg_path} cannot be trained at tensor-parallel size {tp}: {e}") from None
    return _HFModel(hf_dir, cfg_path, hf, model_cfg, hf_vocab, family, config, param_layout(config["model"], tp), tp,
                    _hf_weight_files(hf_dir))


def _import_plan(src: _HFModel, out_dtype: torch.dtype | None) -> list[tuple[str, str, str, torch.dtype]]:
    """(tessera name, HF name, file, stored dtype) of every weight the import writes, shapes checked."""
    layout, tp = src.layout, src.tp
    headers = {p: read_header(p)[0] for p in set(src.weight_files.values())}
    wanted = [k for k in layout.state_keys if k not in layout.aliases]
    source: dict[str, str] = {}
    for hf_name in src.weight_files:
        name = from_hf_name(hf_name)
        if name is None:
            if hf_name.endswith("rotary_emb.inv_freq"):
                continue  # a recomputed buffer some older checkpoints contain
            raise CheckpointError(f"{src.hf_dir}: tensor {hf_name!r} has no tessera counterpart (a {src.family} model "
                                  "tessera cannot represent?)")
        if name == "output.weight" and src.model_cfg["tie_word_embeddings"]:
            continue  # tied: the head is the embedding
        source[name] = hf_name
    missing = [to_hf_name(k) for k in wanted if k not in source]
    if missing:
        raise CheckpointError(f"{src.hf_dir}: missing weights {missing[:5]}")
    plan = []
    for name in wanted:
        hf_name = source[name]
        info = headers[src.weight_files[hf_name]][hf_name]
        expect, dim = list(layout.shapes[name]), layout.dims[name]
        if dim is not None:
            expect[dim] *= tp
        if name in _VOCAB_ROWS:
            expect[0] = src.hf_vocab
        if tuple(info["shape"]) != tuple(expect):
            raise CheckpointError(f"{src.weight_files[hf_name]}: {hf_name} has shape {info['shape']}, {src.cfg_path} "
                                  f"implies {tuple(expect)}")
        plan.append((name, hf_name, src.weight_files[hf_name], out_dtype or info["dtype"]))
    return plan


def _write_model_shards(out: str, plan: list[tuple[str, str, str, torch.dtype]], layout: ParamLayout,
                        tp: int) -> dict[str, Any]:
    """Stream each planned tensor from its HF file into the ``tp`` model shards of ``out``; their file entries."""
    metadata = flat_state_metadata(layout.state_keys, layout.aliases)
    files: dict[str, Any] = {}
    writers = [SafetensorsWriter(os.path.join(out, name), [("/" + n, dt, layout.shapes[n]) for n, _, _, dt in plan],
                                 metadata) for name in shard_files("model", tp)]
    handles: dict[str, SafetensorsReader] = {}
    try:
        for name, hf_name, path, dt in plan:
            if path not in handles:
                handles[path] = SafetensorsReader(path)
            t = handles[path].get_tensor(hf_name).to(dt)
            if name in _VOCAB_ROWS and t.shape[0] != layout.shapes[name][0] * tp:
                pad = t.new_zeros(layout.shapes[name][0] * tp - t.shape[0], *t.shape[1:])
                t = torch.cat([t, pad])
            for w, piece in zip(writers, reshard([t], layout.dims[name], tp, name=name)):
                w.write("/" + name, piece)
        for name, w in zip(shard_files("model", tp), writers):
            files[name] = w.close()
    except BaseException:
        for w in writers:
            w.abort()
        raise
    finally:
        for h in handles.values():
            h.close()
    return files


def _tokenizer_record(path: str, hf: Mapping[str, Any]) -> dict[str, Any] | None:
    """meta.json's tokenizer description (as token folders write it) for an imported tokenizer.json."""
    try:
        tok = HFTokenizer(path, eod_token=_eod_token_name(path, hf))
    except DataError:
        return None  # no usable end-of-document token: tools then ask for --tokenizer
    return {**tok.describe(), "file": "tokenizer.json"}
