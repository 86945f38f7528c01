"""``python -m benchmarks optimizer-update`` runs end to end (tiny shard, this checkout against itself) and
writes its section without touching the rest of the file."""

import os

from benchmarks.optimizer_update import POLICIES, main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_policy_gets_a_row_and_other_sections_are_kept(tmp_path):
    out = tmp_path / "B.md"
    out.write_text("# head\n\n<!-- section:other -->\nkept\n<!-- /section:other -->\n")
    assert main(["--against", ROOT, "--numel", "1000", "--rounds", "1", "--out", str(out)]) == 0
    text = out.read_text()
    assert "kept" in text and "<!-- section:optimizer-update -->" in text
    rows = [line for line in text.splitlines() if line.startswith("| fp32 |") or line.startswith("| bf16 |")]
    assert len(rows) == len(POLICIES)
    assert all(float(row.split("|")[-2]) > 0 for row in rows)  # a ratio of two measured times
