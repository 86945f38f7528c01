"""Sampling under tensor parallelism: KV-cache decoding equals full recomputation at TP=2 (greedy),
and the seeded sample is identical on every TP rank (no broadcast needed)."""

from harness.distributed import run_distributed

MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_attention_heads=2, vocab_size=258,
             mlp_ratio=2.0, multiple_of=16, dtype="torch.float32", use_flash_attn=False)


def _worker(rank, world):

    from tessera.config import Config
    from tessera.core.context import ParallelMode, gpc, launch_from_torch
    from tessera.model import build_model
    from tessera.model.generation import generate_ids
    from tessera.model.kv_cache import generate_ids_cached

    cfg = Config.from_dict(dict(model=MODEL, parallel=dict(tensor=dict(size=2)), data=dict(type="synthetic", seq_len=64)))
    launch_from_torch(cfg, seed=5)
    model = build_model(cfg.model, tp_group=gpc.get_group(ParallelMode.TENSOR), seed=5)
    tp = gpc.get_group(ParallelMode.TENSOR)
    prompt = [10, 20, 30, 40]
    kw = dict(tp_group=tp, max_seq_len=64, vocab_size=257)
    full = generate_ids(model, prompt, 24, temperature=0.0, **kw)
    cached = generate_ids_cached(model, prompt, 24, temperature=0.0, **kw)
    sampled = generate_ids_cached(model, prompt, 24, temperature=1.0, top_p=0.9, seed=3, **kw)
    gpc.destroy()
    return full, cached, sampled


def test_kv_cache_matches_full_recompute_at_tp2():
    (full0, cached0, s0), (full1, cached1, s1) = run_distributed(_worker, 2, init_process_group=False)
    assert full0 == cached0 and full1 == cached1
    assert full0 == full1 and s0 == s1  # every TP rank picks the same tokens
    assert len(cached0) == 28 and all(t < 257 for t in s0)
