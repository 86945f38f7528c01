"""The rules over a whole InternEvo file: what no single key says alone.

- InternEvo's defaults for keys the file leaves out, where tessera's differ (InternEvo builds its MLP with
  ``mlp_ratio=4``, trains fp16 when no dtype is set, saves checkpoints unless told not to, does not clip
  without ``clip_grad_norm``, validates ``micro_num`` micro-batches, and decays every parameter);
- the model family (``model_type``) and InternEvo's default biases;
- the data type: InternEvo's ``tokenized`` reads ``train_folder``, and trains on random tokens without one;
- checkpoint loading in InternEvo's order: ``auto_resume=True`` resumes from ``save_ckpt_folder`` and
  ignores every other source; otherwise ``load_ckpt_info``, else the legacy ``load_model_only_folder`` /
  ``load_ckpt_folder``, decides. Tessera loads weights only from a folder other than its save folder.
"""

from __future__ import annotations

from typing import Any

from tessera.config.internevo_keys import MISSING, Translating, local_path

__all__ = ["file_rules", "FAMILIES"]

# InternEvo's model types that name tessera's decoder (RMSNorm, rotary, grouped-query attention, SwiGLU), from
# InternEvo's own code and configs across its releases:
#   INTERNLM          the default, every release (internlm/model/modeling_internlm.py);
#   INTERNLM2         v0.2.4's configs/_base_/models, and later releases' ModelType enum (internlm/utils/utils.py);
#   INTERNLM2_PUBLIC  modeling_internlm2.py's MODEL_TYPE, v0.3.x's registry and published configs;
#   INTERNLM3         later releases' ModelType, built by the InternLM2 class as INTERNLM2 is (model/registry.py);
#   LLAMA             modeling_llama.py's name from InternEvo #532 until #539 renamed it (Dec 2023), and the
#                     configs/70B_pretrain_llama2.py / 70B_sft_llama2.py written with it (Nov 2023);
#   LLAMA2            every release since.
FAMILIES = ("INTERNLM", "INTERNLM2", "INTERNLM2_PUBLIC", "INTERNLM3", "LLAMA", "LLAMA2")
# the misspelt INTERNLM2_PUTLIC: v0.3.3's published configs/7B_internlm2.py
_MISSPELT = {"INTERNLM2_PUTLIC": "INTERNLM2_PUBLIC"}
# InternEvo's other model types, each refused with what makes it another architecture
_OTHER_FAMILIES = {
    "INTERNLM_MoE": "mixture-of-experts", "MIXTRALMOE": "mixture-of-experts", "QWEN2MOE": "mixture-of-experts",
    "LLAVA": "a vision-language model", "QWEN2": "biases on q/k/v only (not o)",
    "BAICHUAN2": "ALiBi positions (13B) and a normalized head", "GEMMA": "GeGLU, (1 + weight) RMSNorm and a scaled "
    "embedding", "INTERNLM_FROM_HF": "a Hugging Face model class", "INTERNLM2_FROM_HF": "a Hugging Face model class",
}
# InternEvo's value of a key the file leaves out, where tessera's default differs
DEFAULTS: tuple[tuple[str, Any, str], ...] = (
    ("model.mlp_ratio", 4.0, "InternEvo's model default"),
    ("model.dtype", "torch.float16", "InternEvo's default without model.dtype"),
    ("ckpt.enable_save_ckpt", True, "InternEvo's default"),
    ("hybrid_zero_optimizer.clip_grad_norm", 0.0, "InternEvo clips only when told"),
    ("adam.decay_norm_and_bias", True, "InternEvo decays every parameter"),
)
_LOAD_SOURCES = ("ckpt.load_ckpt_info", "ckpt.load_model_only_folder", "ckpt.load_ckpt_folder")
_INTERNEVO_LOAD_KEYS = ("ckpt.load_ckpt_info", "ckpt.load_model_only_folder", "ckpt.load_optimizer",
                        "ckpt.load_given_ckpt")  # only InternEvo has them: they bring its loading rule


def file_rules(t: Translating) -> None:
    """Run every rule that applies to ``t``'s file (the checkpoint rule also for a tessera file that uses
    InternEvo's checkpoint-loading keys)."""
    if t.internevo or any(t.has(k) for k in _INTERNEVO_LOAD_KEYS):
        _checkpoint_loading(t)
    if not t.internevo:
        return
    _model_family(t)
    _data_type(t)
    for path, value, why in DEFAULTS:
        if not t.has(path):
            t.default(path, value, why)
    if not t.has("data.valid_micro_num"):
        t.default("data.valid_micro_num", t.get("data.micro_num", 1), "InternEvo's default: data.micro_num")
    if t.get("data.valid_every", 0) == 0:
        t.differ("data.valid_every=0: InternEvo never validates, tessera validates once at the end (when there is "
                 "validation data: a valid_folder, or random tokens)")


