"""Nested state (dicts, lists, tensors, primitives) <-> one safetensors file, never unpickled.

The tensors are stored under their path in the tree (``/master/norm.weight``); the non-tensor
structure is a JSON "skeleton" in the file's metadata. Tensors sharing storage (tied weights) are
stored once; the file's ``aliases`` metadata maps the other paths to the stored one. A parameter
``name`` of a model state dict is therefore ``/name`` in a model shard, and ``/master/name`` and
``/state/name/<key>`` in an optimizer shard.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from tessera.checkpoint.errors import CheckpointError
from tessera.checkpoint.host_copy import host_copies, release_pinned_memory
from tessera.checkpoint.meta import file_entry
from tessera.files import atomic_write

__all__ = ["write_tree", "prepare_tree", "read_tree", "flat_state_metadata", "tree_nbytes"]


def _encode(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Nested dict/list/tensor/primitive -> JSON skeleton; tensors collected under their path."""
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj.detach()  # where it lives: aliases are found before any copy to the host
        return {"t": path}
    if isinstance(obj, Mapping):
        return {"d": [[k, _encode(v, f"{path}/{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {"l": [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(obj)], "tuple": isinstance(obj, tuple)}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"v": obj}
    if isinstance(obj, torch.dtype):
        return {"dtype": str(obj)}
    raise CheckpointError(f"cannot save a value of type {type(obj).__name__} at {path!r} in a checkpoint")


def _decode(node: Any, get: Callable[[str], torch.Tensor]) -> Any:
    if "t" in node:
        return get(node["t"])
    if "d" in node:
        return {k: _decode(v, get) for k, v in node["d"]}
    if "l" in node:
        items = [_decode(v, get) for v in node["l"]]
        return tuple(items) if node.get("tuple") else items
    if "dtype" in node:
        return getattr(torch, node["dtype"].split(".")[-1])
    return node["v"]


def _byte_range(t: torch.Tensor) -> tuple[int, int, int]:
    """(storage identity, first byte, end byte) of a contiguous tensor within its storage."""
    start = int(t.storage_offset()) * t.element_size()  # torch types the offset int | SymInt
    return t.untyped_storage()._cdata, start, start + t.numel() * t.element_size()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when the (contiguous) tensors share bytes."""
    if not a.numel() or not b.numel():
        return False
    sa, a0, a1 = _byte_range(a)
    sb, b0, b1 = _byte_range(b)
    return sa == sb and a0 < b1 and b0 < a1


def _alias_key(t: torch.Tensor) -> tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype]:
    """Tensors with the same key are the same values in the same memory (storage identity, offset, shape,
    strides, dtype): stored once."""
    return (t.untyped_storage()._cdata, int(t.storage_offset()), tuple(t.shape), tuple(t.stride()), t.dtype)


def prepare_tree(obj: Any) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The host tensors and metadata ``write_tree`` stores for ``obj``: each storage once (tied weights are
    aliases), views of one flat buffer as they are, only partly overlapping tensors copied (safetensors
    refuses them). Aliases are found on the tensors where they live, before the copy to the host
    (``host_copies``), which gives every device tensor a storage of its own. Storages are told apart by
    identity, so this also plans a save of meta tensors."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _encode(obj, "", tensors)
    seen: dict[tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype], str] = {}
    aliases: dict[str, str] = {}
    unique: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        key = _alias_key(t) if t.numel() else None
        if key is not None and key in seen:
            aliases[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
        unique[name] = t
    stored: dict[str, torch.Tensor] = {}
    for name, t in host_copies(unique).items():
        stored[name] = t.clone() if any(_overlap(t, u) for u in stored.values()) else t
    return stored, {"skeleton": json.dumps(skeleton), "aliases": json.dumps(aliases)}


def tree_nbytes(obj: Any) -> int:
    """Bytes of the tensors ``write_tree`` would store for ``obj`` (each view of a storage once), without
    copying anything: the size of its file, short of the header."""
    seen: set[tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype]] = set()
    total = 0

    def visit(node: Any) -> None:
        nonlocal total
        if isinstance(node, torch.Tensor):
            key = _alias_key(node)
            if key not in seen:
                seen.add(key)
                total += node.numel() * node.element_size()
        elif isinstance(node, Mapping):
            for v in node.values():
                visit(v)
        elif isinstance(node, (list, tuple)):
            for v in node:
                visit(v)

    visit(obj)
    return total


def write_tree(path: str, obj: Any) -> dict[str, Any]:
    """Write ``obj`` to ``path`` atomically; returns its meta.json entry (size and sha256). A failed write
    (no space left, quota, I/O error) raises ``OSError`` with its errno and the file's name."""
    unique, metadata = prepare_tree(obj)
    try:
        atomic_write(path, lambda tmp: _save_file(unique, tmp, metadata))
    finally:
        unique.clear()  # the last references to the host copies: their pinned buffers go back, then are released
        release_pinned_memory()
    return file_entry(path)


def _save_file(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str]) -> None:
    """``save_file``, its operating-system errors raised as ``OSError`` (safetensors wraps them as
    ``SafetensorError("... No space left on device (os error 28)")``)."""
    try:
        save_file(tensors, path, metadata=metadata)
    except SafetensorError as e:
        code = re.search(r"os error (\d+)", str(e))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), path) from e


def flat_state_metadata(keys: Sequence[str], aliases: Mapping[str, str]) -> dict[str, str]:
    """The metadata ``write_tree`` gives a flat state dict ``{key: tensor}`` (tensors under ``/key``;
    ``aliases``: key -> the key whose tensor it shares), for writers that stream the tensors themselves."""
    return {"skeleton": json.dumps({"d": [[k, {"t": "/" + k}] for k in keys]}),
            "aliases": json.dumps({"/" + k: "/" + v for k, v in aliases.items()})}


def read_tree(path: str) -> Any:
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        aliases = json.loads(meta.get("aliases", "{}"))
        return _decode(json.loads(meta["skeleton"]), lambda name: f.get_tensor(aliases.get(name, name)))
