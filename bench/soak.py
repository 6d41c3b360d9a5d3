"""Soak: N concurrent streaming clients with random disconnects and hostile requests mixed in,
against one `kvserve serve` replica (and, with --router, the router in front of it), for a bounded
time. What a replica must survive on a shared platform, counted:

  completed      normal requests that streamed to [DONE]
  lost           normal requests that got an error or a cut stream they did not cause (must be 0)
  5xx            any response >= 500, hostile requests included (must be 0)
  hostile 4xx    hostile requests refused as they should be
  leaked blocks  KV cache usage once every request has ended (must be 0)
  RSS growth     the server's resident memory after the soak minus after the warm-up
  /health p99    polled every 0.2 s throughout: the event loop stays responsive

    python bench/soak.py [--duration 60] [--clients 16] [--model smollm2-135m-instruct] [--router]
    python bench/soak.py --json-out /tmp/soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

HOSTILE: list[tuple[str, bytes]] = [
    ("nan temperature", b'{"model":"M","prompt":"hi","temperature":NaN}'),
    ("infinite top_p", b'{"model":"M","prompt":"hi","top_p":Infinity}'),
    ("seed beyond 64 bits", b'{"model":"M","prompt":"hi","seed":' + str(2**70).encode() + b"}"),
    ("deep nesting", b'{"model":"M","prompt":"hi","x":' + b"[" * 5000 + b"]" * 5000 + b"}"),
    ("invalid utf-8", b'{"model":"M","prompt":"\xff\xfe hi"}'),
    ("lone surrogate", b'{"model":"M","prompt":"\\ud800"}'),
    ("too many prompts", json.dumps({"model": "M", "prompt": ["hi"] * 10_000}).encode()),
    ("huge n", b'{"model":"M","prompt":"hi","n":100000}'),
    ("huge logprobs", b'{"model":"M","prompt":"hi","logprobs":100000}'),
    ("token id out of vocab", b'{"model":"M","prompt":[999999999]}'),
    ("negative max_tokens", b'{"model":"M","prompt":"hi","max_tokens":-5}'),
    ("wrong types", b'{"model":"M","prompt":{"a":1},"max_tokens":"many"}'),
    ("not json", b"this is not json"),
    ("unknown model", b'{"model":"no-such-model","prompt":"hi"}'),
    ("beam search", b'{"model":"M","prompt":"hi","use_beam_search":true}'),
    ("body over the cap", b'{"model":"M","prompt":"' + b"a" * (3 << 20) + b'"}'),
]


args_rss_every = 15.0  # seconds between RSS samples


@dataclass
class Tally:
    completed: int = 0
    lost: int = 0
    disconnects: int = 0
    hostile_4xx: int = 0
    status_5xx: int = 0
    unexpected: list[str] = field(default_factory=list)
    health_ms: list[float] = field(default_factory=list)
    rss_mib: list[float] = field(default_factory=list)
    request_s: list[float] = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kvserve_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("kvserve")
    return [str(exe)] if exe.exists() else [shutil.which("kvserve") or "kvserve"]


async def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"{url}: process exited with {proc.returncode}")
            try:
                if (await client.get(url + "/health", timeout=2)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)
    raise SystemExit(f"{url} not ready after {timeout} s")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def normal(client: httpx.AsyncClient, url: str, model: str, rng: random.Random,
                 tally: Tally) -> None:
    body = {"model": model, "stream": True, "max_tokens": rng.randint(8, 48),
            "temperature": rng.choice([0.0, 0.7, 1.0]),
            "messages": [{"role": "user", "content": f"Tell me about item {rng.randint(0, 999)}."}]}
    cut_after = rng.randint(1, 6) if rng.random() < 0.15 else None
    t0 = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body,
                                 timeout=120) as resp:
            if resp.status_code >= 500:
                tally.status_5xx += 1
            if resp.status_code != 200:
                tally.lost += 1
                tally.unexpected.append(f"normal request: {resp.status_code}")
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    tally.completed += 1
                    tally.request_s.append(time.perf_counter() - t0)
                    return
                if '"error"' in line:
                    tally.lost += 1
                    tally.unexpected.append(f"stream error event: {line[:200]}")
                    return
                chunks += 1
                if cut_after is not None and chunks >= cut_after:
                    tally.disconnects += 1  # leaving the block closes the connection
                    return
        tally.lost += 1
        tally.unexpected.append("stream ended without [DONE]")
    except httpx.HTTPError as exc:
        tally.lost += 1
        tally.unexpected.append(f"normal request: {exc!r}")


async def hostile(client: httpx.AsyncClient, url: str, model: str, rng: random.Random,
                  tally: Tally) -> None:
    name, raw = rng.choice(HOSTILE)
    path = rng.choice(["/v1/completions", "/v1/chat/completions"])
    if path.endswith("chat/completions"):
        # a chat request that turns out valid must stay short: chat has no default max_tokens
        raw = raw.replace(b'"prompt":', b'"max_tokens":16,"messages":[{"role":"user","content":"x"}],'
                                        b'"p":')
    raw = raw.replace(b'"model":"M"', b'"model":"' + model.encode() + b'"')
    try:
        resp = await client.post(url + path, content=raw, timeout=60,
                                 headers={"content-type": "application/json"})
    except httpx.HTTPError as exc:
        tally.unexpected.append(f"hostile {name}: {exc!r}")
        return
    if resp.status_code >= 500:
        tally.status_5xx += 1
        tally.unexpected.append(f"hostile {name}: {resp.status_code} {resp.text[:200]}")
    elif 400 <= resp.status_code < 500:
        tally.hostile_4xx += 1
    # a 200 is fine where the case is a valid request on that path (e.g. an ignored extra field)


async def client_loop(url: str, model: str, seed: int, until: float, tally: Tally) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient() as client:
        while time.monotonic() < until:
            if rng.random() < 0.2:
                await hostile(client, url, model, rng, tally)
            else:
                await normal(client, url, model, rng, tally)


async def health_loop(url: str, until: float, tally: Tally, pid: int) -> None:
    next_rss = time.monotonic()
    async with httpx.AsyncClient() as client:
        while time.monotonic() < until:
            if time.monotonic() >= next_rss:  # the trend tells warm-up from a leak
                tally.rss_mib.append(round(rss_mib(pid), 1))
                next_rss += args_rss_every

            t0 = time.perf_counter()
            try:
                resp = await client.get(url + "/health", timeout=10)
                if resp.status_code >= 500:
                    tally.status_5xx += 1
            except httpx.HTTPError as exc:
                tally.unexpected.append(f"/health: {exc!r}")
            tally.health_ms.append(1e3 * (time.perf_counter() - t0))
            await asyncio.sleep(0.2)


async def metric(url: str, name: str) -> float:
    async with httpx.AsyncClient() as client:
        text = (await client.get(url + "/metrics", timeout=10)).text
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


async def settle(replica: str, timeout: float = 60) -> None:
    """Wait for every request to end (disconnected ones are aborted by the server)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (await metric(replica, "vllm:num_requests_running")
                + await metric(replica, "vllm:num_requests_waiting")) == 0:
            return
        await asyncio.sleep(0.5)


