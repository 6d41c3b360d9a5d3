"""CPU benchmark of paged attention: the cpu backend (fused C++ decode) and the torch path vs the
reference vs SDPA on the same lengths
stored contiguously (the peer a non-paged engine would run), for decode and prefill batches.

Shapes are the default model's (9 query heads, 3 KV heads, head_dim 64) with block_size 16 and a
shuffled block pool. Timings are the minimum over repeats, candidates interleaved, so a noisy
shared machine biases all of them alike. Prints milliseconds and ratios.

    python bench/kernels_cpu.py --quick            # a few shapes
    python bench/kernels_cpu.py --dtype bfloat16   # full sweep
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from kvserve.kernels.attention import paged_attention
from kvserve.kernels.write_kv import write_kv
from kvserve.kernels.plan import plan_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
LAYERS = 30  # the plan is built once per step and shared by this many calls


@dataclass
class Case:
    name: str
    seq_lens: list[int]
    query_lens: list[int]


def build(case: Case, dtype: torch.dtype, seed: int = 0):
    """Paged caches holding every sequence (shuffled blocks) and the same K/V contiguously."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // BLOCK) for n in case.seq_lens]
    pool = torch.randperm(sum(need) + 8, generator=gen)
    tables = torch.zeros(len(need), max(need), dtype=torch.int32)
    k_cache = torch.zeros(sum(need) + 8, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    top = max(case.seq_lens)
    k_cont = torch.zeros(len(need), KV_HEADS, top, HEAD_DIM, dtype=dtype)
    v_cont = torch.zeros_like(k_cont)
    used = 0
    for s, n in enumerate(case.seq_lens):
        tables[s, : need[s]] = pool[used: used + need[s]].to(torch.int32)
        used += need[s]
        k = torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        v = torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        slots = tables[s, torch.arange(n) // BLOCK].long() * BLOCK + torch.arange(n) % BLOCK
        write_kv(k, v, k_cache, v_cache, slots)
        k_cont[s, :, :n], v_cont[s, :, :n] = k.transpose(0, 1), v.transpose(0, 1)
    qsl = torch.tensor([0] + case.query_lens).cumsum(0).to(torch.int32)
    q = torch.randn(int(qsl[-1]), HEADS, HEAD_DIM, generator=gen).to(dtype)
    seq_lens = torch.tensor(case.seq_lens, dtype=torch.int32)
    return q, k_cache, v_cache, tables, seq_lens, qsl, k_cont, v_cont


def sdpa_decode(q, k_cont, v_cont, seq_lens):
    """The contiguous peer for decodes: one padded SDPA with a key-length mask when ragged. Each
    KV head's query group is its query rows ([S, kv_heads, group, d]): faster than enable_gqa."""
    mask = None
    if int(seq_lens.min()) != k_cont.shape[2]:
        mask = torch.arange(k_cont.shape[2])[None, None, None, :] < seq_lens[:, None, None, None]
    grouped = q.view(q.shape[0], KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
    return F.scaled_dot_product_attention(grouped, k_cont, v_cont, attn_mask=mask,
                                          scale=HEAD_DIM ** -0.5)


def sdpa_prefill(q, k_cont, v_cont, seq_lens, qsl):
    """The contiguous peer for prefills: SDPA per sequence, causal (shifted by any context)."""
    outs = []
    for s, n in enumerate(seq_lens.tolist()):
        a, b = int(qsl[s]), int(qsl[s + 1])
        mask = torch.ones(b - a, n, dtype=torch.bool).tril(n - (b - a))
        outs.append(F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), k_cont[s, :, :n], v_cont[s, :, :n], attn_mask=mask,
            scale=HEAD_DIM ** -0.5, enable_gqa=True))
    return outs


CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}


