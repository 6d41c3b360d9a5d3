"""Publishing a replica's prefix cache to the Redis index: the publisher when --redis-url is set,
and the engine observer that feeds it after every step."""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kvserve.service.server.config import ServerConfig

logger = logging.getLogger("kvserve.service.api_server")


@dataclass
class PublisherObserver:
    """Feeds the Redis prefix-index publisher from the engine thread (events, load, snapshots)."""

    publisher: Any

    def request_added(self, request_id: str, arrival: float) -> None:
        pass

    def request_aborted(self, request_id: str) -> None:
        pass

    def after_step(self, outputs: list[Any], stats: Any, events: list[Any], engine: Any) -> None:
        snapshot = host = None
        if self.publisher.wants_snapshot():
            snapshot, host = engine.cached_block_hashes(), engine.cached_block_hashes("host")
        self.publisher.on_step(events=events, stats=stats, snapshot=snapshot, host_snapshot=host)


async def stop_advertising(publisher: Any) -> None:
    """Take this replica out of the index at once (a drain): routers stop sending to it on their
    next read of the replica set. Closing the publisher removes its heartbeat, its entry in the
    replica set and its block sets; closing again at shutdown does nothing."""
    try:
        await publisher.close()
    except Exception:  # noqa: BLE001 - best effort: the entries expire with the heartbeat anyway
        logger.exception("prefix index: could not deregister this replica")


def replica_role(kv_transfer_config: Any) -> str:
    """The role a replica announces in its heartbeat (prefill, decode or both) from its
    --kv-transfer-config: a JSON string, a dict or a config object with `kv_role`; None: both."""
    from kvserve.service.prefix_index.replica_info import role_of_kv_role

    cfg = kv_transfer_config
    if isinstance(cfg, str):
        cfg = json.loads(cfg) if cfg.strip() else None
    kv_role = cfg.get("kv_role") if isinstance(cfg, dict) else getattr(cfg, "kv_role", None)
    return role_of_kv_role(kv_role if isinstance(kv_role, str) else None)


def make_publisher(config: ServerConfig, model: str, block_size: int,
                   adapters: Callable[[], Iterable[str]] | None = None,
                   role: str = "both") -> Any:
    """The Redis prefix-index publisher when --redis-url is set (None otherwise); `adapters`
    names the LoRA adapters held now, read at each heartbeat; `role` is the replica's part in
    prefill/decode disaggregation (`replica_role`)."""
    if not config.redis_url:
        return None
    try:
        from kvserve.service.prefix_index.publisher import PrefixIndexPublisher
    except ModuleNotFoundError as exc:
        if exc.name != "kvserve.service.prefix_index.publisher":
            raise
        logger.warning("--redis-url given but kvserve.service.prefix_index is not installed; "
                       "not publishing block hashes")
        return None
    host = socket.gethostname()
    return PrefixIndexPublisher(
        redis_url=config.redis_url, service=config.service_name,
        replica_id=config.replica_id or f"{host}-{config.port}",
        url=config.advertise_url or f"http://{host}:{config.port}", model=model,
        block_size=block_size, adapters=adapters, role=role)

