"""Smoke test of ``python -m benchmarks`` in its tiny mode: every section is written and every number is finite.

No timing assertions: the figures depend on the machine and its load; only their presence and
finiteness (and the memory closed form, which does not depend on timing) are checked.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from benchmarks.cli import main as bench_main
from benchmarks.report import SECTIONS
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


@pytest.mark.slow
def test_bench_tiny(tmp_path):
    out, js = tmp_path / "BENCH.md", tmp_path / "bench.json"
    assert bench_main(["--tiny", "--no-gpu", "--out", str(out), "--json", str(js)]) == 0  # in this process
    text = out.read_text()
    for heading in SECTIONS:
        assert heading in text, heading
    assert "python -m benchmarks --tiny" in text  # the exact command
    assert "not measured: no CUDA device in this run" in text
    # every cell of every table is free of nan/inf
    cells = [c.strip() for line in text.splitlines() if line.startswith("|") for c in line.split("|")]
    assert not [c for c in cells if re.search(r"\b(nan|inf)\b", c, re.I)]
    res = json.loads(js.read_text())
    nums = list(_numbers(res))
    assert nums and all(math.isfinite(x) for x in nums)
    par = res["parallel"]
    # TP=2 was measured over both all-reduce routes (gloo and shared memory), side by side
    from tessera.parallel.shm_comm import shm_unavailable_reason

    if shm_unavailable_reason(2) is None:
        assert {"tp2", "tp2_shm", "dp2"} <= set(par["median_s"]) and "shm_vs_gloo" in par
        assert "shared-memory all-reduce (CPU default)" in text
    else:
        assert "tp2_shm" not in par["median_s"]
    # memory is measured from tensors, not timed: it equals the closed form up to the flat buffers' padding
    for d, row in res["memory_single"].items():
        assert abs(row["measured"]["total"] - row["closed_form"]["total"]) < 0.01, d
    for k, row in par["memory"].items():
        assert abs(row["measured"]["total"] - row["closed_form"]["total"]) < 0.01, k
    assert res["memory_single"]["bf16"]["closed_form"]["total"] == 18.0
    assert par["memory"]["bf16_z2"]["closed_form"]["total"] == 12.0

    # the bf16 verdict gives the reason that fits the CPU: without bf16 instructions, or with them
    from benchmarks.report import to_markdown

    peaks = res["single"]["peaks"]
    for has_bf16 in (False, True):
        flags = {**res["machine"]["flags"], "avx512_bf16": has_bf16, "amx_bf16": False}
        md = to_markdown({**res, "machine": {**res["machine"], "flags": flags}}, res["command"])
        assert ("this CPU has no bf16/fp16 matrix instructions" in md) is (not has_bf16)
        assert (f"bf16 matmul peak is {peaks['bf16'] / peaks['fp32']:.2f}x the fp32 one" in md) is has_bf16
        assert f"without bf16 instructions ({'not' if has_bf16 else 'as'} this one)" in md


def test_gpu_section_code_path_on_cpu():
    """The GPU section's code runs on any device; exercise it on the CPU at tiny dims."""
    from benchmarks.report import section_gpu
    from benchmarks.runner import MODES, measure_gpu

    torch.set_num_threads(1)
    g = measure_gpu(MODES["tiny"], "cpu", log=lambda _: None)
    assert all(math.isfinite(x) for x in g["tflops"].values())
    text = "\n".join(section_gpu({"gpu": g}, "cmd"))
    assert SECTIONS[5] in text and "tessera / plain time ratio" in text and "bf16 speed-up" in text
    assert not re.search(r"\b(nan|inf)\b", text, re.I)


def test_a_section_run_replaces_only_its_section_and_a_full_run_keeps_it(tmp_path):
    from benchmarks.cli import keep_sections, write_section

    out = tmp_path / "B.md"
    out.write_text("# title\n\nbody\n")
    write_section(str(out), "dp", "## 7. DP", ["first"])
    write_section(str(out), "dp", "## 7. DP", ["second"])  # replaced, not appended twice
    text = out.read_text()
    assert text.startswith("# title\n\nbody\n") and text.count("## 7. DP") == 1
    assert "second" in text and "first" not in text
    full = keep_sections(str(out), "# new full run\n")  # what a full run writes keeps the section
    assert full.startswith("# new full run\n") and "second" in full and full.count("<!-- section:dp -->") == 1


def test_collective_byte_counter_matches_the_ring_closed_form():
    """The one collective counter (the plan's, which the DP section uses) on real gloo tensors, two ranks:
    an all-reduce of n bytes sends n (2 (d-1)/d), a reduce-scatter and an all-gather n/2; a group of one
    rank sends nothing."""
    res = run_distributed(_count_worker, 2)
    n = 1000 * 4
    assert res[0] == {"all_reduce": n, "all_reduce_calls": 1, "reduce_scatter": n / 2, "reduce_scatter_calls": 1,
                      "all_gather": n / 2, "all_gather_calls": 1}


def _count_worker(rank, world):
    import torch
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
