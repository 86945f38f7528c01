"""One GEMM policy per linear: the ``model.low_precision`` section resolved over a built decoder's parallel linears.

``gemm_recipe_of`` is the rule (exclude first, then the first matching per-module rule, else the section's
recipe); ``enable_low_precision_linears`` applies it, checks that a block format's blocks tile each shard,
and gives each linear whose route owns state (``GemmRoute.make_state``) its own ``RecipeState``, seeded from
the run's seed and the layer's name. ``RecipeStates`` gathers those states as one checkpoint component.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from typing import Any

from torch import nn

from tessera.config import ConfigError
from tessera.config.checks import low_precision_gemms_problem
from tessera.config.dtypes import ModelDtype
from tessera.logs import log_once
from tessera.parallel.block_formats import BLOCK_RECIPES
from tessera.parallel.gemm import (
    BACKENDS,
    BLOCK_FORMATS,
    KEEP_HIGH,
    GemmRoute,
    block_size,
    gemm_recipes,
    pick_route,
    policy_for,
)
from tessera.parallel.layers import ColumnParallelLinear, RowParallelLinear
from tessera.precision.fp32_marks import fp32_module_names
from tessera.precision.plan import LowPrecisionGemms

__all__ = ["RecipeStates", "enable_low_precision_linears", "gemm_recipe_of", "gradient_format"]

ParallelLinear = ColumnParallelLinear | RowParallelLinear


def gemm_recipe_of(name: str, recipe: str, exclude: Iterable[str] = ("output",),
                   rules: Iterable[tuple[str, str]] = ()) -> str | None:
    """The GEMM recipe ``model.low_precision`` gives the linear ``name`` (None: the model's dtype): ``exclude``
    first, then the first rule whose fnmatch pattern matches (``bf16``/``none`` keep it high), else ``recipe``."""
    if any(fnmatch.fnmatchcase(name, pat) for pat in exclude):
        return None
    for pattern, rule_recipe in rules:
        if fnmatch.fnmatchcase(name, pattern):
            return None if rule_recipe in KEEP_HIGH else rule_recipe
    return recipe


def gradient_format(recipe: str) -> str:
    """What a recipe's operands are rounded to, forward / gradients (for the log line): the fp8 recipes use e4m3
    forward and e5m2 for gradients; a block format uses its element format both ways; an added recipe says so
    in its route's description."""
    if recipe in BLOCK_FORMATS:
        element = BLOCK_RECIPES[recipe][0].name
        return f"{element} forward and gradients"
    if recipe in ("tensorwise", "rowwise"):
        return "e4m3 forward / e5m2 gradients"
    return f"route {_row_of(recipe).name}"


def _row_of(recipe: str) -> GemmRoute:
    """The route row that serves a block or an added recipe (the same on every device)."""
    return pick_route("cpu", None, policy_for(recipe), False)[0]


def _check_blocks(name: str, module: ParallelLinear, recipe: str) -> None:
    """A block recipe's blocks must tile this rank's weight shard along both feature dims (each is a GEMM's
    reduction dim): a block never straddles a TP shard. ConfigError naming the layer otherwise."""
    block = block_size(policy_for(recipe))
    assert block is not None
    out_rank, in_rank = module.weight.shape
    for what, size, full in (("in", in_rank, module.in_features), ("out", out_rank, module.out_features)):
        if size % block:
            shard = f" ({full} over tensor-parallel size {module.tp_size})" if module.tp_size > 1 else ""
            raise ConfigError(f"model.low_precision recipe {recipe!r} on linear {name!r}: its {what}_features per "
                              f"rank, {size}{shard}, is not a multiple of the {block}-element scale block (a block "
                              f"must not straddle a TP shard); keep the layer out (model.low_precision.exclude or a "
                              f"'bf16' rule) or change the sizes")


def _check_section(gemms: LowPrecisionGemms) -> None:
    """Recipes and backend of a section built without a validated config (library callers)."""
    known = gemm_recipes()
    for r in [gemms.recipe, *(r for _, r in gemms.rules if r not in KEEP_HIGH)]:
        if r not in known:
            raise ValueError(f"model.low_precision.recipe must be one of {list(known)}, got {r!r}")
    if gemms.backend not in BACKENDS:
        raise ValueError(f"model.low_precision.backend must be one of {list(BACKENDS)}, got {gemms.backend!r}")


def enable_low_precision_linears(model: nn.Module, model_dtype: ModelDtype, gemms: LowPrecisionGemms, *,
                                 seed: int = 0) -> list[str]:
    """Run the GEMMs of ``model``'s parallel linears in the section's recipes (fp8 tensorwise/rowwise on its
    backend, a block format, or an added recipe: ``tessera.parallel.gemm``), except fp32-marked modules and
    excluded names; a recipe that owns state gets it per linear from ``seed`` and the linear's name. Returns
    the names converted (logged once, each recipe counted with its operands' formats)."""
    problem = low_precision_gemms_problem(True, model_dtype)
    if problem:
        raise ValueError(problem)
    _check_section(gemms)
    fp32 = fp32_module_names(model)
    done: dict[str, str] = {}
    for name, module in model.named_modules():
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)) or name in fp32:
            continue
        chosen = gemm_recipe_of(name, gemms.recipe, gemms.exclude, gemms.rules)
        if chosen is None:
            continue
        if chosen in BLOCK_FORMATS:
            _check_blocks(name, module, chosen)
        policy = policy_for(chosen, gemms.backend)
        make_state = _row_of(chosen).make_state if policy.format == "custom" else None
        module.use_recipe(chosen, gemms.backend, make_state(seed, name) if make_state else None)
        done[name] = chosen
    counts = {r: sum(1 for v in done.values() if v == r) for r in dict.fromkeys(done.values())}
    fp8_backend = f", fp8 backend {gemms.backend}" if any(r in ("tensorwise", "rowwise") for r in counts) else ""
    recipes = "; ".join(f"{r} x{n}: {gradient_format(r)}" for r, n in counts.items()) or "none"
    log_once(f"low-precision linears ({recipes}{fp8_backend}) on {len(done)} modules; kept out: fp32-marked "
             f"modules, {list(gemms.exclude)} and rules {list(gemms.rules)}")
    return list(done)


class RecipeStates:
    """The ``RecipeState`` of every linear that has one, as one checkpoint component (per rank: each TP rank's
    linears own their streams): ``{linear name: state}``. Empty when no recipe owns state."""

    def __init__(self, model: nn.Module) -> None:
        self.states = {name: m.gemm_policy.state for name, m in model.named_modules()
                       if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m.gemm_policy.state is not None}

    def __bool__(self) -> bool:
        return bool(self.states)

    def state_dict(self) -> dict[str, Any]:
        return {name: state.state_dict() for name, state in self.states.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        missing = sorted(set(self.states) - set(state))
        if missing:
            raise KeyError(f"the checkpoint has no GEMM recipe state for the linears {missing}")
        for name, s in self.states.items():
            s.load_state_dict(dict(state[name]))
