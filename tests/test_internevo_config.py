"""InternEvo's configs as they are: its published 7B_sft.py and 7B_llama2.py load, plan and train; every key
InternEvo defines is mapped, accepted as a no-op at its no-op value only, or refused, all refusals in one error.

The fixtures in tests/fixtures/internevo carry the keys and values of InternEvo's files (source noted in
each). What each key means was read from InternEvo's code; the expected values below are written here from
that reading (and from the published model shapes), not taken from tessera's translation table.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import subprocess
import sys

import pytest

from harness.distributed import run_torchrun
from harness.failure import explain
from tessera.config import Config, ConfigError, load_python_file
from tessera.config.internevo import KEYS, translate_internevo
from tessera.config.internevo_rules import FAMILIES
from tessera.config.internevo_table import markdown_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "internevo")
SFT = os.path.join(FIXTURES, "7B_sft.py")
LLAMA2 = os.path.join(FIXTURES, "7B_llama2.py")


def sft() -> dict:
    return load_python_file(SFT)


def with_key(raw: dict, dotted: str, value) -> dict:
    raw = copy.deepcopy(raw)
    *head, last = dotted.split(".")
    node = raw
    for part in head:
        node = node.setdefault(part, {})
    node[last] = value
    return raw


def refusal(raw: dict, *fragments: str) -> str:
    with pytest.raises(ConfigError) as e:
        Config.from_dict(raw, source="cfg.py")
    msg = str(e.value)
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"
    return msg


def decoder_parameters(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int,
                       attention_bias: bool) -> int:
    """Untied embedding and head, q/k/v/o (with biases or without), SwiGLU (three matrices, no biases), two RMSNorms
    a layer + final."""
    head_dim = hidden // heads
    attention = 2 * hidden * hidden + 2 * hidden * kv_heads * head_dim
    if attention_bias:
        attention += 2 * hidden + 2 * kv_heads * head_dim
    return 2 * vocab * hidden + layers * (attention + 3 * hidden * ffn + 2 * hidden) + hidden


# ------------------------------------------------------------------------------------------ acceptance
@pytest.mark.parametrize("path,kv_heads,vocab,ffn,micro_bsz,total_steps", [
    (SFT, 32, 103168, 11008, 2, 50000),  # InternLM-7B: SwiGLU hidden 11008 (8/3 x 4096 rounded up to 256)
    (LLAMA2, 8, 32000, 14336, 1, 20),  # 3.5 x 4096
])
def test_published_configs_validate(path, kv_heads, vocab, ffn, micro_bsz, total_steps, caplog):
    with caplog.at_level(logging.INFO, logger="tessera"):
        cfg = Config.from_file(path)
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_kv_attention_heads, m.vocab_size) == (
        32, 4096, 32, kv_heads, vocab)
    from tessera.model.args import ModelArgs
    assert ModelArgs.from_config(m).ffn_hidden_size == ffn
    assert m.dtype == "torch.bfloat16" and m.checkpoint is False and m.use_fp32_norm is False
    # InternLM (7B_sft: no no_bias key) biases q/k/v/o and not the MLP, as InternEvo's model does; 7B_llama2 says
    # no_bias=True
    assert (m.bias, m.mlp_bias) == ((True, False) if path == SFT else (False, None))
    assert cfg.job_name == ("7b_train" if path == SFT else "7b_llama2_train")  # InternEvo's JOB_NAME
    assert cfg.parallel.tensor.size == 1 and cfg.parallel.tensor.mode == "mtp" and cfg.parallel.pipeline.size == 1
    assert cfg.parallel.zero1.size == -1
    # train_folder=None: InternEvo trains on random tokens
    assert cfg.data.type == "synthetic" and cfg.data.train_folder is None
    assert (cfg.data.seq_len, cfg.data.micro_bsz, cfg.data.micro_num, cfg.data.total_steps) == (
        2048, micro_bsz, 4, total_steps)
    assert cfg.adam.decay_norm_and_bias is True  # InternEvo puts weight decay on every parameter
    assert cfg.hybrid_zero_optimizer.clip_grad_norm == 1.0 and cfg.hybrid_zero_optimizer.reduce_bucket_size == 2**29
    # enable_save_ckpt=False: InternEvo neither saves nor resumes; auto_resume makes it ignore load_ckpt_info
    assert cfg.ckpt.enable_save_ckpt is False and cfg.ckpt.save_ckpt_folder is None
    assert cfg.ckpt.load_ckpt_folder is None
    # one line for the no-ops, one for the mapped keys
    lines = [r.getMessage() for r in caplog.records if "InternEvo keys" in r.getMessage()]
    assert len(lines) == 2 and "no-ops" in lines[1] and "model.num_chunks=1" in lines[1]
    assert "beta2_scheduler.c=0" in lines[1] and "monitor.alert.enable_feishu_alert=False" in lines[1]


@pytest.mark.parametrize("path,kv_heads,vocab,ffn", [(SFT, 32, 103168, 11008), (LLAMA2, 8, 32000, 14336)])
def test_train_py_dry_run_plans_them_at_full_size(path, kv_heads, vocab, ffn, tmp_path):
    """The full 7B model on a fake world of 8 ranks (tp 1 x dp 8, ZeRO over 8): a few seconds."""
    env = dict(os.environ, WORLD_SIZE="8")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--config", path, "--dry-run"],
                          capture_output=True, text=True, timeout=300, cwd=str(tmp_path), env=env)
    assert proc.returncode == 0, explain(proc)
    assert "world 8 = tp 1 x dp 8, zero1 8, tensor mode mtp" in proc.stdout
    params = decoder_parameters(vocab, 4096, 32, 32, kv_heads, ffn, attention_bias=path == SFT)
    assert f"{params:,} parameters on rank 0" in proc.stdout
    assert "= persistent state" in proc.stdout
    assert "InternEvo keys accepted as no-ops" in proc.stderr  # logged before the plan


def test_pipeline_two_and_isp_are_refused_together_in_one_message(tmp_path):
    text = open(SFT).read()
    text = text.replace('pipeline=dict(size=1, interleaved_overlap=True)', 'pipeline=dict(size=2, interleaved_overlap=True)')
    text = text.replace('tensor=dict(size=1, mode="mtp")', 'tensor=dict(size=2, mode="isp")')
    assert 'size=2, mode="isp"' in text and "pipeline=dict(size=2" in text
    path = tmp_path / "7B_isp_pp2.py"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        Config.from_file(path)
    msg = str(e.value)
    assert "2 settings of an InternEvo config that tessera cannot honour" in msg and str(path) in msg
    assert "parallel.pipeline.size=2: pipeline parallelism is not supported" in msg
    assert "parallel.tensor.mode='isp': InternEvo's intern sequence parallelism" in msg
    # and from the command line, through train.py
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--config", SFT, "--dry-run",
                           "parallel.pipeline.size=2", "parallel.tensor.mode='isp'", "parallel.weight.size=4"],
                          capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert proc.returncode != 0, explain(proc)
    err = proc.stderr
    assert err.count("error:") == 1 and "3 settings" in err
    for fragment in ("parallel.pipeline.size=2", "parallel.tensor.mode='isp'", "parallel.weight.size=4"):
        assert fragment in err


def test_every_refusal_of_a_file_in_one_error():
    raw = sft()
    raw.update(model_type="INTERNLM_MoE", tensorboard_folder="/tb")
    raw["model"].update(num_chunks=2, use_swiglu=False, norm_type="layernorm", drop_rate=0.1, dropout=0.2)
    raw["parallel"]["tensor"]["mode"] = "fsp"
    raw["ckpt"].update(save_ckpt_folder="boto3:s3://bucket/ckpt", enable_save_ckpt=True)
    raw["monitor"]["alert"]["enable_feishu_alert"] = True
    msg = refusal(raw, "model_type='INTERNLM_MoE'", "tensorboard_folder='/tb'", "model.num_chunks=2",
                  "model.use_swiglu=False", "model.norm_type='layernorm'", "parallel.tensor.mode='fsp'",
                  "ckpt.save_ckpt_folder='boto3:s3://bucket/ckpt'", "object stores",
                  "monitor.alert.enable_feishu_alert=True", "ckpt.oss_snapshot_freq=25",
                  "model.drop_rate=0.1: means model.dropout=0.1, but the file sets model.dropout=0.2")
    assert msg.startswith("10 settings of an InternEvo config")


def test_unknown_keys_still_get_a_suggestion(tmp_path):
    raw = sft()
    raw["model"]["num_layer"] = 3  # neither tessera's nor InternEvo's
    refusal(raw, "unknown key 'model.num_layer'", "did you mean 'num_layers'")
    raw = sft()
    raw["monitor"]["alert"]["enable_feishu_alrt"] = False  # a typo inside a section only InternEvo has
    refusal(raw, "monitor.alert.enable_feishu_alrt=False: unknown key; did you mean 'enable_feishu_alert'")
    with pytest.raises(ConfigError, match="unknown key 'model.num_chunk'; did you mean 'num_chunks'"):
        Config.from_file(SFT, ["model.num_chunk=1"])
    with pytest.raises(ConfigError, match="unknown key 'monitor.alert.enable_feishu_alrt'; did you mean 'enable_fei"):
        Config.from_file(SFT, ["monitor.alert.enable_feishu_alrt=False"])
    assert Config.from_file(SFT, ["monitor.alert.enable_feishu_alert=False", "generation.top_k=5"]).job_name


# ------------------------------------------------------------------------------------------ each kind of key
# (key, its no-op value, a value that asks for something else), from InternEvo's code
NOOPS = [
    ("model.num_chunks", 1, 2), ("model.embed_grad_scale", 1, 0.1), ("model.apply_post_layer_norm", False, True),
    ("model.o_bias", False, True), ("model.is_reward", False, True), ("model.use_scaled_init", True, False),
    ("model.use_swiglu", True, False), ("model.deepnorm", False, True), ("model.residual_in_fp32", False, True),
    ("model.use_dynamic_ntk_rope", False, True), ("model.norm_head", False, True),
    ("model.init_type", "normal", "uniform"), ("model.num_experts", 1, 4), ("model.use_sliding_window", False, True),
    ("parallel.zero1.fsdp", False, True), ("parallel.weight.size", 1, 4), ("data.skip_batches", "", "0-100"),
    ("data.rampup_batch_size", "", "192 24 8"), ("data.use_packed_dataset", True, False),
    ("tensorboard_folder", None, "/tb"), ("resume_tb_folder", None, "/tb"), ("alert_address", None, "http://a"),
    ("monitor.alert.enable_feishu_alert", False, True), ("monitor.alert.light_monitor_address", None, "http://a"),
    ("gradient_handler", [], [dict(type="PipelineSharedModuleGradientHandler")]), ("ckpt.stop_file_path", None, "s"),
    # no-ops decided by the value of another key
    ("adam.adam_beta2_c", 0, 0.8), ("beta2_scheduler.c", 0, 0.8), ("beta2_scheduler.init_beta2", 0.95, 0.99),
    ("data.gradient_accumulation", 4, 8),  # data.micro_num=4
    ("parallel.sequence_2D", dict(enable=False, head_size=2, context_size=4), dict(enable=True, head_size=2)),
]


@pytest.mark.parametrize("key,ok,other", NOOPS, ids=[k for k, _, _ in NOOPS])
def test_each_noop_is_accepted_only_at_its_noop_value(key, ok, other, caplog):
    with caplog.at_level(logging.INFO, logger="tessera"):
        Config.from_dict(with_key(sft(), key, ok))
    assert f"{key}={ok!r}" in caplog.text
    refusal(with_key(sft(), key, other), f"{key}={other!r}: ")


def test_the_noop_list_covers_every_noop_key():
    assert {k for k, e in KEYS.items() if e.kind == "no-op"} <= {k for k, _, _ in NOOPS}


def test_runtime_tuning_keys_are_accepted_at_any_value(caplog):
    raw = sft()
    raw["model"]["embed_split_hidden"] = False
    raw["hybrid_zero_optimizer"]["overlap_sync_param"] = True
    raw["ckpt"].update(async_upload=False, async_upload_tmp_folder=None)
    raw["data"].update(num_worker=8, empty_cache_and_diag_interval=1, packed_length=123)
    raw["parallel"]["weight"] = dict(size=1, overlap=False, memory_pool=False)
    with caplog.at_level(logging.INFO, logger="tessera"):
        cfg = Config.from_dict(raw)
    assert cfg.data.seq_len == 2048 and "data.packed_length=123" in caplog.text


def test_internlm2_config_is_refused_for_isp_and_weight_parallelism_only():
    """InternEvo's 7B_internlm2.py (its later version: isp with weight parallel 2, a generation section)."""
    raw = load_python_file(LLAMA2)
    raw.update(model_type="INTERNLM2_PUBLIC", generation=dict(ckpt_folder="/c", batch_size=1, eos_id=[2, 0], top_k=50))
    raw["model"].update(vocab_size=92544, qk_interleaved=False)
    raw["parallel"].update(tensor=dict(size=2, mode="isp"), weight=dict(size=2, overlap=True))
    msg = refusal(raw, "parallel.tensor.mode='isp'", "parallel.weight.size=2")
    assert msg.startswith("2 settings")
    raw["parallel"].update(tensor=dict(size=2, mode="msp"), weight=dict(size=1, overlap=True))
    cfg = Config.from_dict(raw)
    assert cfg.parallel.tensor.mode == "msp" and cfg.model.vocab_size == 92544 and cfg.model.bias is False


