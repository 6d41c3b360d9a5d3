"""The router's LoRA adapter hit rate over a fleet of simulated replicas (service/sim/): real
redis-server, a real `kvserve router` process with `--lora-modules`, N simulated replicas in this
process that keep `--max-loras` adapters each (LRU, a load delay), and a workload over K adapters
of Zipf popularity (plus base-model requests).

Peers in the same run, both adapter-unaware gateways driven by this client: `round-robin` and
`least-load` (its own in-flight counts) send each request to a replica and, on vLLM's 404 for an
adapter the replica lacks, load it there and retry: what a gateway without adapter affinity does.

    .venv/bin/python bench/lora_router.py                        # 8 replicas, 32 adapters
    .venv/bin/python bench/lora_router.py --replicas 16 --adapters 64 --max-loras 8

Per policy it prints the hit rate (1 - adapter loads / adapter requests: the share of adapter
requests that found their adapter resident where they were sent), loads, evictions, 404s seen by
the gateways, TTFT p50/p90 and the router's own resident/loaded counts; then router / peer ratios.
Simulated GPUs are slowed by --time-scale as in bench/fleet.py: compare policies, not seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from fleet import RESULTS, SERVICE, percentile, start_redis, start_router, stop
from kvserve.service.sim.fleet import SimFleet
from kvserve.service.sim.timing import timing_model

POLICIES = ("router", "round-robin", "least-load")
MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class Workload:
    adapters: int = 32
    zipf_s: float = 1.0  # adapter popularity ~ 1 / rank^s
    base_share: float = 0.1  # requests for the base model
    system_tokens: int = 256  # each adapter's own system prompt (its tenant)
    user_tokens: int = 64
    max_tokens: int = 16
    seed: int = 0

    def names(self) -> list[str]:
        return [f"lora-{i:03d}" for i in range(self.adapters)]


class Requests:
    """(model, prompt token ids) of the workload, seeded."""

    def __init__(self, w: Workload) -> None:
        self.w, self.rng = w, random.Random(w.seed)
        self.names = w.names()
        self.weights = [1.0 / (r + 1) ** w.zipf_s for r in range(w.adapters)]

    def next(self) -> tuple[str, list[int]]:
        w = self.w
        model = MODEL if self.rng.random() < w.base_share else \
            self.rng.choices(self.names, self.weights)[0]
        sysrng = random.Random(model)
        system = [sysrng.randrange(1, 40000) for _ in range(w.system_tokens)]
        return model, system + [self.rng.randrange(1, 40000) for _ in range(w.user_tokens)]


@dataclass
class RunResult:
    policy: str
    sent: int = 0
    completed: int = 0
    errors: int = 0
    adapter_requests: int = 0
    loads: int = 0
    evictions: int = 0
    not_found: int = 0  # 404s the gateway saw (the router never lets one through)
    hit_rate: float = 0.0
    ttft_p50: float = 0.0
    ttft_p90: float = 0.0
    router_resident: float = 0.0
    router_loaded: float = 0.0
    ttfts: list[float] = field(default_factory=list, repr=False)
    last_error: str = ""


class Gateway:
    """An adapter-unaware client-side gateway: choose, send, and on 404 load and retry once."""

    def __init__(self, fleet: SimFleet, policy: str, paths: dict[str, str]) -> None:
        self.fleet, self.policy, self.paths = fleet, policy, paths
        self.inflight = [0] * len(fleet.replicas)
        self.k = 0

    def choose(self) -> int:
        self.k += 1
        n = len(self.inflight)
        if self.policy == "round-robin":
            return self.k % n
        return min(range(n), key=lambda i: (self.inflight[i], (i - self.k) % n))


async def one(client: httpx.AsyncClient, url: str, body: dict, res: RunResult,
              gw: Gateway | None, i: int) -> None:
    try:
        await _one(client, url, body, res, gw)
    except httpx.HTTPError as exc:
        res.errors += 1
        res.last_error = f"{type(exc).__name__}: {exc}"


async def _one(client: httpx.AsyncClient, url: str, body: dict, res: RunResult,
               gw: Gateway | None) -> None:
    t0 = time.perf_counter()
    for attempt in range(2):
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code == 404 and gw is not None and attempt == 0:
                await resp.aread()
                res.not_found += 1
                load = await client.post(url + "/v1/load_lora_adapter", json={
                    "lora_name": body["model"], "lora_path": gw.paths[body["model"]]})
                if load.status_code not in (200, 400):
                    break
                continue
            if resp.status_code != 200:
                res.last_error = f"{resp.status_code}: {(await resp.aread())[:200]!r}"
                break
            first = None
            async for chunk in resp.aiter_raw():
                if first is None and chunk:
                    first = time.perf_counter() - t0
            res.ttfts.append(first or 0.0)
            res.completed += 1
            return
    res.errors += 1


async def run_policy(fleet: SimFleet, policy: str, router_url: str, w: Workload, qps: float,
                     count: int, paths: dict[str, str]) -> RunResult:
    while not fleet.idle():
        await asyncio.sleep(0.1)
    fleet.reset()
    await asyncio.sleep(1.5)  # heartbeats publish the empty adapter sets; the router refreshes
    res = RunResult(policy)
    gw = None if policy == "router" else Gateway(fleet, policy, paths)
    reqs = Requests(w)
    before = await _router_counts(router_url) if gw is None else (0.0, 0.0)
    rng = random.Random(w.seed + 1)
    tasks = []
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        start = time.perf_counter()
        due = start
        for _ in range(count):
            due += rng.expovariate(qps)
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            model, prompt = reqs.next()
            body = {"model": model, "prompt": prompt, "max_tokens": w.max_tokens,
                    "stream": True}
            res.sent += 1
            if gw is None:
                tasks.append(asyncio.create_task(one(client, router_url, body, res, None, 0)))
            else:
                i = gw.choose()
                tasks.append(asyncio.create_task(_tracked(gw, i, client, body, res)))
        await asyncio.gather(*tasks)
    reps = fleet.replicas
    res.adapter_requests = sum(r.counters.adapter_requests for r in reps)
    res.loads = sum(r.counters.adapter_loads for r in reps)
    res.evictions = sum(r.counters.adapter_evictions for r in reps)
    res.hit_rate = 1.0 - res.loads / res.adapter_requests if res.adapter_requests else 0.0
    if res.ttfts:
        res.ttft_p50, res.ttft_p90 = percentile(res.ttfts, 0.5), percentile(res.ttfts, 0.9)
    if gw is None:
        after = await _router_counts(router_url)
        res.router_resident, res.router_loaded = (a - b for a, b in zip(after, before))
    return res


async def _tracked(gw: Gateway, i: int, client: httpx.AsyncClient, body: dict,
                   res: RunResult) -> None:
    gw.inflight[i] += 1
    try:
        await one(client, gw.fleet.url(i), body, res, gw, i)
    finally:
        gw.inflight[i] -= 1


async def _router_counts(url: str) -> tuple[float, float]:
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(url + "/metrics")).text
    sums = {"resident": 0.0, "loaded": 0.0}
    for line in text.splitlines():
        if line.startswith("kvserve_router:adapter_requests_total{"):
            for outcome in sums:
                if f'outcome="{outcome}"' in line:
                    sums[outcome] += float(line.rsplit(" ", 1)[1])
    return sums["resident"], sums["loaded"]


async def main_async(args: argparse.Namespace, workdir: Path) -> list[RunResult]:
    w = Workload(adapters=args.adapters, zipf_s=args.zipf, seed=args.seed)
    timing = timing_model(args.timing).scaled(args.time_scale, args.num_blocks)
    paths = {n: f"/weights/adapters/{n}" for n in w.names()}
    redis_proc, redis_url = start_redis(workdir)
    fleet = SimFleet(args.replicas, timing, redis_url=redis_url, service=SERVICE, model=MODEL,
                     max_loras=args.max_loras, lora_load_s=args.load_seconds)
    await fleet.start()
    router_proc, router_url = await asyncio.to_thread(
        start_router, redis_url, "prefix", args.tokenizer, workdir / "router.log",
        ["--lora-modules", *(f"{n}={p}" for n, p in paths.items()), *args.router_arg])
    results = []
    try:
        await _wait_routable(router_url, args.replicas)
        for policy in args.policies:
            r = await run_policy(fleet, policy, router_url, w, args.qps, args.requests, paths)
            print(row(r), flush=True)
            if r.errors:
                print(f"  last error: {r.last_error}", flush=True)
            results.append(r)
    finally:
        stop(router_proc)
        await fleet.close()
        stop(redis_proc)
    return results


async def _wait_routable(url: str, n: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=5) as client:
        while time.monotonic() < deadline:
            try:
                if len((await client.get(url + "/health")).json().get("replicas", [])) == n:
                    return
            except (httpx.HTTPError, ValueError):
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"the router does not see {n} replicas")


def row(r: RunResult) -> str:
    extra = f"  router: {r.router_resident:.0f} resident / {r.router_loaded:.0f} loaded" \
        if r.policy == "router" else ""
    return (f"{r.policy:<12} sent {r.sent:>4} ok {r.completed:>4} err {r.errors:>2}  hit "
            f"{r.hit_rate:6.1%}  loads {r.loads:>4}  evictions {r.evictions:>4}  404s "
            f"{r.not_found:>4}  TTFT p50 {r.ttft_p50 * 1000:7.1f} ms p90 "
            f"{r.ttft_p90 * 1000:7.1f} ms{extra}")


def report(results: list[RunResult]) -> None:
    by = {r.policy: r for r in results}
    router = by.get("router")
    if router is None:
        return
    for peer in (p for p in POLICIES if p != "router" and p in by):
        other = by[peer]
        miss_ratio = (1 - router.hit_rate) / (1 - other.hit_rate) if other.hit_rate < 1 else \
            math.nan
        ttft = router.ttft_p90 / other.ttft_p90 if other.ttft_p90 else math.nan
        print(f"router vs {peer}: hit rate {router.hit_rate:.1%} vs {other.hit_rate:.1%} "
              f"(misses x{miss_ratio:.2f}), loads {router.loads} vs {other.loads}, "
              f"TTFT p90 x{ttft:.2f}")


def tiny_tokenizer(path: Path) -> str:
    """A byte-level BPE trained in milliseconds: the router only needs one to start (the
    workload's prompts are token ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["a tiny corpus for a router's tokenizer"] * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(path)
    (path / "config.json").write_text('{"model_type": "llama"}')
    return str(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--max-loras", type=int, default=4, help="adapters each replica keeps")
    ap.add_argument("--load-seconds", type=float, default=0.5,
                    help="simulated time to load one adapter (x --time-scale not applied)")
    ap.add_argument("--zipf", type=float, default=1.0, help="adapter popularity exponent")
    ap.add_argument("--qps", type=float, default=20.0)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--timing", default="h100-llama3-8b")
    ap.add_argument("--time-scale", type=float, default=10.0)
    ap.add_argument("--num-blocks", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="", help="suffix of the results file name")
    ap.add_argument("--router-arg", action="append", default=[],
                    help="extra flag for the router process (repeatable), e.g. "
                         "--router-arg=--lora-spread-slack=4")
    ap.add_argument("--tokenizer", default=None,
                    help="the router's tokenizer (default: a tiny one built here: prompts are "
                         "token ids, hashed as given)")
    args = ap.parse_args()
    args.policies = [p for p in args.policies.split(",") if p]
    bad = [p for p in args.policies if p not in POLICIES]
    if bad:
        raise SystemExit(f"unknown policies {bad}; choose from {POLICIES}")
    print(f"{args.replicas} simulated replicas ({args.timing} x{args.time_scale:g}), "
          f"{args.adapters} adapters (zipf {args.zipf:g}), max_loras {args.max_loras}, load "
          f"{args.load_seconds:g} s, {args.requests} requests at {args.qps:g} QPS", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        args.tokenizer = args.tokenizer or tiny_tokenizer(Path(tmp) / "tok")
        results = asyncio.run(main_async(args, Path(tmp)))
    report(results)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"lora_router{args.tag}.json"
    out.write_text(json.dumps({"args": {k: v for k, v in vars(args).items()},
                               "results": [{k: v for k, v in asdict(r).items() if k != "ttfts"}
                                           for r in results]}, indent=2))
    print(f"results: {out}")


if __name__ == "__main__":
    sys.exit(main())
