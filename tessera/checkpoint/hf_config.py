"""Hugging Face model families <-> tessera's ``model`` section: parameter names and ``config.json``.

tessera's decoder is the Llama layout (pre-norm RMSNorm, rotary in the rotate_half convention, grouped KV
heads, SwiGLU with ``w1`` = gate, ``w3`` = up, ``w2`` = down), so the families built on it map onto
config keys rather than onto code of their own:

    family    what it adds to plain Llama                           tessera keys
    llama     rope scaling (3.x: "llama3"), explicit head_dim,        rope_scaling, head_dim,
              attention_bias (q/k/v/o), mlp_bias                      bias, mlp_bias
    mistral   sliding_window (full attention up to its length)       sliding_window
    qwen2     biases on q/k/v only                                   qkv_bias=True, bias=False
    qwen3     RMSNorm on q and k per head, head_dim apart from        qk_norm=True, head_dim,
              hidden / heads, attention_bias (q/k/v/o)                bias

Names map one to one (``q_norm``/``k_norm`` only with ``qk_norm``)::

    embedding.weight                      model.embed_tokens.weight
    layers.i.attention_norm.weight        model.layers.i.input_layernorm.weight
    layers.i.attention.{wq,wk,wv,wo}.*    model.layers.i.self_attn.{q,k,v,o}_proj.*
    layers.i.attention.{q,k}_norm.weight  model.layers.i.self_attn.{q,k}_norm.weight
    layers.i.ffn_norm.weight              model.layers.i.post_attention_layernorm.weight
    layers.i.feed_forward.{w1,w3,w2}.*    model.layers.i.mlp.{gate,up,down}_proj.*
    norm.weight                           model.norm.weight
    output.weight                         lm_head.weight (absent when tied)

Anything a family's config asks for that the decoder cannot compute (another activation, partial rotary,
length-dependent rope scaling) is refused naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tessera.checkpoint.errors import CheckpointError
from tessera.config.dtypes import dtype_from_name, dtype_name
from tessera.model.args import ModelArgs
from tessera.model.mlp import ffn_hidden_size
from tessera.model.rotary import ROPE_SCALING_TYPES, rope_scaling_problem

__all__ = ["FAMILIES", "to_hf_name", "from_hf_name", "hf_family", "hf_config_from_model_cfg",
           "model_cfg_from_hf_config", "EXPORT_DTYPES"]

EXPORT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what an export or import may convert to
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
FAMILIES = tuple(ARCHITECTURES)

_LAYER = {
    "attention_norm": "input_layernorm",
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "attention.q_norm": "self_attn.q_norm",
    "attention.k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
}
_TOP = {"embedding": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}
_LAYER_INV = {v: k for k, v in _LAYER.items()}
_TOP_INV = {v: k for k, v in _TOP.items()}


def to_hf_name(name: str) -> str:
    """tessera parameter name -> Hugging Face name (KeyError for an unknown name)."""
    module, leaf = name.rsplit(".", 1)
    if module.startswith("layers."):
        _, i, rest = module.split(".", 2)
        return f"model.layers.{i}.{_LAYER[rest]}.{leaf}"
    return f"{_TOP[module]}.{leaf}"


def from_hf_name(name: str) -> str | None:
    """Hugging Face name -> tessera name; None for a name tessera has no parameter for."""
    module, leaf = name.rsplit(".", 1)
    if module.startswith("model.layers."):
        parts = module.split(".", 3)
        if len(parts) == 4 and parts[3] in _LAYER_INV:
            return f"layers.{parts[2]}.{_LAYER_INV[parts[3]]}.{leaf}"
        return None
    return f"{_TOP_INV[module]}.{leaf}" if module in _TOP_INV else None


# ---------------------------------------------------------------------------------------- export
def _family_problem(family: str, a: ModelArgs) -> str | None:
    """Why ``family`` cannot describe the model of ``a`` (None: it can)."""
    qkv, out, mlp = a.attention_qkv_bias, a.bias, a.feed_forward_bias
    if a.qk_norm and family != "qwen3":
        return "q/k norms (model.qk_norm) exist in qwen3 only"
    if family == "qwen2":
        if not (qkv and not out and not mlp):
            return "qwen2 has biases on q/k/v and nowhere else (model.qkv_bias=True, model.bias=False)"
        if a.head_dim * a.num_attention_heads != a.hidden_size:
            return "qwen2 derives head_dim from hidden_size / num_attention_heads"
        return None
    if qkv != out:
        return "biases on q/k/v but not o_proj, or the reverse, exist in qwen2 only (q/k/v alone)"
    if family == "llama":
        return "llama has no sliding window" if a.sliding_window is not None else None
    if family == "qwen3":
        return "qwen3 has no MLP biases" if mlp else None
    if family == "mistral" and (out or mlp):
        return "mistral has no biases"
    return None


def hf_family(model_cfg: Mapping[str, Any], prefer: str | None = None) -> str:
    """The family a checkpoint exports as: ``prefer`` (the family it was imported from) when that family
    can describe it, else the first of llama, mistral, qwen2, qwen3 (the fewest features first) that can."""
    a = ModelArgs.from_config(model_cfg)
    order = ([prefer] if prefer in FAMILIES else []) + ["llama", "mistral", "qwen2", "qwen3"]
    problems = {}
    for family in order:
        problems[family] = _family_problem(family, a)
        if problems[family] is None:
            return family
    raise CheckpointError("no Hugging Face family describes this model: " +
                          "; ".join(f"{f}: {p}" for f, p in problems.items()))


def _hf_rope(a: ModelArgs) -> dict[str, Any]:
    """``rope_theta`` / ``rope_scaling`` (transformers 4.x) and ``rope_parameters`` (5.x) for ``a``."""
    scaling = dict(a.rope_scaling or {})
    kind = scaling.pop("type", "default")
    params = {"rope_type": kind, **scaling} if kind != "default" else None
    return {"rope_theta": float(a.rope_base), "rope_scaling": params,
            "rope_parameters": {"rope_type": kind, "rope_theta": float(a.rope_base), **scaling}}


def hf_config_from_model_cfg(model_cfg: Mapping[str, Any], *, vocab_size: int | None = None,
                             dtype: torch.dtype = torch.float32, eos_token_id: int | None = None,
                             bos_token_id: int | None = None, family: str | None = None) -> dict[str, Any]:
    """``config.json`` describing the same network as tessera's ``model`` section, in ``family`` (default:
    ``hf_family``'s choice); ``CheckpointError`` when that family cannot describe it."""
    a = ModelArgs.from_config(model_cfg)
    family = family or hf_family(model_cfg)
    problem = _family_problem(family, a)
    if problem:
        raise CheckpointError(f"the model cannot be exported as {family}: {problem}")
    max_pos = model_cfg.get("max_position_embeddings")
    if max_pos is None:
        raise CheckpointError("model.max_position_embeddings is not set in the checkpoint's config")
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[family]],
        "model_type": family,
        "vocab_size": int(vocab_size if vocab_size is not None else a.vocab_size),
        "hidden_size": a.hidden_size,
        "intermediate_size": a.ffn_hidden_size,
        "num_hidden_layers": a.num_layers,
        "num_attention_heads": a.num_attention_heads,
        "num_key_value_heads": a.num_kv_attention_heads,
        "head_dim": a.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(max_pos),
        "rms_norm_eps": float(a.layer_norm_epsilon),
        **_hf_rope(a),
        "tie_word_embeddings": a.tie_word_embeddings,
        "attention_dropout": float(a.attn_dropout),
        "initializer_range": float(a.init_std),
        "use_cache": True,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": None,
        "torch_dtype": dtype_name(dtype),
        "dtype": dtype_name(dtype),
    }
    if family == "llama":
        config.update(attention_bias=a.bias, mlp_bias=a.feed_forward_bias, pretraining_tp=1)
    elif family == "mistral":
        config.update(sliding_window=a.sliding_window)
    else:  # qwen2 / qwen3: a window, when set, on every layer (max_window_layers counts the full-attention ones)
        window = a.sliding_window
        config.update(use_sliding_window=window is not None, sliding_window=window,
                      max_window_layers=a.num_layers if window is None else 0)
        if family == "qwen3":
            config.update(attention_bias=a.bias)
        else:
            del config["head_dim"]  # qwen2 derives it (checked equal above)
    return config


