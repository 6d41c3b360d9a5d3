"""KVServeConnector's shared-memory transport: when the prefill and the decode engine run on one
host, a read's block bytes go through a file in /dev/shm that both map (TCP carries only the
control messages). `host_id` says which host (and boot) a process runs on; `Segment` is one read's
file, created by the producer and unlinked by whichever side is done with its name first (the
consumer right after mapping it), so a killed peer leaves no file behind; `sweep_stale` removes
the files of producers that died between creating a segment and naming it to their consumer."""

from __future__ import annotations

import mmap
import os
import socket
import uuid
from pathlib import Path

import torch

SHM_DIR = Path("/dev/shm")
PREFIX = "kvserve-kv-"
TRANSPORTS = ("auto", "tcp", "shm")


def host_id() -> str:
    """This host's identity for the handshake: its name and this boot's id (two processes
    sharing both share /dev/shm, unless containers split it: then the open fails and the pull
    goes over TCP)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def shm_available() -> bool:
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def allowed(transport: str) -> tuple[str, ...]:
    """The transports a side configured with `transport` (auto | tcp | shm) accepts."""
    if transport == "auto":
        return ("shm", "tcp") if shm_available() else ("tcp",)
    if transport == "shm" and not shm_available():
        return ()
    return (transport,)


class Segment:
    """One read's block bytes in /dev/shm: `[layers, 2, n, per-block bytes]` uint8."""

    def __init__(self, path: Path, size: int, create: bool) -> None:
        self.path, self.size = path, size
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size != size:
                raise ValueError(f"shared-memory segment {path.name} holds "
                                 f"{os.fstat(fd).st_size} bytes, {size} expected")
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)  # the mapping keeps the memory; the name goes with unlink()

    @classmethod
    def create(cls, size: int) -> "Segment":
        name = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
        return cls(SHM_DIR / name, size, create=True)

    @classmethod
    def open(cls, name: str, size: int) -> "Segment":
        if "/" in name or not name.startswith(PREFIX):
            raise ValueError(f"not a KV shared-memory segment name: {name!r}")
        return cls(SHM_DIR / name, size, create=False)

    def tensor(self, shape: tuple[int, ...]) -> torch.Tensor:
        """The mapping as a uint8 tensor of `shape` (shares the memory)."""
        return torch.frombuffer(self._map, dtype=torch.uint8).view(shape)

    def unlink(self) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Unlink and unmap (a tensor still viewing the mapping keeps it; the memory goes with
        the last view)."""
        self.unlink()
        try:
            self._map.close()
        except BufferError:  # a view is alive: the mapping is released with it
            pass


def sweep_stale() -> int:
    """Remove the segments of producer processes that are gone; how many."""
    removed = 0
    try:
        paths = list(SHM_DIR.glob(PREFIX + "*"))
    except OSError:
        return 0
    for path in paths:
        pid = path.name[len(PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            try:
                path.unlink()
                removed += 1
            except OSError:
                pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
