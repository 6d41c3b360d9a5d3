"""In-flight requests shared between the routers of one service, through Redis.

Each router counts the requests it has in flight on each replica; alone, it sees only its own
share. Replica heartbeats carry the true load but arrive once a second and are re-read once a
second, so with N routers behind one Service each decides on a view up to ~2 s old plus 1/N of
the recent traffic, and they herd: all send the same tenant's burst to the replica that holds its
prefix, and the overload check trips N times too late (docs/perf.md, "Several routers").

So every router publishes its own in-flight counts, a hash `router_inflight:<router id>` with a
TTL (a router that dies stops counting within `ttl`), listed in the set `routers`; a background
task writes them when they changed (at most every `interval`) and reads the other routers' sums
with one small script every `interval`. None of this is on a request's path: a routing decision
still makes ONE Redis round trip (the prefix lookup) and reads the sums from memory. The keys
carry the service in a hash tag, `kvserve:{<service>}:...`, so a script touching them stays in
one Redis Cluster slot.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
from typing import Any

from redis.exceptions import RedisError

from kvserve.service.bounded import stop_task, within

logger = logging.getLogger("kvserve.router")

# KEYS[1]: the set of router ids; ARGV[1]: key prefix of the per-router hashes; ARGV[2]: this
# router's id (left out of the sums). Ids whose hash expired are dropped from the set.
_SUM_OTHERS = """
local ids = redis.call('SMEMBERS', KEYS[1])
local sums = {}
for _, id in ipairs(ids) do
  if id ~= ARGV[2] then
    local fields = redis.pcall('HGETALL', ARGV[1] .. id)
    if type(fields) ~= 'table' or #fields == 0 then
      if redis.call('EXISTS', ARGV[1] .. id) == 0 then redis.call('SREM', KEYS[1], id) end
    else
      for i = 1, #fields, 2 do
        sums[fields[i]] = (sums[fields[i]] or 0) + (tonumber(fields[i + 1]) or 0)
      end
    end
  end
end
local out = {}
for replica, n in pairs(sums) do out[#out + 1] = replica; out[#out + 1] = n end
return out
"""


CLOSE_TIMEOUT_S = 2.0  # the most close() waits for each of its steps


def router_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class SharedInflight:
    """This router's in-flight counts out to Redis, the other routers' sums back."""

    def __init__(self, client: Any, service: str, own: dict[str, int], interval: float = 0.1,
                 ttl: float = 3.0, rid: str | None = None) -> None:
        if not interval > 0:
            raise ValueError(f"the shared load interval must be positive, got {interval}")
        self.client, self.interval, self.ttl = client, interval, max(ttl, 3 * interval)
        self.router_id = rid or router_id()
        tag = f"kvserve:{{{service}}}:"
        self.routers_key, self.hash_prefix = tag + "routers", tag + "router_inflight:"
        self.others: dict[str, int] = {}  # replica id -> the other routers' requests in flight
        self._own = own  # the router's live counts (ReplicaSet.inflight), read when writing
        self._dirty = True
        self._task: asyncio.Task | None = None
        self._script: Any = None
        self._closing = False

    def changed(self) -> None:
        """This router's counts changed: the next write sends them."""
        self._dirty = True

    def start(self) -> None:
        self._script = self.client.register_script(_SUM_OTHERS)
        self._task = asyncio.create_task(self._loop(), name="kvserve-shared-inflight")

    async def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stop the loop and leave the set of routers; bounded by about 2 x `timeout` even when
        Redis does not answer or a library swallows the cancellation (issue 41: a router hung
        13 minutes in "Waiting for application shutdown" on this loop)."""
        self._closing = True
        if self._task is not None:
            await stop_task(self._task, timeout)
            self._task = None
        leave = self.client.pipeline(transaction=False).delete(  # now rather than after the TTL
            self.hash_prefix + self.router_id).srem(self.routers_key, self.router_id).execute()
        await within(leave, timeout, "leaving the routers' shared load")

    async def _loop(self) -> None:
        since_write = 0.0
        failing = False
        while not self._closing:
            try:
                if self._dirty or since_write >= self.ttl / 3:
                    await self.write()
                    since_write = 0.0
                await self.read()
                failing = False
            except (RedisError, OSError) as exc:
                if self._closing or _cancelling():  # a cancellation turned into an error
                    raise asyncio.CancelledError from exc
                if not failing:
                    logger.warning("shared in-flight counts unavailable (%s); each router "
                                   "counts only its own until Redis answers", exc)
                failing = True
                self.others = {}
            await asyncio.sleep(self.interval)
            since_write += self.interval

    async def write(self) -> None:
        own, self._dirty = {rid: n for rid, n in self._own.items() if n > 0}, False
        key = self.hash_prefix + self.router_id
        # No MULTI: a Redis Cluster pipeline may not support it, and a reader that sees the hash
        # between DEL and HSET only counts this router as idle for one interval.
        pipe = self.client.pipeline(transaction=False).delete(key)
        if own:
            pipe.hset(key, mapping=own)
        await (pipe.pexpire(key, int(self.ttl * 1000)).sadd(self.routers_key, self.router_id)
               .pexpire(self.routers_key, int(self.ttl * 4000)).execute())

    async def read(self) -> None:
        flat = await self._script(keys=[self.routers_key],
                                  args=[self.hash_prefix, self.router_id])
        self.others = {_text(flat[i]): int(flat[i + 1]) for i in range(0, len(flat) - 1, 2)}


def _cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
