"""Stream safetensors files tensor by tensor, in both directions.

Why not ``safetensors.torch.save_file``: it needs every tensor of a file in memory at once, and a
converted 7B optimizer shard (fp32 masters + two Adam moments, ~84 GB at TP=1) does not fit in RAM.
The format is simple enough to write incrementally: an 8-byte little-endian header length, a JSON
header giving every tensor's dtype, shape and byte range, then the raw bytes. All shapes are known
before any data is read (from the source headers), so the header is written first and each tensor
is appended as soon as it is produced, hashed on the way (the checkpoint's meta.json wants sha256).
Reading uses positioned reads of one tensor at a time (``SafetensorsReader``), not a memory map.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Iterable
from typing import Any

import torch

from tessera.config.dtypes import SAFETENSORS_CODES
from tessera.files import publish_file

__all__ = ["DTYPE_NAMES", "SafetensorsReader", "SafetensorsWriter", "read_header", "tensor_bytes"]

# safetensors dtype codes <-> torch dtypes, from the one table of dtype names (tessera.config.dtypes)
DTYPE_NAMES: dict[torch.dtype, str] = SAFETENSORS_CODES
NAME_DTYPES: dict[str, torch.dtype] = {v: k for k, v in DTYPE_NAMES.items()}
_MAX_HEADER = 100 * 1024 * 1024


def _read_raw_header(path: str) -> tuple[dict[str, Any], int]:
    """(header JSON, byte offset of the data section)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError("file shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER:
                raise ValueError(f"header length {n} is implausible")
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not a readable safetensors file: {e}") from None
    return header, 8 + n


def read_header(path: str) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """``({name: {"dtype", "shape", "offsets"}}, metadata)`` without reading any tensor data."""
    tensors, meta, _ = _parse_header(path)
    return tensors, meta


def _parse_header(path: str) -> tuple[dict[str, dict[str, Any]], dict[str, str], int]:
    header, data_start = _read_raw_header(path)
    meta = header.pop("__metadata__", None) or {}
    out: dict[str, dict[str, Any]] = {}
    for name, info in header.items():
        if info["dtype"] not in NAME_DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        out[name] = {"dtype": NAME_DTYPES[info["dtype"]], "shape": tuple(info["shape"]),
                     "offsets": tuple(info["data_offsets"])}
    return out, meta, data_start


class SafetensorsReader:
    """Read single tensors of a safetensors file with plain positioned reads.

    Why not ``safe_open``: it memory-maps the whole file, and every page it touches stays in the
    process's resident set until the file is closed, so streaming through a 80 GB optimizer shard
    would look like (and, under a cgroup limit, count as) 80 GB of memory. ``pread`` into a fresh
    tensor keeps only the tensors still referenced.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.tensors, self.metadata, self._data_start = _parse_header(path)
        self._fd = os.open(path, os.O_RDONLY)

    def keys(self) -> list[str]:
        return list(self.tensors)

    def get_tensor(self, name: str) -> torch.Tensor:
        info = self.tensors.get(name)
        if info is None:
            raise KeyError(f"{self.path} has no tensor {name!r}")
        begin, end = info["offsets"]
        return self._read(name, begin, end).view(info["dtype"]).reshape(info["shape"])

    def get_range(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of tensor ``name`` flattened (only those bytes are read)."""
        info = self.tensors.get(name)
        if info is None:
            raise KeyError(f"{self.path} has no tensor {name!r}")
        numel = math.prod(info["shape"])
        if not 0 <= start <= stop <= numel:
            raise ValueError(f"{self.path}: range [{start}, {stop}) outside {name!r} of {numel} elements")
        size = torch.empty(0, dtype=info["dtype"]).element_size()
        begin = info["offsets"][0]
        return self._read(name, begin + start * size, begin + stop * size).view(info["dtype"])

    def _read(self, name: str, begin: int, end: int) -> torch.Tensor:
        buf = torch.empty(end - begin, dtype=torch.uint8)
        # numpy's stubs give ndarray the buffer protocol on Python >= 3.12 only
        view = memoryview(buf.numpy())  # type: ignore[arg-type]
        done = 0
        while done < len(view):
            n = os.preadv(self._fd, [view[done:]], self._data_start + begin + done)
            if n <= 0:
                raise ValueError(f"{self.path}: unexpected end of file reading {name!r}")
            done += n
        return buf

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of ``t`` (CPU, contiguous), without a Python-level copy."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    # numpy's stubs give ndarray the buffer protocol on Python >= 3.12 only
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]


class SafetensorsWriter:
    """Write one safetensors file whose tensors are declared up front and supplied one at a time.

    ``entries``: ``(name, dtype, shape)`` in file order; ``write`` must then be called once per entry,
    in that order. The file appears under its final name only after ``close`` (a ``.tmp`` name
    before), so an interrupted conversion never leaves a plausible-looking truncated file.
    """

    def __init__(self, path: str, entries: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None) -> None:
        self.path = path
        self._tmp = path + ".tmp"
        self._order: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        header: dict[str, Any] = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        offset = 0
        for name, dtype, shape in entries:
            if name in header:
                raise ValueError(f"{path}: tensor {name!r} declared twice")
            if dtype not in DTYPE_NAMES:
                raise ValueError(f"{path}: cannot store dtype {dtype} for {name!r}")
            shape = tuple(int(s) for s in shape)
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            self._order.append((name, dtype, shape))
        blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
        blob += b" " * (-(8 + len(blob)) % 8)  # align the data section to 8 bytes, as safetensors does
        self._hash = hashlib.sha256()
        self._file = open(self._tmp, "wb")
        self._emit(struct.pack("<Q", len(blob)) + blob)
        self._next = 0

    def _emit(self, data: bytes | memoryview) -> None:
        self._file.write(data)
        self._hash.update(data)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append ``tensor`` as the next declared entry (its dtype and shape must match the declaration)."""
        if self._next >= len(self._order):
            raise ValueError(f"{self.path}: unexpected tensor {name!r}; every declared tensor is written")
        want_name, dtype, shape = self._order[self._next]
        if name != want_name:
            raise ValueError(f"{self.path}: expected tensor {want_name!r} next, got {name!r}")
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"{self.path}: {name!r} declared {dtype} {shape}, "
                             f"got {tensor.dtype} {tuple(tensor.shape)}")
        self._emit(tensor_bytes(tensor))
        self._next += 1

    def close(self) -> dict[str, Any]:
        """Finish the file (fsync, rename into place); returns ``{"size", "sha256"}`` for meta.json."""
        if self._next != len(self._order):
            missing = [n for n, _, _ in self._order[self._next:]]
            self.abort()
            raise ValueError(f"{self.path}: closed before writing {missing[:5]}")
        self._file.close()
        publish_file(self._tmp, self.path)
        return {"size": os.path.getsize(self.path), "sha256": self._hash.hexdigest()}

    def abort(self) -> None:
        """Drop the partial file."""
        if not self._file.closed:
            self._file.close()
        if os.path.exists(self._tmp):
            os.remove(self._tmp)
