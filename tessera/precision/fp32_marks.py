"""Which modules keep fp32 in a low-precision model: the marks by attribute (``set_fp32_attr_to_module``, InternEvo's
"fp32 modules by attribute"), by name pattern (``model.fp32_modules``) and by ``use_fp32_norm``, and what follows
from them: the outermost marked modules, every module that computes in fp32, the model's head.

The NaiveAMP wrapper (``tessera.core.naive_amp``) reads the marks to cast; the low-precision linears skip marked
modules; the memory census counts them.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

from torch import nn

from tessera.config import ConfigError

_FP32_ATTR = "is_fp32_module"

__all__ = ["check_shared_parameters", "fp32_module_names", "fp32_roots", "mark_fp32_modules", "mark_fp32_norms",
           "model_head", "module_has_fp32_attr", "set_fp32_attr_to_module", "unwrap_model"]


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


def fp32_roots(model: nn.Module) -> list[tuple[str, nn.Module]]:
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
    for root_name, root in fp32_roots(unwrap_model(model)):
        for sub_name, _ in root.named_modules():
            out.add(f"{root_name}.{sub_name}" if root_name and sub_name else (root_name or sub_name))
    return out


def model_head(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The module whose output is the model's output: its last registered child (tessera's decoder: its
    ``output``, by the module-name contract of ``tessera.model.transformer``); None without children."""
    children = list(model.named_children())
    return children[-1] if children else None


def check_shared_parameters(model: nn.Module) -> None:
    """A parameter shared by an fp32 module and a low-precision one (tied embeddings with only one
    side marked) cannot be both: refuse it, naming the modules, instead of picking one silently."""
    fp32 = {id(m) for _, root in fp32_roots(model) for m in root.modules()}
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


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's model inside a NaiveAMP wrapper (its ``model`` attribute when it is one), or the model itself."""
    inner = getattr(model, "model", None)
    return inner if getattr(model, "is_naive_amp", False) and isinstance(inner, nn.Module) else model
