"""The engine core's transport at N streams: one step message (every request's new token, its
logprobs, metrics, stats and KV events) pickled, sent over a ZMQ IPC socket pair and unpickled,
against the step time it must hide behind. Pure CPU; no model.

    python bench/core_transport.py                 # 16, 64, 256 and 1024 streams
    python bench/core_transport.py --streams 256 --logprobs 5
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import MISSING, fields

import zmq

from kvserve.engine.core.kv_events import KVEvent
from kvserve.engine.engine_core.messages import StepMessage
from kvserve.engine.engine_core.serial import decode, encode
from kvserve.engine.engine_core.deltas import DeltaTracker
from kvserve.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvserve.engine.stats import EngineStats


def step_message(streams: int, logprobs: int | None) -> StepMessage:
    """A decode step of `streams` requests, cut to deltas by the core's own DeltaTracker."""
    now = time.monotonic()
    tracker = DeltaTracker()
    outputs = []
    for i in range(streams):
        lp = None if logprobs is None else [
            {1000 + k: Logprob(-0.5 * k, k + 1) for k in range(logprobs + 1)}] * 20
        outputs.append(RequestOutput(
            f"chatcmpl-{i:032x}-0", None, list(range(250)),
            [CompletionOutput(0, "", list(range(20)), None if lp is None else -3.2, lp)],
            finished=False, num_cached_tokens=224, metrics=RequestMetrics(now, now, now, now)))
    tracker.deltas(outputs, set())  # the first 19 tokens: sent before
    for out in outputs:
        out.outputs[0].token_ids.append(1234)
        if out.outputs[0].logprobs is not None:
            out.outputs[0].logprobs.append(out.outputs[0].logprobs[0])
    deltas = tracker.deltas(outputs, set())
    events = [KVEvent("stored", tuple(f"{j:032x}" for j in range(4)))]
    names = [f.name for f in fields(EngineStats) if f.default is MISSING]
    stats = EngineStats(**{n: streams if n == "num_running" else 0 for n in names})
    return StepMessage([], deltas, {}, stats, events, [1e-5] * 4, [], now)


def measure(streams: int, logprobs: int | None, rounds: int) -> tuple[float, float, int]:
    """(encode + decode ms, zmq send + recv ms, bytes) per step message."""
    msg = step_message(streams, logprobs)
    with tempfile.TemporaryDirectory() as tmp:
        ctx = zmq.Context()
        push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        pull.bind(f"ipc://{tmp}/s")
        push.connect(f"ipc://{tmp}/s")
        data = encode(msg)
        t0 = time.perf_counter()
        for _ in range(rounds):
            decode(encode(msg))
        serial = (time.perf_counter() - t0) / rounds
        t0 = time.perf_counter()
        for _ in range(rounds):
            push.send(data, copy=False)
            pull.recv(copy=False)
        wire = (time.perf_counter() - t0) / rounds
        push.close(0)
        pull.close(0)
        ctx.term()
    return serial * 1e3, wire * 1e3, len(data)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, nargs="+", default=[16, 64, 256, 1024])
    p.add_argument("--logprobs", type=int, default=None, help="top-k logprobs per token")
    p.add_argument("--rounds", type=int, default=200)
    args = p.parse_args()
    print(f"load {os.getloadavg()[0]:.1f}; logprobs {args.logprobs}\n")
    print("| streams | bytes | pickle + unpickle (ms) | zmq ipc send + recv (ms) |")
    print("| ---: | ---: | ---: | ---: |")
    for n in args.streams:
        serial, wire, size = measure(n, args.logprobs, args.rounds)
        print(f"| {n} | {size:,} | {serial:.3f} | {wire:.3f} |")


if __name__ == "__main__":
    main()
