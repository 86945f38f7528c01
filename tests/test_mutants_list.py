"""The mutation pass's list follows the code (CI-safe: reads files, runs no mutant and no pytest).

``python -m harness.mutation`` runs before a release, not in CI; this keeps its list from rotting in between:
every mutant's original snippet must occur exactly once in its file, and its tests must exist.
"""

from __future__ import annotations

import pytest

from harness.mutants import EQUIVALENT, MUTANTS, Mutant
from harness.mutation import apply_mutant, check_snippets


def test_every_snippet_occurs_exactly_once_and_every_test_file_exists():
    assert check_snippets([*MUTANTS, *EQUIVALENT]) == []


def test_the_issue_mutant_is_listed():
    """Issue 39: the update no longer divides by the loss scale; tests/test_loss_scale.py must kill it."""
    m = next(m for m in MUTANTS if m.name == "zero-update-keeps-loss-scale")
    assert m.path == "tessera/optim/hybrid_zero.py" and "(1.0 / (scale * dp))" in m.original
    assert "tests/test_loss_scale.py" in m.tests


def test_a_snippet_found_twice_or_not_at_all_is_an_error():
    m = Mutant("x", "tessera/x.py", "a + b", "a - b", "", ("tests/x.py",))
    assert apply_mutant("y = a + b\n", m) == "y = a - b\n"
    for text in ("y = a + b; z = a + b\n", "y = a * b\n"):
        with pytest.raises(ValueError, match="exactly once"):
            apply_mutant(text, m)
    problems = check_snippets([m, Mutant("y", "tessera/__init__.py", "no such text", "x", "", ())])
    assert any("x: tessera/x.py is not a file" in p for p in problems)
    assert any("y: the original snippet occurs 0 times" in p for p in problems)
    assert any("y: no tests listed" in p for p in problems)
