"""`KVTransferConfig`: vLLM's `--kv-transfer-config` (which connector, this engine's role, the
connector's own settings), parsed from JSON text, a dict or the dataclass and checked."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field, fields
from typing import Any

from kvserve.engine.errors import ConfigError

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass(frozen=True)
class KVTransferConfig:
    """vLLM's field names. `kv_connector`: a registered name (engine/kv_transfer/factory.py) or,
    with `kv_connector_module_path`, a class in that module; `kv_role`: kv_producer (prefill
    replicas), kv_consumer (decode replicas) or kv_both; `kv_connector_extra_config`: the
    connector's own settings; `engine_id`: this engine's name in transfers (default: random)."""

    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_connector_module_path: str | None = None
    engine_id: str = ""
    # vLLM's fields of its P2P connectors, accepted; KVServeConnector reads its port and host
    # from them when kv_connector_extra_config names none.
    kv_ip: str | None = None
    kv_port: int | None = None
    kv_buffer_device: str | None = None
    kv_buffer_size: float | None = None
    kv_rank: int | None = None
    kv_parallel_size: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kv_connector, str) or not self.kv_connector:
            raise ConfigError("kv_transfer_config needs kv_connector: a connector name "
                              "(KVServeConnector, or NixlConnector for llm-d manifests) or a "
                              "class name with kv_connector_module_path")
        if self.kv_role not in KV_ROLES:
            raise ConfigError(f"kv_transfer_config.kv_role must be one of {KV_ROLES}, got "
                              f"{self.kv_role!r}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ConfigError("kv_transfer_config.kv_connector_extra_config must be a JSON "
                              "object")
        if not self.engine_id:
            object.__setattr__(self, "engine_id", uuid.uuid4().hex)

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def extra(self, key: str, default: Any = None) -> Any:
        return self.kv_connector_extra_config.get(key, default)


def parse_kv_transfer_config(value: Any) -> KVTransferConfig | None:
    """A KVTransferConfig from JSON text, a dict or one already made (None stays None);
    ConfigError naming the unknown fields."""
    if value is None or isinstance(value, KVTransferConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"kv_transfer_config must be a JSON object: {exc}") from None
    if hasattr(value, "__dataclass_fields__") and not isinstance(value, dict):
        value = {f.name: getattr(value, f.name) for f in fields(value)}  # vLLM's own dataclass
    if not isinstance(value, dict):
        raise ConfigError(f"kv_transfer_config must be a JSON object, got "
                          f"{type(value).__name__}")
    known = {f.name for f in fields(KVTransferConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConfigError(f"kv_transfer_config: unknown field(s) {unknown}; known: "
                          f"{sorted(known)}")
    return KVTransferConfig(**{k: v for k, v in value.items() if v is not None or k in (
        "kv_connector_module_path",)})
