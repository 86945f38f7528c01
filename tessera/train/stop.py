"""Stopping a run cleanly: SIGTERM / SIGINT / a stop file / a rank's problem, agreed on by every rank at a step
boundary."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from tessera.parallel.coordination import reduce_scalars, share_texts

__all__ = ["StopRequest"]


@dataclass
class StopRequest:
    """SIGTERM / SIGINT / a stop file, agreed on by all ranks at a step boundary.

    The handler only sets a flag; the ranks all-reduce it once per step, so every rank stops after the
    same step and can save a checkpoint together instead of dying at different points.
    """

    stop_file: str | None = None
    reason: str | None = None
    problems: list[str] = field(default_factory=list)  # every rank's problem of the last agreement (should_stop)
    _signals: list[int] = field(default_factory=list)

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handler)

    def _handler(self, signum: int, frame: Any) -> None:
        self._signals.append(signum)
        self.reason = signal.Signals(signum).name

    def consume(self) -> None:
        """Remove an honoured stop file (after all ranks agreed), so the next launch is not stopped."""
        if self.stop_file:
            try:
                os.remove(self.stop_file)
            except FileNotFoundError:  # another rank on a shared filesystem removed it first
                pass

    def should_stop(self, group: dist.ProcessGroup | None = None,
                    problem: str | None = None) -> tuple[bool, str | None]:
        """Whether any rank of ``group`` (default: all ranks) was asked to stop; the same answer everywhere.

        ``problem``: this rank's reason to stop with an error (e.g. its metrics file cannot be written). It
        rides on the same reduction (no extra collective while no rank has one); when any rank has one,
        every rank gets the texts in ``problems`` and the answer is to stop, with them as the reason.
        The flags are reduced on the device the group's backend serves (on NCCL: the GPU).
        """
        local = bool(self._signals) or bool(self.stop_file and os.path.exists(self.stop_file))
        if local and self.reason is None:
            self.reason = f"stop file {self.stop_file}"
        stop, failed = reduce_scalars([1 if local else 0, 0 if problem is None else 1], group, op=dist.ReduceOp.MAX,
                                      dtype=torch.int32)
        self.problems = share_texts(problem, group) if failed else []
        if self.problems:
            return True, "; ".join(self.problems)
        return bool(stop), (self.reason or "stop requested on another rank") if stop else None
