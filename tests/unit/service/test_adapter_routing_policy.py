"""LoRA adapter affinity on top of a policy's ranking (routing_policy.prefer_adapter): holders
first, then prefix, then load; the replica to load an adapter nobody usable holds."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvserve.service.routing_policy import Candidate, PolicyConfig, decide, prefer_adapter

CFG = PolicyConfig(load_weight=0.3, overload_factor=2.0, overload_slack=4, min_match_tokens=32)


def cands(*specs: tuple[str, int, int]) -> list[Candidate]:
    """(id, load, matched_blocks) triples."""
    return [Candidate(rid, f"http://{rid}", load, 0.0, matched) for rid, load, matched in specs]


def ids(ranking) -> list[str]:
    return [c.replica_id for c in ranking]


def test_holders_come_first_in_the_policys_order_then_the_rest():
    ranked = decide("prefix", cands(("a", 0, 10), ("b", 1, 0), ("c", 2, 0), ("d", 0, 0)),
                    num_blocks=12, cfg=CFG).ranking
    assert ids(ranked)[0] == "a"  # the prefix holder, without adapters
    out, load_on = prefer_adapter(ranked, {"c", "b"}, CFG)
    # b and c hold the adapter: b (less loaded) before c; a's prefix match comes after them.
    assert ids(out) == ["b", "c", "a", "d"] and load_on is None


def test_among_holders_the_prefix_match_wins():
    ranked = decide("prefix", cands(("a", 0, 0), ("b", 1, 10), ("c", 0, 0)), num_blocks=12,
                    cfg=CFG).ranking
    out, _ = prefer_adapter(ranked, {"a", "b"}, CFG)
    assert ids(out)[:2] == ["b", "a"]


def test_no_holder_loads_on_the_least_loaded():
    ranked = decide("least-load", cands(("a", 3, 0), ("b", 1, 0), ("c", 2, 0))).ranking
    out, load_on = prefer_adapter(ranked, set(), CFG)
    assert load_on is not None and load_on.replica_id == "b" and ids(out)[0] == "b"
    assert sorted(ids(out)) == ["a", "b", "c"]  # every replica stays in the ranking


def test_only_overloaded_holders_spread_the_adapter_to_a_cool_replica():
    ranked = decide("least-load", cands(("a", 40, 0), ("b", 1, 0), ("c", 2, 0))).ranking
    out, load_on = prefer_adapter(ranked, {"a"}, CFG)
    assert load_on.replica_id == "b" and ids(out) == ["b", "c", "a"]


def test_an_unloadable_adapter_stays_on_its_holders_even_overloaded():
    ranked = decide("least-load", cands(("a", 40, 0), ("b", 1, 0), ("c", 2, 0))).ranking
    out, load_on = prefer_adapter(ranked, {"a"}, CFG, can_load=False)
    assert load_on is None and ids(out)[0] == "a"
    out, load_on = prefer_adapter(ranked, set(), CFG, can_load=False)  # unknown: policy order
    assert load_on is None and ids(out) == ids(ranked)


def test_no_candidates():
    assert prefer_adapter([], set(), CFG) == ([], None)


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 8), st.booleans()), min_size=1,
                max_size=12), st.booleans())
def test_the_ranking_is_a_permutation_led_by_a_holder_or_the_load_target(specs, can_load):
    cs = [Candidate(f"r{i}", f"http://r{i}", load, 0.0, m) for i, (load, m, _) in
          enumerate(specs)]
    holders = {f"r{i}" for i, (_, _, held) in enumerate(specs) if held}
    ranked = decide("prefix", cs, num_blocks=8, cfg=CFG).ranking
    out, load_on = prefer_adapter(ranked, holders, CFG, can_load)
    assert sorted(ids(out)) == sorted(ids(ranked))
    if load_on is not None:
        assert can_load and out[0] is load_on and load_on.replica_id not in holders
    elif holders:
        assert out[0].replica_id in holders


def test_a_holder_far_busier_than_the_least_loaded_replica_spreads_the_adapter():
    cfg = PolicyConfig(lora_spread_slack=3)
    ranked = decide("least-load", cands(("a", 5, 0), ("b", 1, 0), ("c", 2, 0))).ranking
    out, load_on = prefer_adapter(ranked, {"a"}, cfg)  # 5 - 1 > 3: load it on b
    assert load_on.replica_id == "b" and ids(out)[0] == "b"
    out, load_on = prefer_adapter(ranked, {"a"}, PolicyConfig(lora_spread_slack=4))
    assert load_on is None and ids(out)[0] == "a"  # 5 - 1 = 4: still worth the wait
