"""``python -m benchmarks text-data``: the demo on raw text against its prepared folder, paired by round.

The corpus the benchmark writes is checked against the demo's own: ``data.type='stdlib'``'s prepared
training split (``prepare_stdlib_corpus``) of the same files must hold the same token bytes as the folder
``tools/prepare_data.py`` makes from the benchmark's ``.jsonl`` shards. The runs are faked where the test is
about the schedule (the order, the fresh cache, the loss check), real at a tiny size end to end.
"""

from __future__ import annotations

import json
import os
import statistics

import pytest

import benchmarks.text_data as td
from benchmarks import harness

FILES = 40  # the first 40 stdlib files: 38 training documents, under a MB
MACHINE = {"cpu": "cpu", "cores": 2, "flags": {}, "torch": "2", "load": 1.0}


def _fake_records(steps: int, losses: list[float] | None = None) -> list[dict]:
    losses = losses or [5.0 - 0.1 * s for s in range(1, steps + 1)]
    return [{"kind": "event", "time": 99.0}] + [
        {"kind": "train", "step": s, "time": 100.0 + s, "step_time": 0.1, "loss": losses[s - 1]}
        for s in range(1, steps + 1)]


def _args(tmp_path, **kw) -> td.argparse.Namespace:
    base = dict(config="configs/demo.py", overrides=["data.seq_len=64"], steps=10, rounds=2, max_files=FILES,
                workdir=str(tmp_path / "w"))
    return td.argparse.Namespace(**{**base, **kw})


def test_the_corpus_is_the_demos_training_split(tmp_path):
    from tessera.data.stdlib_corpus import prepare_stdlib_corpus

    sizes = td.write_corpus(str(tmp_path / "corpus"), FILES)
    assert sizes["documents"] == FILES - FILES // 20 and sizes["shards"] == 8
    assert sorted(os.listdir(tmp_path / "corpus")) == [f"part-{k:03d}.jsonl" for k in range(8)]
    td.prepare(str(tmp_path / "corpus"), str(tmp_path / "prepared"))
    demo = prepare_stdlib_corpus(str(tmp_path / "cache"), max_files=FILES)
    for name in ("tokens.bin", "docs.idx"):
        ours = (tmp_path / "prepared" / "train" / name).read_bytes()
        assert ours == open(os.path.join(demo, "train", name), "rb").read(), name
    assert json.loads((tmp_path / "prepared" / "train" / "meta.json").read_text())["num_documents"] == 38


def test_rounds_alternate_and_every_text_run_tokenizes_afresh(monkeypatch, tmp_path):
    calls = []

    def fake_run(checkout, config, overrides, run_dir, cache_folder=None):
        calls.append((os.path.basename(run_dir), overrides[-3], cache_folder))
        assert checkout == harness.ROOT and config == "configs/demo.py"
        assert set(harness.LOOP_ONLY) <= set(overrides) and overrides[-1] == "data.total_steps=10"
        assert "data.seq_len=64" in overrides
        return _fake_records(10)

    monkeypatch.setattr(harness, "train_run", fake_run)
    monkeypatch.setattr(td, "prepare", lambda corpus, output: 1.5)
    res = td.measure(_args(tmp_path))
    work = str(tmp_path / "w")
    assert calls == [("text_0", "data.type='text'", os.path.join(work, "text_0", "cache")),
                     ("tokens_0", "data.type='tokens'", None),
                     ("tokens_1", "data.type='tokens'", None),
                     ("text_1", "data.type='text'", os.path.join(work, "text_1", "cache"))]
    assert res["order"] == [("text", "tokens"), ("tokens", "text")]
    assert res["median_step"] == {"text": [0.1, 0.1], "tokens": [0.1, 0.1]}
    assert res["loop_s"] == {"text": [1.0, 1.0], "tokens": [1.0, 1.0]}  # records 1 s apart, steps 2 to 10
    assert res["losses_equal"] and res["loss_steps"] == 10 and res["prepare_s"] == 1.5


