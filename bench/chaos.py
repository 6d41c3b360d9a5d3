"""Chaos: SIGKILL a replica under a streaming soak through the router, and count what the clients
lose. Two `kvserve serve` replicas behind `kvserve router` (static replicas, least load); N
clients stream chat completions back to back; `--kill-at` seconds in, the replica serving the
most streams is killed. Per round, with request migration on (--migration-limit) and off (0):

  lost            streams that ended with an error event or were cut (goal with migration: 0)
  on victim       streams in flight on the killed replica at the kill
  gap p50/p99     for those streams, the pause between the last chunk before the kill and the
                  first after it (what a migrated stream's client waits), vs the soak's ITL p50
  tok/s before    chunks per second over the `--window` seconds before the kill and after it
  re-prefill      per migrated stream, the tokens its continuation re-prefills (prompt + the
                  tokens delivered before the kill, from the stream's usage and chunks) and the
                  gap's excess over the ITL p50; on the surviving replica, prompt tokens
                  prefilled per second and its prefix-cache hit rate, the window before the
                  kill vs after (its counters)

    python bench/chaos.py [--model smollm2-135m-instruct] [--clients 48] [--rounds 3]
                          [--duration 40] [--kill-at 15] [--json-out bench/results/chaos.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

TOPICS = ["paged attention", "prefix caching", "speculative decoding", "tensor parallelism",
          "KV cache offloading", "continuous batching", "quantisation", "LoRA adapters"]


@dataclass
class Stream:
    start: float
    replica: str = ""
    times: list[float] = field(default_factory=list)  # arrival of each content chunk
    end: float | None = None
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0  # from the usage chunk


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kvserve_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("kvserve")
    return [str(exe)] if exe.exists() else [shutil.which("kvserve") or "kvserve"]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url}: process exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} not ready after {timeout} s")


def start(args: argparse.Namespace, limit: int, tmp: Path) -> tuple[list[subprocess.Popen], str]:
    """Two replicas and a router; the processes (replicas first) and the router's URL."""
    procs, urls = [], []
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    for i in range(2):
        port = free_port()
        urls.append(f"http://127.0.0.1:{port}")
        procs.append(subprocess.Popen(
            kvserve_cmd() + ["serve", args.model, "--port", str(port), "--host", "127.0.0.1",
                             "--max-num-seqs", str(args.clients), "--dtype", "float32"],
            stdout=(tmp / f"replica{i}.log").open("w"), stderr=subprocess.STDOUT, env=env))
    rport = free_port()
    procs.append(subprocess.Popen(
        kvserve_cmd() + ["router", "--port", str(rport), "--host", "127.0.0.1", "--replicas",
                         ",".join(urls), "--policy", "least-load", "--expose-routing-headers",
                         "--migration-limit", str(limit), "--log-level", "warning"],
        stdout=(tmp / "router.log").open("w"), stderr=subprocess.STDOUT))
    for url, proc in zip([*urls, f"http://127.0.0.1:{rport}"], procs):
        wait_ready(url, proc)
    return procs, f"http://127.0.0.1:{rport}"


async def one(client: httpx.AsyncClient, url: str, model: str, i: int, max_tokens: int,
              s: Stream) -> None:
    """One streamed chat completion, booked into `s` as it arrives."""
    body = {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream_options": {"include_usage": True}, "messages": [
                {"role": "user", "content": f"Explain {TOPICS[i % len(TOPICS)]} ({i})."}]}
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            s.replica = resp.headers.get("x-kvserve-replica", "")
            async for line in resp.aiter_lines():
                if line == "data: [DONE]":
                    s.ok = not s.error
                    break
                if line.startswith("data: {\"error\""):
                    s.error = line[6:200]
                elif line.startswith("data: "):
                    now, data = time.monotonic(), json.loads(line[6:])
                    if data.get("choices"):
                        s.times.append(now)
                    if data.get("usage"):
                        s.prompt_tokens = data["usage"]["prompt_tokens"]
    except httpx.HTTPError as exc:
        s.error = f"{type(exc).__name__}: {exc}"
    s.end = time.monotonic()


async def soak(args: argparse.Namespace, url: str, procs: list[subprocess.Popen],
               urls: list[str]) -> tuple[list[Stream], float, str, list[dict[str, float]]]:
    """Clients loop until the duration is over; the kill happens at `kill_at`."""
    t0 = time.monotonic()
    streams: list[Stream] = []
    killed: list[tuple[float, str]] = []
    counters: list[dict[str, float]] = []  # the survivor's, window before, at and after the kill

    async def client_loop(c: int, client: httpx.AsyncClient) -> None:
        n = 0
        while time.monotonic() - t0 < args.duration:
            streams.append(s := Stream(time.monotonic()))
            await one(client, url, args.model, c * 1000 + n, args.max_tokens, s)
            n += 1

    async def killer() -> None:
        await asyncio.sleep(max(0.0, args.kill_at - args.window))
        early = {u: await scrape(u) for u in urls}  # a window before the kill
        await asyncio.sleep(max(0.0, t0 + args.kill_at - time.monotonic()))
        running = [s.replica for s in list(streams) if s.end is None]
        victim = max(urls, key=running.count)
        survivor = next(u for u in urls if u != victim)
        at = await scrape(survivor)
        procs[urls.index(victim)].send_signal(signal.SIGKILL)
        killed.append((time.monotonic(), victim))
        await asyncio.sleep(args.window)
        counters.extend([early[survivor], at, await scrape(survivor)])

    limits = httpx.Limits(max_connections=args.clients + 4)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        await asyncio.gather(killer(), *(client_loop(c, client) for c in range(args.clients)))
    return streams, killed[0][0], killed[0][1], counters


