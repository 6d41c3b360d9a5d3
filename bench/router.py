"""Router benchmark: a multi-tenant chat workload against N replicas, `prefix` vs `round-robin` vs
`least-load`: prefix-cache hit rate, mean/p90 TTFT, throughput (ratios), routing decision latency.

    .venv/bin/python bench/router.py                  # small random Llama, 3 replicas, CPU
    .venv/bin/python bench/router.py --model default  # SmolLM2-135M-Instruct (slow on 2 cores)

Everything is real: redis-server, `kvserve serve` replicas, one `kvserve router` process per policy.
Each policy run uses its own `cache_salt`, so no run reuses another's cached blocks. Results go to
bench/results/router.json and bench/results/router.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
POLICIES = ("round-robin", "least-load", "prefix")
WORDS = ("cache block page token tenant policy replica router latency request prompt answer "
         "kernel batch queue memory budget prefix hash index redis stream metric scale "
         "model").split()


@dataclass(frozen=True)
class Workload:
    tenants: int = 12
    users: int = 6
    turns: int = 3
    system_tokens: int = 400
    max_tokens: int = 32
    concurrency: int = 9  # users in flight at once (each runs its turns one after the other)
    seed: int = 0


@dataclass
class RunResult:
    policy: str
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    wall_s: float = 0.0
    ttfts: list[float] = field(default_factory=list)
    per_replica: dict[str, int] = field(default_factory=dict)
    routing_p99_ms: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def throughput(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s else 0.0

    def summary(self) -> dict:
        return {"policy": self.policy, "requests": self.requests, "errors": self.errors,
                "hit_rate": self.hit_rate, "ttft_mean_s": statistics.fmean(self.ttfts),
                "ttft_p90_s": percentile(self.ttfts, 0.9), "throughput_tok_s": self.throughput,
                "wall_s": self.wall_s, "per_replica": self.per_replica,
                "routing_p99_ms_histogram": self.routing_p99_ms}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- model and cluster ---------------------------------------------------------------------------
def build_model(kind: str, workdir: Path) -> Path:
    """'small': a random 4-layer Llama of the test family (fast on CPU); 'default': SmolLM2."""
    if kind == "default":
        from kvserve.engine.worker.model_loader import fetch_model

        return fetch_model("smollm2-135m-instruct")
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import build_tiny_llama

    return build_tiny_llama(workdir / "small-llama", hidden_size=256, intermediate_size=768,
                            num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                            max_position_embeddings=4096)


@dataclass
class Cluster:
    redis_url: str
    replicas: dict[str, str]  # id -> url
    routers: dict[str, str]  # policy -> url
    procs: list[subprocess.Popen]

    def stop(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


def spawn(args: list[str], log: Path, threads: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads)}
    return subprocess.Popen([sys.executable, "-m", *args], stdout=log.open("w"),
                            stderr=subprocess.STDOUT, env=env)


def start_cluster(model: Path, args: argparse.Namespace, workdir: Path) -> Cluster:
    rport = free_port()
    procs = [subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port",
                               str(rport), "--save", "", "--appendonly", "no"],
                              stdout=subprocess.DEVNULL)]
    redis_url = f"redis://127.0.0.1:{rport}/0"
    replicas, routers = {}, {}
    for i in range(args.replicas):
        port, rid = free_port(), f"replica{i}"
        replicas[rid] = f"http://127.0.0.1:{port}"
        procs.append(spawn(["kvserve.service.cli", "serve", str(model), "--served-model-name",
                            "bench", "--device", "cpu", "--port", str(port), "--host", "127.0.0.1",
                            "--num-gpu-blocks-override", str(args.blocks), "--max-num-seqs", "16",
                            "--redis-url", redis_url, "--service-name", "bench", "--replica-id",
                            rid, "--advertise-url", replicas[rid], "--log-level", "warning",
                            "--enable-prompt-tokens-details"],  # cached tokens per request
                           workdir / f"{rid}.log", args.threads))
    for policy in POLICIES:
        port = free_port()
        routers[policy] = f"http://127.0.0.1:{port}"
        procs.append(spawn(["kvserve.service.router", "--port", str(port), "--host", "127.0.0.1",
                            "--redis-url", redis_url, "--service-name", "bench", "--policy",
                            policy, "--tokenizer", str(model), "--expose-routing-headers",
                            "--log-level", "warning"],
                           workdir / f"router-{policy}.log", 1))
    cluster = Cluster(redis_url, replicas, routers, procs)
    wait_ready(cluster, args.replicas)
    return cluster


def wait_ready(c: Cluster, n: int, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    for url in [*c.replicas.values(), *c.routers.values()]:
        while True:
            try:
                health = httpx.get(url + "/health", timeout=2)
                if health.status_code == 200 and (url not in c.routers.values()
                                                  or len(health.json()["replicas"]) == n):
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or any(p.poll() is not None for p in c.procs):
                c.stop()
                raise SystemExit(f"cluster did not start: {url} (see the logs in the work dir)")
            time.sleep(0.5)


# ---- workload ------------------------------------------------------------------------------------
def system_prompts(tokenizer, w: Workload) -> list[str]:
    """One ~system_tokens-token system prompt per tenant, each distinct from its first token."""
    rng = random.Random(w.seed)
    prompts = []
    for t in range(w.tenants):
        text = f"Tenant {t} policy:"
        while len(tokenizer(text)["input_ids"]) < w.system_tokens:
            text += " " + " ".join(rng.choice(WORDS) for _ in range(8)) + "."
        prompts.append(text)
    return prompts


def user_order(w: Workload) -> list[tuple[int, int]]:
    users = [(t, u) for t in range(w.tenants) for u in range(w.users)]
    random.Random(w.seed + 1).shuffle(users)
    return users


async def one_turn(client: httpx.AsyncClient, url: str, messages: list[dict], salt: str,
                   w: Workload, res: RunResult) -> str:
    body = {"model": "bench", "messages": messages, "max_tokens": w.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "cache_salt": salt}
    start, ttft, text, usage = time.perf_counter(), None, [], None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            res.errors += 1
            return ""
        rid = resp.headers.get("x-kvserve-replica", "?")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    text.append(choice["delta"]["content"])
    if usage is None or ttft is None:
        res.errors += 1
        return ""
    res.requests += 1
    res.ttfts.append(ttft)
    res.prompt_tokens += usage["prompt_tokens"]
    res.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    res.completion_tokens += usage["completion_tokens"]
    res.per_replica[rid] = res.per_replica.get(rid, 0) + 1
    return "".join(text)


async def run_policy(url: str, policy: str, prompts: list[str], w: Workload, salt: str
                     ) -> RunResult:
    res = RunResult(policy)
    queue = list(user_order(w))
    limits = httpx.Limits(max_connections=w.concurrency * 2)

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            tenant, user = queue.pop()
            messages = [{"role": "system", "content": prompts[tenant]}]
            for turn in range(w.turns):
                messages.append({"role": "user", "content":
                                 f"I am user {user} of tenant {tenant}; question {turn}: explain "
                                 f"{WORDS[(user + turn) % len(WORDS)]} briefly."})
                answer = await one_turn(client, url, messages, salt, w, res)
                messages.append({"role": "assistant", "content": answer})

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(w.concurrency)))
    res.wall_s = time.perf_counter() - start
    return res


# ---- routing decision latency --------------------------------------------------------------------
def histogram_p99_ms(router_url: str) -> float:
    """p99 of kvserve_router:routing_decision_seconds, interpolated like histogram_quantile."""
    buckets = []
    for line in httpx.get(router_url + "/metrics").text.splitlines():
        if line.startswith("kvserve_router:routing_decision_seconds_bucket"):
            le = line.split('le="')[1].split('"')[0]
            buckets.append((float(le), float(line.rsplit(" ", 1)[1])))
    total = buckets[-1][1] if buckets else 0
    prev_le, prev_n = 0.0, 0.0
    for le, n in buckets:
        if n >= 0.99 * total:
            if le == float("inf"):
                return prev_le * 1000
            frac = (0.99 * total - prev_n) / (n - prev_n) if n > prev_n else 1.0
            return (prev_le + frac * (le - prev_le)) * 1000
        prev_le, prev_n = le, n
    return 0.0


async def decision_latency(redis_url: str, model: Path | str, prompts: list[str], w: Workload,
                           n: int = 400) -> dict:
    """Exact per-decision latency of Router.route (template, tokenize, hash, one Redis round
    trip, score). Each tenant's system prompt is seen once first (timed apart: the router then
    tokenizes the whole prompt); the n timed decisions are steady state, where only the new
    user message is tokenized (engine.tokenizer.ChatEncoder)."""
    from kvserve.service.router.config import RouterConfig
    from kvserve.service.router.routing import Router

    router = Router(RouterConfig(redis_url=redis_url, service_name="bench",
                                 tokenizer=str(model)))
    await router.start()
    from kvserve.engine.core.block_hash import block_hashes
    from kvserve.service.router.prompt_tokens import prompt_tokens_for

    rng = random.Random(w.seed + 2)
    times, first, redis_times, tokens = [], [], [], []

    def body(system: str, i: int) -> dict:
        return {"messages": [{"role": "system", "content": system},
                             {"role": "user", "content": f"question {i}"}]}

    try:
        for i, system in enumerate(prompts):  # first sight of each tenant's system prompt
            start = time.perf_counter()
            await router.route("/v1/chat/completions", body(system, -i), {})
            first.append(time.perf_counter() - start)
        for i in range(n):
            req = body(rng.choice(prompts), i)
            start = time.perf_counter()
            await router.route("/v1/chat/completions", req, {})
            times.append(time.perf_counter() - start)
            ids = prompt_tokens_for(router.prompts.tokenizer, "/v1/chat/completions", req)
            tokens.append(len(ids))
            hashes = block_hashes(ids, router.replicas.block_size())
            start = time.perf_counter()
            await router.replicas.index.match_counts(hashes)  # the Redis round trip alone
            redis_times.append(time.perf_counter() - start)
    finally:
        await router.close()
    return {"n": n, "prompt_tokens_mean": statistics.fmean(tokens),
            "p50_ms": percentile(times, 0.5) * 1e3, "p99_ms": percentile(times, 0.99) * 1e3,
            "first_sight_p50_ms": percentile(first, 0.5) * 1e3,
            "first_sight_max_ms": max(first) * 1e3,
            "redis_p50_ms": percentile(redis_times, 0.5) * 1e3,
            "redis_p99_ms": percentile(redis_times, 0.99) * 1e3}


async def latency_only(args: argparse.Namespace) -> None:
    """Decision latency without running replicas: a real redis-server holding the heartbeats and
    block sets of `--replicas` replicas, each caching the system prompts of its share of tenants
    (what a prefix-routed cluster converges to)."""
    import redis as redis_sync

    from kvserve.engine.core.block_hash import block_hashes
    from kvserve.engine.sample.tokenizer import load_tokenizer
    from kvserve.service.prefix_index.keys import IndexKeys
    from kvserve.service.prefix_index.scripts import add_blocks
    from kvserve.service.router.prompt_tokens import prompt_tokens_for

    model = build_model(args.model, Path(tempfile.mkdtemp(prefix="kvserve-router-lat-")))
    rport = free_port()
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(rport),
                             "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{rport}/0"
    try:
        client = redis_sync.Redis.from_url(url)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis_sync.ConnectionError:
                time.sleep(0.05)
        tok = load_tokenizer(model)
        prompts = system_prompts(tok, args.workload)
        keys = IndexKeys("bench")
        for r in range(args.replicas):
            rid = f"replica{r}"
            client.sadd(keys.replicas, rid)
            client.hset(keys.replica(rid), mapping={
                "url": f"http://127.0.0.1:{9000 + r}", "model": str(model), "block_size": 16,
                "num_running": 1, "num_waiting": 0, "kv_cache_usage": 0.3,
                "heartbeat_at": time.time()})
            client.expire(keys.replica(rid), 600)
            for t in range(r, len(prompts), args.replicas):
                req = {"messages": [{"role": "system", "content": prompts[t]}]}
                ids = prompt_tokens_for(tok, "/v1/chat/completions", req)
                add_blocks(client, keys, rid, block_hashes(ids, 16))
        lat = await decision_latency(url, model, prompts, args.workload, n=args.latency_calls)
    finally:
        proc.kill()
        proc.wait()
    print(json.dumps(lat, indent=2))
    print(f"routing decision latency ({args.replicas} replicas in Redis, {args.model} model's "
          f"tokenizer, ~{lat['prompt_tokens_mean']:.0f}-token chats, {lat['n']} decisions): "
          f"p50 {lat['p50_ms']:.2f} ms, p99 {lat['p99_ms']:.2f} ms; first sight of a system "
          f"prompt p50 {lat['first_sight_p50_ms']:.2f} ms; the Redis round trip alone p50 "
          f"{lat['redis_p50_ms']:.2f} ms, p99 {lat['redis_p99_ms']:.2f} ms")


async def default_tokenizer_latency(c: Cluster, prompts: list[str], args: argparse.Namespace
                                    ) -> dict | None:
    """The same decisions with SmolLM2's tokenizer (49k vocab: fewer, cheaper tokens), if cached."""
    if args.model == "default":
        return None
    from kvserve.paths import cache_root

    folder = cache_root() / "models" / "smollm2-135m-instruct"
    if not (folder / "tokenizer.json").is_file():
        return None
    return await decision_latency(c.redis_url, folder, prompts, args.workload)


