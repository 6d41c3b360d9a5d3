"""LoRA adapters resident on a simulated replica, as vLLM keeps them: up to `max_loras`, loaded
by name after a delay, the least recently used idle one evicted to make room (never one with
requests in flight: the set may exceed `max_loras` until one is idle)."""

from __future__ import annotations

import asyncio
from collections import Counter, OrderedDict


class AdapterNotFoundError(KeyError):
    """A request for an adapter this replica does not hold (vLLM's 404)."""


class ResidentAdapters:
    """The resident set (name -> path, least recently used first) and the requests in flight
    per adapter."""

    def __init__(self, max_loras: int, load_s: float) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {max_loras}")
        self.max_loras, self.load_s = max_loras, load_s
        self.paths: OrderedDict[str, str] = OrderedDict()
        self._in_use: Counter[str] = Counter()

    def acquire(self, name: str) -> None:
        """A request starts with `name`: AdapterNotFoundError unless resident."""
        if name not in self.paths:
            raise AdapterNotFoundError(name)
        self.paths.move_to_end(name)
        self._in_use[name] += 1

    def release(self, name: str) -> None:
        self._in_use[name] -= 1

    async def load(self, name: str, path: str) -> int | None:
        """Load `name` after the load delay: how many idle adapters that evicted, or None when
        it was resident already."""
        if name in self.paths:
            self.paths.move_to_end(name)
            return None
        await asyncio.sleep(self.load_s)
        if name in self.paths:  # a concurrent load of the same name finished first
            return None
        self.paths[name] = path
        return self._evict()

    def unload(self, name: str) -> None:
        """AdapterNotFoundError when it is not resident."""
        if name not in self.paths:
            raise AdapterNotFoundError(name)
        del self.paths[name]

    def clear(self) -> None:
        self.paths.clear()

    def _evict(self) -> int:
        """Least recently used idle adapters out until `max_loras` remain (or none is idle)."""
        evicted = 0
        for name in list(self.paths):
            if len(self.paths) <= self.max_loras:
                break
            if not self._in_use[name]:
                del self.paths[name]
                evicted += 1
        return evicted
