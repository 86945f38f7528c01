"""The parameters of a rank by dtype, counted on a meta build of the decoder with the run's precision.

A meta build (``torch.device("meta")``, a stand-in TP group of the layout's size) allocates nothing, yet holds
exactly the run's parameters on TP rank 0 after the run's NaiveAMP wrapper and fp32 marks: the closed forms
(``tessera.memory.persistent``, ``tessera.memory.extras``) count from it, for the run's memory check and the
plan alike.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tessera.core.naive_amp import fp32_module_names, naive_amp_for
from tessera.model import build_model
from tessera.model.args import ModelArgs
from tessera.parallel import MetaGroup
from tessera.precision.plan import PrecisionPlan

__all__ = ["MetaCensus", "meta_census", "param_counts"]


@dataclass(frozen=True)
class MetaCensus:
    """What a meta build of the decoder with the run's precision says about TP rank 0."""

    low_params: int  # parameters stored in the model dtype
    fp32_params: int  # parameters kept fp32 (fp32 marks, or an fp32/tf32 model)
    attention_dtypes: tuple[torch.dtype, ...]  # q/k/v dtype per layer: fp32 where a mark covers the attention


@functools.lru_cache(maxsize=32)
def _census_cached(model_json: str, tp: int, precision: PrecisionPlan) -> MetaCensus:
    model_cfg = json.loads(model_json)
    with torch.device("meta"):
        model = build_model(model_cfg, tp_group=MetaGroup(tp), seed=0, device="meta", tensor_rng=None)
    amp = naive_amp_for(model, precision, sync_buffer=False)  # the run's dtype and fp32 marks, resolved here
    params = {id(p): p for p in amp.parameters()}.values()
    fp32_names = fp32_module_names(amp)
    layers = ModelArgs.from_config(model_cfg).num_layers
    attention = tuple(torch.float32 if f"layers.{i}.attention" in fp32_names else precision.dtype
                      for i in range(layers))
    return MetaCensus(sum(p.numel() for p in params if p.dtype != torch.float32),
                      sum(p.numel() for p in params if p.dtype == torch.float32), attention)


def meta_census(model_cfg: Mapping[str, Any], tp: int, precision: PrecisionPlan) -> MetaCensus:
    """Parameters of TP rank 0 by dtype and each layer's attention dtype, counted on a meta build with the
    run's fp32 marks (cached: the search and the refusal's options ask for the same TP sizes again)."""
    return _census_cached(json.dumps(dict(model_cfg), sort_keys=True, default=str), tp, precision)


def param_counts(model_cfg: Mapping[str, Any], tp: int, precision: PrecisionPlan) -> tuple[int, int]:
    """(model-dtype, fp32) parameters of TP rank 0 (``meta_census``)."""
    census = meta_census(model_cfg, tp, precision)
    return census.low_params, census.fp32_params