def test_a_tessera_config_may_spell_a_key_internevo_s_way():
    tiny = load_python_file(os.path.join(ROOT, "configs", "tiny.py"))
    assert Config.from_dict(with_key(tiny, "model.num_chunks", 1)).model.num_layers == 2
    msg = refusal(with_key(tiny, "model.num_chunks", 2), "model.num_chunks=2")
    assert msg.startswith("1 setting of a config that tessera cannot honour")
    # but tessera's own keys keep tessera's meaning (and messages) without InternEvo's top-level names
    refusal(with_key(tiny, "parallel.tensor", 2), "parallel.tensor: expected a dict")


def test_noops_that_depend_on_saving_and_on_data():
    saving = with_key(sft(), "ckpt.enable_save_ckpt", True)  # then oss_snapshot_freq=25 asks for snapshots
    refusal(saving, "ckpt.oss_snapshot_freq=25: rolling snapshot checkpoints")
    Config.from_dict(with_key(saving, "ckpt.oss_snapshot_freq", 0))
    # min_length=50 filters the documents of InternEvo's tokenized folders (tests/test_internevo_data.py)
    assert Config.from_dict(sft()).data.type == "synthetic"
    folder = Config.from_dict(with_key(sft(), "data.train_folder", "/data/tokens/train"))
    assert folder.data.type == "tokens" and folder.data.min_length == 50