# ---------------------------------------------------------------------------------------- import
def _family_of(hf: Mapping[str, Any], where: str) -> str:
    model_type = hf.get("model_type")
    if model_type in FAMILIES:
        return str(model_type)
    archs = list(hf.get("architectures") or [])
    for family, arch in ARCHITECTURES.items():
        if model_type is None and arch in archs:  # model_type, when given, names the family
            return family
    raise CheckpointError(f"{where}: model_type={model_type!r}, architectures={archs}; tessera imports "
                          f"{', '.join(f'{f} ({ARCHITECTURES[f]})' for f in FAMILIES)}")


def _rope_scaling_from_hf(hf: Mapping[str, Any], where: str) -> tuple[float, dict[str, Any] | None]:
    """``(rope_base, model.rope_scaling)`` from transformers 4.x keys (``rope_theta``, ``rope_scaling``) or 5.x's
    ``rope_parameters``; the missing ``original_max_position_embeddings`` defaults as transformers does."""
    params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    if any(isinstance(v, Mapping) for v in params.values()):
        raise CheckpointError(f"{where}: rope parameters per layer type {sorted(params)} are not supported")
    base = float(params.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0)
    kind = params.pop("rope_type", params.pop("type", "default"))
    partial = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise CheckpointError(f"{where}: partial_rotary_factor={partial}; tessera rotates the whole head dim")
    if kind in (None, "default"):
        return base, None
    if kind in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
    if kind in ROPE_SCALING_TYPES:  # keys transformers accepts but does not read for this type
        required, optional = ROPE_SCALING_TYPES[kind]
        params = {k: v for k, v in params.items() if k in required | optional}
    scaling = {"type": kind, **params}
    problem = rope_scaling_problem(scaling)
    if problem:
        raise CheckpointError(f"{where}: rope scaling {hf.get('rope_scaling') or hf.get('rope_parameters')}: "
                              f"{problem}")
    return base, scaling


