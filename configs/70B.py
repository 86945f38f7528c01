"""Llama-70B-like shape for planning across nodes: 80 layers, hidden 8192, 64 heads with 8 KV heads
(GQA), SwiGLU 28672, vocab 128256, seq 4096, bf16, TP 8 within a node, ZeRO-1 over the DP group,
sequence parallelism and selective recomputation.

    torchrun --nnodes=8 --nproc_per_node=8 ... train.py --config configs/70B.py data.train_folder=/data/tokens/train

70.55B parameters (``python tools/model_summary.py configs/70B.py --tp 8``). Before launching,
train.py compares the persistent state per rank with the device's memory and refuses a layout that
cannot hold it.
"""

SEQ_LEN = 4096

model = dict(
    num_layers=80,
    hidden_size=8192,
    num_attention_heads=64,
    num_kv_attention_heads=8,
    vocab_size=128256,
    mlp_ratio=3.5,  # 8192 x 3.5 = 28672
    multiple_of=1024,
    dtype="torch.bfloat16",
    norm_type="rmsnorm",
    layer_norm_epsilon=1e-5,
    use_flash_attn=True,
    checkpoint="selective",
    parallel_output=True,
    tie_word_embeddings=False,
    rope_base=500000.0,
    max_position_embeddings=SEQ_LEN,
    init_std=0.02,
    dropout=0.0,
    attn_dropout=0.0,
)
parallel = dict(tensor=dict(size=8, mode="msp"), zero1=dict(size=-1))
data = dict(
    type="tokens",
    train_folder="/path/to/tokens/train",  # placeholder: override with data.train_folder=...
    valid_folder=None,
    seq_len=SEQ_LEN,
    micro_bsz=1,
    micro_num=16,
    total_steps=100000,
    valid_every=1000,
)
adam = dict(lr=1.5e-4, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, weight_decay=0.1)
lr_scheduler = dict(warmup_ratio=0.02, eta_min=1.5e-5)
hybrid_zero_optimizer = dict(clip_grad_norm=1.0)
ckpt = dict(enable_save_ckpt=True, save_ckpt_folder="runs/70B/ckpt", checkpoint_every=500, keep_last=3)