# ---- report --------------------------------------------------------------------------------------
def report(results: dict[str, RunResult], latency: dict, args: argparse.Namespace) -> str:
    p, rr, ll = (results[k].summary() for k in ("prefix", "round-robin", "least-load"))
    lines = [f"model={args.model} replicas={args.replicas} blocks/replica={args.blocks} "
             f"workload={asdict(args.workload)}",
             f"{'policy':<12} {'hit rate':>8} {'TTFT mean':>10} {'TTFT p90':>9} {'tok/s':>8} "
             f"{'errors':>6}  per replica"]
    for s in (p, rr, ll):
        lines.append(f"{s['policy']:<12} {s['hit_rate']:>8.1%} {s['ttft_mean_s']:>9.3f}s "
                     f"{s['ttft_p90_s']:>8.3f}s {s['throughput_tok_s']:>8.1f} {s['errors']:>6}  "
                     f"{s['per_replica']}")
    for name, o in (("round-robin", rr), ("least-load", ll)):
        lines.append(
            f"prefix vs {name}: hit rate x{p['hit_rate'] / max(o['hit_rate'], 1e-9):.2f}, "
            f"TTFT p90 x{p['ttft_p90_s'] / o['ttft_p90_s']:.2f}, TTFT mean "
            f"x{p['ttft_mean_s'] / o['ttft_mean_s']:.2f}, throughput "
            f"x{p['throughput_tok_s'] / o['throughput_tok_s']:.2f}")
    lines.append(f"routing decision latency (Router.route: template, tokenize "
                 f"~{latency['prompt_tokens_mean']:.0f} tokens, hash, Lua lookup, score; "
                 f"{latency['n']} calls, Redis on loopback): p50 {latency['p50_ms']:.2f} ms, "
                 f"p99 {latency['p99_ms']:.2f} ms (first sight of a system prompt: p50 "
                 f"{latency['first_sight_p50_ms']:.2f} ms); the Redis lookup alone: p50 "
                 f"{latency['redis_p50_ms']:.2f} ms, p99 {latency['redis_p99_ms']:.2f} ms")
    d = latency.get("default_tokenizer")
    if d:
        lines.append(f"  same with SmolLM2's tokenizer (~{d['prompt_tokens_mean']:.0f} tokens): "
                     f"p50 {d['p50_ms']:.2f} ms, p99 {d['p99_ms']:.2f} ms; Redis alone p50 "
                     f"{d['redis_p50_ms']:.2f} ms, p99 {d['redis_p99_ms']:.2f} ms")
    lines.append(f"p99 from the prefix router's histogram during the run (includes waiting for "
                 f"the CPU): {results['prefix'].routing_p99_ms:.1f} ms")
    return "\n".join(lines)


