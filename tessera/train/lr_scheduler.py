"""Linear warmup then cosine decay to ``eta_min`` (InternEvo's ``lr_scheduler`` keys).

A pure function of the step, so resuming needs only the step number: no scheduler object state can
drift from the optimizer's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from tessera.config.typed import AdamConfig, LrSchedulerConfig


class WarmupCosineLR:
    """lr(step): 0 -> base_lr linearly over ``warmup_ratio * total_steps``, then cosine to ``eta_min``.

    ``init_steps`` shifts the schedule (a fine-tune that starts part-way); ``last_epoch`` is the index
    of the last completed step (-1: none), as in torch schedulers.
    """

    def __init__(self, param_groups: Iterable[dict[str, Any]], base_lr: float, total_steps: int,
                 warmup_ratio: float = 0.01, eta_min: float = 0.0, init_steps: int = 0, last_epoch: int = -1):
        self.param_groups = list(param_groups)
        self.base_lr = base_lr
        self.total_steps = total_steps
        self.warmup_steps = int(total_steps * warmup_ratio)
        self.eta_min = eta_min
        self.init_steps = init_steps
        self.last_epoch = last_epoch
        self._apply(self.lr_at(last_epoch + 1))

    @classmethod
    def from_config(cls, param_groups: Iterable[dict[str, Any]], adam_cfg: AdamConfig,
                    sched_cfg: LrSchedulerConfig) -> WarmupCosineLR:
        """From the config's typed ``adam`` (the base lr) and ``lr_scheduler`` sections."""
        return cls(param_groups, adam_cfg.lr, sched_cfg.total_steps, sched_cfg.warmup_ratio, sched_cfg.eta_min,
                   sched_cfg.init_steps, sched_cfg.last_epoch)

    def lr_at(self, step: int) -> float:
        """Learning rate used by optimizer step ``step`` (0-based)."""
        s = step + self.init_steps
        if self.warmup_steps and s < self.warmup_steps:
            return self.base_lr * (s + 1) / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (s - self.warmup_steps) / span)
        return self.eta_min + 0.5 * (self.base_lr - self.eta_min) * (1 + math.cos(math.pi * progress))

    def _apply(self, lr: float) -> None:
        for group in self.param_groups:
            group["lr"] = lr

    def step(self) -> None:
        """Advance one optimizer step and set the next step's learning rate."""
        self.last_epoch += 1
        self._apply(self.lr_at(self.last_epoch + 1))

    @property
    def current_lr(self) -> float:
        """The learning rate the next optimizer step will use."""
        return self.lr_at(self.last_epoch + 1)

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.last_epoch}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.last_epoch = int(state["last_epoch"])
        self._apply(self.lr_at(self.last_epoch + 1))
