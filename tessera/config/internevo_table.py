"""Every key InternEvo defines and what tessera does with it: ``KEYS``, one entry per dotted key.

Read from InternEvo's published configs (configs/7B_sft.py, 7B_llama2.py, 7B_internlm2.py, 7B_isp_sft.py,
demo.py and its _base_ files, 7B_MoE4_sft.py, 7B_qwen2.py) and from the code that reads them (launch.py's
``args_sanity_check``, the model builders, the checkpoint manager, the data loaders). The kinds of entry and
the custom handlers are ``internevo_keys``; the rules over a whole file are ``internevo_rules``.
"""

from __future__ import annotations

from tessera.config.internevo_keys import (
    INIT_STDS,
    Entry,
    beta2_c,
    custom,
    deferred,
    equals_micro_num,
    ignored,
    init_beta2,
    init_stds,
    int_section,
    isp_fsp,
    job_name,
    no_bias,
    noop,
    norm_type,
    pipeline_size,
    renamed,
    same,
    save_folder,
    sequence_2d,
    sequence_parallel,
    snapshots,
    window_size,
    zero1_size,
)

__all__ = ["KEYS", "SECTIONS", "markdown_table"]

_LEFT_OUT = "same key; left out of an InternEvo file, InternEvo's default"
_RANDOM = ("no folder: random tokens (`data.type='synthetic'`), as InternEvo; a folder of InternEvo's tokenized "
           "`.bin` + `.bin.meta` files is read as it is and packed as InternEvo packs (or a tessera token folder)")
_MOE = "only read by MoE models, which are refused (`model_type`, `model.num_experts`)"
_RUNTIME = "InternEvo's runtime tuning; tessera has its own"

