"""parse_dtype and the TF32 switches, read back through both the legacy and the new getters."""

import pytest
import torch

from tessera.config import ConfigError
from tessera.config.dtypes import MODEL_DTYPE_NAMES, parse_dtype
from tessera.precision.switches import apply_precision

# storage dtype and TF32 state from DESIGN.md's precision table, written out independently here
TABLE = {
    "torch.float16": (torch.float16, False),
    "torch.half": (torch.float16, False),
    "fp16": (torch.float16, False),
    "torch.bfloat16": (torch.bfloat16, False),
    "bf16": (torch.bfloat16, False),
    "torch.float32": (torch.float32, False),
    "fp32": (torch.float32, False),
    "torch.tf32": (torch.float32, True),
    "tf32": (torch.float32, True),
    torch.float16: (torch.float16, False),
    torch.bfloat16: (torch.bfloat16, False),
    torch.float32: (torch.float32, False),
}


@pytest.mark.parametrize("name", list(TABLE), ids=str)
def test_parse_dtype_matches_table(name):
    assert parse_dtype(name) == TABLE[name]


@pytest.mark.parametrize("name", ["torch.tf32", "torch.float32", "torch.bfloat16", "torch.float16"])
def test_apply_precision_reads_back_through_both_apis(name):
    # start from the opposite state so a no-op would fail
    _, want_tf32 = TABLE[name]
    torch.backends.cuda.matmul.allow_tf32 = not want_tf32
    torch.backends.cudnn.allow_tf32 = not want_tf32
    apply_precision(name)
    assert torch.backends.cuda.matmul.allow_tf32 is want_tf32
    assert torch.backends.cudnn.allow_tf32 is want_tf32
    # the new getters stay readable (we never used the new setters) and agree
    assert torch.backends.cuda.matmul.fp32_precision == ("tf32" if want_tf32 else "ieee")
    assert (torch.backends.cudnn.conv.fp32_precision == "tf32") is want_tf32
    # and reading the legacy getter again still works (the new setters would make this raise)
    assert torch.backends.cuda.matmul.allow_tf32 is want_tf32


def test_unknown_dtype_lists_valid_names():
    with pytest.raises(ConfigError) as e:
        parse_dtype("torch.float8")
    msg = str(e.value)
    assert "torch.float8" in msg and "model.dtype" in msg
    for name in ("torch.bfloat16", "torch.tf32", "fp16"):
        assert name in msg
    assert set(MODEL_DTYPE_NAMES) >= {"torch.float16", "torch.half", "torch.bfloat16", "torch.float32", "torch.tf32"}


def test_unsupported_torch_dtype():
    with pytest.raises(ConfigError, match="float64"):
        parse_dtype(torch.float64)


def test_one_table_of_dtype_names_agrees_with_torch():
    """Every dtype name tessera reads or writes comes from ``DTYPE_TABLE``; the table itself is checked
    against torch's own names, and the tables derived from it say the same."""
    from tessera.checkpoint import parse_dtype_name
    from tessera.checkpoint.safetensors_io import DTYPE_NAMES, NAME_DTYPES
    from tessera.config.dtypes import DTYPE_TABLE, dtype_from_name, dtype_name, dtypes_by_short_name

    for row in DTYPE_TABLE:
        assert str(row.dtype) == f"torch.{row.name}" and dtype_name(row.dtype) == row.name
        assert all(getattr(torch, alias) is row.dtype for alias in row.aliases)
        for spelling in (row.name, f"torch.{row.name}", row.name.upper(), *row.aliases, *filter(None, [row.short])):
            assert dtype_from_name(spelling) is row.dtype, spelling
        assert NAME_DTYPES[DTYPE_NAMES[row.dtype]] is row.dtype
    assert DTYPE_NAMES[torch.bfloat16] == "BF16" and DTYPE_NAMES[torch.bool] == "BOOL"
    assert dtypes_by_short_name("fp32", "bf16") == {"fp32": torch.float32, "bf16": torch.bfloat16}
    assert parse_dtype_name("bf16") is torch.bfloat16 and parse_dtype_name("torch.float16") is torch.float16
    with pytest.raises(ValueError, match="use fp32, bf16, fp16"):
        parse_dtype_name("int8")  # a dtype of the table, but not one a model is exported in