def _model_family(t: Translating) -> None:
    family = t.get("model_type", "INTERNLM")
    if t.has("model_type"):
        name = family.upper() if isinstance(family, str) else ""
        read_as = _MISSPELT.get(name, name if name in FAMILIES else None)
        if read_as is None:
            kind = _OTHER_FAMILIES.get(family) if isinstance(family, str) else None
            other = f"InternEvo's {family} is {kind}; " if kind else ""
            t.refuse("model_type", family, f"{other}tessera's decoder is InternEvo's {list(FAMILIES)} (RMSNorm, "
                                           "rotary, grouped-query attention, SwiGLU); mixture-of-experts and other "
                                           "families are not implemented")
            return
        if read_as == family:
            t.noop("model_type", family, "tessera's decoder")
        else:  # InternEvo registers no model of this spelling: it would stop here
            t.noop("model_type", family, f"read as {read_as}")
            t.differ(f"model_type={family!r} is read as {read_as!r} (InternEvo registers no model of that name)")
    if not t.has("model.no_bias") and not t.has("model.bias"):
        why = f"InternEvo's {family} biases q/k/v/o unless model.no_bias=True, never the MLP"
        t.default("model.bias", True, why)
        t.default("model.mlp_bias", False, why)


def _data_type(t: Translating) -> None:
    kind = t.get("data.type", MISSING)
    folder = t.get("data.train_folder", None)
    if kind is MISSING or kind == "tokenized":
        new = "tokens" if folder else "synthetic"
        why = "InternEvo reads data.train_folder" if folder else "no data.train_folder: random tokens, as InternEvo"
        if kind is MISSING and new == "synthetic":
            t.default("data.type", new, why)
        elif kind == "tokenized":
            t.map("data.type", kind, "data.type", new, why)
    elif kind not in ("tokens", "synthetic", "stdlib", "text"):
        t.refuse("data.type", kind, "InternEvo's other dataset types are not read: tessera reads InternEvo's "
                                    "tokenized folders and its own token folders (data.type='tokens')")


def _auto_resume(t: Translating) -> Any:
    """The run's ``auto_resume``: the file's, else ``not load_given_ckpt`` (legacy), else True (both defaults)."""
    auto, given = t.get("ckpt.auto_resume"), t.get("ckpt.load_given_ckpt")
    if given is MISSING:
        return True if auto is MISSING else auto
    if auto is MISSING and isinstance(given, bool):
        t.map("ckpt.load_given_ckpt", given, "ckpt.auto_resume", not given)
        return not given
    if isinstance(given, bool):
        t.noop("ckpt.load_given_ckpt", given, "ckpt.auto_resume decides")
    else:
        t.refuse("ckpt.load_given_ckpt", given, "expected a bool")
    return True if auto is MISSING else auto


def _load_source(t: Translating) -> tuple[str | None, Any]:
    """The key InternEvo loads from when it does not resume, and what it loads, as a ``load_ckpt_info`` dict."""
    info = t.get("ckpt.load_ckpt_info", None)
    if info is not None:
        return "ckpt.load_ckpt_info", info
    model_only = t.get("ckpt.load_model_only_folder", None)
    if model_only is not None:
        return "ckpt.load_model_only_folder", dict(path=model_only, content=("model",), ckpt_type="internevo")
    folder = t.get("ckpt.load_ckpt_folder", None)
    if folder is not None:
        optimizer = ("optimizer",) if t.get("ckpt.load_optimizer", True) else ()
        return "ckpt.load_ckpt_folder", dict(path=folder, content=("model", "sampler", *optimizer),
                                             ckpt_type="internevo")
    return None, None


def _checkpoint_loading(t: Translating) -> None:
    auto = _auto_resume(t)
    key, info = _load_source(t)
    for other in (*_LOAD_SOURCES, "ckpt.load_optimizer"):
        if t.has(other) and other != key:
            t.noop(other, t.get(other), f"InternEvo does not read it {'here' if key else 'with no path to load'}")
    if key is None:
        return
    value = t.get(key)
    if auto is not False:
        t.noop(key, value, "auto_resume=True: InternEvo resumes from ckpt.save_ckpt_folder and loads nothing else")
        return
    if not isinstance(info, dict) or not {"path", "content", "ckpt_type"} <= set(info):
        t.refuse(key, value, "expected dict(path=..., content=(...), ckpt_type=...)")
        return
    problems = []
    if str(info["ckpt_type"]).lower() not in ("internevo", "internlm"):
        problems.append(f"ckpt_type={info['ckpt_type']!r}: tessera loads its own checkpoints (convert a Hugging Face "
                        "model with tools/import_hf.py, then load the folder it writes with ckpt_type='internevo')")
    content = info["content"] if isinstance(info["content"], (list, tuple)) else (info["content"],)
    if {str(c).lower() for c in content} != {"model"}:
        problems.append(f"content={info['content']!r}: from any folder but ckpt.save_ckpt_folder tessera loads the "
                        "model weights only (content=('model',)); the full state resumes from ckpt.save_ckpt_folder "
                        "with auto_resume=True")
    path, remote = local_path(info["path"])
    if remote:
        problems.append(remote)
    if problems:
        t.refuse(key, value, "; ".join(problems))
    elif path is None:
        t.noop(key, value, "no path: nothing to load")
    else:
        t.map(key, value, "ckpt.load_ckpt_folder", path, "a weights-only start from a tessera checkpoint")
