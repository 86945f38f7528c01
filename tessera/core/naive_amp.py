"""Low-precision model wrapper with per-module fp32 islands (InternEvo's NaiveAMPModel contract).

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

import fnmatch
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tessera.config import ConfigError
from tessera.config.dtypes import ModelDtype, resolve_model_dtype
from tessera.core.context import ParallelMode, gpc
from tessera.core.precision import Precision
from tessera.model.transformer import Transformer
from tessera.parallel.gemm import BACKENDS, BLOCK_FORMATS, GEMM_RECIPES, block_size, policy_for
from tessera.parallel.layers import ColumnParallelLinear, RowParallelLinear

_FP32_ATTR = "is_fp32_module"

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
    "fp8_recipe_of",
    "unwrap_model",
]

logger = logging.getLogger("tessera")


def set_fp32_attr_to_module(module: nn.Module) -> nn.Module:
    """Mark ``module`` (and so everything inside it) to keep fp32 parameters and compute in fp32."""
    setattr(module, _FP32_ATTR, True)
    return module


def module_has_fp32_attr(module: nn.Module) -> bool:
    """True when ``module`` itself carries the fp32 mark."""
    return bool(getattr(module, _FP32_ATTR, False))


def mark_fp32_modules(model: nn.Module, patterns: Iterable[str]) -> list[str]:
    """Mark every module whose ``named_modules()`` name matches one of the fnmatch ``patterns``.

    Returns the marked names. A pattern that matches nothing is an error: a typo in
    ``model.fp32_modules`` would otherwise silently train the module in low precision.
    """
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    marked: list[str] = []
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise ConfigError(f"model.fp32_modules: patterns must be strings, got {pattern!r}")
        hits = [name for name, _ in model.named_modules() if name and fnmatch.fnmatchcase(name, pattern)]
        if not hits:
            names = [n for n, _ in model.named_modules() if n][:12]
            raise ConfigError(
                f"model.fp32_modules: pattern {pattern!r} matches no module; module names look like {names}"
            )
        for name in hits:
            set_fp32_attr_to_module(model.get_submodule(name))
            if name not in marked:
                marked.append(name)
    return marked


def mark_fp32_norms(model: nn.Module) -> list[str]:
    """InternEvo's ``use_fp32_norm``: mark every module whose class name or module name contains "norm"."""
    marked = []
    for name, module in model.named_modules():
        if not name:
            continue  # never the root: that would make the whole model fp32
        if "norm" in type(module).__name__.lower() or "norm" in name.rsplit(".", 1)[-1].lower():
            set_fp32_attr_to_module(module)
            marked.append(name)
    return marked


