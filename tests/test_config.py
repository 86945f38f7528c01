"""Config loading, overrides, defaults, and strict validation: every error names the key and the file.

The size rules are the model's own: config and model reject the same sizes (the config before any group)."""

import copy
import dataclasses
import textwrap

import pytest
import torch

from tessera.config import SCHEMA, Config, ConfigError, check_world_size, parallel_sizes, resolve_zero1_size
from tessera.model import build_model
from tessera.model.args import ModelArgs
from tessera.model.attention import Attention
from tessera.parallel import MetaGroup

BASE = dict(
    model=dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256, dtype="torch.float32"),
    parallel=dict(tensor=dict(size=2), zero1=dict(size=-1)),
    data=dict(type="synthetic", seq_len=32),
)


def write_config(tmp_path, body: str, name="cfg.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def with_changes(**sections):
    cfg = copy.deepcopy(BASE)
    for section, values in sections.items():
        if isinstance(values, dict) and isinstance(cfg.get(section), dict):
            cfg[section].update(values)
        else:
            cfg[section] = values
    return cfg


def test_load_file_attribute_access_defaults_and_overrides(tmp_path):
    path = write_config(tmp_path, """
        import math
        SEQ = 32                      # ALL_CAPS helpers are not config keys
        def _helper():
            return 4
        model = dict(num_layers=2, hidden_size=64, num_attention_heads=_helper(), vocab_size=256)
        data = dict(type="synthetic", seq_len=SEQ, total_steps=7)
        adam = dict(lr=math.sqrt(1e-6))
    """)
    cfg = Config.from_file(path, ["model.dtype=bf16", "adam.weight_decay=0.1", "parallel.zero1.size=2",
                                  "ckpt.save_ckpt_folder='/tmp/x y'"])
    assert cfg.model.num_attention_heads == 4
    assert cfg.model.dtype == "bf16"
    assert cfg.adam.lr == pytest.approx(1e-3) and cfg.adam.weight_decay == 0.1
    assert cfg.parallel.zero1.size == 2
    assert cfg.ckpt.save_ckpt_folder == "/tmp/x y"
    # defaults filled, derived defaults computed
    assert cfg.model.num_kv_attention_heads == 4
    assert cfg.model.max_position_embeddings == 32
    assert cfg.lr_scheduler.total_steps == 7
    assert cfg.parallel.tensor.size == 1 and cfg.grad_scaler.hysteresis == 2
    assert cfg.source == str(path)
    assert cfg.to_dict()["model"]["dtype"] == "bf16"


def test_repo_configs_validate():
    import glob

    names = sorted(glob.glob("configs/*.py"))
    assert {"configs/tiny.py", "configs/demo.py", "configs/7B.py", "configs/70B.py"} <= set(names)
    for name in names:
        Config.from_file(name)
    big = Config.from_file("configs/70B.py")
    assert big.parallel.tensor.mode == "msp" and big.model.checkpoint == "selective"


# ---------------------------------------------------------------- bad configs, one per case
def expect_error(cfg_dict, *fragments, source=None):
    with pytest.raises(ConfigError) as e:
        Config.from_dict(cfg_dict, source=source)
    msg = str(e.value)
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"
    return msg


def test_misspelled_key_suggests_closest(tmp_path):
    path = write_config(tmp_path, """
        model = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256, num_layer=3)
        data = dict(type="synthetic")
    """)
    with pytest.raises(ConfigError) as e:
        Config.from_file(path)
    msg = str(e.value)
    assert "model.num_layer" in msg and "did you mean 'num_layers'" in msg and str(path) in msg


def test_misspelled_section():
    cfg = with_changes(optimiser=dict(lr=1))
    expect_error(cfg, "optimiser")


def test_string_where_int_needed():
    expect_error(with_changes(model=dict(BASE["model"], num_layers="2")), "model.num_layers", "expected int", "str")


def test_bool_is_not_an_int():
    expect_error(with_changes(data=dict(micro_bsz=True)), "data.micro_bsz", "expected int")


def test_negative_size():
    expect_error(with_changes(parallel=dict(tensor=dict(size=-2))), "parallel.tensor.size", "-2")


def test_heads_not_divisible_by_tp():
    cfg = with_changes(model=dict(BASE["model"], num_attention_heads=4, hidden_size=72, num_kv_attention_heads=2),
                       parallel=dict(tensor=dict(size=3)))
    cfg["model"]["vocab_size"] = 255
    expect_error(cfg, "model.num_attention_heads=4", "parallel.tensor.size=3")


def test_kv_heads_not_divisible_by_tp():
    cfg = with_changes(model=dict(BASE["model"], num_attention_heads=8, num_kv_attention_heads=2),
                       parallel=dict(tensor=dict(size=4)))
    expect_error(cfg, "model.num_kv_attention_heads=2", "parallel.tensor.size=4")


def test_hidden_not_divisible_by_heads():
    expect_error(with_changes(model=dict(BASE["model"], hidden_size=66)), "model.hidden_size=66",
                 "model.num_attention_heads=4")


def test_vocab_not_divisible_by_tp():
    expect_error(with_changes(model=dict(BASE["model"], vocab_size=257)), "model.vocab_size=257",
                 "parallel.tensor.size=2")


def test_pipeline_size_two_not_supported():
    expect_error(with_changes(parallel=dict(pipeline=dict(size=2))), "parallel.pipeline.size=2", "not supported")


def test_unknown_dtype():
    msg = expect_error(with_changes(model=dict(BASE["model"], dtype="torch.float8")), "model.dtype", "torch.float8")
    assert "torch.bfloat16" in msg  # lists the valid names


def test_missing_config_file(tmp_path):
    missing = tmp_path / "nope.py"
    with pytest.raises(ConfigError, match="config file not found: .*nope.py"):
        Config.from_file(missing)


def test_syntax_error_points_at_line(tmp_path):
    path = write_config(tmp_path, """
        model = dict(num_layers=2,
                     hidden_size=64)
        data = dict(seq_len=32
        adam = dict(lr=1)
    """)
    with pytest.raises(ConfigError) as e:
        Config.from_file(path)
    msg = str(e.value)
    assert str(path) in msg and "syntax error" in msg
    assert "line 4" in msg or "line 5" in msg  # the unclosed dict starts on line 4, Python reports 4 or 5


def test_config_file_raising(tmp_path):
    path = write_config(tmp_path, "model = dict(hidden_size=1 / 0)\n")
    with pytest.raises(ConfigError, match="ZeroDivisionError"):
        Config.from_file(path)


@pytest.mark.parametrize("override, fragments", [
    ("model.hiden_size=32", ["model.hiden_size", "did you mean 'hidden_size'"]),
    ("model.hidden_size", ["expected key.sub=value"]),
    ("model.hidden_size=[1,", ["not a Python literal"]),
    ("model.num_layers='two'", ["model.num_layers", "expected int"]),
    ("model.num_layers.x=1", ["model.num_layers", "not a section"]),
])
def test_bad_cli_override(tmp_path, override, fragments):
    path = write_config(tmp_path, """
        model = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256)
        data = dict(type="synthetic")
    """)
    with pytest.raises(ConfigError) as e:
        Config.from_file(path, [override])
    for f in fragments:
        assert f in str(e.value)


def test_seq_len_beyond_max_positions():
    expect_error(with_changes(model=dict(BASE["model"], max_position_embeddings=16)), "data.seq_len=32",
                 "model.max_position_embeddings=16")


def test_valid_context_len_not_below_seq_len():
    expect_error(with_changes(data=dict(BASE["data"], valid_context_len=32)), "data.valid_context_len=32",
                 "data.seq_len=32")


def test_missing_required_key():
    cfg = copy.deepcopy(BASE)
    del cfg["model"]["vocab_size"]
    expect_error(cfg, "model.vocab_size", "missing")


def test_out_of_range_fraction():
    expect_error(with_changes(model=dict(BASE["model"], checkpoint=1.5)), "model.checkpoint")
    expect_error(with_changes(adam=dict(adam_beta2=1.2)), "adam.adam_beta2")


def test_tokens_data_needs_folder():
    expect_error(with_changes(data=dict(type="tokens")), "data.train_folder")


def test_error_names_the_file():
    msg = expect_error(with_changes(parallel=dict(tensor=dict(size=0))), "parallel.tensor.size", source="/x/cfg.py")
    assert "/x/cfg.py" in msg


# ---------------------------------------------------------------- launch-time layout checks
def test_world_size_checks():
    cfg = Config.from_dict(with_changes(parallel=dict(tensor=dict(size=2), zero1=dict(size=2))))
    assert check_world_size(cfg, 8) == (2, 4, 2)
    with pytest.raises(ConfigError, match=r"world size 6 .*tensor size x data size|zero1"):
        check_world_size(cfg, 6)  # dp=3, zero1=2 does not divide
    with pytest.raises(ConfigError, match="world size 3 is not a multiple of parallel.tensor.size=2"):
        check_world_size(cfg, 3)
    cfg_all = Config.from_dict(with_changes(parallel=dict(tensor=dict(size=2), zero1=dict(size=-1))))
    assert check_world_size(cfg_all, 8) == (2, 4, 4)


def test_zero1_not_dividing_dp():
    cfg = Config.from_dict(with_changes(parallel=dict(tensor=dict(size=1), zero1=dict(size=3))))
    with pytest.raises(ConfigError, match=r"parallel.zero1.size=3 does not divide the data-parallel size 4"):
        check_world_size(cfg, 4)


def test_parallel_sizes_and_zero1_rule_shared_with_the_layout():
    assert parallel_sizes(8, 2, -1) == (2, 4, 4) and parallel_sizes(8, 2, 2) == (2, 4, 2)
    assert resolve_zero1_size(4, -1) == 4 and resolve_zero1_size(4, 2) == 2
    with pytest.raises(ConfigError, match=r"parallel.zero1.size=3 does not divide the data-parallel size 4"):
        resolve_zero1_size(4, 3)
    with pytest.raises(ConfigError, match=r"parallel.zero1.size=8 does not divide the data-parallel size 4"):
        parallel_sizes(8, 2, 8)  # a ZeRO group larger than the DP group


# ---------------------------------------------------------------- one source of sizes and defaults
def test_ffn_hidden_not_divisible_by_tp_is_a_config_error_before_any_group(tmp_path):
    # heads, KV heads and vocab all split over tp=2; only the SwiGLU hidden size does not:
    # int(64 * 8/3) = 170 rounded up to a multiple of 3 = 171
    assert not torch.distributed.is_initialized()
    cfg = with_changes(model=dict(BASE["model"], multiple_of=3))
    msg = expect_error(cfg, "171", "model.hidden_size=64", "model.mlp_ratio", "model.multiple_of=3",
                       "parallel.tensor.size=2")
    assert "num_attention_heads" not in msg and "vocab_size" not in msg
    path = write_config(tmp_path, """
        model = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256, multiple_of=3)
        parallel = dict(tensor=dict(size=2))
        data = dict(type="synthetic")
    """)
    with pytest.raises(ConfigError, match=f"parallel.tensor.size=2.*{path}"):
        Config.from_file(path)
    assert not torch.distributed.is_initialized()  # raised by validation alone
    assert Config.from_dict(with_changes(model=dict(BASE["model"], multiple_of=3),
                                         parallel=dict(tensor=dict(size=1)))).model.multiple_of == 3


_SIZE_CASES = [  # (model keys, tp)
    (dict(num_attention_heads=4), 2),  # fine
    (dict(num_attention_heads=4), 3),  # heads, KV heads, vocab (256) and SwiGLU hidden (256) vs tp
    (dict(num_attention_heads=8, num_kv_attention_heads=2), 4),  # KV heads vs tp
    (dict(num_attention_heads=4, vocab_size=258), 4),  # vocab vs tp
    (dict(num_attention_heads=4, multiple_of=3), 2),  # SwiGLU hidden vs tp
    (dict(num_attention_heads=4, hidden_size=66), 1),  # hidden vs heads
    (dict(num_attention_heads=8, hidden_size=72), 1),  # odd head dim (rotary)
    (dict(num_attention_heads=4, num_kv_attention_heads=3), 1),  # heads vs KV heads
]


@pytest.mark.parametrize("model_keys, tp", _SIZE_CASES)
def test_model_and_config_apply_the_same_size_rules(model_keys, tp):
    model_cfg = {"num_layers": 2, "hidden_size": 64, "vocab_size": 256, **model_keys}
    config_err = model_err = None
    try:
        Config.from_dict(dict(model=model_cfg, parallel=dict(tensor=dict(size=tp)), data=dict(type="synthetic")))
    except ConfigError as e:
        config_err = str(e)
    try:
        build_model(model_cfg, tp_group=MetaGroup(tp) if tp > 1 else None, device="meta")
    except ValueError as e:
        model_err = str(e)
    assert (config_err is None) == (model_err is None), (config_err, model_err)
    if config_err is not None:
        # the same rules in the same order; the config names its keys, the model its arguments
        as_model = config_err.replace("model.", "").replace("parallel.tensor.size=", "tensor-parallel size ")
        assert as_model == model_err
        assert "model." in config_err and "model." not in model_err


def test_attention_alone_applies_the_model_size_rules():
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by num_kv_attention_heads=3"):
        Attention(64, 4, 3)
    with pytest.raises(ValueError, match="num_kv_attention_heads=2 is not divisible by tensor-parallel size 4"):
        Attention(64, 8, 2, MetaGroup(4), device="meta")


def test_model_defaults_are_model_args_defaults():
    spec = SCHEMA.keys["model"].keys
    for f in dataclasses.fields(ModelArgs):
        key = spec[f.name]  # every ModelArgs field is a config key
        if f.default is dataclasses.MISSING:
            with pytest.raises(ConfigError, match=f"missing required key 'model.{f.name}'"):
                Config.from_dict(dict(model={k: v for k, v in BASE["model"].items() if k != f.name},
                                      data=dict(type="synthetic")))
        else:
            assert key.default == f.default, f.name
    minimal = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256)
    from_config = ModelArgs.from_config(Config.from_dict(dict(model=minimal, data=dict(type="synthetic"))).model)
    assert from_config == ModelArgs(**minimal)  # build_model(dict(...)) and a loaded config agree


def test_norm_type_accepts_only_rmsnorm():
    assert Config.from_dict(BASE).model.norm_type == "rmsnorm"
    assert Config.from_dict(with_changes(model=dict(BASE["model"], norm_type="rmsnorm"))).model.norm_type == "rmsnorm"
    expect_error(with_changes(model=dict(BASE["model"], norm_type="layernorm")), "model.norm_type", "'rmsnorm'",
                 "'layernorm'")
    Config.from_file("configs/7B.py")  # InternEvo's key, set in the 7B config


def test_tensor_modes_mtp_and_msp():
    assert Config.from_dict(BASE).parallel.tensor.mode == "mtp"
    assert Config.from_dict(with_changes(parallel=dict(tensor=dict(size=2, mode="mtp")))).parallel.tensor.mode == "mtp"
    assert Config.from_dict(with_changes(parallel=dict(tensor=dict(size=2, mode="msp")))).parallel.tensor.mode == "msp"
    expect_error(with_changes(parallel=dict(tensor=dict(size=2, mode="sp"))), "parallel.tensor.mode", "'mtp'", "'msp'")


def test_unused_keys_are_not_accepted():
    expect_error(with_changes(data=dict(BASE["data"], num_workers=2)), "unknown key 'data.num_workers'")
