"""DiskTier: the optional third KV tier, a size-capped directory of block files (one per block)
that keeps blocks the host tier evicted, by hash, in LRU order, and serves them back verified.

Writes leave the engine step: `put` queues the block's bytes for one writer thread and returns;
when that many bytes already wait, the block is dropped (a later miss recomputes it), so a slow
disk costs hits, never step time. Reads happen on the step, batched per request (`read`), since a
block must be known good before the scheduler counts it as computed: a missing, torn, corrupted,
stale or foreign file is a miss and leaves the index. Files survive a restart: the directory is
scanned at start and the files of this model and layout are reused (LRU by modification time).
"""

from __future__ import annotations

import fcntl
import logging
import os
import queue
import shutil
import threading
from collections import OrderedDict
from pathlib import Path

from kvserve.engine.core.kv_events import KVEvent, KVEventLog
from kvserve.engine.errors import ConfigError
from kvserve.engine.kv_offload import disk_block_file as fmt
from kvserve.engine.kv_offload.host_tier import TierCounters

logger = logging.getLogger("kvserve.engine")

QUEUE_BYTES = 64 << 20  # most block bytes waiting for the writer before blocks are dropped


class DiskTier:
    """Hash -> block file, least recently used first. The index and counters belong to the engine
    thread; the writer thread only writes and unlinks files, in the order they were asked for,
    and shares nothing with the engine thread but `_inflight` (under `_mutex`)."""

    medium = "disk"

    def __init__(self, path: str | Path, size_bytes: int, payload_size: int, layout: str,
                 queue_bytes: int = QUEUE_BYTES) -> None:
        self.path = Path(path)
        self.payload_size = payload_size
        self.file_size = fmt.HEADER_SIZE + payload_size
        self.num_blocks = int(size_bytes) // self.file_size
        if self.num_blocks < 1:
            raise ConfigError(
                f"kv_offloading_disk_size {size_bytes / (1 << 30):g} GiB holds no KV block file "
                f"of {self.file_size} bytes; raise it")
        self._lock_fd = _claim_directory(self.path)
        self.digest = fmt.layout_digest(layout)
        self.queue_blocks = max(1, queue_bytes // payload_size)
        self.index: OrderedDict[bytes, None] = OrderedDict()  # LRU first
        self.counters = TierCounters()
        self.num_dropped = 0  # blocks not written: the writer queue was full
        self.num_bad_files = 0  # reads that found a missing, damaged or foreign file
        self.bytes_written = 0  # queued for writing (what a full queue dropped not counted)
        self.bytes_read = 0
        self._events = KVEventLog(self.medium, self.num_blocks, lambda: self.index)
        self._mutex = threading.Lock()
        self._inflight: dict[bytes, tuple[int, bytearray]] = {}  # queued, not yet on disk
        self._seq = 0
        self._ops: queue.Queue[tuple[str, bytes, int]] = queue.Queue()
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer",
                                        daemon=True)
        self._writer.start()
        _warn_if_small_disk(self.path, self.num_blocks * self.file_size)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.index

    def __len__(self) -> int:
        return len(self.index)

    # ---- engine thread ------------------------------------------------------------------------
    def put(self, block_hash: bytes, payload: bytearray, wait: bool = False) -> bool:
        """Keep a block the host tier evicted (False: dropped, the writer is behind; with
        `wait`, wait for it instead). A block already here is only made most recent."""
        if block_hash in self.index:
            self.index.move_to_end(block_hash)
            return True
        if not fmt.key_fits(block_hash):  # refused here: in the writer thread it would stop it
            raise ValueError(f"a disk tier block key is 16 to {fmt.KEY_BYTES} bytes (a hash, or "
                             f"a KV-cache group's key), not {len(block_hash)}")
        if wait and len(self._inflight) >= self.queue_blocks:
            self.flush()
        with self._mutex:
            if len(self._inflight) >= self.queue_blocks:
                self.num_dropped += 1
                return False
            while len(self.index) >= self.num_blocks:
                self._evict_lru()
            self._seq += 1
            self._inflight[block_hash] = (self._seq, payload)
        self.index[block_hash] = None
        self._ops.put(("write", block_hash, self._seq))
        self.counters.stored += 1
        self.bytes_written += len(payload)
        self._events.stored(block_hash)
        return True

    def touch(self, block_hash: bytes) -> None:
        self.index.move_to_end(block_hash)

    def _evict_lru(self) -> None:
        """Drop the least recent block (caller holds `_mutex`); its file goes after any write."""
        h, _ = self.index.popitem(last=False)
        self._inflight.pop(h, None)
        self._ops.put(("unlink", h, 0))
        self.counters.evicted += 1
        self._events.removed(h)

    def read(self, hashes: list[bytes]) -> list[bytearray]:
        """Verified payloads of the leading `hashes`, stopping at the first one that is not here
        or whose file fails its check (that one leaves the tier: a miss, recomputed)."""
        out: list[bytearray] = []
        for h in hashes:
            payload = self._read_one(h) if h in self.index else None
            if payload is None:
                break
            self.index.move_to_end(h)
            out.append(payload)
        return out

    def _read_one(self, block_hash: bytes) -> bytearray | None:
        with self._mutex:
            queued = self._inflight.get(block_hash)
        if queued is not None:
            return queued[1]
        head, payload = bytearray(fmt.HEADER_SIZE), bytearray(self.payload_size)
        try:
            with open(self.path / fmt.file_name(block_hash), "rb") as f:
                ok = (f.readinto(head) == len(head) and f.readinto(payload) == len(payload)
                      and not f.read(1))
        except OSError:
            ok = False
        if ok and fmt.verify(head, payload, block_hash, self.digest, self.payload_size):
            self.bytes_read += len(payload)
            return payload
        self.num_bad_files += 1
        logger.warning("KV disk tier: block file %s is missing or damaged; treated as a miss",
                       fmt.file_name(block_hash))
        with self._mutex:
            del self.index[block_hash]
            self._ops.put(("unlink", block_hash, 0))
        self._events.removed(block_hash)
        return None

    def clear(self) -> None:
        """Forget every block and delete their files (the prefix cache was reset)."""
        with self._mutex:
            self.index.clear()
            self._inflight.clear()
            self._ops.put(("clear", b"", 0))
        self._events.cleared()

    def usage(self) -> float:
        return len(self.index) / self.num_blocks

    def lru_hashes(self) -> list[bytes]:
        return list(self.index)

    def flush(self) -> None:
        """Wait until every queued write and unlink is on disk (tests, benchmarks, shutdown)."""
        self._ops.join()

    @property
    def is_open(self) -> bool:
        return self._lock_fd >= 0

    def close(self) -> None:
        """Finish the queued writes, stop the writer and release the directory; idempotent."""
        if self._lock_fd < 0:
            return
        self._ops.put(("stop", b"", 0))
        self._writer.join()
        os.close(self._lock_fd)
        self._lock_fd = -1

    def drain_events(self) -> list[KVEvent]:
        """Changes since the last call, consecutive ones of a kind batched, tagged `disk`."""
        return self._events.drain()

    # ---- start-up -----------------------------------------------------------------------------
    def _scan(self) -> None:
        """Index the files a previous run of this model and layout left, oldest first; delete
        leftovers of interrupted writes and files of another layout; trim to the cap."""
        found: list[tuple[int, bytes]] = []
        for f in self.path.iterdir():
            if f.name.endswith(".tmp"):
                f.unlink(missing_ok=True)
                continue
            h = _hash_of(f.name)
            if h is None:
                continue
            try:
                st = f.stat()
                with open(f, "rb") as fh:
                    head = fh.read(fmt.HEADER_SIZE)
            except OSError:
                continue
            if st.st_size == self.file_size and fmt.header_matches(head, self.digest,
                                                                   self.payload_size):
                found.append((st.st_mtime_ns, h))
            else:
                f.unlink(missing_ok=True)  # another model or layout, or a torn file
        found.sort()
        for _, h in found[: max(len(found) - self.num_blocks, 0)]:
            (self.path / fmt.file_name(h)).unlink(missing_ok=True)
        for _, h in found[-self.num_blocks:]:
            self.index[h] = None
            self._events.stored(h)
        if self.index:
            logger.info("KV disk tier: reusing %d block files in %s", len(self.index), self.path)

    # ---- writer thread ------------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            op, h, seq = self._ops.get()
            try:
                if op == "stop":
                    return
                self._apply(op, h, seq)
            except OSError as e:
                logger.warning("KV disk tier: %s of block %s failed (%s); it will be a miss",
                               op, h.hex(), e)
                with self._mutex:
                    if op == "write" and self._inflight.get(h, (0,))[0] == seq:
                        del self._inflight[h]
            finally:
                self._ops.task_done()

    def _apply(self, op: str, h: bytes, seq: int) -> None:
        if op == "unlink":
            (self.path / fmt.file_name(h)).unlink(missing_ok=True)
        elif op == "clear":
            for f in self.path.iterdir():
                if _hash_of(f.name) is not None or f.name.endswith(".tmp"):
                    f.unlink(missing_ok=True)
        elif op == "write":
            with self._mutex:
                queued = self._inflight.get(h)
            if queued is None or queued[0] != seq:  # evicted or replaced while it waited
                return
            final = self.path / fmt.file_name(h)
            tmp = final.with_name(final.name + ".tmp")
            with open(tmp, "wb") as f:
                f.write(fmt.header(h, self.digest, queued[1]))
                f.write(queued[1])
            os.replace(tmp, final)  # a reader sees the old file, the new one, or none
            with self._mutex:
                if self._inflight.get(h, (0,))[0] == seq:
                    del self._inflight[h]


def _hash_of(name: str) -> bytes | None:
    """The block key a file name holds (a hash, or a KV-cache group's key), or None for a file
    that is not a block file."""
    if not name.endswith(fmt.SUFFIX):
        return None
    try:
        h = bytes.fromhex(name[: -len(fmt.SUFFIX)])
    except ValueError:
        return None
    return h if fmt.key_fits(h) else None


def _claim_directory(path: Path) -> int:
    """Create `path`, check that files can be written there and lock it for this engine (two
    engines sharing one directory would evict each other's files past their caps)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
        fd = os.open(path / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise ConfigError(f"kv_offloading_disk_path {str(path)!r} is not a writable directory "
                          f"({e.strerror or e}); pick another path") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        raise ConfigError(f"kv_offloading_disk_path {str(path)!r} is in use by another kvserve "
                          "engine; give each engine its own directory") from e
    return fd


def _warn_if_small_disk(path: Path, cap: int) -> None:
    free = shutil.disk_usage(path).free
    if cap > free:
        logger.warning("KV disk tier: the cap (%.1f GiB) exceeds the free space in %s (%.1f GiB); "
                       "writes that fail are misses", cap / (1 << 30), path, free / (1 << 30))
