"""Prefill/decode disaggregation on the CPU: what moving a prompt's KV blocks between replicas
costs, next to computing them again.

`transfer`: a prefill engine's KVServeConnector serves blocks of the default model's layout
(30 layers, 3 KV heads x 64, 16-token blocks) from a KV cache in memory; a decode engine's
connector pulls N of them over loopback TCP, or through shared memory (both on this host), and
writes them into its cache (the whole decode-side path: handshake, layer frames or segment,
confirmation, scatter). Per N, KV dtype and transport: milliseconds per block (median of the
rounds, min-max), MB/s, and shm / tcp (the median of each round's ratio, min-max: the transports
alternate within a round, so both see the same machine load); the same for the wire part alone
(the pull thread's fetch: connect, handshake, the bytes into a host buffer, confirmation). Same run: the default model's
prefill of the same N x 16 tokens (max_tokens=1, no prefix cache) per block, and the ratio
transfer / prefill.

    python bench/pd.py transfer [--blocks 1,8,32,128] [--rounds 5] [--dtypes float32,fp8]
                                [--transports tcp,shm] [--threads 1] [--skip-prefill]

`mixed`: the interference figures of issue 43 (aggregated vs disaggregated replicas each pinned
to one core with taskset): decode-heavy streamed chats while long prompts arrive every few
seconds; ITL p50/p99 of the chats, TTFT of the long prompts, throughput. The disaggregated run
sends each long prompt to the prefill replica with max_tokens=1 and kv_transfer_params
{"do_remote_decode": true}, then to the decode replica with the params it answered (what
`kvserve router --policy pd` and llm-d's sidecar do), and the chats to the decode replica.

    python bench/pd.py mixed [--chats 4] [--long-every 6] [--long-tokens 2048] [--seconds 60]
                             [--rounds 2] [--max-num-batched-tokens N]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import kvserve  # noqa: F401 - before torch: kvserve sets OpenMP's spin for a shared CPU
import torch
from kv_pull import pull


def layout_for(dtype: torch.dtype):
    from kvserve.engine.kv_transfer.wire import KVLayout

    return KVLayout(model="smollm2-135m-instruct", architecture="LlamaForCausalLM",
                    num_layers=30, num_kv_heads=3, head_dim=64, block_size=16,
                    kv_dtype=str(dtype), tp_size=1)


def connectors(role: str, dtype: torch.dtype, num_blocks: int, transport: str = "tcp"):
    from kvserve.engine.kv_transfer.config import KVTransferConfig
    from kvserve.engine.kv_transfer.factory import EngineInfo, make_connectors

    lay = layout_for(dtype)
    kv = torch.randn(2, lay.num_layers, num_blocks, 16, 3, 64).to(dtype)
    cfg = KVTransferConfig("KVServeConnector", role, {"kv_port": 0, "transport": transport})
    sched, worker = make_connectors(cfg, EngineInfo(lay, 16, 1, torch.device("cpu")))
    worker.register_kv_caches({f"layers.{i}": kv[:, i] for i in range(lay.num_layers)})
    return sched, worker, kv


def time_pulls(dtype: torch.dtype, n: int, rounds: int, transports: list[str]
               ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per transport, seconds of each round's pull + scatter of n blocks (the decode side's
    whole path), and of its wire part; the transports alternate within each round, their
    order too."""
    pairs = {t: (connectors("kv_producer", dtype, n + 1, t)[0],
                 *connectors("kv_consumer", dtype, n + 1, t)[:2]) for t in transports}
    out: dict[str, list[float]] = {t: [] for t in transports}
    wire: dict[str, list[float]] = {t: [] for t in transports}
    try:
        for r in range(rounds + 1):  # round 0 warms up
            order = transports if r % 2 else transports[::-1]
            for t in order:
                blocks = list(range(1, n + 1))
                seconds = pull(*pairs[t], blocks, blocks, 16, f"{t}{r}")
                if r:
                    out[t].append(seconds)
                    wire[t].append(pairs[t][1].figures.seconds[-1])
        for t, (_, c_sched, _) in pairs.items():
            got = set(c_sched.figures.bytes_by_transport)
            assert got == {t}, f"asked for {t}, moved over {got}"
    finally:
        for p_sched, c_sched, _ in pairs.values():
            p_sched.shutdown()
            c_sched.shutdown()
    return out, wire


