#!/usr/bin/env bash
# Decode and prefill attention on one CUDA GPU (H100/H200 class), < 5 minutes, installs nothing.
#
#   bench/kernels_gpu.sh            # the sweep: decode batch 64..256 x context 1k..32k, prefill
#   bench/kernels_gpu.sh --smoke    # tiny shapes on the CPU under TRITON_INTERPRET=1: checks the
#                                   # script itself, times nothing meaningful
#
# Decode: kvserve's Triton paged kernel (auto split-KV, and forced to 1 split) against torch SDPA
# (FlashAttention / efficient backends) on the same lengths stored contiguously. Reports achieved
# HBM bandwidth (K+V bytes read / time) as a % of the device's peak (a table by name, override
# with PEAK_GBPS=...; a device-to-device copy is also measured as the practical ceiling).
# Prefill: causal TFLOP/s of the paged kernel vs SDPA is_causal. Shape: Llama-3-8B attention
# (32 query heads, 8 KV heads, head_dim 128), bf16, block_size 16, shuffled block pool.
set -euo pipefail
source "$(dirname "$0")/gpu_prelude.sh" "$@"
exec "$PY" - <<'PYEOF'
import os, sys, time
import torch
import torch.nn.functional as F

try:
    import kvserve  # noqa: F401  (installed, or the repository as package "kvserve")
except ImportError:
    sys.exit("kvserve is not importable: run from the repository with its venv, or pip install -e .")
from kvserve.kernels.attention import paged_attention
from kvserve.kernels.write_kv import write_kv
from kvserve.kernels.plan import plan_attention
from kvserve.kernels.triton_attention import triton_paged_attention

SMOKE = os.environ.get("KV_BENCH_SMOKE") == "1"
DEV = torch.device("cpu" if SMOKE else "cuda")
HEADS, KV_HEADS, HEAD_DIM, BLOCK = (4, 2, 64, 16) if SMOKE else (32, 8, 128, 16)
DTYPE = torch.float32 if SMOKE else torch.bfloat16
PEAKS_GBPS = {"H200": 4800, "H100 SXM": 3350, "H100 80GB HBM3": 3350, "H100 PCIe": 2000,
              "H100 NVL": 3900, "H100": 3350, "A100-SXM4-80GB": 2039, "A100 80GB PCIe": 1935,
              "A100": 1555, "L40S": 864, "L4": 300}
t_start = time.time()


def peak_gbps() -> float:
    if "PEAK_GBPS" in os.environ:
        return float(os.environ["PEAK_GBPS"])
    if SMOKE:
        return 10.0
    name = torch.cuda.get_device_name()
    for key, value in PEAKS_GBPS.items():
        if key in name:
            return float(value)
    return float("nan")


def timed(fn, iters: int) -> float:
    """Median seconds per call (CUDA events; wall clock in smoke mode)."""
    fn()
    if SMOKE:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def copy_gbps() -> float:
    """Device-to-device copy bandwidth (read + write) of 2 GiB: the practical HBM ceiling."""
    n = (1 << 20) if SMOKE else (1 << 30)
    src = torch.empty(n, dtype=torch.float16, device=DEV)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / timed(lambda: dst.copy_(src), 20) / 1e9


def paged_batch(seq_lens: list[int], query_lens: list[int], gen: torch.Generator):
    """Shuffled paged caches with random K/V, plus q and the metadata tensors."""
    need = [-(-n // BLOCK) for n in seq_lens]
    total = sum(need)
    pool = torch.randperm(total, generator=gen).to(torch.int32)
    tables = torch.zeros(len(need), max(need), dtype=torch.int32)
    used = 0
    for s, n in enumerate(need):
        tables[s, :n] = pool[used:used + n]
        used += n
    shape = (total, BLOCK, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=DTYPE, device=DEV)
    v_cache = torch.randn(shape, dtype=DTYPE, device=DEV)
    qsl = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
    q = torch.randn(int(qsl[-1]), HEADS, HEAD_DIM, dtype=DTYPE, device=DEV)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    return q, k_cache, v_cache, tables.to(DEV), seq.to(DEV), qsl.to(DEV)


def contiguous_kv(k_cache, tables, seq_lens):
    """The same keys laid out [batch, kv_heads, len, head_dim] (all lengths equal here)."""
    b, n = tables.shape[0], int(seq_lens[0])
    rows = k_cache[tables.long()].reshape(b, -1, KV_HEADS, HEAD_DIM)[:, :n]
    return rows.transpose(1, 2).contiguous()


def sdpa(q, k, v, causal: bool):
    try:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    except RuntimeError:  # a backend without GQA: repeat K/V
        g = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1),
                                              v.repeat_interleave(g, 1), is_causal=causal)


