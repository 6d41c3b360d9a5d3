"""The EPP as a real gRPC server on ephemeral ports: the ext_proc stream from a gRPC client,
health for the protocol's three names, Prometheus metrics, TLS with its self-signed certificate."""

from __future__ import annotations

import argparse
import asyncio
import json

import grpc
import httpx
import pytest
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import free_port

from kvserve.service.epp.cli import add_arguments, config_from_args
from kvserve.service.epp.health import EXT_PROC_SERVICE
from kvserve.service.epp.server import EppServer

SERVING = health_pb2.HealthCheckResponse.SERVING


def config(*flags: str):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(
        ["--host", "127.0.0.1", "--grpc-port", "0", "--grpc-health-port", str(free_port()),
         "--metrics-port", str(free_port()), "--endpoints", "127.0.0.1:8101,127.0.0.1:8102",
         *flags]))


def requests(body: bytes):
    first = pb.ProcessingRequest()
    for key, value in ((":path", "/v1/completions"), (":method", "POST")):
        h = first.request_headers.headers.headers.add()
        h.key, h.raw_value = key, value.encode()
    first.protocol_config.request_body_mode = ProcessingMode.FULL_DUPLEX_STREAMED
    first.protocol_config.response_body_mode = ProcessingMode.FULL_DUPLEX_STREAMED
    yield first
    yield pb.ProcessingRequest(request_body=pb.HttpBody(body=body[:5]))
    yield pb.ProcessingRequest(request_body=pb.HttpBody(body=body[5:], end_of_stream=True))


@pytest.fixture
async def epp():
    server = EppServer(config())
    await server.start()
    try:
        yield server
    finally:
        await server.stop(grace=0)


async def wait_ready(channel: grpc.aio.Channel) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    for _ in range(100):
        resp = await stub.Check(health_pb2.HealthCheckRequest(service="readiness"))
        if resp.status == SERVING:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("never ready")


async def test_process_stream_picks_and_echoes_the_body(epp):
    body = json.dumps({"model": "tiny", "prompt": "hello there"}).encode()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{epp.ports['grpc']}") as channel:
        await wait_ready(channel)
        replies = [r async for r in pb_grpc.ExternalProcessorStub(channel).Process(
            requests(body))]
    assert replies[0].HasField("request_headers")
    [opt] = replies[0].request_headers.response.header_mutation.set_headers
    assert opt.header.raw_value.decode() in ("127.0.0.1:8101", "127.0.0.1:8102")
    assert b"".join(r.request_body.response.body_mutation.streamed_response.body
                    for r in replies[1:]) == body
    metrics = httpx.get(f"http://127.0.0.1:{epp.ports['metrics']}/metrics").text
    assert 'kvserve_epp:decisions_total{reason="least-load"} 1.0' in metrics
    assert "kvserve_epp:endpoints 2.0" in metrics
    assert "kvserve_router:requests_total" in metrics  # the router core's own, alongside


async def test_health_names_on_both_ports(epp):
    for port in (epp.ports["grpc"], epp.ports["health"]):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await wait_ready(channel)
            stub = health_pb2_grpc.HealthStub(channel)
            for name in ("liveness", "readiness", EXT_PROC_SERVICE):
                resp = await stub.Check(health_pb2.HealthCheckRequest(service=name))
                assert resp.status == SERVING, (port, name)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Check(health_pb2.HealthCheckRequest(service="nonsense"))
            assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_secure_serving_speaks_tls_with_its_self_signed_certificate():
    server = EppServer(config("--secure-serving"))
    await server.start()
    try:
        assert server.certificate and server.certificate.startswith(b"-----BEGIN CERTIFICATE")
        creds = grpc.ssl_channel_credentials(root_certificates=server.certificate)
        target = f"127.0.0.1:{server.ports['grpc']}"
        async with grpc.aio.secure_channel(target, creds) as channel:
            await wait_ready(channel)
        async with grpc.aio.insecure_channel(target) as channel:
            with pytest.raises(grpc.aio.AioRpcError):
                await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service="liveness"), timeout=2)
        # The health-only port stays plaintext: the kubelet's gRPC probes speak no TLS.
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.ports['health']}") as channel:
            resp = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="liveness"), timeout=5)
            assert resp.status == SERVING
    finally:
        await server.stop(grace=0)
