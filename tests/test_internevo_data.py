"""InternEvo's tokenized folders (``*.bin`` + ``*.bin.meta``) read as they are, packed as InternEvo packs them.

The folders are written by ``write_internevo_bin`` below, which follows InternEvo's ``tools/tokenizer.py``
(one ``{"tokens": [...]}`` JSON line per document; ``.meta`` = ``numpy.save`` of int32 ``(offset, length)``
rows). The expected packs come from ``reference_packs``, written from InternEvo's description of its
packed datasets (per-file shuffle with ``RandomState(1024)``; ``PackedDatasetWithCut`` /
``PackedDatasetWithoutCuSeqlen``; ``packed_collate_fn``), reading the files with plain json and numpy:
never through tessera's reader.
"""

from __future__ import annotations

import bisect
import itertools
import json
import os

import numpy as np
import pytest
import torch

from harness.distributed import run_torchrun
from harness.failure import explain
from tessera.data import DataError, build_data
from tessera.data.internevo_packing import InternEvoPacks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SFT = os.path.join(ROOT, "tests", "fixtures", "internevo", "7B_sft.py")
VOCAB = 256
FILES = ["cn/part-000.bin", "en/a.bin", "en/b.bin", "en/sub/c.bin"]  # InternEvo's walk order: sorted, top-down