def decode_row(batch: int, ctx: int, gen, peak: float) -> None:
    q, kc, vc, bt, sl, qsl = paged_batch([ctx] * batch, [1] * batch, gen)
    plan = plan_attention(bt, sl, qsl, BLOCK, 1, ctx)
    scale = HEAD_DIM ** -0.5
    auto = lambda: paged_attention(q, kc, vc, bt, sl, qsl, scale, backend="triton", plan=plan)
    one = lambda: triton_paged_attention(q, kc, vc, plan, scale, num_splits=1)
    k, v = contiguous_kv(kc, bt, sl), contiguous_kv(vc, bt, sl)
    peer = lambda: sdpa(q.unsqueeze(2), k, v, False)
    err = (auto().float() - peer().squeeze(2).float()).abs().max().item()
    iters = 5 if SMOKE else 30
    t_auto, t_one, t_peer = timed(auto, iters), timed(one, iters), timed(peer, iters)
    kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * kc.element_size()
    gbps = kv_bytes / t_auto / 1e9
    splits = plan.parts[("triton", KV_HEADS, HEADS)].num_splits
    print(f"decode {batch:4d} x {ctx:6d}  paged {t_auto * 1e6:9.1f} us ({splits:2d} splits) "
          f"{gbps:7.0f} GB/s {100 * gbps / peak:5.1f}% peak | 1 split {t_one * 1e6:9.1f} us | "
          f"SDPA contiguous {t_peer * 1e6:9.1f} us {kv_bytes / t_peer / 1e9:7.0f} GB/s | "
          f"paged/SDPA {t_auto / t_peer:5.2f} | max err {err:.1e}", flush=True)
    del q, kc, vc, k, v


def prefill_row(batch: int, n: int, gen) -> None:
    q, kc, vc, bt, sl, qsl = paged_batch([n] * batch, [n] * batch, gen)
    plan = plan_attention(bt, sl, qsl, BLOCK, n, n)
    scale = HEAD_DIM ** -0.5
    paged = lambda: paged_attention(q, kc, vc, bt, sl, qsl, scale, backend="triton", plan=plan)
    k, v = contiguous_kv(kc, bt, sl), contiguous_kv(vc, bt, sl)
    qc = q.view(batch, n, HEADS, HEAD_DIM).transpose(1, 2)
    peer = lambda: sdpa(qc, k, v, True)
    err = (paged().float() - peer().transpose(1, 2).reshape(-1, HEADS, HEAD_DIM).float())
    iters = 3 if SMOKE else 10
    t_paged, t_peer = timed(paged, iters), timed(peer, iters)
    flops = 4 * batch * HEADS * HEAD_DIM * n * (n + 1) / 2  # causal: QK^T and PV, half the keys
    print(f"prefill {batch:3d} x {n:6d}  paged {t_paged * 1e3:8.2f} ms "
          f"{flops / t_paged / 1e12:6.1f} TFLOP/s | SDPA causal {t_peer * 1e3:8.2f} ms "
          f"{flops / t_peer / 1e12:6.1f} TFLOP/s | paged/SDPA {t_paged / t_peer:5.2f} | "
          f"max err {err.abs().max().item():.1e}", flush=True)


def fits(batch: int, ctx: int) -> bool:
    """Paged + contiguous copies of K and V must fit in 60% of free memory."""
    if SMOKE:
        return True
    need = 2 * 2 * batch * ctx * KV_HEADS * HEAD_DIM * 2
    return need < 0.6 * torch.cuda.mem_get_info()[0]


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    name = "CPU (smoke)" if SMOKE else torch.cuda.get_device_name()
    peak = peak_gbps()
    print(f"{name}; torch {torch.__version__}; heads {HEADS}/{KV_HEADS} head_dim {HEAD_DIM} "
          f"{DTYPE}; peak {peak:.0f} GB/s (table), device copy {copy_gbps():.0f} GB/s")
    batches, contexts = ([2], [40]) if SMOKE else ([64, 128, 256], [1024, 4096, 16384, 32768])
    for batch in batches:
        for ctx in contexts:
            if fits(batch, ctx):
                decode_row(batch, ctx, gen, peak)
                if not SMOKE:
                    torch.cuda.empty_cache()
            else:
                print(f"decode {batch:4d} x {ctx:6d}  skipped: does not fit", flush=True)
    for batch, n in ([(1, 33)] if SMOKE else [(8, 2048), (2, 8192), (1, 16384)]):
        prefill_row(batch, n, gen)
    print(f"done in {time.time() - t_start:.0f} s")


main()
PYEOF
