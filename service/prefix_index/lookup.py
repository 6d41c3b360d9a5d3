"""The router's side of the prefix index: which live replica holds how much of a hash chain.

Lookup is ONE round trip: a Lua script (EVALSHA, `LOOKUP_SCRIPT`) gets the prompt's hash chain,
walks the live replicas and returns, per replica, its heartbeat fields and the number of LEADING
blocks of the chain it holds in either tier, and how many of those are only in its host tier (one
SMISMEMBER per replica and block set). A leading block counts as held when it is in the device set
or the host set; one in both counts as a device block (no copy needed). The router thus learns
liveness, load and prefix match at once. The script reads keys it derives from the prefix; on a
Redis Cluster they share the prefix's hash-tag slot, and the declared key (`replicas`) routes the
script to the node owning it. The key layout is in service/prefix_index/keys.py.

Anything in Redis may be garbage (a bug, an operator's typo, a hostile writer): a key of the wrong
type counts as "holds nothing" inside the scripts (redis.pcall), and a heartbeat that does not parse
is skipped and reported in `IndexScan.malformed`, never raised to the router.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from kvserve.service.prefix_index.keys import IndexKeys
from kvserve.service.prefix_index.redis_client import async_redis
from kvserve.service.prefix_index.replica_info import (INFO_FIELDS, MalformedHeartbeatError,
                                                       ReplicaInfo)

# Both scripts take ARGV[1]: key prefix; ARGV[2]: the chain as ONE string of 32-hex-digit hashes
# (one argument instead of one per block: cheaper to encode and send). They share this prelude
# (split the chain) and a function giving a replica's leading matched blocks and, of those, how many
# only its host tier holds.
_LUA_PRELUDE = """
local prefix = ARGV[1]
local blob = ARGV[2] or ''
local n = math.floor(#blob / 32)
local hashes = {}
for i = 1, n do hashes[i] = string.sub(blob, (i - 1) * 32 + 1, i * 32) end
local function members(key)
  local flags = redis.pcall('SMISMEMBER', key, unpack(hashes))
  if flags.err then return {} end  -- not a set: garbage holds nothing
  return flags
end
local function leading_matched(id)
  if n == 0 then return 0, 0 end
  local device = members(prefix .. 'blocks:' .. id)
  local host = members(prefix .. 'blocks_host:' .. id)
  local matched, on_host = 0, 0
  for i = 1, n do
    if device[i] == 1 then matched = i
    elseif host[i] == 1 then matched = i; on_host = on_host + 1
    else break end
  end
  return matched, on_host
end
local out = {}
"""
# Per live replica: id, leading matched blocks, host-only ones among them, then its heartbeat fields
# in INFO_FIELDS order
# (the router's once-a-second refresh). Replicas whose heartbeat expired are swept.
# A heartbeat key of another type yields empty fields, which the parser rejects.
LOOKUP_SCRIPT = _LUA_PRELUDE + """
for _, id in ipairs(redis.call('SMEMBERS', prefix .. 'replicas')) do
  local key = prefix .. 'replica:' .. id
  if redis.call('EXISTS', key) == 0 then
    redis.call('SREM', prefix .. 'replicas', id)
  else
    local info = redis.pcall('HMGET', key, %s)
    if info.err then info = {} end
    local matched, on_host = leading_matched(id)
    out[#out + 1] = id
    out[#out + 1] = matched
    out[#out + 1] = on_host
    for i = 1, %d do out[#out + 1] = info[i] or '' end
  end
end
return out
""" % (", ".join(f"'{f}'" for f in INFO_FIELDS), len(INFO_FIELDS))
# The per-request hot path: id, matched, host-only, id, ... for the live replicas (liveness by the
# heartbeat key's existence), without the heartbeat fields the router already holds.
MATCH_SCRIPT = _LUA_PRELUDE + """
for _, id in ipairs(redis.call('SMEMBERS', prefix .. 'replicas')) do
  if redis.call('EXISTS', prefix .. 'replica:' .. id) == 0 then
    redis.call('SREM', prefix .. 'replicas', id)
  else
    local matched, on_host = leading_matched(id)
    out[#out + 1] = id
    out[#out + 1] = matched
    out[#out + 1] = on_host
  end
end
return out
"""
HASH_HEX_LEN = 32  # engine.block_hash: blake2b-128 as hex

# Lua's unpack() is limited by the C stack (~8000 values); longer chains are cut (a 128k-token
# prompt at block size 16), which only makes the predicted match conservative.
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

    @property
    def device_blocks(self) -> int:
        return self.matched_blocks - self.host_blocks


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

    async def scan(self, hashes: Sequence[str] = ()) -> IndexScan:
        """`lookup`, plus the entries left out as malformed and why."""
        flat = await self._call(self._script, hashes)
        stride = 3 + len(INFO_FIELDS)
        matches, malformed = [], []
        for i in range(0, len(flat) - stride + 1, stride):
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
        """{replica id: leading matched blocks, either tier} of every live replica."""
        return {rid: matched for rid, (matched, _) in (await self.match_tiers(hashes)).items()}

    async def match_tiers(self, hashes: Sequence[str]) -> dict[str, tuple[int, int]]:
        """{replica id: (leading matched blocks, host-only ones among them)} of every live
        replica, in one round trip: the router's per-request call (it knows the replicas'
        heartbeat fields from `replicas()`)."""
        flat = await self._call(self._match_script, hashes)
        return {_s(flat[i]): (int(flat[i + 1]), int(flat[i + 2]))
                for i in range(0, len(flat) - 2, 3)}

    async def _call(self, script: Any, hashes: Sequence[str]) -> Any:
        chain = list(hashes)[:MAX_LOOKUP_BLOCKS]
        blob = "".join(chain)
        if len(blob) != HASH_HEX_LEN * len(chain):
            raise ValueError("block hashes must be 32-hex-digit strings from engine.block_hash")
        args = [self.keys.prefix, blob]
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

