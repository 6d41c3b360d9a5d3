"""Concurrent requests at equal KV memory, with sliding-window layers releasing their blocks
(KV-cache groups) vs one block table for every layer, for real models' layer patterns.

The engine's own KVCacheManager does the counting: requests are prefilled in chunks and decoded
to their full length, admitted until the pool runs out; the KV bytes are the same on both sides
(all-layer blocks without groups, pages of `page_layers` layers with them).

    python bench/sliding_window_kv.py [--kv-gib 16] [--block-size 16] [--chunk 2048]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvserve.engine.core.kv_cache_groups import KVCacheGroups
from kvserve.engine.core.kv_cache_manager import KVCacheManager
from kvserve.engine.core.sequence import Sequence
from kvserve.engine.sample.sampling_params import SamplingParams


@dataclass(frozen=True)
class Pattern:
    name: str
    windows: tuple[int | None, ...]
    kv_heads: int
    head_dim: int


def every_nth_full(layers: int, n: int, window: int) -> tuple[int | None, ...]:
    return tuple(None if (i + 1) % n == 0 else window for i in range(layers))


PATTERNS = [  # from the models' config.json (layer_types / sliding_window)
    Pattern("Gemma 3 27B (5 sliding : 1 full, W 1024)", every_nth_full(62, 6, 1024), 16, 128),
    Pattern("Gemma 3 1B (5 : 1, W 512)", every_nth_full(26, 6, 512), 1, 256),
    Pattern("gpt-oss-120b (alternating, W 128)", every_nth_full(36, 2, 128), 8, 64),
]


def concurrency(groups: KVCacheGroups, num_blocks: int, block_size: int, tokens: int,
                chunk: int) -> int:
    """Requests of `tokens` tokens held at once at their full length."""
    kv = KVCacheManager(num_blocks, block_size, enable_caching=False, groups=groups)
    n = 0
    while True:
        seq = Sequence(n, str(n), 0, [1] * tokens, SamplingParams())
        while seq.num_computed_tokens < tokens:  # prefill in chunks, the last 16 decoded
            left = tokens - seq.num_computed_tokens
            step = 1 if left <= 16 else min(chunk, left - 16)
            if not kv.allocate_slots(seq, step):
                return n
            seq.num_computed_tokens += step
        n += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kv-gib", type=float, default=16.0, help="KV memory (bf16)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=2048, help="prefill chunk (decode: 1 token)")
    ap.add_argument("--contexts", default="4096,16384,32768")
    args = ap.parse_args()
    bs = args.block_size
    print(f"KV memory {args.kv_gib} GiB bf16, block {bs}, prefill chunk {args.chunk}")
    print("| model | context | requests, one table | requests, windowed groups | gain |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for p in PATTERNS:
        layer_block = 2 * p.kv_heads * p.head_dim * 2 * bs  # K and V, bf16
        kv_bytes = int(args.kv_gib * (1 << 30))
        full = KVCacheGroups.single(len(p.windows))
        hybrid = KVCacheGroups.from_windows(p.windows)
        for ctx in (int(c) for c in args.contexts.split(",")):
            base = concurrency(full, kv_bytes // (layer_block * len(p.windows)), bs, ctx,
                               args.chunk)
            ours = concurrency(hybrid, kv_bytes // (layer_block * hybrid.page_layers), bs, ctx,
                               args.chunk)
            print(f"| {p.name} | {ctx} | {base} | {ours} | {ours / max(base, 1):.2f}x |")


if __name__ == "__main__":
    main()