def test_losses_that_differ_stop_the_benchmark(monkeypatch, tmp_path):
    def fake_run(checkout, config, overrides, run_dir, cache_folder=None):
        losses = [5.0 - 0.1 * s for s in range(1, 11)]
        if "data.type='text'" in overrides:
            losses[6] += 2**-40  # one step a hair off
        return _fake_records(10, losses)

    monkeypatch.setattr(harness, "train_run", fake_run)
    monkeypatch.setattr(td, "prepare", lambda corpus, output: 0.0)
    with pytest.raises(SystemExit) as e:
        td.measure(_args(tmp_path, rounds=1))
    assert str(e.value).startswith("error: round 1: the loss columns of ") and "(first at step 7)" in str(e.value)


def _result(text: list[float], tokens: list[float]) -> dict:
    return {"command": "cmd", "date": "today", "commit": "abc", "machine": MACHINE, "load_end": 1.0,
            "config": "configs/demo.py", "overrides": [], "steps": 200, "rounds": 3, "first": 20, "max_files": None,
            "corpus": {"documents": 1700, "text_bytes": 30e6, "shards": 8, "jsonl_bytes": 32e6}, "prepare_s": 12.0,
            "order": [["text", "tokens"], ["tokens", "text"], ["text", "tokens"]],
            "median_step": {"text": text, "tokens": tokens}, "loop_s": {"text": [0.2, 0.2, 0.2],
                                                                        "tokens": [0.2, 0.2, 0.2]},
            "startup_s": {"text": [30.0, 31.0, 29.0], "tokens": [20.0, 20.5, 19.0]},
            "tokenize_s": [9.5, 10.0, 9.0], "losses_equal": True, "loss_steps": 200}


def test_the_ratio_is_paired_by_round_and_judged_against_five_percent():
    text, tokens = [0.102, 0.121, 0.099], [0.100, 0.110, 0.100]
    ratios = sorted(a / b for a, b in zip(text, tokens))  # 0.990, 1.020, 1.100
    lines = td.markdown(_result(text, tokens))
    out = "\n".join(lines)
    assert (f"median step {statistics.median(ratios):.3f}x [{ratios[0]:.3f}-{ratios[-1]:.3f}], meets the 5% target; "
            "loop 1.000x [1.000-1.000], meets the 5% target**") in out
    assert "| 2 | tokens, text | 121.0 | 110.0 | 1.100 | 200.0 | 200.0 | 1.000 | 31.0 | 20.5 | 10.0 |" in lines
    assert "Start-up, text less tokens: +10.0 s (median over rounds; +10.0, +10.5, +10.0 s)" in out
    assert "the demo's training set, 1700 documents, 30.0 MB of text in 8 `.jsonl` files" in out
    slow = td.markdown(_result([0.106, 0.106, 0.106], [0.100, 0.100, 0.100]))
    assert "median step 1.060x [1.060-1.060], misses the 5% target" in "\n".join(slow)


@pytest.mark.slow
def test_end_to_end_at_a_tiny_size(tmp_path):
    out, work = tmp_path / "B.md", tmp_path / "w"
    out.write_text("# before\n")
    assert td.main(["--max-files", str(FILES), "--steps", "4", "--rounds", "1", "--out", str(out), "--workdir",
                    str(work), "data.seq_len=64", "data.micro_bsz=2", "data.valid_context_len=0"]) == 0
    res = json.loads((work / "result.json").read_text())
    assert res["losses_equal"] and res["loss_steps"] == 4 and res["corpus"]["documents"] == 38
    assert all(len(v) == 1 and v[0] > 0 for v in [*res["median_step"].values(), *res["loop_s"].values()])
    assert res["tokenize_s"][0] is not None  # train.py logged tokenizing the corpus ...
    cached = os.listdir(work / "text_0" / "cache")
    assert len(cached) == 1 and cached[0].startswith("text-")  # ... into the run's own cache folder
    text = out.read_text()
    assert text.startswith("# before\n") and "<!-- section:text-data -->\n" + td.TITLE in text
    assert "\n| 1 | text, tokens | " in text and "bitwise equal in every round (4 steps each" in text
