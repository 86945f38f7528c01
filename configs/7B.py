"""InternLM-7B shape: 32 layers, hidden 4096, 32 heads, SwiGLU 11008, vocab 103168, seq 2048, bf16, TP 8.

    torchrun --nproc_per_node=8 train.py --config configs/7B.py data.train_folder=/data/tokens/train

7.32B parameters (``python tools/model_summary.py configs/7B.py``). Set ``data.train_folder`` (and
``valid_folder``) to folders prepared by tools/prepare_data.py with the InternLM tokenizer.
"""

SEQ_LEN = 2048

model = dict(
    num_layers=32,
    hidden_size=4096,
    num_attention_heads=32,
    num_kv_attention_heads=32,
    vocab_size=103168,
    mlp_ratio=8 / 3,
    multiple_of=256,
    dtype="torch.bfloat16",
    norm_type="rmsnorm",
    layer_norm_epsilon=1e-6,
    use_flash_attn=True,
    checkpoint=False,  # True (or a fraction of layers) trades ~1/3 more compute for activation memory
    parallel_output=True,
    tie_word_embeddings=False,
    rope_base=10000.0,
    max_position_embeddings=SEQ_LEN,
    init_std=0.02,
    dropout=0.0,
    attn_dropout=0.0,
)
parallel = dict(tensor=dict(size=8), zero1=dict(size=-1))
data = dict(
    type="tokens",
    train_folder="/path/to/tokens/train",  # placeholder: override with data.train_folder=...
    valid_folder=None,
    seq_len=SEQ_LEN,
    micro_bsz=2,
    micro_num=4,
    total_steps=50000,
    valid_every=1000,
)
adam = dict(lr=3e-4, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, weight_decay=0.1)
lr_scheduler = dict(warmup_ratio=0.01, eta_min=3e-5)
hybrid_zero_optimizer = dict(clip_grad_norm=1.0)
ckpt = dict(enable_save_ckpt=True, save_ckpt_folder="runs/7B/ckpt", checkpoint_every=1000, keep_last=3)
