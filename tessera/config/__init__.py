"""Python config files: load, apply ``key.sub=value`` overrides, fill defaults, validate strictly.

A config is a Python file of plain dicts (InternEvo style). Names in ALL_CAPS, modules, functions and
names starting with ``_`` are treated as the file's own helpers and are not part of the config. Every
other top-level name must be a known key. Validation happens before any process group exists, so a
typo costs a second, not a queue slot on a cluster.
"""

from __future__ import annotations

import ast
import copy
import difflib
import importlib.util
import math
import os
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch

from tessera.config.errors import ConfigError



_REQUIRED = object()


@dataclass
class Key:
    """One config key: accepted types, default, and an optional range/choice check."""

    types: tuple[type, ...]
    default: Any = _REQUIRED
    check: Callable[[Any], str | None] | None = None
    doc: str = ""
    nullable: bool = False


@dataclass
class Section:
    """A dict-valued key whose own keys are validated recursively."""

    keys: dict[str, "Key | Section"]
    doc: str = ""
    optional: bool = True  # may be absent from the file (then all defaults)
    extra: dict[str, Any] = field(default_factory=dict)


def _positive(v: Any) -> str | None:
    return None if v > 0 else "must be > 0"


def _non_negative(v: Any) -> str | None:
    return None if v >= 0 else "must be >= 0"


def _fraction(v: Any) -> str | None:
    return None if 0 <= v <= 1 else "must be in [0, 1]"


def _one_of(*choices: Any) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        return None if v in choices else f"must be one of {list(choices)}"

    return check


def _size_or_all(v: Any) -> str | None:
    return None if v == -1 or v >= 1 else "must be -1 (whole data-parallel group) or >= 1"


def _checkpoint_value(v: Any) -> str | None:
    if isinstance(v, bool):
        return None
    return None if 0 <= v <= 1 else "must be a bool or a fraction of layers in [0, 1]"


def _dtype_value(v: Any) -> str | None:
    from tessera.config.precision import parse_dtype

    try:
        parse_dtype(v)
    except ConfigError as e:
        return str(e)
    return None


def _str_list(v: Any) -> str | None:
    return None if all(isinstance(x, str) for x in v) else "must be a list of strings"


INT = (int,)
FLOAT = (float, int)
BOOL = (bool,)
STR = (str,)

