"""The ngram proposer against a plain reference (longest suffix, latest occurrence)."""

from __future__ import annotations

import numpy as np
import pytest

from kvserve.engine.spec_decode.config import SpeculativeConfig
from kvserve.engine.spec_decode.ngram import NgramProposer
from kvserve.engine.spec_decode.proposer import ProposerContext, SpecRequestView


def reference(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    """Longest suffix of length lo..hi seen earlier (latest occurrence first), its followers."""
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def proposer(lo: int, hi: int) -> NgramProposer:
    config = SpeculativeConfig("ngram", 3, prompt_lookup_min=lo, prompt_lookup_max=hi)
    return NgramProposer(config, ProposerContext(vocab_size=100, max_model_len=4096))


def view(tokens: list[int]) -> SpecRequestView:
    return SpecRequestView("r", np.array(tokens, dtype=np.int64), 1)


def test_known_cases():
    p = proposer(2, 4)
    got = p.propose([view([1, 2, 3, 4, 5, 1, 2]), view([9, 8, 7]),
                     view([1, 2, 3, 1, 2, 3, 1, 2]), view([7])], 3)
    assert got == [[3, 4, 5], [], [3, 1, 2], []]


@pytest.mark.parametrize("lo,hi", [(1, 1), (2, 4), (3, 5)])
def test_matches_reference_on_random_batches(lo, hi):
    rng = np.random.default_rng(lo * 10 + hi)
    p = proposer(lo, hi)
    for _ in range(20):
        batch = [rng.integers(0, 4, size=int(rng.integers(1, 40))).tolist() for _ in range(6)]
        got = p.propose([view(t) for t in batch], 4)
        assert got == [reference(t, lo, hi, 4) for t in batch]


def test_no_drafts_asked():
    assert proposer(2, 3).propose([view([1, 1, 1])], 0) == [[]]