def _fp32_roots(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Outermost marked modules: hooks go there only, so nested marks do not cast back inside fp32."""
    roots: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        if module_has_fp32_attr(module):
            roots.append((prefix, module))
            return
        for child_name, child in module.named_children():
            visit(f"{prefix}.{child_name}" if prefix else child_name, child)

    visit("", model)
    return roots


def fp32_module_names(model: nn.Module) -> set[str]:
    """Names of all modules that run in fp32 because they or an ancestor are marked."""
    out: set[str] = set()
    for root_name, root in _fp32_roots(unwrap_model(model)):
        for sub_name, _ in root.named_modules():
            out.add(f"{root_name}.{sub_name}" if root_name and sub_name else (root_name or sub_name))
    return out


def model_head(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The module whose output is the model's output: its last registered child (tessera's decoder: its
    ``output``, by the module-name contract of ``tessera.model.transformer``); None without children."""
    children = list(model.named_children())
    return children[-1] if children else None


def _check_shared_parameters(model: nn.Module) -> None:
    """A parameter shared by an fp32 module and a low-precision one (tied embeddings with only one
    side marked) cannot be both: refuse it, naming the modules, instead of picking one silently."""
    fp32 = {id(m) for _, root in _fp32_roots(model) for m in root.modules()}
    owners: dict[int, list[tuple[str, bool]]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for p_name, p in module.named_parameters(recurse=False):
            entry = (f"{mod_name}.{p_name}" if mod_name else p_name, id(module) in fp32)
            if entry not in owners.setdefault(id(p), []):
                owners[id(p)].append(entry)
    for entries in owners.values():
        if len({is_fp32 for _, is_fp32 in entries}) > 1:
            marked = [n for n, f in entries if f]
            unmarked = [n for n, f in entries if not f]
            raise ConfigError(
                f"{' and '.join(n for n, _ in entries)} are one shared parameter (e.g. model.tie_word_embeddings"
                f"=True), but fp32 marks cover {marked} and not {unmarked}: mark both modules fp32 (e.g. "
                "model.fp32_modules=['embedding', 'output']) or neither"
            )


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


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's model inside a ``NaiveAMPModel`` (or the model itself)."""
    return model.model if isinstance(model, NaiveAMPModel) else model


class NaiveAMPModel(nn.Module):
    """Cast a model to a low-precision ``dtype`` except its fp32-marked modules.

    ``dtype`` takes a torch dtype or a name (``"torch.bfloat16"``, ``"bf16"``, ``"torch.tf32"``...);
    fp32 and tf32 cast nothing (tf32 is a compute mode, switched on by ``tessera.core.precision``).
    ``fp32_modules`` / ``use_fp32_norm`` mark modules by name before casting (config keys of the same
    name). The wrapped model is ``.model``, so names without the wrapper prefix are
    ``wrapper.model.named_parameters()``. ``head_dtype``: what the head (``model_head``) computes in, fp32
    when it is marked, else the model dtype; handed to a ``Transformer`` as its ``head_dtype``.
    """

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
            _check_shared_parameters(model)
        self.head_dtype = self._decide_head_dtype(model)
        self._convert(model)

    def _decide_head_dtype(self, model: nn.Module) -> torch.dtype:
        """The head's compute dtype (fp32 when it or an ancestor is marked), decided once and handed to
        tessera's decoder, which applies its head itself when it fuses it with the loss."""
        head = model_head(model)
        in_fp32 = {id(m) for _, root in _fp32_roots(model) for m in root.modules()}
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
        for _, root in _fp32_roots(model):
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
        for _, root in _fp32_roots(model):
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


def naive_amp_for(model: nn.Module, precision: Precision, *, sync_buffer: bool = True,
                  parallel_mode: ParallelMode | Any = ParallelMode.DATA) -> NaiveAMPModel:
    """Wrap ``model`` as the run's precision asks: its dtype, fp32 marks (patterns and ``use_fp32_norm``,
    resolved to module names here, once) and fp8 linears. ``parallel_mode``: the group whose floating
    buffers are averaged (a Job's ``groups.dp``)."""
    amp = NaiveAMPModel(model, output_to_fp32=True, parallel_mode=parallel_mode, sync_buffer=sync_buffer,
                        dtype=precision.model, fp32_modules=precision.fp32_modules,
                        use_fp32_norm=precision.use_fp32_norm)
    if precision.fp8.enabled:
        f = precision.fp8
        enable_fp8_linears(amp, f.recipe, f.exclude, backend=f.backend, rules=f.rules)
    return amp


_KEEP_HIGH = ("bf16", "none")  # a rule recipe that leaves the module in the model's dtype


def fp8_recipe_of(name: str, recipe: str, exclude: Iterable[str] = ("output",),
                  rules: Iterable[tuple[str, str]] = ()) -> str | None:
    """The GEMM recipe ``model.fp8`` gives the linear ``name`` (None: the model's dtype): ``exclude`` first, then
    the first rule whose fnmatch pattern matches (``bf16``/``none`` keep it high), else ``recipe``."""
    if any(fnmatch.fnmatchcase(name, pat) for pat in exclude):
        return None
    for pattern, rule_recipe in rules:
        if fnmatch.fnmatchcase(name, pattern):
            return None if rule_recipe in _KEEP_HIGH else rule_recipe
    return recipe


def _check_blocks(name: str, module: ColumnParallelLinear | RowParallelLinear, recipe: str) -> None:
    """A block recipe's blocks must tile this rank's weight shard along both feature dims (each is a GEMM's
    reduction dim): a block never straddles a TP shard. ConfigError naming the layer otherwise."""
    block = block_size(policy_for(recipe))
    assert block is not None
    out_rank, in_rank = module.weight.shape
    for what, size, full in (("in", in_rank, module.in_features), ("out", out_rank, module.out_features)):
        if size % block:
            shard = f" ({full} over tensor-parallel size {module.tp_size})" if module.tp_size > 1 else ""
            raise ConfigError(f"model.fp8 recipe {recipe!r} on linear {name!r}: its {what}_features per rank, "
                              f"{size}{shard}, is not a multiple of the {block}-element scale block (a block must "
                              f"not straddle a TP shard); keep the layer out (model.fp8.exclude or a 'bf16' rule) "
                              f"or change the sizes")


def enable_fp8_linears(amp: NaiveAMPModel, recipe: str, exclude: Iterable[str] = ("output",), *,
                       backend: str = "auto", rules: Iterable[tuple[str, str]] = ()) -> list[str]:
    """Run the GEMMs of the model's parallel linears in a low-precision recipe (fp8 tensorwise/rowwise on
    ``backend``, or the block formats mxfp8/nvfp4: ``tessera.parallel.gemm``), except fp32-marked modules and
    names matching ``exclude``; ``rules`` give per-module recipes (``fp8_recipe_of``). Returns the names
    converted (logged once, with each one's recipe counted)."""
    if amp.model_dtype.dtype != torch.bfloat16:
        raise ValueError(f"fp8 linears need a bf16 model, not {amp.model_dtype.name} (model.fp8.enabled)")
    rules = [(str(p), str(r)) for p, r in rules]
    for r in [recipe, *(r for _, r in rules if r not in _KEEP_HIGH)]:
        if r not in GEMM_RECIPES:
            raise ValueError(f"model.fp8.recipe must be one of {list(GEMM_RECIPES)}, got {r!r}")
    if backend not in BACKENDS:
        raise ValueError(f"model.fp8.backend must be one of {list(BACKENDS)}, got {backend!r}")
    fp32 = fp32_module_names(amp)
    exclude = list(exclude)
    done: dict[str, str] = {}
    for name, module in unwrap_model(amp).named_modules():
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)) or name in fp32:
            continue
        chosen = fp8_recipe_of(name, recipe, exclude, rules)
        if chosen is None:
            continue
        if chosen in BLOCK_FORMATS:
            _check_blocks(name, module, chosen)
        module.use_recipe(chosen, backend)
        done[name] = chosen
    counts = {r: sum(1 for v in done.values() if v == r) for r in dict.fromkeys(done.values())}
    logger.info("low-precision linears (%s; fp8: e4m3 forward / e5m2 gradients, backend %s) on %d modules; kept "
                "out: fp32-marked modules, %s and rules %s", ", ".join(f"{r} x{n}" for r, n in counts.items()) or
                "none", backend, len(done), exclude, rules)
    return list(done)
