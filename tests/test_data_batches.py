"""Packing, sampler and loader tests: batches are checked against reconstructions written here.

The reconstructions deliberately loop token by token (the code under test is vectorized), so a
shared mistake is unlikely.
"""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest
import torch

from tessera.data import (
    ByteTokenizer,
    DataError,
    GlobalRowSampler,
    PackedRows,
    TokenFileWriter,
    build_data,
    open_token_folder,
)

EOD = 256
L = 16
# lengths chosen to hit: an empty document, documents longer than a row (spanning 2-3 rows), a
# document whose EOD is the last token of a row (15 + EOD = 16), single-token ones, a padded last row;
# 324 tokens in all -> 21 rows, not a multiple of any global batch used below
DOC_LENGTHS = [5, 0, 23, 7, 15, 40, 3, 1, 15, 2, 60, 33, 0, 47, 29, 16, 11]


def make_docs(lengths: list[int], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=n).tolist() for n in lengths]


def write_folder(folder, docs: list[list[int]]) -> None:
    w = TokenFileWriter(folder, ByteTokenizer(), created_by="test")
    for i, d in enumerate(docs):
        w.add(np.array(d, dtype=np.int64), num_bytes=len(d), source=f"doc{i}")
    w.close()


def expected_rows(docs: list[list[int]], seq_len: int, pack_one: bool = False, context: int = 0) -> list[dict]:
    """Token-by-token reconstruction of every row of one stream, straight from the specification.

    ``context``: rows advance by ``seq_len - context`` tokens; all but the first leave their first
    ``context`` positions unlabelled."""
    stream, doc_of, is_last = [], [], []
    for d, doc in enumerate(docs):
        toks = list(doc) + [EOD]
        for j, t in enumerate(toks):
            stream.append(t)
            doc_of.append(d)
            is_last.append(j == len(toks) - 1)
    n = len(stream)
    stride = seq_len - context
    rows = []
    for r in range(1 + math.ceil(max(0, n - seq_len) / stride)):
        inp, lab, pos, starts, nbytes, p = [], [], [], [], 0, 0
        for j in range(seq_len):
            t = r * stride + j
            if t < n:
                inp.append(stream[t])
                label = -100 if is_last[t] else stream[t + 1]
                new_seg = j == 0 or (not pack_one and doc_of[t] != doc_of[t - 1])
            else:
                inp.append(EOD)
                label = -100
                new_seg = j == 0 or (not pack_one and t == n)
            if r > 0 and j < context:
                label = -100
            if new_seg:
                starts.append(j)
                p = 0
            pos.append(p)
            p += 1
            lab.append(label)
            nbytes += label not in (-100, EOD)
        rows.append({"input_ids": inp, "labels": lab, "position_ids": pos, "starts": starts, "num_bytes": nbytes})
    return rows


def assert_batch_matches(batch: dict, rows: list[dict], seq_len: int) -> None:
    ids = batch["sample_ids"].tolist()
    assert batch["input_ids"].dtype == torch.int64 and batch["labels"].dtype == torch.int64
    assert batch["position_ids"].dtype == torch.int64 and batch["cu_seqlens"].dtype == torch.int32
    assert batch["input_ids"].shape == (len(ids), seq_len)
    cu = []
    for b, r in enumerate(ids):
        exp = rows[r]
        assert batch["input_ids"][b].tolist() == exp["input_ids"], f"row {r}"
        assert batch["labels"][b].tolist() == exp["labels"], f"row {r}"
        assert batch["position_ids"][b].tolist() == exp["position_ids"], f"row {r}"
        cu += [b * seq_len + s for s in exp["starts"]]
    assert batch["cu_seqlens"].tolist() == cu + [len(ids) * seq_len]
    assert int(batch["num_bytes"]) == sum(rows[r]["num_bytes"] for r in ids)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    docs = make_docs(DOC_LENGTHS, seed=0)
    write_folder(root / "train", docs)
    return root, docs


