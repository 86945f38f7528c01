"""A ~1B-parameter decoder (1.04B): 12 layers, hidden 2048, 16 heads, SwiGLU 5632, InternLM vocab, bf16.

    torchrun --nproc_per_node=8 train.py --config configs/1B.py data.train_folder=/data/tokens/train

Same tokenizer and data as configs/7B.py; fits a single 80 GB GPU with TP 1 (raise
``parallel.tensor.size`` to 2/4/8 to split it).
"""

SEQ_LEN = 2048

model = dict(
    num_layers=12,
    hidden_size=2048,
    num_attention_heads=16,
    num_kv_attention_heads=16,
    vocab_size=103168,
    mlp_ratio=8 / 3,
    multiple_of=256,
    dtype="torch.bfloat16",
    layer_norm_epsilon=1e-6,
    use_flash_attn=True,
    checkpoint=False,
    parallel_output=True,
    max_position_embeddings=SEQ_LEN,
    init_std=0.02,
)
parallel = dict(tensor=dict(size=1), zero1=dict(size=-1))
data = dict(
    type="tokens",
    train_folder="/path/to/tokens/train",  # placeholder: override with data.train_folder=...
    seq_len=SEQ_LEN,
    micro_bsz=4,
    micro_num=2,
    total_steps=20000,
    valid_every=1000,
)
adam = dict(lr=4e-4, weight_decay=0.1)
lr_scheduler = dict(warmup_ratio=0.01, eta_min=4e-5)
hybrid_zero_optimizer = dict(clip_grad_norm=1.0)
ckpt = dict(enable_save_ckpt=True, save_ckpt_folder="runs/1B/ckpt", checkpoint_every=1000, keep_last=3)
