"""Every check that involves several config keys, in one place, all run before any process group exists.

``check_config`` runs from ``Config.from_dict`` (so from every ``Config.from_file``), after the key-by-key
validation; it also fills the defaults derived from other keys. ``check_world_size`` needs the launch
size and runs in ``tessera.core.launch`` before the process joins anything. Rules shared with other
layers are stated once and called from both sides: the model's size rules are ``tessera.model.args``'s
(the model checks them again at build time); the layout rules are ``parallel_sizes`` /
``resolve_zero1_size`` here, for the group layout and the optimizer to call as well.
"""

from __future__ import annotations

from typing import Any

import torch

from tessera.config.dtypes import ModelDtype, resolve_model_dtype
from tessera.config.errors import ConfigError, where
from tessera.config.schema import SCHEMA, default_of
from tessera.model.args import ModelArgs, ModelSizeError, check_tensor_parallel_sizes
from tessera.model.compile import settings_problem as compile_settings_problem
from tessera.parallel.gemm import BLOCK_FORMATS, GemmPolicy

__all__ = ["check_config", "check_data", "check_model_sizes", "check_world_size", "low_precision_gemms_problem",
           "masters_problem", "parallel_sizes", "resolve_zero1_size"]

_MODEL_KEYS = frozenset(SCHEMA.keys["model"].keys)  # type: ignore[union-attr]


def _config_size_name(name: str, value: int | float) -> str:
    """A size in a config error: the key that sets it (``model.vocab_size=257``, ``parallel.tensor.size=2``)."""
    if name == "tp":
        return f"parallel.tensor.size={value}"
    text = f"{value:g}" if isinstance(value, float) else str(value)
    return f"model.{name}={text}" if name in _MODEL_KEYS else f"{name}={text}"


def check_model_sizes(model: dict[str, Any], tp: int, source: str | None = None) -> None:
    """The model's own size rules (``tessera.model.args.size_problems``) over ``tp``, as a ConfigError naming
    the keys; ``model`` is the validated section, ``num_kv_attention_heads`` already filled."""
    try:
        check_tensor_parallel_sizes(ModelArgs.from_config(model), tp)
    except ModelSizeError as e:
        raise ConfigError("; ".join(p.describe(_config_size_name) for p in e.problems) + where(source)) from None


def check_data(data: dict[str, Any], source: str | None = None) -> None:
    """Rules among the ``data`` keys alone (``build_data`` runs them on its partial dicts too)."""
    w = where(source)
    if data["valid_context_len"] >= data["seq_len"]:
        raise ConfigError(f"data.valid_context_len={data['valid_context_len']} must be below "
                          f"data.seq_len={data['seq_len']} (a validation row needs a token to score){w}")
    if data["type"] in ("tokens", "text") and not data["train_folder"]:
        raise ConfigError(f"data.train_folder is required when data.type='{data['type']}'{w}")
    text = data["text"]
    if data["type"] != "text":
        changed = sorted(k for k, v in text.items() if v != default_of(f"data.text.{k}"))
        if changed:
            raise ConfigError(f"data.text.{changed[0]}={text[changed[0]]!r} applies only to data.type='text' (this "
                              f"run reads data.type={data['type']!r}); remove it or set data.type='text'{w}")
    if text["valid_fraction"] and text["valid_every_nth"]:
        raise ConfigError(f"data.text.valid_fraction={text['valid_fraction']} and data.text.valid_every_nth="
                          f"{text['valid_every_nth']}: give one rule for holding out validation documents{w}")
    if data["type"] == "text" and data["valid_folder"] and (text["valid_fraction"] or text["valid_every_nth"]):
        raise ConfigError(f"data.valid_folder={data['valid_folder']} and a held-out rule (data.text.valid_fraction / "
                          f"valid_every_nth): validate on one or the other{w}")