def cfg(folder, **kw):
    return {"type": "tokens", "train_folder": str(folder), "seq_len": L, "micro_bsz": 2, "micro_num": 2, **kw}


# ------------------------------------------------------------------------------------------ packing
def test_reconstruction_sanity(corpus):
    """The test's own reconstruction agrees with hand-checked facts before it judges anything."""
    _, docs = corpus
    rows = expected_rows(docs, L)
    n_tokens = sum(DOC_LENGTHS) + len(DOC_LENGTHS)
    assert len(rows) == math.ceil(n_tokens / L)
    # first row: doc0 (5 tokens + EOD), doc1 (EOD only), 9 tokens of doc2
    assert rows[0]["starts"] == [0, 6, 7]
    assert rows[0]["labels"][:6] == docs[0][1:] + [EOD, -100]
    assert rows[0]["labels"][6] == -100  # doc1 is just its EOD


@pytest.mark.parametrize("pack_one", [False, True])
def test_every_row_matches_reconstruction(corpus, pack_one):
    root, docs = corpus
    bundle = build_data(cfg(root / "train", pack_sample_into_one=pack_one), vocab_size=257, max_seq_len=L)
    rows = expected_rows(docs, L, pack_one)
    assert bundle.train.num_rows == len(rows)
    seen = []
    steps = math.ceil(len(rows) / 4)
    for _ in range(steps):
        for mb in bundle.train.next_step_batches():
            assert_batch_matches(mb, rows, L)
            seen += mb["sample_ids"].tolist()
    assert sorted(seen[: len(rows)]) == list(range(len(rows)))  # first epoch: every row exactly once


def test_label_and_boundary_rules_directly(corpus):
    """Spot checks of the rules stated in the brief, independent of any reconstruction helper."""
    root, docs = corpus
    rows = PackedRows(open_token_folder(root / "train"), L, ByteTokenizer().token_byte_lengths())
    b = rows.batch(np.arange(rows.num_rows))
    inp, lab, pos = b["input_ids"].reshape(-1), b["labels"].reshape(-1), b["position_ids"].reshape(-1)
    n = sum(DOC_LENGTHS) + len(DOC_LENGTHS)
    # labels are the next input token wherever they are not ignored (within the flattened stream)
    keep = lab[:-1] != -100
    assert torch.equal(lab[:-1][keep], inp[1:][keep])
    # every EOD input position is ignored; the token before each EOD predicts EOD
    assert (lab[:n][inp[:n] == EOD] == -100).all()
    eod_pos = (inp[:n] == EOD).nonzero().flatten()
    before = eod_pos[eod_pos > 0] - 1
    before = before[inp[before] != EOD]
    assert (lab[before] == EOD).all()
    # padding (after the stream) has no labels and starts its own segment
    assert (lab[n:] == -100).all() and n % L != 0 and n in b["cu_seqlens"].tolist()
    # positions restart exactly at cu_seqlens boundaries
    cu = b["cu_seqlens"].tolist()
    for s, e in zip(cu[:-1], cu[1:]):
        assert pos[s:e].tolist() == list(range(e - s))
    assert all(r * L in cu for r in range(rows.num_rows))


def test_shards_do_not_share_rows(tmp_path):
    a, b = make_docs([9, 30], seed=1), make_docs([4, 4, 17], seed=2)
    write_folder(tmp_path / "train" / "shard_00", a)
    write_folder(tmp_path / "train" / "shard_01", b)
    rows = expected_rows(a, L) + expected_rows(b, L)
    bundle = build_data(cfg(tmp_path / "train", micro_bsz=1, micro_num=1), vocab_size=257, max_seq_len=L)
    assert bundle.train.num_rows == len(rows)
    for _ in range(len(rows)):
        assert_batch_matches(bundle.train.next_step_batches()[0], rows, L)


