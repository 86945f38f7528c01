"""``tessera.core.grad_scaler``: the documented path (DESIGN.md) of the loss scalers, which live in
``tessera.optim.grad_scaler``."""

from tessera.optim.grad_scaler import BaseGradScaler, ConstantGradScaler, DynamicGradScaler, build_grad_scaler

__all__ = ["BaseGradScaler", "ConstantGradScaler", "DynamicGradScaler", "build_grad_scaler"]
