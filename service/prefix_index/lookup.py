"""The router's side of the prefix index: which live replica holds how much of a hash chain.

Each routing decision is ONE round trip: `match_tiers` runs MATCH_SCRIPT (scripts.py), which walks
the prompt's hash chain through the inverted index and returns, per live replica holding its first
block, the number of LEADING blocks it holds in either tier and how many of those only its host
tier holds (a block in both counts as a device block: no copy needed). The router's
once-a-second `scan` (LOOKUP_SCRIPT) reads every live replica's heartbeat and takes a bounded
share of dead replicas' entries out of the index. The key layout is in keys.py.

Anything in Redis may be garbage (a bug, an operator's typo, a hostile writer): a key of the wrong
type counts as "holds nothing" inside the scripts (redis.pcall), and a heartbeat that does not parse
is skipped and reported in `IndexScan.malformed`, never raised to the router.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from kvserve.service.prefix_index.keys import IndexKeys
from kvserve.service.prefix_index.redis_client import async_redis
from kvserve.service.prefix_index.replica_info import (INFO_FIELDS, MalformedHeartbeatError,
                                                       ReplicaInfo)
from kvserve.service.prefix_index.scripts import (LOOKUP_SCRIPT, MATCH_SCRIPT, SWEEP_BUDGET,
                                                  chain_blob)

# A lookup walks at most this many blocks (112k tokens at block size 16), which bounds its time on
# Redis's one thread; a longer chain is cut, which only makes the predicted match conservative.
MAX_LOOKUP_BLOCKS = 7000


@dataclass(frozen=True)
class IndexScan:
    """The live replicas' heartbeats, and the entries that were not heartbeats a replica writes
    (id, reason)."""

    matches: list[ReplicaMatch]
    malformed: list[tuple[str, str]]


@dataclass(frozen=True)
class ReplicaMatch:
    """A live replica and how many leading blocks of the looked-up chain it holds (either tier),
    `host_blocks` of them only in host memory."""

    replica: ReplicaInfo
    matched_blocks: int
    host_blocks: int = 0


def _s(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class PrefixIndex:
    """Router-side reader: which live replica holds how much of a hash chain, in one round trip."""

    def __init__(self, client: aioredis.Redis, service: str) -> None:
        self.client = client
        self.keys = IndexKeys(service)
        self._script = client.register_script(LOOKUP_SCRIPT)
        self._match_script = client.register_script(MATCH_SCRIPT)

    @classmethod
    def from_url(cls, redis_url: str, service: str, timeout: float = 0.5) -> PrefixIndex:
        """The index at `redis_url` (password from the URL, else KVSERVE_REDIS_PASSWORD)."""
        return cls(async_redis(redis_url, timeout), service)

    async def lookup(self, hashes: Sequence[str]) -> list[ReplicaMatch]:
        """Every live replica with its leading matched block count (raises RedisError); entries
        that are not valid heartbeats are left out."""
        return (await self.scan(hashes)).matches

    async def scan(self, hashes: Sequence[str] = (), sweep: int = SWEEP_BUDGET) -> IndexScan:
        """`lookup`, plus the entries left out as malformed and why. Also moves replicas whose
        heartbeat expired to `dead` and takes up to `sweep` of dead replicas' block entries out of
        the index (every router's once-a-second refresh does this)."""
        flat = await self._call(self._script, hashes, str(sweep))
        stride = 3 + len(INFO_FIELDS)
        matches, malformed = [], []
        for n, i in enumerate(range(0, len(flat) - stride + 1, stride)):
            if n and n % 32 == 0:
                # Parsing 256 heartbeats takes ~4 ms: let the router's requests in meanwhile.
                await asyncio.sleep(0)
            rid = _s(flat[i])
            try:
                if "\ufffd" in rid or not rid.isprintable() or len(rid) > 253:
                    raise MalformedHeartbeatError("the id is not a printable UTF-8 name")
                info = ReplicaInfo.from_fields(rid, flat[i + 3 : i + stride])
            except ValueError as exc:  # MalformedHeartbeatError, UnicodeDecodeError
                malformed.append((rid, str(exc)))
                continue
            matches.append(ReplicaMatch(info, int(flat[i + 1]), int(flat[i + 2])))
        return IndexScan(sorted(matches, key=lambda m: m.replica.replica_id), malformed)

    async def match_counts(self, hashes: Sequence[str]) -> dict[str, int]:
        """{replica id: leading matched blocks, either tier} of the live replicas holding at
        least the chain's first block."""
        return {rid: matched for rid, (matched, _) in (await self.match_tiers(hashes)).items()}

    async def match_tiers(self, hashes: Sequence[str]) -> dict[str, tuple[int, int]]:
        """{replica id: (leading matched blocks, host-only ones among them)} of the live replicas
        holding at least the chain's first block, in one round trip: the router's per-request
        call (it knows every live replica and its heartbeat fields from `scan`)."""
        flat = await self._call(self._match_script, hashes)
        return {_s(flat[i]): (int(flat[i + 1]), int(flat[i + 2]))
                for i in range(0, len(flat) - 2, 3)}

    async def _call(self, script: Any, hashes: Sequence[str], *extra: str) -> Any:
        args = [self.keys.prefix, chain_blob(list(hashes)[:MAX_LOOKUP_BLOCKS]), *extra]
        keys = [self.keys.replicas]  # a declared key routes the script to its Cluster node
        try:
            return await script(keys=keys, args=args)
        except RedisConnectionError:
            # A pooled connection from before a Redis restart fails once; a fresh one may not.
            return await script(keys=keys, args=args)

    async def replicas(self) -> list[ReplicaInfo]:
        return [m.replica for m in await self.lookup([])]

    async def close(self) -> None:
        await self.client.aclose()