# ------------------------------------------------------------------------------------------ sampler
def step_rows(loader) -> list[list[int]]:
    return [mb["sample_ids"].tolist() for mb in loader.next_step_batches()]


def test_dp_ranks_disjoint_and_union_is_global_batch(corpus):
    root, _ = corpus
    ranks = [build_data(cfg(root / "train"), vocab_size=257, max_seq_len=L, dp_rank=r, dp_size=2, seed=7).train
             for r in range(2)]
    # dp=1 with twice the micro-batches consumes the same number of rows per step
    single = build_data(cfg(root / "train", micro_num=4), vocab_size=257, max_seq_len=L, seed=7).train
    assert single.num_rows == 21
    for _ in range(6):  # 6 steps x 8 rows > 2 epochs of 21 rows: crosses epoch boundaries
        r0 = sum(step_rows(ranks[0]), [])
        r1 = sum(step_rows(ranks[1]), [])
        g = sum(step_rows(single), [])
        assert len(r0) == len(r1) == 4
        # disjoint positions in the global sequence: same row twice only if the step spans an epoch end
        assert sorted(r0 + r1) == sorted(g)


def test_epochs_are_permutations_and_reshuffled(corpus):
    root, _ = corpus
    loader = build_data(cfg(root / "train", micro_bsz=1, micro_num=1), vocab_size=257, max_seq_len=L, seed=3).train
    n = loader.num_rows
    seq = [step_rows(loader)[0][0] for _ in range(3 * n)]
    epochs = [seq[i * n:(i + 1) * n] for i in range(3)]
    for e in epochs:
        assert sorted(e) == list(range(n))
    assert len({tuple(e) for e in epochs}) == 3, epochs  # each epoch its own order (all three pairs differ)
    assert epochs[0] != list(range(n))  # shuffled at all


def test_deterministic_for_a_seed(corpus):
    root, _ = corpus

    def run(seed):
        loader = build_data(cfg(root / "train"), vocab_size=257, max_seq_len=L, seed=seed).train
        return [step_rows(loader) for _ in range(5)]

    assert run(11) == run(11)
    assert run(11) != run(12)


def _equal_batches(x: list[dict], y: list[dict]) -> bool:
    return len(x) == len(y) and all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
                                    for a, b in zip(x, y))


def test_resume_gives_identical_batches(corpus):
    root, _ = corpus
    n_steps = 4

    def loader():
        return build_data(cfg(root / "train"), vocab_size=257, max_seq_len=L, dp_rank=1, dp_size=2, seed=5).train

    full = loader()
    straight = [full.next_step_batches() for _ in range(2 * n_steps)]
    first = loader()
    resumed = [first.next_step_batches() for _ in range(n_steps)]
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)  # the checkpoint path: plain values, weights_only-safe
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    json.dumps(state)
    second = loader()
    second.load_state_dict(state)
    resumed += [second.next_step_batches() for _ in range(n_steps)]
    assert all(_equal_batches(a, b) for a, b in zip(straight, resumed))
    # and the state really moved: a fresh loader does not produce the second half
    assert not _equal_batches(loader().next_step_batches(), straight[n_steps])


@pytest.mark.parametrize("new_dp", [1, 4])
def test_resume_at_another_dp_size_continues_global_sequence(corpus, new_dp):
    root, _ = corpus
    B, M = 2, 1

    def loaders(dp):
        return [build_data(cfg(root / "train", micro_bsz=B, micro_num=M), vocab_size=257, max_seq_len=L,
                           dp_rank=r, dp_size=dp, seed=9).train for r in range(dp)]

    # reference: the global sequence at dp=1, one row at a time
    ref = loaders(1)[0]
    n_old, n_new = 5, 4
    total = n_old * 2 * B * M + n_new * new_dp * B * M
    reference = []
    while len(reference) < total:
        reference += sum(step_rows(ref), [])
    old = loaders(2)
    consumed = []
    for _ in range(n_old):
        per_rank = [step_rows(ld) for ld in old]
        consumed.append(sorted(sum(sum(per_rank, []), [])))
    states = [ld.state_dict() for ld in old]
    assert states[0] == states[1]  # the position is global: any rank's state will do
    new = loaders(new_dp)
    for ld in new:
        ld.load_state_dict(states[0])
    for _ in range(n_new):
        consumed.append(sorted(sum(sum((step_rows(ld) for ld in new), []), [])))
    # step by step, the rows are exactly the next slice of the reference sequence: no repeat, no skip
    pos = 0
    for step in consumed:
        assert step == sorted(reference[pos:pos + len(step)])
        pos += len(step)
    assert pos == total


