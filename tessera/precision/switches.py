"""The process-wide numeric switches a run's precision owns: TF32 and reduced-precision GEMM reductions.

``torch.tf32`` is not a storage type: the parameters stay fp32 and TF32 is a compute mode of CUDA matmuls
and cuDNN convolutions. It is flipped only through the legacy ``allow_tf32`` setters: on torch 2.13 those
keep both the legacy getters and the new ``fp32_precision`` getters readable, whereas the new setters make
any later ``allow_tf32`` read raise "mix of the legacy and new APIs". bf16 and fp16 GEMMs accumulate in fp32,
but cuBLAS may still reduce the partial sums of a split-K GEMM in the operand dtype unless told otherwise
(torch's default allows it), so both reduced-precision-reduction switches are set explicitly, off unless the
config allows them, and fp16 GEMMs never accumulate in fp16. Those switches have no ``fp32_precision`` twin.
"""

from __future__ import annotations

import torch

from tessera.config.dtypes import ModelDtype, resolve_model_dtype

__all__ = ["apply_precision", "set_reduced_precision_reduction", "set_tf32"]


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
