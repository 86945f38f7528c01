"""The reduced-precision reduction switches of bf16/fp16 GEMMs, set by the precision config and read back.

torch leaves cuBLAS free to reduce the partial sums of bf16 and fp16 GEMMs (split-K) in bf16/fp16
(``allow_bf16_reduced_precision_reduction`` / ``allow_fp16_reduced_precision_reduction`` default to
True), which contradicts fp32 accumulation. ``apply_precision`` sets both explicitly — off unless
``model.allow_reduced_precision_reduction`` asks otherwise — and fp16 accumulation off. Each state is
read back through both getter families torch 2.13 has for them: the boolean attributes (with their
``_split_k`` companions) and the ``torch._C`` getters of (reduced precision, split-K) pairs; the TF32
getters, legacy and ``fp32_precision``, must stay readable afterwards (no mix of the two APIs).
"""

import pytest
import torch

from tessera.config import Config, ConfigError
from tessera.precision.switches import apply_precision

MATMUL = torch.backends.cuda.matmul
TF32 = {"torch.bfloat16": False, "torch.float16": False, "torch.float32": False, "torch.tf32": True}


@pytest.fixture(autouse=True)
def _restore_switches():
    """This process's switches back as they were (other tests in the same process may rely on them)."""
    saved = (torch._C._get_cublas_allow_bf16_reduced_precision_reduction(),
             torch._C._get_cublas_allow_fp16_reduced_precision_reduction(),
             MATMUL.allow_fp16_accumulation, MATMUL.allow_tf32, torch.backends.cudnn.allow_tf32)
    yield
    bf16, fp16, fp16_acc, tf32, cudnn_tf32 = saved
    MATMUL.allow_bf16_reduced_precision_reduction = bf16
    MATMUL.allow_fp16_reduced_precision_reduction = fp16
    MATMUL.allow_fp16_accumulation = fp16_acc
    MATMUL.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = cudnn_tf32


def _read_back() -> dict:
    return {
        "bf16": MATMUL.allow_bf16_reduced_precision_reduction,
        "bf16_split_k": MATMUL.allow_bf16_reduced_precision_reduction_split_k,
        "fp16": MATMUL.allow_fp16_reduced_precision_reduction,
        "fp16_split_k": MATMUL.allow_fp16_reduced_precision_reduction_split_k,
        "bf16_pair": torch._C._get_cublas_allow_bf16_reduced_precision_reduction(),
        "fp16_pair": torch._C._get_cublas_allow_fp16_reduced_precision_reduction(),
        "fp16_accumulation": MATMUL.allow_fp16_accumulation,
    }


@pytest.mark.parametrize("allowed", [False, True], ids=["default-fp32", "allowed"])
@pytest.mark.parametrize("name", list(TF32))
def test_apply_precision_sets_both_reduction_switches_and_reads_back(name, allowed):
    # start from the opposite state (and split-K off where torch permits it: not with reduced precision
    # on), fp16 accumulation on, so a no-op would fail
    opposite = (True, True) if not allowed else (False, False)
    MATMUL.allow_bf16_reduced_precision_reduction = opposite
    MATMUL.allow_fp16_reduced_precision_reduction = opposite
    MATMUL.allow_fp16_accumulation = True
    apply_precision(name, reduced_precision_reduction=allowed)
    assert _read_back() == {"bf16": allowed, "bf16_split_k": True, "fp16": allowed, "fp16_split_k": True,
                            "bf16_pair": (allowed, True), "fp16_pair": (allowed, True), "fp16_accumulation": False}
    # the TF32 switch of the same call, through both of its getter families, still readable afterwards
    tf32 = TF32[name]
    assert MATMUL.allow_tf32 is tf32 and torch.backends.cudnn.allow_tf32 is tf32
    assert MATMUL.fp32_precision == ("tf32" if tf32 else "ieee")
    assert (torch.backends.cudnn.conv.fp32_precision == "tf32") is tf32
    assert MATMUL.allow_tf32 is tf32


def test_the_default_is_fp32_reduction():
    MATMUL.allow_bf16_reduced_precision_reduction = True
    MATMUL.allow_fp16_reduced_precision_reduction = True
    apply_precision("bf16")
    assert _read_back()["bf16_pair"] == (False, True) and _read_back()["fp16_pair"] == (False, True)


MODEL = {"dtype": "bf16", "num_layers": 1, "hidden_size": 8, "num_attention_heads": 2, "vocab_size": 16}


def _cfg(**model) -> Config:
    return Config.from_dict({"model": {**MODEL, **model}, "data": {"type": "synthetic"}})


def test_config_key_is_validated_and_defaults_to_off():
    assert _cfg().model.allow_reduced_precision_reduction is False
    assert _cfg(allow_reduced_precision_reduction=True).model.allow_reduced_precision_reduction is True
    with pytest.raises(ConfigError, match="model.allow_reduced_precision_reduction"):
        _cfg(allow_reduced_precision_reduction="yes")


def test_launch_applies_the_config_key(tmp_path):
    """A single-process launch (what train.py does on every rank) sets the switches from the config."""
    from tessera.core.context import gpc, launch

    MATMUL.allow_bf16_reduced_precision_reduction = True
    MATMUL.allow_fp16_reduced_precision_reduction = True
    launch(_cfg(), rank=0, world_size=1, init_method=f"file://{tmp_path}/store", backend="gloo")
    try:
        assert _read_back()["bf16_pair"] == (False, True) and _read_back()["fp16_pair"] == (False, True)
    finally:
        gpc.destroy()
