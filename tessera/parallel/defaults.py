"""Where a leaf finds the process's launch defaults without importing the launcher.

``build_model(model_cfg)`` is documented to default to the launched job's tensor-parallel group, seed,
device, TENSOR RNG stream and tensor mode. ``tessera.core.parallel_context`` registers a provider of
those here when it is imported, read from the launched run description (``gpc.job``); ``tessera.model``
asks for them only when the caller passed none. So the imports still run one way (``core`` ->
``parallel`` <- ``model``) and a plain single process (nothing registered, or nothing launched) gets
no TP, seed 1024 and the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["LaunchDefaults", "register_launch_defaults", "launch_defaults"]


@dataclass(frozen=True)
class LaunchDefaults:
    tp_group: dist.ProcessGroup | None = None
    seed: int | None = None
    device: torch.device | None = None
    tensor_rng: Callable[[], AbstractContextManager[Any]] | None = None
    tensor_mode: str | None = None  # parallel.tensor.mode: "mtp" or "msp" (sequence parallelism)


_provider: Callable[[], LaunchDefaults] | None = None


def register_launch_defaults(provider: Callable[[], LaunchDefaults] | None) -> None:
    """Install (or with None remove) the callable that describes the launched job."""
    global _provider
    _provider = provider


def launch_defaults() -> LaunchDefaults:
    """The launched job's defaults, or empty ones when nothing launched this process."""
    return _provider() if _provider is not None else LaunchDefaults()
