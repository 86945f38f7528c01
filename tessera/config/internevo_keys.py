"""The kinds of entry of the InternEvo key table (``internevo_table.KEYS``) and the handlers of its custom keys.

Each entry's ``does`` is its row of docs/internevo.md's key table; ``handle`` does it. The kinds:

    same       tessera's key of the same name and meaning (in an InternEvo file, InternEvo's values that
               tessera lacks are refused here, e.g. ``parallel.pipeline.size=2``)
    renamed    tessera has the concept under another name
    noop       accepted at the values where InternEvo does nothing tessera would not; refused at any other
    ignored    tunes only how InternEvo runs (overlap, buffers, uploads, alerts), never what it computes
    custom     the rest, each a short function below; rules over a whole file are ``internevo_rules``
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from tessera.config.schema import SCHEMA, Section

__all__ = ["Entry", "MISSING", "Translating", "is_tessera_path", "same_value", "local_path", "same", "noop", "ignored",
           "renamed", "deferred", "custom"]


class _Missing:
    def __repr__(self) -> str:
        return "<unset>"


MISSING: Any = _Missing()  # a key the file does not set


class Translating(Protocol):
    """What a key's handler may do to the file being translated (``internevo.Translation`` does it)."""

    internevo: bool  # the file is an InternEvo config (it defines a name only InternEvo has)

    def get(self, path: str, default: Any = ...) -> Any: ...
    def has(self, path: str) -> bool: ...
    def once(self, key: str) -> bool: ...
    def drop(self, path: str) -> None: ...
    def noop(self, path: str, value: Any, why: str = "") -> None: ...
    def map(self, path: str, value: Any, target: str, new: Any, why: str = "") -> None: ...
    def default(self, target: str, value: Any, why: str) -> None: ...
    def refuse(self, path: str, value: Any, why: str) -> None: ...
    def differ(self, text: str) -> None: ...


Handler = Callable[[Translating, str, Any], None]


@dataclass(frozen=True)
class Entry:
    does: str  # what tessera does with the key: docs/internevo.md's table text
    handle: Handler
    kind: str = "custom"  # same | renamed | no-op | ignored | rule | custom


def is_tessera_path(path: str) -> bool:
    """Whether tessera's schema has the dotted key or section ``path``."""
    node: Any = SCHEMA
    for part in path.split("."):
        if not isinstance(node, Section) or part not in node.keys:
            return False
        node = node.keys[part]
    return True


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def same_value(a: Any, b: Any) -> bool:
    """Equal values of the same kind: True is not 1 here, 1 is 1.0."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return bool(a == b)


# ------------------------------------------------------------------------------------ kinds of entry
def same(does: str = "same key, same meaning", refuse: Callable[[Any], str | None] | None = None) -> Entry:
    def handle(t: Translating, path: str, value: Any) -> None:
        why = refuse(value) if refuse else None
        if why:
            t.refuse(path, value, why)

    return Entry(does, handle, "same")


def noop(values: tuple[Any, ...], why: str, does: str) -> Entry:
    def handle(t: Translating, path: str, value: Any) -> None:
        if any(same_value(value, v) for v in values):
            t.noop(path, value)
        else:
            t.refuse(path, value, why)

    return Entry(does, handle, "no-op")


def ignored(does: str) -> Entry:
    return Entry(does, lambda t, path, value: t.noop(path, value), "ignored")


def renamed(target: str, does: str | None = None) -> Entry:
    return Entry(does or f"`{target}`", lambda t, path, value: t.map(path, value, target, value), "renamed")


def deferred(does: str) -> Entry:
    """Read by a rule over the whole file (``internevo_rules``); the walk leaves it alone."""
    return Entry(does, lambda t, path, value: None, "rule")


def custom(does: str) -> Callable[[Handler], Entry]:
    return lambda handle: Entry(does, handle)


# ------------------------------------------------------------------------------------ custom entries
REMOTE = ("boto3:", "volc:", "oss2:")


def local_path(value: Any) -> tuple[Any, str | None]:
    """InternEvo's storage prefix: ``local:x`` is the folder ``x``; an object store is refused (the why)."""
    if isinstance(value, str):
        if value.startswith("local:"):
            return value[len("local:"):], None
        if value.startswith(REMOTE):
            return value, "object stores (boto3/volc/oss2) are not supported: tessera reads and writes folders"
    return value, None


@custom("`JOB_NAME` of an InternEvo file becomes `job_name` (unless the file sets `job_name`); in other files "
        "an ALL_CAPS helper, as before")
def job_name(t: Translating, path: str, value: Any) -> None:
    if t.internevo and not t.has("job_name") and isinstance(value, str):
        t.map(path, value, "job_name", value)
    else:
        t.drop(path)


@custom("`local:` prefix dropped; object stores refused; `None` when `enable_save_ckpt=False` (InternEvo "
        "neither saves nor resumes there then)")
def save_folder(t: Translating, path: str, value: Any) -> None:
    if t.get("ckpt.enable_save_ckpt", True) is False and value is not None:
        t.map(path, value, path, None, "enable_save_ckpt=False")
        return
    new, why = local_path(value)
    if why:
        t.refuse(path, value, why)
    elif new != value:
        t.map(path, value, path, new)


@custom("no-op when saving is off or at <= 1; otherwise refused: tessera writes no rolling snapshots "
        "(lower `ckpt.checkpoint_every`, with `ckpt.keep_last`)")
def snapshots(t: Translating, path: str, value: Any) -> None:
    if t.get("ckpt.enable_save_ckpt", True) is not True or (_is_num(value) and value <= 1):
        t.noop(path, value)
    else:
        t.refuse(path, value, "rolling snapshot checkpoints are not written: set ckpt.checkpoint_every (with "
                              "ckpt.keep_last) for the same protection, and remove this key")


