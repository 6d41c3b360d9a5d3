"""Test modules have unique basenames: the test folders are not packages, so pytest imports each
file as a top-level module and a second file of the same name fails collection."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_two_test_files_share_a_basename() -> None:
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert len(names) > 100  # the walk found the suite
    assert [n for n, c in names.items() if c > 1] == []