SCHEMA = Section(
    {
        "job_name": Key(STR, "tessera", doc="name of the run; the log folder is log_folder/job_name"),
        "seed": Key(INT, 1024, _non_negative, doc="global seed (train.py --seed overrides)"),
        "log_folder": Key(STR, "runs", doc="metrics.jsonl, TensorBoard events and text logs go here"),
        "cudnn_deterministic": Key(BOOL, False),
        "cudnn_benchmark": Key(BOOL, False),
        "dist": Section(
            {
                "timeout_s": Key(FLOAT, 1800, _positive, doc="collective timeout in seconds"),
                "backend": Key(STR, None, _one_of("nccl", "gloo"), nullable=True, doc="None: nccl on CUDA, else gloo"),
                "cpu_shm_allreduce": Key(STR, "auto", _one_of("auto", "on", "off"),
                                         doc="tensor-parallel all-reduces on CPU through shared memory instead of "
                                             "gloo when the TP group is on one machine; auto: unless its "
                                             "processes outnumber the cores"),
            }
        ),
        "model": Section(
            {
                "num_layers": Key(INT, check=_positive),
                "hidden_size": Key(INT, check=_positive),
                "num_attention_heads": Key(INT, check=_positive),
                "num_kv_attention_heads": Key(INT, None, _positive, nullable=True, doc="None: = num_attention_heads"),
                "vocab_size": Key(INT, check=_positive),
                "mlp_ratio": Key(FLOAT, 8 / 3, _positive),
                "multiple_of": Key(INT, 256, _positive, doc="SwiGLU hidden size is rounded up to a multiple of this"),
                "dtype": Key((str, torch.dtype), "torch.bfloat16", _dtype_value),
                "norm_type": Key(STR, "rmsnorm", _one_of("rmsnorm")),
                "layer_norm_epsilon": Key(FLOAT, 1e-5, _positive),
                "use_flash_attn": Key(BOOL, True, doc="use the flash-attn package on CUDA when it is installed"),
                "checkpoint": Key((bool, float, int), False, _checkpoint_value, doc="activation checkpointing"),
                "parallel_output": Key(BOOL, True, doc="keep logits vocab-sharded for the parallel loss"),
                "tie_word_embeddings": Key(BOOL, False),
                "rope_base": Key(FLOAT, 10000.0, _positive),
                "max_position_embeddings": Key(INT, None, _positive, nullable=True, doc="None: data.seq_len"),
                "init_std": Key(FLOAT, 0.02, _positive),
                "dropout": Key(FLOAT, 0.0, _fraction, doc="residual dropout (outside TP regions)"),
                "attn_dropout": Key(FLOAT, 0.0, _fraction, doc="attention-probability dropout (inside TP regions)"),
                "bias": Key(BOOL, False, doc="biases on attention and MLP projections"),
                "fp32_modules": Key((list, tuple), [], _str_list, doc="fnmatch patterns of module names kept fp32"),
                "use_fp32_norm": Key(BOOL, False, doc="keep every norm module fp32 (InternEvo's switch)"),
            },
            optional=False,
        ),
        "parallel": Section(
            {
                "tensor": Section(
                    {
                        "size": Key(INT, 1, _positive),
                        "mode": Key(STR, "mtp", _one_of("mtp")),
                    }
                ),
                "zero1": Section({"size": Key(INT, -1, _size_or_all)}),
                "pipeline": Section(
                    {"size": Key(INT, 1, _positive, doc="only 1: pipeline parallelism is not supported")}
                ),
            }
        ),
        "data": Section(
            {
                "seq_len": Key(INT, 2048, _positive),
                "micro_bsz": Key(INT, 1, _positive),
                "micro_num": Key(INT, 1, _positive, doc="micro-batches accumulated per optimizer step"),
                "total_steps": Key(INT, 1000, _positive),
                "type": Key(STR, "tokens", _one_of("tokens", "synthetic", "stdlib"),
                            doc="tokens: prepared token folders; synthetic: random tokens; stdlib: Python's own source"),
                "train_folder": Key(STR, None, nullable=True),
                "valid_folder": Key(STR, None, nullable=True),
                "cache_folder": Key(STR, "data_cache", doc="where type='stdlib' prepares its token files"),
                "valid_every": Key(INT, 0, _non_negative, doc="0: validate only at the end"),
                "valid_micro_num": Key(INT, 8, _positive),
                "valid_micro_bsz": Key(INT, None, _positive, nullable=True,
                                       doc="rows per validation forward; None: micro_bsz (no backward, so it "
                                           "can be larger)"),
                "valid_context_len": Key(INT, 0, _non_negative,
                                         doc="validation rows after a stream's first start this many tokens "
                                             "early; those are context, not scored (each token is still "
                                             "scored once, with at least this much of its document before it)"),
                "pack_sample_into_one": Key(BOOL, False, doc="True: positions do not restart per document"),
                "num_workers": Key(INT, 0, _non_negative),
            }
        ),
        "adam": Section(
            {
                "lr": Key(FLOAT, 1e-4, _non_negative),
                "adam_beta1": Key(FLOAT, 0.9, _fraction),
                "adam_beta2": Key(FLOAT, 0.95, _fraction),
                "adam_eps": Key(FLOAT, 1e-8, _positive),
                "weight_decay": Key(FLOAT, 0.01, _non_negative),
                "decay_norm_and_bias": Key(BOOL, False, doc="False: norms and biases get no weight decay"),
            }
        ),
        "lr_scheduler": Section(
            {
                "total_steps": Key(INT, None, _positive, nullable=True, doc="None: data.total_steps"),
                "init_steps": Key(INT, 0, _non_negative),
                "warmup_ratio": Key(FLOAT, 0.01, _fraction),
                "eta_min": Key(FLOAT, 1e-5, _non_negative),
                "last_epoch": Key(INT, -1),
            }
        ),
        "grad_scaler": Section(
            {
                "fp16": Section(
                    {
                        "initial_scale": Key(FLOAT, 2**16, _positive),
                        "min_scale": Key(FLOAT, 1.0, _positive),
                        "growth_interval": Key(INT, 1000, _positive),
                    }
                ),
                "growth_factor": Key(FLOAT, 2.0, lambda v: None if v > 1 else "must be > 1"),
                "backoff_factor": Key(FLOAT, 0.5, lambda v: None if 0 < v < 1 else "must be in (0, 1)"),
                "max_scale": Key(FLOAT, 2**24, _positive),
                "hysteresis": Key(INT, 2, _positive),
            }
        ),
        "hybrid_zero_optimizer": Section(
            {
                "clip_grad_norm": Key(FLOAT, 1.0, _non_negative, doc="0 disables clipping"),
                "reduce_dtype": Key(STR, "fp32", _one_of("fp32", "model"),
                                    doc="dtype of gradient accumulation and the DP all-reduce"),
                "max_consecutive_skips": Key(INT, 20, _positive,
                                             doc="stop the run when more steps than this in a row are skipped "
                                                 "(inf/NaN); fp16 counts them once the loss scale is at its minimum"),
            }
        ),
        "loss": Section({"label_smoothing": Key(FLOAT, 0.0, _fraction)}),
        "ckpt": Section(
            {
                "enable_save_ckpt": Key(BOOL, False),
                "save_ckpt_folder": Key(STR, None, nullable=True),
                "load_ckpt_folder": Key(STR, None, nullable=True, doc="weights-only start (fine-tuning)"),
                "auto_resume": Key(BOOL, True),
                "checkpoint_every": Key(INT, 0, _non_negative, doc="0: only at the end"),
                "keep_last": Key(INT, 0, _non_negative, doc="0: keep every checkpoint"),
            }
        ),
        "metrics": Section(
            {
                "log_every": Key(INT, 1, _positive, doc="print a line every N steps (metrics.jsonl and TensorBoard get every step)"),
                "tensorboard": Key(BOOL, True),
                "progress_bar": Key(BOOL, True),
                "peak_tflops": Key(FLOAT, None, _positive, nullable=True,
                                   doc="per-device peak for MFU; None: GPU table or measured CPU peak"),
            }
        ),
        "generate": Section(
            {
                "prompt": Key(STR, "def "),
                "max_new_tokens": Key(INT, 0, _non_negative, doc="sample this many tokens at the end (0: none)"),
                "temperature": Key(FLOAT, 0.8, _non_negative),
                "top_k": Key(INT, 0, _non_negative),
                "top_p": Key(FLOAT, 1.0, _fraction),
            }
        ),
    },
    optional=False,
)


