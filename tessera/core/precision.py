"""The run's precision: ``Precision``, every precision fact of a run resolved once as torch dtypes, and
the backend switches it owns.

``Precision.from_config`` is the only reader of ``model.dtype`` and the precision keys around it
(``model.allow_reduced_precision_reduction``, ``model.fp32_modules``, ``model.use_fp32_norm``,
``model.fp8``, and the dtypes of ``hybrid_zero_optimizer``: ``OptimizerDtypes``); everything below the
launcher takes the resolved object (``Job.precision``). Its parts, one name each: ``ModelDtype`` (what
``model.dtype`` means: storage dtype and TF32, parsed by ``tessera.config.dtypes``, the one dtype table),
``Fp8Spec`` and ``OptimizerDtypes``.

The switches: ``torch.tf32`` is not a storage type, the parameters stay fp32 and TF32 is a compute
mode of CUDA matmuls and cuDNN convolutions. It is flipped only through the legacy ``allow_tf32``
setters: on torch 2.13 those keep both the legacy getters and the new ``fp32_precision`` getters
readable, whereas the new setters make any later ``allow_tf32`` read raise "mix of the legacy and new
APIs". bf16 and fp16 GEMMs accumulate in fp32, but cuBLAS may still reduce the partial sums of a
split-K GEMM in the operand dtype unless told otherwise (torch's default allows it), so both
reduced-precision-reduction switches are set explicitly, off unless the config allows them, and fp16
GEMMs never accumulate in fp16. Those switches have no ``fp32_precision`` twin.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tessera.config.dtypes import ModelDtype, dtype_from_name, parse_dtype, resolve_model_dtype
from tessera.config.schema import default_of

__all__ = ["Fp8Spec", "ModelDtype", "OptimizerDtypes", "Precision", "apply_precision", "model_dtype_of",
           "optimizer_dtypes", "parse_dtype", "set_reduced_precision_reduction", "set_tf32"]

_OPTIMIZER_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class Fp8Spec:
    """``model.fp8``: low-precision GEMMs in the parallel linears (fp8 or a block format: the GEMM routes of
    ``tessera.parallel.gemm``), with the fp8 backend and per-module rules."""

    enabled: bool = False
    recipe: str = "tensorwise"
    exclude: tuple[str, ...] = ("output",)
    backend: str = "auto"
    rules: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class OptimizerDtypes:
    """The dtypes HybridZeroOptimizer keeps (``hybrid_zero_optimizer`` keys), as torch dtypes."""

    master: torch.dtype = torch.float32
    state: torch.dtype = torch.float32  # Adam moments
    reduce: torch.dtype = torch.float32  # gradient accumulation and the DP reduction
    compensation: str = "none"  # bf16 masters: "none" | "kahan" | "stochastic"


def optimizer_dtypes(section: Mapping[str, Any], model: ModelDtype) -> OptimizerDtypes:
    """``hybrid_zero_optimizer``'s dtype keys as torch dtypes: ``master_dtype`` and ``optimizer_state_dtype``
    (fp32 | bf16), ``reduce_dtype`` (fp32 | model: the model's storage dtype)."""
    def pick(key: str) -> torch.dtype:
        value = section.get(key) or "fp32"
        try:
            return dtype_from_name(value, among=_OPTIMIZER_DTYPES)
        except ValueError as e:
            raise ValueError(f"hybrid_zero_optimizer.{key}: {e}") from None

    reduce = section.get("reduce_dtype") or "fp32"
    return OptimizerDtypes(
        master=pick("master_dtype"), state=pick("optimizer_state_dtype"),
        reduce=model.dtype if reduce == "model" else pick("reduce_dtype"),
        compensation=str(section.get("master_compensation") or "none"),
    )


@dataclass(frozen=True)
class Precision:
    """Every precision fact of a run, as torch dtypes and flags. ``fp32_modules`` holds the config's patterns
    and ``use_fp32_norm``; the builder resolves them to module names on the built decoder."""

    model: ModelDtype
    reduced_precision_reduction: bool = False
    fp32_modules: tuple[str, ...] = ()
    use_fp32_norm: bool = False
    fp8: Fp8Spec = Fp8Spec()
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
    def of(cls, dtype: str | torch.dtype | ModelDtype, **fields: Any) -> Precision:
        """A precision for code that has no config: the model dtype, other fields as given (defaults else)."""
        return cls(resolve_model_dtype(dtype), **fields)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> Precision:
        """Read a config (a ``Config`` or its dict; absent sections take their defaults) once."""
        model = dict(cfg.get("model") or {})
        model_dtype = resolve_model_dtype(model.get("dtype") or default_of("model.dtype"))
        fp8 = dict(model.get("fp8") or {})
        fp32 = model.get("fp32_modules") or ()
        return cls(
            model=model_dtype,
            reduced_precision_reduction=bool(model.get("allow_reduced_precision_reduction", False)),
            fp32_modules=(fp32,) if isinstance(fp32, str) else tuple(fp32),
            use_fp32_norm=bool(model.get("use_fp32_norm", False)),
            fp8=Fp8Spec(bool(fp8.get("enabled", False)), str(fp8.get("recipe", "tensorwise")),
                        tuple(fp8.get("exclude", ("output",))), str(fp8.get("backend", "auto")),
                        tuple((str(p), str(r)) for p, r in fp8.get("rules", ()))),
            optimizer=optimizer_dtypes(cfg.get("hybrid_zero_optimizer") or {}, model_dtype),
        )

    def with_model_dtype(self, dtype: str | torch.dtype | ModelDtype) -> Precision:
        """The same run at another model dtype (the precision report compares dtypes)."""
        return dataclasses.replace(self, model=resolve_model_dtype(dtype))

    def apply(self) -> None:
        """Set the process-wide switches this precision asks for (``apply_precision``)."""
        apply_precision(self.model, reduced_precision_reduction=self.reduced_precision_reduction)


def model_dtype_of(dtype: torch.dtype | ModelDtype) -> ModelDtype:
    """The ``ModelDtype`` of a storage dtype (fp16, bf16 or fp32; never tf32, which no tensor carries)."""
    return resolve_model_dtype(dtype)


def set_tf32(enabled: bool) -> None:
    """Switch TF32 for CUDA matmuls and cuDNN through the legacy setters (see the module docstring)."""
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def set_reduced_precision_reduction(allowed: bool) -> None:
    """Whether cuBLAS may reduce the partial sums of bf16 and fp16 GEMMs (split-K) in bf16/fp16; off: in
    fp32. Both are set, through the legacy boolean setters (split-K itself stays allowed: with reduced
    precision off its partial sums are reduced in fp32). fp16 accumulation is always switched off."""
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = allowed
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = allowed
    if hasattr(torch._C, "_set_cublas_allow_fp16_accumulation"):  # torch >= 2.7
        torch.backends.cuda.matmul.allow_fp16_accumulation = False


def apply_precision(value: str | torch.dtype | ModelDtype, *,
                    reduced_precision_reduction: bool = False) -> ModelDtype:
    """Apply the process-wide switches a precision asks for: TF32 on for tf32, IEEE fp32 otherwise, and
    bf16/fp16 GEMM reductions in fp32 unless ``reduced_precision_reduction`` allows them in reduced precision.

    fp16/bf16 runs also get TF32 off, so the fp32 parts of a mixed run (marked modules, the loss, the
    optimizer) compute in IEEE fp32 as the precision table promises.
    """
    p = resolve_model_dtype(value)
    set_tf32(p.tf32)
    set_reduced_precision_reduction(reduced_precision_reduction)
    return p