def test_keys_tessera_has_under_another_name():
    raw = sft()
    raw.update(enable_tb=False, use_fp32_norm=True)
    raw["model"].update(drop_rate=0.1, attn_drop_rate=0.05, **{f"{w}_init_std": 0.01 for w in (
        "embedding", "attn_wqkv", "attn_other", "ffn_uplayer", "ffn_other", "out_head")})
    raw["hybrid_zero_optimizer"] = dict(zero_overlap_communication=False, clip_grad_norm=1.0)
    cfg = Config.from_dict(raw)
    assert cfg.metrics.tensorboard is False and cfg.model.use_fp32_norm is True
    assert cfg.model.dropout == 0.1 and cfg.model.attn_dropout == 0.05 and cfg.model.init_std == 0.01
    assert cfg.hybrid_zero_optimizer.overlap_sync_grad is False
    raw["model"]["ffn_other_init_std"] = 0.02  # tessera has one std
    refusal(raw, "model.ffn_other_init_std=0.02", "one init_std")
    # InternEvo's short forms and ranges
    raw = sft()
    raw["parallel"] = dict(zero1=0, tensor=2, pipeline=1, sequence_parallel=True)
    cfg = Config.from_dict(raw)
    assert cfg.parallel.zero1.size == -1 and cfg.parallel.tensor.size == 2 and cfg.parallel.pipeline.size == 1
    assert cfg.parallel.tensor.mode == "msp"  # the old sequence_parallel switch
    raw["parallel"] = dict(tensor=dict(size=2, mode="mtp"), sequence_parallel=True)
    refusal(raw, "parallel.sequence_parallel=True: contradicts parallel.tensor.mode='mtp'")


