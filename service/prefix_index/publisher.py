"""The replica's side of the prefix index: block events and heartbeats to Redis, off the engine.

The publisher never slows generation: `on_step` (engine thread) only appends to a bounded queue
under a lock and wakes a writer task on the server's event loop. Events that cannot be written
(queue full, Redis down) are dropped and counted; after (re)connecting, `wants_snapshot()` turns
True, the engine thread passes `snapshot=engine.cached_block_hashes()` (and `host_snapshot=` the
host tier's) and the writer replaces both tiers' entries (a bounded clear, then the snapshot in
chunks). Until the engine steps again (an idle replica), the entries may be stale or empty.

Every write is an UPDATE_SCRIPT call (scripts.py) that changes the replica's own set and the
inverted index together, up to WRITE_CHUNK hashes a call: one round trip per flush in the steady
state. The key layout is in keys.py.

Events carry their tier (`KVEvent.medium`): device-pool events go to `blocks:<id>` (holder code
2*slot), host-tier events to `blocks_host:<id>` (2*slot+1), so a block demoted to host memory
leaves the first (the pool's "removed") and joins the second (the tier's "stored"), and a router
can weigh the two. Disk-tier events are not published: a disk hit is close enough to a miss for
routing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from kvserve.service.prefix_index.keys import IndexKeys
from kvserve.service.prefix_index.redis_client import async_redis, redact_url
from kvserve.service.prefix_index.replica_info import (ADAPTERS_FIELD, REGISTRATION_TOKEN_ENV,
                                                       ROLE_BOTH, ROLE_FIELD, ROLES,
                                                       SIGNATURE_FIELD, encode_adapters,
                                                       sign_heartbeat)
from kvserve.service.prefix_index.scripts import (CLEAR_SCRIPT, SWEEP_BUDGET, UPDATE_SCRIPT,
                                                  write_calls)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Batch:
    kind: str  # "stored" | "removed" | "cleared" | "snapshot"
    hashes: tuple[str, ...]
    medium: str = "device"  # "device" | "host": which of the replica's sets it changes


PUBLISHED_MEDIA = ("device", "host")


class PrefixIndexPublisher:
    """Replica-side writer: block events and heartbeats to Redis, off the engine's step loop."""

    def __init__(self, redis_url: str, service: str, replica_id: str, url: str, model: str,
                 block_size: int, heartbeat_interval: float = 1.0, *,
                 max_pending_hashes: int = 200_000, ttl: float | None = None,
                 timeout: float = 0.5, registration_token: str | None = None,
                 adapters: Callable[[], Iterable[str]] | None = None,
                 role: str = ROLE_BOTH) -> None:
        if role not in ROLES:
            raise ValueError(f"replica role {role!r} is not one of {', '.join(ROLES)}")
        self.redis_url, self.replica_id, self.url = redis_url, replica_id, url
        self.role = role  # prefill / decode / both: routers with --policy pd read it
        # The LoRA adapters resident now, read at each heartbeat (None: a replica without LoRA).
        self._adapters = adapters
        self._last_adapters = "[]"
        # Signs each heartbeat so routers holding the same token accept this replica.
        self._token = registration_token or os.environ.get(REGISTRATION_TOKEN_ENV) or None
        self.model, self.block_size = model, block_size
        self.heartbeat_interval = heartbeat_interval
        self.ttl = ttl if ttl is not None else max(3.0 * heartbeat_interval, 2.0)
        self.keys = IndexKeys(service)
        self.max_pending_hashes = max_pending_hashes
        self._timeout = timeout
        self._lock = threading.Lock()
        self._pending: deque[_Batch] = deque()
        self._pending_hashes = 0
        self._load = (0, 0, 0.0)
        self._want_snapshot = True
        self._connected = False
        self._first_connect = True
        self._dropped = 0
        self._stopping = False
        self._redis_errors = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._client: aioredis.Redis | None = None

    # ---- engine thread side -------------------------------------------------------------------
    def on_step(self, events: Iterable[Any], stats: Any = None,
                snapshot: Sequence[str] | None = None,
                host_snapshot: Sequence[str] | None = None) -> None:
        """Record one step's KV events and load; never blocks on Redis (thread-safe).

        With `snapshot` (the device pool's hashes) both sets are replaced; `host_snapshot` is the
        host tier's (None: the replica has no host tier, its host set is emptied)."""
        batches = [_Batch(e.kind, tuple(e.block_hashes), getattr(e, "medium", "device"))
                   for e in events]
        batches = [b for b in batches if b.medium in PUBLISHED_MEDIA]
        with self._lock:
            if stats is not None:
                self._load = (int(getattr(stats, "num_running", 0)),
                              int(getattr(stats, "num_waiting", 0)),
                              float(getattr(stats, "kv_cache_usage", 0.0)))
            pushed = self._enqueue(batches, snapshot, host_snapshot)
        if pushed:
            self._wakeup()

    def _enqueue(self, batches: list[_Batch], snapshot: Sequence[str] | None,
                 host_snapshot: Sequence[str] | None = None) -> bool:
        """Queue batches (lock held); True when the writer has something new to do."""
        if snapshot is not None:
            # The snapshot already includes this step's events and everything queued before.
            host = tuple(host_snapshot or ())
            self._pending.clear()
            self._pending.append(_Batch("snapshot", tuple(snapshot), "device"))
            self._pending.append(_Batch("snapshot", host, "host"))
            self._pending_hashes = len(snapshot) + len(host)
            self._want_snapshot = False
            return True
        if not batches:
            return False
        size = sum(len(b.hashes) for b in batches)
        if not self._connected or self._pending_hashes + size > self.max_pending_hashes:
            self._dropped += size or 1
            self._want_snapshot = True
            return False
        self._pending.extend(batches)
        self._pending_hashes += size
        return True

    def wants_snapshot(self) -> bool:
        """True when the engine thread should pass `snapshot=engine.cached_block_hashes()` and
        `host_snapshot=engine.cached_block_hashes("host")`."""
        with self._lock:
            return self._want_snapshot and self._connected

    @property
    def dropped_events(self) -> int:
        """Block hashes dropped because Redis was down or the queue was full."""
        return self._dropped

    @property
    def redis_errors(self) -> int:
        return self._redis_errors

    @property
    def connected(self) -> bool:
        return self._connected

    def _wakeup(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # loop closed between the check and the call
                pass

    # ---- event loop side ----------------------------------------------------------------------
    async def start(self) -> None:
        """Start the writer/heartbeat task on the running loop (does not wait for Redis)."""
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._client = async_redis(self.redis_url, self._timeout)
        self._update = self._client.register_script(UPDATE_SCRIPT)
        self._clear_script = self._client.register_script(CLEAR_SCRIPT)
        self._task = asyncio.create_task(self._run(), name="kvserve-prefix-index-publisher")

    async def close(self) -> None:
        """Stop publishing and remove this replica's entries (best effort)."""
        if self._task is not None:
            # The flag as well as the cancel: a cancel can be lost (seen on Python 3.11: close()
            # waited forever on a task left "cancelling" in its idle wait); the flag cannot.
            self._stopping = True
            if self._wake is not None:
                self._wake.set()
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=2.0)
            if not self._task.done():
                logger.warning("prefix index: the publisher of %s did not stop within 2 s",
                               self.replica_id)
            elif not self._task.cancelled() and self._task.exception() is not None:
                logger.warning("prefix index: publisher failed: %s", self._task.exception())
            self._task = None
        if self._client is not None:
            try:  # routers stop routing here at once and take the entries out in bounded steps
                await self._client.pipeline(transaction=False).srem(
                    self.keys.replicas, self.replica_id).delete(
                    self.keys.replica(self.replica_id)).sadd(
                    self.keys.dead, self.replica_id).execute()
            except (RedisError, OSError):
                pass
            await self._client.aclose()
            self._client = None

    async def _run(self) -> None:
        assert self._wake is not None
        next_beat = 0.0
        while not self._stopping:
            try:
                if not self._connected:
                    await self._connect()
                if time.monotonic() >= next_beat:
                    await self._heartbeat()
                    next_beat = time.monotonic() + self.heartbeat_interval
                await self._flush()
            except (RedisError, OSError) as exc:
                self._on_redis_error(exc)
                next_beat = 0.0
            timeout = max(0.0, next_beat - time.monotonic()) if self._connected else \
                self.heartbeat_interval
            try:  # not asyncio.wait_for: on 3.11 it can swallow a cancel racing its timeout
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()

    async def _connect(self) -> None:
        assert self._client is not None
        await self._client.ping()
        if self._first_connect:
            # A previous life of this replica id may have left entries: the snapshot rebuilds them.
            for medium in PUBLISHED_MEDIA:
                await self._clear(medium)
            self._first_connect = False
        with self._lock:
            self._connected = True
            self._want_snapshot = True
        logger.info("prefix index: connected to Redis %s for replica %s",
                    redact_url(self.redis_url), self.replica_id)

    def _on_redis_error(self, exc: BaseException) -> None:
        self._redis_errors += 1
        with self._lock:
            was = self._connected
            self._connected = False
            self._dropped += self._pending_hashes
            self._pending.clear()
            self._pending_hashes = 0
            self._want_snapshot = True
        if was:
            logger.warning("prefix index: Redis unavailable (%s); dropping events until it returns",
                           exc)

    async def _heartbeat(self) -> None:
        assert self._client is not None
        running, waiting, usage = self._load
        beat_at = f"{time.time():.6f}"
        fields = {"url": self.url, "model": self.model, "block_size": self.block_size,
                  "num_running": running, "num_waiting": waiting, "kv_cache_usage": usage,
                  "heartbeat_at": beat_at, ROLE_FIELD: self.role}
        if self._adapters is not None:
            fields[ADAPTERS_FIELD] = self._adapter_names()
        if self._token is not None:
            fields[SIGNATURE_FIELD] = sign_heartbeat(self._token, self.replica_id, self.url,
                                                     beat_at)
        ttl_ms = int(self.ttl * 1000)
        rid = self.replica_id
        created, *_ = await (self._client.pipeline(transaction=False)
                             .hset(self.keys.replica(rid), mapping=fields)
                             .pexpire(self.keys.replica(rid), ttl_ms)
                             .sadd(self.keys.replicas, rid)
                             .execute())
        if created and not self._want_snapshot:
            # Our entry had expired (a frozen process, a flushed Redis): routers are taking our
            # block entries out, or they are gone.
            logger.warning("prefix index: entry of replica %s had expired; republishing", rid)
            with self._lock:
                self._want_snapshot = True

    def _adapter_names(self) -> str:
        """The heartbeat's adapter list; a failing callback publishes the last good list."""
        assert self._adapters is not None
        try:
            self._last_adapters = encode_adapters(self._adapters())
        except Exception as exc:  # noqa: BLE001 -- the heartbeat must go out regardless
            logger.warning("prefix index: reading the resident adapters failed: %s", exc)
        return self._last_adapters

    async def _flush(self) -> None:
        assert self._client is not None
        with self._lock:
            batches = list(self._pending)
            self._pending.clear()
            self._pending_hashes = 0
        if not batches:
            return
        ops: list[tuple[str, str, Sequence[str]]] = []
        try:
            for batch in batches:
                if batch.kind in ("cleared", "snapshot"):
                    await self._write(ops)
                    ops = []
                    await self._clear(batch.medium)
                if batch.kind in ("stored", "snapshot"):
                    ops.append(("add", batch.medium, batch.hashes))
                elif batch.kind == "removed":
                    ops.append(("remove", batch.medium, batch.hashes))
            await self._write(ops)
        except (RedisError, OSError):
            self._dropped += sum(len(b.hashes) for b in batches)
            raise

    async def _write(self, ops: list[tuple[str, str, Sequence[str]]]) -> None:
        assert self._client is not None
        for args in write_calls(self.keys, self.replica_id, ops):
            await self._update(keys=[self.keys.replicas], args=args)

    async def _clear(self, medium: str) -> None:
        """Take all of this replica's entries of one tier out of the index, in bounded calls."""
        assert self._client is not None
        args = [self.keys.prefix, self.replica_id, medium, SWEEP_BUDGET]
        while await self._clear_script(keys=[self.keys.replicas], args=args):
            pass
