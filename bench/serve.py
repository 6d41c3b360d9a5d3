"""Server benchmark: N concurrent streaming clients against `kvserve serve`, versus the offline
engine (`kvserve.LLM.generate`) on the same chat workload, in the same run.

Workload (the engine benchmark's chat workload): 64 chat requests sharing a ~200-token system
prompt, 64 new tokens each, greedy, ignore_eos, the default model. The server runs in its own
process (`python -m kvserve.service.api_server`), the clients here on asyncio streams (raw
HTTP/1.1, on uvloop where installed), reading SSE chunks with `continuous_usage_stats` so inter-token latency is per token even when a chunk
carries several. Prints TTFT p50/p99, ITL p50/p99, output tok/s and the ratio to offline.

    python bench/serve.py                         # 16 and 64 clients, default model
    python bench/serve.py --concurrency 64 --json-out /tmp/serve.json
    python bench/serve.py --engine-core thread process --dtype bfloat16   # before / after the split
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
from dataclasses import asdict, dataclass, field

import httpx
import psutil

SYSTEM_PROMPT = (
    "You are KV, a careful assistant for engineers who run large language models in production. "
    "You know how transformer inference works: the prompt is processed in a prefill pass that "
    "fills the key-value cache, then tokens are decoded one at a time, each step reading every "
    "cached key and value of the sequence. Paged attention stores that cache in fixed-size blocks, "
    "like virtual memory pages, so that memory is allocated on demand, shared between requests "
    "with a common prefix, and freed the moment a request finishes or is preempted. Continuous "
    "batching admits new requests at every step instead of waiting for a whole batch to finish. "
    "When you answer, be concrete: give numbers, name the trade-offs, and say what you would "
    "measure to check a claim. Prefer short paragraphs and plain words. If a question is "
    "ambiguous, state the assumption you make before answering. Never invent benchmark figures; "
    "say how they could be measured instead. Keep each answer under two hundred words."
)
TOPICS = [
    "how prefix caching saves prefill time", "why decode is memory-bound",
    "what limits the batch size", "how preemption by recompute works",
    "when swapping KV blocks to CPU pays off", "how block size affects fragmentation",
    "what fp8 KV caches cost in accuracy", "how to size GPU memory for a model",
]


def chat_workload(num_requests: int = 64) -> list[list[dict[str, str]]]:
    """`num_requests` conversations sharing SYSTEM_PROMPT, each with its own question."""
    return [[{"role": "system", "content": SYSTEM_PROMPT},
             {"role": "user", "content": f"Question {i}: explain {TOPICS[i % len(TOPICS)]}."}]
            for i in range(num_requests)]


@dataclass
class RequestTiming:
    ttft: float
    itls: list[float] = field(default_factory=list)
    tokens: int = 0


@dataclass
class Result:
    name: str
    concurrency: int
    requests: int
    output_tokens: int
    seconds: float
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    itl_p50: float | None = None
    itl_p99: float | None = None
    cpu: dict[str, float] = field(default_factory=dict)  # CPU seconds per process role

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.seconds


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


# ---------------------------------------------------------------------------- offline peer


class OfflinePeer:
    """The offline engine on the same workload: loaded and warmed once (the system prompt is
    cached, like the server's), then run once per round."""

    def __init__(self, args: argparse.Namespace, convs: list) -> None:
        from kvserve import LLM, SamplingParams

        self.convs = convs
        self.llm = LLM(model=args.model, max_model_len=args.max_model_len, seed=0,
                       dtype=args.dtype, kv_cache_memory=args.kv_cache_memory)
        self.params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        self.llm.chat(convs[:2], self.params, use_tqdm=False)  # warm-up

    def run(self) -> Result:
        start, cpu0 = time.perf_counter(), sum(psutil.Process().cpu_times()[:2])
        outs = self.llm.chat(self.convs, self.params, use_tqdm=False)
        seconds = time.perf_counter() - start
        cpu = {"engine": sum(psutil.Process().cpu_times()[:2]) - cpu0}
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        # The engine's own inter-token time, per request: its decode step as each request saw it
        # (first to last token over the tokens between), and its TTFT from arrival. The server's
        # ITL p50 is held against this step (the goal: within 10%).
        ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
        steps = [(o.metrics.last_token_time - o.metrics.first_token_time)
                 / (len(o.outputs[0].token_ids) - 1)
                 for o in outs if len(o.outputs[0].token_ids) > 1]
        return Result("offline LLM.generate", len(self.convs), len(self.convs), tokens, seconds,
                      percentile(ttfts, 50), percentile(ttfts, 99),
                      percentile(steps, 50) if steps else None,
                      percentile(steps, 99) if steps else None, cpu=cpu)

    def close(self) -> None:
        self.llm.shutdown()
        del self.llm
        gc.collect()


# ---------------------------------------------------------------------------- server side


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, port: int, engine_core: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvserve.service.api_server", "--model", args.model,
           "--engine-core", engine_core,
           "--host", "127.0.0.1", "--port", str(port), "--max-model-len",
           str(args.max_model_len), "--log-level", "warning", "--dtype", args.dtype]
    if args.kv_cache_memory:
        cmd += ["--kv-cache-memory", str(args.kv_cache_memory)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not become healthy in 600 s")


COMPLETION_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')


async def one_request(host: str, port: int, path: str, body: bytes) -> RequestTiming:
    """One streaming chat request on its own connection, read as raw HTTP/1.1 chunks.

    The load generator shares the machine with the server: httpx's line iterator plus a JSON
    parse per chunk cost ~0.1 ms of CPU a token, time taken from the engine's cores. This client
    reads the chunked body with asyncio streams and takes only `completion_tokens` out of each
    SSE event, so the clients cost a fraction of that (the table's "clients" column).
    """
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"POST %s HTTP/1.1\r\nhost: %s:%d\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\nconnection: close\r\n\r\n%s"
                 % (path.encode(), host.encode(), port, len(body), body))
    status = await reader.readline()
    if b" 200 " not in status:
        raise AssertionError(f"HTTP {status!r}: {await reader.read()!r}")
    chunked = False
    while (line := await reader.readline()) not in (b"\r\n", b""):
        chunked |= line.lower().startswith(b"transfer-encoding:") and b"chunked" in line.lower()
    timing: RequestTiming | None = None
    last, seen, pending = start, 0, b""
    while True:
        if chunked:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                break
            data = await reader.readexactly(size + 2)  # the chunk and its CRLF
            pending += data[:-2]
        else:
            data = await reader.read(65536)
            if not data:
                break
            pending += data
        events = pending.split(b"\n\n")
        pending = events.pop()  # an event not yet whole
        tokens = seen
        for event in events:
            m = COMPLETION_TOKENS.search(event)
            if m:
                tokens = max(tokens, int(m.group(1)))
        if tokens <= seen:
            continue
        now = time.perf_counter()
        if timing is None:
            timing = RequestTiming(ttft=now - start)
        else:
            timing.itls += [(now - last) / (tokens - seen)] * (tokens - seen)
        last, seen = now, tokens
    writer.close()
    assert timing is not None, "no token came back"
    timing.tokens = seen
    return timing