def test_data_type_and_paths():
    raw = with_key(with_key(sft(), "data.type", "tokenized"), "data.train_folder", "/data/train")
    assert Config.from_dict(with_key(raw, "data.min_length_dict", {"cn/": 10})).data.min_length_dict == {"cn/": 10}
    refusal(with_key(raw, "data.min_length_dict", {"cn/": -1}), "data.min_length_dict")
    refusal(with_key(sft(), "data.type", "streaming"), "data.type='streaming'")
    raw = with_key(with_key(sft(), "ckpt.enable_save_ckpt", True), "ckpt.oss_snapshot_freq", 0)
    assert Config.from_dict(raw).ckpt.save_ckpt_folder == "llm_ckpts"  # InternEvo's local: prefix


def test_checkpoint_loading_follows_internevo_s_order():
    base = with_key(sft(), "ckpt.auto_resume", False)
    # auto_resume=False: load_ckpt_info decides, and the legacy load_ckpt_folder beside it is not read
    assert Config.from_dict(base).ckpt.load_ckpt_folder == "llm_ckpts/xxxx"
    for content, ckpt_type, why in ((("model", "optimizer"), "internevo", "model weights only"),
                                    (("all",), "internevo", "model weights only"),
                                    (("model",), "hf", "tools/import_hf.py")):
        info = dict(path="local:ckpt/10", content=content, ckpt_type=ckpt_type)
        refusal(with_key(base, "ckpt.load_ckpt_info", info), "ckpt.load_ckpt_info=", why)
    # legacy keys without load_ckpt_info: a model-only folder loads weights; load_ckpt_folder is a full resume
    legacy = copy.deepcopy(base)
    del legacy["ckpt"]["load_ckpt_info"]
    assert Config.from_dict(with_key(legacy, "ckpt.load_model_only_folder", "local:w")).ckpt.load_ckpt_folder == "w"
    refusal(legacy, "ckpt.load_ckpt_folder='local:llm_ckpts/'", "model weights only")
    given = with_key(legacy, "ckpt.load_given_ckpt", False)  # legacy: auto_resume = not load_given_ckpt
    del given["ckpt"]["auto_resume"]
    cfg = Config.from_dict(given)
    assert cfg.ckpt.auto_resume is True and cfg.ckpt.load_ckpt_folder is None


