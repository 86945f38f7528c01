"""A tiny model for tests: 2 layers, hidden 64, 4 heads (2 KV heads), vocab 256, fp32."""

model = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_kv_attention_heads=2,
    vocab_size=256,
    mlp_ratio=2.0,
    multiple_of=16,
    dtype="torch.float32",
    use_flash_attn=False,
)
parallel = dict(tensor=dict(size=1), zero1=dict(size=-1))
data = dict(type="synthetic", seq_len=64, micro_bsz=2, micro_num=1, total_steps=10)
adam = dict(lr=1e-3)
