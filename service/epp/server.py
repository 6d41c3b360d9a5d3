"""The EPP process: the ext_proc gRPC service and gRPC health on --grpc-port, health alone on
--grpc-health-port (plaintext always, for the kubelet), Prometheus on --metrics-port, over one
Router fed by static endpoints, Redis heartbeats or an InferencePool."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2_grpc
from prometheus_client import start_http_server

from kvserve.service.epp.config import EppConfig
from kvserve.service.epp.endpoints import endpoint_url
from kvserve.service.epp.health import EppHealth
from kvserve.service.epp.metrics import EppMetrics
from kvserve.service.epp.picker import Picker
from kvserve.service.epp.pool import PoolWatcher
from kvserve.service.epp.stream import ExtProcStream
from kvserve.service.epp.tls import self_signed
from kvserve.service.prefix_index.replica_info import ReplicaInfo
from kvserve.service.router.routing import Router

logger = logging.getLogger("kvserve.epp")
# The router refuses to start without replicas; a pool's come later (set_static replaces it).
_POOL_PLACEHOLDER = "http://pool-not-read-yet:0"
STOP_TIMEOUT = 10.0  # seconds SIGTERM gives the servers and the router to close


class ExtProcServicer(pb_grpc.ExternalProcessorServicer):
    """`Process`: one bidirectional stream per HTTP request."""

    def __init__(self, picker: Picker, metrics: EppMetrics) -> None:
        self.picker, self.metrics = picker, metrics

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],
                      context: Any) -> AsyncIterator[pb.ProcessingResponse]:
        stream = ExtProcStream(self.picker, self.metrics)
        self.metrics.streams.inc()
        try:
            async for req in request_iterator:
                for resp in await stream.handle(req):
                    yield resp
        finally:  # Envoy closed the stream (request over, client gone, or an error)
            stream.finish()
            self.metrics.streams.dec()


def router_config(cfg: EppConfig) -> Any:
    """The RouterConfig the EPP scores with: static endpoints become replica URLs."""
    replicas = tuple(endpoint_url(e) for e in cfg.endpoints)
    if not replicas and cfg.pool_name and not cfg.router.redis_url:
        replicas = (_POOL_PLACEHOLDER,)
    return dataclasses.replace(cfg.router, replicas=replicas)


def set_static(router: Router, endpoints: tuple[str, ...]) -> None:
    """Replace the router's static replica set (pool mode without Redis)."""
    block = router.cfg.block_size
    router.replicas.known = {endpoint_url(e): ReplicaInfo(endpoint_url(e), endpoint_url(e), "",
                                                          block) for e in endpoints}
    router.replicas.update_gauges()


class EppServer:
    """Builds and runs everything; `ports` holds the bound ports once started."""

    def __init__(self, cfg: EppConfig) -> None:
        self.cfg = cfg
        self.router = Router(router_config(cfg))
        self.metrics = EppMetrics(self.router.metrics.registry)
        self.picker = Picker(self.router, self.metrics, cfg.objectives, cfg.saturation,
                             cfg.fallback_list)
        self.health = EppHealth()
        self.pool = PoolWatcher(cfg.pool_name, cfg.pool_namespace, self._on_pool,
                                cfg.pool_resync) if cfg.pool_name else None
        self.ports: dict[str, int] = {}
        self.certificate: bytes | None = None  # PEM, with --secure-serving
        self._servers: list[grpc.aio.Server] = []
        self._http: Any = None
        self._task: asyncio.Task | None = None

    def _on_pool(self, endpoints: tuple[str, ...]) -> None:
        self.picker.allowed = frozenset(endpoints)
        if not self.cfg.router.redis_url:
            set_static(self.router, endpoints)

    async def start(self) -> None:
        await self.health.start()
        if self.pool is not None and not self.cfg.router.redis_url:
            set_static(self.router, ())
        await self.router.start()
        if self.pool is not None:
            self.pool.start()
        creds = self._credentials()
        main = self._grpc_server(with_ext_proc=True)
        self.ports["grpc"] = self._bind(main, self.cfg.grpc_port, creds)
        self._servers.append(main)
        if self.cfg.grpc_health_port:
            side = self._grpc_server(with_ext_proc=False)
            # Plaintext even with --secure-serving: the kubelet's gRPC probes cannot speak TLS,
            # and this port carries the health service alone.
            self.ports["health"] = self._bind(side, self.cfg.grpc_health_port, None)
            self._servers.append(side)
        for s in self._servers:
            await s.start()
        if self.cfg.metrics_port:
            self._http, _ = start_http_server(self.cfg.metrics_port, addr=self.cfg.host,
                                              registry=self.metrics.registry)
            self.ports["metrics"] = self._http.server_port
        self._task = asyncio.create_task(self._status_loop())
        logger.info("EPP serving ext_proc on %s:%d (%s), ports %s", self.cfg.host,
                    self.ports["grpc"], "TLS" if creds else "plaintext", self.ports)

    def _grpc_server(self, with_ext_proc: bool) -> grpc.aio.Server:
        server = grpc.aio.server()
        if with_ext_proc:
            pb_grpc.add_ExternalProcessorServicer_to_server(
                ExtProcServicer(self.picker, self.metrics), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, server)
        return server

    def _bind(self, server: grpc.aio.Server, port: int, creds: Any) -> int:
        address = f"{self.cfg.host}:{port}"
        return server.add_secure_port(address, creds) if creds else \
            server.add_insecure_port(address)

    def _credentials(self) -> Any:
        if not self.cfg.secure_serving:
            return None
        key, self.certificate = self_signed(("localhost", "127.0.0.1"))
        return grpc.ssl_server_credentials([(key, self.certificate)])

    def ready(self) -> bool:
        """The endpoint source has synced: Redis answered, the pool was read, or static."""
        if self.pool is not None and not self.pool.synced:
            return False
        return self.router.replicas.redis_up if self.cfg.router.redis_url else True

    async def _status_loop(self) -> None:
        while True:
            await self.health.set_ready(self.ready())
            self.metrics.endpoints.set(self.picker.known_endpoints())
            await asyncio.sleep(0.5)

    async def stop(self, grace: float = 1.0) -> None:
        """Not ready first (probes and Envoy's health check see it), then the servers, then
        the endpoint sources."""
        await self.health.stop()
        if self._task is not None:
            self._task.cancel()
        logger.info("EPP: health NOT_SERVING; stopping gRPC (grace %.1f s)", grace)
        await asyncio.gather(*(s.stop(grace) for s in self._servers))
        if self._http is not None:
            await asyncio.to_thread(self._http.shutdown)
        if self.pool is not None:
            await self.pool.close()
        logger.info("EPP: gRPC stopped; closing the router")
        await self.router.close()


async def serve(cfg: EppConfig) -> None:
    """Run until SIGTERM or SIGINT."""
    server = EppServer(cfg)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("EPP stopping")
    try:
        await asyncio.wait_for(server.stop(), STOP_TIMEOUT)
    except asyncio.TimeoutError:
        logger.warning("EPP: shutdown took over %.0f s; exiting anyway", STOP_TIMEOUT)
    logger.info("EPP stopped")
