"""SimFleet: N simulated replicas in one process and one event loop, behind one HTTP server.

Each replica heartbeats and publishes its block events to Redis with its own real
`PrefixIndexPublisher` (replica id `<prefix>-<i>`, URL `http://host:port/r<i>`), so a real
`kvserve router` finds and routes to them as to engine replicas. One uvicorn server with a path
prefix per replica, not one server per replica: the router cannot tell them apart (it joins URL +
path), one port is simpler to run and to firewall, and it is a little cheaper: idle, 256 uvicorn
servers in one loop took 2.9% of a core against 0.3% for one (their housekeeping ticks; measured
2026-12-04, docs/perf.md); a request costs the same either way.

    python -m kvserve.service.sim.fleet --replicas 64 --redis-url redis://127.0.0.1:6379/0 \\
        --timing h100-llama3-8b --port 9000
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
from typing import Any

from kvserve.service.prefix_index.publisher import PrefixIndexPublisher
from kvserve.service.sim.app import SimFleetApp
from kvserve.service.sim.replica import SimReplica
from kvserve.service.sim.timing import CALIBRATIONS, TimingModel, timing_model


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class SimFleet:
    """Start with `await fleet.start()`; `fleet.replicas[i]` is replica i (its true cache, load
    and counters), `fleet.url(i)` its base URL."""

    def __init__(self, num_replicas: int, timing: TimingModel, *, redis_url: str | None = None,
                 service: str = "default", model: str = "smollm2-135m-instruct",
                 tokenizer: Any = None, host: str = "127.0.0.1", port: int = 0,
                 id_prefix: str = "sim", heartbeat_interval: float = 1.0,
                 max_loras: int = 8, lora_load_s: float = 0.05) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
        self.timing, self.host = timing, host
        self.port = port or free_port(host)
        self.replicas: list[SimReplica] = []
        for i in range(num_replicas):
            rid = f"{id_prefix}-{i:03d}"
            rep = SimReplica(rid, timing, max_loras=max_loras, lora_load_s=lora_load_s)
            if redis_url:
                rep.publisher = PrefixIndexPublisher(
                    redis_url, service, rid, self.url(i), model, timing.block_size,
                    heartbeat_interval, adapters=rep.resident_adapters)
            self.replicas.append(rep)
        self.app = SimFleetApp(self.replicas, model, tokenizer)
        self._server: Any = None
        self._serve: asyncio.Task | None = None

    def url(self, i: int) -> str:
        return f"http://{self.host}:{self.port}/r{i}"

    async def start(self) -> None:
        import uvicorn

        config = uvicorn.Config(self.app, host=self.host, port=self.port, log_level="warning",
                                access_log=False, lifespan="off", backlog=4096)
        self._server = uvicorn.Server(config)
        self._server.install_signal_handlers = lambda: None  # the caller owns the signals
        self._serve = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._serve.done():
                self._serve.result()  # raises the server's start-up error
            await asyncio.sleep(0.02)
        for r in self.replicas:
            if r.publisher is not None:
                await r.publisher.start()
            r.start()

    async def close(self) -> None:
        """Stop serving; each publisher removes its replica from the index."""
        for r in self.replicas:
            await r.close()
        await asyncio.gather(*(r.publisher.close() for r in self.replicas
                               if r.publisher is not None), return_exceptions=True)
        if self._server is not None:
            self._server.should_exit = True
            await asyncio.gather(self._serve, return_exceptions=True)

    def reset(self) -> None:
        """Empty every replica's cache and counters (and its sets in Redis)."""
        for r in self.replicas:
            r.reset()

    def idle(self) -> bool:
        return all(not r.running and not r.waiting for r in self.replicas)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m kvserve.service.sim.fleet",
                                 description="serve N simulated replicas that publish to Redis")
    ap.add_argument("--replicas", type=int, default=16)
    ap.add_argument("--redis-url", required=True)
    ap.add_argument("--service-name", default="default")
    ap.add_argument("--timing", choices=sorted(CALIBRATIONS), default="h100-llama3-8b")
    ap.add_argument("--time-scale", type=float, default=1.0,
                    help="every simulated duration x this (a slower fleet)")
    ap.add_argument("--num-blocks", type=int, default=None, help="KV blocks per replica")
    ap.add_argument("--model", default="smollm2-135m-instruct",
                    help="model announced (the router loads its tokenizer)")
    ap.add_argument("--max-loras", type=int, default=8,
                    help="LoRA adapters each replica keeps resident (LRU)")
    ap.add_argument("--lora-load-seconds", type=float, default=0.05,
                    help="simulated time to load one adapter")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=9000)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    timing = timing_model(args.timing).scaled(args.time_scale, args.num_blocks)

    async def run() -> None:
        fleet = SimFleet(args.replicas, timing, redis_url=args.redis_url,
                         service=args.service_name, model=args.model, host=args.host,
                         port=args.port, max_loras=args.max_loras,
                         lora_load_s=args.lora_load_seconds)
        await fleet.start()
        print(f"{args.replicas} simulated replicas ({timing.name}) at {fleet.url(0)} ... "
              f"{fleet.url(args.replicas - 1)}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await fleet.close()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
