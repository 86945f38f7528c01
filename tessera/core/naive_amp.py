"""Low-precision model wrapper with per-module fp32 islands (InternEvo's NaiveAMPModel contract, at InternEvo's
path: ``internlm.core.naive_amp``). The marks themselves are ``tessera.precision.fp32_marks`` (re-exported here,
where InternEvo code imports them); the low-precision linears are ``tessera.precision.linears``.

Why not ``torch.autocast``: we want the *storage* in low precision (half the weight memory, matmuls in
bf16/fp16 without per-call casts) while a few numerically sensitive modules (norms, the output head)
keep fp32 weights and compute in fp32. Those modules are marked by attribute
(``set_fp32_attr_to_module``), by name pattern (``mark_fp32_modules``) or by the ``use_fp32_norm``
switch; the wrapper casts their inputs to fp32 and their outputs back to the model dtype with forward
hooks, so the surrounding low-precision code never sees an fp32 activation it did not ask for.

The one exception is the head, the module whose output is the model's (``model_head``): when it is
marked and the wrapper returns fp32 outputs, its output is already what the caller asked for, so it is
returned as computed, never rounded to the model dtype on the way. Whether the head computes in fp32 is
decided once here (``NaiveAMPModel.head_dtype``) and handed to tessera's decoder as its ``head_dtype``
(it fuses the head with the loss, where the head module and its hooks are not called).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tessera.config.dtypes import ModelDtype, resolve_model_dtype
from tessera.core.context import ParallelMode, gpc
from tessera.model.transformer import Transformer
from tessera.precision.fp32_marks import (
    check_shared_parameters,
    fp32_module_names,
    fp32_roots,
    mark_fp32_modules,
    mark_fp32_norms,
    model_head,
    module_has_fp32_attr,
    set_fp32_attr_to_module,
    unwrap_model,
)
from tessera.precision.linears import enable_low_precision_linears, gemm_recipe_of
from tessera.precision.plan import LowPrecisionGemms, PrecisionPlan

__all__ = [
    "NaiveAMPModel",
    "set_fp32_attr_to_module",
    "module_has_fp32_attr",
    "mark_fp32_modules",
    "mark_fp32_norms",
    "fp32_module_names",
    "model_head",
    "naive_amp_for",
    "enable_fp8_linears",
    "enable_low_precision_linears",
    "fp8_recipe_of",
    "gemm_recipe_of",
    "unwrap_model",
]

logger = logging.getLogger("tessera")


def _cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    """Cast floating tensors inside nested tuples/lists/dicts; leave everything else as is."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_cast_floating(x, dtype) for x in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_cast_floating(x, dtype) for x in obj)
    if isinstance(obj, Mapping):
        return {k: _cast_floating(v, dtype) for k, v in obj.items()}
    return obj