async def run_clients(url: str, model: str, convs: list, concurrency: int,
                      max_tokens: int) -> tuple[list[RequestTiming], float]:
    parsed = urllib.parse.urlsplit(url)
    sem = asyncio.Semaphore(concurrency)

    async def bounded(conv: list) -> RequestTiming:
        body = json.dumps({
            "model": model, "messages": conv, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }).encode()
        async with sem:
            return await one_request(parsed.hostname, parsed.port, parsed.path, body)

    start = time.perf_counter()
    timings = await asyncio.gather(*(bounded(c) for c in convs))
    return list(timings), time.perf_counter() - start


def run_async(coro):
    """uvloop where installed (kvserve's server runs on it too): a lighter load generator."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def cpu_seconds(proc: subprocess.Popen) -> dict[str, float]:
    """CPU seconds so far of the server's processes and of this one (the clients): the API
    process, the engine core process where split (the child that runs longest), and the rest."""
    def secs(p: psutil.Process) -> float:
        t = p.cpu_times()
        return t.user + t.system

    server = psutil.Process(proc.pid)
    out = {"server": secs(server), "clients": secs(psutil.Process())}
    for child in server.children(recursive=True):
        try:
            name = "core" if "engine_core" in " ".join(child.cmdline()) or \
                "spawn_main" in " ".join(child.cmdline()) else "other"
            out[name] = out.get(name, 0.0) + secs(child)
        except psutil.NoSuchProcess:
            pass
    return out


class ServerUnderTest:
    """`kvserve serve` in its own process (engine core in a thread or split), started and warmed
    once, then driven once per round and concurrency."""

    def __init__(self, args: argparse.Namespace, convs: list, engine_core: str) -> None:
        self.args, self.convs, self.engine_core = args, convs, engine_core
        port = free_port()
        self.proc = start_server(args, port, engine_core)
        base = f"http://127.0.0.1:{port}"
        self.url = base + "/v1/chat/completions"
        self.model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
        run_async(run_clients(self.url, self.model, convs[:2], 2, args.max_tokens))  # warm-up

    def run(self, n: int) -> Result:
        convs, max_tokens = self.convs, self.args.max_tokens
        cpu0 = cpu_seconds(self.proc)
        timings, seconds = run_async(run_clients(self.url, self.model, convs, n, max_tokens))
        cpu1 = cpu_seconds(self.proc)
        cpu = {k: cpu1[k] - cpu0.get(k, 0.0) for k in cpu1}
        tokens = sum(t.tokens for t in timings)
        if tokens != len(convs) * max_tokens:
            raise AssertionError(f"expected {len(convs) * max_tokens} tokens, got {tokens}")
        itls = [x for t in timings for x in t.itls]
        ttfts = [t.ttft for t in timings]
        return Result(f"server ({self.engine_core}), {n} clients", n, len(convs), tokens,
                      seconds, percentile(ttfts, 50), percentile(ttfts, 99),
                      percentile(itls, 50), percentile(itls, 99), cpu)

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def cpu_text(r: Result) -> str:
    """CPU per output token of each process: the server (the API process, or the whole engine
    when it steps in a thread), the engine core when split, and the clients (this process)."""
    if not r.cpu:
        return "-"
    names = {"engine": "engine", "server": "API" if r.cpu.get("core") else "server", "core": "core",
             "other": "other", "clients": "clients"}
    return ", ".join(f"{names[k]} {v / r.output_tokens * 1e3:.2f}" for k, v in r.cpu.items()
                     if k in names and (v > 0 or k in ("server", "engine")))


def report(offline: Result | None, results: list[Result]) -> str:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1000:.0f}"

    rows = ["| run | tok/s | vs offline | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | CPU ms per token |",
            "| --- | ---: | ---: | ---: | ---: | --- |"]
    for r in ([offline] if offline else []) + results:
        ratio = f"{r.tok_per_s / offline.tok_per_s:.2f}x" if offline else "-"
        rows.append(f"| {r.name} | {r.tok_per_s:.1f} | {ratio} | {ms(r.ttft_p50)} / "
                    f"{ms(r.ttft_p99)} | {ms(r.itl_p50)} / {ms(r.itl_p99)} | {cpu_text(r)} |")
    return "\n".join(rows)


def summary(rounds: list[tuple[Result | None, list[Result]]]) -> str:
    """Medians over the rounds: each server run's ratio is to the offline run of its own round,
    so a machine whose speed drifts between rounds (shared hosts do, by +-25% over a minute)
    still compares like with like."""
    import statistics

    rows = ["| run | tok/s median | vs offline: median (range) | TTFT p50 (ms) | ITL p50 (ms) |"
            " ITL p50 / offline step |",
            "| --- | ---: | ---: | ---: | ---: | ---: |"]
    names = [r.name for r in rounds[0][1]]
    if rounds[0][0] is not None:
        tps = [off.tok_per_s for off, _ in rounds]
        step = statistics.median(off.itl_p50 for off, _ in rounds) * 1000
        rows.append(f"| offline LLM.generate | {statistics.median(tps):.1f} | 1.00x | - | "
                    f"{step:.0f} (its step) | 1.00 |")
    for i, name in enumerate(names):
        runs = [(off, res[i]) for off, res in rounds]
        tps = statistics.median(r.tok_per_s for _, r in runs)
        ratio = "-"
        if runs[0][0] is not None:
            ratios = sorted(r.tok_per_s / off.tok_per_s for off, r in runs)
            ratio = f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})"
        ttft = statistics.median(r.ttft_p50 for _, r in runs) * 1000
        itl = statistics.median(r.itl_p50 for _, r in runs) * 1000
        vs_step = "-"
        if runs[0][0] is not None:  # each round's ITL over its own offline step
            vs_step = f"{statistics.median(r.itl_p50 / off.itl_p50 for off, r in runs):.2f}"
        rows.append(f"| {name} | {tps:.1f} | {ratio} | {ttft:.0f} | {itl:.0f} | {vs_step} |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--dtype", default="auto", help="model dtype for both sides (auto, "
                   "bfloat16, float32, ...)")
    p.add_argument("--kv-cache-memory", default="1GiB",
                   help="KV-cache size on CPU (the workload needs ~0.9 GiB in fp32)")
    p.add_argument("--threads", type=int, default=None,
                   help="OMP/torch threads for both the offline engine and the server process "
                   "(on a shared, oversubscribed CPU, 1 avoids OpenMP spin-wait stalls)")
    p.add_argument("--engine-core", nargs="+", default=["process"],
                   choices=["process", "thread"],
                   help="server modes to run, each against the same offline peer: process (the "
                   "engine core in its own process, the default of `kvserve serve`) and/or "
                   "thread (the engine in a thread of the server, as before)")
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds of (offline, every server mode): each server run is compared "
                   "with its own round's offline run, and the medians are printed")
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    if args.kv_cache_memory:
        from kvserve.service.flags import byte_size

        args.kv_cache_memory = byte_size(args.kv_cache_memory)
    if args.threads:  # before torch is imported here, and inherited by the server process
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    convs = chat_workload(args.num_requests)
    peer = None if args.skip_offline else OfflinePeer(args, convs)
    servers = [ServerUnderTest(args, convs, mode) for mode in args.engine_core]
    rounds: list[tuple[Result | None, list[Result]]] = []
    try:
        for _ in range(args.repeat):  # offline, then every server, round after round
            offline = peer.run() if peer else None
            rounds.append((offline, [s.run(n) for s in servers for n in args.concurrency]))
    finally:
        for s in servers:
            s.close()
        if peer:
            peer.close()
    print(f"\nmachine: {os.cpu_count()} CPUs (load {os.getloadavg()[0]:.1f}), threads "
          f"{args.threads or 'default'}; model {args.model}; {args.num_requests} chat requests x "
          f"{args.max_tokens} new tokens, greedy, ignore_eos, dtype {args.dtype}\n")
    for i, (offline, results) in enumerate(rounds):
        if len(rounds) > 1:
            print(f"round {i + 1} of {len(rounds)}:\n")
        print(report(offline, results) + "\n")
    if len(rounds) > 1:
        print(f"medians over {len(rounds)} rounds:\n\n{summary(rounds)}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"load": os.getloadavg(), "rounds": [
                {"offline": asdict(off) if off else None, "server": [asdict(r) for r in res]}
                for off, res in rounds]}, f, indent=2)

if __name__ == "__main__":
    main()
