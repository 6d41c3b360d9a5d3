"""ServerConfig: one server process's HTTP settings, from `kvserve serve`'s flags."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.service.limits import RequestLimits

DEFAULT_PUBLIC_PATHS = ("/health", "/metrics", "/version", "/ping")


@dataclass
class ServerConfig:
    """The HTTP side's settings (the engine's are in EngineConfig)."""

    host: str = "0.0.0.0"
    port: int = 8000
    served_model_names: list[str] = field(default_factory=list)  # [] = the engine's model name
    api_key: str | None = None
    public_paths: tuple[str, ...] = DEFAULT_PUBLIC_PATHS  # open without the API key
    max_waiting: int | None = None
    max_body_bytes: int = 1 << 20
    limits: RequestLimits = field(default_factory=RequestLimits)
    allowed_origins: list[str] = field(default_factory=list)  # CORS off when empty
    shutdown_grace_period: float = 30.0
    log_level: str = "info"
    redis_url: str | None = None
    service_name: str = "default"
    advertise_url: str | None = None
    replica_id: str | None = None
    print_banner: bool = False  # print the curl line and Python snippet once started

