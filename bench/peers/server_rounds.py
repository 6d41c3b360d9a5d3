"""The server half of the vLLM peer bench: `kvserve serve` and vLLM's server up side by side, the
same streaming chat clients (bench/serve.py's) against each in alternating order, round by round.
Each round sends new questions under the shared system prompt, so no round reuses the previous
round's cached prompts on either server."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, TextIO

import httpx
from serve import free_port, percentile, run_async, run_clients, start_server
from peer_spread import order_of_round
from vllm_launch import vllm_serve_cmd
from workload import chat_requests


class Server:
    """A running OpenAI server: its process, chat URL and served model id."""

    def __init__(self, name: str, proc: subprocess.Popen, port: int, group: bool) -> None:
        self.name, self.proc, self.port = name, proc, port
        self.group = group  # started in its own session: signal the whole process group
        self.base = f"http://127.0.0.1:{port}"
        self.model = ""

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    self.model = httpx.get(self.base + "/v1/models").json()["data"][0]["id"]
                    return
            except httpx.TransportError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.name} was not healthy after {timeout:.0f} s")

    def measure(self, convs: list, concurrency: int, max_tokens: int) -> dict[str, Any]:
        timings, seconds = run_async(run_clients(self.base + "/v1/chat/completions", self.model,
                                                 convs, concurrency, max_tokens))
        tokens = sum(t.tokens for t in timings)
        if tokens != len(convs) * max_tokens:
            raise AssertionError(f"{self.name}: {tokens} tokens, not {len(convs) * max_tokens}")
        itls = [x for t in timings for x in t.itls]
        ttfts = [t.ttft for t in timings]
        return {"tok_s": tokens / seconds, "seconds": seconds, "tokens": tokens,
                "ttft_p50": percentile(ttfts, 50), "ttft_p99": percentile(ttfts, 99),
                "itl_p50": percentile(itls, 50), "itl_p99": percentile(itls, 99)}

    def close(self) -> None:
        """SIGTERM (to its process group where it has its own), then SIGKILL."""
        if self.proc.poll() is not None:
            return
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.proc.wait()

    def _signal(self, sig: int) -> None:
        if self.group:
            os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)


def start_servers(args: Any, model_dir: Path, env: dict[str, str], log: TextIO) -> list[Server]:
    """vLLM first (its start-up is the long one), then kvserve, which start_server waits for."""
    port = free_port()
    cmd = vllm_serve_cmd(args.vllm_venv, model_dir, port, args.dtype, args.max_model_len)
    vllm = Server("vllm", subprocess.Popen(cmd, env=env, stdout=log, stderr=log,
                                           start_new_session=True), port, group=True)
    servers = [vllm]
    try:
        port = free_port()
        ns = argparse.Namespace(model=str(model_dir), max_model_len=args.max_model_len,
                                dtype=args.dtype, kv_cache_memory=args.kv_cache_bytes)
        servers.insert(0, Server("kvserve", start_server(ns, port, "process"), port,
                                  group=False))
        for s in servers:
            s.wait_healthy(900)
            s.measure(chat_requests(2, seed=99), 2, args.max_tokens)  # warm-up
    except BaseException:
        close_all(servers)
        raise
    return servers


def close_all(servers: list[Server]) -> None:
    for s in servers:
        s.close()


def server_rounds(args: Any, model_dir: Path, env: dict[str, str],
                  log: TextIO) -> dict[str, list[dict[str, Any]]]:
    """{"kvserve": [round results], "vllm": [...]} at `args.concurrency` clients."""
    servers = {s.name: s for s in start_servers(args, model_dir, env, log)}
    results: dict[str, list[dict[str, Any]]] = {"kvserve": [], "vllm": []}
    try:
        for i in range(args.server_rounds):
            convs = chat_requests(args.requests, seed=1000 + i)  # new questions each round
            for who in order_of_round(i):
                r = servers[who].measure(convs, args.concurrency, args.max_tokens)
                results[who].append(r)
                print(f"  server round {i + 1} {who}: {r['tok_s']:.1f} tok/s, TTFT p50 "
                      f"{r['ttft_p50'] * 1e3:.0f} ms, ITL p50 {r['itl_p50'] * 1e3:.0f} ms",
                      flush=True)
    finally:
        close_all(list(servers.values()))
    return results
