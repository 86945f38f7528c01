"""Checkpoint tensors into host memory for writing.

CUDA tensors are copied into page-locked (pinned) host buffers, all copies queued without waiting
(``non_blocking``), then one wait per device before anything is written: a copy into pageable memory
is staged by the driver through its own small pinned buffer, one synchronous chunk at a time. The
pinned buffers come from torch's host cache; ``release_pinned_memory`` hands them back after the file
is written, so a save does not keep page-locked host memory (which a cgroup counts) between saves.

Which tensors share storage (tied weights) must be decided before this copy: each copy is a storage of
its own (``tessera.checkpoint.tree.prepare_tree`` does so).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tessera.logs import log_once

__all__ = ["host_copies", "release_pinned_memory"]


def _pinned_buffer(t: torch.Tensor) -> torch.Tensor:
    """An empty page-locked host tensor shaped like ``t`` (contiguous)."""
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)


def _wait_for_copies(devices: set[torch.device]) -> None:
    """Wait for the copies queued on each device's current stream (not for unrelated work elsewhere)."""
    for device in devices:
        torch.cuda.current_stream(device).synchronize()


def host_copies(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous host tensors with the values of ``tensors``, ready to be written.

    CPU tensors are used as they are (copied only when not contiguous), meta tensors (a dry run plans a
    save) stay meta, CUDA tensors go through pinned buffers and are complete when this returns.
    """
    out: dict[str, torch.Tensor] = {}
    pending: set[torch.device] = set()
    for name, t in tensors.items():
        if t.is_meta or t.device.type == "cpu":
            out[name] = t.contiguous()
        elif t.device.type == "cuda":
            buf = _pinned_buffer(t)
            buf.copy_(t, non_blocking=True)
            out[name] = buf
            pending.add(t.device)
        else:  # another accelerator: a plain (synchronous) copy
            out[name] = t.to("cpu").contiguous()
    if pending:
        log_once("checkpoint: CUDA tensors are copied to the host through pinned buffers (asynchronous copies, one "
                 "wait per device before writing; the buffers are released after each file)")
        _wait_for_copies(pending)
    return out


def release_pinned_memory() -> None:
    """Return the host cache's unused pinned buffers to the system (no-op when CUDA was never used)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.accelerator.memory.empty_host_cache()
