"""The shared chat workload of the engine and server benchmarks: N chat requests whose system
prompt (~200 tokens) is the same, each with its own short question."""

from __future__ import annotations

import random

SYSTEM_PROMPT = (
    "You are kvserve's support assistant. You answer questions about large language model "
    "inference: paged attention, KV caches, continuous batching, prefix caching, quantisation, "
    "speculative decoding, tensor parallelism, Kubernetes deployment, autoscaling on cache "
    "usage, and the trade-offs between latency and throughput. Keep every answer short, precise "
    "and friendly. When a question is ambiguous, state the assumption you make before you answer. "
    "Prefer concrete numbers to vague claims, and cite the mechanism that explains each number. "
    "Never invent benchmark results; say what you would measure instead. Use plain English, no "
    "jargon without a definition, and at most three sentences unless asked for more detail. "
    "If the user greets you, greet them back and ask what they are working on today."
)
TOPICS = ["block tables", "prefix caching", "copy-on-write", "chunked prefill", "preemption",
          "swap space", "FP8 KV cache", "continuous batching", "the scheduler", "eviction",
          "GQA", "RoPE", "the router", "autoscaling", "tensor parallelism", "sampling"]


def chat_requests(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.sample(TOPICS, 2)
        q = (f"Question {i}: how do {a} and {b} interact in a paged KV-cache engine, and what "
             f"would you measure to see the effect of {a} on request latency?")
        out.append([{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}])
    return out


def output_lengths(n: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(n)]
