"""Does a fresh prefill (no cached prefix) run faster on the CPU through torch's SDPA on the new
K/V (kernels/fresh_prefill.py) than through the CPU backends' paged prefill? Same run, same
batches, candidates interleaved, minimum over repeats; prints milliseconds and the ratio
paged / SDPA per backend (above 1: SDPA is faster).

Shapes: the default model's attention (9 query heads, 3 KV heads, head_dim 64), block_size 16,
shuffled blocks; one layer's call with the step's plan already built (the engine plans once per
step for all 30 layers).

    python bench/fresh_prefill_cpu.py [--dtype float32|bfloat16] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time

import torch

from kvserve.kernels import fresh_prefill
from kvserve.kernels.attention import paged_attention
from kvserve.kernels.backend import cpu_kernel_available
from kvserve.kernels.plan import plan_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
CASES = {"1 x 256": [256], "1 x 1024": [1024], "4 x 512": [512] * 4, "16 x 128": [128] * 16}


def build(lens: list[int], dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // BLOCK) for n in lens]
    pool = torch.randperm(sum(need), generator=gen)
    width = max(need)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    at = 0
    for s, n in enumerate(need):
        tables[s, :n] = pool[at:at + n]
        at += n
    total = sum(lens)
    key = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    value = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    q = torch.randn(total, HEADS, HEAD_DIM, generator=gen).to(dtype)
    k_cache = torch.zeros(sum(need), BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
    qsl[1:] = seq_lens.cumsum(0)
    slots = torch.cat([tables[s, torch.arange(n) // BLOCK].long() * BLOCK + torch.arange(n) % BLOCK
                       for s, n in enumerate(lens)])
    k_cache.view(-1, KV_HEADS, HEAD_DIM)[slots] = key
    v_cache.view(-1, KV_HEADS, HEAD_DIM)[slots] = value
    return q, key, value, k_cache, v_cache, tables, seq_lens, qsl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    backends = ["torch"] + (["cpu"] if cpu_kernel_available() else [])
    routes = fresh_prefill.CPU_BACKENDS
    print(f"dtype {args.dtype}, threads {torch.get_num_threads()}; ms per layer call, "
          "ratio = paged / SDPA (> 1: SDPA faster)")
    print(f"{'batch':>10} " + " ".join(f"{b + ' paged':>12} {b + ' sdpa':>12} {'ratio':>6}"
                                       for b in backends))
    for name, lens in CASES.items():
        q, key, value, kc, vc, bt, sl, qsl = build(lens, dtype)
        best: dict[tuple[str, bool], float] = {}
        for _ in range(args.repeats):
            for backend in backends:
                for sdpa in (False, True):
                    plan = plan_attention(bt, sl, qsl, BLOCK)
                    fresh_prefill.CPU_BACKENDS = {backend: frozenset({dtype})} if sdpa else {}
                    kw = {"key": key, "value": value} if sdpa else {}
                    paged_attention(q, kc, vc, bt, sl, qsl, HEAD_DIM ** -0.5, backend=backend,
                                    plan=plan, **kw)  # warm the plan's parts
                    t0 = time.perf_counter()
                    paged_attention(q, kc, vc, bt, sl, qsl, HEAD_DIM ** -0.5, backend=backend,
                                    plan=plan, **kw)
                    dt = time.perf_counter() - t0
                    best[backend, sdpa] = min(best.get((backend, sdpa), 1e9), dt)
        fresh_prefill.CPU_BACKENDS = routes
        cells = []
        for b in backends:
            paged, sdpa = best[b, False] * 1e3, best[b, True] * 1e3
            cells.append(f"{paged:12.2f} {sdpa:12.2f} {paged / sdpa:6.2f}")
        print(f"{name:>10} " + " ".join(cells))


if __name__ == "__main__":
    main()
