"""The benchmark harness (rounds, paired ratios, sections) and the benchmarks built on it, at tiny sizes.

No timing assertions: the figures depend on the machine and its load; only their presence and
finiteness (and what does not depend on timing: the rotation, first-step losses, byte counts) are checked.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from benchmarks import harness
from benchmarks.cli import main as bench_main
from harness.distributed import run_distributed


def _numbers(obj):
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return
    if isinstance(obj, (int, float)):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _numbers(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _numbers(v)


def _cells(text: str) -> list[str]:
    return [c.strip() for line in text.splitlines() if line.startswith("|") for c in line.split("|")]


def test_rounds_rotate_and_ratios_pair_within_a_round():
    order = []
    variants = [harness.Variant(n, lambda n=n: order.append(n) or len(order)) for n in "ABC"]
    timed = harness.interleave(variants, 3, warmup=1, quiet=True)
    assert order == list("ABC") + list("ABC") + list("BCA") + list("CAB")
    assert timed["A"].warmup == [1] and timed["B"].values == [5, 7, 12]
    p = harness.paired([2.0, 4.0, 9.0], [1.0, 4.0, 3.0])  # ratios 2, 1, 3: the median of the per-round ratios
    assert p == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert harness.ratio(p) == "**2.00x** [1.00-3.00]" and harness.slowest([[1, 5], [2, 3]]) == [2, 5]
    budget = harness.interleave(variants, 10, warmup=0, min_rounds=2, budget_s=0.0, quiet=True)
    assert len(budget["A"].wall) == 2  # past min_rounds, rounds stop once the budget is spent


def test_a_section_is_replaced_in_place_and_the_rest_kept(tmp_path):
    out = tmp_path / "B.md"
    out.write_text("# title\n\nbody\n\n<!-- section:other -->\nkept\n<!-- /section:other -->\n\ntail\n")
    harness.write_section(str(out), "dp", "## 7. DP", ["first"])  # absent: appended
    harness.write_section(str(out), "dp", "## 7. DP", ["second"])  # present: replaced where it stands
    harness.write_section(str(out), "other", "## other", ["new"])
    text = out.read_text()
    assert text.startswith("# title\n\nbody\n\n<!-- section:other -->\n## other\n\nnew\n<!-- /section:other -->\n\ntail")
    assert text.count("## 7. DP") == 1 and "second" in text and "first" not in text and "kept" not in text


def test_overhead_tiny(tmp_path, monkeypatch, capsys):
    """``python -m benchmarks --tiny``: sections 1 and 2 in one marked section, every figure finite, the same
    first-step loss in tessera and plain PyTorch, and ``--render`` writing the same section from the JSON."""
    out, js = tmp_path / "B.md", tmp_path / "b.json"
    out.write_text("# intro\n\n<!-- section:dp -->\nkept\n<!-- /section:dp -->\n")
    assert bench_main(["--tiny", "--out", str(out), "--json", str(js), "--note", "A note."]) == 0
    text = out.read_text()
    assert "## 1. Framework overhead" in text and "## 2. Precisions" in text and "kept" in text
    assert "`python -m benchmarks --tiny --out" in text and "A note." in text
    assert not [c for c in _cells(text) if re.search(r"\b(nan|inf)\b", c, re.I)]
    res = json.loads(js.read_text())
    assert all(math.isfinite(x) for x in _numbers(res))
    main = res["main"]
    assert main["tessera fp32"]["first_loss"] == pytest.approx(main["plain fp32"]["first_loss"], abs=2e-4)
    assert len(main["tessera bf16"]["wall"]) == 2 and set(res["skipped"]) == {"bf16", "fp16", "fp32", "tf32"}
    again = tmp_path / "C.md"
    assert bench_main(["--render", str(js), "--out", str(again)]) == 0
    assert again.read_text().strip() == text[text.index("<!-- section:overhead"):].strip()

    from benchmarks.overhead import markdown  # the bf16 verdict says why where the CPU lacks bf16 instructions

    for has_bf16 in (False, True):
        flags = {**res["machine"]["flags"], "avx512_bf16": has_bf16, "amx_bf16": False}
        md = "\n".join(markdown({**res, "machine": {**res["machine"], "flags": flags}}))
        assert ("This CPU has no bf16 matrix instructions" in md) is (not has_bf16)

    # without --out nothing is written: the published file in the working folder stays as it was
    published = tmp_path / harness.PUBLISHED
    published.write_text("# the published figures\n")
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert bench_main(["--render", str(js)]) == 0
    assert published.read_text() == "# the published figures\n"
    assert "Reproduce: `python -m benchmarks --tiny" in capsys.readouterr().out


def test_attention_kernels_one_shape(tmp_path):
    out = tmp_path / "B.md"
    assert bench_main(["attention-kernels", "--only", "demo", "--dtype", "fp32", "--causal", "--rounds", "1",
                       "--out", str(out)]) == 0
    text = out.read_text()
    assert "## 16. CPU attention kernels" in text and "| blocked fp32 |" in text
    errors = [float(c) for line in text.splitlines() if line.startswith("| ") and "e-" in line
              for c in line.split("|")[-3:-1]]
    assert errors and max(errors) < 1e-4  # fp32 kernels against the fp64 reference


@pytest.mark.slow
def test_dp_tiny(tmp_path):
    """``python -m benchmarks dp`` on tiny dims: bytes equal the closed form, overlap on and off agree on the losses."""
    out, js = tmp_path / "B.md", tmp_path / "dp.json"
    assert bench_main(["--section", "dp", "--config", "configs/tiny.py", "--rounds", "2", "--micro-bsz", "4",
                       "--out", str(out), "--json", str(js), "data.seq_len=32"]) == 0
    res = json.loads(js.read_text())
    for row in res["traffic"].values():  # the agreements (flags, norms, losses) add a few bytes
        assert row["total"] == pytest.approx(row["closed_form"], rel=0.01)
    assert res["same_losses"] and len(res["job_times"]["overlap"]) == 2
    assert "## 7. Data parallelism" in out.read_text()


@pytest.mark.slow
def test_activations_tiny(tmp_path):
    out, js = tmp_path / "B.md", tmp_path / "a.json"
    assert bench_main(["activations", "--layers", "1", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--vocab",
                       "128", "--seq", "32", "--rounds", "1", "--out", str(out), "--json", str(js)]) == 0
    rows = json.loads(js.read_text())["rows"]
    assert len(rows) == 6 and all(abs(r["peak_bytes"] / r["closed_bytes"] - 1) < 0.15 for r in rows.values())
    assert "| msp | selective |" in out.read_text()


def test_collective_byte_counter_matches_the_ring_closed_form():
    """The one collective counter (the plan's, which the DP benchmark uses) on real gloo tensors, two ranks:
    an all-reduce of n bytes sends n (2 (d-1)/d), a reduce-scatter and an all-gather n/2; a group of one
    rank sends nothing."""
    res = run_distributed(_count_worker, 2)
    n = 1000 * 4
    assert res[0] == {"all_reduce": n, "all_reduce_calls": 1, "reduce_scatter": n / 2, "reduce_scatter_calls": 1,
                      "all_gather": n / 2, "all_gather_calls": 1}


def _count_worker(rank, world):
    import torch.distributed as dist

    from tessera.plan.tracker import CollectiveTraffic

    t = torch.ones(1000)
    alone = [dist.new_group([r]) for r in range(world)][rank]
    with CollectiveTraffic() as traffic:
        dist.all_reduce(t, group=alone)  # a group of one rank sends nothing
        dist.all_reduce(t)
        (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(torch.empty(500), t)
        dist.all_gather(list(torch.empty(1000).chunk(2)), torch.ones(500))
    return traffic.by_kind()
