"""Two real gloo processes: rank 0 prepares the stdlib corpus behind a barrier, ranks split each step."""

from __future__ import annotations

import os

from harness.distributed import run_distributed


def _worker(rank: int, world_size: int, cache: str) -> dict:
    import torch.distributed as dist

    import tessera.data.stdlib_corpus as sc
    from tessera.data import build_data

    if rank != 0:  # only rank 0 may prepare; the others must wait at the barrier
        def refuse(*args, **kwargs):
            raise AssertionError(f"rank {rank} tried to prepare the corpus")

        sc.prepare_corpus = refuse
    waited = []

    def barrier() -> None:
        waited.append(1)
        dist.barrier()

    bundle = build_data({"type": "stdlib", "cache_folder": cache, "seq_len": 32, "micro_bsz": 2, "micro_num": 2},
                        vocab_size=258, max_seq_len=32, dp_rank=rank, dp_size=world_size, seed=3, barrier=barrier)
    steps = [[mb["sample_ids"].tolist() for mb in bundle.train.next_step_batches()] for _ in range(3)]
    valid = [mb["sample_ids"].tolist() for mb in bundle.valid]
    return {"steps": steps, "valid": valid, "waited": len(waited), "source": bundle.info["source"]}


def test_two_ranks_share_one_prepared_corpus(tmp_path):
    cache = str(tmp_path / "cache")
    out = run_distributed(_worker, 2, cache, timeout=300)
    assert out[0]["source"] == out[1]["source"] and out[0]["waited"] == out[1]["waited"] == 1
    assert len(os.listdir(cache)) == 1  # one prepared corpus, no temporary leftovers
    from tessera.data import build_data

    single = build_data({"type": "stdlib", "cache_folder": cache, "seq_len": 32, "micro_bsz": 2, "micro_num": 4},
                        vocab_size=258, max_seq_len=32, seed=3)
    for k in range(3):
        r0, r1 = sum(out[0]["steps"][k], []), sum(out[1]["steps"][k], [])
        assert not set(r0) & set(r1)
        assert sorted(r0 + r1) == sorted(sum((mb["sample_ids"].tolist() for mb in single.train.next_step_batches()), []))
    v0, v1 = sum(out[0]["valid"], []), sum(out[1]["valid"], [])
    assert len(v0) == len(v1) and not set(v0) & set(v1)
