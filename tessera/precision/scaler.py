"""Loss scalers: dynamic for fp16 (whose gradients underflow without one), constant 1 otherwise.

The scale is a plain Python float: it is read on the host every step anyway (to scale the loss and to
log), and a float keeps ``state_dict()`` loadable with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tessera.config import ConfigError
from tessera.config.dtypes import ModelDtype, resolve_model_dtype

__all__ = ["BaseGradScaler", "ConstantGradScaler", "DynamicGradScaler", "build_grad_scaler"]


class BaseGradScaler:
    """Interface: ``scale``, ``update(found_inf)``, ``state_dict()``/``load_state_dict()``."""

    def __init__(self, initial_scale: float) -> None:
        if not initial_scale > 0:
            raise ValueError(f"initial_scale must be > 0, got {initial_scale}")
        self._scale = float(initial_scale)

    @property
    def scale(self) -> float:
        return self._scale

    def update(self, found_inf: bool) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self._scale}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._scale = float(state["scale"])


class ConstantGradScaler(BaseGradScaler):
    """A fixed scale (1 by default): bf16/fp32/tf32 need no loss scaling; overflow still skips steps."""

    def __init__(self, scale: float = 1.0) -> None:
        super().__init__(scale)

    def update(self, found_inf: bool) -> None:  # found_inf unused: the scale never changes
        return None


class DynamicGradScaler(BaseGradScaler):
    """fp16 loss scaling with hysteresis.

    On overflow: the clean-step counter resets and one hysteresis step is counted; once the count
    reaches ``hysteresis`` the scale backs off (times ``backoff_factor``, clamped to ``min_scale``) and
    keeps backing off on every further overflow until the next growth. After ``growth_interval``
    consecutive clean steps the scale grows (times ``growth_factor``, clamped to ``max_scale``) and
    both counters reset. Hysteresis tolerates a lone overflow spike without halving the scale.
    """

    def __init__(
        self,
        initial_scale: float = 2**16,
        min_scale: float = 1,
        growth_factor: float = 2,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        max_scale: float = 2**24,
    ) -> None:
        super().__init__(initial_scale)
        if not 0 < min_scale <= initial_scale <= max_scale:
            raise ValueError(
                f"need 0 < min_scale <= initial_scale <= max_scale, got {min_scale}, {initial_scale}, {max_scale}"
            )
        if not growth_factor > 1:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if growth_interval < 1 or hysteresis < 1:
            raise ValueError(f"growth_interval and hysteresis must be >= 1, got {growth_interval}, {hysteresis}")
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self._growth_step = 0
        self._hysteresis_step = 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_step = 0
            self._hysteresis_step += 1
            if self._hysteresis_step >= self.hysteresis:
                self._scale = max(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_step += 1
            if self._growth_step >= self.growth_interval:
                self._growth_step = 0
                self._hysteresis_step = 0
                self._scale = min(self._scale * self.growth_factor, self.max_scale)

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self._scale,
            "growth_step": self._growth_step,
            "hysteresis_step": self._hysteresis_step,
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "hysteresis": self.hysteresis,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the scale and both counters; the hyperparameters stay as configured now."""
        self._scale = float(state["scale"])
        self._growth_step = int(state.get("growth_step", 0))
        self._hysteresis_step = int(state.get("hysteresis_step", 0))


def build_grad_scaler(
    grad_scaler_cfg: Mapping[str, Any] | None, precision: str | Any | ModelDtype
) -> BaseGradScaler:
    """The scaler a precision needs: dynamic (from the ``grad_scaler`` config section) for fp16, else 1.

    ``grad_scaler_cfg`` uses the config layout: ``fp16=dict(initial_scale, min_scale,
    growth_interval)`` plus ``growth_factor``, ``backoff_factor``, ``max_scale``, ``hysteresis``.
    """
    p = resolve_model_dtype(precision)
    if not p.uses_loss_scaling:
        return ConstantGradScaler(1.0)
    cfg = dict(grad_scaler_cfg or {})
    fp16 = dict(cfg.pop("fp16", None) or {})
    known_top = {"growth_factor", "backoff_factor", "max_scale", "hysteresis"}
    known_fp16 = {"initial_scale", "min_scale", "growth_interval"}
    for key in cfg:
        if key not in known_top:
            raise ConfigError(f"grad_scaler.{key}: unknown key; valid: {sorted(known_top | {'fp16'})}")
    for key in fp16:
        if key not in known_fp16:
            raise ConfigError(f"grad_scaler.fp16.{key}: unknown key; valid: {sorted(known_fp16)}")
    try:
        return DynamicGradScaler(**fp16, **cfg)
    except ValueError as e:
        raise ConfigError(f"grad_scaler: {e}") from None
