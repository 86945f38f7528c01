"""One GEMM policy per linear: the ``model.low_precision`` section resolved over a built decoder's parallel linears.

``gemm_recipe_of`` is the rule (exclude first, then the first matching per-module rule, else the section's
recipe); ``enable_low_precision_linears`` applies it, checks that a block format's blocks tile each shard,
and gives each linear whose route owns state (``GemmRoute.make_state``) its own ``RecipeState``, seeded from
the run's seed and the layer's name. ``RecipeStates`` gathers those states as one checkpoint component.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
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
    GemmPolicy,
    GemmRoute,
    block_size,
    gemm_recipes,
    pick_route,
    policy_for,
)
from tessera.parallel.layers import ColumnParallelLinear, RowParallelLinear
from tessera.parallel.recipe_state import RecipeState, RecipeStream
from tessera.precision.fp32_marks import fp32_module_names
from tessera.precision.plan import LowPrecisionGemms

__all__ = ["ForwardSchedule", "RecipeStates", "enable_low_precision_linears", "gemm_recipe_of", "gradient_format"]

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
    if recipe == "rowwise_with_gw_hp":
        return "e4m3 forward / e5m2 data gradients, weight gradients in the model dtype"
    if recipe == "blockwise":
        return "e4m3 forward and gradients, power-of-two scales per 1x128 and 128x128"
    return f"route {_row_of(recipe).name}"


def _row_of(recipe: str) -> GemmRoute:
    """The route row that serves a block or an added recipe (the same on every device)."""
    return pick_route("cpu", None, policy_for(recipe), False)[0]


def _check_blocks(name: str, module: ParallelLinear, recipe: str) -> None:
    """A block recipe's blocks must tile this rank's weight shard along both feature dims (each is a GEMM's
    reduction dim): a block never straddles a TP shard. ConfigError naming the layer otherwise."""
    block = block_size(policy_for(recipe))
    assert block is not None
    if recipe == "blockwise" and module.tp_size == 1:
        return  # a ragged 128-tile is padded with zeros; only a TP shard's edge must fall on a tile's
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


_BLOCK = re.compile(r"^layers\.(\d+)\.")  # a decoder block's linears: layers.<i>.* (tessera.model's names)


def _block_index(name: str) -> int | None:
    m = _BLOCK.match(name)
    return int(m.group(1)) if m else None


def _kept_blocks(model: nn.Module, gemms: LowPrecisionGemms) -> set[int]:
    """The decoder blocks ``keep_first_blocks`` / ``keep_last_blocks`` keep in the model dtype."""
    blocks = sorted({i for name, _ in model.named_modules() if (i := _block_index(name)) is not None})
    return set(blocks[: gemms.keep_first_blocks]) | set(blocks[len(blocks) - gemms.keep_last_blocks:])


def _state_for(policy: GemmPolicy, seed: int, name: str) -> RecipeState | None:
    """The state a linear's recipe owns: an added row's own (``make_state``), the published switches' stream
    (stochastic rounding, Hadamard signs), or none."""
    if policy.format == "custom":
        make_state = _row_of(str(policy.recipe)).make_state
        return make_state(seed, name) if make_state else None
    return RecipeStream(seed, name) if policy.stochastic or policy.hadamard else None


def enable_low_precision_linears(model: nn.Module, model_dtype: ModelDtype, gemms: LowPrecisionGemms, *,
                                 seed: int = 0) -> list[str]:
    """Run the GEMMs of ``model``'s parallel linears in the section's recipes (fp8 tensorwise/rowwise on its
    backend, a block format with the recipe switches, or an added recipe: ``tessera.parallel.gemm``), except
    fp32-marked modules, excluded names and the kept decoder blocks; a recipe that owns state gets it per linear
    from ``seed`` and the linear's name. Returns the names converted (logged once, each recipe counted with its
    operands' formats)."""
    problem = low_precision_gemms_problem(True, model_dtype)
    if problem:
        raise ValueError(problem)
    _check_section(gemms)
    fp32, kept = fp32_module_names(model), _kept_blocks(model, gemms)
    done: dict[str, str] = {}
    for name, module in model.named_modules():
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)) or name in fp32:
            continue
        chosen = gemm_recipe_of(name, gemms.recipe, gemms.exclude, gemms.rules)
        if chosen is None or _block_index(name) in kept:
            continue
        if block_size(policy_for(chosen)) is not None:
            _check_blocks(name, module, chosen)
        policy = policy_for(chosen, gemms.backend, gemms.switches)
        module.use_policy(dataclasses.replace(policy, state=_state_for(policy, seed, name)))
        done[name] = chosen
    counts = {r: sum(1 for v in done.values() if v == r) for r in dict.fromkeys(done.values())}
    fp8_backend = f", fp8 backend {gemms.backend}" if any(r in ("tensorwise", "rowwise") for r in counts) else ""
    recipes = "; ".join(f"{r} x{n}: {gradient_format(r)}" for r, n in counts.items()) or "none"
    switches = _switches_text(gemms)
    log_once(f"low-precision linears ({recipes}{fp8_backend}{switches}) on {len(done)} modules; kept out: "
             f"fp32-marked modules, {list(gemms.exclude)}, rules {list(gemms.rules)}"
             + (f", decoder blocks {sorted(kept)}" if kept else ""))
    return list(done)


def _switches_text(gemms: LowPrecisionGemms) -> str:
    """The recipe switches that are on, for the log line."""
    s = gemms.switches
    on = [name for name, flag in (("2D weight blocks", s.weight_2d), ("Hadamard wgrad", s.hadamard),
                                  ("stochastic gradients", s.stochastic)) if flag]
    if "mxfp8" in gemms.recipes:
        on.append(f"mxfp8 scales {s.scale_rounding}")
    if gemms.high_precision_forward_from_step:
        on.append(f"forward in the model dtype from step {gemms.high_precision_forward_from_step}")
    return f"; {', '.join(on)}" if on else ""


def _low_precision_linears(model: nn.Module) -> list[ParallelLinear]:
    return [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
            and m.gemm_policy.format != "model"]


class ForwardSchedule:
    """``high_precision_forward_from_step``: from that optimizer step on (a resumed run too), the low-precision
    linears' forward GEMMs run in the model dtype; the backward GEMMs keep the recipe. ``before_step(step)`` is
    called with the step about to run; it changes the policies once."""

    def __init__(self, model: nn.Module, gemms: LowPrecisionGemms) -> None:
        self.model, self.from_step, self.switched = model, gemms.high_precision_forward_from_step, False

    def before_step(self, step: int) -> bool:
        """Switch the forwards when ``step`` reached the configured one; True when this call switched them."""
        if self.switched or self.from_step is None or step < self.from_step:
            return False
        for m in _low_precision_linears(self.model):
            m.use_policy(dataclasses.replace(m.gemm_policy, forward_high=True))
        self.switched = True
        log_once(f"from step {step}: forward GEMMs of the low-precision linears in the model dtype "
                 "(model.low_precision.high_precision_forward_from_step)")
        return True


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