def check_config(cfg: dict[str, Any], source: str | None = None) -> None:
    """Fill the defaults derived from other keys and check every rule that involves several keys (in place)."""
    w = where(source)
    m, par, data = cfg["model"], cfg["parallel"], cfg["data"]
    if par["pipeline"]["size"] != 1:
        raise ConfigError(f"parallel.pipeline.size={par['pipeline']['size']}: pipeline parallelism is not supported; "
                          f"use 1{w}")
    if m["num_kv_attention_heads"] is None:
        m["num_kv_attention_heads"] = m["num_attention_heads"]
    check_model_sizes(m, par["tensor"]["size"], source)
    if par["tensor"]["mode"] == "msp" and data["seq_len"] % par["tensor"]["size"]:
        raise ConfigError(f"data.seq_len={data['seq_len']} is not divisible by parallel.tensor.size="
                          f"{par['tensor']['size']}: parallel.tensor.mode='msp' splits the sequence evenly over "
                          f"the tensor-parallel ranks{w}")
    if m["max_position_embeddings"] is None:
        m["max_position_embeddings"] = data["seq_len"]
    elif data["seq_len"] > m["max_position_embeddings"]:
        raise ConfigError(
            f"data.seq_len={data['seq_len']} exceeds model.max_position_embeddings={m['max_position_embeddings']}{w}"
        )
    if m["sliding_window"] is not None and m["sliding_window"] < data["seq_len"]:
        raise ConfigError(f"model.sliding_window={m['sliding_window']} is shorter than data.seq_len={data['seq_len']}: "
                          f"tessera's attention is full causal, which equals a sliding window only up to the window's "
                          f"length; train with data.seq_len <= {m['sliding_window']}{w}")
    check_data(data, source)
    if cfg["lr_scheduler"]["total_steps"] is None:
        cfg["lr_scheduler"]["total_steps"] = data["total_steps"]
    gs = cfg["grad_scaler"]
    if gs["fp16"]["min_scale"] > gs["max_scale"]:
        raise ConfigError(f"grad_scaler.fp16.min_scale={gs['fp16']['min_scale']} exceeds "
                          f"grad_scaler.max_scale={gs['max_scale']}{w}")
    if not gs["fp16"]["min_scale"] <= gs["fp16"]["initial_scale"] <= gs["max_scale"]:
        raise ConfigError(f"grad_scaler.fp16.initial_scale={gs['fp16']['initial_scale']} is outside "
                          f"[min_scale, max_scale]{w}")
    check_optimizer_precision(cfg, source)
    problem = compile_settings_problem(m["compile"]["backend"], m["compile"]["mode"])
    if problem:
        raise ConfigError(problem + w)
    met = cfg["metrics"]
    if met["precision_every"] and met["precision_activations"] and m["compile"]["enabled"] is True:
        raise ConfigError(f"metrics.precision_every={met['precision_every']} with metrics.precision_activations="
                          "True hooks module outputs inside the decoder blocks, which model.compile.enabled=True "
                          "compiles: set metrics.precision_activations=False (gradients and updates only) or "
                          f"model.compile.enabled=False{w}")
    ck = cfg["ckpt"]
    if ck["enable_save_ckpt"] and not ck["save_ckpt_folder"]:
        raise ConfigError(f"ckpt.save_ckpt_folder is required when ckpt.enable_save_ckpt=True{w}")
    ev = cfg["eval"]
    if ev["tasks"] and not ev["every"] and not ev["at_end"]:
        raise ConfigError(f"eval.tasks={ev['tasks']} would never run with eval.every=0 and eval.at_end=False: set "
                          f"eval.every=N (steps) or eval.at_end=True{w}")


def low_precision_gemms_problem(enabled: bool, model: ModelDtype) -> str | None:
    """The rule between ``model.low_precision.enabled`` and ``model.dtype`` (the config check and the layers ask
    it)."""
    if enabled and model.dtype != torch.bfloat16:
        return f"model.low_precision.enabled=True needs model.dtype bfloat16, not {model.name}"
    return None


def masters_problem(master_dtype: str, compensation: str, model: ModelDtype) -> str | None:
    """The rules between ``hybrid_zero_optimizer.master_dtype`` / ``master_compensation`` and ``model.dtype``
    (the config check and the optimizer's master policy ask it)."""
    if master_dtype == "bf16" and model.dtype != torch.bfloat16:
        return (f"hybrid_zero_optimizer.master_dtype='bf16' needs model.dtype bfloat16, not {model.name}: the "
                "masters share the bf16 weights' storage")
    if compensation != "none" and master_dtype != "bf16":
        return (f"hybrid_zero_optimizer.master_compensation={compensation!r} applies to bf16 masters only; set "
                "hybrid_zero_optimizer.master_dtype='bf16'")
    return None


