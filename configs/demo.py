"""The CPU demo: a byte-level decoder trained on the Python standard library's own source files.

TP=2 on 2 CPU processes, bf16 with fp32 master weights. Sized to finish within 10 minutes on a 2-core
machine (about 7 minutes when the machine is otherwise idle, 3.3M training bytes). The model is small
on purpose: ~6 minutes of two CPU cores is ~3e13 FLOPs, for which a ~1M-parameter model seeing a few
million bytes learns more than a larger one seeing fewer (measured: at equal wall time, hidden 128
reached 3.5 bits/byte where hidden 256 was still at 4.0). Measured result: about 1.9 bits per byte on
the held-out files (1000 steps: 1.91); see README for the compressors on the same bytes.

    torchrun --standalone --nproc_per_node=2 train.py --config configs/demo.py
"""

job_name = "demo"
seed = 1024

model = dict(
    num_layers=4,
    hidden_size=128,
    num_attention_heads=2,
    num_kv_attention_heads=2,
    vocab_size=258,  # 256 bytes + end-of-document, rounded up to a multiple of the TP size
    mlp_ratio=8 / 3,
    multiple_of=64,
    dtype="torch.bfloat16",
    use_flash_attn=False,
    checkpoint=False,
)
parallel = dict(tensor=dict(size=2), zero1=dict(size=-1))
data = dict(
    type="stdlib",
    cache_folder="data_cache",
    seq_len=256,
    micro_bsz=16,
    micro_num=1,
    total_steps=800,
    valid_every=0,
    valid_micro_num=10000,  # the whole held-out set
)
adam = dict(lr=3e-3, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, weight_decay=0.01)
lr_scheduler = dict(warmup_ratio=0.02, eta_min=3e-4)
hybrid_zero_optimizer = dict(clip_grad_norm=1.0)
ckpt = dict(enable_save_ckpt=True, save_ckpt_folder="ckpts/demo", checkpoint_every=0, auto_resume=True)
metrics = dict(log_every=25)
generate = dict(prompt="def ", max_new_tokens=200, temperature=0.7, top_k=0, top_p=0.95)
