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

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def kv_slot_utilization(self) -> float:
        """Real tokens / allocated slots (1.0 = no slot wasted); 1.0 when nothing is held."""
        return self.kv_slots_used / self.kv_slots_allocated if self.kv_slots_allocated else 1.0

    @property
    def kv_seq_slot_utilization(self) -> float:
        """Per-sequence view: each request's tokens / the slots of its own block table (a shared
        prefix block counts for every request reading it); 1.0 when nothing runs."""
        return self.kv_seq_tokens / self.kv_seq_slots if self.kv_seq_slots else 1.0
