"""BlockPool: every physical KV block, their reference counts, the LRU free queue and the
hash -> block map of the prefix cache. It knows nothing of requests."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.engine.core.kv_events import KVEvent, KVEventLog


@dataclass(eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set once the block is full and cached
    owner: str | None = None  # the model that cached it (a pool shared by models, shared_pool.py)
    prev: "Block | None" = None  # free-queue links (None when not in the queue)
    next: "Block | None" = None


class FreeBlockQueue:
    """Doubly linked list of free blocks, O(1) popleft / append / appendleft / remove.

    Head = next to be reused (least recently used); tail = most recently freed. A cached block
    stays in the queue with its hash until it is popped (lazy eviction) or hit again (removed).
    """

    def __init__(self, blocks: list[Block]) -> None:
        self.head = Block(-1)  # sentinels
        self.tail = Block(-1)
        self.head.next, self.tail.prev = self.tail, self.head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def _link(self, b: Block, prev: Block, nxt: Block) -> None:
        b.prev, b.next = prev, nxt
        prev.next = b
        nxt.prev = b
        self.num_free += 1

    def append(self, b: Block) -> None:
        self._link(b, self.tail.prev, self.tail)  # type: ignore[arg-type]

    def appendleft(self, b: Block) -> None:
        self._link(b, self.head, self.head.next)  # type: ignore[arg-type]

    def remove(self, b: Block) -> None:
        if b.prev is None or b.next is None:  # unlinking it would corrupt the list
            raise ValueError(f"block {b.block_id} is not in the free queue")
        b.prev.next, b.next.prev = b.next, b.prev
        b.prev = b.next = None
        self.num_free -= 1

    def popleft(self) -> Block:
        b = self.head.next
        if b is self.tail or b is None:
            raise IndexError("no free block")
        self.remove(b)
        return b

    def __iter__(self):
        b = self.head.next
        while b is not None and b is not self.tail:
            yield b
            b = b.next


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, Block] = {}
        self.num_evictions = 0
        self._num_shared = 0  # blocks with ref_cnt > 1, kept as refs change (read every step)
        self._events = KVEventLog("device", num_blocks, lambda: self.cached)
        # (block id, hash) of cached blocks evicted since the last take_evicted(): their content
        # is still in the block until this step's forward writes it, so it can be offloaded.
        self._evicted: list[tuple[int, bytes]] = []

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def usage(self) -> float:
        """Fraction of blocks referenced by running requests (cached-but-free counts as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, n: int) -> list[Block]:
        """Pop `n` blocks from the LRU end, evicting their cached content if any."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, only {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            b = self.free_queue.popleft()
            self._evict(b)
            b.ref_cnt = 1
            out.append(b)
        return out

    def _evict(self, b: Block) -> None:
        if b.block_hash is None:
            return
        if self.cached.get(b.block_hash) is b:
            del self.cached[b.block_hash]
            self._events.removed(b.block_hash)
            self.num_evictions += 1
            self._evicted.append((b.block_id, b.block_hash))
        b.block_hash = None

    def take_evicted(self) -> list[tuple[int, bytes]]:
        """(block id, hash) of the cached blocks evicted since the last call."""
        out, self._evicted = self._evicted, []
        return out

    def get_cached_block(self, block_hash: bytes) -> Block | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on cache hits, pulling free ones out of the free queue."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1
            if b.ref_cnt == 2:
                self._num_shared += 1

    def cache_block(self, b: Block, block_hash: bytes, parent: bytes | None = None,
                    token_ids: Sequence[int] = (), owner: str | None = None) -> None:
        """Register a full block under its hash (first writer wins; duplicates stay private).
        `parent` (the previous block's hash) and `token_ids` only travel in its "stored" event."""
        if not self.enable_caching or b.block_hash is not None:
            return
        if block_hash in self.cached:
            return
        b.block_hash, b.owner = block_hash, owner
        self.cached[block_hash] = b
        self._events.stored(block_hash, parent, token_ids)

    def forget_owner(self, owner: str) -> int:
        """Drop the cached hashes of the blocks `owner` cached (a model leaving a shared pool);
        free ones go to the head of the free queue. Returns how many."""
        gone = [b for b in self.cached.values() if b.owner == owner]
        for b in gone:
            self._evict(b)
            self._evicted.pop()  # nothing to offload: nobody will look it up again
            b.owner = None
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
                self.free_queue.appendleft(b)
        return len(gone)

    def free_blocks(self, blocks: list[Block]) -> None:
        """Drop one reference each; blocks reaching zero go back to the free queue.

        Cached blocks go to the tail (kept longest, LRU); blocks with nothing reusable go to the
        head so they are reused before any cached content is evicted.
        """
        for b, times in Counter(blocks).items():  # check all first: a bad call changes nothing
            if b.ref_cnt < times:
                raise RuntimeError(f"double free of block {b.block_id}")
        for b in blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 1:
                self._num_shared -= 1
            if b.ref_cnt == 0:
                if b.block_hash is not None:
                    self.free_queue.append(b)
                else:
                    self.free_queue.appendleft(b)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for b in self.blocks:
            b.block_hash = None
        self.cached.clear()
        self._events.cleared()
        return True

    def drain_events(self) -> list[KVEvent]:
        """Changes since the last call, in order, consecutive ones of a kind batched together."""
        return self._events.drain()

    def cached_hashes(self) -> list[str]:
        return [h.hex() for h in self.cached]

    def num_shared_blocks(self) -> int:
        return self._num_shared
