"""KVCacheManager: block tables of the running sequences on top of the BlockPool — lazy slot
allocation, prefix-cache lookup and registration, fork with copy-on-write, swap to a CPU pool."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from kvserve.engine.block_hash import hash_block
from kvserve.engine.block_pool import Block, BlockPool
from kvserve.engine.sequence import Sequence


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache


@dataclass(frozen=True)
class KVCacheStats:
    """The block manager's figures at one moment (`KVCacheManager.make_stats()`)."""

    usage: float  # fraction of device blocks referenced by live sequences, 0..1
    num_total_blocks: int
    num_free_blocks: int
    num_cached_blocks: int  # blocks holding a hash in the prefix cache (in use or free)
    num_shared_blocks: int  # blocks referenced by more than one sequence
    num_evictions: int  # cumulative cached blocks evicted
    num_cpu_blocks: int
    num_free_cpu_blocks: int
    prefix_cache_queries: int  # cumulative prompt tokens looked up
    prefix_cache_hits: int  # cumulative prompt tokens found cached
    allocated_slots: int  # token slots in blocks held by sequences (shared blocks counted once)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 num_cpu_blocks: int = 0) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.tables: dict[int, list[Block]] = {}
        self.hashes: dict[int, list[bytes]] = {}  # chained hashes of each seq's full blocks
        self.num_registered: dict[int, int] = {}  # leading blocks already in the prefix cache
        self.prefix_stats = PrefixCacheStats()
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu_free: list[int] = list(range(num_cpu_blocks - 1, -1, -1))
        self.swapped: dict[int, list[int]] = {}  # seq -> its blocks in the CPU pool
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) for the runner
        self.alloc_seconds: deque[float] = deque(maxlen=4096)

    # ---- prefix cache -------------------------------------------------------------------------
    def _seq_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The seq's chained block hashes, extended lazily up to `num_blocks` full blocks."""
        hs = self.hashes.setdefault(seq.seq_id, [])
        bs = self.block_size
        while len(hs) < num_blocks:
            i = len(hs)
            toks = seq.token_range(i * bs, (i + 1) * bs)
            hs.append(hash_block(hs[-1] if hs else None, toks, seq.extra_keys))
        return hs

    def lookup_prefix(self, seq: Sequence) -> list[Block]:
        """Cached blocks holding the longest prefix of the seq's tokens.

        At least one token is always left to compute, since its logits are needed.
        """
        if not self.enable_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[Block] = []
        for h in self._seq_hashes(seq, max_blocks)[:max_blocks]:
            b = self.pool.get_cached_block(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def full_block_hashes(self, seq: Sequence, start_block: int, end_block: int) -> list[bytes]:
        """Hashes of the seq's full blocks in [start_block, end_block) (clipped to full ones)."""
        if not self.enable_caching:
            return []
        end = min(end_block, seq.num_tokens // self.block_size)
        return self._seq_hashes(seq, end)[start_block:end] if end > start_block else []

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's prefix lookup in the hit-rate figures."""
        if self.enable_caching:
            self.prefix_stats.queries += num_tokens
            self.prefix_stats.hits += num_hit_tokens

    def register_computed(self, seq: Sequence) -> None:
        """Put the seq's newly full and computed blocks into the prefix cache."""
        if not self.enable_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        done = self.num_registered.get(seq.seq_id, 0)
        if num_full <= done:
            return
        table = self.tables[seq.seq_id]
        hs = self._seq_hashes(seq, num_full)
        for i in range(done, num_full):
            self.pool.cache_block(table[i], hs[i])
        self.num_registered[seq.seq_id] = num_full

    # ---- allocation ---------------------------------------------------------------------------
    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       computed: list[Block] | None = None) -> bool:
        """Make room for `num_new_tokens` after the seq's computed ones (and its cache hits).

        Returns False, changing nothing, when the pool cannot supply the blocks.
        """
        t0 = time.perf_counter()
        computed = computed or []
        table = self.tables.get(seq.seq_id, [])
        start = seq.num_computed_tokens + len(computed) * self.block_size
        needed_total = -(-(start + num_new_tokens) // self.block_size)
        num_new_blocks = max(needed_total - len(table) - len(computed), 0)
        cow = bool(table) and start % self.block_size != 0 and table[-1].ref_cnt > 1
        free_hits = sum(1 for b in computed if b.ref_cnt == 0)
        if num_new_blocks + int(cow) > self.pool.num_free_blocks - free_hits:
            return False
        if computed:
            self.pool.touch(computed)
            table = table + computed
            self.num_registered[seq.seq_id] = len(table)
        if cow:
            self._copy_on_write(table)
        if num_new_blocks:
            table = table + self.pool.get_new_blocks(num_new_blocks)
        self.tables[seq.seq_id] = table
        self.alloc_seconds.append(time.perf_counter() - t0)
        return True

    def _copy_on_write(self, table: list[Block]) -> None:
        """The last (partial) block is shared with a sibling: write into a private copy."""
        old = table[-1]
        new = self.pool.get_new_blocks(1)[0]
        self.pending_copies.append((old.block_id, new.block_id))
        table[-1] = new
        self.pool.free_blocks([old])

    def take_pending_copies(self) -> list[tuple[int, int]]:
        out, self.pending_copies = self.pending_copies, []
        return out

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Share every block of `parent` with `child` (ref counts +1); writes copy on demand."""
        table = self.tables[parent.seq_id]
        self.pool.touch(table)
        self.tables[child.seq_id] = list(table)
        self.hashes[child.seq_id] = list(self.hashes.get(parent.seq_id, []))
        self.num_registered[child.seq_id] = self.num_registered.get(parent.seq_id, 0)

    def free(self, seq: Sequence) -> None:
        """Release the seq's blocks (tail first, so its last blocks are evicted first)."""
        table = self.tables.pop(seq.seq_id, [])
        self.pool.free_blocks(list(reversed(table)))
        self.hashes.pop(seq.seq_id, None)
        self.num_registered.pop(seq.seq_id, None)
        cpu = self.swapped.pop(seq.seq_id, None)
        if cpu:
            self.cpu_free.extend(cpu)

    def block_ids(self, seq: Sequence) -> list[int]:
        return [b.block_id for b in self.tables.get(seq.seq_id, ())]

    # ---- swap ---------------------------------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        return len(self.tables.get(seq.seq_id, ())) <= len(self.cpu_free)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move the seq's blocks to the CPU pool: (device block, cpu block) pairs to copy."""
        table = self.tables.pop(seq.seq_id)
        cpu = [self.cpu_free.pop() for _ in table]
        self.swapped[seq.seq_id] = cpu
        self.pool.free_blocks(list(reversed(table)))
        self.num_registered[seq.seq_id] = 0
        return [(b.block_id, c) for b, c in zip(table, cpu)]

    def can_swap_in(self, seq: Sequence, num_new_tokens: int = 0) -> bool:
        """Whether the seq's blocks, and the slots of its next `num_new_tokens`, fit on device."""
        num_blocks = len(self.swapped.get(seq.seq_id, ()))
        if num_new_tokens:
            total = seq.num_computed_tokens + num_new_tokens
            num_blocks = max(num_blocks, -(-total // self.block_size))
        return num_blocks <= self.pool.num_free_blocks

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Bring the seq's blocks back: (cpu block, device block) pairs to copy."""
        cpu = self.swapped.pop(seq.seq_id)
        table = self.pool.get_new_blocks(len(cpu))
        self.tables[seq.seq_id] = table
        self.cpu_free.extend(cpu)
        return [(c, b.block_id) for c, b in zip(cpu, table)]

    # ---- figures ------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def num_blocks_of(self, seq: Sequence) -> int:
        """Device blocks in the seq's block table."""
        return len(self.tables.get(seq.seq_id, ()))

    def usage(self) -> float:
        return self.pool.usage()

    def allocated_slots(self) -> int:
        """Token slots in blocks held by running sequences (shared blocks counted once)."""
        return (self.pool.num_blocks - self.pool.num_free_blocks) * self.block_size

    def make_stats(self) -> KVCacheStats:
        """A snapshot of the figures; reading it changes nothing (see take_alloc_seconds)."""
        pool = self.pool
        return KVCacheStats(
            usage=pool.usage(), num_total_blocks=pool.num_blocks,
            num_free_blocks=pool.num_free_blocks, num_cached_blocks=len(pool.cached),
            num_shared_blocks=pool.num_shared_blocks(), num_evictions=pool.num_evictions,
            num_cpu_blocks=self.num_cpu_blocks, num_free_cpu_blocks=len(self.cpu_free),
            prefix_cache_queries=self.prefix_stats.queries,
            prefix_cache_hits=self.prefix_stats.hits, allocated_slots=self.allocated_slots())

    def take_alloc_seconds(self) -> list[float]:
        """Durations of the allocate_slots calls since the last take (the newest 4,096 kept)."""
        out = list(self.alloc_seconds)
        self.alloc_seconds.clear()
        return out
