"""KVCacheManager: block tables of the running sequences on top of the BlockPool — lazy slot
allocation, prefix-cache lookup and registration, fork with copy-on-write, swap to a CPU pool,
and the host tier: evicted prefix blocks demoted to host memory (and from there to an optional
disk tier), promoted back on a prefix hit."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from kvserve.engine.core.block_hash import extra_keys_for, hash_block
from kvserve.engine.core.block_pool import Block, BlockPool
from kvserve.engine.core.kv_cache_groups import KVCacheGroups, group_key
from kvserve.engine.core.sequence import Sequence
from kvserve.engine.core.shared_pool import SharedBlockPool
from kvserve.engine.kv_offload.disk_tier import DiskTier
from kvserve.engine.kv_offload.host_tier import HostTier, TierCounters


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache (any tier)
    host_hits: int = 0  # of the hits, those restored from the host tier
    disk_hits: int = 0  # of the hits, those loaded from the disk tier
    # A KV connector's (engine/kv_transfer/): prompt tokens of requests asked about, and those
    # it supplied (not counted in `hits`: vLLM's external prefix cache figures)
    external_queries: int = 0
    external_hits: int = 0


@dataclass(frozen=True)
class HostHit:
    """A prefix block found in the host tier, not on the device: allocating it takes a new
    device block and queues the host -> device copy."""

    block_hash: bytes


@dataclass(frozen=True, eq=False)
class DiskHit:
    """A prefix block found (and already read and verified) in the disk tier: allocating it
    takes a new device block and queues the load of `payload` into it."""

    block_hash: bytes
    payload: bytearray


@dataclass(frozen=True)
class ExternalHit:
    """A prefix block a KV connector supplies (engine/kv_transfer/): allocating it takes a new
    device block registered under its hash; the connector writes its content before the step's
    forward."""

    block_hash: bytes


PrefixHit = Block | HostHit | DiskHit | ExternalHit
# One group's block table: None where a sliding window has released the block.
Table = list[Block | None]


class PrefixMatch(list):
    """`lookup_prefix`'s answer: the first group's hits (a list, as with one group), and in
    `groups` every group's, None where a sliding group needs no block (before its window)."""

    def __init__(self, hits: list, groups: list[list[PrefixHit | None]]) -> None:
        super().__init__(hits)
        self.groups = groups