@custom("`True` -> `model.bias=False`; `False` -> `model.bias=True`, `model.mlp_bias=False` (InternEvo biases "
        "q/k/v/o, never the MLP)")
def no_bias(t: Translating, path: str, value: Any) -> None:
    if value is True:
        t.map(path, value, "model.bias", False)
    elif value is False:
        t.map(path, value, "model.bias", True)
        t.map(path, value, "model.mlp_bias", False, "InternEvo's MLP has no biases")
    else:
        t.refuse(path, value, "expected True or False")


INIT_STDS = ("embedding_init_std", "attn_wqkv_init_std", "attn_other_init_std", "ffn_uplayer_init_std",
             "ffn_other_init_std", "out_head_init_std")


def init_stds(t: Translating, path: str, value: Any) -> None:
    if not t.once("init_stds"):
        t.drop(path)
        return
    stds = {k: t.get(f"model.{k}", 0.02) for k in INIT_STDS}  # InternEvo's default for each
    given = {k: v for k, v in stds.items() if t.has(f"model.{k}")}
    if not all(_is_num(v) for v in stds.values()) or len(set(stds.values())) > 1:
        for k, v in given.items():
            t.refuse(f"model.{k}", v, f"tessera has one init_std for every weight; these six differ: {stds}")
        return
    first, *rest = given
    for k in rest:
        t.drop(f"model.{k}")
    t.map(f"model.{first}", given[first], "model.init_std", stds[first],
          "one std for every weight, output projections scaled by 1/sqrt(2 x num_layers) as use_scaled_init")


@custom("`init_beta2` equal to `adam.adam_beta2` is a no-op (with `c <= 0` InternEvo holds beta2 there); "
        "otherwise refused")
def init_beta2(t: Translating, path: str, value: Any) -> None:
    beta2 = t.get("adam.adam_beta2", 0.95)
    if _is_num(value) and _is_num(beta2) and value == beta2:
        t.noop(path, value)
    else:
        t.refuse(path, value, f"InternEvo sets beta2 to this after the first step, but adam.adam_beta2={beta2!r}: "
                              "set them equal")


def beta2_c(t: Translating, path: str, value: Any) -> None:
    if _is_num(value) and value <= 0:
        t.noop(path, value)
    else:
        t.refuse(path, value, "a beta2 schedule (1 - 1/step^c): tessera keeps adam.adam_beta2 constant")


def equals_micro_num(why: str) -> Handler:
    def handle(t: Translating, path: str, value: Any) -> None:
        micro_num = t.get("data.micro_num", 1)
        if same_value(value, micro_num):
            t.noop(path, value)
        else:
            t.refuse(path, value, f"{why}: must equal data.micro_num={micro_num!r}")

    return handle


def int_section(size_key: str, zero_is_all: bool = False) -> Handler:
    """InternEvo's ``parallel.tensor=2`` / ``pipeline=1`` / ``zero1=8``: an int is the size."""

    def handle(t: Translating, path: str, value: Any) -> None:
        if not _is_int(value):
            return  # tessera's validation says "expected a dict"
        size = -1 if zero_is_all and value <= 0 else value
        if path == "parallel.pipeline" and size > 1:
            t.refuse(path, value, "pipeline parallelism is not supported; use 1")
            return
        t.map(path, value, path, {size_key: size})

    return handle


@custom("InternEvo's `<= 0` (whole data-parallel group) -> `-1`")
def zero1_size(t: Translating, path: str, value: Any) -> None:
    if _is_int(value) and value <= 0 and value != -1:
        t.map(path, value, path, -1)


@custom("old InternEvo switch: `True` -> `parallel.tensor.mode='msp'` when no mode is set (refused against "
        "`mtp`); `False` a no-op (InternEvo derives it from the mode)")
def sequence_parallel(t: Translating, path: str, value: Any) -> None:
    mode = t.get("parallel.tensor.mode", None)
    if not isinstance(value, bool):
        t.refuse(path, value, "expected a bool")
    elif value and mode is None:
        t.map(path, value, "parallel.tensor.mode", "msp")
    elif value and mode == "mtp":
        t.refuse(path, value, "contradicts parallel.tensor.mode='mtp'")
    elif value or mode in (None, "mtp"):
        t.noop(path, value)  # InternEvo derives it from the mode
    else:
        t.noop(path, value, f"InternEvo turns it on for mode {mode!r}")


@custom("accepted while `enable=False`; 2D sequence parallelism refused")
def sequence_2d(t: Translating, path: str, value: Any) -> None:
    if isinstance(value, dict) and value.get("enable", False) is False:
        t.noop(path, value)
    else:
        t.refuse(path, value, "2D sequence parallelism (head x context parallel) is not implemented")


@custom("ignored beside `use_sliding_window` (read only when it is `True`, which is refused); without it, "
        "tessera's key of the same name where tessera has one")
def window_size(t: Translating, path: str, value: Any) -> None:
    if t.has("model.use_sliding_window") or not is_tessera_path(path):
        t.noop(path, value)


def isp_fsp(value: Any) -> str | None:
    if value == "isp":
        return ("InternEvo's intern sequence parallelism (sequence over TP ranks, weights over parallel.weight) is "
                "not implemented; use 'msp' (Megatron sequence parallelism) or 'mtp'")
    if value == "fsp":
        return "flash-attn's sequence-parallel layers are not implemented; 'msp' splits the same activations"
    return None


def pipeline_size(value: Any) -> str | None:
    return "pipeline parallelism is not supported; use 1" if _is_int(value) and value > 1 else None


def norm_type(value: Any) -> str | None:
    return None if value == "rmsnorm" else "only 'rmsnorm' is implemented (the decoder uses RMSNorm)"