def _biases(family: str, hf: Mapping[str, Any], where: str) -> dict[str, bool | None]:
    """``model.bias`` / ``qkv_bias`` / ``mlp_bias`` of a family's config (the last two None where they follow
    ``bias``): Llama's ``attention_bias`` covers q/k/v/o and its ``mlp_bias`` the MLP; Qwen3 has only the
    former, Qwen2 biases q/k/v by design, Mistral has none."""
    if family == "qwen2":
        return {"bias": False, "qkv_bias": True, "mlp_bias": None}
    attn, mlp = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    if family == "mistral" and (attn or mlp):
        raise CheckpointError(f"{where}: mistral takes no attention_bias / mlp_bias")
    if family == "qwen3" and mlp:
        raise CheckpointError(f"{where}: mlp_bias on qwen3: its MLP has no biases")
    return {"bias": attn, "qkv_bias": None, "mlp_bias": None if mlp == attn else mlp}


def _sliding_window(family: str, hf: Mapping[str, Any]) -> int | None:
    """The attention window, when one applies to some layer (Qwen's ``use_sliding_window`` gates it)."""
    window = hf.get("sliding_window")
    if family in ("qwen2", "qwen3"):
        types = hf.get("layer_types") or []
        if not hf.get("use_sliding_window", False) and "sliding_attention" not in types:
            return None
    elif family == "llama":
        return None
    return None if window is None else int(window)


def model_cfg_from_hf_config(hf: Mapping[str, Any], tp: int, where: str = "config.json"
                             ) -> tuple[dict[str, Any], int, str]:
    """tessera ``model`` section for a Hugging Face config at TP size ``tp``, the HF vocab size and the family.

    Raises ``CheckpointError`` naming the key for what tessera's decoder cannot represent.
    """
    def need(key: str) -> Any:
        if key not in hf:
            raise CheckpointError(f"{where}: missing key {key!r}")
        return hf[key]

    family = _family_of(hf, where)
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{where}: hidden_act={hf['hidden_act']!r}; tessera's MLP is SwiGLU (silu)")
    base, scaling = _rope_scaling_from_hf(hf, where)
    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    kv = int(hf.get("num_key_value_heads") or heads)
    head_dim = hf.get("head_dim")
    if family == "qwen2" or head_dim is None or int(head_dim) * heads == hidden:
        head_dim = None  # the default layout (qwen2 has no head_dim of its own)
    biases = _biases(family, hf, where)
    inter = int(need("intermediate_size"))
    # mlp_ratio / multiple_of reproducing intermediate_size exactly: prefer a round multiple_of
    ratio = inter / hidden
    multiple_of = next(mo for mo in (256, 128, 64, 32, 16, 8, 4, 2, 1, inter)
                       if ffn_hidden_size(hidden, ratio, mo) == inter)
    vocab = int(need("vocab_size"))
    padded = -(-vocab // tp) * tp
    try:  # the stored dtype when it is one tessera trains in, else bf16
        stored = dtype_from_name(str(hf.get("dtype") or hf.get("torch_dtype") or "float32"), among=EXPORT_DTYPES)
    except ValueError:
        stored = torch.bfloat16
    model: dict[str, Any] = {
        "num_layers": int(need("num_hidden_layers")),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_kv_attention_heads": kv,
        "head_dim": None if head_dim is None else int(head_dim),
        "vocab_size": padded,
        "mlp_ratio": ratio,
        "multiple_of": multiple_of,
        "dtype": f"torch.{dtype_name(stored)}",
        "layer_norm_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
        "rope_base": base,
        "rope_scaling": scaling,
        "max_position_embeddings": int(hf.get("max_position_embeddings", 2048)),
        "sliding_window": _sliding_window(family, hf),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        **biases,
        "qk_norm": family == "qwen3",
        "attn_dropout": float(hf.get("attention_dropout", 0.0) or 0.0),
        "init_std": float(hf.get("initializer_range", 0.02)),
    }
    return model, vocab, family

