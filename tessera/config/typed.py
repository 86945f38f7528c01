"""The typed view of a validated config: one frozen dataclass per section, so mypy checks every key read.

``Config`` stays a dict with attribute access (InternEvo-style user code reads it so), but every value read
off it is ``Any``: ``cfg.data.seq_lenn`` type-checks and fails at run time. ``typed_config(cfg)`` (also
``cfg.typed``) copies a validated ``Config`` into ``RunConfig``, whose fields are the schema's keys with
their types: train.py, the builder and the tools read this view, so a misspelled key or a wrong type fails
``mypy``. The schema (``schema.py``) stays the one home of keys, defaults and checks: these classes hold
no defaults, and ``tests/test_config_typed.py`` checks that their fields, types and choices (``Literal``)
are the schema's, key by key. Keys that ``check_config`` fills from other keys (``FILLED_KEYS``) are
typed without ``None``.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch

from tessera.config.errors import ConfigError, where

__all__ = ["RunConfig", "DistConfig", "ModelConfig", "CompileConfig", "LowPrecisionConfig", "ParallelConfig",
           "TensorParallelConfig", "Zero1Config", "PipelineConfig", "DataConfig", "TextDataConfig", "AdamConfig",
           "LrSchedulerConfig", "GradScalerConfig", "Fp16ScalerConfig", "HybridZeroConfig", "LossConfig", "CkptConfig",
           "MetricsConfig", "WandbConfig", "MemoryConfig", "GenerateConfig", "EvalConfig", "FILLED_KEYS",
           "typed_config"]

# nullable in the schema, but never None after ``check_config`` fills them from other keys
FILLED_KEYS = frozenset({"model.num_kv_attention_heads", "model.max_position_embeddings", "lr_scheduler.total_steps"})


@dataclass(frozen=True)
class _Section:
    """A config section: its keys as typed fields, and back as the plain dict the lower layers take."""

    def as_dict(self) -> dict[str, Any]:
        """The section as the validated plain dict it was built from (nested sections too)."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class DistConfig(_Section):
    timeout_s: float
    backend: Literal["nccl", "gloo"] | None
    cpu_shm_allreduce: Literal["auto", "on", "off"]


@dataclass(frozen=True)
class CompileConfig(_Section):
    enabled: Literal[True, False, "auto"]
    backend: Literal["inductor", "aot_eager", "eager"]
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]


@dataclass(frozen=True)
class LowPrecisionConfig(_Section):
    enabled: bool
    recipe: Literal["tensorwise", "rowwise", "mxfp8", "nvfp4", "rowwise_with_gw_hp", "blockwise"]
    backend: Literal["auto", "scaled_mm", "emulated"]
    exclude: Sequence[str]
    rules: Sequence[tuple[str, str]]
    preset: Literal["nvidia", "torchtitan"] | None
    mx_scale_rounding: Literal["floor", "rceil"]
    nvfp4_2d_weights: bool
    hadamard_wgrad: bool
    stochastic_gradients: bool
    keep_first_blocks: int
    keep_last_blocks: int
    high_precision_forward_from_step: int | None


@dataclass(frozen=True)
class ModelConfig(_Section):
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_attention_heads: int  # filled: num_attention_heads when the file leaves it None
    vocab_size: int
    mlp_ratio: float
    multiple_of: int
    dtype: str | torch.dtype
    norm_type: Literal["rmsnorm"]
    layer_norm_epsilon: float
    use_flash_attn: bool
    checkpoint: bool | float | str
    parallel_output: bool
    tie_word_embeddings: bool
    rope_base: float
    max_position_embeddings: int  # filled: data.seq_len when the file leaves it None
    init_std: float
    dropout: float
    attn_dropout: float
    bias: bool
    qkv_bias: bool | None
    mlp_bias: bool | None
    head_dim: int | None
    qk_norm: bool
    rope_scaling: Mapping[str, float | str] | None  # Hugging Face's parameters: 'type' and numbers
    sliding_window: int | None
    fp32_modules: Sequence[str]
    use_fp32_norm: bool
    allow_reduced_precision_reduction: bool
    compile: CompileConfig
    low_precision: LowPrecisionConfig


@dataclass(frozen=True)
class TensorParallelConfig(_Section):
    size: int
    mode: Literal["mtp", "msp"]


@dataclass(frozen=True)
class Zero1Config(_Section):
    size: int


@dataclass(frozen=True)
class PipelineConfig(_Section):
    size: int


@dataclass(frozen=True)
class ParallelConfig(_Section):
    tensor: TensorParallelConfig
    zero1: Zero1Config
    pipeline: PipelineConfig


@dataclass(frozen=True)
class TextDataConfig(_Section):
    tokenizer: str
    eod_token: str | None
    add_bos: bool
    text_column: str
    hf_split: str
    patterns: Sequence[str] | None
    valid_fraction: float
    valid_every_nth: int
    workers: int | None


@dataclass(frozen=True)
class DataConfig(_Section):
    seq_len: int
    micro_bsz: int
    micro_num: int
    total_steps: int
    type: Literal["tokens", "synthetic", "stdlib", "text"]
    train_folder: str | None
    valid_folder: str | None
    cache_folder: str
    valid_every: int
    valid_micro_num: int
    valid_micro_bsz: int | None
    valid_context_len: int
    pack_sample_into_one: bool
    min_length: int
    min_length_dict: Mapping[str, int] | None
    text: TextDataConfig