def timeit(fns: dict[str, Callable], repeats: int, clock: str) -> dict[str, float]:
    """Minimum milliseconds per candidate, candidates interleaved round-robin.

    clock "cpu" (process CPU time) is the honest one on a shared, oversubscribed machine when
    torch runs one thread; with several threads it also counts OpenMP spin-waits.
    """
    now = CLOCK[clock]
    best = {name: float("inf") for name in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in fns.items():
            start = now()
            fn()
            best[name] = min(best[name], (now() - start) * 1e3)
    return best


def run_case(case: Case, dtype: torch.dtype, repeats: int, with_reference: bool,
             clock: str) -> dict:
    q, k_cache, v_cache, tables, seq_lens, qsl, k_cont, v_cont = build(case, dtype)
    args = (q, k_cache, v_cache, tables, seq_lens, qsl, HEAD_DIM ** -0.5)
    plan = plan_attention(tables, seq_lens, qsl, BLOCK)
    paged_attention(*args, backend="torch", plan=plan)  # builds the torch parts once
    paged_attention(*args, backend="cpu", plan=plan)
    decode = max(case.query_lens) == 1
    fns = {
        "torch": lambda: paged_attention(*args, backend="torch", plan=plan),
        "cpu": lambda: paged_attention(*args, backend="cpu", plan=plan),
        "torch+plan/30": lambda: _planned_step(args, tables, seq_lens, qsl),
        "sdpa": (lambda: sdpa_decode(q, k_cont, v_cont, seq_lens)) if decode
        else (lambda: sdpa_prefill(q, k_cont, v_cont, seq_lens, qsl)),
    }
    times = timeit(fns, repeats, clock)
    times["torch+plan/30"] = times["torch+plan/30"] / LAYERS
    if with_reference:
        times.update(timeit({"reference": lambda: paged_attention(*args, backend="reference")}, 1,
                            clock))
    return times


def _planned_step(args, tables, seq_lens, qsl) -> None:
    """One engine step: plan once, attend in every layer (here all over one layer's cache)."""
    plan = plan_attention(tables, seq_lens, qsl, BLOCK)
    for _ in range(LAYERS):
        paged_attention(*args, backend="torch", plan=plan)


def cases(quick: bool, seqs: int) -> list[Case]:
    gen = torch.Generator().manual_seed(1)
    contexts = [512, 2048] if quick else [512, 1024, 2048, 4096]
    out = []
    for ctx in contexts:
        out.append(Case(f"decode {seqs}x{ctx}", [ctx] * seqs, [1] * seqs))
        ragged = torch.randint(ctx // 2, ctx + 1, (seqs,), generator=gen).tolist()
        out.append(Case(f"decode {seqs}x{ctx // 2}..{ctx}", ragged, [1] * seqs))
    out.append(Case("prefill 4x512", [512] * 4, [512] * 4))
    out.append(Case("prefill 1x2048", [2048], [2048]))
    out.append(Case("chunked 2x(512 new on 1536)", [2048] * 2, [512] * 2))
    if not quick:
        out.append(Case("prefill 16x256", [256] * 16, [256] * 16))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer contexts and repeats")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--seqs", type=int, default=64, help="sequences per decode batch")
    parser.add_argument("--repeats", type=int, default=0, help="0 = 5 (quick) or 10")
    parser.add_argument("--no-reference", action="store_true", help="skip the slow oracle")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--clock", default="cpu", choices=sorted(CLOCK))
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    dtype = getattr(torch, opts.dtype)
    repeats = opts.repeats or (5 if opts.quick else 10)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {opts.dtype}, "
          f"heads {HEADS}/{KV_HEADS}, head_dim {HEAD_DIM}, block {BLOCK}; "
          f"ms of {opts.clock} time, min of {repeats}")
    print(f"{'case':32s} {'cpu':>9s} {'torch':>9s} {'sdpa':>9s} {'cpu/sdpa':>9s} "
          f"{'torch/sdpa':>10s} {'plan+30/30':>10s} {'reference':>10s} {'ref/torch':>9s}")
    for case in cases(opts.quick, opts.seqs):
        t = run_case(case, dtype, repeats, not opts.no_reference, opts.clock)
        ref = t.get("reference", float("nan"))
        print(f"{case.name:32s} {t['cpu']:9.2f} {t['torch']:9.2f} {t['sdpa']:9.2f} "
              f"{t['cpu'] / t['sdpa']:9.2f} {t['torch'] / t['sdpa']:10.2f} "
              f"{t['torch+plan/30']:10.2f} {ref:10.1f} {ref / t['torch']:9.1f}", flush=True)


if __name__ == "__main__":
    main()
