"""EngineStats: a snapshot of the engine's scheduler and KV-cache figures (for metrics, routing)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_cache_usage: float  # fraction of blocks referenced by live sequences, 0..1
    block_size: int
    num_total_blocks: int
    num_free_blocks: int
    num_cached_blocks: int  # blocks holding a hash in the prefix cache (in use or free)
    num_shared_blocks: int  # blocks referenced by more than one sequence
    num_cpu_blocks: int
    num_free_cpu_blocks: int
    prefix_cache_queries: int  # cumulative prompt tokens looked up
    prefix_cache_hits: int  # cumulative prompt tokens found cached
    num_preemptions: int  # cumulative
    num_evictions: int  # cumulative cached blocks evicted
    kv_slots_used: int  # token slots of held blocks that hold computed tokens
    kv_slots_allocated: int  # token slots of held blocks
    prompt_tokens: int  # cumulative prompt tokens of admitted requests
    generation_tokens: int  # cumulative generated tokens
    # Per sequence (a shared block counted once for each sequence using it): what each request
    # sees of its own block table.
    kv_seq_tokens: int = 0  # computed tokens of the running sequences
    kv_seq_slots: int = 0  # token slots of their block tables
    # KV host tier (kv_offloading_size); prefix_cache_hits counts its hits too.
    prefix_cache_host_hits: int = 0  # cumulative prompt tokens restored from the host tier
    num_host_blocks: int = 0
    num_host_cached_blocks: int = 0
    host_blocks_stored: int = 0  # cumulative blocks written to the host tier
    host_blocks_restored: int = 0  # cumulative blocks copied back to the device
    host_blocks_evicted: int = 0  # cumulative blocks dropped from the host tier
    offload_bytes_to_host: int = 0  # cumulative, offloads and swap-outs, all ranks
    offload_bytes_to_device: int = 0  # cumulative, restores and swap-ins, all ranks
    # KV disk tier (kv_offloading_disk_path); prefix_cache_hits counts its hits too.
    prefix_cache_disk_hits: int = 0  # cumulative prompt tokens loaded from the disk tier
    num_disk_blocks: int = 0
    num_disk_cached_blocks: int = 0
    disk_blocks_stored: int = 0  # cumulative blocks queued for writing to the disk tier
    disk_blocks_restored: int = 0  # cumulative blocks loaded back to the device
    disk_blocks_evicted: int = 0  # cumulative blocks deleted to stay under the cap
    disk_blocks_dropped: int = 0  # cumulative blocks not written: the writer was behind
    disk_bad_files: int = 0  # cumulative reads of a missing or damaged file (misses)
    offload_bytes_to_disk: int = 0
    offload_bytes_from_disk: int = 0
    # Speculative decoding (engine/spec_decode/), cumulative: vLLM's spec_decode_* counters
    spec_decode_num_drafts: int = 0  # (request, step) pairs that scored at least one draft
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_accepted_per_pos: tuple[int, ...] = ()  # accepted drafts by position (0: first)
    # A KV connector (engine/kv_transfer/): vLLM's external prefix cache (prompt tokens of the
    # requests asked about, and those it supplied; not in prefix_cache_hits), and its transfers
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    kv_transfer_blocks_received: int = 0  # cumulative blocks pulled and loaded
    kv_transfer_bytes_received: int = 0
    kv_transfer_bytes_tcp: int = 0  # of those, pulled as TCP frames
    kv_transfer_bytes_shm: int = 0  # of those, pulled through shared memory (one host)
    kv_transfer_blocks_sent: int = 0  # cumulative blocks served to decode replicas
    kv_transfer_failures: int = 0  # cumulative pulls that fell back to local prefill
    kv_transfer_held_requests: int = 0  # finished requests whose blocks wait to be pulled
    prompt_tokens_computed: int = 0  # cumulative prompt positions the model ran (not cached)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def cpu_cache_usage(self) -> float:
        """Host blocks in use (swap pool and host tier together), 0..1; 0 with neither."""
        total = self.num_cpu_blocks + self.num_host_blocks
        used = self.num_cpu_blocks - self.num_free_cpu_blocks + self.num_host_cached_blocks
        return used / total if total else 0.0

    @property
    def kv_slot_utilization(self) -> float:
        """Real tokens / allocated slots (1.0 = no slot wasted); 1.0 when nothing is held."""
        return self.kv_slots_used / self.kv_slots_allocated if self.kv_slots_allocated else 1.0

    @property
    def kv_seq_slot_utilization(self) -> float:
        """Per-sequence view: each request's tokens / the slots of its own block table (a shared
        prefix block counts for every request reading it); 1.0 when nothing runs."""
        return self.kv_seq_tokens / self.kv_seq_slots if self.kv_seq_slots else 1.0


class TierFigures:
    """Bytes moved between device and host (all ranks) and the restores' durations, as the
    model runner reports its copies; the engine keeps one."""

    def __init__(self) -> None:
        self.bytes_to_host = 0  # offloads and swap-outs
        self.bytes_to_device = 0  # restores and swap-ins
        self._restore_seconds: list[float] = []

    def add(self, kind: str, num_bytes: int, seconds: float) -> None:
        if kind in ("offload", "swap_out"):
            self.bytes_to_host += num_bytes
        else:
            self.bytes_to_device += num_bytes
        if kind == "restore":
            self._restore_seconds.append(seconds)
            del self._restore_seconds[:-4096]  # undrained (offline use): the newest kept

    def take_restore_seconds(self) -> list[float]:
        out, self._restore_seconds = self._restore_seconds, []
        return out