def write_internevo_bin(path, docs) -> None:
    """One .bin and its .bin.meta, as InternEvo's tools/tokenizer.py writes them."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    meta, offset = [], 0
    with open(path, "wb") as f:
        for tokens in docs:
            line = (json.dumps({"tokens": [int(t) for t in tokens]}) + "\n").encode("utf-8")
            f.write(line)
            meta.append((offset, len(tokens)))
            offset += len(line)
    with open(f"{path}.meta", "wb") as f:
        np.save(f, np.array(meta, dtype=np.int32))


def make_folder(root, seed=0, docs_per_file=(9, 14, 3, 20)) -> dict[str, list[list[int]]]:
    """Documents of 1..30 tokens; some start with a prompt of negative ids (InternEvo's SFT masking)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, n in zip(FILES, docs_per_file):
        docs = []
        for _ in range(n):
            doc = rng.integers(1, VOCAB, size=int(rng.integers(1, 31))).tolist()
            if rng.random() < 0.3:
                doc[:len(doc) // 2] = [-t for t in doc[:len(doc) // 2]]
            docs.append(doc)
        write_internevo_bin(os.path.join(root, name), docs)
        out[name] = docs
    return out


# ------------------------------------------------------------------------------------------ the reference
def _docs_read_plainly(path, min_length):
    with open(path, "rb") as f:
        docs = [json.loads(line)["tokens"] for line in f if line.strip()]
    return [d for d in docs if len(d) >= min_length]


def _pack_with_cut(docs, k, seq_len, P):
    acm = list(itertools.accumulate(len(d) for d in docs))
    pre_pos, pre_tok = 0, 0
    if k > 0:
        pre_pos = bisect.bisect_left(acm, k * P)
        pre_tok = len(docs[pre_pos]) - (acm[pre_pos] - k * P)
        if pre_tok == len(docs[pre_pos]):
            pre_pos, pre_tok = pre_pos + 1, 0
    pos = bisect.bisect_left(acm, (k + 1) * P)
    end_tok = len(docs[pos]) - (acm[pos] - (k + 1) * P)
    tokens, labels, cu, idx = [], [], [0], []

    def add(chunk, last):
        tokens.extend(chunk)
        labels.extend(list(chunk[1:]) + [last])
        full, rest = divmod(len(chunk), seq_len)
        for n in [seq_len] * full + ([rest] if rest else []):
            cu.append(cu[-1] + n)
            idx.extend(range(n))

    while pre_pos < pos:
        add(docs[pre_pos][pre_tok:], -100)
        pre_pos, pre_tok = pre_pos + 1, 0
    add(docs[pos][pre_tok:end_tok], -100 if end_tok == len(docs[pos]) else docs[pos][end_tok])
    return tokens, labels, cu, idx


def _pack_into_one(docs, k, seq_len, P):
    cum = list(itertools.accumulate(len(d) for d in docs))

    def offset(o):
        i = bisect.bisect_right(cum, o)
        return i, (o if i == 0 else o - cum[i - 1])

    (a, a_len), (b, b_len) = offset(k * P), offset((k + 1) * P)
    if a == b:
        pieces = [docs[a][a_len:b_len]]
    else:
        pieces = [docs[a][a_len:]] + [docs[i] for i in range(a + 1, b)] + ([docs[b][:b_len]] if b_len else [])
    tokens = [t for p in pieces for t in p]
    labels = [t for p in pieces for t in list(p[1:]) + [-100]]
    return tokens, labels, list(range(0, P + 1, seq_len)), list(range(seq_len)) * (P // seq_len)


def reference_packs(root, seq_len, micro_bsz, pack_one, min_length=0, min_length_dict=None):
    """Every pack of the folder in InternEvo's order, collated: (input ids, labels, cu_seqlens, positions)."""
    P = seq_len * micro_bsz
    packs = []
    for name in FILES:
        m = next((v for key, v in (min_length_dict or {}).items() if key in name), min_length)
        docs = _docs_read_plainly(os.path.join(root, name), m)
        order = np.arange(len(docs))
        np.random.RandomState(1024).shuffle(order)
        docs = [docs[i] for i in order]
        for k in range(sum(map(len, docs)) // P):
            t, lab, cu, idx = (_pack_into_one if pack_one else _pack_with_cut)(docs, k, seq_len, P)
            packs.append(([abs(x) for x in t], [x if x > 0 else -100 for x in lab], cu, idx))
    return packs


def _cfg(root, **kw):
    return dict(type="tokens", train_folder=str(root), seq_len=8, micro_bsz=2, micro_num=2, **kw)


def _assert_pack(batch, ref):
    tokens, labels, cu, idx = ref
    assert batch["input_ids"].tolist() == [tokens]
    assert batch["labels"].tolist() == [labels]
    assert batch["cu_seqlens"].tolist() == cu
    assert batch["position_ids"].tolist() == [idx]


# ------------------------------------------------------------------------------------------ the tests
@pytest.mark.parametrize("pack_one", [False, True])
@pytest.mark.parametrize("min_length", [0, 6])
def test_every_pack_equals_internevo_s(tmp_path, pack_one, min_length):
    make_folder(tmp_path)
    bundle = build_data(_cfg(tmp_path, pack_sample_into_one=pack_one, min_length=min_length), vocab_size=VOCAB,
                        max_seq_len=8)
    packs = bundle.train.rows
    assert isinstance(packs, InternEvoPacks) and bundle.tokenizer is None
    ref = reference_packs(tmp_path, 8, 2, pack_one, min_length)
    assert packs.num_rows == len(ref) > 10
    for r, expected in enumerate(ref):
        _assert_pack(packs.batch([r]), expected)
    assert bundle.info["tokens_per_step"] == 2 * 16


def test_min_length_dict_per_file(tmp_path):
    make_folder(tmp_path)
    cfg = _cfg(tmp_path, min_length=2, min_length_dict={"en/sub/": 20, "cn/": 0})
    packs = build_data(cfg, vocab_size=VOCAB, max_seq_len=8).train.rows
    ref = reference_packs(tmp_path, 8, 2, False, 2, {"en/sub/": 20, "cn/": 0})
    assert packs.num_rows == len(ref)
    for r, expected in enumerate(ref):
        _assert_pack(packs.batch([r]), expected)
    with pytest.raises(DataError, match="several keys"):
        build_data(_cfg(tmp_path, min_length_dict={"en/": 1, "sub": 2}), vocab_size=VOCAB, max_seq_len=8)


def test_steps_split_packs_over_ranks_and_resume_bitwise(tmp_path):
    make_folder(tmp_path)
    ref = reference_packs(tmp_path, 8, 2, False)
    loaders = [build_data(_cfg(tmp_path), vocab_size=VOCAB, max_seq_len=8, dp_rank=r, dp_size=2, seed=7).train
               for r in (0, 1)]
    seen = []
    for _ in range(3):
        for loader in loaders:
            batches = loader.next_step_batches()
            assert len(batches) == 2  # micro_num packs, one micro-batch each
            for b in batches:
                seen.append(int(b["sample_ids"][0]))
                _assert_pack(b, ref[seen[-1]])
    assert len(set(seen)) == len(seen) == 12  # 3 steps x 2 ranks x 2 micro-batches, no pack twice in an epoch
    state = loaders[0].state_dict()
    ahead = [loaders[0].next_step_batches() for _ in range(4)]
    resumed = build_data(_cfg(tmp_path), vocab_size=VOCAB, max_seq_len=8, dp_rank=0, dp_size=2, seed=7).train
    resumed.load_state_dict(state)
    for step in ahead:  # across the epoch boundary too (the folder has fewer packs than 7 steps take)
        for a, b in zip(step, resumed.next_step_batches()):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_validation_rows_of_an_internevo_folder(tmp_path):
    docs = make_folder(tmp_path / "train")
    write_internevo_bin(str(tmp_path / "valid" / "val" / "valid.bin"), [[5, -6, 7, 8], [9, 10, 11]])
    bundle = build_data(dict(_cfg(tmp_path / "train"), valid_folder=str(tmp_path / "valid")), vocab_size=VOCAB,
                        max_seq_len=8)
    batch = next(iter(bundle.valid))
    assert batch["input_ids"][0].tolist() == [5, 6, 7, 8, 9, 10, 11, 0]  # abs ids, 0-padded
    assert batch["labels"][0].tolist() == [-100, 7, 8, -100, 10, 11, -100, -100]
    assert docs and bundle.info["train_tokens"] == sum(len(d) for ds in docs.values() for d in ds)


def test_damaged_files_name_the_file(tmp_path):
    make_folder(tmp_path)
    meta = tmp_path / "en" / "a.bin.meta"
    meta.unlink()
    with pytest.raises(DataError, match=f"missing {meta}"):
        build_data(_cfg(tmp_path), vocab_size=VOCAB, max_seq_len=8)
    meta.write_bytes(b"garbage, not numpy")
    with pytest.raises(DataError, match=f"{meta}: not a readable .meta"):
        build_data(_cfg(tmp_path), vocab_size=VOCAB, max_seq_len=8)
    # the index of another file: its offsets do not start lines of this one
    meta.write_bytes((tmp_path / "en" / "b.bin.meta").read_bytes())
    with pytest.raises(DataError, match=f"{meta} does not match"):
        build_data(_cfg(tmp_path), vocab_size=VOCAB, max_seq_len=8)
    # lines that disagree with the vocabulary or the index (same byte length, so the index still fits):
    # named with file and line when they are read
    write_internevo_bin(str(tmp_path / "en" / "a.bin"), [[100, 2, 3], [101, 2, 3], [102, 2, 3]] + [[100, 2, 3]] * 40)
    good = (tmp_path / "en" / "a.bin").read_bytes()
    for old, new, message in ((b"[101, 2, 3]", b"[999, 2, 3]", r"a\.bin:2: token id 999 is >= the model's vocab_size 256"),
                              (b"[102, 2, 3]", b"[1,2,3,4,5]", r"a\.bin:3: 5 tokens, but .*a\.bin\.meta says 3")):
        (tmp_path / "en" / "a.bin").write_bytes(good.replace(old, new))
        packs = build_data(_cfg(tmp_path), vocab_size=VOCAB, max_seq_len=8).train.rows
        with pytest.raises(DataError, match=message):
            for r in range(packs.num_rows):
                packs.batch([r])
    # data that does not fill one pack
    with pytest.raises(DataError, match="micro_bsz x seq_len"):
        build_data(dict(_cfg(tmp_path), micro_bsz=64), vocab_size=VOCAB, max_seq_len=8)


SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", f"model.vocab_size={VOCAB}",
         "data.seq_len=16", "data.micro_bsz=2", "data.micro_num=2", "data.valid_micro_num=1", "data.valid_every=0",
         "data.min_length=3", "metrics.progress_bar=False", "metrics.tensorboard=False", "lr_scheduler.total_steps=4",
         "ckpt.enable_save_ckpt=True", "ckpt.checkpoint_every=2", "ckpt.oss_snapshot_freq=0",
         "generate.max_new_tokens=0", "model.dtype='torch.float32'",
         # a rank stuck in a collective or the rendezvous then fails with torch's own message naming the operation,
         # well before the harness's 300 s kill (which dumps every rank's stacks when it does come)
         "dist.timeout_s=120"]


def _train(tmp_path, folder, ckpt, steps, logs):
    args = [os.path.join(ROOT, "train.py"), "--config", SFT, *SMALL, f"data.train_folder='{folder}'",
            f"data.total_steps={steps}", f"ckpt.save_ckpt_folder='{ckpt}'", f"log_folder='{logs}'"]
    # TESSERA_LOG_LEVEL=DEBUG: each rank logs the phases of its launch, so a failure's output shows where a rank stopped
    proc = run_torchrun(args, 2, timeout=300, cwd=str(tmp_path), env={"TESSERA_LOG_LEVEL": "DEBUG"})
    assert proc.returncode == 0, explain(proc)
    with open(os.path.join(logs, "7b_train", "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if r["kind"] == "train"}


@pytest.mark.slow
def test_train_py_trains_an_internevo_folder_with_an_internevo_config_and_resumes_bitwise(tmp_path):
    make_folder(tmp_path / "data", docs_per_file=(40, 40, 10, 60))
    import shutil

    full = _train(tmp_path, tmp_path / "data", tmp_path / "ckpt_a", 4, tmp_path / "logs_a")
    assert sorted(full) == [1, 2, 3, 4] and all(0 < v < 20 for v in full.values())
    os.makedirs(tmp_path / "ckpt_b")
    shutil.copytree(tmp_path / "ckpt_a" / "step_2", tmp_path / "ckpt_b" / "step_2")
    resumed = _train(tmp_path, tmp_path / "data", tmp_path / "ckpt_b", 4, tmp_path / "logs_b")
    assert sorted(resumed) == [3, 4]
    assert [resumed[s] for s in (3, 4)] == [full[s] for s in (3, 4)]  # bitwise: the same floats