def test_sampler_state_mismatch_is_an_error(corpus):
    s = GlobalRowSampler(20, seed=1)
    s.take(7)
    other = GlobalRowSampler(21, seed=1)
    with pytest.raises(DataError, match="20 rows.*21"):
        other.load_state_dict(s.state_dict())


# ------------------------------------------------------------------------------------------ valid
def test_valid_is_repeatable_sharded_and_padded(tmp_path):
    docs = make_docs([20, 9, 40, 3, 31, 12, 50], seed=4)
    write_folder(tmp_path / "valid", docs)
    write_folder(tmp_path / "train", make_docs([30], seed=5))
    rows = expected_rows(docs, L)
    n = len(rows)
    assert n == 11  # 165 tokens + 7 EODs = 172 -> 11 rows of 16; 12 slots over 2 ranks -> 1 padding row

    def valids(dp, micro_num):
        return [build_data(cfg(tmp_path / "train", valid_folder=str(tmp_path / "valid"), valid_micro_num=micro_num),
                           vocab_size=257, max_seq_len=L, dp_rank=r, dp_size=dp).valid for r in range(dp)]

    # enough micro-batches to cover everything: each row once over both ranks, the rest padding
    vs = valids(2, micro_num=100)
    assert len(vs[0]) == len(vs[1]) == math.ceil(n / 4)
    seen = []
    for v in vs:
        first, again = list(v), list(v)
        assert _equal_batches(first, again)
        for mb in first:
            ids = mb["sample_ids"].tolist()
            for b, r in enumerate(ids):
                if r == -1:
                    assert (mb["labels"][b] == -100).all()
                else:
                    assert mb["input_ids"][b].tolist() == rows[r]["input_ids"]
                    assert mb["labels"][b].tolist() == rows[r]["labels"]
            seen += ids
    assert sorted(r for r in seen if r >= 0) == list(range(n))
    # capped: 2 micro-batches x 2 rows x 2 ranks = 8 distinct rows spread over the set
    capped = [r for v in valids(2, micro_num=2) for mb in v for r in mb["sample_ids"].tolist()]
    assert len(capped) == len(set(capped)) == 8 and max(capped) >= n - 2 and min(capped) == 0
    # valid_micro_bsz: bigger validation micro-batches, the same rows each once
    big = build_data(cfg(tmp_path / "train", valid_folder=str(tmp_path / "valid"), valid_micro_num=100,
                         valid_micro_bsz=5), vocab_size=257, max_seq_len=L).valid
    assert len(big) == math.ceil(n / 5) and all(mb["input_ids"].shape[0] == 5 for mb in big)
    ids = [r for mb in big for r in mb["sample_ids"].tolist()]
    assert sorted(r for r in ids if r >= 0) == list(range(n)) and ids.count(-1) == 5 * len(big) - n