async def soak(args: argparse.Namespace, replica: str, entry: str, pid: int) -> dict:
    tally = Tally()
    warm_until = time.monotonic() + 5
    await asyncio.gather(*(client_loop(entry, args.model, 1000 + i, warm_until, Tally())
                           for i in range(2)))
    await settle(replica)
    rss0 = rss_mib(pid)
    until = time.monotonic() + args.duration
    await asyncio.gather(health_loop(entry, until, tally, pid),
                         *(client_loop(entry, args.model, i, until, tally)
                           for i in range(args.clients)))
    await settle(replica)
    usage = await metric(replica, "vllm:kv_cache_usage_perc")
    total = await metric(replica, "kvserve:total_blocks")
    health = sorted(tally.health_ms)
    return {"clients": args.clients, "duration_s": args.duration, "router": args.router,
            "completed": tally.completed, "lost": tally.lost, "status_5xx": tally.status_5xx,
            "hostile_4xx": tally.hostile_4xx, "disconnects": tally.disconnects,
            "leaked_blocks": round(usage * total), "rss_growth_mib": round(rss_mib(pid) - rss0, 1),
            "health_p50_ms": round(statistics.median(health), 1),
            "health_p99_ms": round(health[int(0.99 * (len(health) - 1))], 1),
            "request_p99_s": round(sorted(tally.request_s)[int(0.99 * (len(tally.request_s) - 1))],
                                   2) if tally.request_s else None,
            "rss_trend_mib": tally.rss_mib, "unexpected": tally.unexpected[:20]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--router", action="store_true", help="a redis-server and the router in front")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    procs: list[subprocess.Popen] = []
    port = free_port()
    replica = f"http://127.0.0.1:{port}"
    cmd = kvserve_cmd() + ["serve", args.model, "--port", str(port), "--max-body-bytes", "2MiB",
                           "--max-num-seqs", "32"]
    entry = replica
    tmp = tempfile.mkdtemp(prefix="kvserve-soak-")
    try:
        if args.router:
            rport, router_port = free_port(), free_port()
            procs.append(subprocess.Popen(["redis-server", "--port", str(rport), "--save", "",
                                           "--dir", tmp], stdout=subprocess.DEVNULL))
            redis_url = f"redis://127.0.0.1:{rport}/0"
            cmd += ["--redis-url", redis_url, "--service-name", "soak"]
            entry = f"http://127.0.0.1:{router_port}"
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        server = procs[-1]
        asyncio.run(wait_ready(replica, server))
        if args.router:
            procs.append(subprocess.Popen(
                kvserve_cmd() + ["router", "--port", str(router_port), "--redis-url", redis_url,
                                 "--service-name", "soak", "--max-body-bytes", "2MiB"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            asyncio.run(wait_ready(entry, procs[-1]))
            time.sleep(2)  # the router's replica set refreshes from heartbeats
        result = asyncio.run(soak(args, replica, entry, server.pid))
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{'completed':>10} {'lost':>5} {'5xx':>4} {'hostile 4xx':>11} {'disconnects':>11} "
          f"{'leaked blk':>10} {'RSS +MiB':>8} {'/health p50/p99 ms':>19}")
    print(f"{result['completed']:>10} {result['lost']:>5} {result['status_5xx']:>4} "
          f"{result['hostile_4xx']:>11} {result['disconnects']:>11} {result['leaked_blocks']:>10} "
          f"{result['rss_growth_mib']:>8} {result['health_p50_ms']:>9}/{result['health_p99_ms']}")
    print("server RSS every 15 s (MiB):", " ".join(str(r) for r in result["rss_trend_mib"]))
    for line in result["unexpected"]:
        print("unexpected:", line)
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1))
    bad = result["lost"] or result["status_5xx"] or result["leaked_blocks"]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