KEYS: dict[str, Entry] = {
    # ---- top level
    "JOB_NAME": job_name,
    "model_type": deferred("`INTERNLM` (the default), `INTERNLM2`, `INTERNLM2_PUBLIC`, `INTERNLM3`, `LLAMA` (the "
                           "Llama model's name before InternEvo #539), `LLAMA2` (and the misspelt `INTERNLM2_PUTLIC` "
                           "of one published config, or these names in other letter case, with a warning): tessera's "
                           "decoder, with InternEvo's default q/k/v/o biases (`model.bias=True`, "
                           "`model.mlp_bias=False`) unless `model.no_bias=True`; any other family (MoE, LLaVA, Qwen2, "
                           "Baichuan2, Gemma, ...) refused, saying why"),
    "use_fp32_norm": renamed("model.use_fp32_norm"),
    "cudnn_deterministic": same(),
    "cudnn_benchmark": same(),
    "enable_tb": renamed("metrics.tensorboard"),
    "tensorboard_folder": noop((None,), "TensorBoard events go to log_folder/job_name/tensorboard: set log_folder",
                               "no-op at `None`; refused otherwise (events go to `log_folder/job_name`)"),
    "resume_tb_folder": noop((None,), "tessera continues the run's own TensorBoard folder on resume",
                             "no-op at `None`; refused otherwise"),
    "alert_address": noop((None,), "alerts are not sent", "no-op at `None`; refused otherwise"),
    "monitor.alert.enable_feishu_alert": noop((False,), "Feishu alerts are not sent", "no-op at `False`; refused"),
    "monitor.alert.feishu_alert_address": ignored("ignored (read only with alerts on)"),
    "monitor.alert.light_monitor_address": noop((None,), "heartbeats to a light monitor are not sent",
                                                "no-op at `None`; refused otherwise"),
    "monitor.alert.alert_file_path": ignored("ignored (read only with alerts on)"),
    "monitor.tensorboard.queue_max_length": ignored(_RUNTIME),
    "metric_dtype": ignored("ignored: tessera computes the loss and its metrics in fp32"),
    "generation": ignored("ignored, every sub-key (InternEvo's generation tool, not training); see `generate`"),
    "moe": ignored(f"ignored: {_MOE}"),
    "gradient_handler": noop(([],), "gradient handlers are InternEvo's pipeline machinery",
                             "no-op at `[]`; refused otherwise"),
    "batch_count": ignored("ignored (InternEvo's internal counter)"),
    # ---- model
    **{f"model.{k}": same() for k in (
        "num_layers", "hidden_size", "num_attention_heads", "num_kv_attention_heads", "vocab_size", "multiple_of",
        "layer_norm_epsilon", "use_flash_attn", "checkpoint", "parallel_output", "rope_base",
        "max_position_embeddings")},
    "model.mlp_ratio": same(f"{_LEFT_OUT} `4.0`"),
    "model.dtype": same(f"{_LEFT_OUT} `'torch.float16'`"),
    "model.norm_type": same("same key; only `rmsnorm`", norm_type),
    "model.num_chunks": noop((1,), "interleaved pipeline chunks need pipeline parallelism, which is not supported",
                             "no-op at 1; refused above"),
    "model.embed_split_hidden": ignored("ignored: how InternEvo shards the embedding (tessera shards the vocabulary; "
                                        "same model)"),
    "model.embed_grad_scale": noop((1,), "the embedding-gradient shrink (GLM-130B) is not implemented",
                                   "no-op at 1; refused otherwise"),
    "model.apply_post_layer_norm": noop((False,), "the decoder is pre-norm only", "no-op at `False`; refused"),
    "model.no_bias": no_bias,
    "model.qkv_bias": renamed("model.qkv_bias", "tessera's `model.qkv_bias`: biases on q/k/v"),
    "model.o_bias": noop((False,), "a bias on the attention output alone is not implemented",
                         "no-op at `False`; refused"),
    "model.adapt_hf": ignored("ignored: a rotary layout for InternEvo's checkpoints (same model)"),
    "model.qk_interleaved": ignored("ignored: a rotary layout for InternEvo's checkpoints (same model)"),
    "model.drop_rate": renamed("model.dropout"),
    "model.attn_drop_rate": renamed("model.attn_dropout"),
    "model.is_reward": noop((False,), "reward-model heads are not implemented", "no-op at `False`; refused"),
    "model.dropout_selective_checkpoint": ignored(_RUNTIME + " (which recomputation runs)"),
    "model.use_scaled_init": noop((True,), "tessera always scales the output projections' init by "
                                  "1/sqrt(2 x num_layers)", "no-op at `True` (tessera's init); refused"),
    "model.use_swiglu": noop((True,), "the MLP is SwiGLU only", "no-op at `True`; refused"),
    "model.deepnorm": noop((False,), "DeepNorm is not implemented", "no-op at `False`; refused"),
    "model.residual_in_fp32": noop((False,), "an fp32 residual stream is not implemented (mark modules fp32 with "
                                   "model.fp32_modules instead)", "no-op at `False`; refused"),
    "model.use_dynamic_ntk_rope": noop((False,), "dynamic NTK rotary scaling is not implemented",
                                       "no-op at `False`; refused"),
    "model.norm_head": noop((False,), "a normalized output head is not implemented", "no-op at `False`; refused"),
    "model.init_type": noop(("normal",), "only normal init is implemented", "no-op at `'normal'`; refused"),
    **{f"model.{k}": Entry("the six stds (0.02 each by default) -> `model.init_std` when equal; refused when they "
                           "differ", init_stds) for k in INIT_STDS},
    "model.num_experts": noop((1,), "mixture-of-experts models are not implemented", "no-op at 1; refused above"),
    "model.moe_use_residual": ignored(f"ignored: {_MOE}"),
    "model.moe_type": ignored(f"ignored: {_MOE}"),
    "model.use_sliding_window": noop((False,), "per-layer sliding-window attention (Qwen2's) is not implemented",
                                     "no-op at `False`; refused"),
    "model.sliding_window": window_size,
    "model.max_window_layers": window_size,
    # ---- parallel
    "parallel.tensor": Entry("an int is `dict(size=int)` (mode `mtp`)", int_section("size")),
    "parallel.tensor.size": same(),
    "parallel.tensor.mode": same("same key: `mtp`, `msp`; `isp` and `fsp` refused", isp_fsp),
    "parallel.zero1": Entry("an int is `dict(size=int)`", int_section("size", zero_is_all=True)),
    "parallel.zero1.size": zero1_size,
    "parallel.zero1.fsdp": noop((False,), "FSDP is not implemented (ZeRO-1 shards the optimizer state)",
                                "no-op at `False`; refused"),
    "parallel.pipeline": Entry("an int is `dict(size=int)`; above 1 refused", int_section("size")),
    "parallel.pipeline.size": same("same key: only 1", pipeline_size),
    "parallel.pipeline.interleaved_overlap": ignored(_RUNTIME + " (pipeline only)"),
    "parallel.weight.size": noop((1,), "weight parallelism (isp's weight sharding) is not implemented",
                                 "no-op at 1; refused above"),
    "parallel.weight.overlap": ignored(_RUNTIME + " (weight parallelism only)"),
    "parallel.weight.memory_pool": ignored(_RUNTIME + " (weight parallelism only)"),
    "parallel.sequence_parallel": sequence_parallel,
    "parallel.sequence_2D": sequence_2d,
    # ---- data
    **{f"data.{k}": same() for k in ("seq_len", "micro_num", "micro_bsz", "pack_sample_into_one", "total_steps")},
    "data.valid_micro_num": same(f"{_LEFT_OUT}: `micro_num`"),
    "data.train_folder": same(_RANDOM),
    "data.valid_folder": same("same key; InternEvo's tokenized folder (rows cut as tessera cuts validation rows) or "
                              "a tessera token folder"),
    "data.valid_every": same("same key; InternEvo's 0 never validates, tessera's validates once at the end (said "
                             "in a warning)"),
    "data.type": deferred("InternEvo's `tokenized` (its default) -> `tokens`, or `synthetic` without a "
                          "`train_folder`; its other types refused"),
    "data.skip_batches": noop(("", None), "skipping batch ranges is not implemented", "no-op at `''`; refused"),
    "data.rampup_batch_size": noop(("", None), "a batch-size ramp-up is not implemented", "no-op at `''`; refused"),
    "data.min_length": same("same key: documents of InternEvo's tokenized folders shorter than this are left out"),
    "data.min_length_dict": same("same key: `min_length` per `.bin` file whose path contains a key"),
    "data.packed_length": ignored("ignored (InternEvo ignores it too: a pack is `seq_len x micro_bsz`)"),
    "data.gradient_accumulation": custom("no-op when equal to `micro_num`; refused otherwise")(
        equals_micro_num("gradient accumulation is micro_num micro-batches")),
    "data.batch_size": ignored("ignored (InternEvo overwrites it with `micro_num`)"),
    "data.use_packed_dataset": noop((True,), "unpacked (padded) batches are not implemented: documents are packed",
                                    "no-op at `True`; refused"),
    "data.fixed_random_dataset_seqlen": ignored("ignored (document lengths of InternEvo's random data)"),
    "data.num_worker": ignored(_RUNTIME + " (loader workers)"),
    "data.seed": ignored("ignored: the order of the packs follows the run's seed (their content is InternEvo's)"),
    "data.empty_cache_and_diag_interval": ignored(_RUNTIME + " (diagnostics)"),
    "data.diag_outlier_ratio": ignored(_RUNTIME + " (diagnostics)"),
    # ---- optimizer, schedules, loss
    **{f"grad_scaler.{k}": same() for k in (
        "fp16.initial_scale", "fp16.min_scale", "fp16.growth_interval", "growth_factor", "backoff_factor",
        "max_scale", "hysteresis")},
    **{f"hybrid_zero_optimizer.{k}": same() for k in ("overlap_sync_grad", "reduce_bucket_size")},
    "hybrid_zero_optimizer.clip_grad_norm": same(f"{_LEFT_OUT} `0.0` (no clipping)"),
    "hybrid_zero_optimizer.overlap_sync_param": ignored(_RUNTIME + " (parameter all-gather overlap)"),
    "hybrid_zero_optimizer.zero_overlap_communication": renamed("hybrid_zero_optimizer.overlap_sync_grad"),
    **{f"adam.{k}": same() for k in ("lr", "adam_beta1", "adam_beta2", "adam_eps", "weight_decay")},
    "adam.adam_beta2_c": custom("no-op at `<= 0`; refused otherwise (a beta2 schedule)")(beta2_c),
    "beta2_scheduler.init_beta2": init_beta2,
    "beta2_scheduler.c": custom("no-op at `<= 0`; refused otherwise (a beta2 schedule)")(beta2_c),
    "beta2_scheduler.cur_iter": ignored("ignored (read only by a beta2 schedule)"),
    **{f"lr_scheduler.{k}": same() for k in ("total_steps", "init_steps", "warmup_ratio", "eta_min", "last_epoch")},
    "loss.label_smoothing": same(),
    "loss.moe_loss_coeff": ignored(f"ignored: {_MOE}"),
    # ---- checkpoints
    **{f"ckpt.{k}": same() for k in ("checkpoint_every", "auto_resume")},
    "ckpt.enable_save_ckpt": same(f"{_LEFT_OUT} `True`"),
    "ckpt.save_ckpt_folder": save_folder,
    "ckpt.load_ckpt_info": deferred("with `auto_resume=False`: `content=('model',)` of a tessera checkpoint -> "
                                    "`ckpt.load_ckpt_folder`; other contents and `ckpt_type`s refused. With "
                                    "`auto_resume=True` unused, as in InternEvo"),
    "ckpt.load_ckpt_folder": deferred("tessera's weights-only start; in an InternEvo file InternEvo's legacy key, "
                                      "read only without `load_ckpt_info` and with `auto_resume=False`, as a full "
                                      "resume, which is refused"),
    "ckpt.load_model_only_folder": deferred("legacy: as `load_ckpt_info=dict(path=..., content=('model',))`"),
    "ckpt.load_optimizer": deferred("legacy: read with the legacy `load_ckpt_folder`"),
    "ckpt.load_given_ckpt": deferred("legacy: `auto_resume = not load_given_ckpt` when `auto_resume` is unset"),
    "ckpt.async_upload": ignored(_RUNTIME + " (object-store uploads)"),
    "ckpt.async_upload_tmp_folder": ignored(_RUNTIME + " (object-store uploads)"),
    "ckpt.oss_snapshot_freq": snapshots,
    "ckpt.snapshot_ckpt_folder": ignored("ignored (snapshots are refused)"),
    "ckpt.stop_file_path": noop((None,), "use train.py --stop-file FILE", "no-op at `None`; refused (use "
                                "`train.py --stop-file`)"),
}

# every dict on the way to a key: tessera's sections, and the ones only InternEvo has (monitor, beta2_scheduler, ...)
SECTIONS: frozenset[str] = frozenset(".".join(p.split(".")[:i]) for p in KEYS for i in range(1, p.count(".") + 1))


def markdown_table() -> str:
    """docs/internevo.md's table: one row per key, as ``| `key` | kind | what tessera does |``."""
    rows = ["| InternEvo key | kind | what tessera does |", "|---|---|---|"]
    rows += [f"| `{path}` | {entry.kind} | {entry.does} |" for path, entry in KEYS.items()]
    return "\n".join(rows)
