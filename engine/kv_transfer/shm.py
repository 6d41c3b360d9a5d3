"""KVServeConnector's shared-memory transport: when the prefill and the decode engine run on one
host, a read's block bytes go through a memory file both processes map, and TCP carries only the
control messages.

The file is a `memfd` (anonymous shared memory: it has no name in /dev/shm, so nothing is left
behind by a request or by a killed process; the kernel frees it with the last descriptor or
mapping). The producer keeps a `SegmentPool` of them and reuses them read after read, because
first-touching fresh shared pages costs more than the copy itself (docs/perf/pd.md); the consumer
opens one through `/proc/<producer pid>/fd/<fd>` (same host, same PID namespace, same user) and
keeps the mapping in a small `MappingCache`. Where any of that fails the pull goes over TCP."""

from __future__ import annotations

import mmap
import os
import socket
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

TRANSPORTS = ("auto", "tcp", "shm")
POOL_BYTES = 1 << 30  # the producer keeps at most this much in free segments
CACHE_BYTES = 1 << 30  # the consumer keeps at most this much of producers' segments mapped


def host_id() -> str:
    """This host's identity for the handshake: its name and this boot's id."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def shm_available() -> bool:
    return hasattr(os, "memfd_create") and Path("/proc/self/fd").is_dir()


def allowed(transport: str) -> tuple[str, ...]:
    """The transports a side configured with `transport` (auto | tcp | shm) accepts."""
    if transport == "auto":
        return ("shm", "tcp") if shm_available() else ("tcp",)
    if transport == "shm" and not shm_available():
        return ()
    return (transport,)


@dataclass(frozen=True)
class SegmentRef:
    """How a consumer finds a producer's segment: its process, descriptor, inode and size, and
    a token of its own (a consumer's cached mapping is never taken for a later segment that
    happens to get the same descriptor)."""

    pid: int
    fd: int
    inode: int
    size: int
    token: str

    def to_json(self) -> dict[str, object]:
        return {"pid": self.pid, "fd": self.fd, "inode": self.inode, "size": self.size,
                "token": self.token}

    @classmethod
    def from_json(cls, value: object) -> "SegmentRef":
        if not isinstance(value, dict):
            raise ValueError(f"not a segment reference: {value!r}")
        return cls(int(value["pid"]), int(value["fd"]), int(value["inode"]), int(value["size"]),
                   str(value["token"]))


class Segment:
    """One producer-side memory file and its mapping."""

    def __init__(self, size: int) -> None:
        self.fd = os.memfd_create("kvserve-kv", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self.map = mmap.mmap(self.fd, size)
        except OSError:
            os.close(self.fd)
            raise
        self.size = size
        self.ref = SegmentRef(os.getpid(), self.fd, os.fstat(self.fd).st_ino, size,
                              uuid.uuid4().hex)

    def tensor(self, nbytes: int) -> torch.Tensor:
        """The first `nbytes` as a uint8 tensor sharing the memory (it keeps the mapping
        object alive; close() must wait until no such tensor is used)."""
        return torch.frombuffer(self.map, dtype=torch.uint8, count=nbytes)

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)


class SegmentPool:
    """The producer's segments: `take` one at least `size` bytes (a free one, else a new one
    rounded up to a power of two), `give` it back once its reader has copied it out."""

    def __init__(self, max_free_bytes: int = POOL_BYTES) -> None:
        self.max_free_bytes = max_free_bytes
        self._free: list[Segment] = []
        self._lock = threading.Lock()
        self.num_created = 0

    def take(self, size: int) -> Segment:
        with self._lock:
            fits = [s for s in self._free if size <= s.size <= 2 * max(size, 1 << 20)]
            if fits:
                seg = min(fits, key=lambda s: s.size)
                self._free.remove(seg)
                return seg
            self.num_created += 1
        return Segment(1 << max(size - 1, 1).bit_length())

    def give(self, seg: Segment) -> None:
        with self._lock:
            self._free.append(seg)
            while sum(s.size for s in self._free) > self.max_free_bytes:
                self._free.pop(0).close()

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(s.size for s in self._free)

    def close(self) -> None:
        with self._lock:
            for seg in self._free:
                seg.close()
            self._free = []


class MappingCache:
    """The consumer's mappings of producers' segments, newest kept, at most `max_bytes`."""

    def __init__(self, max_bytes: int = CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._maps: OrderedDict[SegmentRef, mmap.mmap] = OrderedDict()
        self._lock = threading.Lock()

    def tensor(self, ref: SegmentRef, nbytes: int) -> torch.Tensor:
        """The segment's first `nbytes` (OSError / ValueError: it cannot be mapped here)."""
        if nbytes > ref.size:
            raise ValueError(f"a segment of {ref.size} bytes for {nbytes}")
        with self._lock:
            m = self._maps.pop(ref, None)
        if m is None:
            m = _map(ref)
        with self._lock:
            self._maps[ref] = m
            while len(self._maps) > 1 and sum(x.size() for x in self._maps.values()) \
                    > self.max_bytes:
                self._maps.popitem(last=False)  # unmapped with its last tensor
        return torch.frombuffer(m, dtype=torch.uint8, count=nbytes)

    def drop(self, ref: SegmentRef) -> None:
        """Forget a segment (its producer broke off: it may be gone, or reuse the descriptor).
        Mappings are never closed here: one is unmapped (and the descriptor mmap keeps closed)
        when the last reference goes, so a copy in flight on another thread stays valid."""
        with self._lock:
            self._maps.pop(ref, None)

    def clear(self) -> None:
        with self._lock:
            self._maps = OrderedDict()

    def __len__(self) -> int:
        with self._lock:
            return len(self._maps)


def _map(ref: SegmentRef) -> mmap.mmap:
    fd = os.open(f"/proc/{ref.pid}/fd/{ref.fd}", os.O_RDWR)
    try:
        st = os.fstat(fd)
        if st.st_ino != ref.inode or st.st_size != ref.size:
            raise ValueError(f"/proc/{ref.pid}/fd/{ref.fd} is not the producer's segment")
        return mmap.mmap(fd, ref.size)
    finally:
        os.close(fd)
