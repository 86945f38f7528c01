"""The run's precision plan: every fact that decides a number's format, resolved once from the typed config.

``PrecisionPlan.from_run`` is the only reader of ``model.dtype`` and the precision keys around it
(``model.allow_reduced_precision_reduction``, ``model.fp32_modules``, ``model.use_fp32_norm``, the
low-precision GEMMs of ``model.low_precision``, and the dtypes of ``hybrid_zero_optimizer``), and it reads them off the
typed ``RunConfig`` (so mypy checks every field name). Everything below the launcher takes the plan
(``Job.precision``): the NaiveAMP wrapper, the optimizer's master policy, the memory closed forms, the dry run
and the telemetry. The cross-key rules are the config's (``tessera.config.checks``), checked when the config
was validated; the plan is built only from a validated config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tessera.config import Config
from tessera.config.checks import masters_problem
from tessera.config.dtypes import ModelDtype, dtype_from_name, resolve_model_dtype
from tessera.config.typed import HybridZeroConfig, LowPrecisionConfig, ModelConfig, RunConfig
from tessera.parallel.gemm import RecipeSwitches
from tessera.precision.switches import apply_precision

__all__ = ["LowPrecisionGemms", "ModelDtype", "OptimizerDtypes", "PrecisionPlan", "model_dtype_of",
           "optimizer_dtypes", "run_config_of", "storage_dtype"]

_OPTIMIZER_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class LowPrecisionGemms:
    """The config's ``model.low_precision`` section: low-precision GEMMs in the parallel linears (an fp8 recipe or a
    block format: the routes of ``tessera.parallel.gemm``), the fp8 backend, the per-module rules, the published
    recipes' switches (``RecipeSwitches``), the decoder blocks kept in the model dtype at either end, and the step
    from which the forward GEMMs run in the model dtype."""

    enabled: bool = False
    recipe: str = "tensorwise"
    exclude: tuple[str, ...] = ("output",)
    backend: str = "auto"
    rules: tuple[tuple[str, str], ...] = ()
    switches: RecipeSwitches = RecipeSwitches()
    keep_first_blocks: int = 0
    keep_last_blocks: int = 0
    high_precision_forward_from_step: int | None = None

    @classmethod
    def from_section(cls, section: LowPrecisionConfig) -> LowPrecisionGemms:
        """From the typed ``model.low_precision`` section."""
        switches = RecipeSwitches(str(section.mx_scale_rounding), bool(section.nvfp4_2d_weights),
                                  bool(section.hadamard_wgrad), bool(section.stochastic_gradients))
        return cls(bool(section.enabled), str(section.recipe), tuple(section.exclude), str(section.backend),
                   tuple((str(p), str(r)) for p, r in section.rules), switches, int(section.keep_first_blocks),
                   int(section.keep_last_blocks), section.high_precision_forward_from_step)

    @property
    def recipes(self) -> list[str]:
        """Every recipe the section may give a linear (the main one and the rules'), in order; none when off."""
        return [self.recipe, *(r for _, r in self.rules)] if self.enabled else []


@dataclass(frozen=True)
class OptimizerDtypes:
    """The dtypes HybridZeroOptimizer keeps (``hybrid_zero_optimizer`` keys), as torch dtypes."""

    master: torch.dtype = torch.float32
    state: torch.dtype = torch.float32  # Adam moments
    reduce: torch.dtype = torch.float32  # gradient accumulation and the DP reduction
    compensation: str = "none"  # bf16 masters: "none" | "kahan" | "stochastic"


def optimizer_dtypes(master: str, state: str, reduce: str, compensation: str, model: ModelDtype) -> OptimizerDtypes:
    """``hybrid_zero_optimizer``'s dtype keys as torch dtypes, the one place they are resolved: ``master_dtype``
    and ``optimizer_state_dtype`` (fp32 | bf16), ``reduce_dtype`` (fp32 | model: the model's storage dtype),
    ``master_compensation``; the cross-key rules checked (``masters_problem``)."""
    def pick(key: str, value: str) -> torch.dtype:
        try:
            return dtype_from_name(value, among=_OPTIMIZER_DTYPES)
        except ValueError as e:
            raise ValueError(f"hybrid_zero_optimizer.{key}: {e}") from None

    problem = masters_problem(master, compensation, model)
    if problem:
        raise ValueError(problem)
    return OptimizerDtypes(master=pick("master_dtype", master), state=pick("optimizer_state_dtype", state),
                           reduce=model.dtype if reduce == "model" else pick("reduce_dtype", reduce),
                           compensation=compensation)


def _optimizer_dtypes_of(section: HybridZeroConfig, model: ModelDtype) -> OptimizerDtypes:
    return optimizer_dtypes(section.master_dtype, section.optimizer_state_dtype, section.reduce_dtype,
                            section.master_compensation, model)


def run_config_of(cfg: RunConfig | Config | Mapping[str, Any]) -> RunConfig:
    """The typed view of a config: as given, a ``Config``'s, or a plain dict's after validation (defaults filled
    from the schema, the one home of defaults)."""
    if isinstance(cfg, RunConfig):
        return cfg
    return (cfg if isinstance(cfg, Config) else Config.from_dict(dict(cfg))).typed


@dataclass(frozen=True)
class PrecisionPlan:
    """Every precision fact of a run, as torch dtypes and flags. ``fp32_modules`` holds the config's patterns
    and ``use_fp32_norm``; the NaiveAMP wrapper resolves them to module names on the built decoder, and the
    low-precision linears (``gemms``) to one GEMM policy per linear (``tessera.precision.linears``)."""

    model: ModelDtype
    reduced_precision_reduction: bool = False
    fp32_modules: tuple[str, ...] = ()
    use_fp32_norm: bool = False
    gemms: LowPrecisionGemms = LowPrecisionGemms()
    optimizer: OptimizerDtypes = OptimizerDtypes()

    @property
    def dtype(self) -> torch.dtype:
        """The storage dtype of parameters and activations (fp32 for tf32)."""
        return self.model.dtype

    @property
    def name(self) -> str:
        """``float16`` | ``bfloat16`` | ``float32`` | ``tf32``."""
        return self.model.name

    @classmethod
    def of(cls, dtype: str | torch.dtype | ModelDtype, **fields: Any) -> PrecisionPlan:
        """A plan for code that has no config: the model dtype, other fields as given (defaults else)."""
        return cls(resolve_model_dtype(dtype), **fields)

    @classmethod
    def from_run(cls, run: RunConfig) -> PrecisionPlan:
        """The plan of a validated, typed config: the one reader of its precision keys."""
        return cls.from_sections(run.model, run.hybrid_zero_optimizer)

    @classmethod
    def from_sections(cls, model: ModelConfig, optimizer: HybridZeroConfig) -> PrecisionPlan:
        """The plan of the typed ``model`` and ``hybrid_zero_optimizer`` sections."""
        model_dtype = resolve_model_dtype(model.dtype)
        fp32 = model.fp32_modules
        return cls(model=model_dtype, reduced_precision_reduction=bool(model.allow_reduced_precision_reduction),
                   fp32_modules=(fp32,) if isinstance(fp32, str) else tuple(fp32),
                   use_fp32_norm=bool(model.use_fp32_norm), gemms=LowPrecisionGemms.from_section(model.low_precision),
                   optimizer=_optimizer_dtypes_of(optimizer, model_dtype))

    @classmethod
    def from_config(cls, cfg: RunConfig | Config | Mapping[str, Any]) -> PrecisionPlan:
        """``from_run`` of a config's typed view (a plain dict is validated first: ``run_config_of``)."""
        return cls.from_run(run_config_of(cfg))

    def with_model_dtype(self, dtype: str | torch.dtype | ModelDtype) -> PrecisionPlan:
        """The same run at another model dtype (the precision report compares dtypes)."""
        return dataclasses.replace(self, model=resolve_model_dtype(dtype))

    def apply(self) -> None:
        """Set the process-wide switches this plan asks for (``apply_precision``)."""
        apply_precision(self.model, reduced_precision_reduction=self.reduced_precision_reduction)


def storage_dtype(model_section: Mapping[str, Any]) -> torch.dtype:
    """The storage dtype a run trained in (tf32 is fp32 storage), from its saved, validated ``model`` section."""
    return resolve_model_dtype(model_section["dtype"]).dtype


def model_dtype_of(dtype: torch.dtype | ModelDtype) -> ModelDtype:
    """The ``ModelDtype`` of a storage dtype (fp16, bf16 or fp32; never tf32, which no tensor carries)."""
    return resolve_model_dtype(dtype)
