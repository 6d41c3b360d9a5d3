"""gRPC health (grpc.health.v1) for the GIE protocol's three names: `liveness` serves while the
process answers; `readiness` and the ext_proc service serve once the endpoint source has synced."""

from __future__ import annotations

from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
LIVENESS, READINESS = "liveness", "readiness"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class EppHealth:
    """One HealthServicer shared by the ext_proc port and the health port."""

    def __init__(self) -> None:
        self.servicer = health_aio.HealthServicer()
        self.ready: bool | None = None

    async def start(self) -> None:
        await self.servicer.set(LIVENESS, SERVING)
        await self.set_ready(False)

    async def set_ready(self, ready: bool) -> None:
        if ready == self.ready:
            return
        self.ready = ready
        status = SERVING if ready else NOT_SERVING
        for name in (READINESS, EXT_PROC_SERVICE, ""):
            await self.servicer.set(name, status)

    async def stop(self) -> None:
        await self.servicer.enter_graceful_shutdown()