@dataclass(frozen=True)
class AdamConfig(_Section):
    lr: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    weight_decay: float
    decay_norm_and_bias: bool


@dataclass(frozen=True)
class LrSchedulerConfig(_Section):
    total_steps: int  # filled: data.total_steps when the file leaves it None
    init_steps: int
    warmup_ratio: float
    eta_min: float
    last_epoch: int


@dataclass(frozen=True)
class Fp16ScalerConfig(_Section):
    initial_scale: float
    min_scale: float
    growth_interval: int


@dataclass(frozen=True)
class GradScalerConfig(_Section):
    fp16: Fp16ScalerConfig
    growth_factor: float
    backoff_factor: float
    max_scale: float
    hysteresis: int


@dataclass(frozen=True)
class HybridZeroConfig(_Section):
    clip_grad_norm: float
    reduce_dtype: Literal["fp32", "model"]
    master_dtype: Literal["fp32", "bf16"]
    master_compensation: Literal["none", "kahan", "stochastic"]
    optimizer_state_dtype: Literal["fp32", "bf16"]
    overlap_sync_grad: bool
    reduce_bucket_size: int
    fuse_wgrad_accumulation: bool
    max_consecutive_skips: int


@dataclass(frozen=True)
class LossConfig(_Section):
    label_smoothing: float
    chunk_tokens: int


@dataclass(frozen=True)
class CkptConfig(_Section):
    enable_save_ckpt: bool
    save_ckpt_folder: str | None
    load_ckpt_folder: str | None
    auto_resume: bool
    checkpoint_every: int
    keep_last: int


@dataclass(frozen=True)
class WandbConfig(_Section):
    project: str | None
    entity: str | None
    mode: Literal["online", "offline", "disabled"]
    name: str | None
    tags: Sequence[str]


@dataclass(frozen=True)
class MetricsConfig(_Section):
    log_every: int
    tensorboard: bool
    progress_bar: bool
    peak_tflops: float | None
    precision_every: int
    precision_group: Literal["module", "layer", "kind"]
    precision_activations: bool
    wandb: WandbConfig


@dataclass(frozen=True)
class MemoryConfig(_Section):
    headroom: float


@dataclass(frozen=True)
class GenerateConfig(_Section):
    prompt: str
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float


@dataclass(frozen=True)
class EvalConfig(_Section):
    tasks: Sequence[str]
    every: int
    at_end: bool
    include_path: str | None
    limit: int | None
    num_fewshot: int | None
    batch_size: int
    max_length: int | None
    max_gen_toks: int
    seed: int
    dtype: Literal["fp32", "bf16", "fp16"]
    tokenizer: str | None
    timeout_s: float


@dataclass(frozen=True)
class RunConfig(_Section):
    """A whole validated config; ``source`` (the file it came from, for error lines) is not a key."""

    job_name: str
    seed: int
    log_folder: str
    cudnn_deterministic: bool
    deterministic: bool
    cudnn_benchmark: bool
    dist: DistConfig
    model: ModelConfig
    parallel: ParallelConfig
    data: DataConfig
    adam: AdamConfig
    lr_scheduler: LrSchedulerConfig
    grad_scaler: GradScalerConfig
    hybrid_zero_optimizer: HybridZeroConfig
    loss: LossConfig
    ckpt: CkptConfig
    metrics: MetricsConfig
    memory: MemoryConfig
    generate: GenerateConfig
    eval: EvalConfig
    source: str | None = dataclasses.field(default=None, compare=False)

    def as_dict(self) -> dict[str, Any]:
        """The config's keys as the validated plain dict (``source`` left out: it is not a key)."""
        out = dataclasses.asdict(self)
        del out["source"]
        return out


S = TypeVar("S", bound=_Section)


def typed_config(cfg: Mapping[str, Any], source: str | None = None) -> RunConfig:
    """The typed view of a config that ``Config.from_dict`` / ``Config.from_file`` validated and checked
    (every key present, the ``FILLED_KEYS`` filled); ``source`` defaults to ``cfg.source`` when it has one."""
    if source is None:
        source = getattr(cfg, "source", None)
    run = _build(RunConfig, cfg, "", source)
    return dataclasses.replace(run, source=source)


def _build(cls: type[S], section: Mapping[str, Any], prefix: str, source: str | None) -> S:
    """``cls`` from one validated section; a missing key or an unfilled one means the dict was not validated."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init or f.name == "source" and cls is RunConfig:
            continue
        dotted = f"{prefix}{f.name}"
        if f.name not in section:
            raise ConfigError(f"typed_config: key {dotted!r} is missing: build the typed view from a validated "
                              f"config (Config.from_dict / Config.from_file){where(source)}")
        value = section[f.name]
        hint = hints[f.name]
        if isinstance(hint, type) and issubclass(hint, _Section):
            if not isinstance(value, Mapping):
                raise ConfigError(f"typed_config: {dotted!r} is {type(value).__name__}, not a section{where(source)}")
            value = _build(hint, value, dotted + ".", source)
        elif value is None and dotted in FILLED_KEYS:
            raise ConfigError(f"typed_config: {dotted!r} is None: build the typed view from a config that "
                              f"check_config filled (Config.from_dict / Config.from_file){where(source)}")
        elif isinstance(value, Mapping):
            value = dict(value)  # a plain copy: the view does not share the config's nested dicts
        elif isinstance(value, list):
            value = list(value)
        values[f.name] = value
    return cls(**values)
