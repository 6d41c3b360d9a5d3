"""Prefix hit rate of `kvserve epp` against the standalone router on the fleet simulator's workload.

    .venv/bin/python bench/epp_fleet.py --replicas 16 --rounds 3 --qps 8 --requests 300

Envoy cannot reach service/sim/'s replicas (they share one ip:port under path prefixes, and an
ORIGINAL_DST cluster routes by ip:port only), so the EPP side is driven without Envoy: a small
gateway process (`gateway` below) hands each request to the EPP's own ext_proc stream
(service/epp/stream.py over a Picker and a Router, as `kvserve epp --redis-url` builds them) with
the messages Envoy sends in FULL_DUPLEX_STREAMED mode (request headers with the protocol config,
the body in 16 KiB chunks, response headers, every response chunk), forwards what the stream
returns to the replica it picked, and closes the stream when the response ends, so the EPP's
in-flight accounting is the one it has behind Envoy. The only departure from Envoy: the replica
is found by the picked replica id, because the `ip:port` header (checked equal to the replica's)
is the same for every simulated replica. Each round: a fresh redis-server and simulated fleet,
then the router (`kvserve router --policy prefix`) and the EPP gateway in turn (order alternating)
on the same requests and arrival times (bench/fleet.py's `run_once`, same seed). Hit rate =
cached / prompt tokens from the simulated replicas' own counters. Results:
bench/results/epp_fleet.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fleet import (RESULTS, SERVICE, RedisProbe, Workload, _wait_routable, free_port,
                   run_once, start_redis, start_router, stop, wait_port)

CHUNK = 16 << 10  # bytes per request body message, as Envoy reads a downstream body


# ---- the EPP gateway (a separate process, like the router) -------------------------------------
def _headers_message(path: str) -> Any:
    from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    req = pb.ProcessingRequest()
    for key, value in ((":method", "POST"), (":path", path), (":authority", "gateway"),
                       ("content-type", "application/json")):
        h = req.request_headers.headers.headers.add()
        h.key, h.raw_value = key, value.encode()
    req.protocol_config.request_body_mode = ProcessingMode.FULL_DUPLEX_STREAMED
    req.protocol_config.response_body_mode = ProcessingMode.FULL_DUPLEX_STREAMED
    return req


def _returned(replies: list, field: str) -> tuple[bytes, Any]:
    """The body bytes the EPP streamed back (what Envoy forwards) and a headers reply if any."""
    body, headers = b"", None
    for r in replies:
        kind = r.WhichOneof("response")
        if kind == "request_headers":
            headers = r
        elif kind == field:
            body += getattr(r, field).response.body_mutation.streamed_response.body
    return body, headers


async def _body(receive: Any) -> bytes:
    body, more = b"", True
    while more:
        msg = await receive()
        body, more = body + msg.get("body", b""), msg.get("more_body", False)
    return body


class EppGateway:
    """ASGI app: POST -> the EPP's ext_proc stream -> the picked simulated replica; /health and
    /metrics as the router serves them (bench/fleet.py reads both)."""

    def __init__(self, redis_url: str, tokenizer: str) -> None:
        from kvserve.service.epp.metrics import EppMetrics
        from kvserve.service.epp.picker import Picker
        from kvserve.service.router.config import RouterConfig
        from kvserve.service.router.routing import Router

        self.router = Router(RouterConfig(redis_url=redis_url, service_name=SERVICE,
                                          policy="prefix", tokenizer=tokenizer))
        self.metrics = EppMetrics(self.router.metrics.registry)
        self.picker = Picker(self.router, self.metrics)
        self.client: Any = None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["path"] == "/health":
            return await self._json(send, 200, {"replicas": [
                {"id": i.replica_id, "url": i.url} for i in self.router.replicas.routable()]})
        if scope["path"] == "/metrics":
            from prometheus_client import generate_latest
            return await self._raw(send, 200, generate_latest(self.router.metrics.registry),
                                   b"text/plain")
        await self._proxy(scope["path"], await _body(receive), send)

    async def _lifespan(self, receive: Any, send: Any) -> None:
        import httpx

        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await self.router.start()
                self.client = httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(
                    max_connections=4096, max_keepalive_connections=512))
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await self.client.aclose()
                await self.router.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _proxy(self, path: str, body: bytes, send: Any) -> None:
        from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

        from kvserve.service.epp.endpoints import endpoint_of
        from kvserve.service.epp.stream import ExtProcStream

        stream = ExtProcStream(self.picker, self.metrics)
        try:
            replies = await stream.handle(_headers_message(path))
            for i in range(0, len(body), CHUNK):
                replies += await stream.handle(pb.ProcessingRequest(request_body=pb.HttpBody(
                    body=body[i:i + CHUNK], end_of_stream=i + CHUNK >= len(body))))
            if replies and replies[0].HasField("immediate_response"):
                imm = replies[0].immediate_response
                return await self._raw(send, imm.status.code, imm.body, b"application/json")
            forwarded, headers = _returned(replies, "request_body")
            rid = stream.picked.replica_id
            url = self.router.replicas.known[rid].url
            value = headers.request_headers.response.header_mutation.set_headers[0].header
            assert value.raw_value.decode() == endpoint_of(url), (value, url)
            await self._upstream(stream, url + path, forwarded, send)
        finally:
            stream.finish()

    async def _upstream(self, stream: Any, url: str, body: bytes, send: Any) -> None:
        from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

        async with self.client.stream("POST", url, content=body, headers={
                "content-type": "application/json"}) as resp:
            msg = pb.ProcessingRequest()
            h = msg.response_headers.headers.headers.add()
            h.key, h.raw_value = "content-type", resp.headers.get("content-type", "").encode()
            await stream.handle(msg)
            await send({"type": "http.response.start", "status": resp.status_code, "headers": [
                (b"content-type", resp.headers.get("content-type", "").encode())]})
            async for chunk in resp.aiter_raw():
                out, _ = _returned(await stream.handle(pb.ProcessingRequest(
                    response_body=pb.HttpBody(body=chunk))), "response_body")
                await send({"type": "http.response.body", "body": out, "more_body": True})
            out, _ = _returned(await stream.handle(pb.ProcessingRequest(
                response_body=pb.HttpBody(body=b"", end_of_stream=True))), "response_body")
            await send({"type": "http.response.body", "body": out})

    @staticmethod
    async def _raw(send: Any, status: int, body: bytes, ctype: bytes) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", ctype)]})
        await send({"type": "http.response.body", "body": body})

    async def _json(self, send: Any, status: int, obj: Any) -> None:
        await self._raw(send, status, json.dumps(obj).encode(), b"application/json")


def serve_gateway(redis_url: str, tokenizer: str, port: int) -> None:
    import logging

    import uvicorn

    logging.basicConfig(level=logging.WARNING)
    uvicorn.run(EppGateway(redis_url, tokenizer), host="127.0.0.1", port=port,
                log_level="warning", access_log=False, lifespan="on", backlog=4096)


def start_gateway(redis_url: str, tokenizer: str, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "gateway", "--redis-url", redis_url,
                             "--tokenizer", tokenizer, "--port", str(port)],
                            stdout=log.open("ab"), stderr=subprocess.STDOUT)
    wait_port(port, proc, "EPP gateway")
    return proc, f"http://127.0.0.1:{port}"


# ---- the comparison ---------------------------------------------------------------------------
async def one_round(args: argparse.Namespace, seed: int, order: list[str], workdir: Path,
                    tokenizer: str) -> dict[str, dict]:
    from kvserve.service.sim.fleet import SimFleet
    from kvserve.service.sim.timing import timing_model

    w = Workload(tenants=args.tenants, system_tokens=args.system_tokens, seed=seed)
    base = timing_model("h100-llama3-8b")
    blocks = max(int(0.4 * w.tenants * w.system_tokens / base.block_size), 64)
    redis_proc, redis_url = start_redis(workdir)
    out: dict[str, dict] = {}
    try:
        probe = RedisProbe(redis_url)
        fleet = SimFleet(args.replicas, base.scaled(args.time_scale, blocks),
                         redis_url=redis_url, service=SERVICE)
        await fleet.start()
        try:
            for name in order:
                out[name] = await _run(args, name, fleet, w, probe, redis_url, workdir,
                                       tokenizer)
        finally:
            await fleet.close()
    finally:
        stop(redis_proc)
    return out


async def _run(args: argparse.Namespace, name: str, fleet: Any, w: Workload, probe: Any,
               redis_url: str, workdir: Path, tokenizer: str) -> dict:
    start = start_router if name == "router" else \
        (lambda url, _policy, tok, log: start_gateway(url, tok, log))
    proc, url = await asyncio.to_thread(start, redis_url, "prefix", tokenizer,
                                        workdir / f"{name}.log")
    try:
        await _wait_routable([url], args.replicas)
        # `name` as the run's policy label: neither "prefix" (no index probe) nor "oracle".
        res = await run_once(fleet, name, [url], args.qps, w, 0.0, 0.0, probe,
                             "smollm2-135m-instruct", args.requests, args.warmup_requests)
    finally:
        await asyncio.to_thread(stop, proc)
    row = {"hit_rate": res.hit_rate, "completed": res.completed, "errors": res.errors,
           "ttft_p50_s": res.ttft_p50, "requests_cv": res.requests_cv,
           "decision_p50_ms": res.decision_p50_ms}
    print(f"    {name:<6} hit {100 * res.hit_rate:.2f}%  done {res.completed} err {res.errors} "
          f"ttft50 {res.ttft_p50:.3f} s  reqCV {res.requests_cv:.2f}", flush=True)
    return row


def compare(args: argparse.Namespace) -> dict:
    from kvserve.engine.worker.model_loader import resolve_model

    tokenizer = str(resolve_model("smollm2-135m-instruct"))
    rounds = []
    with tempfile.TemporaryDirectory(prefix="kvserve-epp-fleet-") as tmp:
        for r in range(args.rounds):
            order = ["router", "epp"] if r % 2 == 0 else ["epp", "router"]
            print(f"  round {r + 1} (seed {r}, order {order}):", flush=True)
            rounds.append(asyncio.run(one_round(args, r, order, Path(tmp), tokenizer)))
    diffs = [100 * (x["epp"]["hit_rate"] - x["router"]["hit_rate"]) for x in rounds]
    summary = {k: {"hit_rate_median": statistics.median(x[k]["hit_rate"] for x in rounds),
                   "hit_rate_range": [min(x[k]["hit_rate"] for x in rounds),
                                      max(x[k]["hit_rate"] for x in rounds)]}
               for k in ("router", "epp")}
    summary["epp_minus_router_points"] = diffs
    print(f"  EPP - router, hit-rate points per round: {[f'{d:+.2f}' for d in diffs]}")
    return {"date": time.strftime("%Y-%m-%d"), "args": vars(args), "rounds": rounds,
            "summary": summary}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd")
    g = sub.add_parser("gateway", help="(internal) serve the EPP gateway")
    g.add_argument("--redis-url", required=True)
    g.add_argument("--tokenizer", required=True)
    g.add_argument("--port", type=int, required=True)
    p.add_argument("--replicas", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--qps", type=float, default=8.0)
    p.add_argument("--requests", type=int, default=300, help="requests per run")
    p.add_argument("--warmup-requests", type=int, default=60, help="of which left out")
    p.add_argument("--tenants", type=int, default=Workload.tenants)
    p.add_argument("--system-tokens", type=int, default=Workload.system_tokens)
    p.add_argument("--time-scale", type=float, default=40.0)
    p.add_argument("--out", type=Path, default=RESULTS / "epp_fleet.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.cmd == "gateway":
        return serve_gateway(args.redis_url, args.tokenizer, args.port)
    print(f"prefix hit rate, router vs EPP, {args.replicas} simulated replicas:")
    result = compare(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
