"""The model's shape and options, read once from the config's ``model`` section, and its size rules.

``ModelArgs`` decouples the modules from the config object: ``build_model`` reads the section, the
modules take plain values. Field names are the config keys, and its defaults are the config's
(``tessera.config.schema`` takes them from here).

``size_problems`` is the one statement of which sizes build a model over ``tp`` ranks; the model checks
it at build time (``check_tensor_parallel_sizes``) and the config checks it before any process group
exists, naming the config keys instead (``tessera.config.checks``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tessera.model.mlp import ffn_hidden_size

__all__ = ["ModelArgs", "ModelSizeError", "SizeProblem", "check_sizes", "check_tensor_parallel_sizes",
           "size_name", "size_problems"]


@dataclass
class ModelArgs:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    # None (the default): num_attention_heads, filled in by __post_init__, so readers always see an int
    num_kv_attention_heads: int = None  # type: ignore[assignment]
    mlp_ratio: float = 8 / 3
    multiple_of: int = 256
    layer_norm_epsilon: float = 1e-5
    use_flash_attn: bool = True
    checkpoint: bool | float | str = False  # True / fraction of layers: full; "selective" (tessera.model.recompute)
    parallel_output: bool = True
    tie_word_embeddings: bool = False
    rope_base: float = 10000.0
    init_std: float = 0.02
    dropout: float = 0.0
    attn_dropout: float = 0.0
    bias: bool = False
    # the model families people continue from (Hugging Face import/export names them in tessera.checkpoint.hf)
    # None: hidden_size / num_attention_heads, filled in when it divides (size_problems names it when not)
    head_dim: int = None  # type: ignore[assignment]
    qkv_bias: bool | None = None  # biases on q/k/v (Qwen2: True with bias False); None: as ``bias``
    mlp_bias: bool | None = None  # biases on w1/w3/w2 (InternLM, Llama attention_bias only: False); None: ``bias``
    qk_norm: bool = False  # RMSNorm over head_dim on queries and keys before rotary (Qwen3)
    rope_scaling: dict[str, Any] | None = None  # tessera.model.rotary.ROPE_SCALING_TYPES
    sliding_window: int | None = None  # Mistral's key: only a window no shorter than the sequence is accepted

    def __post_init__(self) -> None:
        if self.num_kv_attention_heads is None:
            self.num_kv_attention_heads = self.num_attention_heads
        if self.head_dim is None and self.hidden_size % self.num_attention_heads == 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if isinstance(self.checkpoint, str) and self.checkpoint != "selective":
            raise ValueError(f"checkpoint={self.checkpoint!r}: must be a bool, a fraction of layers or 'selective'")

    @classmethod
    def from_config(cls, model_cfg: Any) -> ModelArgs:
        """From the validated ``model`` section (attribute access or a mapping); other keys are ignored."""
        if isinstance(model_cfg, ModelArgs):
            return model_cfg
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if isinstance(model_cfg, Mapping):
                if f.name in model_cfg:
                    values[f.name] = model_cfg[f.name]
            elif hasattr(model_cfg, f.name):
                values[f.name] = getattr(model_cfg, f.name)
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.default is dataclasses.MISSING and f.name not in values]
        if missing:
            raise ValueError(f"model config is missing required keys: {missing}")
        return cls(**values)

    @property
    def attention_qkv_bias(self) -> bool:
        """Whether q/k/v carry biases: ``qkv_bias`` when set, else ``bias`` (which always decides wo's)."""
        return self.bias if self.qkv_bias is None else self.qkv_bias

    @property
    def feed_forward_bias(self) -> bool:
        """Whether the MLP's w1/w3/w2 carry biases: ``mlp_bias`` when set, else ``bias``."""
        return self.bias if self.mlp_bias is None else self.mlp_bias

    @property
    def ffn_hidden_size(self) -> int:
        return ffn_hidden_size(self.hidden_size, self.mlp_ratio, self.multiple_of)

    @property
    def selective_checkpoint(self) -> bool:
        """``checkpoint="selective"``: every layer keeps its GEMM outputs and recomputes the rest."""
        return isinstance(self.checkpoint, str)

    @property
    def num_checkpoint_layers(self) -> int:
        """Layers under full checkpointing: all for True, none for False or "selective", else round(fraction*L)."""
        if isinstance(self.checkpoint, str):
            if self.checkpoint != "selective":
                raise ValueError(f"checkpoint={self.checkpoint!r}: a bool, a fraction of layers or 'selective'")
            return 0
        if isinstance(self.checkpoint, bool):
            return self.num_layers if self.checkpoint else 0
        return int(round(float(self.checkpoint) * self.num_layers))


def size_name(name: str, value: int | float) -> str:
    """How the model names a size in an error: ``hidden_size=64``, ``tensor-parallel size 4``."""
    if name == "tp":
        return f"tensor-parallel size {value}"
    return f"{name}={value:g}" if isinstance(value, float) else f"{name}={value}"


@dataclass(frozen=True)
class SizeProblem:
    """One broken size rule: ``text`` with a ``{name}`` field per size involved, ``sizes`` their values."""

    text: str
    sizes: dict[str, int | float]

    def describe(self, name: Callable[[str, int | float], str] = size_name) -> str:
        """The rule as a sentence, each size written by ``name(size_name, value)``."""
        return self.text.format_map({k: name(k, v) for k, v in self.sizes.items()})


class ModelSizeError(ValueError):
    """Sizes that cannot build the model (over this TP size); ``problems`` holds every broken rule."""

    def __init__(self, problems: list[SizeProblem]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(p.describe() for p in self.problems))


def size_problems(
    *,
    hidden_size: int,
    num_attention_heads: int,
    num_kv_attention_heads: int | None = None,
    tp: int = 1,
    vocab_size: int | None = None,
    mlp_ratio: float | None = None,
    multiple_of: int | None = None,
    head_dim: int | None = None,
) -> list[SizeProblem]:
    """Every size rule the decoder (or its attention alone: no vocab/MLP sizes given) breaks over ``tp`` ranks.

    Heads split the hidden size unless ``head_dim`` is given (then the projections map hidden_size to
    heads x head_dim), KV heads split the heads (grouped queries), rotary needs an even head dim, and
    every tensor-parallel dim (query heads, KV heads, vocabulary, SwiGLU hidden) splits over tp.
    """
    kv = num_attention_heads if num_kv_attention_heads is None else num_kv_attention_heads
    hidden, heads = hidden_size, num_attention_heads
    out: list[SizeProblem] = []
    if head_dim is not None:
        if head_dim % 2:
            out.append(SizeProblem("{head_dim} is odd: rotary embeddings need an even head dim",
                                   {"head_dim": head_dim}))
    elif hidden % heads:
        out.append(SizeProblem("{hidden_size} is not divisible by {num_attention_heads} (and head_dim is not set)",
                               {"hidden_size": hidden, "num_attention_heads": heads}))
    elif (hidden // heads) % 2:
        out.append(SizeProblem("{head_dim} ({hidden_size} / {num_attention_heads}) is odd: rotary embeddings "
                               "need an even head dim",
                               {"head_dim": hidden // heads, "hidden_size": hidden, "num_attention_heads": heads}))
    if heads % kv:
        out.append(SizeProblem("{num_attention_heads} is not divisible by {num_kv_attention_heads}",
                               {"num_attention_heads": heads, "num_kv_attention_heads": kv}))
    if heads % tp:
        out.append(SizeProblem("{num_attention_heads} is not divisible by {tp}",
                               {"num_attention_heads": heads, "tp": tp}))
    if kv % tp:
        out.append(SizeProblem("{num_kv_attention_heads} is not divisible by {tp}",
                               {"num_kv_attention_heads": kv, "tp": tp}))
    if vocab_size is not None and vocab_size % tp:
        out.append(SizeProblem("{vocab_size} is not divisible by {tp} (round the vocabulary up to a multiple of it)",
                               {"vocab_size": vocab_size, "tp": tp}))
    if mlp_ratio is not None and multiple_of is not None:
        ffn = ffn_hidden_size(hidden, mlp_ratio, multiple_of)
        if ffn % tp:
            out.append(SizeProblem("{ffn_hidden_size} (the SwiGLU hidden size: {hidden_size} x {mlp_ratio} rounded "
                                   "up to a multiple of {multiple_of}) is not divisible by {tp}",
                                   {"ffn_hidden_size": ffn, "hidden_size": hidden, "mlp_ratio": mlp_ratio,
                                    "multiple_of": multiple_of, "tp": tp}))
    return out


def check_sizes(**sizes: Any) -> None:
    """Raise ``ModelSizeError`` (a ValueError) naming the sizes when ``size_problems(**sizes)`` finds any."""
    problems = size_problems(**sizes)
    if problems:
        raise ModelSizeError(problems)


def check_tensor_parallel_sizes(args: ModelArgs, tp: int = 1) -> None:
    """Raise ``ModelSizeError`` naming the sizes when the model of ``args`` cannot be built over ``tp`` ranks."""
    # a head_dim equal to hidden / heads is the default layout: checked (and named) as such
    implied = args.hidden_size // args.num_attention_heads if args.hidden_size % args.num_attention_heads == 0 else None
    check_sizes(hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
                num_kv_attention_heads=args.num_kv_attention_heads, tp=tp, vocab_size=args.vocab_size,
                mlp_ratio=args.mlp_ratio, multiple_of=args.multiple_of,
                head_dim=None if args.head_dim == implied else args.head_dim)
