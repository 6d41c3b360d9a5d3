"""RouterConfig: the router's settings, from `kvserve router`'s flags."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.engine.defaults import BLOCK_SIZE
from kvserve.service.limits import RequestLimits
from kvserve.service.router.pd import PDConfig
from kvserve.service.routing_policy import PolicyConfig


@dataclass(frozen=True)
class RouterConfig:
    """How the router finds replicas, chooses among them and talks to them."""

    host: str = "0.0.0.0"
    port: int = 8000
    redis_url: str | None = None
    service_name: str = "default"
    replicas: tuple[str, ...] = ()  # static replica URLs (or the fallback set when Redis is down)
    policy: str = "prefix"
    tokenizer: str | None = None  # path or model name; default: the replicas' model
    session_header: str = "x-session-id"
    policy_cfg: PolicyConfig = field(default_factory=PolicyConfig)
    pd: PDConfig = field(default_factory=PDConfig)  # --policy pd: --pd-threshold etc. (pd.py)
    block_size: int = BLOCK_SIZE  # used for static replicas (Redis replicas announce theirs)
    refresh_interval: float = 1.0
    # --shared-load-interval: how often routers exchange their in-flight counts through Redis
    # (service/router/shared_load.py); 0 = each router counts only its own.
    shared_load_interval: float = 0.1
    down_cooldown: float = 3.0
    connect_timeout: float = 2.0  # --upstream-connect-timeout
    # --upstream-first-byte-timeout: after this long without response headers the router probes
    # the replica's /health (same limit); no answer there either means hung: fail over.
    first_byte_timeout: float = 5.0
    read_timeout: float = 600.0  # between two chunks of a response that has started
    redis_timeout: float = 0.5
    max_body_bytes: int = 1 << 20  # 413 over it, before the body is read
    limits: RequestLimits = field(default_factory=RequestLimits)  # the replicas' caps, checked here
    api_key: str | None = None  # Bearer key clients must send (--api-key / KVSERVE_API_KEY)
    public_paths: tuple[str, ...] = ("/health", "/metrics")
    # x-kvserve-* response headers (chosen replica, predicted cached tokens) tell a client what
    # other tenants' prompts are cached: off unless --expose-routing-headers.
    expose_routing_headers: bool = False
    registration_token: str | None = None  # KVSERVE_REGISTRATION_TOKEN: only signed replicas
    # A signed heartbeat older (or further in the future) than this is a replay or a clock that
    # is off: left out (--heartbeat-max-age; only checked with a registration token).
    heartbeat_max_age: float = 30.0
    shutdown_grace_period: float = 30.0  # SIGTERM: in-flight requests get this long to finish
    # --lora-modules: the LoRA adapters the router may have replicas load, name -> the path a
    # replica loads it from (the same on every replica: the weights cache's mount).
    lora_modules: tuple[tuple[str, str], ...] = ()
    lora_load_timeout: float = 120.0  # --lora-load-timeout: one replica's load of one adapter
    # --migration-limit: times one streamed request may move to another replica when its
    # replica's stream breaks (service/router/migration.py); 0 turns migration off.
    migration_limit: int = 3
    # --migration-max-tokens: a stream longer than this (prompt + delivered tokens) is not
    # migrated (its re-prefill would cost more than a retry); 0 = no limit.
    migration_max_tokens: int = 0
