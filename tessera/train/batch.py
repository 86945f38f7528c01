"""Micro-batches from the host to the compute device: what needs the host done before the copy.

The packed-document boundaries (``cu_seqlens``) are checked and the longest document (``max_seqlen``,
carried on as a Python int under that key) computed while the batch is still on the host: read on the
GPU, either would wait for the device once per micro-batch, and a malformed batch would reach the
varlen kernel unchecked. On CUDA the tensors go through page-locked (pinned) memory, so the copies
are asynchronous (``non_blocking``) instead of staged through pageable memory by the driver; elsewhere
they are copied as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tessera.model.attention import check_cu_seqlens

__all__ = ["host_checks", "to_device"]


def host_checks(batch: Mapping[str, Any], where: str = "batch") -> dict[str, Any]:
    """``batch`` with ``max_seqlen`` added when it has ``cu_seqlens`` (checked here; ``ValueError`` naming
    ``where`` and the problem when malformed). Host tensors only: nothing is read from a device."""
    out = dict(batch)
    cu = batch.get("cu_seqlens")
    if cu is not None and "max_seqlen" not in batch:
        rows, seqlen = batch["input_ids"].shape
        try:
            out["max_seqlen"] = check_cu_seqlens(cu, rows, seqlen)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    return out


def to_device(batch: Mapping[str, Any], device: torch.device, where: str = "batch") -> dict[str, Any]:
    """``host_checks``, then every tensor copied to ``device`` (on CUDA: pinned first, then non-blocking)."""
    checked = host_checks(batch, where)
    pin = device.type == "cuda"
    out: dict[str, Any] = {}
    for key, value in checked.items():
        if isinstance(value, torch.Tensor) and value.device != device:
            if pin and value.device.type == "cpu":
                value = value.pin_memory()  # the tensor itself when already pinned
            value = value.to(device, non_blocking=pin)
        out[key] = value
    return out
