"""InternEvo's path of the loss scalers (``internlm.core.grad_scaler`` there): they live in
``tessera.precision.scaler``, the precision plan's package; this path stays importable (../DESIGN.md)."""

from tessera.precision.scaler import BaseGradScaler, ConstantGradScaler, DynamicGradScaler, build_grad_scaler

__all__ = ["BaseGradScaler", "ConstantGradScaler", "DynamicGradScaler", "build_grad_scaler"]