def test_internevo_defaults_for_keys_the_file_leaves_out():
    raw = sft()
    for section, key in (("model", "mlp_ratio"), ("model", "dtype"), ("ckpt", "enable_save_ckpt"),
                         ("hybrid_zero_optimizer", "clip_grad_norm"), ("data", "valid_micro_num")):
        del raw[section][key]
    raw["ckpt"]["oss_snapshot_freq"] = 0
    cfg = Config.from_dict(raw)
    # InternEvo: mlp_ratio 4.0, fp16 without a dtype, saving on, no clipping, valid_micro_num = micro_num
    assert cfg.model.mlp_ratio == 4.0 and cfg.model.dtype == "torch.float16" and cfg.ckpt.enable_save_ckpt is True
    assert cfg.hybrid_zero_optimizer.clip_grad_norm == 0.0 and cfg.data.valid_micro_num == 4


def test_differences_are_one_warning(caplog):
    """7B_llama2 never validates (valid_every=0), tessera validates at the end: one warning. 7B_sft's biases are
    InternEvo's own (q/k/v/o, not the MLP): mapped, no warning; no_bias=True from the command line drops them."""
    with caplog.at_level(logging.INFO, logger="tessera"):
        Config.from_file(LLAMA2)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "InternEvo never validates" in warnings[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tessera"):
        Config.from_file(SFT)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    assert any("model.mlp_bias=False (InternEvo's INTERNLM biases q/k/v/o" in r.getMessage() for r in caplog.records)
    cfg = Config.from_file(SFT, ["model.no_bias=True"])  # an InternEvo key on the command line
    assert cfg.model.bias is False and cfg.model.mlp_bias is None


def test_tessera_configs_are_untouched():
    import glob

    for name in sorted(glob.glob(os.path.join(ROOT, "configs", "*.py"))):
        raw = load_python_file(name)
        assert translate_internevo(raw, name) == raw, name
    # an ALL_CAPS JOB_NAME in a tessera file stays a helper; InternEvo's keys need InternEvo's top-level names
    raw = dict(JOB_NAME="x", model=dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256),
               data=dict(type="tokens", train_folder=None))
    assert Config.from_dict(dict(raw, data=dict(type="synthetic"))).job_name == "tessera"
    with pytest.raises(ConfigError, match="data.train_folder is required"):  # no random-token fallback
        Config.from_dict(raw)