class Config(dict):
    """A dict with attribute access, recursively (``cfg.model.hidden_size``)."""

    def __init__(self, data: Mapping[str, Any] | None = None, source: str | None = None):
        super().__init__()
        for k, v in (data or {}).items():
            self[k] = Config(v) if isinstance(v, Mapping) and not isinstance(v, Config) else v
        object.__setattr__(self, "_source", source)

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"config has no key {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = Config(value) if isinstance(value, Mapping) and not isinstance(value, Config) else value

    def __deepcopy__(self, memo: dict) -> "Config":
        return Config(copy.deepcopy(dict(self), memo), self.source)

    @property
    def source(self) -> str | None:
        return object.__getattribute__(self, "_source")

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-friendly dict (torch dtypes become their names)."""

        def plain(v: Any) -> Any:
            if isinstance(v, Mapping):
                return {k: plain(x) for k, x in v.items()}
            if isinstance(v, (list, tuple)):
                return [plain(x) for x in v]
            if isinstance(v, torch.dtype):
                return str(v)
            return v

        return plain(self)

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_file(cls, path: str | os.PathLike, overrides: Iterable[str] = ()) -> "Config":
        """Execute a Python config file, apply ``key.sub=value`` overrides, fill defaults, validate."""
        raw = load_python_file(path)
        apply_overrides(raw, overrides, source=str(path))
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str | None = None) -> "Config":
        """Validate a plain dict (e.g. written in a test) against the schema and fill defaults."""
        filled = _validate_section(SCHEMA, dict(copy.deepcopy(raw)), "", source)
        _derive_and_cross_check(filled, source)
        return cls(filled, source)


def _where(source: str | None) -> str:
    return f" (in {source})" if source else ""


def load_python_file(path: str | os.PathLike) -> dict[str, Any]:
    """Run the config file as a module and return its config-relevant globals."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    spec = importlib.util.spec_from_file_location("_tessera_config", path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"cannot load config file {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise ConfigError(f"syntax error in config file {path}, line {e.lineno}: {e.msg}\n  {(e.text or '').rstrip()}") from None
    except Exception as e:  # noqa: BLE001 - any error while running user code is a config error
        raise ConfigError(f"error while running config file {path}: {type(e).__name__}: {e}") from e
    out: dict[str, Any] = {}
    for name, value in vars(module).items():
        if name.startswith("_") or name.isupper():
            continue
        if isinstance(value, (types.ModuleType, types.FunctionType, type)):
            continue
        out[name] = value
    return out


def parse_override(text: str, source: str | None = None) -> tuple[list[str], Any]:
    """``"model.dtype=bf16"`` -> (["model", "dtype"], "bf16"); values are Python literals."""
    if "=" not in text:
        raise ConfigError(f"bad override {text!r}: expected key.sub=value{_where(source)}")
    key, value_text = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(p.isidentifier() for p in parts):
        raise ConfigError(f"bad override {text!r}: {key!r} is not a dotted key name")
    try:
        value = ast.literal_eval(value_text.strip())
    except (ValueError, SyntaxError):
        stripped = value_text.strip()
        # a bare word (bf16, torch.bfloat16, a path) is taken as a string; anything else is an error
        if stripped and all(c.isalnum() or c in "._-/+:" for c in stripped):
            value = stripped
        else:
            raise ConfigError(f"bad override {text!r}: value {value_text!r} is not a Python literal") from None
    return parts, value


def apply_overrides(raw: dict[str, Any], overrides: Iterable[str], source: str | None = None) -> None:
    """Apply CLI overrides in place; keys are checked against the schema (typos get a suggestion)."""
    for text in overrides:
        parts, value = parse_override(text, source)
        node: dict[str, Any] = raw
        spec: Section = SCHEMA
        for i, p in enumerate(parts):
            dotted = ".".join(parts[: i + 1])
            if p not in spec.keys:
                raise ConfigError(f"bad override {text!r}: unknown key {dotted!r}{_suggest(p, spec.keys)}")
            sub = spec.keys[p]
            if i == len(parts) - 1:
                node[p] = value
            else:
                if not isinstance(sub, Section):
                    raise ConfigError(f"bad override {text!r}: {dotted!r} is not a section")
                node = node.setdefault(p, {})
                if not isinstance(node, dict):
                    raise ConfigError(f"bad override {text!r}: {dotted!r} is not a dict in the config")
                spec = sub


def _suggest(name: str, valid: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else f"; valid keys: {sorted(valid)}"


def _type_name(types_: tuple[type, ...]) -> str:
    return " or ".join(t.__name__ for t in types_)


def _validate_value(key: Key, value: Any, dotted: str, source: str | None) -> Any:
    if value is None and key.nullable:
        return None
    ok = isinstance(value, key.types) and not (isinstance(value, bool) and bool not in key.types)
    if not ok:
        raise ConfigError(
            f"{dotted}: expected {_type_name(key.types)}, got {type(value).__name__} {value!r}{_where(source)}"
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{dotted}: must be finite, got {value!r}{_where(source)}")
    if key.check is not None:
        problem = key.check(value)
        if problem:
            raise ConfigError(f"{dotted}: {problem}, got {value!r}{_where(source)}")
    if isinstance(value, tuple):
        value = list(value)
    return value


def _validate_section(spec: Section, raw: Any, prefix: str, source: str | None) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a dict, got {type(raw).__name__}{_where(source)}")
    for name in raw:
        if name not in spec.keys:
            where = f"{prefix}.{name}" if prefix else name
            raise ConfigError(f"unknown key {where!r}{_suggest(name, spec.keys)}{_where(source)}")
    out: dict[str, Any] = {}
    for name, sub in spec.keys.items():
        dotted = f"{prefix}.{name}" if prefix else name
        if isinstance(sub, Section):
            if name not in raw and not sub.optional:
                raise ConfigError(f"missing required section {dotted!r}{_where(source)}")
            out[name] = _validate_section(sub, raw.get(name, {}), dotted, source)
        elif name in raw:
            out[name] = _validate_value(sub, raw[name], dotted, source)
        elif sub.default is _REQUIRED:
            raise ConfigError(f"missing required key {dotted!r}{_where(source)}")
        else:
            out[name] = copy.deepcopy(sub.default)
    return out


def _derive_and_cross_check(cfg: dict[str, Any], source: str | None) -> None:
    """Fill derived defaults and check constraints that involve several keys."""
    w = _where(source)
    m, par, data = cfg["model"], cfg["parallel"], cfg["data"]
    tp = par["tensor"]["size"]
    if par["pipeline"]["size"] != 1:
        raise ConfigError(f"parallel.pipeline.size={par['pipeline']['size']}: pipeline parallelism is not supported; use 1{w}")
    if m["num_kv_attention_heads"] is None:
        m["num_kv_attention_heads"] = m["num_attention_heads"]
    heads, kv = m["num_attention_heads"], m["num_kv_attention_heads"]
    if m["hidden_size"] % heads:
        raise ConfigError(f"model.hidden_size={m['hidden_size']} is not divisible by model.num_attention_heads={heads}{w}")
    if heads % kv:
        raise ConfigError(f"model.num_attention_heads={heads} is not divisible by model.num_kv_attention_heads={kv}{w}")
    if heads % tp:
        raise ConfigError(f"model.num_attention_heads={heads} is not divisible by parallel.tensor.size={tp}{w}")
    if kv % tp:
        raise ConfigError(f"model.num_kv_attention_heads={kv} is not divisible by parallel.tensor.size={tp}{w}")
    if m["vocab_size"] % tp:
        raise ConfigError(
            f"model.vocab_size={m['vocab_size']} is not divisible by parallel.tensor.size={tp}; "
            f"round the vocabulary up to a multiple of {tp}{w}"
        )
    if (m["hidden_size"] // heads) % 2:
        raise ConfigError(f"model.hidden_size/num_attention_heads={m['hidden_size'] // heads}: rotary needs an even head dim{w}")
    if m["max_position_embeddings"] is None:
        m["max_position_embeddings"] = data["seq_len"]
    elif data["seq_len"] > m["max_position_embeddings"]:
        raise ConfigError(
            f"data.seq_len={data['seq_len']} exceeds model.max_position_embeddings={m['max_position_embeddings']}{w}"
        )
    if data["valid_context_len"] >= data["seq_len"]:
        raise ConfigError(f"data.valid_context_len={data['valid_context_len']} must be below "
                          f"data.seq_len={data['seq_len']} (a validation row needs a token to score){w}")
    if cfg["lr_scheduler"]["total_steps"] is None:
        cfg["lr_scheduler"]["total_steps"] = data["total_steps"]
    if data["type"] == "tokens" and not data["train_folder"]:
        raise ConfigError(f"data.train_folder is required when data.type='tokens'{w}")
    gs = cfg["grad_scaler"]
    if gs["fp16"]["min_scale"] > gs["max_scale"]:
        raise ConfigError(f"grad_scaler.fp16.min_scale={gs['fp16']['min_scale']} exceeds grad_scaler.max_scale={gs['max_scale']}{w}")
    if not gs["fp16"]["min_scale"] <= gs["fp16"]["initial_scale"] <= gs["max_scale"]:
        raise ConfigError(f"grad_scaler.fp16.initial_scale={gs['fp16']['initial_scale']} is outside [min_scale, max_scale]{w}")
    ck = cfg["ckpt"]
    if ck["enable_save_ckpt"] and not ck["save_ckpt_folder"]:
        raise ConfigError(f"ckpt.save_ckpt_folder is required when ckpt.enable_save_ckpt=True{w}")


def check_world_size(cfg: Config, world_size: int) -> tuple[int, int, int]:
    """Check the launch size against the config; return (tp, dp, zero1). Raised on every rank alike."""
    tp = cfg.parallel.tensor.size
    w = _where(cfg.source)
    if world_size % tp:
        raise ConfigError(
            f"world size {world_size} is not a multiple of parallel.tensor.size={tp}: "
            f"world size must equal tensor size x data size{w}"
        )
    dp = world_size // tp
    zero1 = cfg.parallel.zero1.size
    zero1 = dp if zero1 == -1 else zero1
    if dp % zero1:
        raise ConfigError(f"parallel.zero1.size={zero1} does not divide the data-parallel size {dp} (world {world_size} / tp {tp}){w}")
    return tp, dp, zero1