COUNTERS = ("vllm:prompt_tokens_total", "vllm:prefix_cache_queries_total",
            "vllm:prefix_cache_hits_total")


async def scrape(url: str) -> dict[str, float]:
    """The replica's prefill counters (summed over their labels)."""
    async with httpx.AsyncClient(timeout=30) as client:
        text = (await client.get(url + "/metrics")).text
    out = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


def refill(counters: list[dict[str, float]], window: float) -> dict:
    """The survivor's prefill rate and prefix-cache hit rate, the window before the kill vs
    the window after (what the continuations added)."""
    if len(counters) != 3:
        return {}
    early, at, late = counters
    prompt, queries, hits = COUNTERS

    def rate(a: dict, b: dict) -> tuple[float, float | None]:
        q = b[queries] - a[queries]
        return round((b[prompt] - a[prompt]) / window, 1), \
            round((b[hits] - a[hits]) / q, 3) if q else None
    (pre_tok, pre_hit), (post_tok, post_hit) = rate(early, at), rate(at, late)
    return {"survivor_prefill_tok_s_before": pre_tok, "survivor_prefill_tok_s_after": post_tok,
            "survivor_hit_rate_before": pre_hit, "survivor_hit_rate_after": post_hit}


def summarise(streams: list[Stream], kill: float, victim: str, window: float,
              counters: list[dict[str, float]]) -> dict:
    hit = [s for s in streams if s.start < kill and s.end is not None and s.end > kill
           and s.replica == victim]
    gaps, refills = [], []
    for s in hit:
        before = [t for t in s.times if t < kill]
        after = [t for t in s.times if t >= kill]
        if before and after:
            gaps.append(after[0] - before[-1])
            if s.prompt_tokens:  # the continuation's sequence: prompt + delivered (~1 a chunk)
                refills.append(s.prompt_tokens + len(before))
    itl = [b - a for s in streams for a, b in zip(s.times, s.times[1:]) if b < kill]
    chunks = [t for s in streams for t in s.times]
    before = sum(kill - window <= t < kill for t in chunks) / window
    after = sum(kill <= t < kill + window for t in chunks) / window
    q = statistics.quantiles
    return {"streams": len(streams), "lost": sum(not s.ok for s in streams),
            "on_victim": len(hit), "lost_on_victim": sum(not s.ok for s in hit),
            "gap_p50_s": round(statistics.median(gaps), 3) if gaps else None,
            "gap_p99_s": round(q(gaps, n=100)[98], 3) if len(gaps) > 1 else None,
            "itl_p50_s": round(statistics.median(itl), 4) if itl else None,
            "refill_tokens_p50": statistics.median(refills) if refills else None,
            "refill_tokens_max": max(refills) if refills else None,
            "gap_excess_p50_s": round(statistics.median(gaps) - statistics.median(itl), 3)
            if gaps and itl else None,
            "tok_s_before": round(before, 1), "tok_s_after": round(after, 1),
            **refill(counters, window),
            "errors": sorted({s.error[:120] for s in streams if s.error})[:5]}


def run_round(args: argparse.Namespace, limit: int) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="kvserve-chaos-"))
    procs: list[subprocess.Popen] = []
    try:
        procs, url = start(args, limit, tmp)
        urls = [r["url"] for r in httpx.get(url + "/health").json()["replicas"]]
        streams, kill, victim, counters = asyncio.run(soak(args, url, procs, urls))
        return {"migration_limit": limit,
                **summarise(streams, kill, victim, args.window, counters)}
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if args.keep_logs:
            shutil.copytree(tmp, args.keep_logs / f"limit{limit}-{time.time():.0f}")
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--clients", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=40.0)
    ap.add_argument("--kill-at", type=float, default=15.0)
    ap.add_argument("--window", type=float, default=5.0)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    ap.add_argument("--limits", default="3,0", help="--migration-limit values, alternated")
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--keep-logs", type=Path, help="copy each round's process logs here")
    args = ap.parse_args()
    results = []
    for r in range(args.rounds):
        for limit in (int(x) for x in args.limits.split(",")):
            res = run_round(args, limit)
            results.append({"round": r, **res})
            print(json.dumps(results[-1]), flush=True)
    if args.json_out:
        args.json_out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                             "rounds": results}, indent=1))


if __name__ == "__main__":
    main()
