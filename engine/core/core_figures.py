"""The engine core's figures: its `EngineStats` snapshot and the prefix-cache hashes a replica
publishes (plain keys only: the router hashes as a one-group engine does)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvserve.engine.core.kv_cache_groups import is_plain_key
from kvserve.engine.core.kv_events import KVEvent
from kvserve.engine.stats import EngineStats


def engine_stats(core: Any) -> EngineStats:
    """`core` (an EngineCore) as one EngineStats, read from its KV manager's snapshot."""
    cache, sch, block_size = core.kv.make_stats(), core.scheduler, core.block_size
    # Group 0's table: one slot per token position, as with one group (other groups' pages
    # hold other layers of the same positions, or none where a window released them).
    seq_slots = sum(len(core.kv.block_ids(s)) for s in sch.running) * block_size
    seq_tokens = sum(s.num_computed_tokens for s in sch.running)
    waste = seq_slots - seq_tokens
    return EngineStats(
        num_running=len(sch.running), num_waiting=len(sch.waiting),
        num_swapped=len(sch.swapped), kv_cache_usage=cache.usage,
        block_size=block_size, num_total_blocks=cache.num_total_blocks,
        num_free_blocks=cache.num_free_blocks, num_cached_blocks=cache.num_cached_blocks,
        num_shared_blocks=cache.num_shared_blocks, num_cpu_blocks=cache.num_cpu_blocks,
        num_free_cpu_blocks=cache.num_free_cpu_blocks,
        prefix_cache_queries=cache.prefix_cache_queries,
        prefix_cache_hits=cache.prefix_cache_hits,
        num_preemptions=sch.num_preemptions, num_evictions=cache.num_evictions,
        kv_slots_used=max(cache.allocated_slots - max(waste, 0), 0),
        kv_slots_allocated=cache.allocated_slots, prompt_tokens=core.prompt_tokens,
        generation_tokens=core.generation_tokens, kv_seq_tokens=seq_tokens,
        kv_seq_slots=seq_slots, prefix_cache_host_hits=cache.prefix_cache_host_hits,
        num_host_blocks=cache.num_host_blocks,
        num_host_cached_blocks=cache.num_host_cached_blocks,
        host_blocks_stored=cache.host.stored, host_blocks_restored=cache.host.restored,
        host_blocks_evicted=cache.host.evicted,
        offload_bytes_to_host=core.tiers.bytes_to_host,
        offload_bytes_to_device=core.tiers.bytes_to_device,
        prefix_cache_disk_hits=cache.prefix_cache_disk_hits,
        num_disk_blocks=cache.num_disk_blocks,
        num_disk_cached_blocks=cache.num_disk_cached_blocks,
        disk_blocks_stored=cache.disk.stored, disk_blocks_restored=cache.disk.restored,
        disk_blocks_evicted=cache.disk.evicted, disk_blocks_dropped=cache.disk_blocks_dropped,
        disk_bad_files=cache.disk_bad_files, offload_bytes_to_disk=cache.disk_bytes_written,
        offload_bytes_from_disk=cache.disk_bytes_read,
        external_prefix_cache_queries=cache.external_prefix_cache_queries,
        external_prefix_cache_hits=cache.external_prefix_cache_hits,
        prompt_tokens_computed=core.prompt_tokens_computed, **transfer_figures(core),
        **_spec_figures(core))


def _spec_figures(core: Any) -> dict[str, Any]:
    """Speculative decoding's counters (none without it)."""
    spec = getattr(core, "spec", None)
    if spec is None:
        return {}
    c = spec.counters
    return dict(spec_decode_num_drafts=c.num_drafts,
                spec_decode_num_draft_tokens=c.num_draft_tokens,
                spec_decode_num_accepted_tokens=c.num_accepted_tokens,
                spec_decode_accepted_per_pos=tuple(c.accepted_per_pos))


def transfer_figures(core: Any) -> dict[str, int]:
    """The KV connector's figures as EngineStats fields (none without a connector)."""
    conn = getattr(core, "kv_connector", None)
    shared = getattr(conn[0], "shared", None) if conn is not None else None
    if shared is None:
        return {}
    f, server = shared.figures, shared.server
    return {"kv_transfer_blocks_received": f.blocks_received,
            "kv_transfer_bytes_received": f.bytes_received,
            "kv_transfer_bytes_tcp": f.bytes_by_transport.get("tcp", 0),
            "kv_transfer_bytes_shm": f.bytes_by_transport.get("shm", 0),
            "kv_transfer_failures": sum(f.failures.values()),
            "kv_transfer_blocks_sent": server.num_blocks_sent if server is not None else 0,
            "kv_transfer_held_requests": len(shared.registry)}


def plain_events(events: list[KVEvent]) -> list[KVEvent]:
    """The events' plain block hashes (group 0's keys); an event naming none is dropped."""
    out: list[KVEvent] = []
    for event in events:
        if event.kind == "cleared":
            out.append(event)
            continue
        keep = tuple(h for h in event.block_hashes if is_plain_key(h))
        if keep:
            out.append(replace(event, block_hashes=keep))
    return out


def cached_block_hashes(kv: Any, medium: str) -> list[str]:
    """Every hash the device pool (or, `medium="host"` / "disk", that tier) holds now."""
    if medium == "host":
        return [h.hex() for h in kv.host.lru_hashes()] if kv.host else []
    if medium == "disk":
        return [h.hex() for h in kv.disk.lru_hashes()] if kv.disk else []
    return [h for h in kv.pool.cached_hashes() if is_plain_key(h)]
