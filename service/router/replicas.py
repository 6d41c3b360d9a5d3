"""The replicas a router can send to, and how much of a prompt each one holds.

Replicas come from Redis heartbeats (service/prefix_index/), re-read every `refresh_interval`, or
from a static `--replicas url,url`. Without Redis the last known set stays routable (by load
alone), and a refresh is also how the router notices Redis came back; if it comes back without any
heartbeat (they expired during a failover), the last known set stays until the replicas
re-register. A replica that fails is kept out of routing for `down_cooldown` seconds.

Heartbeats are not trusted blindly: a malformed one, one without a valid signature when the router
holds a registration token, a signed one whose timestamp is more than `heartbeat_max_age` off the
router's clock (a replayed heartbeat), and one that says the replica is draining are left out of
routing (logged once per replica and reason).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from redis.exceptions import RedisError

from kvserve.service.prefix_index.lookup import IndexScan, PrefixIndex, ReplicaMatch
from kvserve.service.prefix_index.redis_client import async_redis
from kvserve.service.prefix_index.replica_info import ReplicaInfo
from kvserve.service.router.config import RouterConfig
from kvserve.service.router.metrics import RouterMetrics
from kvserve.service.bounded import stop_task, within
from kvserve.service.router.shared_load import CLOSE_TIMEOUT_S, SharedInflight
from kvserve.service.routing_policy import Candidate

logger = logging.getLogger("kvserve.router")
_NO_MATCH = (0, 0)

# Seconds after Redis becomes reachable during which an index without any heartbeat keeps the
# replicas known before (replicas heartbeat every second and re-register within one beat).
REREGISTER_GRACE = 10.0


class ReplicaSet:
    """Known replicas, which are down, each one's requests in flight, and the prefix lookup."""

    def __init__(self, cfg: RouterConfig, metrics: RouterMetrics) -> None:
        self.cfg, self.metrics = cfg, metrics
        self.index = PrefixIndex.from_url(cfg.redis_url, cfg.service_name, cfg.redis_timeout) \
            if cfg.redis_url else None
        self.redis_up = False
        self._had_outage = False
        self._reachable_since = -REREGISTER_GRACE  # when Redis came back from an outage
        self.known: dict[str, ReplicaInfo] = self._static()
        self.ignored: set[str] = set()  # ids in Redis left out of routing (see `_admit`)
        self._logged: dict[str, str] = {}  # id -> the reason last logged for leaving it out
        self.inflight: dict[str, int] = {}
        # The other routers' in-flight counts (service/router/shared_load.py), None when alone.
        self.shared = SharedInflight(async_redis(cfg.redis_url, cfg.redis_timeout),
                                     cfg.service_name, self.inflight, cfg.shared_load_interval) \
            if cfg.redis_url and cfg.shared_load_interval > 0 else None
        self.down_until: dict[str, float] = {}
        self._task: asyncio.Task | None = None
        self._pending_refresh: asyncio.Task | None = None

    def _static(self) -> dict[str, ReplicaInfo]:
        return {u: ReplicaInfo(u, u, "", self.cfg.block_size) for u in self.cfg.replicas}

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        if self.index is not None:
            await self.refresh()
            self._task = asyncio.create_task(self._refresh_loop())
        if self.shared is not None:
            self.shared.start()

    async def close(self) -> None:
        """Stop the loops and close Redis; each step bounded (service/bounded.py), so a Redis
        or a replica that is gone never holds the router's shutdown."""
        for task in (self._task, self._pending_refresh):
            if task is not None:
                await stop_task(task, CLOSE_TIMEOUT_S)
        if self.index is not None:
            await within(self.index.close(), CLOSE_TIMEOUT_S, "closing the prefix index")
        if self.shared is not None:
            await self.shared.close()
            await within(self.shared.client.aclose(), CLOSE_TIMEOUT_S, "closing Redis")

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.refresh_interval)
            await self.refresh()
            if asyncio.current_task().cancelling():  # refresh() took it for a Redis error
                raise asyncio.CancelledError

    async def refresh(self) -> None:
        """Re-read the live replica set; this is also how the router notices Redis came back."""
        assert self.index is not None
        try:
            scan = await self.index.scan()
        except (RedisError, OSError) as exc:
            self._redis_failed(exc)
            return
        self._redis_ok(self._admit(scan))

    def _admit(self, scan: IndexScan) -> dict[str, ReplicaInfo]:
        """The routable heartbeats of a scan; the others go to `ignored`, logged once."""
        token = self.cfg.registration_token
        reasons = {rid: f"malformed heartbeat ({why})" for rid, why in scan.malformed}
        known: dict[str, ReplicaInfo] = {}
        now = time.time()
        for info in (m.replica for m in scan.matches):
            if token and not info.signed_by(token):
                reasons[info.replica_id] = ("heartbeat unsigned or signed with another "
                                            "registration token (KVSERVE_REGISTRATION_TOKEN)")
            elif token and abs(now - info.heartbeat_at) > self.cfg.heartbeat_max_age:
                # The signature covers the timestamp, so an old signed heartbeat written back
                # (a replay keeping a dead replica routable) is stale here.
                reasons[info.replica_id] = (
                    f"signed heartbeat is {now - info.heartbeat_at:+.0f} s off this router's "
                    f"clock (a replay, or clocks apart; --heartbeat-max-age "
                    f"{self.cfg.heartbeat_max_age:g})")
            elif info.draining:
                reasons[info.replica_id] = "draining"
            else:
                known[info.replica_id] = info
        for rid, reason in reasons.items():
            if self._logged.get(rid) != reason:
                level = logging.INFO if reason == "draining" else logging.WARNING
                logger.log(level, "replica %r left out of routing: %s", rid[:80], reason)
        self._logged = reasons
        self.ignored = set(reasons)
        self.metrics.replicas_ignored.set(len(reasons))
        return known

    def _redis_failed(self, exc: BaseException) -> None:
        self.metrics.redis_errors.inc()
        self._had_outage = True
        if self.redis_up:
            logger.warning("Redis failed (%s: %s): routing by least load over %d known replicas",
                           type(exc).__name__, exc, len(self.known))
        self.redis_up = False
        self.update_gauges()

    def _redis_ok(self, known: dict[str, ReplicaInfo]) -> None:
        now = time.monotonic()
        if not self.redis_up:
            logger.info("Redis reachable: %d live replicas", len(known))
            if self._had_outage:  # back from an outage, not starting up
                self._reachable_since = now
        self.redis_up = True
        if not known and self.known and now - self._reachable_since < REREGISTER_GRACE:
            # Back from an outage (a failover, a restart) with no heartbeat: they expired while
            # the replicas could not write. They re-register within a heartbeat; until then the
            # replicas known before the outage are better than none (503s).
            self.update_gauges()
            return
        # No heartbeat at all but static replicas configured: keep those rather than nothing.
        self.known = known or self._static()
        self.update_gauges()

    def update_gauges(self) -> None:
        self.metrics.redis_up.set(1 if self.redis_up else 0)
        self.metrics.replicas_up.set(len(self.routable()))

    # ---- what routing reads ------------------------------------------------------------------
    def routable(self, infos: Sequence[ReplicaInfo] | None = None) -> list[ReplicaInfo]:
        """`infos` (default: every known replica) less those marked down."""
        now = time.monotonic()
        infos = list(self.known.values()) if infos is None else infos
        return [i for i in infos if self.down_until.get(i.replica_id, 0.0) <= now]

    def is_down(self, replica_id: str) -> bool:
        return self.down_until.get(replica_id, 0.0) > time.monotonic()

    def mark_down(self, replica_id: str) -> None:
        self.down_until[replica_id] = time.monotonic() + self.cfg.down_cooldown
        self.update_gauges()

    def acquire(self, replica_id: str) -> None:
        self.inflight[replica_id] = self.inflight.get(replica_id, 0) + 1
        if self.shared is not None:
            self.shared.changed()

    def release(self, replica_id: str) -> None:
        self.inflight[replica_id] = max(0, self.inflight.get(replica_id, 1) - 1)
        if self.shared is not None:
            self.shared.changed()

    def candidate(self, info: ReplicaInfo, matched_blocks: int, host_blocks: int = 0) -> Candidate:
        """The replica as the policy sees it: its load is the larger of its heartbeat's (up to
        ~2 s old) and the requests every router of the service has in flight on it now
        (`candidates` inlines the same formula)."""
        rid = info.replica_id
        others = self.shared.others.get(rid, 0) if self.shared is not None else 0
        load = max(info.load, self.inflight.get(rid, 0) + others)
        return Candidate(info.replica_id, info.url, load, info.kv_cache_usage, matched_blocks,
                         host_blocks, info.role)

    def announced_model(self) -> str | None:
        """The model a replica announced (the router's tokenizer by default)."""
        return next((i.model for i in self.known.values() if i.model), None)

    def block_size(self) -> int:
        """The block size most replicas announce (the configured one for static replicas)."""
        sizes = [i.block_size for i in self.known.values() if i.model]
        return max(set(sizes), key=sizes.count) if sizes else self.cfg.block_size

    def candidates(self, counts: dict[str, tuple[int, int]]) -> list[Candidate]:
        """Every routable replica as a Candidate, `counts` {id: (matched, host-only)} giving the
        matched blocks (absent: 0); every known replica when all are marked down. One pass: this
        runs per request over the whole fleet."""
        now = time.monotonic()
        down, inflight = self.down_until, self.inflight
        others = self.shared.others if self.shared is not None else {}
        out, downs = [], []
        for rid, info in self.known.items():
            matched, host = counts.get(rid, _NO_MATCH)
            # `candidate`'s load, inlined: a method call per replica costs ~10% of a decision
            load = max(info.load, inflight.get(rid, 0) + others.get(rid, 0))
            cand = Candidate(rid, info.url, load, info.kv_cache_usage, matched, host, info.role)
            (downs if down and down.get(rid, 0.0) > now else out).append(cand)
        return out or downs

    async def match_counts(self, hashes: list[str]) -> dict[str, tuple[int, int]]:
        """{replica id: (leading matched blocks, host-only ones)} in one Redis round trip; {} when
        Redis is down (counted as an outage), unused or the chain empty.

        Redis names only the live replicas holding the chain's first block; the replica set and
        their heartbeat fields (URL, load) come from `refresh`, every second.
        """
        if self.index is None or not self.redis_up or not hashes:
            return {}
        try:
            counts = await self.index.match_tiers(hashes)
        except (RedisError, OSError) as exc:
            self._redis_failed(exc)
            return {}
        new = any(rid not in self.known and rid not in self.ignored for rid in counts)
        if new and self._pending_refresh is None:
            self._pending_refresh = asyncio.create_task(self._refresh_now())
        return counts

    async def lookup(self, hashes: list[str]) -> list[ReplicaMatch]:
        """Every known replica with its matched blocks (`match_counts`)."""
        counts = await self.match_counts(hashes)
        return [ReplicaMatch(info, *counts.get(rid, _NO_MATCH))
                for rid, info in self.known.items()]

    async def _refresh_now(self) -> None:
        """A replica joined since the last refresh: learn its URL and load now."""
        try:
            await self.refresh()
        finally:
            self._pending_refresh = None