# A block for the disk tier: ("host", host slot, hash), or ("device", device block, hash) when the
# host tier could not take it (every slot busy this step).
Spill = tuple[str, int, bytes]


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
    prefix_cache_hits: int  # cumulative prompt tokens found cached (any tier)
    allocated_slots: int  # token slots in blocks held by sequences (shared blocks counted once)
    prefix_cache_host_hits: int = 0  # of prefix_cache_hits, tokens restored from the host tier
    num_host_blocks: int = 0  # host tier capacity
    num_host_cached_blocks: int = 0  # host tier blocks holding a prefix block
    host: TierCounters = field(default_factory=TierCounters)  # cumulative host tier moves
    prefix_cache_disk_hits: int = 0  # of prefix_cache_hits, tokens loaded from the disk tier
    external_prefix_cache_queries: int = 0  # a KV connector's: prompt tokens asked about
    external_prefix_cache_hits: int = 0  # ... and supplied (engine/kv_transfer/)
    num_disk_blocks: int = 0  # disk tier capacity
    num_disk_cached_blocks: int = 0
    disk: TierCounters = field(default_factory=TierCounters)  # cumulative disk tier moves
    disk_blocks_dropped: int = 0  # not written: the disk writer was behind
    disk_bad_files: int = 0  # reads that found a missing or damaged file (misses)
    disk_bytes_written: int = 0
    disk_bytes_read: int = 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 num_cpu_blocks: int = 0, num_host_blocks: int = 0,
                 disk: DiskTier | None = None, groups: KVCacheGroups | None = None, *,
                 shared: SharedBlockPool | None = None, member: str = "",
                 model_key: str | None = None) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        # `shared`: the pages of several models (shared_pool.py), this one joined as `member`
        # before; `model_key` goes into its block hashes so no model hits another's blocks
        # (None keeps the plain hashes: the router's, for the server's first model).
        self.shared, self.member, self.model_key = shared, member, model_key
        self.pool = shared.pool if shared is not None else BlockPool(num_blocks, enable_caching)
        # Layer groups, each with its own block table per seq (kv_cache_groups.py); one
        # full-attention group behaves exactly as a manager without groups.
        self.groups = groups or KVCacheGroups.single(1)
        self.tables: dict[int, Table] = {}  # seq -> its block table in group 0
        self.group_tables: dict[int, list[Table]] = {}  # seq -> its tables in groups 1..
        self.hashes: dict[int, list[bytes]] = {}  # chained hashes of each seq's full blocks
        self.num_registered: dict[int, int] = {}  # leading blocks already in the prefix cache
        self.prefix_stats = PrefixCacheStats()
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu_free: list[int] = list(range(num_cpu_blocks - 1, -1, -1))
        self.swapped: dict[int, list[int]] = {}  # seq -> its blocks in the CPU pool
        # seq -> which slots of each group's table held a block when swapped out (in order)
        self.swapped_layout: dict[int, list[list[bool]]] = {}
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) for the runner
        self.alloc_seconds: deque[float] = deque(maxlen=4096)
        self.host = HostTier(num_host_blocks) if num_host_blocks and enable_caching else None
        self.pending_offloads: list[tuple[int, int]] = []  # (device block, host slot)
        self.pending_restores: list[tuple[int, int]] = []  # (host slot, device block)
        self.disk = disk if self.host is not None else None
        self.pending_spills: list[Spill] = []  # blocks for the disk tier
        self.pending_loads: list[tuple[bytearray, int]] = []  # (disk payload, device block)

    # ---- prefix cache -------------------------------------------------------------------------
    def _seq_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The seq's chained block hashes, extended lazily up to `num_blocks` full blocks."""
        hs = self.hashes.setdefault(seq.seq_id, [])
        bs = self.block_size
        while len(hs) < num_blocks:
            i = len(hs)
            toks = seq.token_range(i * bs, (i + 1) * bs)
            hs.append(hash_block(hs[-1] if hs else None, toks, self._extra_keys(seq)))
        return hs

    def _extra_keys(self, seq: Sequence) -> object:
        """The seq's extra hash keys; on a shared pool the model's name takes the adapter's
        place (the router hashes a request for a named model the same way)."""
        if self.model_key is None or seq.lora_name is not None:
            return seq.extra_keys
        return extra_keys_for(seq.cache_salt, self.model_key)

    def lookup_prefix(self, seq: Sequence) -> list[PrefixHit]:
        """Cached blocks holding the longest prefix of the seq's tokens: device blocks,
        `HostHit`s for blocks only the host tier holds, `DiskHit`s for blocks only the disk tier
        holds (read and verified here, in one batch: a bad file ends the prefix). Changes
        nothing but the tiers' LRU order (and drops a bad disk file).

        At least one token is always left to compute, since its logits are needed. A prompt
        of embeddings is never looked up (its placeholder token ids say nothing of its KV).
        """
        if not self.enable_caching or seq.prompt_embeds is not None:
            return []
        if self.groups.is_hybrid or self.groups.slides:
            return self._lookup_groups(seq)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[PrefixHit] = []
        on_disk: list[int] = []  # positions in `hits` to fill from the disk tier
        for h in self._seq_hashes(seq, max_blocks)[:max_blocks]:
            b = self.pool.get_cached_block(h)
            if b is not None:
                hits.append(b)
            elif self.host is not None and h in self.host:
                hits.append(HostHit(h))
            elif self.disk is not None and h in self.disk:
                on_disk.append(len(hits))
                hits.append(HostHit(h))  # placeholder until read
            else:
                break
        if on_disk:
            payloads = self.disk.read([hits[i].block_hash for i in on_disk])  # type: ignore
            for i, payload in zip(on_disk, payloads):
                hits[i] = DiskHit(hits[i].block_hash, payload)  # type: ignore[union-attr]
            if len(payloads) < len(on_disk):
                del hits[on_disk[len(payloads)]:]
        return hits

    def _tier_hit(self, key: bytes) -> PrefixHit | None:
        """Where a block key is cached: a device block, a HostHit (host or, unread, disk tier)."""
        b = self.pool.get_cached_block(key)
        if b is not None:
            return b
        if self.host is not None and key in self.host:
            return HostHit(key)
        if self.disk is not None and key in self.disk:
            return DiskHit(key, bytearray())  # placeholder until read
        return None

    def _lookup_groups(self, seq: Sequence) -> PrefixMatch:
        """The longest prefix every group can resume from: a full-attention group needs all
        its blocks, a sliding group only those of the last W - 1 tokens before the boundary
        (vLLM scans those from the right). Lowering the boundary for one sliding group may
        break another's, so it repeats until no group lowers it (it only goes down)."""
        bs, max_blocks = self.block_size, (seq.num_tokens - 1) // self.block_size
        hs = self._seq_hashes(seq, max_blocks)[:max_blocks]
        found = [[self._tier_hit(group_key(h, g)) for h in hs]
                 for g in range(len(self.groups.groups))]
        k, changed = max_blocks, True
        while changed:
            changed = False
            for g, group in enumerate(self.groups.groups):
                need = group.window_blocks(bs)
                k2 = _resumable(found[g], k, need)
                if k2 < k:
                    k, changed = k2, True
        per_group: list[list[PrefixHit | None]] = []
        for g, group in enumerate(self.groups.groups):
            need = group.window_blocks(bs)
            first = 0 if need is None else max(0, k - need)
            per_group.append([None] * first + found[g][first:k])
        if not self._read_disk_hits(per_group):
            return self._lookup_groups(seq)  # a bad file was dropped: look again without it
        return PrefixMatch(per_group[0], per_group)

    def _read_disk_hits(self, per_group: list[list[PrefixHit | None]]) -> bool:
        """Read the disk tier's blocks of a match in one batch; False if a file was bad."""
        at = [(g, i) for g, hits in enumerate(per_group) for i, h in enumerate(hits)
              if isinstance(h, DiskHit)]
        if not at:
            return True
        payloads = self.disk.read([per_group[g][i].block_hash for g, i in at])  # type: ignore
        for (g, i), payload in zip(at, payloads):
            per_group[g][i] = DiskHit(per_group[g][i].block_hash, payload)  # type: ignore
        return len(payloads) == len(at)

    def full_block_hashes(self, seq: Sequence, start_block: int, end_block: int) -> list[bytes]:
        """Hashes of the seq's full blocks in [start_block, end_block) (clipped to full ones)."""
        if not self.enable_caching or seq.prompt_embeds is not None:
            return []
        end = min(end_block, seq.num_tokens // self.block_size)
        return self._seq_hashes(seq, end)[start_block:end] if end > start_block else []

    def external_hits(self, seq: Sequence, start_block: int, num_blocks: int
                      ) -> list[ExternalHit]:
        """The seq's full blocks [start_block, start_block + num_blocks) as a connector's hits."""
        hs = self._seq_hashes(seq, start_block + num_blocks)
        return [ExternalHit(h) for h in hs[start_block:start_block + num_blocks]]

    def record_external(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's query to the KV connector (vLLM's external prefix
        cache: every request's prompt tokens, and those the connector supplied)."""
        self.prefix_stats.external_queries += num_tokens
        self.prefix_stats.external_hits += num_hit_tokens

    def record_lookup(self, num_tokens: int, num_hit_tokens: int,
                      num_host_hit_tokens: int = 0, num_disk_hit_tokens: int = 0) -> None:
        """Count one admitted request's prefix lookup in the hit-rate figures (the hits of any
        tier, and of those the host tier's and the disk tier's)."""
        if self.enable_caching:
            self.prefix_stats.queries += num_tokens
            self.prefix_stats.hits += num_hit_tokens
            self.prefix_stats.host_hits += num_host_hit_tokens
            self.prefix_stats.disk_hits += num_disk_hit_tokens

    def register_computed(self, seq: Sequence) -> None:
        """Put the seq's newly full and computed blocks into the prefix cache (never those of
        a prompt of embeddings, as vLLM: their hashes would be of placeholder ids)."""
        if not self.enable_caching or seq.prompt_embeds is not None:
            return
        num_full = seq.num_computed_tokens // self.block_size
        done = self.num_registered.get(seq.seq_id, 0)
        if num_full <= done:
            return
        hs, bs = self._seq_hashes(seq, num_full), self.block_size
        for g, table in enumerate(self._tables(seq.seq_id)):
            for i in range(done, num_full):
                b = table[i]
                if b is not None:  # None: released by a sliding window before it was full
                    # parent and tokens ride along in the "stored" event (vLLM's BlockStored)
                    parent = group_key(hs[i - 1], g) if i else None
                    self.pool.cache_block(b, group_key(hs[i], g), parent,
                                          seq.token_range(i * bs, (i + 1) * bs),
                                          owner=self.member or None)
        self.num_registered[seq.seq_id] = num_full

    # ---- allocation ---------------------------------------------------------------------------
    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       computed: list[PrefixHit] | None = None) -> bool:
        """Make room for `num_new_tokens` after the seq's computed ones (and its cache hits;
        host hits take a new device block each and queue their restore). Blocks that have left
        a sliding window are released first (that changes no token's result).

        Returns False, changing nothing else, when the pool cannot supply the blocks.
        """
        t0 = time.perf_counter()
        hits = self._group_hits(computed or [])
        num_hit = len(hits[0])
        start = seq.num_computed_tokens + num_hit * self.block_size
        tables = self._tables(seq.seq_id) or [[] for _ in self.groups.groups]
        self._release_skipped(tables, start)
        needed_total = -(-(start + num_new_tokens) // self.block_size)
        num_new = [max(needed_total - len(t) - num_hit, 0) for t in tables]
        cows = [bool(t) and start % self.block_size != 0 and t[-1] is not None
                and t[-1].ref_cnt > 1 for t in tables]
        flat = [h for group in hits for h in group if h is not None]
        on_device = [b for b in flat if isinstance(b, Block)]
        num_restores = len(flat) - len(on_device)
        free_hits = sum(1 for b in on_device if b.ref_cnt == 0)
        if sum(num_new) + num_restores + sum(cows) > self.pool.num_free_blocks - free_hits:
            return False
        if num_hit:
            self.pool.touch(on_device)
            restored = iter(self._restore(flat, seq) if num_restores else flat)
            for t, group in zip(tables, hits):
                t.extend(None if h is None else next(restored) for h in group)
            self.num_registered[seq.seq_id] = len(tables[0])
        for t, cow, n in zip(tables, cows, num_new):
            if cow:
                self._copy_on_write(t)
            if n:
                t.extend(self._new_blocks(n))
        self._set_tables(seq.seq_id, tables)
        self.alloc_seconds.append(time.perf_counter() - t0)
        return True

    def _tables(self, seq_id: int) -> list[Table]:
        """The seq's table in every group ([] when it holds none)."""
        if seq_id not in self.tables:
            return []
        return [self.tables[seq_id]] + self.group_tables.get(seq_id, [])

    def _set_tables(self, seq_id: int, tables: list[Table]) -> None:
        self.tables[seq_id] = tables[0]
        if len(tables) > 1:
            self.group_tables[seq_id] = tables[1:]

    def _pop_tables(self, seq_id: int) -> list[Table]:
        tables = self._tables(seq_id)
        self.tables.pop(seq_id, None)
        self.group_tables.pop(seq_id, None)
        return tables

    def _group_hits(self, computed: list[PrefixHit]) -> list[list[PrefixHit | None]]:
        """Each group's hits: a PrefixMatch's, or a plain list for the one group."""
        if isinstance(computed, PrefixMatch):
            return [list(g) for g in computed.groups]
        if computed and len(self.groups.groups) > 1:
            raise ValueError("a manager with several KV-cache groups takes the PrefixMatch "
                             "lookup_prefix returned, not a plain list of hits")
        return [list(computed)] + [[] for _ in self.groups.groups[1:]]

    def _release_skipped(self, tables: list[Table], num_computed: int) -> None:
        """Free the blocks of sliding groups that no token from `num_computed` on attends to,
        newest first (as `free`), leaving None in their table slots."""
        for group, table in zip(self.groups.groups, tables):
            i = min(group.num_skipped_blocks(num_computed, self.block_size), len(table)) - 1
            done: list[Block] = []
            while i >= 0 and table[i] is not None:  # released blocks form a prefix: stop there
                done.append(table[i])  # type: ignore[arg-type]
                table[i] = None
                i -= 1
            if done:
                self.pool.free_blocks(done)

    # ---- host tier ----------------------------------------------------------------------------
    def _new_blocks(self, n: int) -> list[Block]:
        """Fresh device blocks; cached content they held goes to the host tier first, and what
        that evicts from the host tier to the disk tier (read before the slot is reused)."""
        blocks = self.pool.get_new_blocks(n)
        evicted = self.pool.take_evicted()
        if self.host is not None:
            for block_id, h in evicted:
                slot, victim = self.host.store(h)
                if slot is not None:
                    self.pending_offloads.append((block_id, slot))
                elif h not in self.host:  # every host slot busy this step: straight to disk
                    self._spill("device", block_id, h)
                if victim is not None:
                    self._spill("host", victim[1], victim[0])
        return blocks

    def _spill(self, medium: str, index: int, block_hash: bytes) -> None:
        if self.disk is None:
            return
        if block_hash in self.disk:
            self.disk.touch(block_hash)  # already written once: no copy
        else:
            self.pending_spills.append((medium, index, block_hash))

    def _restore(self, hits: list[PrefixHit], seq: Sequence) -> list[Block]:
        """Device blocks for `hits` in order: device hits as they are, host and disk hits in
        new blocks registered under their hash, with the copies into them queued."""
        host_hits = [h for h in hits if isinstance(h, HostHit)]
        assert self.host is not None or not host_hits  # connector hits need no host tier
        slots = [self.host.restore(h.block_hash)  # type: ignore[union-attr] # pinned first:
                 for h in host_hits]  # the
        num_new = sum(1 for h in hits if not isinstance(h, Block))  # allocation may evict
        fresh = iter(self._new_blocks(num_new))
        at = {h: i for i, h in enumerate(self.hashes.get(seq.seq_id, []))}
        out: list[Block] = []
        for hit in hits:
            if isinstance(hit, Block):
                out.append(hit)
                continue
            b = next(fresh)
            self.pool.cache_block(b, hit.block_hash, *self._lineage(seq, at, hit.block_hash))
            out.append(b)
            if isinstance(hit, DiskHit):
                self.pending_loads.append((hit.payload, b.block_id))
                self.disk.counters.restored += 1  # type: ignore[union-attr]
        restored = [b for b, hit in zip(out, hits) if isinstance(hit, HostHit)]
        self.pending_restores += [(s, b.block_id) for s, b in zip(slots, restored)]
        return out

    def _lineage(self, seq: Sequence, at: dict[bytes, int],
                 block_hash: bytes) -> tuple[bytes | None, list[int]]:
        """(parent hash, tokens) of the seq's plain block at `at[block_hash]`, for its "stored"
        event; (None, []) for another group's key."""
        i = at.get(block_hash)
        if i is None:
            return None, []
        bs = self.block_size
        return (self.hashes[seq.seq_id][i - 1] if i else None), \
            seq.token_range(i * bs, (i + 1) * bs)

    def take_tier_moves(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's (device, host) offloads and (host, device) restores; the runner applies
        the offloads before anything writes the device blocks. Unpins the host slots."""
        out = (self.pending_offloads, self.pending_restores)
        self.pending_offloads, self.pending_restores = [], []
        if self.host is not None:
            self.host.unpin_all()
        return out

    def take_disk_moves(self) -> tuple[list[Spill], list[tuple[bytearray, int]]]:
        """This step's spills to the disk tier, which the runner reads before the step's copies
        reuse those host slots or device blocks, and (payload, device block) loads."""
        out = (self.pending_spills, self.pending_loads)
        self.pending_spills, self.pending_loads = [], []
        return out

    def _copy_on_write(self, table: list[Block]) -> None:
        """The last (partial) block is shared with a sibling: write into a private copy."""
        old = table[-1]
        new = self._new_blocks(1)[0]
        self.pending_copies.append((old.block_id, new.block_id))
        table[-1] = new
        self.pool.free_blocks([old])

    def take_pending_copies(self) -> list[tuple[int, int]]:
        out, self.pending_copies = self.pending_copies, []
        return out

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Share every block of `parent` with `child` (ref counts +1); writes copy on demand."""
        tables = self._tables(parent.seq_id)
        self.pool.touch([b for t in tables for b in t if b is not None])
        self._set_tables(child.seq_id, [list(t) for t in tables])
        self.hashes[child.seq_id] = list(self.hashes.get(parent.seq_id, []))
        self.num_registered[child.seq_id] = self.num_registered.get(parent.seq_id, 0)

    def free(self, seq: Sequence) -> None:
        """Release the seq's blocks (tail first, so its last blocks are evicted first)."""
        tables = self._pop_tables(seq.seq_id)
        self.pool.free_blocks([b for t in tables for b in reversed(t) if b is not None])
        self.hashes.pop(seq.seq_id, None)
        self.num_registered.pop(seq.seq_id, None)
        self.swapped_layout.pop(seq.seq_id, None)
        cpu = self.swapped.pop(seq.seq_id, None)
        if cpu:
            self.cpu_free.extend(cpu)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free the seq's blocks past those holding its first `num_tokens` tokens (speculative
        decoding: the slots of rejected drafts), newest first."""
        keep = -(-num_tokens // self.block_size)
        freed: list[Block] = []
        for table in self._tables(seq.seq_id):
            while len(table) > keep:
                b = table.pop()
                if b is not None:
                    freed.append(b)
        if freed:
            self.pool.free_blocks(freed)

    def block_ids(self, seq: Sequence, group: int = 0) -> list[int]:
        """The seq's block table in `group`; a block a sliding window released reads as 0, a
        slot the kernels never read for that group's layers (they skip or mask it)."""
        tables = self._tables(seq.seq_id)
        if not tables:
            return []
        return [0 if b is None else b.block_id for b in tables[group]]

    # ---- swap ---------------------------------------------------------------------------------
    def _held(self, seq: Sequence) -> list[Block]:
        return [b for t in self._tables(seq.seq_id) for b in t if b is not None]

    def held_blocks(self, seq: Sequence) -> list[Block]:
        """The seq's device blocks in its first group's table order (a KV connector's)."""
        return [b for b in (self._tables(seq.seq_id) or [[]])[0] if b is not None]

    def can_swap_out(self, seq: Sequence) -> bool:
        return len(self._held(seq)) <= len(self.cpu_free)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move the seq's blocks to the CPU pool: (device block, cpu block) pairs to copy."""
        held = self._held(seq)
        tables = self._pop_tables(seq.seq_id)
        cpu = [self.cpu_free.pop() for _ in held]
        self.swapped[seq.seq_id] = cpu
        self.swapped_layout[seq.seq_id] = [[b is not None for b in t] for t in tables]
        self.pool.free_blocks(list(reversed(held)))
        self.num_registered[seq.seq_id] = 0
        return [(b.block_id, c) for b, c in zip(held, cpu)]

    def can_swap_in(self, seq: Sequence, num_new_tokens: int = 0) -> bool:
        """Whether the seq's blocks, and the slots of its next `num_new_tokens`, fit on device."""
        layout = self.swapped_layout.get(seq.seq_id, [])
        needed = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        num_blocks = sum(sum(t) + (max(needed - len(t), 0) if num_new_tokens else 0)
                         for t in layout)
        return num_blocks <= self.pool.num_free_blocks

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Bring the seq's blocks back: (cpu block, device block) pairs to copy."""
        cpu = self.swapped.pop(seq.seq_id)
        fresh = self._new_blocks(len(cpu))
        it = iter(fresh)
        self._set_tables(seq.seq_id, [[next(it) if held else None for held in t]
                                      for t in self.swapped_layout.pop(seq.seq_id)])
        self.cpu_free.extend(cpu)
        return [(c, b.block_id) for c, b in zip(cpu, fresh)]

    # ---- figures ------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def num_blocks_of(self, seq: Sequence) -> int:
        """Device blocks in the seq's block tables (every group)."""
        return len(self._held(seq))

    def usage(self) -> float:
        return self.pool.usage()

    def num_held_blocks(self) -> int:
        """Device blocks this manager's sequences hold (each once): its part of a shared pool."""
        return len({id(b) for t in self.tables.values() for b in t if b is not None}
                   | {id(b) for ts in self.group_tables.values() for t in ts for b in t
                      if b is not None})

    def report_load(self, waiting: bool) -> None:
        """Tell a shared pool whether this model has requests waiting."""
        if self.shared is not None and len(self.shared.members) > 1:
            self.shared.report(self.member, waiting)

    def may_admit(self) -> bool:
        """Whether a new request may take pages now (a shared pool's fairness rule; the pages
        held are counted only while another model waits)."""
        return self.shared is None or self.shared.may_admit(self.member, self.num_held_blocks)

    def allocated_slots(self) -> int:
        """Token slots in blocks held by running sequences (shared blocks counted once)."""
        return (self.pool.num_blocks - self.pool.num_free_blocks) * self.block_size

    def make_stats(self) -> KVCacheStats:
        """A snapshot of the figures; reading it changes nothing (see take_alloc_seconds)."""
        pool, host, disk = self.pool, self.host, self.disk
        return KVCacheStats(
            usage=pool.usage(), num_total_blocks=pool.num_blocks,
            num_free_blocks=pool.num_free_blocks, num_cached_blocks=len(pool.cached),
            num_shared_blocks=pool.num_shared_blocks(), num_evictions=pool.num_evictions,
            num_cpu_blocks=self.num_cpu_blocks, num_free_cpu_blocks=len(self.cpu_free),
            prefix_cache_queries=self.prefix_stats.queries,
            prefix_cache_hits=self.prefix_stats.hits, allocated_slots=self.allocated_slots(),
            prefix_cache_host_hits=self.prefix_stats.host_hits,
            num_host_blocks=host.num_blocks if host else 0,
            num_host_cached_blocks=len(host) if host else 0,
            host=TierCounters(**vars(host.counters)) if host else TierCounters(),
            prefix_cache_disk_hits=self.prefix_stats.disk_hits,
            external_prefix_cache_queries=self.prefix_stats.external_queries,
            external_prefix_cache_hits=self.prefix_stats.external_hits,
            num_disk_blocks=disk.num_blocks if disk else 0,
            num_disk_cached_blocks=len(disk) if disk else 0,
            disk=TierCounters(**vars(disk.counters)) if disk else TierCounters(),
            disk_blocks_dropped=disk.num_dropped if disk else 0,
            disk_bad_files=disk.num_bad_files if disk else 0,
            disk_bytes_written=disk.bytes_written if disk else 0,
            disk_bytes_read=disk.bytes_read if disk else 0)

    def take_alloc_seconds(self) -> list[float]:
        """Durations of the allocate_slots calls since the last take (the newest 4,096 kept)."""
        out = list(self.alloc_seconds)
        self.alloc_seconds.clear()
        return out


def _resumable(found: list[PrefixHit | None], k: int, need: int | None) -> int:
    """The largest k' <= k such that one group can resume after k' cached blocks: all of
    blocks [0, k') present (need None: full attention), or the last `need` of them."""
    if need is None:
        return next((i for i in range(k) if found[i] is None), k)
    if need == 0:
        return k
    run = 0
    for i in range(k - 1, -1, -1):  # from the right, as vLLM's SlidingWindowManager
        run = run + 1 if found[i] is not None else 0
        if run == need:
            return i + need
    return run  # blocks [0, run) are all there, fewer than `need`: the window reaches back to 0