def time_prefill(llm, n: int, rounds: int) -> list[float]:
    """Seconds of the default model's prefill of n blocks of tokens, prefix cache off."""
    from kvserve import SamplingParams

    rng = random.Random(n)
    params = SamplingParams(max_tokens=1, temperature=0)
    llm.generate([[rng.randrange(100, 40000) for _ in range(16)]], params,
                 use_tqdm=False)  # warm-up
    out = []
    for _ in range(rounds):
        ids = [rng.randrange(100, 40000) for _ in range(16 * n)]
        t0 = time.perf_counter()
        llm.generate([ids], params, use_tqdm=False)
        out.append(time.perf_counter() - t0)
    return out


def spread(values: list[float], scale: float) -> str:
    v = sorted(x * scale for x in values)
    return f"{statistics.median(v):.3f} ({v[0]:.3f}-{v[-1]:.3f})"


def transfer(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16,
              "fp8": torch.float8_e4m3fn}
    sizes = [int(b) for b in args.blocks.split(",")]
    prefill = {}
    if not args.skip_prefill:
        from kvserve import LLM

        llm = LLM(dtype="float32", device="cpu", enable_prefix_caching=False,
                  kv_cache_memory=256 << 20)
        prefill = {n: time_prefill(llm, n, args.rounds) for n in sizes}
        del llm
    transports = args.transports.split(",")
    print("| KV dtype | blocks | transport | pull ms / block | MB/s | vs tcp | wire ms / block | "
          "vs tcp | prefill ms / block | transfer / prefill |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.dtypes.split(","):
        dtype = dtypes[name]
        per_block = layout_for(dtype).layer_bytes_per_block * 30
        for n in sizes:
            times, wire = time_pulls(dtype, n, args.rounds, transports)
            pre = prefill.get(n)
            pre_s = spread(pre, 1000 / n) if pre else "-"
            for t, v in times.items():
                med = statistics.median(v)
                mbs = per_block * n / med / 1e6
                vs = vs_wire = "-"
                if t != "tcp" and "tcp" in times:
                    vs = spread([a / b for a, b in zip(v, times["tcp"])], 1)
                    vs_wire = spread([a / b for a, b in zip(wire[t], wire["tcp"])], 1)
                ratio = f"{med / statistics.median(pre):.3f}" if pre else "-"
                print(f"| {name} | {n} | {t} | {spread(v, 1000 / n)} | {mbs:.0f} | {vs} | "
                      f"{spread(wire[t], 1000 / n)} | {vs_wire} | {pre_s} | {ratio} |",
                      flush=True)


# ---- mixed workload ---------------------------------------------------------------------------
def start(port: int, core: int, role: str | None, kv_port: int, log: Path,
          chunk: int | None = None) -> subprocess.Popen:
    flags = ["--kv-cache-memory", "1GiB", "--max-num-seqs", "16", "--engine-core", "thread"]
    if chunk:  # chunked prefill: a long prompt's step holds at most this many tokens
        flags += ["--max-num-batched-tokens", str(chunk)]
    if role is not None:
        flags += ["--kv-transfer-config", json.dumps({
            "kv_connector": "KVServeConnector", "kv_role": role,
            "kv_connector_extra_config": {"kv_port": kv_port}})]
    cmd = ["taskset", "-c", str(core), sys.executable, "-m", "kvserve.service.cli", "serve",
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--log-level", "warning", *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    import httpx

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(url)


def stream_chat(url: str, messages: list, max_tokens: int, extra: dict | None = None
                ) -> tuple[float, list[float], int]:
    """(time to first token, gaps between later tokens, tokens) of one streamed chat."""
    import httpx

    body = {"model": "smollm2-135m-instruct", "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, **(extra or {})}
    t0 = time.perf_counter()
    times = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():  # tokens: chunks with text (not the opening role chunk)
            if line.startswith("data: {") and any((c.get("delta") or {}).get("content")
                                                  for c in json.loads(line[6:])["choices"]):
                times.append(time.perf_counter())
    if not times:
        return float("nan"), [], 0
    return times[0] - t0, [b - a for a, b in zip(times, times[1:])], len(times)


def long_prompt(i: int, tokens: int) -> list[dict]:
    rng = random.Random(i)
    words = ["paged", "attention", "block", "prefill", "decode", "replica", "cache", "token"]
    text = " ".join(rng.choice(words) for _ in range(tokens))
    return [{"role": "user", "content": f"Document {i}: {text}\nSummarise it."}]


def run_mixed(urls: dict, args: argparse.Namespace) -> dict:
    """One timed run; `urls` has 'chat' (list: chats round-robin), 'long' (list), and for the
    disaggregated layout 'prefill' (the long prompts' first hop)."""
    import httpx

    stop = time.monotonic() + args.seconds
    itl: list[float] = []
    ttft_long: list[float] = []
    tokens = [0]
    lock = threading.Lock()

    def chat_loop(k: int) -> None:
        url = urls["chat"][k % len(urls["chat"])]
        while time.monotonic() < stop:
            _, gaps, n = stream_chat(url, [{"role": "user", "content": f"Chat {k}: tell me "
                                                                       "about KV caches."}], 64)
            with lock:
                itl.extend(gaps)
                tokens[0] += n

    def long_one(i: int) -> None:
        msgs = long_prompt(i, args.long_tokens)
        t0 = time.perf_counter()
        extra = None
        if "prefill" in urls:
            r = httpx.post(urls["prefill"] + "/v1/chat/completions", timeout=600, json={
                "model": "smollm2-135m-instruct", "messages": msgs, "max_tokens": 1,
                "temperature": 0, "kv_transfer_params": {"do_remote_decode": True}})
            extra = {"kv_transfer_params": r.json().get("kv_transfer_params")}
        first, gaps, n = stream_chat(urls["long"][i % len(urls["long"])], msgs, 16, extra)
        with lock:
            ttft_long.append(time.perf_counter() - t0 - sum(gaps))
            tokens[0] += n

    threads = [threading.Thread(target=chat_loop, args=(k,)) for k in range(args.chats)]
    t_start = time.perf_counter()
    for t in threads:
        t.start()
    longs = []
    i = 0
    while time.monotonic() < stop - args.long_every / 2:
        time.sleep(args.long_every)
        longs.append(threading.Thread(target=long_one, args=(i,)))
        longs[-1].start()
        i += 1
    for t in threads + longs:
        t.join()
    wall = time.perf_counter() - t_start
    q = statistics.quantiles(itl, n=100) if len(itl) > 2 else [float("nan")] * 99
    pulled = 0.0  # the decode replica's external prefix-cache hits: the transfers happened
    for url in set(urls["long"]):
        for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
            if line.startswith("vllm:external_prefix_cache_hits_total"):
                pulled += float(line.split()[-1])
    return {"pulled_tokens": pulled,
            "itl_p50_ms": 1000 * statistics.median(itl) if itl else float("nan"),
            "itl_p99_ms": 1000 * q[98], "ttft_long_s": statistics.median(ttft_long)
            if ttft_long else float("nan"), "long_prompts": len(ttft_long),
            "tokens_per_s": tokens[0] / wall}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mixed_run(args: argparse.Namespace) -> None:
    logs = Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    layouts = {"aggregated": [(0, None), (1, None)],
               "disaggregated": [(0, "kv_producer"), (1, "kv_consumer")]}
    results: dict[str, list[dict]] = {k: [] for k in layouts}
    for rnd in range(args.rounds):
        for name, replicas in layouts.items():
            procs, urls = [], []
            try:
                for core, role in replicas:
                    port = _free_port()
                    procs.append(start(port, core, role, _free_port(),
                                       logs / f"{name}-{core}.log", args.max_num_batched_tokens))
                    urls.append(f"http://127.0.0.1:{port}")
                for url, proc in zip(urls, procs):
                    wait_healthy(url, proc)
                if name == "aggregated":
                    plan = {"chat": urls, "long": urls}
                else:
                    plan = {"chat": [urls[1]], "long": [urls[1]], "prefill": urls[0]}
                res = run_mixed(plan, args)
                results[name].append(res)
                print(f"round {rnd} {name}: " + ", ".join(f"{k} {v:.3g}" for k, v in
                                                         res.items()), flush=True)
            finally:
                for p in procs:
                    p.kill()
                    p.wait()
    for name, runs in results.items():
        keys = runs[0].keys()
        print(f"{name}: " + ", ".join(
            f"{k} {statistics.median(r[k] for r in runs):.3g} "
            f"({min(r[k] for r in runs):.3g}-{max(r[k] for r in runs):.3g})" for k in keys))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("transfer")
    t.add_argument("--blocks", default="1,8,32,128")
    t.add_argument("--rounds", type=int, default=5)
    t.add_argument("--dtypes", default="float32,fp8")
    t.add_argument("--transports", default="tcp,shm")
    t.add_argument("--threads", type=int, default=1)
    t.add_argument("--skip-prefill", action="store_true")
    m = sub.add_parser("mixed")
    m.add_argument("--chats", type=int, default=4)
    m.add_argument("--long-every", type=float, default=6.0)
    m.add_argument("--long-tokens", type=int, default=2048)
    m.add_argument("--seconds", type=float, default=60.0)
    m.add_argument("--rounds", type=int, default=2)
    m.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="every replica's step budget (chunked prefill; default: the engine's)")
    m.add_argument("--log-dir", default="/tmp/kvserve-pd-bench")
    args = parser.parse_args()
    transfer(args) if args.cmd == "transfer" else mixed_run(args)


if __name__ == "__main__":
    main()
