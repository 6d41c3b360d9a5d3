"""Key names of one service's prefix index in Redis (every key under `kvserve:<service>:`).

    replicas              SET   ids of replicas that heartbeated (swept lazily by the lookup)
    replica:<id>          HASH  url, model, block_size, num_running, num_waiting, kv_cache_usage,
                                heartbeat_at, draining ("1" while the replica drains: routers
                                skip it), signature (hex HMAC-SHA256 of id, url and heartbeat_at
                                under KVSERVE_REGISTRATION_TOKEN; replica_info.py);
                                EXPIREs after `ttl` (3 heartbeats) without a refresh
    blocks:<id>           SET   hex block hashes (engine.block_hash) held in <id>'s prefix cache;
                                same TTL, refreshed by each heartbeat and each write

A replica whose heartbeat stops loses its `replica:<id>` hash after the TTL, so the lookup ignores
it (and removes it from `replicas`); its `blocks:<id>` set expires at the same time.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class IndexKeys:
    """Key names of one service's index."""

    service: str

    @property
    def prefix(self) -> str:
        return f"kvserve:{self.service}:"

    @property
    def replicas(self) -> str:
        return self.prefix + "replicas"

    def replica(self, replica_id: str) -> str:
        return f"{self.prefix}replica:{replica_id}"

    def blocks(self, replica_id: str) -> str:
        return f"{self.prefix}blocks:{replica_id}"

