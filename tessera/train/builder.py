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
from functools import partial
from typing import Any

import torch
from torch import nn

from tessera.config import Config, RunConfig
from tessera.core.context import ParallelMode, gpc
from tessera.core.job import Job
from tessera.core.naive_amp import NaiveAMPModel, naive_amp_for, unwrap_model
from tessera.logs import log_once
from tessera.model import Transformer, build_model
from tessera.model.compile import compile_blocks, compiles_blocks
from tessera.optim.hybrid_zero import HybridZeroOptimizer
from tessera.optim.params import build_param_groups
from tessera.precision.plan import run_config_of
from tessera.train.lr_scheduler import WarmupCosineLR
from tessera.train.precision_telemetry import PrecisionTelemetry
from tessera.train.step import Trainer

__all__ = ["TrainingStack", "build_training_stack", "build_optimizer", "compile_enabled"]


@dataclass
class TrainingStack:
    """What ``build_training_stack`` returns; ``model`` is the precision wrapper."""

    model: NaiveAMPModel
    optimizer: HybridZeroOptimizer
    scheduler: WarmupCosineLR
    trainer: Trainer
    job: Job

    @property
    def inner_model(self) -> Transformer:
        """The decoder inside the wrapper (parameter names without the wrapper's prefix)."""
        decoder = unwrap_model(self.model)
        if not isinstance(decoder, Transformer):
            raise TypeError(f"the training stack wraps a {type(decoder).__name__}, not the tessera decoder")
        return decoder


def build_training_stack(
    cfg: RunConfig | Config | Mapping[str, Any],
    job: Job | None = None,
    *,
    sync_buffer: bool = True,
    before_cast: Callable[[nn.Module], None] | None = None,
    trainer_cls: type[Trainer] = Trainer,
) -> TrainingStack:
    """Build the whole stack for ``cfg`` (its typed view, a ``Config`` or its dict) as ``job`` describes the run.

    ``job`` defaults to the launched job (``gpc.job``), else a single process on the CPU.
    ``before_cast(model)`` runs on the fp32, TP-sharded decoder before the precision wrapper casts it
    (train.py loads a weights-only start there). ``sync_buffer`` is NaiveAMPModel's (average floating
    buffers over DP). ``trainer_cls`` lets tests drive a subclass of the one Trainer.
    """
    cfg = typed_view(cfg)
    job = job or gpc.job or Job.single_process(cfg)
    groups = job.groups
    model = build_model(cfg.model, tp_group=groups.tp, seed=job.seed, device=job.device, tensor_mode=job.tensor_mode,
                        tensor_rng=partial(gpc.seed, ParallelMode.TENSOR))  # a no-op stream until a launch seeds it
    if before_cast is not None:
        before_cast(model)
    amp = naive_amp_for(model, job.precision, sync_buffer=sync_buffer, parallel_mode=groups.dp, seed=job.seed)
    compiled = compile_enabled(cfg, job)
    if compiled:  # a no-op on meta parameters (dry runs)
        compile_blocks(model, backend=cfg.model.compile.backend, mode=cfg.model.compile.mode)
    optimizer = build_optimizer(amp, cfg, job)
    scheduler = WarmupCosineLR.from_config(optimizer.param_groups, cfg.adam, cfg.lr_scheduler)
    met = cfg.metrics
    telemetry = PrecisionTelemetry(  # none when off: nothing installed, nothing allocated
        model, optimizer, every=met.precision_every, group_by=met.precision_group,
        activations=met.precision_activations, tp_group=groups.tp, dp_group=groups.dp, world_group=groups.world,
        device=job.device) if met.precision_every > 0 else None
    trainer = trainer_cls(amp, optimizer, tp_group=groups.tp, dp_group=groups.dp, device=job.device,
                          label_smoothing=cfg.loss.label_smoothing, dp_size=job.layout.dp_size, telemetry=telemetry,
                          chunk_tokens=cfg.loss.chunk_tokens, compile_loss=compiled and job.device.type != "meta")
    return TrainingStack(amp, optimizer, scheduler, trainer, job)


def typed_view(cfg: RunConfig | Config | Mapping[str, Any]) -> RunConfig:
    """The typed view the builder reads: as given, a ``Config``'s, or a plain dict's after validation."""
    return run_config_of(cfg)


def compile_enabled(cfg: RunConfig | Config, job: Job) -> bool:
    """``model.compile.enabled``: True / False as set; ``"auto"`` compiles on CUDA and stays eager on the CPU
    (where compiling a short run costs more than it saves), and stays eager where the precision telemetry
    hooks module outputs inside the blocks. The choice is logged once."""
    cfg = typed_view(cfg)
    setting = cfg.model.compile.enabled
    hooks = bool(cfg.metrics.precision_every and cfg.metrics.precision_activations)
    enabled = compiles_blocks(setting, job.device.type, hooks)
    if setting != "auto":
        return enabled
    why = ("metrics.precision_activations hooks the blocks" if hooks and job.device.type == "cuda"
           else f"the device is {job.device.type}")
    log_once(f"model.compile.enabled='auto': compiled blocks {'on' if enabled else 'off'} ({why}); set it to "
             f"{not enabled} to override")
    return enabled


def build_optimizer(amp: NaiveAMPModel, cfg: RunConfig, job: Job) -> HybridZeroOptimizer:
    """AdamW from the config's ``adam`` section on the cast model, wrapped in a HybridZeroOptimizer over the
    job's groups and precision, whose state is keyed by the decoder's own parameter names."""
    adam = cfg.adam
    inner = torch.optim.AdamW(
        build_param_groups(amp, adam.weight_decay, adam.decay_norm_and_bias), lr=adam.lr,
        betas=(adam.adam_beta1, adam.adam_beta2), eps=adam.adam_eps, weight_decay=adam.weight_decay,
    )
    return HybridZeroOptimizer(inner, grad_scal_cfg=cfg.grad_scaler.as_dict(),
                               zero_cfg=cfg.hybrid_zero_optimizer.as_dict(), job=job, param_names=unwrap_model(amp))
