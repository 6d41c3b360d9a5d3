"""Key names of one service's prefix index in Redis (every key under `kvserve:{<service>}:`).

The braces are a Redis Cluster hash tag: all of a service's keys hash to one slot, so its Lua
scripts and MULTI/EXEC work on a Cluster, and different services spread over the nodes.

    replicas              SET   ids of replicas that heartbeated (swept lazily by the lookup)
    replica:<id>          HASH  url, model, block_size, num_running, num_waiting, kv_cache_usage,
                                heartbeat_at, draining ("1" while the replica drains: routers
                                skip it), signature (hex HMAC-SHA256 of id, url and heartbeat_at
                                under KVSERVE_REGISTRATION_TOKEN; replica_info.py);
                                EXPIREs after `ttl` (3 heartbeats) without a refresh
    blocks:<id>           SET   hex block hashes (engine.block_hash) held in <id>'s device pool;
                                same TTL, refreshed by each heartbeat and each write
    blocks_host:<id>      SET   hex block hashes held in <id>'s host-memory tier (offloaded
                                blocks, --kv-offloading-size): a hit here costs a copy back,
                                not a prefill; same TTL and refresh as `blocks:<id>`

A replica whose heartbeat stops loses its `replica:<id>` hash after the TTL, so the lookup ignores
it (and removes it from `replicas`); its `blocks:<id>` and `blocks_host:<id>`
sets expire at the same time.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class IndexKeys:
    """Key names of one service's index."""

    service: str

    @property
    def prefix(self) -> str:
        return f"kvserve:{{{self.service}}}:"  # {service}: the Cluster hash tag

    @property
    def replicas(self) -> str:
        return self.prefix + "replicas"

    def replica(self, replica_id: str) -> str:
        return f"{self.prefix}replica:{replica_id}"

    def blocks(self, replica_id: str) -> str:
        return f"{self.prefix}blocks:{replica_id}"

    def host_blocks(self, replica_id: str) -> str:
        return f"{self.prefix}blocks_host:{replica_id}"

    def block_sets(self, replica_id: str) -> tuple[str, str]:
        """Both of a replica's block sets (device, host): they live and die together."""
        return self.blocks(replica_id), self.host_blocks(replica_id)