def plot(summaries: dict[str, dict], path: Path, title: str) -> bool:
    """Hit rate, TTFT and throughput per policy from RunResult.summary() dicts."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install matplotlib)")
        return False
    names = list(POLICIES)
    s = summaries
    panels = [("prefix-cache hit rate", [s[k]["hit_rate"] * 100 for k in names], "%"),
              ("TTFT mean / p90", None, "s"),
              ("throughput", [s[k]["throughput_tok_s"] for k in names], "output tok/s")]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    colors = ["#999999", "#6699cc", "#dd6633"]
    for ax, (label, values, unit) in zip(axes, panels):
        if values is None:
            x = range(len(names))
            ax.bar([i - 0.2 for i in x], [s[k]["ttft_mean_s"] for k in names], 0.4,
                   color=colors, alpha=0.6, label="mean")
            ax.bar([i + 0.2 for i in x], [s[k]["ttft_p90_s"] for k in names], 0.4,
                   color=colors, label="p90")
            ax.set_xticks(list(x), names)
            ax.legend()
        else:
            ax.bar(names, values, color=colors)
        ax.set_title(label)
        ax.set_ylabel(unit)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("small", "default"), default="small")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--blocks", type=int, default=224, help="KV blocks per replica (16 tokens each)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    p.add_argument("--tenants", type=int, default=12)
    p.add_argument("--users", type=int, default=6)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-tokens", type=int, default=400)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=9)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--replot", type=Path, help="only draw the PNG of a saved router.json")
    p.add_argument("--latency-only", action="store_true",
                   help="only the routing decision latency (Redis + tokenizer, no replicas)")
    p.add_argument("--latency-calls", type=int, default=1000)
    args = p.parse_args(argv)
    args.workload = Workload(args.tenants, args.users, args.turns, args.system_tokens,
                             args.max_tokens, args.concurrency)
    return args


async def bench(args: argparse.Namespace, workdir: Path) -> None:
    from kvserve.engine.sample.tokenizer import load_tokenizer

    model = build_model(args.model, workdir)
    cluster = start_cluster(model, args, workdir)
    try:
        prompts = system_prompts(load_tokenizer(model), args.workload)
        results = {}
        for policy in POLICIES:
            salt = f"{policy}-{time.time_ns()}"
            results[policy] = await run_policy(cluster.routers[policy], policy, prompts,
                                               args.workload, salt)
            results[policy].routing_p99_ms = histogram_p99_ms(cluster.routers[policy])
            print(f"{policy}: {results[policy].summary()}", flush=True)
        latency = await decision_latency(cluster.redis_url, model, prompts, args.workload)
        latency["default_tokenizer"] = await default_tokenizer_latency(cluster, prompts, args)
    finally:
        cluster.stop()
    text = report(results, latency, args)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "router.json").write_text(json.dumps(
        {"args": {k: v for k, v in vars(args).items() if k not in ("out", "workload")},
         "workload": asdict(args.workload), "latency": latency,
         "results": {k: r.summary() for k, r in results.items()}, "report": text}, indent=2))
    plot({k: r.summary() for k, r in results.items()}, args.out / "router.png",
         f"kvserve router, {args.replicas} replicas ({args.model} model, CPU), "
         f"{args.tenants} tenants x {args.users} users x {args.turns} turns")


def replot(json_path: Path) -> None:
    """Draw the PNG of a saved run (router.json) next to it."""
    data = json.loads(json_path.read_text())
    a, w = data["args"], data["workload"]
    plot(data["results"], json_path.with_suffix(".png"),
         f"kvserve router, {a['replicas']} replicas ({a['model']} model, CPU, {a['blocks']} "
         f"blocks each), {w['tenants']} tenants x {w['users']} users x {w['turns']} turns")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.replot:
        replot(args.replot)
        return
    if args.latency_only:
        asyncio.run(latency_only(args))
        return
    with tempfile.TemporaryDirectory(prefix="kvserve-router-bench-") as tmp:
        asyncio.run(bench(args, Path(tmp)))


if __name__ == "__main__":
    main()
