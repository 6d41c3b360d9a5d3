"""Routing policies as pure functions: prefix scoring, overload skipping, fallbacks, hashing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvserve.service.routing_policy import (Candidate, PolicyConfig, UnknownPolicyError, decide,
                                            overloaded, rank_session)

CFG = PolicyConfig(load_weight=0.3, overload_factor=2.0, overload_slack=4, min_match_tokens=32)


def cands(*specs: tuple[str, int, int]) -> list[Candidate]:
    """(id, load, matched_blocks) triples."""
    return [Candidate(rid, f"http://{rid}", load, 0.0, matched) for rid, load, matched in specs]


def ids(decision) -> list[str]:
    return [c.replica_id for c in decision.ranking]


def test_prefix_prefers_the_replica_holding_the_prompt():
    d = decide("prefix", cands(("a", 0, 0), ("b", 0, 20), ("c", 0, 3)), num_blocks=25,
               block_size=16, cfg=CFG)
    assert d.applied == "prefix"
    assert ids(d)[:2] == ["b", "c"]


def test_prefix_beats_moderately_higher_load():
    # b holds 90% of the prompt with 3 requests running; a is idle and holds nothing.
    d = decide("prefix", cands(("a", 0, 0), ("b", 3, 18)), num_blocks=20, block_size=16, cfg=CFG)
    assert d.chosen.replica_id == "b"


def test_small_match_loses_to_load():
    # b holds 10% only and is the busiest: the load penalty outweighs the match.
    d = decide("prefix", cands(("a", 1, 0), ("b", 4, 2), ("c", 1, 0)), num_blocks=20,
               block_size=16, cfg=CFG)
    assert d.applied == "prefix"
    assert d.chosen.replica_id in ("a", "c")


def test_overloaded_replica_is_skipped_even_with_full_match():
    # b holds everything but runs 20 requests while the others run 1: far above the mean.
    c = cands(("a", 1, 0), ("b", 20, 25), ("c", 1, 0))
    assert overloaded(c, CFG) == {"b"}
    d = decide("prefix", c, num_blocks=25, block_size=16, cfg=CFG)
    assert d.chosen.replica_id != "b"
    assert ids(d)[-1] == "b"  # still listed last, for retries


def test_full_kv_cache_counts_as_overloaded():
    c = [Candidate("a", "u", 0, 0.99, 10), Candidate("b", "u", 0, 0.1, 0)]
    assert overloaded(c, CFG) == {"a"}


def test_small_absolute_load_is_not_overload():
    assert overloaded(cands(("a", 3, 0), ("b", 0, 0), ("c", 0, 0)), CFG) == set()


def test_below_min_match_falls_back_to_least_load():
    # One block (16 tokens) < 32: the cache hit is not worth it; the idle replica wins.
    d = decide("prefix", cands(("a", 2, 1), ("b", 0, 0)), num_blocks=10, block_size=16, cfg=CFG)
    assert d.applied == "least-load"
    assert d.chosen.replica_id == "b"


def test_least_load_orders_by_load_and_rotates_ties():
    c = cands(("a", 2, 0), ("b", 0, 0), ("c", 0, 0))
    firsts = {decide("least-load", c, counter=k).chosen.replica_id for k in range(6)}
    assert firsts == {"b", "c"}
    assert ids(decide("least-load", c, counter=0))[-1] == "a"


def test_round_robin_cycles_through_all():
    c = cands(("a", 9, 0), ("b", 0, 0), ("c", 0, 0))
    assert [decide("round-robin", c, counter=k).chosen.replica_id for k in range(6)] == \
        ["a", "b", "c", "a", "b", "c"]


def test_session_is_sticky_and_minimally_disrupted():
    c = cands(*[(f"r{i}", 0, 0) for i in range(5)])
    keys = [f"user-{i}" for i in range(200)]
    before = {k: rank_session(c, k)[0].replica_id for k in keys}
    assert len(set(before.values())) == 5  # spread over all replicas
    assert before == {k: decide("session", c, session_key=k).chosen.replica_id for k in keys}
    removed = "r2"
    after = {k: rank_session([x for x in c if x.replica_id != removed], k)[0].replica_id
             for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == removed for k in moved)


def test_session_without_key_uses_least_load():
    d = decide("session", cands(("a", 5, 0), ("b", 1, 0)), session_key=None)
    assert d.applied == "least-load" and d.chosen.replica_id == "b"


def test_unknown_policy_is_a_typed_error():
    with pytest.raises(UnknownPolicyError, match="round-robin"):
        decide("random", cands(("a", 0, 0)))


def test_no_candidates_gives_empty_ranking():
    for policy in ("prefix", "least-load", "round-robin", "session"):
        assert decide(policy, [], session_key="k").chosen is None


@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 40), st.floats(0, 1)),
                min_size=1, max_size=6),
       st.sampled_from(["prefix", "least-load", "round-robin", "session"]),
       st.integers(0, 100))
def test_every_policy_ranks_every_candidate_once(specs, policy, counter):
    c = [Candidate(f"r{i}", "u", load, usage, m) for i, (load, m, usage) in enumerate(specs)]
    d = decide(policy, c, num_blocks=40, block_size=16, cfg=CFG, counter=counter,
               session_key="s")
    assert sorted(ids(d)) == sorted(x.replica_id for x in c)


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 40)), min_size=2, max_size=6))
def test_prefix_choice_is_deterministic(specs):
    # Two routers seeing the same index and loads must choose the same replica.
    c = [Candidate(f"r{i}", "u", load, 0.0, m) for i, (load, m) in enumerate(specs)]
    a = decide("prefix", c, num_blocks=40, block_size=16, cfg=CFG, counter=3)
    b = decide("prefix", list(reversed(c)), num_blocks=40, block_size=16, cfg=CFG, counter=3)
    assert a.chosen.replica_id == b.chosen.replica_id


# Edges the mutation run (docs/mutation.md) found untested.

@pytest.mark.parametrize("weight", [0.0, 1.0])
def test_host_weight_accepts_both_ends_of_its_range(weight):
    assert PolicyConfig(host_weight=weight).host_weight == weight


@pytest.mark.parametrize("weight", [-0.5, 1.5])
def test_host_weight_outside_its_range_is_an_error(weight):
    with pytest.raises(ValueError, match="host_weight"):
        PolicyConfig(host_weight=weight)


def test_overload_starts_strictly_above_the_limit():
    # Loads 0, 0, x: mean x/3, limit 2 * x/3 + 4, which equals x at 12.
    assert overloaded(cands(("a", 0, 0), ("b", 0, 0), ("c", 12, 0)), CFG) == set()
    assert overloaded(cands(("a", 0, 0), ("b", 0, 0), ("c", 13, 0)), CFG) == {"c"}


def test_a_kv_cache_exactly_at_kv_full_counts_as_overloaded():
    cfg = PolicyConfig(kv_full=0.5)
    c = [Candidate("a", "u", 0, 0.5, 10), Candidate("b", "u", 0, 0.49, 0)]
    assert overloaded(c, cfg) == {"a"}


def test_min_match_zero_still_needs_a_match_for_prefix_routing():
    cfg = PolicyConfig(min_match_tokens=0)
    # Nothing matched anywhere: least load decides, whatever the threshold.
    d = decide("prefix", cands(("a", 2, 0), ("b", 0, 0)), num_blocks=4, block_size=16, cfg=cfg)
    assert (d.applied, d.chosen.replica_id) == ("least-load", "b")
    # One matched token's worth (block_size 1) is a match once the threshold is off.
    d = decide("prefix", cands(("a", 2, 1), ("b", 0, 0)), num_blocks=1, block_size=1, cfg=cfg)
    assert (d.applied, d.chosen.replica_id) == ("prefix", "a")
    assert decide("prefix", [], num_blocks=4, block_size=16, cfg=cfg).chosen is None


def test_session_choice_is_highest_random_weight_over_blake2b_64():
    """The session hash is a contract between router versions: during a rolling update old and
    new routers run side by side, and a session must land on the same replica under both. So
    the replica chosen is pinned to its definition: the highest 8-byte blake2b of
    "key NUL replica id" (a lowest-weight order, or another digest size, moves the sessions)."""
    import hashlib

    c = cands(*[(f"r{i}", 0, 0) for i in range(5)])

    def weight(key: str, rid: str) -> bytes:
        return hashlib.blake2b(f"{key}\x00{rid}".encode(), digest_size=8).digest()

    for key in (f"user-{i}" for i in range(50)):
        want = sorted((x.replica_id for x in c), key=lambda rid: weight(key, rid), reverse=True)
        assert [x.replica_id for x in rank_session(c, key)] == want
