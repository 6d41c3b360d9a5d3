"""EppConfig: the EPP's settings, from `kvserve epp`'s flags; the scoring is a RouterConfig."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.service.epp.objectives import Objectives, Saturation
from kvserve.service.router.config import RouterConfig


@dataclass(frozen=True)
class EppConfig:
    """Where the EPP listens, where its endpoints come from, and how it picks."""

    host: str = "0.0.0.0"
    grpc_port: int = 9002  # ext_proc (and gRPC health)
    grpc_health_port: int = 9003  # gRPC health alone (kubelet probes); 0: off
    metrics_port: int = 9090  # Prometheus /metrics; 0: off
    endpoints: tuple[str, ...] = ()  # static `ip:port` list
    pool_name: str | None = None  # InferencePool to watch (with pool_namespace)
    pool_namespace: str = "default"
    pool_resync: float = 2.0  # seconds between reads of the pool and its pods
    secure_serving: bool = False  # TLS with a self-signed certificate
    fallback_list: bool = False  # send the ordered list `ip:port,ip:port` (not for ORIGINAL_DST)
    objectives: Objectives = field(default_factory=Objectives)
    saturation: Saturation = field(default_factory=Saturation)
    router: RouterConfig = field(default_factory=RouterConfig)  # scoring and endpoint discovery
