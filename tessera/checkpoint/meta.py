"""A checkpoint step folder's file names and its ``meta.json``: build, write (last), read, verify.

Layout of ``<save_ckpt_folder>/step_<N>/``::

    model_tp<r>.safetensors   TP-rank r's model shard (written by the DP-rank-0 replica)
    optim_tp<r>_zero<z>.safetensors
                              ZeRO-rank z's shard of TP-rank r's optimizer state (masters, Adam
                              moments, scaler; ``optim_shards``), written by the DP-rank-0 ZeRO group
    optim_tp<r>.safetensors   (instead, in converted and older checkpoints) TP-rank r's whole
                              optimizer state, gathered over ZeRO
    rng_rank<g>.safetensors   RNG states of global rank g
    meta.json                 step, tokens, config, layout, trainer state, file sizes + sha256

``meta.json`` is written last, atomically, with a digest of its own content (``meta_sha256``); its
presence is what makes a step folder complete, and it vouches for every other file's size and hash.
Every writer (training save, offline conversion, Hugging Face import) builds it with ``new_meta`` and
writes it with ``write_meta``.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Mapping
from typing import Any

import tessera
from tessera.checkpoint.errors import CheckpointError
from tessera.files import atomic_write_text, sha256_file

__all__ = ["CHECKPOINT_FORMAT", "META_FILE", "shard_name", "shard_files", "rng_name", "file_entry",
           "new_meta", "write_meta", "read_meta", "verify_files"]

CHECKPOINT_FORMAT = 1
META_FILE = "meta.json"


def shard_name(kind: str, tp_rank: int) -> str:
    """``model_tp0.safetensors`` ... for ``kind`` in (model, optim)."""
    return f"{kind}_tp{tp_rank}.safetensors"


def shard_files(kind: str, tp_size: int) -> list[str]:
    """Every TP rank's shard file of ``kind``, in rank order."""
    return [shard_name(kind, r) for r in range(tp_size)]


def rng_name(global_rank: int) -> str:
    return f"rng_rank{global_rank}.safetensors"


def file_entry(path: str) -> dict[str, Any]:
    """meta.json's ``files`` entry for a written file: its size and sha256."""
    return {"size": os.path.getsize(path), "sha256": sha256_file(path)}


def new_meta(*, step: int, layout: Mapping[str, Any], has_optimizer: bool, trainer_state: Mapping[str, Any],
             config: Mapping[str, Any] | None, files: Mapping[str, Any], **extra: Any) -> dict[str, Any]:
    """A meta.json dict. ``layout``: ``tp_size``, ``dp_size``, ``zero1_size`` (and ``world_size``, default
    tp x dp), e.g. ``dataclasses.asdict(layout)`` of a ``tessera.core.layout.Layout``; its per-rank fields are
    recorded as None."""
    tp, dp = int(layout["tp_size"]), int(layout["dp_size"])
    return {
        "format": CHECKPOINT_FORMAT,
        "tessera_version": tessera.__version__,
        "step": step,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "layout": {"global_rank": None, "world_size": int(layout.get("world_size", tp * dp)), "tp_rank": None,
                   "tp_size": tp, "dp_rank": None, "dp_size": dp, "zero1_size": int(layout["zero1_size"])},
        "has_optimizer": has_optimizer,
        "trainer_state": dict(trainer_state),
        "config": config,
        "files": dict(files),
        **extra,
    }


def _meta_digest(meta: Mapping[str, Any]) -> str:
    """sha256 of meta.json's content (all but this digest)."""
    body = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def write_meta(folder: str, meta: dict[str, Any]) -> None:
    """Write ``folder/meta.json`` atomically with its self-digest (``meta_sha256``); call it last."""
    meta["meta_sha256"] = _meta_digest(meta)
    atomic_write_text(os.path.join(folder, META_FILE), json.dumps(meta, indent=2, default=str))


def read_meta(path: str) -> dict[str, Any]:
    """meta.json of step folder ``path``, checked (format, self-digest, required keys)."""
    meta_path = os.path.join(path, META_FILE)
    if not os.path.isfile(meta_path):
        raise CheckpointError(f"{meta_path} is missing: {path} is not a complete checkpoint")
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:  # ValueError: bad JSON or bad UTF-8
        raise CheckpointError(f"{meta_path} is damaged or unreadable: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(f"{meta_path}: unsupported checkpoint format {got!r}")
    if "meta_sha256" in meta and meta["meta_sha256"] != _meta_digest(meta):
        raise CheckpointError(f"{meta_path} is damaged: its content does not match its sha256")
    missing = [k for k in ("step", "layout", "files", "trainer_state") if k not in meta]
    if missing:
        raise CheckpointError(f"{meta_path} is damaged: missing {missing}")
    return meta


def verify_files(path: str, names: list[str], meta: Mapping[str, Any]) -> None:
    """Check size and sha256 of ``names`` against meta.json; raise naming the first damaged file."""
    for name in names:
        full = os.path.join(path, name)
        want = meta["files"].get(name)
        if want is None:
            raise CheckpointError(f"{full} is not listed in {path}/{META_FILE}")
        if not os.path.isfile(full):
            raise CheckpointError(f"{full} is missing")
        size = os.path.getsize(full)
        if size != want["size"]:
            raise CheckpointError(f"{full} is damaged: size {size} bytes, expected {want['size']}")
        if sha256_file(full) != want["sha256"]:
            raise CheckpointError(f"{full} is damaged: sha256 does not match meta.json")