class NaiveAMPModel(nn.Module):
    """Cast a model to a low-precision ``dtype`` except its fp32-marked modules.

    ``dtype`` takes a torch dtype or a name (``"torch.bfloat16"``, ``"bf16"``, ``"torch.tf32"``...);
    fp32 and tf32 cast nothing (tf32 is a compute mode, switched on by ``tessera.precision.switches``).
    ``fp32_modules`` / ``use_fp32_norm`` mark modules by name before casting (config keys of the same
    name). The wrapped model is ``.model``, so names without the wrapper prefix are
    ``wrapper.model.named_parameters()``. ``head_dtype``: what the head (``model_head``) computes in, fp32
    when it is marked, else the model dtype; handed to a ``Transformer`` as its ``head_dtype``.
    """

    is_naive_amp = True  # what ``unwrap_model`` looks for

    def __init__(
        self,
        model: nn.Module,
        output_to_fp32: bool = True,
        parallel_mode: ParallelMode | Any = ParallelMode.DATA,
        sync_buffer: bool = True,
        dtype: torch.dtype | str | ModelDtype = torch.float16,
        fp32_modules: Iterable[str] = (),
        use_fp32_norm: bool = False,
    ) -> None:
        super().__init__()
        if isinstance(model, NaiveAMPModel):
            raise TypeError("NaiveAMPModel: the model is already wrapped in a NaiveAMPModel")
        self.model_dtype: ModelDtype = resolve_model_dtype(dtype)
        self.dtype = self.model_dtype.dtype
        self.output_to_fp32 = output_to_fp32
        self.parallel_mode = parallel_mode
        self._sync_buf = sync_buffer
        if fp32_modules:
            mark_fp32_modules(model, fp32_modules)
        if use_fp32_norm:
            mark_fp32_norms(model)
        self.model = model
        self._hooks: list[Any] = []
        if self.dtype != torch.float32:  # fp32/tf32 store everything in fp32: marks cannot conflict
            check_shared_parameters(model)
        self.head_dtype = self._decide_head_dtype(model)
        self._convert(model)

    def _decide_head_dtype(self, model: nn.Module) -> torch.dtype:
        """The head's compute dtype (fp32 when it or an ancestor is marked), decided once and handed to
        tessera's decoder, which applies its head itself when it fuses it with the loss."""
        head = model_head(model)
        in_fp32 = {id(m) for _, root in fp32_roots(model) for m in root.modules()}
        head_dtype = torch.float32 if head is not None and id(head[1]) in in_fp32 else self.dtype
        if isinstance(model, Transformer):
            model.head_dtype = head_dtype
        if head is not None and head_dtype != self.dtype and self.output_to_fp32:
            logger.info("NaiveAMPModel: the head %r computes in fp32 and its output is returned in fp32 as "
                        "computed (not rounded to %s)", head[0], self.model_dtype.name)
        return head_dtype

    # ------------------------------------------------------------------ casting
    def _convert(self, model: nn.Module) -> None:
        fp32_ids: set[int] = set()
        for _, root in fp32_roots(model):
            fp32_ids.update(id(m) for m in root.modules())
        for module in model.modules():
            target = torch.float32 if id(module) in fp32_ids else self.dtype
            for _, p in module.named_parameters(recurse=False):
                if p.is_floating_point() and p.dtype != target:
                    p.data = p.data.to(target)
            for name, b in module.named_buffers(recurse=False):
                if b.is_floating_point() and b.dtype != target:
                    module._buffers[name] = b.to(target)
        if self.dtype == torch.float32:
            return  # fp32 / tf32: marked modules need no casts either
        # the model's output comes from its head (or the model itself, when that is marked): with fp32 outputs
        # asked for, it is not rounded to the model dtype on its way out
        head = model_head(model)
        output_roots = {id(model), *((id(head[1]),) if head else ())} if self.output_to_fp32 else set()
        for _, root in fp32_roots(model):
            self._hooks.append(root.register_forward_pre_hook(self._to_fp32_pre_hook, with_kwargs=True))
            if id(root) not in output_roots:
                self._hooks.append(root.register_forward_hook(self._cast_back_hook))

    @staticmethod
    def _to_fp32_pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return _cast_floating(args, torch.float32), _cast_floating(kwargs, torch.float32)

    def _cast_back_hook(self, module: nn.Module, args: tuple, output: Any) -> Any:
        return _cast_floating(output, self.dtype)

    # ------------------------------------------------------------------ buffers
    def _buffer_group(self) -> Any:
        """The process group whose floating buffers are averaged, or None (no sync needed)."""
        mode = self.parallel_mode
        if not dist.is_available() or not dist.is_initialized():
            return None
        if isinstance(mode, ParallelMode):
            if not gpc.is_using_parallel_mode(mode):
                return None
            return gpc.get_group(mode)
        group = mode  # a process group passed directly
        return group if group is not None and dist.get_world_size(group) > 1 else None

    @torch.no_grad()
    def _sync_buffers(self) -> None:
        group = self._buffer_group()
        if group is None:
            return
        size = dist.get_world_size(group)
        for buf in self.model.buffers():
            if buf.is_floating_point():
                tmp = buf.float()
                dist.all_reduce(tmp, group=group)
                buf.copy_(tmp.div_(size))

    # ------------------------------------------------------------------ forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._sync_buf:
            self._sync_buffers()
        args = _cast_floating(args, self.dtype)
        kwargs = _cast_floating(kwargs, self.dtype)
        out = self.model(*args, **kwargs)
        return _cast_floating(out, torch.float32) if self.output_to_fp32 else out


def naive_amp_for(model: nn.Module, precision: PrecisionPlan, *, sync_buffer: bool = True,
                  parallel_mode: ParallelMode | Any = ParallelMode.DATA, seed: int = 0) -> NaiveAMPModel:
    """Wrap ``model`` as the run's precision plan asks: its dtype, fp32 marks (patterns and ``use_fp32_norm``,
    resolved to module names here, once) and low-precision linears (``seed``: the run's, for recipes that own an
    RNG stream). ``parallel_mode``: the group whose floating buffers are averaged (a Job's ``groups.dp``)."""
    amp = NaiveAMPModel(model, output_to_fp32=True, parallel_mode=parallel_mode, sync_buffer=sync_buffer,
                        dtype=precision.model, fp32_modules=precision.fp32_modules,
                        use_fp32_norm=precision.use_fp32_norm)
    if precision.gemms.enabled:
        enable_low_precision_linears(amp.model, amp.model_dtype, precision.gemms, seed=seed)
    return amp


fp8_recipe_of = gemm_recipe_of  # the name published configs' docs use


def enable_fp8_linears(amp: NaiveAMPModel, recipe: str, exclude: Iterable[str] = ("output",), *,
                       backend: str = "auto", rules: Iterable[tuple[str, str]] = (), seed: int = 0) -> list[str]:
    """``enable_low_precision_linears`` on a wrapped model, with the ``model.low_precision`` keys as arguments (every
    sub-bf16 recipe, not only fp8: the older name)."""
    gemms = LowPrecisionGemms(True, recipe, tuple(exclude), backend, tuple((str(p), str(r)) for p, r in rules))
    return enable_low_precision_linears(unwrap_model(amp), amp.model_dtype, gemms, seed=seed)
