"""Routing policies as pure functions: rank candidate replicas for one request, best first.

`prefix` scores each replica by `matched_fraction - load_weight * load / max_load`, after skipping
replicas whose load is far above the mean (so one popular system prompt cannot pile every request on
one replica); when no replica holds at least `min_match_tokens` of the prompt it falls back to
least-load. A block a replica holds only in host memory (offloaded) counts `host_weight` of a device
block in `matched_fraction`: restoring it is a copy, far cheaper than a prefill but not free, so a
device hit ranks above a host hit above a miss. `least-load`, `round-robin` and `session`
(rendezvous hash on a header value) ignore the index. `pd` (prefill/decode disaggregation,
service/router/pd.py) ranks the decode-capable replicas as `prefix` does. Every ranking lists all candidates, so the
router retries the next one when a replica fails.

A request for a LoRA adapter is ranked by the policy first, then `prefer_adapter` moves the
replicas holding the adapter to the front (adapter, then prefix, then load); when no holder can
take it (none, or all overloaded or `lora_spread_slack` busier than the least-loaded replica) and
the router may load the adapter, it names the replica to load it on: the best-ranked one that is
not overloaded."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

POLICIES = ("prefix", "least-load", "round-robin", "session", "pd")


class UnknownPolicyError(ValueError):
    """A policy name that is not one of POLICIES."""


@dataclass(slots=True)
class Candidate:
    """One routable replica as the router sees it for this request (not frozen: the router
    builds one per replica per request, and a frozen dataclass's __init__ is ~5x slower)."""

    replica_id: str
    url: str
    load: int = 0  # running + waiting requests (heartbeat, or this router's in-flight if larger)
    kv_cache_usage: float = 0.0
    matched_blocks: int = 0  # leading blocks of the prompt this replica already holds
    host_blocks: int = 0  # of those, the ones it holds only in its host-memory tier
    role: str = "both"  # prefill / decode / both (its heartbeat's role; --policy pd)


@dataclass(frozen=True)
class PolicyConfig:
    load_weight: float = 0.3  # how much a full relative load costs against a full prefix match
    overload_factor: float = 2.0  # skip replicas with load > factor * mean + slack ...
    overload_slack: int = 4  # ... the slack keeps small absolute loads from counting as overload
    kv_full: float = 0.98  # a replica whose KV cache is this full counts as overloaded
    min_match_tokens: int = 32  # below this predicted match, prefix routing is not worth it
    # A host-tier block's worth against a device block: a restore copies the block back (PCIe /
    # memcpy) instead of recomputing it, so it is worth most of a hit; the rest of the weight
    # keeps a device holder ahead of a host holder at equal load.
    host_weight: float = 0.7
    # A LoRA adapter's holder more than this many requests busier than the least-loaded replica
    # counts as busy: the adapter is loaded on a cooler replica (a load costs less than that
    # queue). 0: off, holders are left only when overloaded (docs/perf/router.md: spreading
    # early costs hit rate).
    lora_spread_slack: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.host_weight <= 1.0:
            raise ValueError(f"host_weight must be in [0, 1], got {self.host_weight}")


@dataclass(frozen=True)
class Decision:
    """A ranking plus why: the policy actually applied and the best predicted match."""

    ranking: tuple[Candidate, ...]
    policy: str  # the policy asked for
    applied: str  # what decided: "prefix", "least-load" (fallback), "round-robin", "session"

    @property
    def chosen(self) -> Candidate | None:
        return self.ranking[0] if self.ranking else None


def _rotation(cands: Sequence[Candidate], tiebreak: int) -> list[Candidate]:
    """Candidates sorted by id, then rotated by `tiebreak` so ties do not all pick the same one."""
    ordered = sorted(cands, key=lambda c: c.replica_id)
    if not ordered:
        return ordered
    k = tiebreak % len(ordered)
    return ordered[k:] + ordered[:k]


def rank_least_load(cands: Sequence[Candidate], tiebreak: int = 0) -> list[Candidate]:
    rotated = _rotation(cands, tiebreak)
    position = {c.replica_id: i for i, c in enumerate(rotated)}
    return sorted(rotated, key=lambda c: (c.load, c.kv_cache_usage, position[c.replica_id]))


def rank_round_robin(cands: Sequence[Candidate], counter: int) -> list[Candidate]:
    return _rotation(cands, counter)


def _rendezvous_weight(key: str, replica_id: str) -> bytes:
    return hashlib.blake2b(f"{key}\x00{replica_id}".encode(), digest_size=8).digest()


def rank_session(cands: Sequence[Candidate], session_key: str) -> list[Candidate]:
    """Highest-random-weight hashing: a key keeps its replica while that replica is in the set."""
    return sorted(cands, key=lambda c: _rendezvous_weight(session_key, c.replica_id), reverse=True)


def overloaded(cands: Sequence[Candidate], cfg: PolicyConfig) -> set[str]:
    """Ids of replicas whose load is far above the mean (or whose KV cache is full)."""
    if len(cands) < 2:
        return set()
    mean = sum(c.load for c in cands) / len(cands)
    limit = cfg.overload_factor * mean + cfg.overload_slack
    return {c.replica_id for c in cands if c.load > limit or c.kv_cache_usage >= cfg.kv_full}


def prefix_score(c: Candidate, num_blocks: int, max_load: int, cfg: PolicyConfig) -> float:
    worth = c.matched_blocks - (1.0 - cfg.host_weight) * c.host_blocks
    matched = worth / num_blocks if num_blocks else 0.0
    return matched - cfg.load_weight * (c.load / max_load if max_load else 0.0)


def rank_prefix(cands: Sequence[Candidate], num_blocks: int, block_size: int,
                cfg: PolicyConfig, tiebreak: int = 0) -> tuple[list[Candidate], str]:
    """Ranking by prefix score among non-overloaded replicas; the overloaded ones come last."""
    hot = overloaded(cands, cfg)
    usable = [c for c in cands if c.replica_id not in hot]
    if not usable:  # every replica is hot: rank them all, nothing spills
        usable, hot = list(cands), set()
    # By id, not `c not in usable`: that compares dataclasses pairwise (O(n^2), 5 ms at 256).
    spill = rank_least_load([c for c in cands if c.replica_id in hot], tiebreak)
    best = max((c.matched_blocks for c in usable), default=0)
    if best * block_size < max(cfg.min_match_tokens, 1):
        return rank_least_load(usable, tiebreak) + spill, "least-load"
    max_load = max(c.load for c in usable)
    position = {c.replica_id: i for i, c in enumerate(rank_least_load(usable, tiebreak))}
    ranked = sorted(usable, key=lambda c: (-prefix_score(c, num_blocks, max_load, cfg),
                                           position[c.replica_id]))
    return ranked + spill, "prefix"


def decide(policy: str, cands: Sequence[Candidate], *, num_blocks: int = 0, block_size: int = 16,
           cfg: PolicyConfig = PolicyConfig(), counter: int = 0,
           session_key: str | None = None) -> Decision:
    """Rank `cands` under `policy`; `counter` is the router's request counter (rotation, ties)."""
    if policy not in POLICIES:
        raise UnknownPolicyError(f"unknown routing policy {policy!r}; choose one of {POLICIES}")
    if policy in ("prefix", "pd"):  # pd: the caller passes the decode-capable replicas
        ranked, applied = rank_prefix(cands, num_blocks, block_size, cfg, counter)
    elif policy == "round-robin":
        ranked, applied = rank_round_robin(cands, counter), policy
    elif policy == "session" and session_key:
        ranked, applied = rank_session(cands, session_key), policy
    else:  # least-load, or session without a key
        ranked, applied = rank_least_load(cands, counter), "least-load"
    return Decision(tuple(ranked), policy, applied)


def prefer_adapter(ranking: Sequence[Candidate], holders: set[str] | frozenset[str],
                   cfg: PolicyConfig = PolicyConfig(), can_load: bool = True
                   ) -> tuple[list[Candidate], Candidate | None]:
    """`ranking` (a policy's, best first) with the adapter's holders that are not overloaded in
    front, in their order; then the replica to load the adapter on, or None. A load is asked for
    when no holder is usable and `can_load` (the router knows the adapter's source): the best
    ranked replica that is not overloaded goes first and is returned. Without `can_load` the
    holders lead even when overloaded (any other replica would answer 404)."""
    hot = overloaded(ranking, cfg)
    if can_load and ranking and cfg.lora_spread_slack > 0:
        floor = min(c.load for c in ranking)
        hot |= {c.replica_id for c in ranking if c.load - floor > cfg.lora_spread_slack}
    usable = [c for c in ranking if c.replica_id in holders and c.replica_id not in hot]
    if not usable and not can_load:
        usable = [c for c in ranking if c.replica_id in holders]
    if usable or not can_load:
        first = {c.replica_id for c in usable}
        return usable + [c for c in ranking if c.replica_id not in first], None
    cool = [c for c in ranking if c.replica_id not in hot] or list(ranking)
    if not cool:
        return [], None
    target = cool[0]
    return [target] + [c for c in ranking if c.replica_id != target.replica_id], target
