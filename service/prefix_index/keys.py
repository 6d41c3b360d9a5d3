"""Key names of one service's prefix index in Redis (every key under `kvserve:{<service>}:`).

The braces are a Redis Cluster hash tag: all of a service's keys hash to one slot, so its Lua
scripts work on a Cluster, and different services spread over the nodes.

    replicas              SET   ids of replicas that heartbeated (swept by the routers' scans)
    replica:<id>          HASH  url, model, block_size, num_running, num_waiting, kv_cache_usage,
                                heartbeat_at, draining ("1" while the replica drains: routers
                                skip it), signature (hex HMAC-SHA256 of id, url and heartbeat_at
                                under KVSERVE_REGISTRATION_TOKEN; replica_info.py),
                                adapters (JSON list of the LoRA adapters it holds; absent: none),
                                role (prefill, decode or both: its --kv-transfer-config's
                                kv_role; absent: both);
                                EXPIREs after `ttl` (3 heartbeats) without a refresh
    h:<hash>              SET   the inverted index: who holds block <hash> (engine.block_hash,
                                32 hex digits), as integers 2*slot (device pool) and 2*slot+1
                                (host-memory tier); small integer sets are Redis intsets
    blocks:<id>           SET   hex block hashes in <id>'s device pool: the replica's own list,
                                kept in step with `h:*` by the same scripts, so its entries can
                                be taken out again (an eviction, a clear, its death)
    blocks_host:<id>      SET   the same for <id>'s host-memory tier (--kv-offloading-size)
    slots                 HASH  replica id -> slot (a small integer, allocated once per id)
    slot_ids              HASH  slot -> replica id
    next_slot             STRING the last slot allocated (INCR)
    dead                  SET   ids whose heartbeat expired (or that closed) while their entries
                                remain: each router scan takes a bounded number of them out

A replica whose heartbeat stops loses its `replica:<id>` hash after the TTL; the next router scan
moves it from `replicas` to `dead` and the scans remove its entries in bounded steps (its block
sets do not expire on their own: they are what says which `h:*` entries to clean).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class IndexKeys:
    """Key names of one service's index."""

    service: str

    def __post_init__(self) -> None:
        # An empty name would make the empty hash tag `{}`, which Redis Cluster ignores (the keys
        # would scatter over slots); braces inside would cut the tag short.
        if not self.service or "{" in self.service or "}" in self.service:
            raise ValueError(f"--service-name: a service name must be non-empty and without "
                             f"braces (it is the Redis Cluster hash tag), got {self.service!r}")

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

    def holders(self, block_hash: str) -> str:
        return f"{self.prefix}h:{block_hash}"

    @property
    def slots(self) -> str:
        return self.prefix + "slots"

    @property
    def dead(self) -> str:
        return self.prefix + "dead"
