"""The one place the training stack is assembled: model -> NaiveAMPModel -> HybridZeroOptimizer -> LR
schedule -> Trainer, from a config and the process groups.

train.py, the dry run, the benchmarks and the tests all build through ``build_training_stack``; a
variant (no buffer sync, a subclassed trainer, weights loaded before the precision cast) is an
argument here, not a second copy of the assembly. ``tests/test_architecture.py`` fails when the stack
is put together anywhere else.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tessera.config import Config
from tessera.dist import ParallelMode, gpc
from tessera.model import build_model
from tessera.model.compile import compile_blocks
from tessera.optim.hybrid_zero import HybridZeroOptimizer
from tessera.optim.params import build_param_groups
from tessera.train.lr_scheduler import WarmupCosineLR
from tessera.train.naive_amp import NaiveAMPModel, naive_amp_from_config, unwrap_model
from tessera.train.precision_telemetry import PrecisionTelemetry
from tessera.train.step import Trainer

__all__ = ["Groups", "TrainingStack", "build_training_stack", "build_optimizer"]

ProcessGroup = dist.ProcessGroup


@dataclass(frozen=True)
class Groups:
    """The process groups a training stack talks to; None = that dimension has one rank."""

    tp: ProcessGroup | None = None
    dp: ProcessGroup | None = None
    zero1: ProcessGroup | None = None
    world: ProcessGroup | None = None

    @classmethod
    def from_gpc(cls) -> Groups:
        """The launched job's groups (none when nothing is launched: a single process)."""
        def group(mode: ParallelMode) -> ProcessGroup | None:
            return gpc.get_group(mode) if gpc.is_initialized(mode) else None

        return cls(tp=group(ParallelMode.TENSOR), dp=group(ParallelMode.DATA), zero1=group(ParallelMode.ZERO1),
                   world=group(ParallelMode.GLOBAL))

    @property
    def dp_size(self) -> int:
        return dist.get_world_size(self.dp) if self.dp is not None else 1


@dataclass
class TrainingStack:
    """What ``build_training_stack`` returns; ``model`` is the precision wrapper."""

    model: NaiveAMPModel
    optimizer: HybridZeroOptimizer
    scheduler: WarmupCosineLR
    trainer: Trainer

    @property
    def inner_model(self) -> nn.Module:
        """The decoder inside the wrapper (parameter names without the wrapper's prefix)."""
        return unwrap_model(self.model)


def build_training_stack(
    cfg: Config | Mapping[str, Any],
    groups: Groups | None = None,
    *,
    seed: int | None = None,
    device: torch.device | str | None = None,
    sync_buffer: bool = True,
    before_cast: Callable[[nn.Module], None] | None = None,
    trainer_cls: type[Trainer] = Trainer,
) -> TrainingStack:
    """Build the whole stack for ``cfg`` (a ``Config`` or its dict) over ``groups`` (default: gpc's).

    ``seed`` defaults to the config's, ``device`` to the launched job's (the CPU when none is).
    ``before_cast(model)`` runs on the fp32, TP-sharded decoder before the precision wrapper casts it
    (train.py loads a weights-only start there). ``sync_buffer`` is NaiveAMPModel's (average floating
    buffers over DP). ``trainer_cls`` lets tests drive a subclass of the one Trainer.
    """
    cfg = cfg if isinstance(cfg, Config) else Config.from_dict(cfg)  # validated, defaults filled
    groups = Groups.from_gpc() if groups is None else groups
    seed = cfg.seed if seed is None else seed
    device = gpc.device if device is None else torch.device(device)
    model = build_model(cfg.model, tp_group=groups.tp, seed=seed, device=device,
                        tensor_mode=cfg.parallel.tensor.mode)
    if before_cast is not None:
        before_cast(model)
    amp = naive_amp_from_config(model, cfg.model, sync_buffer=sync_buffer,
                                parallel_mode=groups.dp if groups.dp is not None else ParallelMode.DATA)
    if cfg.model.compile.enabled:  # a no-op on meta parameters (dry runs)
        compile_blocks(model, backend=cfg.model.compile.backend, mode=cfg.model.compile.mode)
    optimizer = build_optimizer(amp, cfg, groups, seed)
    scheduler = WarmupCosineLR.from_config(optimizer.param_groups, cfg.adam, cfg.lr_scheduler)
    met = cfg.metrics
    telemetry = PrecisionTelemetry(  # none when off: nothing installed, nothing allocated
        model, optimizer, every=met.precision_every, group_by=met.precision_group,
        activations=met.precision_activations, tp_group=groups.tp, dp_group=groups.dp, world_group=groups.world,
        device=device) if met.precision_every > 0 else None
    trainer = trainer_cls(amp, optimizer, tp_group=groups.tp, dp_group=groups.dp, device=device,
                          label_smoothing=cfg.loss.label_smoothing, dp_size=groups.dp_size, telemetry=telemetry)
    return TrainingStack(amp, optimizer, scheduler, trainer)


def build_optimizer(amp: NaiveAMPModel, cfg: Config, groups: Groups, seed: int) -> HybridZeroOptimizer:
    """AdamW from the config's ``adam`` section on the cast model, wrapped in a HybridZeroOptimizer whose
    state is keyed by the decoder's own parameter names (``seed``: the run's, for stochastic rounding)."""
    adam = cfg.adam
    inner = torch.optim.AdamW(
        build_param_groups(amp, adam.weight_decay, adam.decay_norm_and_bias), lr=adam.lr,
        betas=(adam.adam_beta1, adam.adam_beta2), eps=adam.adam_eps, weight_decay=adam.weight_decay,
    )
    return HybridZeroOptimizer(
        inner, grad_scal_cfg=cfg.grad_scaler, zero_cfg=cfg.hybrid_zero_optimizer, dtype=cfg.model.dtype,
        param_names=unwrap_model(amp), seed=seed, tp_group=groups.tp, dp_group=groups.dp,
        zero1_group=groups.zero1, global_group=groups.world,
    )
