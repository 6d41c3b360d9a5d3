"""HostTier: the bookkeeping of the KV host tier, a bounded set of host block slots that keep
prefix-cache blocks the device pool evicted, by hash, in LRU order. It holds no tensors: the
model runner owns the host memory and does the copies this tier hands out as (src, dst) pairs."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvserve.engine.core.kv_events import KVEvent, KVEventLog


@dataclass
class TierCounters:
    """Cumulative block moves of one tier (what the offload metrics count)."""

    stored: int = 0  # blocks written into the tier
    restored: int = 0  # blocks copied from the tier back to the device
    evicted: int = 0  # blocks dropped from the tier to make room


class HostTier:
    """Hash -> host slot, least recently used first; slots with a copy in flight are pinned.

    A block is written once: storing a hash the tier already holds only refreshes its LRU place,
    and restoring keeps the host copy (device and host may both hold a block; that is intended,
    so a block evicted again costs no copy). Pins last until the step's copies are handed to the
    runner (`unpin_all`), so a slot being read or written this step is never reused this step.
    """

    medium = "host"

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a host tier needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.slots: OrderedDict[bytes, int] = OrderedDict()  # LRU first
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.pinned: set[int] = set()
        self.counters = TierCounters()
        self._events = KVEventLog(self.medium, self.num_blocks, lambda: self.slots)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.slots

    def __len__(self) -> int:
        return len(self.slots)

    def store(self, block_hash: bytes) -> tuple[int | None, tuple[bytes, int] | None]:
        """Make room for `block_hash`: (slot to copy the block into, or None when it is already
        here or every slot is pinned; the (hash, slot) evicted to make room, if any)."""
        if block_hash in self.slots:
            self.slots.move_to_end(block_hash)
            return None, None
        victim = None
        if not self.free:
            victim = self._evict_lru()
            if victim is None:
                return None, None
        slot = self.free.pop()
        self.slots[block_hash] = slot
        self.pinned.add(slot)
        self.counters.stored += 1
        self._events.stored(block_hash)
        return slot, victim

    def _evict_lru(self) -> tuple[bytes, int] | None:
        for h, slot in self.slots.items():
            if slot not in self.pinned:
                del self.slots[h]
                self.free.append(slot)
                self.counters.evicted += 1
                self._events.removed(h)
                return h, slot
        return None

    def restore(self, block_hash: bytes) -> int:
        """The slot holding `block_hash`, pinned and made most recent (KeyError if absent)."""
        slot = self.slots[block_hash]
        self.slots.move_to_end(block_hash)
        self.pinned.add(slot)
        self.counters.restored += 1
        return slot

    def unpin_all(self) -> None:
        self.pinned.clear()

    def clear(self) -> None:
        """Forget every block (the prefix cache was reset)."""
        self.slots.clear()
        self.free = list(range(self.num_blocks - 1, -1, -1))
        self.pinned.clear()
        self._events.cleared()

    def usage(self) -> float:
        return len(self.slots) / self.num_blocks

    def lru_hashes(self) -> list[bytes]:
        """Held hashes, least recently used first."""
        return list(self.slots)

    def drain_events(self) -> list[KVEvent]:
        """Changes since the last call, consecutive ones of a kind batched, tagged `host`."""
        return self._events.drain()