def low_precision_switches_problem(section: dict[str, Any], num_layers: int) -> str | None:
    """The rules between ``model.low_precision``'s switches and its recipes (the main one and the rules'): NVFP4's
    switches need an NVFP4 linear, stochastic rounding a block format, the kept blocks fewer than the model's."""
    if not section["enabled"]:
        return None
    recipes = {section["recipe"], *(r for _, r in section["rules"])}
    for key in ("nvfp4_2d_weights", "hadamard_wgrad"):
        if section[key] and "nvfp4" not in recipes:
            return (f"model.low_precision.{key}=True is an nvfp4 switch, but no linear runs nvfp4 (recipes "
                    f"{sorted(recipes)})")
    if section["stochastic_gradients"] and not recipes & set(BLOCK_FORMATS):
        return ("model.low_precision.stochastic_gradients=True rounds a block format's gradients, but no linear runs "
                f"mxfp8 or nvfp4 (recipes {sorted(recipes)})")
    kept = section["keep_first_blocks"] + section["keep_last_blocks"]
    if kept >= num_layers:
        return (f"model.low_precision.keep_first_blocks + keep_last_blocks = {kept} keeps every one of "
                f"model.num_layers={num_layers} blocks in the model dtype: nothing would run in low precision")
    return None


def check_optimizer_precision(cfg: dict[str, Any], source: str | None = None) -> None:
    """The cross-key precision rules: fp8 linears and bf16 masters only under a bf16 model, a compensation only
    for bf16 masters, the block formats never on the scaled_mm backend (``GemmPolicy``'s rule)."""
    opt, fp8 = cfg["hybrid_zero_optimizer"], cfg["model"]["low_precision"]
    model_dtype = resolve_model_dtype(cfg["model"]["dtype"])
    problem = (low_precision_gemms_problem(fp8["enabled"], model_dtype)
               or masters_problem(opt["master_dtype"], opt["master_compensation"], model_dtype)
               or low_precision_switches_problem(fp8, cfg["model"]["num_layers"]))
    if problem is None and fp8["recipe"] in BLOCK_FORMATS:
        try:
            GemmPolicy("block", fp8["recipe"], fp8["backend"])
        except ValueError as e:
            problem = str(e)
    if problem:
        raise ConfigError(problem + where(source))


# ------------------------------------------------------------------------------ layout (needs the world size)
def resolve_zero1_size(dp: int, zero1: int, source: str | None = None) -> int:
    """``parallel.zero1.size`` over a data-parallel group of ``dp`` ranks: -1 means all of them; it must divide dp."""
    zero1 = dp if zero1 == -1 else zero1
    if dp % zero1:
        raise ConfigError(f"parallel.zero1.size={zero1} does not divide the data-parallel size {dp}{where(source)}")
    return zero1


def parallel_sizes(world_size: int, tp: int, zero1: int, source: str | None = None) -> tuple[int, int, int]:
    """``(tp, dp, zero1)`` of a job of ``world_size`` ranks; world size must be tp x dp and zero1 divide dp."""
    if world_size % tp:
        raise ConfigError(
            f"world size {world_size} is not a multiple of parallel.tensor.size={tp}: "
            f"world size must equal tensor size x data size{where(source)}"
        )
    dp = world_size // tp
    try:
        zero1 = resolve_zero1_size(dp, zero1)
    except ConfigError as e:
        raise ConfigError(f"{e} (world {world_size} / tp {tp}){where(source)}") from None
    return tp, dp, zero1


def check_world_size(cfg: Any, world_size: int) -> tuple[int, int, int]:
    """Check the launch size against the config; return (tp, dp, zero1). Raised on every rank alike."""
    return parallel_sizes(world_size, cfg.parallel.tensor.size, cfg.parallel.zero1.size, cfg.source)
