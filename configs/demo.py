"""The CPU demo: a byte-level decoder trained on the Python standard library's own source files.

TP=2 on 2 CPU processes, bf16 with fp32 master weights, 1600 steps of 8 x 256 bytes (3.3M training
bytes). Sized to finish within 10 minutes on a 2-core machine including the installs (about 8.5
minutes on the idle development VM: ~6.5 minutes of training, ~1 minute of validation over all
held-out files). The recipe was tuned at this compute budget (ablations on a 1.6M-byte proxy, bits per
byte on a fixed 400-row validation sample, see README): hidden 128 beats 96 and 256 at equal time;
4 heads of 32 beat 2 of 64 (-0.04); 8 rows per step beat 16 at the same bytes and wall time (-0.11;
4 rows learn a little more per byte but run 20% slower); a warmup over half the run beats 2-30%
(-0.03 to -0.18); peak lr 4e-3 beats 2.5e-3 and 6e-3.

    torchrun --standalone --nproc_per_node=2 train.py --config configs/demo.py
"""

job_name = "demo"
seed = 1024

model = dict(
    num_layers=4,
    hidden_size=128,
    num_attention_heads=4,
    num_kv_attention_heads=4,
    vocab_size=258,  # 256 bytes + end-of-document, rounded up to a multiple of the TP size
    mlp_ratio=8 / 3,
    multiple_of=64,
    init_std=0.08,  # about 1/sqrt(hidden_size); the usual 0.02 trains 0.1+ bits/byte worse at this budget
    dtype="torch.bfloat16",
    use_flash_attn=False,
    checkpoint=False,
)
parallel = dict(tensor=dict(size=2), zero1=dict(size=-1))
data = dict(
    type="stdlib",
    cache_folder="data_cache",
    seq_len=128,
    micro_bsz=16,
    micro_num=1,
    total_steps=1600,
    valid_every=0,
    valid_micro_num=10000,  # the whole held-out set
    valid_context_len=32,  # each scored byte has >= 32 bytes of its file before it (where the file has them)
)
adam = dict(lr=4e-3, adam_beta1=0.8, adam_beta2=0.95, adam_eps=1e-8, weight_decay=0.01)
lr_scheduler = dict(warmup_ratio=0.5, eta_min=4e-4)
hybrid_zero_optimizer = dict(clip_grad_norm=1.0)
ckpt = dict(enable_save_ckpt=True, save_ckpt_folder="ckpts/demo", checkpoint_every=0, auto_resume=True)
metrics = dict(log_every=25)
generate = dict(prompt="def ", max_new_tokens=200, temperature=0.7, top_k=0, top_p=0.95)