def test_the_docs_table_lists_every_key():
    page = open(os.path.join(ROOT, "docs", "internevo.md")).read()
    assert markdown_table() in page


def test_train_py_trains_a_shrunk_internevo_config(tmp_path):
    """7B_sft.py as published with a small model: train.py runs it (random tokens) and the loss is finite."""
    small = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.vocab_size=256",
             "data.seq_len=64", "data.micro_num=2", "data.total_steps=3", "data.valid_micro_num=1",
             "metrics.progress_bar=False", f"log_folder='{tmp_path / 'logs'}'"]
    proc = run_torchrun([os.path.join(ROOT, "train.py"), "--config", SFT, *small], 2, timeout=240, cwd=str(tmp_path))
    assert proc.returncode == 0, explain(proc)
    with open(tmp_path / "logs" / "7b_train" / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    losses = [r["loss"] for r in rows if r["kind"] == "train"]
    assert len(losses) == 3 and all(0 < loss < 20 for loss in losses)


# InternEvo's names for its Llama-style decoder across releases (sources: tessera/config/internevo_rules.py)
DECODER_NAMES = ["INTERNLM", "INTERNLM2", "INTERNLM2_PUBLIC", "INTERNLM2_PUTLIC", "INTERNLM3", "LLAMA", "LLAMA2"]
OTHER_CASE = ["llama", "Llama2", "internlm2"]  # not InternEvo's spelling (its registry is exact): read, with a warning


@pytest.mark.parametrize("family", DECODER_NAMES + OTHER_CASE)
def test_every_model_type_internevo_releases_use_for_the_decoder(family, caplog):
    """INTERNLM2 is v0.2.4's configs/_base_/models name, INTERNLM2_PUTLIC the misspelling in v0.3.3's
    published configs/7B_internlm2.py; both are the decoder InternEvo registers as INTERNLM2(_PUBLIC).
    LLAMA is the Llama model's name before InternEvo #539 (Dec 2023) renamed it LLAMA2; INTERNLM3 is built by
    InternEvo's InternLM2 class. Each gives the very config that LLAMA2 gives."""
    raw = sft()
    raw.update(model_type=family)
    with caplog.at_level(logging.WARNING, logger="tessera"):
        cfg = Config.from_dict(raw)
    assert cfg.model.bias is True and cfg.model.mlp_bias is False  # InternEvo's default q/k/v/o biases
    reference = Config.from_dict(dict(sft(), model_type="LLAMA2"))
    assert cfg.model == reference.model and cfg.data == reference.data
    renamed = [r for r in caplog.records if f"model_type={family!r} is read as" in r.getMessage()]
    assert len(renamed) == (family not in FAMILIES)
    raw["model"]["no_bias"] = True
    assert Config.from_dict(raw).model.bias is False


@pytest.mark.parametrize("family,why", [("INTERNLM_MoE", "mixture-of-experts"), ("MIXTRALMOE", "mixture-of-experts"),
                                        ("QWEN2MOE", "mixture-of-experts"), ("LLAVA", "vision-language"),
                                        ("QWEN2", "q/k/v only"), ("GEMMA", "GeGLU"), ("BAICHUAN2", "ALiBi"),
                                        ("INTERNLM2_FROM_HF", "Hugging Face"), ("GPT2", "LLAMA2"), ("llama3", "LLAMA2"),
                                        (None, "LLAMA2"), (["LLAMA2"], "LLAMA2")])
def test_other_architectures_are_refused_saying_why(family, why):
    """InternEvo's other model types (its ModelType enum and registry) and names of no InternEvo model: one
    refusal naming the value, what it is, and the names that are tessera's decoder."""
    refusal(dict(sft(), model_type=family), f"model_type={family!r}", why, "INTERNLM3")
