"""What a replica's heartbeat tells the router: its URL, model, block size and load."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# The heartbeat hash's fields (service/prefix_index/keys.py), in the order the lookup returns them.
INFO_FIELDS = ("url", "model", "block_size", "num_running", "num_waiting", "kv_cache_usage",
               "heartbeat_at")


@dataclass(frozen=True)
class ReplicaInfo:
    """What a replica's last heartbeat said."""

    replica_id: str
    url: str
    model: str
    block_size: int
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    heartbeat_at: float = 0.0

    @property
    def load(self) -> int:
        return self.num_running + self.num_waiting


    @classmethod
    def from_fields(cls, replica_id: str, values: Sequence[Any]) -> ReplicaInfo:
        """From the heartbeat hash's values in INFO_FIELDS order (bytes or str, as Redis gives)."""
        f = dict(zip(INFO_FIELDS, (v.decode() if isinstance(v, bytes) else str(v)
                                   for v in values)))
        return cls(
            replica_id=replica_id, url=f["url"], model=f["model"],
            block_size=int(f["block_size"] or 16), num_running=int(f["num_running"] or 0),
            num_waiting=int(f["num_waiting"] or 0), kv_cache_usage=float(f["kv_cache_usage"] or 0),
            heartbeat_at=float(f["heartbeat_at"] or 0))