@pytest.mark.parametrize("context", [1, 5, 15])
def test_valid_context_rows_score_every_token_once_with_context(tmp_path, context):
    docs = make_docs([20, 9, 40, 3, 31, 12, 50], seed=4)
    write_folder(tmp_path / "valid", docs)
    write_folder(tmp_path / "train", make_docs([30], seed=5))

    def batches(c):  # one row per micro-batch: every row of the valid set once, in order
        v = build_data(cfg(tmp_path / "train", valid_folder=str(tmp_path / "valid"), valid_micro_num=1000,
                           valid_micro_bsz=1, valid_context_len=c), vocab_size=257, max_seq_len=L).valid
        return list(v)

    rows = expected_rows(docs, L, context=context)
    got = batches(context)
    assert [int(mb["sample_ids"]) for mb in got] == list(range(len(rows)))
    assert len(rows) > len(expected_rows(docs, L))  # overlapping rows: more of them
    for mb in got:
        assert_batch_matches(mb, rows, L)

    # independently of the reconstruction: every (stream position, label) pair is scored exactly once,
    # the same pairs and bytes as without context, and in every row after the first no scored
    # position has fewer than `context` tokens before it in the row
    def scored(bs, c):
        pairs, nbytes = [], 0
        for r, mb in enumerate(bs):
            nbytes += int(mb["num_bytes"])
            for j, label in enumerate(mb["labels"][0].tolist()):
                if label != -100:
                    assert r == 0 or j >= c
                    pairs.append((r * (L - c) + j, label))
        return pairs, nbytes

    with_ctx, bytes_ctx = scored(got, context)
    plain, bytes_plain = scored(batches(0), 0)
    assert sorted(with_ctx) == sorted(plain) and len({p for p, _ in with_ctx}) == len(with_ctx)
    assert bytes_ctx == bytes_plain == sum(len(d) - 1 for d in docs if d)  # a first byte has no predictor


def test_valid_context_len_must_be_below_seq_len(tmp_path):
    write_folder(tmp_path / "valid", make_docs([20], seed=4))
    write_folder(tmp_path / "train", make_docs([30], seed=5))
    with pytest.raises(DataError, match=r"data.valid_context_len.*seq_len=16"):
        build_data(cfg(tmp_path / "train", valid_folder=str(tmp_path / "valid"), valid_context_len=L),
                   vocab_size=257, max_seq_len=L)


# ------------------------------------------------------------------------------------------ synthetic
def test_synthetic_is_deterministic_and_well_formed():
    def batches(seed, rank=0, dp=1):
        b = build_data({"type": "synthetic", "seq_len": 32, "micro_bsz": 2, "micro_num": 2}, vocab_size=50,
                       max_seq_len=64, seed=seed, dp_rank=rank, dp_size=dp)
        assert b.tokenizer is None
        return [b.train.next_step_batches() for _ in range(3)], list(b.valid)

    (t1, v1), (t2, v2) = batches(1), batches(1)
    assert all(_equal_batches(a, b) for a, b in zip(t1, t2)) and _equal_batches(v1, v2)
    t3, _ = batches(2)
    assert not _equal_batches(t1[0], t3[0])
    eod = 49
    for mb in sum(t1, []) + v1:
        inp, lab, cu = mb["input_ids"], mb["labels"], mb["cu_seqlens"].tolist()
        assert inp.min() >= 0 and inp.max() <= eod
        flat_inp, flat_lab, flat_pos = inp.reshape(-1), lab.reshape(-1), mb["position_ids"].reshape(-1)
        assert (flat_lab[flat_inp == eod] == -100).all()
        for b in range(inp.shape[0]):  # within a row, labels are the next inputs
            keep = lab[b, :-1] != -100
            assert torch.equal(lab[b, :-1][keep], inp[b, 1:][keep])
        for s, e in zip(cu[:-1], cu[1:]):
            assert flat_pos[s:e].tolist() == list(range(e - s))
            assert (flat_inp[s:e - 1] != eod).all()  # EOD only ever ends a segment
        assert int(mb["num_bytes"]) == int(((lab != -100) & (lab != eod)).sum())
    # documents end inside rows, so segments other than row boundaries exist
    assert any(len(mb["cu_seqlens"]) > 3 for mb in t1[0])
