"""CUDA tensors without a GPU: ``FakeTensorMode`` plus the few Python bindings it does not cover.

Under ``torch._subclasses.fake_tensor.FakeTensorMode`` a CPU-only torch creates ``device="cuda"``
tensors that carry shapes, dtypes and devices but no data, and runs operators on them through the
dispatcher. A handful of Python-level tensor methods (basic indexing, ``copy_``, ``.to``) open a
CUDA device guard in C++ before dispatching, which a CPU-only build cannot do ("PyTorch is not linked
with support for cuda devices"). ``fake_cuda_mode`` routes exactly those calls, for fake CUDA
tensors only, to the equivalent ATen operators, so the framework's real code — model, optimizer,
trainer, collectives on a fake process group — runs unchanged. ``pin_memory`` of a host tensor (the
trainer pins batches before copying them to CUDA) has no fake implementation: it returns the tensor.
Used by the NCCL-rule tests (a CPU tensor reaching a CUDA-only group fails as it would with NCCL).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake
from torch.overrides import TorchFunctionMode

__all__ = ["fake_cuda_mode"]

_aten = torch.ops.aten


def _on_fake_cuda(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cuda" and is_fake(t)


def _view(x: torch.Tensor, index: Any) -> torch.Tensor | None:
    """``x[index]`` for basic indices (ints, slices, ``...``, ``None``) or one integer index tensor,
    through ATen; None for anything else."""
    if isinstance(index, torch.Tensor) and index.dtype != torch.bool:  # x[ids]: a gather
        return _aten.index.Tensor(x, [index])
    idx = index if isinstance(index, tuple) else (index,)
    if not all(i is None or i is Ellipsis or isinstance(i, (int, slice)) for i in idx):
        return None
    if any(isinstance(i, bool) for i in idx):
        return None
    specified = sum(1 for i in idx if i is not None and i is not Ellipsis)
    out, dim = x, 0
    for i in idx:
        if i is Ellipsis:
            dim += x.dim() - specified
        elif i is None:
            out = _aten.unsqueeze.default(out, dim)
            dim += 1
        elif isinstance(i, int):
            out = _aten.select.int(out, dim, i)
        else:
            start, stop, step = i.indices(out.shape[dim])
            out = _aten.slice.Tensor(out, dim, start, max(stop, start), step)
            dim += 1
    return out


def _to(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``Tensor.to`` as ``aten._to_copy`` (returns ``x`` itself when nothing changes, like ``.to``)."""
    device, dtype = kwargs.get("device"), kwargs.get("dtype")
    for a in args:
        if isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, (str, torch.device)):
            device = a
        elif isinstance(a, torch.Tensor):
            device, dtype = a.device, a.dtype
    device = torch.device(device) if device is not None else x.device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    dtype = dtype or x.dtype
    if device == x.device and dtype == x.dtype and not kwargs.get("copy", False):
        return x
    return _aten._to_copy.default(x, dtype=dtype, device=device)


class _FakeCudaBindings(TorchFunctionMode):
    """Sends the guard-opening Python bindings of fake CUDA tensors to ATen operators."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.__getitem__ and _on_fake_cuda(args[0]):
            out = _view(args[0], args[1])
            if out is not None:
                return out
        elif func is torch.Tensor.__setitem__ and _on_fake_cuda(args[0]):
            dst = _view(args[0], args[1])
            if dst is not None:
                value = args[2]
                if isinstance(value, torch.Tensor):
                    _aten.copy_.default(dst, value)
                else:
                    _aten.fill_.Scalar(dst, value)
                return None
        elif func is torch.Tensor.copy_ and (_on_fake_cuda(args[0]) or _on_fake_cuda(args[1])):
            return _aten.copy_.default(args[0], args[1], kwargs.get("non_blocking", False))
        elif func is torch.Tensor.to and isinstance(args[0], torch.Tensor) and (
                _on_fake_cuda(args[0]) or "cuda" in str(kwargs.get("device", "")) + "".join(map(str, args[1:]))):
            kwargs.pop("non_blocking", None)
            return _to(*args, **kwargs)
        elif func is torch.Tensor.cuda and isinstance(args[0], torch.Tensor):
            return _to(args[0], device="cuda")
        elif func is torch.Tensor.pin_memory and isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu":
            return args[0]  # page-locking needs a GPU; a copy to a fake CUDA tensor reads nothing from its source
        try:
            return func(*args, **kwargs)
        except RuntimeError as e:
            op = _aten_twin(func)
            if "not linked with support for cuda" not in str(e) or op is None:
                raise
            return op(*args, **kwargs)


_DUNDER = {"invert": "bitwise_not", "and": "bitwise_and", "or": "bitwise_or", "xor": "bitwise_xor",
           "iand": "bitwise_and_", "ior": "bitwise_or_", "ixor": "bitwise_xor_"}


def _aten_twin(func: Any) -> Any:
    """The ATen operator behind a Tensor method (``__invert__`` -> ``aten.bitwise_not``), or None."""
    name = getattr(func, "__name__", "")
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
        name = _DUNDER.get(name, name)
    return getattr(_aten, name, None)


@contextlib.contextmanager
def fake_cuda_mode() -> Iterator[FakeTensorMode]:
    """Fake tensors, with ``device="cuda"`` usable on a CPU-only torch (see the module docstring)."""
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, _FakeCudaBindings():
        yield mode
