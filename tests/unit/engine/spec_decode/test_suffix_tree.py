"""The suffix tree against brute force: substring counts and greedy drafts, under appends and
removals."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.engine.spec_decode.suffix_tree import SuffixTree

ALPHABET = st.integers(min_value=0, max_value=3)


def _count(seqs: dict[int, list[int]], pattern: list[int], depth: int) -> int:
    if len(pattern) > depth:
        return 0
    m = len(pattern)
    return sum(1 for s in seqs.values() for i in range(len(s) - m + 1) if s[i:i + m] == pattern)


def _reference_drafts(seqs, context, depth, k, factor, min_prob):
    """Every (score, tokens) the greedy walk gives for each matching suffix of the context."""
    context = context[-depth:]
    out = []
    for m in range(1, len(context) + 1):
        pat = context[len(context) - m:]
        base = _count(seqs, pat, depth)
        if base == 0:
            break
        limit = min(k, int(m * factor + 1e-6))
        cur, tokens, score = list(pat), [], Fraction(0)
        while len(tokens) < limit:
            cands = [(_count(seqs, cur + [x], depth), -x) for x in range(4)]
            c, neg_x = max(cands)
            if c == 0 or Fraction(c, base) < min_prob:
                break
            cur.append(-neg_x)
            tokens.append(-neg_x)
            score += Fraction(c, base)
        out.append((float(score), tokens))
    return out


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 3), st.lists(ALPHABET, min_size=1, max_size=12)),
        st.tuples(st.just("remove"), st.integers(0, 3), st.just([])),
    ),
    min_size=1,
    max_size=10,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, depth=st.integers(1, 6), context=st.lists(ALPHABET, min_size=1, max_size=8),
       k=st.integers(1, 6), factor=st.sampled_from([0.5, 1.0, 2.0]))
def test_counts_and_drafts_match_brute_force(ops, depth, context, k, factor):
    tree = SuffixTree(depth)
    seqs: dict[int, list[int]] = {}
    for op, seq_id, tokens in ops:
        if op == "add":
            tree.extend(seq_id, tokens)
            seqs.setdefault(seq_id, []).extend(tokens)
        elif seq_id in seqs:
            tree.remove(seq_id)
            del seqs[seq_id]
        tree.check_integrity()
    for a in range(len(context)):
        for b in range(a + 1, min(len(context), a + depth) + 1):
            assert tree.count(context[a:b]) == _count(seqs, context[a:b], depth)
    min_prob = 0.1 + 1e-7  # off any exact ratio of small counts
    draft = tree.speculate(context, k, factor, min_prob)
    ref = _reference_drafts(seqs, context, depth, k, factor, Fraction(1, 10) + Fraction(1, 10**7))
    best = max((s for s, _ in ref), default=0.0)
    assert draft.score == pytest.approx(best, abs=1e-6)
    if best > 0:
        assert any(abs(s - draft.score) < 1e-6 and t == draft.token_ids for s, t in ref)
        assert len(draft.probs) == len(draft.token_ids)


def test_proposes_the_known_continuation():
    tree = SuffixTree(24)
    text = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    tree.extend(0, [1, 2, 3] + text + [4, 4])
    draft = tree.speculate([40, 41, 5, 6, 7], max_spec_tokens=4, max_spec_factor=2.0)
    assert draft.token_ids == [8, 9, 10, 11]
    assert draft.probs == [1.0] * 4
    assert draft.match_len == 3


def test_frequency_decides_between_continuations():
    tree = SuffixTree(8)
    tree.extend(0, [1, 2, 3])
    tree.extend(1, [1, 2, 7])
    tree.extend(2, [1, 2, 7])
    draft = tree.speculate([1, 2], max_spec_tokens=3, min_token_prob=0.5)
    assert draft.token_ids == [7]
    assert draft.probs == [pytest.approx(2 / 3)]
    assert tree.speculate([1, 2], 3, min_token_prob=0.9).token_ids == []


def test_spec_factor_caps_draft_by_match_length():
    tree = SuffixTree(32)
    tree.extend(0, list(range(20)))
    assert len(tree.speculate([3], 10, max_spec_factor=1.0).token_ids) == 1
    assert len(tree.speculate([2, 3], 10, max_spec_factor=2.0).token_ids) == 4


def test_removal_forgets_the_sequence():
    tree = SuffixTree(8)
    tree.extend(0, [1, 2, 3, 4])
    tree.extend(1, [9, 9])
    tree.remove(0)
    tree.check_integrity()
    assert tree.count([1, 2]) == 0
    assert tree.speculate([1, 2], 4).token_ids == []
    with pytest.raises(KeyError, match="not in the suffix tree"):
        tree.remove(0)


def test_append_cost_does_not_grow_with_sequence_length():
    """A long repetitive sequence: active nodes stay <= depth, so the tree stays linear in size."""
    tree = SuffixTree(4)
    tree.extend(0, [1, 2] * 5000)
    assert all(len(a) <= 4 for a in tree._active.values())
    assert tree.count([1, 2, 1]) == 5000 - 1 + 0
